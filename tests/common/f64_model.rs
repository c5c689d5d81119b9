//! The float64 GPT of the f64 tests (`tests/fsdp/f64_gpt.rs` on the CPU, `tests/serial/f64_device.rs`
//! on CUDA against the CPU): the model, the ranks' batches, the optimizers, and FSDP
//! training of it on thread ranks on any device, recording what the tests compare (the
//! per-step f64 losses, the full parameters after the steps, the first step's gradient).
#![allow(dead_code)]

use fsdp::backend::Device;
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel,
    ShardingStrategy, StateDict, StateDictConfig,
};
use fsdp::nn::{self, Context, GptConfig, Module, GPT};
use fsdp::ops;
use fsdp::optim::{Adam, AdamConfig, AdamW, Optimizer};
use fsdp::tensor::{DType, Tensor};

/// `(name, values)` pairs.
pub type Named = Vec<(String, Vec<f64>)>;

/// 2 blocks of width 8 with 2 heads over 13 tokens: 1,872 parameters (`wpe` rows past `T`
/// get no gradient: `T` is the block size here, so every row does).
pub const CFG: GptConfig = GptConfig {
    vocab_size: 13,
    block_size: 5,
    n_layer: 2,
    n_head: 2,
    n_embd: 8,
};
/// Sequences per rank and step.
pub const B: usize = 2;
/// Optimizer steps of every run.
pub const STEPS: usize = 3;

/// The GPT in f64 (`model.double()`), on the host.
pub fn gpt() -> Box<dyn Module> {
    let mut m = GPT::new(CFG, 11).unwrap();
    nn::module_to_dtype(&mut m, DType::F64).unwrap();
    Box::new(m)
}

/// Rank `r`'s token ids and targets `(B, T)` at step `s`, on the host.
pub fn batch(r: usize, s: usize) -> (Tensor, Tensor) {
    let t = CFG.block_size;
    let v = CFG.vocab_size;
    let ids: Vec<i32> = (0..B * t)
        .map(|i| ((7 * i + 3 * r + 5 * s + 1) % v) as i32)
        .collect();
    let tg: Vec<i32> = (0..B * t)
        .map(|i| ((5 * i + 2 * r + 3 * s + 4) % v) as i32)
        .collect();
    (
        Tensor::from_vec(ids, &[B, t]).unwrap(),
        Tensor::from_vec(tg, &[B, t]).unwrap(),
    )
}

/// Adam (the main job's optimizer), or AdamW with its weight decay.
pub fn optimizer(decoupled: bool) -> Box<dyn Optimizer> {
    let c = AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adam()
    };
    if decoupled {
        Box::new(AdamW::new(AdamConfig {
            weight_decay: 0.1,
            ..c
        }))
    } else {
        Box::new(Adam::new(c))
    }
}

/// The largest `|got - want|`, asserted to be at most `tol`.
pub fn max_err(what: &str, got: &[f64], want: &[f64], tol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}");
    let e = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(e <= tol, "{what}: max error {e:e} > {tol:e}");
    e
}

/// The parameters of `m`, by name.
pub fn params(m: &mut dyn Module) -> Named {
    let mut out = Vec::new();
    nn::visit_parameters(m, "", false, &mut |n, p| {
        out.push((n.to_string(), p.data()?.to_vec_f64()?));
        Ok(())
    })
    .unwrap();
    out
}

/// A rank's pieces of a gradient: `(name, flat range, values)`.
pub type GradPieces = Vec<(String, Option<(usize, usize)>, Vec<f64>)>;

/// What one rank of [`fsdp_train`] saw.
pub struct RankRun {
    /// The rank's f64 mean loss at each step (`ops::cross_entropy_f64`).
    pub losses: Vec<f64>,
    /// The full parameters after the steps.
    pub params: Named,
    /// The rank's pieces of the first step's averaged gradient `(name, flat range,
    /// values)`.
    pub grads: GradPieces,
}

/// How [`fsdp_train`] wraps and trains.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// Thread ranks.
    pub world: usize,
    /// The sharding strategy.
    pub strategy: ShardingStrategy,
    /// One unit per block (`transformer_auto_wrap_policy`) instead of one flat unit.
    pub nested: bool,
    /// AdamW instead of Adam.
    pub decoupled: bool,
    /// `Some(n)`: rank `r` computes on `cuda:(r % n)`; `None`: the CPU.
    pub gpus: Option<usize>,
}

/// FSDP training of [`gpt`] for [`STEPS`] steps: every rank's [`RankRun`].
pub fn fsdp_train(run: Run) -> Vec<RankRun> {
    let Run {
        world,
        strategy,
        nested,
        decoupled,
        gpus,
    } = run;
    launch(&LaunchOptions::new(world), move |pg| {
        let r = pg.rank();
        let dev = gpus.map_or(Device::Cpu, |n| Device::Cuda(r % n));
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            ranks_per_node: strategy.is_hybrid().then_some(2),
            auto_wrap_policy: nested.then(|| transformer_auto_wrap_policy(["Block"])),
            device_id: Some(dev),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(gpt(), pg, cfg)?;
        assert_eq!(m.flat_param().dtype(), DType::F64);
        let mut opt = optimizer(decoupled);
        let (mut grads, mut losses) = (Vec::new(), Vec::new());
        for s in 0..STEPS {
            let (ids, tg) = batch(r, s);
            let (ids, tg) = (ids.to_device(dev)?, tg.to_device(dev)?);
            let logits = m.forward(&ids, &Context::train())?;
            assert_eq!((logits.dtype(), logits.device()), (DType::F64, dev));
            let (loss, dl) = ops::cross_entropy_f64(&logits, &tg)?;
            losses.push(loss);
            m.backward(&dl, &Context::train())?;
            if s == 0 {
                grads = grad_pieces(&mut m)?;
            }
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        Ok(RankRun {
            losses,
            params: full_params(&mut m)?,
            grads,
        })
    })
    .unwrap()
}

/// This rank's pieces of each parameter's averaged gradient (after a backward), by the
/// unit's state-dict ranges; an empty piece where the rank holds none of a parameter.
pub fn grad_pieces(m: &mut FullyShardedDataParallel) -> fsdp::Result<GradPieces> {
    let ps = m.optimizer_params();
    let names = m.optimizer_param_names();
    let mut out = Vec::new();
    for range in m.state_dict_ranges() {
        let g = match names.iter().position(|(n, _)| *n == range.name) {
            Some(i) => ps[i].grad.as_ref().unwrap().to_vec_f64()?,
            None => Vec::new(),
        };
        out.push((range.name, range.range, g));
    }
    Ok(out)
}

/// The full parameters from the full state dict, each asserted f64.
pub fn full_params(m: &mut FullyShardedDataParallel) -> fsdp::Result<Named> {
    let StateDict::Full(f) = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?
    else {
        unreachable!()
    };
    Ok(f.tensors
        .iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), DType::F64, "{n}");
            (n.clone(), t.to_vec_f64().unwrap())
        })
        .collect())
}
