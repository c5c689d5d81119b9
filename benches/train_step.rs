//! One training step of the default `fsdp train` GPT (4 layers, 128 wide, seq 64, batch 32,
//! AdamW) at world size 1: plain training vs FSDP FullShard (per-block units), side by side
//! in one run. The FSDP overhead at world size 1 is the cost of flattening, gathering (a
//! copy at world size 1), and reducing gradients; target ratio <= 1.10. Then the FSDP step
//! with `--mixed-precision bf16` and `f64` beside it: the CPU costs of the low-precision
//! paths (widening copies, rounding) and of f64 compute against the f32 step.
//!
//! `cargo bench --bench train_step`; `fsdp bench` prints the same comparison plus world
//! sizes 2 and 4 and per-rank memory.

use criterion::{criterion_group, criterion_main, Criterion};
use fsdp::distributed::{Group, ThreadsGroup};
use fsdp::nn::{loss, Context};
use fsdp::optim::Optimizer;
use fsdp::tensor::Tensor;
use fsdp::train::data::{Split, TextDataset};
use fsdp::train::engine::Engine;
use fsdp::train::{build_engine, Precision, TrainConfig};
use std::sync::Arc;
use std::time::Duration;

fn corpus() -> Vec<u8> {
    // The real corpus when present, else a synthetic one of the same size class.
    std::fs::read("data/tinyshakespeare.txt").unwrap_or_else(|_| {
        (0..200_000u32)
            .map(|i| b"the king and queen of rome shall speak\n"[(i as usize * 7919) % 39])
            .collect()
    })
}

fn step(
    cfg: &TrainConfig,
    data: &TextDataset,
    engine: &mut Engine,
    opt: &mut dyn Optimizer,
    step: u64,
) {
    let (b, t) = (cfg.global_batch, cfg.seq_len);
    let (x, y) = data.batch(Split::Train, cfg.seed, step, 0..b, t);
    let cx = Context::train();
    let logits = engine
        .module()
        .forward(&Tensor::from_vec(x, &[b, t]).unwrap(), &cx)
        .unwrap();
    let (_, g) = loss::cross_entropy(&logits, &Tensor::from_vec(y, &[b, t]).unwrap()).unwrap();
    engine.module().backward(&g, &cx).unwrap();
    opt.step(&engine.optimizer_params()).unwrap();
    engine.zero_grad();
}

fn bench_step(c: &mut Criterion) {
    let cfg = TrainConfig {
        world_size: 1,
        ..TrainConfig::default()
    };
    let data = TextDataset::from_bytes(&corpus(), "corpus", cfg.seq_len).unwrap();
    fsdp::backend::cpu::gemm::set_num_threads(
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    );
    let mut group = c.benchmark_group("gpt_step_ws1");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .warm_up_time(Duration::from_secs(2));
    for (name, no_fsdp, mixed_precision) in [
        ("plain", true, Precision::None),
        ("fsdp_full_shard", false, Precision::None),
        ("fsdp_full_shard_bf16", false, Precision::Bf16),
        ("fsdp_full_shard_f64", false, Precision::F64),
    ] {
        let cfg = TrainConfig {
            no_fsdp,
            mixed_precision,
            ..cfg.clone()
        };
        let pg: Group = Arc::new(
            ThreadsGroup::new_world(1, Duration::from_secs(60))
                .unwrap()
                .remove(0),
        );
        let mut engine = build_engine(&cfg, pg).unwrap();
        let mut opt = fsdp::optim::build(cfg.optimizer, cfg.lr, cfg.betas);
        let mut i = 0u64;
        group.bench_function(name, |bch| {
            bch.iter(|| {
                i += 1;
                step(&cfg, &data, &mut engine, opt.as_mut(), i)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_step);
criterion_main!(benches);
