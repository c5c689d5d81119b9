//! A float64 GPT (PyTorch FSDP accepts float64 modules, so exact references run in f64):
//! trained with Adam under FSDP (every sharding strategy, flat and one unit per block,
//! world sizes 1 to 4 on thread ranks) it equals unsharded f64 training to 1e-12, its
//! first-step gradient included; the whole model's gradient matches central finite
//! differences of the f64 loss; `clip_grad_norm_` clips in f64; the train job runs in f64
//! (`--mixed-precision f64`). The same model and loop on CUDA: `tests/serial/f64_device.rs`.

use crate::common;
use crate::f64_model;

use f64_model::{batch, gpt, max_err, optimizer, params, Named, Run, STEPS};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, ShardingStrategy,
};
use fsdp::nn::{self, Context, Module};
use fsdp::ops;
use fsdp::optim::ParamGrad;
use fsdp::tensor::{DType, Tensor};

/// Unsharded f64 training on every rank's batch: each step the gradients of the ranks'
/// mean losses are summed in rank order and divided by the world size (FSDP's reduction,
/// in its order: a tied parameter's two gradient terms per rank then add up alike; Adam's
/// update divides by `sqrt(v) + eps`, which magnifies rounding-level differences of tiny
/// gradients) and the optimizer steps once. Returns the parameters after the steps and the averaged gradient of the
/// first step.
fn reference(world: usize, decoupled: bool) -> (Named, Named) {
    let mut m = gpt();
    let mut opt = optimizer(decoupled);
    let mut first = Vec::new();
    for s in 0..STEPS {
        let mut sum: Named = Vec::new();
        for r in 0..world {
            nn::zero_grad(m.as_mut());
            let (ids, tg) = batch(r, s);
            let logits = m.forward(&ids, &Context::train()).unwrap();
            assert_eq!(logits.dtype(), DType::F64);
            let (_, dl) = ops::cross_entropy(&logits, &tg).unwrap();
            m.backward(&dl, &Context::train()).unwrap();
            let mut i = 0;
            nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
                let g = p.grad().unwrap().to_vec_f64()?;
                match sum.get_mut(i) {
                    Some((_, acc)) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                    None => sum.push((n.to_string(), g)),
                }
                i += 1;
                Ok(())
            })
            .unwrap();
        }
        let (mut pgs, mut grads) = (Vec::new(), Vec::new());
        let mut i = 0;
        nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
            let g: Vec<f64> = sum[i].1.iter().map(|g| g / world as f64).collect();
            i += 1;
            grads.push((n.to_string(), g.clone()));
            pgs.push(ParamGrad {
                param: p.data()?.reshape(&[p.numel()])?,
                grad: Some(Tensor::from_vec(g, &[p.numel()])?),
            });
            Ok(())
        })
        .unwrap();
        if s == 0 {
            first = grads;
        }
        opt.step(&pgs).unwrap();
    }
    (params(m.as_mut()), first)
}

/// Rank results: the full parameters after the steps, and the rank's pieces of the first
/// step's averaged gradient `(name, flat range, values)`.
type RankResult = (Named, f64_model::GradPieces);

fn fsdp_run(
    world: usize,
    strategy: ShardingStrategy,
    nested: bool,
    decoupled: bool,
) -> Vec<RankResult> {
    f64_model::fsdp_train(Run {
        world,
        strategy,
        nested,
        decoupled,
        gpus: None,
    })
    .into_iter()
    .map(|r| (r.params, r.grads))
    .collect()
}

fn check_runs(at: &str, runs: &[RankResult], want: &Named, want_grad: &Named) {
    let (mut worst_p, mut worst_g) = (0.0f64, 0.0f64);
    for (r, (params, grads)) in runs.iter().enumerate() {
        assert_eq!(params.len(), want.len(), "{at}");
        for (n, w) in want {
            let (_, got) = params
                .iter()
                .find(|(pn, _)| pn == n)
                .unwrap_or_else(|| panic!("{at}: rank {r} has no {n}"));
            worst_p = worst_p.max(max_err(&format!("{at}, rank {r}: {n}"), got, w, 1e-12));
        }
        let mut covered = 0;
        for (n, range, g) in grads {
            let (_, w) = want_grad.iter().find(|(wn, _)| wn == n).unwrap();
            if let Some((lo, hi)) = range {
                let e = max_err(&format!("{at}, rank {r}: grad {n}"), g, &w[*lo..*hi], 1e-13);
                worst_g = worst_g.max(e);
                covered += hi - lo;
            }
        }
        // Every rank holds a piece (unsharded: all) of the gradient.
        assert!(covered > 0, "{at}: rank {r} compared no gradient");
    }
    // Printed with --nocapture.
    println!("{at}: worst parameter error {worst_p:e}, gradient {worst_g:e}");
}

#[test]
fn fsdp_f64_gpt_with_adam_equals_unsharded_f64_training_world_1_to_4() {
    for world in 1..=4 {
        let (want, want_grad) = reference(world, false);
        let mut cases = vec![
            (ShardingStrategy::FullShard, false),
            (ShardingStrategy::FullShard, true),
            (ShardingStrategy::ShardGradOp, true),
            (ShardingStrategy::NoShard, false),
            (ShardingStrategy::NoShard, true),
        ];
        if world == 4 {
            cases.push((ShardingStrategy::HybridShard, true));
            cases.push((ShardingStrategy::HybridShardZero2, true));
        }
        for (strategy, nested) in cases {
            let runs = fsdp_run(world, strategy, nested, false);
            let at = format!("world {world}, {strategy:?}, nested {nested}");
            check_runs(&at, &runs, &want, &want_grad);
        }
    }
}

#[test]
fn fsdp_f64_gpt_with_adamw_equals_unsharded_f64_training() {
    let world = 3;
    let (want, want_grad) = reference(world, true);
    let runs = fsdp_run(world, ShardingStrategy::FullShard, true, true);
    check_runs("world 3, FullShard + AdamW", &runs, &want, &want_grad);
}

/// The f64 mean cross-entropy of the model at `values`, summed over the ranks' batches of
/// step 0 and averaged (FSDP's objective).
fn loss_at(world: usize, values: &Named) -> f64 {
    let mut m = gpt();
    nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
        let (_, v) = values.iter().find(|(vn, _)| vn == n).unwrap();
        p.data()?.data_mut::<f64>()?.copy_from_slice(v);
        Ok(())
    })
    .unwrap();
    let mut l = 0.0;
    for r in 0..world {
        let (ids, tg) = batch(r, 0);
        let logits = m.forward(&ids, &Context::eval()).unwrap();
        l += ops::cross_entropy_f64(&logits, &tg).unwrap().0;
    }
    l / world as f64
}

#[test]
fn fsdp_f64_gpt_gradient_matches_finite_differences() {
    // The averaged first-step gradient of unsharded training, which FSDP's equals (the
    // tests above).
    let world = 2;
    let (_, want_grad) = reference(world, false);
    let init = params(gpt().as_mut());
    let h = 1e-5;
    let mut checked = 0;
    for (pi, (n, g)) in want_grad.iter().enumerate() {
        // A spread of entries of every parameter.
        for i in (0..g.len()).step_by(g.len().div_ceil(5).max(1)) {
            let mut v = init.clone();
            v[pi].1[i] += h;
            let lp = loss_at(world, &v);
            v[pi].1[i] -= 2.0 * h;
            let lm = loss_at(world, &v);
            let num = (lp - lm) / (2.0 * h);
            assert!(
                (num - g[i]).abs() <= 1e-8 * (1.0 + num.abs()),
                "{n}[{i}]: gradient {} vs finite difference {num}",
                g[i]
            );
            checked += 1;
        }
    }
    assert!(checked >= 3 * want_grad.len(), "{checked} entries checked");
}

#[test]
fn fsdp_f64_clip_grad_norm_is_computed_in_f64() {
    let world = 2;
    let (_, want_grad) = reference(world, false);
    let total = want_grad
        .iter()
        .flat_map(|(_, g)| g.iter())
        .map(|v| v * v)
        .sum::<f64>()
        .sqrt();
    let max_norm = 0.1f32;
    let coef = 0.1 / (total + 1e-6);
    assert!(coef < 0.5, "the test must clip: total norm {total}");
    let runs = launch(&LaunchOptions::new(world), move |pg| {
        let r = pg.rank();
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Block"])),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(gpt(), pg, cfg)?;
        let (ids, tg) = batch(r, 0);
        let logits = m.forward(&ids, &Context::train())?;
        let (_, dl) = ops::cross_entropy(&logits, &tg)?;
        m.backward(&dl, &Context::train())?;
        let norm = m.clip_grad_norm_(max_norm, 2.0)?;
        let ps = m.optimizer_params();
        let names = m.optimizer_param_names();
        let mut pieces = Vec::new();
        for range in m.state_dict_ranges() {
            if let (Some(i), Some(rg)) = (
                names.iter().position(|(n, _)| *n == range.name),
                range.range,
            ) {
                pieces.push((range.name, rg, ps[i].grad.as_ref().unwrap().to_vec_f64()?));
            }
        }
        Ok((norm, pieces))
    })
    .unwrap();
    for (r, (norm, pieces)) in runs.iter().enumerate() {
        assert!(
            (f64::from(*norm) - total).abs() <= 1e-7 * total,
            "rank {r}: norm {norm} vs {total}"
        );
        assert!(!pieces.is_empty());
        for (n, (lo, hi), g) in pieces {
            let (_, w) = want_grad.iter().find(|(wn, _)| wn == n).unwrap();
            let want: Vec<f64> = w[*lo..*hi].iter().map(|v| v * coef).collect();
            // An f32 norm or coefficient would be off by ~1e-8 relative.
            for (a, b) in g.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-14 * b.abs().max(1e-300),
                    "rank {r}: clipped {n}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn the_train_job_runs_in_f64() {
    use fsdp::train::{train, Precision, Silent, TrainConfig};
    let data = common::corpus_file("f64-job");
    let job = |w: usize, p: Precision| TrainConfig {
        mixed_precision: p,
        ..common::small_job(data.clone(), w)
    };
    let run = |cfg: TrainConfig| {
        train(&cfg, &Silent)
            .unwrap_or_else(|e| panic!("{cfg:?}: {e}"))
            .losses()
    };
    let (one, two) = (run(job(1, Precision::F64)), run(job(2, Precision::F64)));
    let f32_losses = run(job(1, Precision::None));
    assert_eq!(one.len(), 30);
    assert!(one[29] < one[0] - 1.0, "loss did not fall: {one:?}");
    let (mut across_worlds, mut vs_f32) = (0.0f32, 0.0f32);
    for ((a, b), c) in one.iter().zip(&two).zip(&f32_losses) {
        across_worlds = across_worlds.max((a - b).abs() / a);
        vs_f32 = vs_f32.max((a - c).abs() / a);
    }
    println!("f64 job: world 1 vs 2 {across_worlds:e}, f64 vs f32 {vs_f32:e}");
    // The f64 losses reach the report as f32: world sizes agree to its rounding.
    assert!(across_worlds <= 1e-6, "world 1 vs 2: {across_worlds:e}");
    // f64 arithmetic, not f32's: the curves part by f32 rounding, and no more.
    assert!(vs_f32 > 0.0 && vs_f32 < 1e-2, "f64 vs f32: {vs_f32:e}");
}
