//! Memory given back (pytorch#149100 replayed): live heap bytes, counted by a global
//! allocator in this test binary, over build/train/state-dict/drop cycles of a W=2 FSDP
//! model of 4 x Linear(1024, 1024) on thread ranks, over 100 steps of one such model, and
//! after `empty_cache()` once everything is dropped.
//!
//! The allocator counts the whole process, so the tests take one lock and run one at a
//! time.

use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    module_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel, StateDict,
    StateDictConfig,
};
use fsdp::nn::{loss, Context, InitKey, Linear, Module, Sequential};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::tensor::{empty_cache, memory_stats, HostMemoryStats, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

/// Heap bytes allocated and not freed.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is a plain
// atomic and never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time: the counter sees every thread of the process.
static SERIAL: Mutex<()> = Mutex::new(());

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const WIDTH: usize = 1024;
const LAYERS: usize = 4;
const ROWS: usize = 8;
/// One buffer of the largest size: a unit's unsharded flat parameter (or gradient), the
/// 1024 x 1024 weight and 1024 bias in f32, 4 MiB + 4 KiB.
const BLOCK: isize = ((WIDTH * WIDTH + WIDTH) * 4) as isize;
/// Live bytes outside the pool that may move: what the runtime makes once per process or
/// per model and keeps for the process group's life (a communicator subgroup per FSDP root,
/// ~0.5-1 KB a cycle, measured; the first use's statics), not buffers: 64 KiB, against the
/// 4 MiB of one block.
const SLACK: isize = 64 << 10;
/// The bytes of new peaks the pool may keep beyond the first cycle (or step 10): none. Each
/// thread's buckets are bounded by that thread's own peaks, which its program sets in the
/// first step whatever the other rank does, and FSDP reuses its flat gradients itself
/// rather than have the communication thread free them at a moment the schedule picks
/// ([Note: pool bound] in `tensor::pool`). With one bucket per length for both ranks the
/// pool kept 0 to 2 blocks more over 10 cycles, and up to 2 over steps 10 to 100, varying
/// with how the ranks interleaved on the loaded machine.
const NEW_PEAKS: isize = 0;
/// The bound on growth (pytorch#149100 replayed): within one block of the level
/// after the first cycle. The assertions below are tighter: [`NEW_PEAKS`] and [`SLACK`].
const ONE_BLOCK: isize = BLOCK;
const _: () = assert!(SLACK + NEW_PEAKS < ONE_BLOCK);

/// 4 x Linear(1024, 1024) wrapped per layer, as in pytorch#149100.
fn model(pg: Group) -> fsdp::Result<FullyShardedDataParallel> {
    let key = InitKey::new(7);
    let layers = (0..LAYERS)
        .map(|i| {
            Ok(
                Box::new(Linear::new(WIDTH, WIDTH, true, &key.child(&i.to_string()))?)
                    as Box<dyn Module>,
            )
        })
        .collect::<fsdp::Result<Vec<_>>>()?;
    let cfg = FsdpConfig {
        auto_wrap_policy: Some(module_wrap_policy(["Linear"])),
        ..Default::default()
    };
    FullyShardedDataParallel::new(Box::new(Sequential::new(layers)), pg, cfg)
}

/// One step on this rank's rows (inputs and targets made for the step, as a data loader
/// does): the loss.
fn step(
    m: &mut FullyShardedDataParallel,
    opt: &mut AdamW,
    rank: usize,
    i: usize,
) -> fsdp::Result<f32> {
    let x: Vec<f32> = (0..ROWS * WIDTH)
        .map(|j| (((j + 31 * i + 7 * rank) % 97) as f32 - 48.0) / 97.0)
        .collect();
    let y: Vec<f32> = (0..ROWS * WIDTH)
        .map(|j| (((j * 3 + i) % 89) as f32 - 44.0) / 89.0)
        .collect();
    let cx = Context::train();
    let out = m.forward(&Tensor::from_vec(x, &[ROWS, WIDTH])?, &cx)?;
    let (l, g) = loss::mse_loss(&out, &Tensor::from_vec(y, &[ROWS, WIDTH])?)?;
    m.backward(&g, &cx)?;
    opt.step(&m.optimizer_params())?;
    m.zero_grad();
    Ok(l)
}

fn adamw() -> AdamW {
    AdamW::new(AdamConfig {
        lr: 1e-3,
        ..AdamConfig::adamw()
    })
}

fn full() -> StateDictConfig {
    StateDictConfig::Full(FullStateDictConfig::default())
}

/// On one rank: builds the model, trains one step, takes the model's and the optimizer's
/// full state dicts, and drops everything (pytorch#149100's loop body).
fn cycle(pg: &Group) -> fsdp::Result<()> {
    let mut m = model(pg.clone())?;
    let mut opt = adamw();
    let l = step(&mut m, &mut opt, pg.rank(), 0)?;
    assert!(l.is_finite());
    let StateDict::Full(sd) = m.state_dict(full())? else {
        panic!("not a full state dict");
    };
    assert_eq!(sd.tensors.len(), 2 * LAYERS);
    let osd = m.optim_state_dict(&opt, full())?;
    assert_eq!(osd.buffers.len(), 2, "exp_avg, exp_avg_sq");
    Ok(())
}

/// After `cycles` cycles on 2 thread ranks (one process group for all, as the report's
/// loop), the live heap bytes and the pool's figures after each cycle, read by rank 0 while
/// both ranks wait.
fn cycles(cycles: usize) -> Vec<(isize, HostMemoryStats)> {
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut levels = Vec::new();
        for _ in 0..cycles {
            cycle(&pg)?;
            pg.barrier()?;
            if pg.rank() == 0 {
                levels.push((live(), memory_stats()));
            }
            pg.barrier()?;
        }
        Ok(levels)
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

#[test]
fn build_train_drop_cycles_level_off() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let levels = cycles(10);
    let growth: Vec<isize> = levels.iter().map(|(l, _)| l - levels[0].0).collect();
    let pooled: Vec<usize> = levels.iter().map(|(_, s)| s.pooled_bytes).collect();
    let (first, last) = (levels[0].1, levels[9].1);
    eprintln!(
        "live bytes after each cycle {:?}; growth over the first {growth:?}; pooled {pooled:?}; \
         cycles 2-10: {} pool hits, {} misses, {} heap allocations",
        levels.iter().map(|(l, _)| l).collect::<Vec<_>>(),
        last.pool_hits - first.pool_hits,
        last.pool_misses - first.pool_misses,
        last.heap_allocations - first.heap_allocations,
    );
    // Beyond the level after the first cycle, live bytes grow by no buffer: no new peaks,
    // and nothing else beyond SLACK; the old pool grew 84 MB a cycle here, keeping every
    // state dict's tensors.
    for (i, ((l, s), g)) in levels.iter().zip(&growth).enumerate() {
        let new_peaks = (s.pool_miss_bytes - first.pool_miss_bytes) as isize;
        assert!(
            new_peaks <= NEW_PEAKS && g.abs() <= SLACK,
            "after cycle {}: live {l} B, {g} B over the first cycle's level, {new_peaks} B of \
             new peaks (bounds: {NEW_PEAKS} B of new peaks, {SLACK} B in all): {growth:?}",
            i + 1
        );
    }
    // The pool served the same model's buffers again: the later cycles asked the pool for
    // their buffers and found them.
    let (hits, misses) = (
        last.pool_hits - first.pool_hits,
        last.pool_misses - first.pool_misses,
    );
    assert!(hits > 0 && misses == 0, "{hits} hits, {misses} misses");
}

#[test]
fn live_bytes_are_flat_from_step_10_to_100() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let out = launch(&LaunchOptions::new(2), |pg: Group| {
        let mut m = model(pg.clone())?;
        let mut opt = adamw();
        let mut levels = Vec::new();
        for i in 0..=100 {
            step(&mut m, &mut opt, pg.rank(), i)?;
            pg.barrier()?;
            if pg.rank() == 0 && (i == 10 || i == 100) {
                levels.push((live(), memory_stats()));
            }
            pg.barrier()?;
        }
        Ok(levels)
    })
    .unwrap();
    let ((at10, s10), (at100, s100)) = (out[0][0], out[0][1]);
    eprintln!(
        "live bytes at step 10 {at10}, at step 100 {at100}: {} B; pooled {} -> {}; \
         steps 11-100: {} heap allocations, {} pool misses",
        at100 - at10,
        s10.pooled_bytes,
        s100.pooled_bytes,
        s100.heap_allocations - s10.heap_allocations,
        s100.pool_misses - s10.pool_misses,
    );
    // Flat: no new peak (each thread's were set by its first steps, whatever the other
    // rank did) and nothing else accumulates (the old pool grew 17.7 MB here, keeping every
    // step's input vectors).
    let misses = s100.pool_misses - s10.pool_misses;
    let new_peaks = (s100.pool_miss_bytes - s10.pool_miss_bytes) as isize;
    let hits = s100.pool_hits - s10.pool_hits;
    assert!(
        new_peaks <= NEW_PEAKS && (at100 - at10).abs() <= SLACK,
        "live bytes moved {} B from step 10 to step 100, {new_peaks} B of them new peaks \
         ({misses} misses; bounds: {NEW_PEAKS} B of new peaks, {SLACK} B in all)",
        at100 - at10
    );
    // Every buffer of a steady step came from the pool.
    assert!(hits > 0 && misses == 0, "{hits} hits, {misses} misses");
    assert_eq!(s100.active_bytes, s10.active_bytes, "the model's state");
}

#[test]
fn empty_cache_with_everything_dropped_returns_to_the_baseline() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let baseline = live();
    let levels = cycles(2);
    let held = levels[1].0 - baseline;
    // Every model and group dropped: the last one emptied the pool.
    let dropped = memory_stats();
    let after_drop = live();
    empty_cache();
    let after = live();
    let stats = memory_stats();
    eprintln!(
        "baseline {baseline}; held after 2 cycles {held} B; everything dropped {} B over the \
         baseline (pooled {} B); after empty_cache {} B",
        after_drop - baseline,
        dropped.pooled_bytes,
        after - baseline
    );
    assert_eq!(dropped.users, 0);
    assert_eq!(
        dropped.pooled_bytes, 0,
        "the last user's drop empties the pool"
    );
    assert_eq!(
        (stats.active_bytes, stats.pooled_bytes),
        (0, 0),
        "{stats:?}"
    );
    assert!(held > 4 * BLOCK, "the cycles held {held} B");
    assert!(
        after - baseline <= SLACK,
        "{} B above the baseline after empty_cache (bound {SLACK} B)",
        after - baseline
    );
}
