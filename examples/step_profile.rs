//! Where a training step's time goes on the CPU, per rank: wall time, the rank thread's CPU
//! time and run-queue wait (`/proc/thread-self/schedstat`: time runnable but not running,
//! i.e. other jobs on the machine), the process's CPU time, and tensor buffers taken from
//! the heap instead of the pool. `wall - thread cpu - runq wait` is the time a rank slept
//! (waiting for a peer in a collective, or for its intra-op threads).
//!
//! The 8 x 256, seq 128, global batch 64 job of `scripts/compare_torch.sh --config large`:
//!
//! `cargo run --release --example step_profile -- WORLD_SIZE STEPS` (from the repository
//! root: it reads data/tinyshakespeare.txt)
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::nn::{loss, Context};
use fsdp::tensor::{pool, Tensor};
use fsdp::train::data::{Split, TextDataset};
use fsdp::train::{build_engine, TrainConfig};
use std::time::Instant;

fn clock(id: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Seconds the calling thread waited runnable on a run queue (0 where unknown).
fn runq_wait() -> f64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    s.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0.0, |ns| ns * 1e-9)
}

fn main() -> fsdp::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (w, steps) = (
        args.first().copied().unwrap_or(1),
        args.get(1).copied().unwrap_or(5),
    );
    let cfg = TrainConfig {
        world_size: w,
        n_layer: 8,
        n_embd: 256,
        n_head: 8,
        seq_len: 128,
        global_batch: 64,
        ..TrainConfig::default()
    };
    let data = TextDataset::load(&cfg.data, cfg.seq_len)?;
    let rows = cfg.global_batch / w;
    launch(&LaunchOptions::new(w), |pg| {
        let mut engine = build_engine(&cfg, pg.clone())?;
        let mut opt = fsdp::optim::build(cfg.optimizer, cfg.lr, cfg.betas);
        let r0 = pg.rank() * rows;
        for s in 0..steps {
            let (t0, q0, a0) = (Instant::now(), runq_wait(), pool::allocations());
            let (c0, p0) = (
                clock(libc::CLOCK_THREAD_CPUTIME_ID),
                clock(libc::CLOCK_PROCESS_CPUTIME_ID),
            );
            let (x, y) = data.batch(Split::Train, cfg.seed, s as u64, r0..r0 + rows, cfg.seq_len);
            let cx = Context::train();
            let x = Tensor::from_vec(x, &[rows, cfg.seq_len])?;
            let logits = engine.module().forward(&x, &cx)?;
            let y = Tensor::from_vec(y, &[rows, cfg.seq_len])?;
            let (l, g) = loss::cross_entropy(&logits, &y)?;
            drop(logits);
            engine.module().backward(&g, &cx)?;
            opt.step(&engine.optimizer_params())?;
            engine.zero_grad();
            eprintln!(
                "rank {} step {s}: loss {l:.4}, wall {:.3} s, thread cpu {:.3} s, runq wait {:.3} s, \
                 process cpu {:.3} s, heap buffers {}, pooled {} MB",
                pg.rank(),
                t0.elapsed().as_secs_f64(),
                clock(libc::CLOCK_THREAD_CPUTIME_ID) - c0,
                runq_wait() - q0,
                clock(libc::CLOCK_PROCESS_CPUTIME_ID) - p0,
                pool::allocations() - a0,
                pool::pooled_bytes() >> 20
            );
        }
        Ok(())
    })?;
    Ok(())
}
