//! CPU tensor buffers come from the pool after the first step: a training step of the GPT,
//! plain and under FSDP at world size 1, allocates no tensor buffer but its inputs once
//! the shapes have been seen (`fsdp::tensor::pool::allocations`). One test in its own binary, so no other
//! test allocates while it counts.

use fsdp::distributed::{Group, ThreadsGroup};
use fsdp::nn::{loss, Context};
use fsdp::tensor::{pool, Tensor};
use fsdp::train::data::{Split, TextDataset};
use fsdp::train::{build_engine, TrainConfig};
use std::sync::Arc;
use std::time::Duration;

/// Tensor buffers allocated by each of 5 steps of `cfg` (AdamW, one rank).
fn allocations_per_step(cfg: &TrainConfig) -> Vec<u64> {
    let text: Vec<u8> = (0..20_000u32)
        .map(|i| b"to be or not to be, that is the question\n"[(i as usize * 7919) % 41])
        .collect();
    let data = TextDataset::from_bytes(&text, "corpus", cfg.seq_len).unwrap();
    let pg: Group = Arc::new(
        ThreadsGroup::new_world(1, Duration::from_secs(60))
            .unwrap()
            .remove(0),
    );
    let mut engine = build_engine(cfg, pg).unwrap();
    let mut opt = fsdp::optim::build(cfg.optimizer, cfg.lr, cfg.betas);
    let (b, t) = (cfg.global_batch, cfg.seq_len);
    let mut out = Vec::new();
    for step in 0..5 {
        let before = pool::allocations();
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
        drop((logits, g));
        out.push(pool::allocations() - before);
    }
    out
}

#[test]
fn steps_after_the_first_allocate_no_tensor_buffer() {
    for no_fsdp in [true, false] {
        let cfg = TrainConfig {
            world_size: 1,
            no_fsdp,
            global_batch: 8,
            ..TrainConfig::default()
        };
        let per_step = allocations_per_step(&cfg);
        eprintln!("no_fsdp {no_fsdp}: tensor buffers allocated per step {per_step:?}");
        assert!(per_step[0] > 0, "the first step allocates its buffers");
        // The two that remain are the step's inputs: the token ids and targets this test
        // hands in as new vectors (`Tensor::from_vec`).
        for (i, &n) in per_step.iter().enumerate().skip(2) {
            assert_eq!(n, 2, "step {i} allocated {n} tensor buffers: {per_step:?}");
        }
    }
}
