//! ZeRO-1 (`ZeroRedundancyOptimizer` over a NoShard model): the same losses and parameters
//! as NoShard bit for bit (the task asks within 1e-6) at world sizes 1-4 (SGD with
//! momentum, AdamW, parameter groups, clipping, bf16, CPU offload, gradient accumulation
//! under no_sync, empty chunks; on CUDA), 1/W of its optimizer state per rank, state dicts
//! and checkpoints that reload at another world size and strategy, and the errors. `fsdp
//! train --zero-redundancy-optimizer` is tested in `train_job.rs` and `resume.rs` (and the
//! binary in `crates/fsdp-cli/tests/cli/cli.rs`).
use crate::common;

use common::{assert_close, values};
use fsdp::backend::Device;
use fsdp::checkpoint::{load_checkpoint, save_checkpoint};
use fsdp::distributed::{launch, Group, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, CpuOffload, FsdpConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy, StateDictConfig, StateDictType, ZeroRedundancyOptimizer,
};
use fsdp::nn::{loss, Context, InitKey, Linear, Module};
use fsdp::optim::{no_decay_groups, AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};
use fsdp::Error;

const STEPS: usize = 3;
/// Rows of every global batch: divisible by world sizes 1 to 4.
const ROWS: usize = 12;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    /// SGD with momentum and weight decay (a momentum buffer per element).
    Sgd,
    /// AdamW with PyTorch's defaults but eps 1e-3 (see `tests/fsdp/fsdp_parity.rs`).
    AdamW,
    /// AdamW with nanoGPT's groups: decay for matrices, none for vectors.
    AdamWGroups,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Model {
    /// Linear(7,5)-GELU-Linear(5,7)-GELU-Linear(7,1), no biases, a unit per Linear: 35,
    /// 35 and 7 elements, none divisible by 2, 3 or 4.
    Uneven,
    /// Linear(1, 1) with bias: 2 elements, so at world sizes 3 and 4 some chunks are empty.
    Tiny,
    /// A GPT of 2 blocks (vocab 29, width 12, 3 heads), a unit per block.
    Gpt,
}

/// What a run varies besides the model, optimizer and world size.
#[derive(Clone, Copy, Debug, Default)]
struct Variant {
    clip: bool,
    bf16: bool,
    offload: bool,
    /// Two micro-batches per step, the first under `no_sync`.
    accumulate: bool,
    /// Every rank on cuda:0 (`device_id`).
    cuda: bool,
}

fn build(model: Model) -> (Box<dyn Module>, &'static str) {
    match model {
        Model::Uneven => (common::uneven_model(5), "Linear"),
        Model::Tiny => (
            Box::new(Linear::new(1, 1, true, &InitKey::new(9)).unwrap()),
            "Linear",
        ),
        Model::Gpt => (common::small_gpt(2), "Block"),
    }
}

/// Forward and backward of rows `lo..hi` of step `step`'s batch; the local mean loss.
fn forward_backward(
    m: &mut FullyShardedDataParallel,
    model: Model,
    step: usize,
    lo: usize,
    hi: usize,
) -> fsdp::Result<f32> {
    let cx = Context::train();
    let dev = m.compute_device();
    let (l, g) = match model {
        Model::Uneven | Model::Tiny => {
            let d = if model == Model::Tiny { 1 } else { 7 };
            let x = values(100 + step as u64, ROWS * d);
            let y = values(200 + step as u64, ROWS);
            let xt = Tensor::from_vec(x[lo * d..hi * d].to_vec(), &[hi - lo, d])?.to_device(dev)?;
            let yt = Tensor::from_vec(y[lo..hi].to_vec(), &[hi - lo, 1])?.to_device(dev)?;
            let out = m.forward(&xt, &cx)?;
            loss::mse_loss(&out, &yt)?
        }
        Model::Gpt => {
            let (x, y) = common::gpt_batch(step, lo, hi)?;
            let logits = m.forward(&x.to_device(dev)?, &cx)?;
            loss::cross_entropy(&logits, &y.to_device(dev)?)?
        }
    };
    m.backward(&g, &cx)?;
    Ok(l)
}

fn optimizer(o: Opt, m: &mut FullyShardedDataParallel) -> fsdp::Result<Box<dyn Optimizer>> {
    Ok(match o {
        Opt::Sgd => Box::new(SGD::new(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        })),
        Opt::AdamW | Opt::AdamWGroups => {
            let mut a = AdamW::new(AdamConfig {
                lr: 1e-2,
                eps: 1e-3,
                ..AdamConfig::adamw()
            });
            if o == Opt::AdamWGroups {
                let shapes: Vec<Vec<usize>> = m
                    .optimizer_param_names()
                    .into_iter()
                    .map(|(_, s)| s)
                    .collect();
                a.set_param_groups(no_decay_groups(&shapes, 1e-2, 0.1))?;
            }
            Box::new(a)
        }
    })
}

fn wrap(model: Model, pg: Group, v: Variant) -> fsdp::Result<FullyShardedDataParallel> {
    let (m, unit) = build(model);
    let cfg = FsdpConfig {
        sharding_strategy: ShardingStrategy::NoShard,
        auto_wrap_policy: Some(transformer_auto_wrap_policy([unit])),
        mixed_precision: v.bf16.then(|| MixedPrecision::uniform(DType::BF16)),
        cpu_offload: CpuOffload {
            offload_params: v.offload,
        },
        device_id: v.cuda.then_some(Device::Cuda(0)),
        ..Default::default()
    };
    FullyShardedDataParallel::new(m, pg, cfg)
}

/// One rank's run: its per-step losses, the final parameters, its optimizer state bytes
/// and the entries of its optimizer list.
type RankRun = (Vec<f32>, Vec<(String, Vec<f32>)>, usize, usize);

/// `STEPS` steps of `model` under NoShard at world size `world`, with the optimizer in a
/// `ZeroRedundancyOptimizer` when `zero`.
fn run(model: Model, opt: Opt, world: usize, zero: bool, v: Variant) -> Vec<RankRun> {
    launch(&LaunchOptions::new(world), |pg| {
        let mut m = wrap(model, pg.clone(), v)?;
        let mut o = optimizer(opt, &mut m)?;
        if zero {
            o = Box::new(ZeroRedundancyOptimizer::new(&mut m, o)?);
        }
        let rows = ROWS / world;
        let lo = pg.rank() * rows;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let l = if v.accumulate {
                // Two micro-batches of this rank's rows: the first kept local (no_sync).
                let half = rows / 2;
                let a = m.no_sync(|m| forward_backward(m, model, step, lo, lo + half))?;
                let b = forward_backward(&mut m, model, step, lo + half, lo + rows)?;
                a + b
            } else {
                forward_backward(&mut m, model, step, lo, lo + rows)?
            };
            losses.push(l);
            if v.clip {
                m.clip_grad_norm_(0.05, 2.0)?;
            }
            o.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        let entries = m.optimizer_params().len();
        Ok((losses, m.full_parameters()?, o.state_bytes(), entries))
    })
    .unwrap_or_else(|e| panic!("{model:?} {opt:?} world {world} zero {zero} {v:?}: {e}"))
}

/// Trainable elements of `model`.
fn trainable(model: Model) -> usize {
    let (mut m, _) = build(model);
    fsdp::optim::parameters(m.as_mut())
        .iter()
        .map(|p| p.param.numel())
        .sum()
}

/// Runs NoShard and ZeRO-1 and checks losses, parameters and state bytes.
fn check(model: Model, opt: Opt, world: usize, v: Variant) {
    let plain = run(model, opt, world, false, v);
    let zero = run(model, opt, world, true, v);
    let what = format!("{model:?} {opt:?} world {world} {v:?}");
    for (rank, (z, p)) in zero.iter().zip(&plain).enumerate() {
        assert_close(&format!("{what} rank {rank} losses"), &z.0, &p.0, 0.0, 0.0);
        for ((zn, zv), (pn, pv)) in z.1.iter().zip(&p.1) {
            assert_eq!(zn, pn);
            assert_close(&format!("{what} rank {rank} {zn}"), zv, pv, 0.0, 0.0);
        }
    }
    // The state is split, not copied: every element's state on exactly one rank. Adam
    // also keeps an 8-byte step count per entry of the list, and a parameter that
    // straddles two chunks is an entry on each rank.
    let (per_elem, per_entry) = if opt == Opt::Sgd { (4, 0) } else { (8, 8) };
    let whole = plain[0].2;
    assert!(plain.iter().all(|r| r.2 == whole), "{what}");
    assert_eq!(whole, trainable(model) * per_elem + plain[0].3 * per_entry);
    let bytes: Vec<usize> = zero.iter().map(|r| r.2).collect();
    let entries: usize = zero.iter().map(|r| r.3).sum();
    assert_eq!(
        bytes.iter().sum::<usize>(),
        trainable(model) * per_elem + entries * per_entry,
        "{what}: {bytes:?}"
    );
    // And no rank holds more than its ceil(N / W) elements of each unit.
    let units: &[usize] = match model {
        Model::Uneven => &[35, 35, 7],
        Model::Tiny => &[2],
        Model::Gpt => &[],
    };
    for (r, (&b, z)) in bytes.iter().zip(&zero).enumerate() {
        let bound: usize = units
            .iter()
            .map(|n| n.div_ceil(world) * per_elem)
            .sum::<usize>()
            + z.3 * per_entry;
        assert!(
            units.is_empty() || b <= bound,
            "{what}: rank {r} {b} > {bound}"
        );
    }
}

#[test]
fn zero1_equals_no_shard_at_world_sizes_1_to_4() {
    for world in 1..=4 {
        for model in [Model::Uneven, Model::Tiny, Model::Gpt] {
            for opt in [Opt::Sgd, Opt::AdamW] {
                check(model, opt, world, Variant::default());
            }
        }
        check(Model::Gpt, Opt::AdamWGroups, world, Variant::default());
    }
}

#[test]
fn zero1_equals_no_shard_with_clipping_bf16_offload_and_accumulation() {
    for world in [2, 3] {
        for v in [
            Variant {
                clip: true,
                ..Variant::default()
            },
            Variant {
                bf16: true,
                ..Variant::default()
            },
            Variant {
                offload: true,
                ..Variant::default()
            },
            Variant {
                accumulate: true,
                clip: true,
                ..Variant::default()
            },
        ] {
            check(Model::Gpt, Opt::AdamW, world, v);
            check(Model::Uneven, Opt::Sgd, world, v);
        }
    }
}

/// On a GPU (every rank on cuda:0): the device paths of the reduce-scatter, the chunk
/// all-gather and `clip_grad_norm_`'s f64 combination of the chunks' sums give NoShard's
/// numbers there too. Skipped (with a notice) without a usable GPU; runs on cuda-emu in CI.
#[test]
fn zero1_equals_no_shard_cuda() {
    if let Err(e) = fsdp::backend::cuda::detect() {
        eprintln!("skipping zero1_equals_no_shard_cuda on CUDA: {e}");
        return;
    }
    for world in [1, 2, 3] {
        let v = Variant {
            cuda: true,
            clip: true,
            ..Variant::default()
        };
        check(Model::Gpt, Opt::AdamW, world, v);
        check(Model::Tiny, Opt::Sgd, world, v);
    }
}

#[test]
fn rank_0_holds_a_quarter_of_no_shards_optimizer_state_at_world_size_4() {
    let plain = run(Model::Gpt, Opt::AdamW, 4, false, Variant::default());
    let zero = run(Model::Gpt, Opt::AdamW, 4, true, Variant::default());
    let ratio = zero[0].2 as f64 / plain[0].2 as f64;
    println!(
        "GPT (2 blocks), AdamW, world 4: no-shard {} B, ZeRO-1 rank 0 {} B ({ratio:.4})",
        plain[0].2, zero[0].2
    );
    assert!((ratio - 0.25).abs() < 0.01, "ratio {ratio}");
}

/// Steps `steps` of the GPT's batches on this rank's rows: the global mean loss of each.
fn train_gpt(
    m: &mut FullyShardedDataParallel,
    o: &mut dyn Optimizer,
    pg: &Group,
    steps: std::ops::Range<usize>,
) -> fsdp::Result<Vec<f32>> {
    let rows = ROWS / pg.size();
    let lo = pg.rank() * rows;
    steps
        .map(|step| {
            let l = forward_backward(m, Model::Gpt, step, lo, lo + rows)?;
            o.step(&m.optimizer_params())?;
            m.zero_grad();
            fsdp::train::mean_over_ranks(pg, l)
        })
        .collect()
}

/// `STEPS` steps of the GPT at `world`, ZeRO-1 or plain NoShard, then `f` on the model
/// and optimizer.
fn trained<R: Send>(
    world: usize,
    zero: bool,
    f: impl Fn(&mut FullyShardedDataParallel, &dyn Optimizer) -> fsdp::Result<R> + Sync,
) -> Vec<R> {
    launch(&LaunchOptions::new(world), |pg| {
        let mut m = wrap(Model::Gpt, pg.clone(), Variant::default())?;
        let mut o = optimizer(Opt::AdamW, &mut m)?;
        if zero {
            o = Box::new(ZeroRedundancyOptimizer::new(&mut m, o)?);
        }
        train_gpt(&mut m, o.as_mut(), &pg, 0..STEPS)?;
        f(&mut m, o.as_ref())
    })
    .unwrap()
}

#[test]
fn consolidated_state_equals_no_shards_full_optimizer_state() {
    let full = StateDictConfig::Full(Default::default());
    let want = trained(4, false, |m, o| m.optim_state_dict(o, full)).remove(0);
    let got = launch(&LaunchOptions::new(4), |pg| {
        let mut m = wrap(Model::Gpt, pg.clone(), Variant::default())?;
        let inner = optimizer(Opt::AdamW, &mut m)?;
        let mut o = ZeroRedundancyOptimizer::new(&mut m, inner)?;
        train_gpt(&mut m, &mut o, &pg, 0..STEPS)?;
        o.consolidate_state_dict(&mut m, 1)
    })
    .unwrap();
    assert!(got[0].is_none() && got[2].is_none() && got[3].is_none());
    let got = got[1].as_ref().expect("rank 1 consolidates");
    assert_eq!((&got.kind, &got.steps), (&want.kind, &want.steps));
    for (name, sd) in &want.buffers {
        let (fsdp::fsdp::StateDict::Full(w), Some(fsdp::fsdp::StateDict::Full(g))) =
            (sd, got.buffer(name))
        else {
            panic!("{name}: not full state dicts");
        };
        assert_eq!(w.tensors.len(), g.tensors.len());
        for ((wn, wt), (gn, gt)) in w.tensors.iter().zip(&g.tensors) {
            assert_eq!(wn, gn);
            let (wv, gv) = (wt.to_vec_f32().unwrap(), gt.to_vec_f32().unwrap());
            assert_close(&format!("{name} of {wn}"), &gv, &wv, 0.0, 0.0);
        }
    }
}

/// Saves (at `from` ranks) after `STEPS` steps, loads at `to` ranks under `strategy`
/// (ZeRO-1 over NoShard when `zero_to`), runs `STEPS` more: the losses of the second half.
fn resumed_losses(
    from: usize,
    ty: StateDictType,
    to: usize,
    strategy: ShardingStrategy,
    zero_to: bool,
) -> Vec<f32> {
    let dir = std::env::temp_dir().join(format!(
        "fsdp-zero1-{}-{from}-{to}-{ty:?}-{strategy:?}-{zero_to}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.clone();
    trained(from, true, move |m, o| {
        save_checkpoint(&d, m, Some(o), ty, serde_json::Value::Null)
    });
    if ty == StateDictType::Sharded {
        // Every rank wrote its chunk of the optimizer state.
        let files = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                n.to_string_lossy().starts_with("rank-")
            })
            .count();
        assert_eq!(files, from);
    }
    let losses = launch(&LaunchOptions::new(to), |pg| {
        let (module, unit) = build(Model::Gpt);
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: Some(transformer_auto_wrap_policy([unit])),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(module, pg.clone(), cfg)?;
        let mut o = optimizer(Opt::AdamW, &mut m)?;
        if zero_to {
            o = Box::new(ZeroRedundancyOptimizer::new(&mut m, o)?);
        }
        load_checkpoint(&dir, &mut m, Some(o.as_mut()))?;
        train_gpt(&mut m, o.as_mut(), &pg, STEPS..2 * STEPS)
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    losses.into_iter().next().unwrap()
}

#[test]
fn a_checkpoint_saved_at_world_size_4_resumes_at_2_and_under_other_strategies() {
    // The uninterrupted run: 2 STEPS steps at world size 4 under ZeRO-1, global mean losses.
    let want = launch(&LaunchOptions::new(4), |pg| {
        let mut m = wrap(Model::Gpt, pg.clone(), Variant::default())?;
        let inner = optimizer(Opt::AdamW, &mut m)?;
        let mut o = ZeroRedundancyOptimizer::new(&mut m, inner)?;
        train_gpt(&mut m, &mut o, &pg, 0..2 * STEPS)
    })
    .unwrap()
    .remove(0);
    let want = &want[STEPS..];
    for (ty, to, strategy, zero) in [
        (StateDictType::Sharded, 2, ShardingStrategy::NoShard, true),
        (
            StateDictType::Sharded,
            3,
            ShardingStrategy::FullShard,
            false,
        ),
        (StateDictType::Sharded, 1, ShardingStrategy::NoShard, false),
        (StateDictType::Full, 2, ShardingStrategy::NoShard, true),
    ] {
        let got = resumed_losses(4, ty, to, strategy, zero);
        // Other world sizes sum the gradients in another order: rounding apart.
        assert_close(
            &format!("{ty:?} checkpoint at 4 resumed at {to} {strategy:?} zero {zero}"),
            &got,
            want,
            1e-5,
            1e-5,
        );
    }
}

#[test]
fn zero_redundancy_optimizer_refuses_what_it_cannot_do() {
    let errs = launch(&LaunchOptions::new(2), |pg| {
        let (module, unit) = build(Model::Uneven);
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy([unit])),
            ..Default::default()
        };
        let mut full = FullyShardedDataParallel::new(module, pg.clone(), cfg)?;
        let sharded = ZeroRedundancyOptimizer::new(&mut full, Box::new(common::sgd(0.1)))
            .err()
            .map(|e| e.to_string());
        // Gradients held: after a backward, before zero_grad.
        let mut m = wrap(Model::Uneven, pg.clone(), Variant::default())?;
        forward_backward(&mut m, Model::Uneven, 0, 0, 6)?;
        let held = ZeroRedundancyOptimizer::new(&mut m, Box::new(common::sgd(0.1)))
            .err()
            .map(|e| e.to_string());
        // An optimizer with state for the whole list.
        let mut adam = AdamW::new(AdamConfig::adamw());
        adam.step(&m.optimizer_params())?;
        m.zero_grad();
        let stateful = ZeroRedundancyOptimizer::new(&mut m, Box::new(adam))
            .err()
            .map(|e| e.to_string());
        // A list that is not the model's chunk list.
        let mut o = ZeroRedundancyOptimizer::new(&mut m, Box::new(common::sgd(0.1)))?;
        let list = m.optimizer_params();
        let short = o.step(&list[..1]).err();
        let far = o
            .consolidate_state_dict(&mut m, 2)
            .err()
            .map(|e| e.to_string());
        Ok((sharded, held, stateful, short, far))
    })
    .unwrap();
    for (sharded, held, stateful, short, far) in errs {
        let s = sharded.expect("FullShard refused");
        assert!(s.contains("NoShard") && s.contains("FullShard"), "{s}");
        let h = held.expect("held gradients refused");
        assert!(h.contains("after zero_grad"), "{h}");
        let st = stateful.expect("stateful optimizer refused");
        assert!(st.contains("holds") && st.contains("fresh"), "{st}");
        assert!(
            matches!(short, Some(Error::ShapeMismatch { ref expected, ref got, .. }) if expected == &vec![3] && got == &vec![1]),
            "{short:?}"
        );
        let f = far.expect("rank 2 of 2 refused");
        assert!(f.contains("to = 2") && f.contains("0..2"), "{f}");
    }
}

#[test]
fn ranks_that_disagree_on_zero1_fail_at_the_gradient_reduction() {
    let got = launch(&LaunchOptions::new(2), |pg| {
        let mut m = wrap(Model::Uneven, pg.clone(), Variant::default())?;
        let _o = if pg.rank() == 0 {
            Some(ZeroRedundancyOptimizer::new(
                &mut m,
                Box::new(common::sgd(0.1)),
            )?)
        } else {
            None
        };
        forward_backward(&mut m, Model::Uneven, 0, pg.rank() * 6, pg.rank() * 6 + 6).map(drop)
    });
    let e = got
        .expect_err("a reduce-scatter met an all-reduce")
        .to_string();
    assert!(
        e.contains("collective mismatch")
            && e.contains("reduce_scatter_tensor")
            && e.contains("all_reduce"),
        "{e}"
    );
}
