//! MixedPrecision: low-precision compute over f32 master shards, against an unsharded
//! reference with the same rounding, and the exact values of a reduction in f32 vs bf16.

use crate::common;
use common::named_values;

use common::{assert_close, values};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy,
};
use fsdp::nn::{loss, visit_parameters, Context, InitKey, Linear, Module};
use fsdp::optim::{Optimizer, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};

const ROWS: usize = 12;
const STEPS: usize = 3;

fn round(v: &[f32], d: DType) -> Vec<f32> {
    let t = Tensor::from_vec(v.to_vec(), &[v.len()]).unwrap();
    t.to_dtype(d).unwrap().to_vec_f32().unwrap()
}

fn sgd() -> SGD {
    SGD::new(SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        ..Default::default()
    })
}

#[derive(Clone, Copy)]
enum Model {
    Uneven,
    Gpt,
}

fn build(m: Model) -> Box<dyn Module> {
    match m {
        Model::Uneven => common::uneven_model(5),
        Model::Gpt => common::small_gpt(2),
    }
}

/// Forward + backward on rows `lo..hi` of step `step`'s batch, the float input cast to
/// `cast_input` first when given (what FSDP's root input cast does).
fn step_loss(
    model: Model,
    m: &mut dyn Module,
    step: usize,
    lo: usize,
    hi: usize,
    cast_input: Option<DType>,
) -> fsdp::Result<()> {
    let cx = Context::train();
    match model {
        Model::Uneven => {
            let x = values(100 + step as u64, ROWS * 7);
            let y = values(200 + step as u64, ROWS);
            let mut xt = Tensor::from_vec(x[lo * 7..hi * 7].to_vec(), &[hi - lo, 7])?;
            if let Some(d) = cast_input {
                xt = xt.to_dtype(d)?;
            }
            let out = m.forward(&xt, &cx)?;
            let (_, g) =
                loss::mse_loss(&out, &Tensor::from_vec(y[lo..hi].to_vec(), &[hi - lo, 1])?)?;
            m.backward(&g, &cx)?;
        }
        Model::Gpt => common::gpt_step(m, step, lo, hi)?,
    }
    Ok(())
}

/// Makes every parameter of `m` a `d` tensor (`model.to(d)`), keeping the f32 masters.
fn to_low_precision(m: &mut dyn Module, d: DType) -> Vec<(String, Vec<f32>)> {
    let master = named_values(m);
    visit_parameters(m, "", false, &mut |_, p| {
        let t = p.data()?.to_dtype(d)?;
        p.set_grad(None);
        p.set_data(Some(t))
    })
    .unwrap();
    master
}

/// Unsharded training of the `param_dtype` model PyTorch FSDP runs: each step the f32
/// masters are cast to `d`, forward and backward run on `d` tensors (every op rounding its
/// output to `d`, gradients produced in `d`), and the gradients, cast to f32, step the f32
/// masters.
fn reference(model: Model, d: DType) -> Vec<(String, Vec<f32>)> {
    let mut m = build(model);
    let mut opt = sgd();
    for step in 0..STEPS {
        let master = to_low_precision(m.as_mut(), d);
        step_loss(model, m.as_mut(), step, 0, ROWS, Some(d)).unwrap();
        let mut i = 0;
        visit_parameters(m.as_mut(), "", false, &mut |_, p| {
            let g = p.grad().map(|g| g.to_dtype(DType::F32)).transpose()?;
            let shape = p.data()?.shape().to_vec();
            p.set_data(Some(Tensor::from_vec(master[i].1.clone(), &shape)?))?;
            p.set_grad(g);
            i += 1;
            Ok(())
        })
        .unwrap();
        opt.step(&fsdp::optim::parameters(m.as_mut())).unwrap();
        fsdp::nn::zero_grad(m.as_mut());
    }
    named_values(m.as_mut())
}

fn fsdp_run(
    model: Model,
    world: usize,
    strategy: ShardingStrategy,
    per_unit: bool,
    mp: MixedPrecision,
) -> Vec<Vec<(String, Vec<f32>)>> {
    launch(&LaunchOptions::new(world), |pg| {
        let policy = match model {
            Model::Uneven => transformer_auto_wrap_policy(["Linear"]),
            Model::Gpt => transformer_auto_wrap_policy(["Block"]),
        };
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: per_unit.then_some(policy),
            ranks_per_node: strategy
                .is_hybrid()
                .then(|| common::hybrid_ranks_per_node(world)),
            mixed_precision: Some(mp),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(build(model), pg.clone(), cfg)?;
        let mut opt = sgd();
        let rows = ROWS / world;
        for step in 0..STEPS {
            step_loss(
                model,
                &mut m,
                step,
                pg.rank() * rows,
                (pg.rank() + 1) * rows,
                None,
            )?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        m.full_parameters()
    })
    .unwrap()
}

fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

#[test]
fn bf16_forward_is_the_forward_of_the_bf16_model() {
    // FSDP's forward output is a bf16 tensor, bitwise the forward of the model cast to
    // bf16 (parameters and input bf16 tensors, each op rounding its output once).
    let x = values(7, 4 * 7);
    let outs = launch(&LaunchOptions::new(2), |pg| {
        let cfg = FsdpConfig {
            mixed_precision: Some(MixedPrecision::uniform(DType::BF16)),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(build(Model::Uneven), pg, cfg)?;
        let y = m.forward(&Tensor::from_vec(x.clone(), &[4, 7])?, &Context::eval())?;
        Ok((y.dtype(), y.to_vec_f32()?))
    })
    .unwrap();
    let mut plain = build(Model::Uneven);
    to_low_precision(plain.as_mut(), DType::BF16);
    let xb = Tensor::from_vec(x.clone(), &[4, 7])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let want = plain.forward(&xb, &Context::eval()).unwrap();
    assert_eq!(want.dtype(), DType::BF16);
    let want = want.to_vec_f32().unwrap();
    let unrounded = build(Model::Uneven)
        .forward(
            &Tensor::from_vec(x.clone(), &[4, 7]).unwrap(),
            &Context::eval(),
        )
        .unwrap()
        .to_vec_f32()
        .unwrap();
    for (dtype, o) in &outs {
        assert_eq!(*dtype, DType::BF16);
        assert_eq!(o, &want);
    }
    assert_ne!(want, unrounded, "bf16 rounding must change the output");
    assert_eq!(want, round(&want, DType::BF16), "outputs are bf16 values");
}

#[test]
fn bf16_and_f16_training_match_an_unsharded_reference_with_the_same_rounding() {
    for (model, strategies) in [
        (
            Model::Uneven,
            &[
                ShardingStrategy::FullShard,
                ShardingStrategy::ShardGradOp,
                ShardingStrategy::NoShard,
                ShardingStrategy::HybridShard,
            ][..],
        ),
        (Model::Gpt, &[ShardingStrategy::FullShard][..]),
    ] {
        for d in [DType::BF16, DType::F16] {
            let want = reference(model, d);
            let f32_ref = reference(model, DType::F32);
            let gap = max_diff(&want, &f32_ref);
            assert!(
                gap > 1e-6,
                "{d} rounding must change the result (gap {gap})"
            );
            for &strategy in strategies {
                for world in [1, 2, 3, 4] {
                    for per_unit in [false, true] {
                        let mp = MixedPrecision::uniform(d);
                        for (rank, got) in fsdp_run(model, world, strategy, per_unit, mp)
                            .iter()
                            .enumerate()
                        {
                            if world == 1 && !per_unit {
                                // One rank, one unit: the same roundings in the same places.
                                assert_eq!(got, &want, "{d} {strategy:?} world 1");
                            }
                            for ((n, g), (_, w)) in got.iter().zip(&want) {
                                // bf16 has 8 significant bits: a rank's gradient rounds
                                // differently from the whole batch's by ~2^-8 relative, and
                                // per-unit wrapping also rounds each unit's input.
                                let what = format!("{d} {strategy:?} world {world} per_unit {per_unit} rank {rank} {n}");
                                assert_close(&what, g, w, 2e-3, 2e-2);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One Linear(1, 1, no bias) weight, at hybrid 2 nodes x 2 ranks; rank r's input is
/// `xs[r]`, so its local gradient of `sum(out)` is `xs[r]`. Returns every rank's gradient
/// shard value for the weight (ranks holding only padding report `None`).
fn hybrid_reduced_grad(xs: [f32; 4], mp: MixedPrecision) -> Vec<Option<f32>> {
    launch(&LaunchOptions::new(4), |pg| {
        let cfg = FsdpConfig {
            sharding_strategy: ShardingStrategy::HybridShard,
            ranks_per_node: Some(2),
            mixed_precision: Some(mp),
            ..Default::default()
        };
        let lin = Linear::new(1, 1, false, &InitKey::new(1))?;
        let mut m = FullyShardedDataParallel::new(Box::new(lin), pg.clone(), cfg)?;
        let x = Tensor::from_vec(vec![xs[pg.rank()]], &[1, 1])?;
        m.forward(&x, &Context::train())?;
        m.backward(&Tensor::from_vec(vec![1.0f32], &[1, 1])?, &Context::train())?;
        let valid = m.flat_param().valid_shard_numel();
        let g = m
            .flat_param()
            .grad_shard()
            .map(|g| g.to_vec_f32())
            .transpose()?;
        Ok((valid > 0).then(|| g.map(|v| v[0])).flatten())
    })
    .unwrap()
}

#[test]
fn hybrid_bf16_params_with_f32_reduce_keep_the_small_gradient_exactly() {
    // FSDP averages over the 4 ranks, so local gradients 4 and 2^-8 (ranks 0 and 2, one per
    // node; ranks 1 and 3 contribute 0) are the 1.0 and 2^-10 after the average:
    // the reduced gradient is 1 + 2^-10 = 1.0009765625 exactly in f32, while a bf16
    // reduction (8 significant bits) loses the 2^-10.
    let xs = [4.0, 0.0, 2f32.powi(-8), 0.0];
    let f32_reduce = MixedPrecision {
        param_dtype: Some(DType::BF16),
        reduce_dtype: Some(DType::F32),
        ..Default::default()
    };
    let got = hybrid_reduced_grad(xs, f32_reduce);
    // The weight's single element lives on local rank 0 of each node: world ranks 0 and 2.
    let want = 1.0 + 2f32.powi(-10); // 1.0009765625, exact in f32
    assert_eq!(got, vec![Some(want), None, Some(want), None]);
    let bf16_reduce = MixedPrecision::uniform(DType::BF16);
    let got = hybrid_reduced_grad(xs, bf16_reduce);
    assert_eq!(got, vec![Some(1.0), None, Some(1.0), None]);
}

#[test]
fn keep_low_precision_grads_leaves_bf16_values_in_the_sharded_gradient() {
    for keep in [false, true] {
        let grads = launch(&LaunchOptions::new(2), |pg| {
            let cfg = FsdpConfig {
                mixed_precision: Some(MixedPrecision {
                    param_dtype: Some(DType::BF16),
                    reduce_dtype: Some(DType::F32),
                    keep_low_precision_grads: keep,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let mut m = FullyShardedDataParallel::new(build(Model::Uneven), pg.clone(), cfg)?;
            step_loss(
                Model::Uneven,
                &mut m,
                0,
                pg.rank() * 6,
                (pg.rank() + 1) * 6,
                None,
            )?;
            m.flat_param().grad_shard().unwrap().to_vec_f32()
        })
        .unwrap();
        let all: Vec<f32> = grads.concat();
        let representable = all
            .iter()
            .filter(|&&v| half::bf16::from_f32(v).to_f32() == v)
            .count();
        if keep {
            assert_eq!(representable, all.len());
        } else {
            // The f32 average of two bf16 gradients is often not a bf16 value.
            assert!(
                representable < all.len(),
                "{representable} of {}",
                all.len()
            );
        }
    }
}

#[test]
fn integer_mixed_precision_dtypes_are_refused_at_wrap_time() {
    let err = launch(&LaunchOptions::new(1), |pg| {
        let cfg = FsdpConfig {
            mixed_precision: Some(MixedPrecision {
                reduce_dtype: Some(DType::I32),
                ..Default::default()
            }),
            ..Default::default()
        };
        FullyShardedDataParallel::new(build(Model::Uneven), pg, cfg).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("reduce_dtype") && err.contains("i32"), "{err}");
}

/// One training step of the small GPT (2 blocks, one unit each, FullShard at world 2) under
/// `mp`; rank 0's memory figures.
fn gpt_step_memory(mp: Option<MixedPrecision>) -> fsdp::fsdp::MemoryStats {
    launch(&LaunchOptions::new(2), |pg| {
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            mixed_precision: mp,
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(build(Model::Gpt), pg.clone(), cfg)?;
        m.reset_peak_memory_stats();
        let rows = ROWS / 2;
        common::gpt_step(&mut m, 0, pg.rank() * rows, (pg.rank() + 1) * rows)?;
        Ok(m.memory_stats())
    })
    .unwrap()
    .remove(0)
}

#[test]
fn bf16_halves_unsharded_parameter_and_saved_activation_bytes() {
    let f32_mem = gpt_step_memory(None);
    let bf16_mem = gpt_step_memory(Some(MixedPrecision::uniform(DType::BF16)));
    eprintln!(
        "peak unsharded parameter bytes f32 {} bf16 {}; saved activation bytes f32 {} bf16 {}",
        f32_mem.peak_unsharded_param_bytes,
        bf16_mem.peak_unsharded_param_bytes,
        f32_mem.activation_bytes,
        bf16_mem.activation_bytes
    );
    // The unsharded flat parameters are bf16 tensors: exactly half the bytes.
    assert!(f32_mem.peak_unsharded_param_bytes > 0);
    assert_eq!(
        2 * bf16_mem.peak_unsharded_param_bytes,
        f32_mem.peak_unsharded_param_bytes
    );
    // Every saved activation is bf16 but the token ids (i32 in both) and LayerNorm's saved
    // statistics (two per row, where f32 saves one per row besides xhat): half, plus that.
    assert!(f32_mem.activation_bytes > 0);
    let ratio = bf16_mem.activation_bytes as f64 / f32_mem.activation_bytes as f64;
    assert!(
        (0.5..0.56).contains(&ratio),
        "bf16 / f32 saved activation bytes {ratio}"
    );
    // The shards the optimizer steps on stay f32.
    assert_eq!(bf16_mem.param_shard_bytes, f32_mem.param_shard_bytes);
}
