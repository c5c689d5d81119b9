//! What a rank keeps between steps (parameters, gradients waiting for the step, AdamW's
//! moments) is about 1/W of the unsharded model's, measured two ways: fsdp's own
//! accounting (shard bytes and the optimizer's state bytes) and the process heap (a
//! counting global allocator: the bytes that go away when the ranks drop the model and
//! its optimizer). World size 1 is the unsharded baseline; no-shard at 4 ranks shows the
//! heap figure is the model's (it stays at the unsharded size per rank).
//!
//! Its own test binary (the allocator counts the whole process) with one test.

use candle::Module;
use candle_nn::{linear, Linear, VarBuilder};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, ShardingStrategy};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp_candle::{CandleFsdp, Wrap};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

/// Heap bytes allocated and not freed, and the most at once.
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are
// plain atomics and never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(l.size() as isize, Ordering::Relaxed) + l.size() as isize;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(l.size() as isize, Ordering::Relaxed) + l.size() as isize;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let now = LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed)
            + new as isize
            - l.size() as isize;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const WIDTH: usize = 384;
const LAYERS: usize = 4;
const ROWS: usize = 8;

struct Wide(Vec<Linear>);

fn wide(vb: VarBuilder) -> candle::Result<Wide> {
    (0..LAYERS)
        .map(|i| linear(WIDTH, WIDTH, vb.pp(format!("l{i}"))))
        .collect::<candle::Result<_>>()
        .map(Wide)
}

/// One rank's figures: fsdp's (parameter shard, gradient shard, optimizer state bytes),
/// and rank 0's reading of the whole heap with the models held minus without them, and
/// the heap's peak during the measured step over its level before.
#[derive(Debug, Clone, Copy)]
struct Figures {
    fsdp: (usize, usize, usize),
    heap: isize,
    step_peak: isize,
}

fn measure(world: usize, strategy: ShardingStrategy) -> Vec<Figures> {
    let heap = Mutex::new((0isize, 0isize));
    let out = launch(&LaunchOptions::new(world), |pg| {
        let rank = pg.rank();
        let (lo, hi) = (rank * ROWS / world, (rank + 1) * ROWS / world);
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            ..FsdpConfig::default()
        };
        let wrap = Wrap::modules(|p| p.starts_with('l'));
        let mut m = CandleFsdp::new(wide, &wrap, pg.clone(), cfg)?;
        let mut opt = AdamW::new(AdamConfig::adamw());
        let x = candle::Tensor::ones((hi - lo, WIDTH), candle::DType::F32, &candle::Device::Cpu)
            .map_err(|e| fsdp::Error::Data(e.to_string()))?;
        let step = |m: &mut CandleFsdp<Wide>| {
            m.forward_backward(|w| {
                let mut h = x.clone();
                for l in &w.0 {
                    h = l.forward(&h)?.tanh()?;
                }
                h.sqr()?.mean_all()
            })
        };
        for _ in 0..2 {
            step(&mut m)?;
            m.step(&mut opt)?;
        }
        // The measured step: parameters, gradients and optimizer state all held after it.
        pg.barrier()?;
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        pg.barrier()?;
        step(&mut m)?;
        pg.barrier()?;
        let step_peak = PEAK.load(Ordering::Relaxed) - before;
        if rank == 0 {
            heap.lock().unwrap().0 = LIVE.load(Ordering::Relaxed);
        }
        pg.barrier()?;
        let s = m.memory_stats();
        let fsdp = (s.param_shard_bytes, s.grad_shard_bytes, opt.state_bytes());
        drop(m);
        drop(opt);
        pg.barrier()?;
        if rank == 0 {
            heap.lock().unwrap().1 = LIVE.load(Ordering::Relaxed);
        }
        pg.barrier()?;
        Ok((fsdp, step_peak))
    })
    .unwrap();
    let (with, without) = *heap.lock().unwrap();
    out.into_iter()
        .map(|(fsdp, step_peak)| Figures {
            fsdp,
            heap: with - without,
            step_peak,
        })
        .collect()
}

#[test]
fn a_rank_keeps_about_one_over_w_of_the_model_state() {
    // Freed tensor buffers go back to the allocator (not fsdp's CPU pool), so the heap
    // shows what is held.
    fsdp::tensor::pool::set_pool_limit(0);
    let n = LAYERS * (WIDTH * WIDTH + WIDTH);
    // f32 parameters, gradients, AdamW's two moments.
    let unsharded = 4 * n * 4;
    let base = measure(1, ShardingStrategy::FullShard);
    let base_heap = base[0].heap as f64;
    println!("unsharded state {unsharded} B ({n} parameters)");
    for (world, strategy) in [
        (1, ShardingStrategy::FullShard),
        (2, ShardingStrategy::FullShard),
        (4, ShardingStrategy::FullShard),
        (4, ShardingStrategy::ShardGradOp),
        (4, ShardingStrategy::NoShard),
    ] {
        let f = match world {
            1 => base.clone(),
            _ => measure(world, strategy),
        };
        let heap_per_rank = f[0].heap as f64 / world as f64;
        for (r, fig) in f.iter().enumerate() {
            let (p, g, o) = fig.fsdp;
            let total = p + g + o;
            println!(
                "world {world} {strategy:?} rank {r}: fsdp params {p} grads {g} optimizer {o} = {total} B ({:.3} of unsharded); heap held per rank {heap_per_rank:.0} B ({:.3} of world 1's); heap peak of the step (all ranks) {} B",
                total as f64 / unsharded as f64,
                heap_per_rank / base_heap,
                fig.step_peak
            );
            let want = match strategy {
                ShardingStrategy::NoShard => 1.0,
                _ => 1.0 / world as f64,
            };
            // fsdp's accounting: the shards, padding included (a few elements per unit).
            let ratio = total as f64 / unsharded as f64;
            assert!(
                ratio >= want * 0.999 && ratio <= want * 1.01,
                "world {world} {strategy:?} rank {r}: fsdp holds {ratio:.4} of the unsharded state, want {want:.3}"
            );
            // The heap: within 10% of world 1's share (fsdp's metadata, the group).
            let heap_ratio = heap_per_rank / base_heap;
            assert!(
                (heap_ratio - want).abs() <= 0.1 * want,
                "world {world} {strategy:?}: the heap holds {heap_ratio:.3} of world 1's per rank, want {want:.3}"
            );
        }
    }
    // World 1's heap is the unsharded state itself (within 10%).
    assert!(
        (base_heap / unsharded as f64 - 1.0).abs() <= 0.1,
        "world 1 holds {base_heap} B on the heap for {unsharded} B of state"
    );
}
