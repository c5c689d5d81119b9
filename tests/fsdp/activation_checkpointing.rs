//! Activation checkpointing (`CheckpointWrapper`, `apply_activation_checkpointing`): the
//! same gradients and parameters bit for bit as without it, unwrapped and under FSDP
//! (FullShard, ShardGradOp, NoShard at world sizes 1, 2, 4; HybridShard; bf16), random
//! draws and BatchNorm statistics replayed by the recompute, fewer saved activation bytes
//! with the recompute's peak counted, and the modules it cannot work on refused.

use crate::common;

use common::{gpt_step, small_gpt, small_job};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy,
};
use fsdp::nn::{
    apply_activation_checkpointing, loss, no_children, no_params, parameter_shapes,
    saved_activation_bytes, saved_activation_peak, state_dict, track_saved_activations,
    visit_parameters, BatchNorm1d, Block, BufferVisitor, CheckpointPolicy, CheckpointWrapper,
    ChildVisitor, Context, InitKey, Linear, Module, ModuleBuffer, ModuleList, ParamVisitor,
    Sequential, GELU,
};
use fsdp::optim::{AdamConfig, AdamW, Optimizer};
use fsdp::tensor::DType;
use fsdp::tensor::Tensor;
use fsdp::{Error, Result};

const STEPS: usize = 3;

fn adamw() -> AdamW {
    AdamW::new(AdamConfig {
        lr: 1e-2,
        ..AdamConfig::adamw()
    })
}

fn blocks() -> CheckpointPolicy {
    CheckpointPolicy::types(["Block"])
}

/// Every parameter's gradient, then every parameter, as bits, in `named_parameters()` order.
/// `(name, bits)` per parameter.
type Named = Vec<(String, Vec<u32>)>;

fn grads_and_params(m: &mut dyn Module) -> (Named, Named) {
    let (mut g, mut p) = (Vec::new(), Vec::new());
    visit_parameters(m, "", false, &mut |n, q| {
        g.push((
            n.to_string(),
            q.grad().map(common::f32_bits).unwrap_or_default(),
        ));
        p.push((n.to_string(), common::f32_bits(q.data()?)));
        Ok(())
    })
    .unwrap();
    (g, p)
}

/// Per step of a plain (unwrapped) GPT of 3 blocks, AdamW: gradients and parameters after
/// the step, and the saved-activation bytes (end of forward, peak over the step).
type PlainRun = Vec<(Named, Named, usize, usize)>;

fn plain_run(checkpoint: bool) -> PlainRun {
    let mut m = small_gpt(3);
    if checkpoint {
        assert_eq!(
            apply_activation_checkpointing(m.as_mut(), &blocks()).unwrap(),
            3
        );
    }
    let mut opt = adamw();
    let mut out = Vec::new();
    for step in 0..STEPS {
        fsdp::nn::zero_grad(m.as_mut());
        // gpt_step's forward and backward, with the account started between them.
        let mut fwd_bytes = 0;
        let mut tracked = TrackAfterForward {
            inner: m,
            bytes: &mut fwd_bytes,
        };
        gpt_step(&mut tracked, step, 0, 12).unwrap();
        m = tracked.inner;
        let peak = saved_activation_peak();
        let (g, _) = grads_and_params(m.as_mut());
        opt.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        let (_, p) = grads_and_params(m.as_mut());
        out.push((g, p, fwd_bytes, peak));
    }
    out
}

/// Forwards to its module and starts the saved-activation account after a training
/// forward, as FSDP's root does.
struct TrackAfterForward<'a> {
    inner: Box<dyn Module>,
    bytes: &'a mut usize,
}

impl Module for TrackAfterForward<'_> {
    fn type_name(&self) -> &str {
        "TrackAfterForward"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let y = self.inner.forward(x, cx)?;
        *self.bytes = track_saved_activations(self.inner.as_mut())?;
        Ok(y)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        self.inner.backward(dy, cx)
    }
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        no_params(f)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("", &mut self.inner)
    }
}

#[test]
fn unwrapped_gpt_gradients_and_parameters_are_bit_for_bit_those_without_checkpointing() {
    let base = plain_run(false);
    let ck = plain_run(true);
    for (step, (b, c)) in base.iter().zip(&ck).enumerate() {
        assert_eq!(b.0.len(), c.0.len());
        for ((name, gb), (name2, gc)) in b.0.iter().zip(&c.0) {
            assert_eq!(name, name2, "names changed by the wrapper");
            assert!(!gb.is_empty(), "step {step}: {name} has no gradient");
            assert_eq!(gb, gc, "step {step}: gradient of {name} differs");
        }
        assert_eq!(b.1, c.1, "step {step}: parameters differ");
        // Without checkpointing the saves peak at the end of the forward.
        assert_eq!(b.2, b.3, "step {step}");
        // With it the forward keeps only the blocks' inputs, and the recompute peak is
        // counted: above the end-of-forward figure, below the plain run's.
        assert!(
            c.2 < c.3,
            "step {step}: recompute peak not counted: {c:?}",
            c = (c.2, c.3)
        );
        assert!(
            c.3 < b.3,
            "step {step}: checkpointed peak {} >= plain {}",
            c.3,
            b.3
        );
    }
}

#[test]
fn the_recompute_peak_is_the_inputs_still_held_plus_one_blocks_saves() {
    // 12 rows x 6 tokens x width 12, f32: one block's input.
    let x_bytes = 12 * 6 * 12 * 4;
    let ids_bytes = 12 * 6 * 4;
    let x = Tensor::from_vec(common::values(9, 12 * 6 * 12), &[12, 6, 12]).unwrap();
    // One block alone: R, what its forward saves; R' = R with its input, what its
    // recompute holds (a lone wrapper's peak).
    let mut plain = Block::new(12, 3, &InitKey::new(5)).unwrap();
    plain.forward(&x, &Context::train()).unwrap();
    let r = saved_activation_bytes(&mut plain).unwrap();
    let mut lone =
        CheckpointWrapper::new(Box::new(Block::new(12, 3, &InitKey::new(5)).unwrap())).unwrap();
    let y = lone.forward(&x, &Context::train()).unwrap();
    assert_eq!(track_saved_activations(&mut lone).unwrap(), x_bytes);
    lone.backward(&y, &Context::train()).unwrap();
    let r_with_input = saved_activation_peak();
    assert!(
        r <= r_with_input && r_with_input <= r + x_bytes,
        "{r} {r_with_input}"
    );
    // The whole GPT (3 blocks): the end of the forward holds the ids and the three blocks'
    // inputs (the head's saves are gone by the first recompute); the last block's
    // recompute holds the ids, the first two blocks' inputs and R'.
    let run = plain_run(true);
    let (fwd, peak) = (run[0].2, run[0].3);
    assert!(fwd >= ids_bytes + 3 * x_bytes, "{fwd}");
    assert_eq!(peak, ids_bytes + 2 * x_bytes + r_with_input);
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ckpt {
    Off,
    /// `apply_activation_checkpointing` after `FullyShardedDataParallel::new`.
    After,
    /// Before it: FSDP puts each unit around the wrapper.
    Before,
}

/// Per step, rank by rank: the local gradient shards after backward, then (rank 0) the
/// full parameters after the optimizer step, as bits; and the rank's activation bytes.
type FsdpRun = Vec<(Vec<Vec<u32>>, Named, usize)>;

/// What the FSDP runs vary besides checkpointing: the strategy, and bf16 mixed precision.
#[derive(Clone, Copy, Debug)]
struct Setup {
    strategy: ShardingStrategy,
    bf16: bool,
}

fn fsdp_run(w: usize, setup: Setup, ckpt: Ckpt) -> Vec<FsdpRun> {
    let Setup { strategy, bf16 } = setup;
    launch(&LaunchOptions::new(w), |pg| {
        let rank = pg.rank();
        let mut model = small_gpt(3);
        if ckpt == Ckpt::Before {
            apply_activation_checkpointing(model.as_mut(), &blocks())?;
        }
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            // Hybrid: 2 "nodes" at world size 4.
            ranks_per_node: strategy
                .is_hybrid()
                .then(|| common::hybrid_ranks_per_node(w)),
            mixed_precision: bf16.then(|| MixedPrecision::uniform(DType::BF16)),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(model, pg, cfg)?;
        if ckpt == Ckpt::After {
            assert_eq!(apply_activation_checkpointing(&mut m, &blocks())?, 3);
        }
        if ckpt != Ckpt::Off {
            // Either way each block's unit holds the wrapper, which holds the block.
            let inner = m.with_unit("blocks.1", |u| u.module_mut().type_name().to_string())?;
            assert_eq!(inner, "CheckpointWrapper");
        }
        let mut opt = adamw();
        let mut out = Vec::new();
        for step in 0..STEPS {
            let (lo, hi) = (rank * 12 / w, (rank + 1) * 12 / w);
            m.reset_peak_memory_stats();
            gpt_step(&mut m, step, lo, hi)?;
            let act = m.memory_stats().activation_bytes;
            let grads = m
                .optimizer_params()
                .iter()
                .map(|p| p.grad.as_ref().map(common::f32_bits).unwrap_or_default())
                .collect();
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
            let params = m
                .full_parameters()?
                .into_iter()
                .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
                .collect();
            out.push((grads, params, act));
        }
        Ok(out)
    })
    .unwrap()
}

#[test]
fn under_fsdp_gradients_and_parameters_are_bit_for_bit_those_without_checkpointing() {
    let mut runs = Vec::new();
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        for w in [1, 2, 4] {
            runs.push((
                w,
                Setup {
                    strategy,
                    bf16: false,
                },
            ));
        }
    }
    // Hybrid sharding (2 x 2) and bf16 compute (the recompute in bf16 too).
    runs.push((
        4,
        Setup {
            strategy: ShardingStrategy::HybridShard,
            bf16: false,
        },
    ));
    runs.push((
        2,
        Setup {
            strategy: ShardingStrategy::FullShard,
            bf16: true,
        },
    ));
    runs.push((
        4,
        Setup {
            strategy: ShardingStrategy::ShardGradOp,
            bf16: true,
        },
    ));
    for (w, setup) in runs {
        let base = fsdp_run(w, setup, Ckpt::Off);
        for ckpt in [Ckpt::After, Ckpt::Before] {
            let got = fsdp_run(w, setup, ckpt);
            let at = format!("{setup:?} W={w} {ckpt:?}");
            for (rank, (b, g)) in base.iter().zip(&got).enumerate() {
                for step in 0..STEPS {
                    assert!(b[step].0.iter().any(|g| !g.is_empty()), "{at}: no grads");
                    assert_eq!(b[step].0, g[step].0, "{at} rank {rank} step {step}: grads");
                    assert_eq!(b[step].1, g[step].1, "{at} rank {rank} step {step}: params");
                    assert!(
                        2 * g[step].2 < b[step].2,
                        "{at} rank {rank}: activation bytes {} not under half of {}",
                        g[step].2,
                        b[step].2
                    );
                }
            }
        }
    }
}

#[test]
fn fsdp_activation_bytes_count_the_recompute_peak() {
    // One rank, FullShard: the root's figure after the forward, then after the backward.
    let got = launch(&LaunchOptions::new(1), |pg| {
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(small_gpt(3), pg, cfg)?;
        apply_activation_checkpointing(&mut m, &blocks())?;
        let ids = Tensor::from_vec(vec![1i32; 12 * 6], &[12, 6])?;
        let logits = m.forward(&ids, &Context::train())?;
        let after_forward = m.memory_stats().activation_bytes;
        let (_, g) = loss::sum_loss(&logits)?;
        m.backward(&g, &Context::train())?;
        Ok((
            after_forward,
            m.memory_stats().activation_bytes,
            saved_activation_peak(),
        ))
    })
    .unwrap();
    let (fwd, after_bwd, peak) = got[0];
    assert!(fwd < after_bwd, "{fwd} {after_bwd}");
    assert_eq!(after_bwd, peak);
}

/// Dropout with its generator state in a buffer: `y = x * mask / (1 - p)`, the mask drawn
/// from a hash of (the buffer's counter, element index); each training forward advances
/// the counter. Saves the mask.
struct Dropout {
    p: f32,
    counter: ModuleBuffer,
    mask: Option<Tensor>,
}

impl Dropout {
    fn new(p: f32) -> Self {
        Dropout {
            p,
            counter: ModuleBuffer::non_persistent(Tensor::from_vec(vec![0i64], &[]).unwrap()),
            mask: None,
        }
    }
}

fn uniform(counter: i64, i: usize) -> f32 {
    let mut z = (counter as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
}

impl Module for Dropout {
    fn type_name(&self) -> &str {
        "Dropout"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        if !cx.training {
            return Ok(x.clone());
        }
        let c = self.counter.data.data::<i64>()?[0];
        self.counter.data.data_mut::<i64>()?[0] = c + 1;
        let scale = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..x.numel())
            .map(|i| if uniform(c, i) < self.p { 0.0 } else { scale })
            .collect();
        let y: Vec<f32> = x
            .to_vec_f32()?
            .iter()
            .zip(&mask)
            .map(|(a, m)| a * m)
            .collect();
        if cx.grad_enabled {
            self.mask = Some(Tensor::from_vec(mask, x.shape())?);
        }
        Tensor::from_vec(y, x.shape())
    }
    fn backward(&mut self, dy: &Tensor, _: &Context) -> Result<Tensor> {
        let mask = self
            .mask
            .take()
            .ok_or(Error::NoSavedForward { module: "Dropout" })?;
        let dx: Vec<f32> = dy
            .to_vec_f32()?
            .iter()
            .zip(mask.to_vec_f32()?)
            .map(|(a, m)| a * m)
            .collect();
        Tensor::from_vec(dx, dy.shape())
    }
    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        out.extend(self.mask.clone());
    }
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        no_params(f)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        no_children(f)
    }
    fn for_each_buffer(&mut self, f: &mut BufferVisitor<'_>) -> Result<()> {
        f("rng_counter", &mut self.counter)
    }
}

/// `Linear(6, 8) -> Dropout(0.3) -> BatchNorm1d(8) -> GELU -> Linear(8, 3)`, the middle
/// as one `"Layer"` (the module checkpointed), then a head.
fn rng_model() -> Box<dyn Module> {
    let k = InitKey::new(11);
    let layer = Sequential::named(vec![
        (
            "fc",
            Box::new(Linear::new(6, 8, true, &k.child("fc")).unwrap()) as Box<dyn Module>,
        ),
        ("drop", Box::new(Dropout::new(0.3))),
        ("bn", Box::new(BatchNorm1d::new(8).unwrap())),
        ("act", Box::new(GELU::new())),
    ])
    .unwrap()
    .with_type_name("Layer");
    Box::new(
        Sequential::named(vec![
            ("layer", Box::new(layer) as Box<dyn Module>),
            (
                "head",
                Box::new(Linear::new(8, 3, true, &k.child("head")).unwrap()),
            ),
        ])
        .unwrap(),
    )
}

/// Per step: gradients, parameters, buffers (running stats, the dropout counter) as bits,
/// and the dropout mask's zeros.
fn rng_run(checkpoint: bool) -> Vec<(Named, Named, Vec<String>)> {
    let mut m = rng_model();
    if checkpoint {
        let n = apply_activation_checkpointing(m.as_mut(), &CheckpointPolicy::types(["Layer"]))
            .unwrap();
        assert_eq!(n, 1);
    }
    let mut opt = adamw();
    let mut out = Vec::new();
    for step in 0..STEPS {
        fsdp::nn::zero_grad(m.as_mut());
        let x = Tensor::from_vec(common::values(30 + step as u64, 10 * 6), &[10, 6]).unwrap();
        let y = m.forward(&x, &Context::train()).unwrap();
        let (_, g) =
            loss::mse_loss(&y, &Tensor::from_vec(vec![0.5f32; 30], &[10, 3]).unwrap()).unwrap();
        m.backward(&g, &Context::train()).unwrap();
        let (grads, _) = grads_and_params(m.as_mut());
        opt.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        let (_, params) = grads_and_params(m.as_mut());
        let buffers = fsdp::nn::named_buffers(m.as_mut(), false)
            .unwrap()
            .into_iter()
            .map(|(n, t)| match t.dtype() {
                fsdp::tensor::DType::I64 => format!("{n}={:?}", t.data::<i64>().unwrap().to_vec()),
                _ => format!("{n}={:?}", common::f32_bits(&t)),
            })
            .collect();
        out.push((grads, params, buffers));
    }
    out
}

#[test]
fn random_draws_and_batchnorm_statistics_are_replayed_by_the_recompute() {
    let base = rng_run(false);
    let ck = rng_run(true);
    // The draws are real: the counter advanced once per forward, and the fc weight
    // gradient has rows zeroed by the mask in some steps and not in others (the mask
    // differs from step to step).
    let counter = |s: usize| {
        base[s]
            .2
            .iter()
            .find(|b| b.contains("rng_counter"))
            .cloned()
            .unwrap()
    };
    assert_eq!(counter(0), "layer.drop.rng_counter=[1]");
    assert_eq!(counter(2), "layer.drop.rng_counter=[3]");
    assert!(base[0]
        .2
        .iter()
        .any(|b| b.starts_with("layer.bn.running_mean")));
    for step in 0..STEPS {
        assert_eq!(base[step].0, ck[step].0, "step {step}: gradients");
        assert_eq!(base[step].1, ck[step].1, "step {step}: parameters");
        // BatchNorm updated its stats once per forward, not again in the recompute; the
        // counter advanced once.
        assert_eq!(base[step].2, ck[step].2, "step {step}: buffers");
    }
}

#[test]
fn names_and_state_dict_keys_are_unchanged_by_the_wrapper() {
    let mut plain = small_gpt(2);
    let mut ck = small_gpt(2);
    apply_activation_checkpointing(ck.as_mut(), &blocks()).unwrap();
    assert_eq!(
        parameter_shapes(plain.as_mut()),
        parameter_shapes(ck.as_mut())
    );
    let keys = |m: &mut dyn Module| {
        state_dict(m)
            .unwrap()
            .keys()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(plain.as_mut()), keys(ck.as_mut()));
    fsdp::nn::check_names(ck.as_mut()).unwrap();
    // A second call finds every block already checkpointed.
    assert_eq!(
        apply_activation_checkpointing(ck.as_mut(), &blocks()).unwrap(),
        0
    );
    // Evaluation (no grad) through the wrapper saves nothing and gives the plain output.
    let ids = Tensor::from_vec(vec![3i32; 2 * 6], &[2, 6]).unwrap();
    let a = plain.forward(&ids, &Context::eval()).unwrap();
    let b = ck.forward(&ids, &Context::eval()).unwrap();
    assert_eq!(common::f32_bits(&a), common::f32_bits(&b));
    assert_eq!(saved_activation_bytes(ck.as_mut()).unwrap(), 0);
}

fn err_text<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn modules_where_checkpointing_cannot_work_are_refused() {
    // A holder without a forward.
    let list = ModuleList::new(vec![Box::new(
        Linear::new(2, 2, false, &InitKey::new(1)).unwrap(),
    )]);
    let e = err_text(CheckpointWrapper::new(Box::new(list)));
    assert!(e.contains("no forward of its own"), "{e}");
    let mut m = Sequential::named(vec![(
        "h",
        Box::new(ModuleList::new(vec![Box::new(GELU::new())])) as Box<dyn Module>,
    )])
    .unwrap();
    let e = err_text(apply_activation_checkpointing(
        &mut m,
        &CheckpointPolicy::types(["ModuleList"]),
    ));
    assert!(
        e.contains("'h' (ModuleList)") && e.contains("no forward"),
        "{e}"
    );

    // Backward without a training forward.
    let mut w = CheckpointWrapper::new(Box::new(GELU::new())).unwrap();
    let x = Tensor::from_vec(vec![1.0f32; 4], &[4]).unwrap();
    w.forward(&x, &Context::eval()).unwrap();
    assert!(matches!(
        w.backward(&x, &Context::train()),
        Err(Error::NoSavedForward {
            module: "CheckpointWrapper"
        })
    ));

    // State the recompute cannot replay: a buffer that changed shape after the forward.
    let mut w = CheckpointWrapper::new(Box::new(Dropout::new(0.5))).unwrap();
    w.forward(&x, &Context::train()).unwrap();
    fsdp::nn::visit_buffers(&mut w, "", false, &mut |_, b| {
        b.data = Tensor::from_vec(vec![0i64; 2], &[2])?;
        Ok(())
    })
    .unwrap();
    let e = err_text(w.backward(&x, &Context::train()));
    assert!(
        e.contains("buffers changed between its forward and its backward")
            && e.contains("'rng_counter'"),
        "{e}"
    );

    let errs = launch(&LaunchOptions::new(2), |pg| {
        let cfg = || FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            ..FsdpConfig::default()
        };
        let mut out = Vec::new();
        // A wrapper around an FSDP unit, by hand.
        let unit = FullyShardedDataParallel::new(small_gpt(1), pg.clone(), FsdpConfig::default())?;
        out.push(err_text(CheckpointWrapper::new(Box::new(unit))));
        // A policy that picks the units themselves.
        let mut m = FullyShardedDataParallel::new(small_gpt(2), pg.clone(), cfg())?;
        let all = CheckpointPolicy::predicate(|_, _| true);
        out.push(err_text(apply_activation_checkpointing(&mut m, &all)));
        // A wrapper around two blocks that FSDP then wraps one by one.
        let k = InitKey::new(2);
        let two = Sequential::new(vec![
            Box::new(Block::new(6, 2, &k.child("0"))?) as Box<dyn Module>,
            Box::new(Block::new(6, 2, &k.child("1"))?),
        ]);
        let outer = Sequential::named(vec![(
            "pair",
            Box::new(CheckpointWrapper::new(Box::new(two))?) as Box<dyn Module>,
        )])?;
        out.push(err_text(FullyShardedDataParallel::new(
            Box::new(outer),
            pg,
            cfg(),
        )));
        Ok(out)
    })
    .unwrap();
    let e = &errs[0];
    assert!(
        e[0].contains("it is an FSDP unit") && e[0].contains("forward hooks"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("'blocks.0'") && e[1].contains("FullyShardedDataParallel"),
        "{}",
        e[1]
    );
    assert!(
        e[2].contains("activation checkpointing of 'pair' would enclose FSDP unit 'pair.0'"),
        "{}",
        e[2]
    );
}

#[test]
fn the_train_job_with_activation_checkpointing_has_the_same_losses_and_fewer_activation_bytes() {
    let data = common::corpus_file("actckpt");
    // Four blocks, as the main job: the checkpointed peak is one block's saves and the
    // blocks' inputs (two blocks would hold just over half).
    let cfg = fsdp::train::TrainConfig {
        steps: 4,
        n_layer: 4,
        ..small_job(data, 2)
    };
    let run = |activation_checkpointing| {
        fsdp::train::train(
            &fsdp::train::TrainConfig {
                activation_checkpointing,
                ..cfg.clone()
            },
            &fsdp::train::Silent,
        )
        .unwrap()
    };
    let (base, ck) = (run(false), run(true));
    let loss_bits =
        |r: &fsdp::train::TrainReport| r.losses().iter().map(|l| l.to_bits()).collect::<Vec<_>>();
    assert_eq!(loss_bits(&base), loss_bits(&ck));
    for (b, c) in base.records.iter().zip(&ck.records) {
        for (rb, rc) in b.ranks.iter().zip(&c.ranks) {
            assert!(
                rc.activation_bytes > 0 && 2 * rc.activation_bytes < rb.activation_bytes,
                "{rb:?} {rc:?}"
            );
        }
    }
}
