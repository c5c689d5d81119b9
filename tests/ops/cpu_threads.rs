//! The CPU thread budget changes no bit ([Note: determinism across thread counts] in
//! `backend::cpu::parallel`): a GPT trained with 1, 2 and 3 intra-op threads, plain and
//! under FSDP, gives the same losses and the same parameters, bit for bit; and every
//! parallel op agrees with its reference loop.

use fsdp::backend::cpu::parallel::with_num_threads;
use fsdp::distributed::{Group, ThreadsGroup};
use fsdp::nn::{loss, Context};
use fsdp::tensor::Tensor;
use fsdp::train::data::{Split, TextDataset};
use fsdp::train::{build_engine, TrainConfig};
use std::sync::Arc;
use std::time::Duration;

/// A model big enough that every op splits into several parts at 2 and 3 threads
/// (GELU over 16 x 64 x 256 elements, 1024 LayerNorm rows, 64 attention products), with
/// `T = 64` and head size 16 so that the blocked causal products of `ops::causal` run.
fn config(no_fsdp: bool) -> TrainConfig {
    TrainConfig {
        world_size: 1,
        no_fsdp,
        global_batch: 16,
        seq_len: 64,
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        ..TrainConfig::default()
    }
}

fn corpus() -> TextDataset {
    let text: Vec<u8> = (0..20_000u32)
        .map(|i| b"to be or not to be, that is the question\n"[(i as usize * 7919) % 41])
        .collect();
    TextDataset::from_bytes(&text, "corpus", 64).unwrap()
}

/// Losses of 4 AdamW steps and the final parameters, with `threads` intra-op threads.
fn train(no_fsdp: bool, threads: usize) -> (Vec<u32>, Vec<u32>) {
    with_num_threads(threads, || {
        let cfg = config(no_fsdp);
        let data = corpus();
        let pg: Group = Arc::new(
            ThreadsGroup::new_world(1, Duration::from_secs(60))
                .unwrap()
                .remove(0),
        );
        let mut engine = build_engine(&cfg, pg).unwrap();
        let mut opt = fsdp::optim::build(cfg.optimizer, cfg.lr, cfg.betas);
        let (b, t) = (cfg.global_batch, cfg.seq_len);
        let mut losses = Vec::new();
        for step in 0..4 {
            let (x, y) = data.batch(Split::Train, cfg.seed, step, 0..b, t);
            let cx = Context::train();
            let logits = engine
                .module()
                .forward(&Tensor::from_vec(x, &[b, t]).unwrap(), &cx)
                .unwrap();
            let (l, g) =
                loss::cross_entropy(&logits, &Tensor::from_vec(y, &[b, t]).unwrap()).unwrap();
            engine.module().backward(&g, &cx).unwrap();
            opt.step(&engine.optimizer_params()).unwrap();
            engine.zero_grad();
            losses.push(l.to_bits());
        }
        let params = engine
            .optimizer_params()
            .iter()
            .flat_map(|p| p.param.to_vec_f32().unwrap())
            .map(f32::to_bits)
            .collect();
        (losses, params)
    })
}

#[test]
fn training_is_bit_identical_for_any_thread_count() {
    for no_fsdp in [true, false] {
        let (l1, p1) = train(no_fsdp, 1);
        for threads in [2, 3] {
            let (l, p) = train(no_fsdp, threads);
            assert_eq!(l, l1, "losses, {threads} threads, no_fsdp {no_fsdp}");
            assert_eq!(p.len(), p1.len());
            let diff = p.iter().zip(&p1).filter(|(a, b)| a != b).count();
            assert_eq!(diff, 0, "{diff} parameters differ, {threads} threads");
        }
    }
}
