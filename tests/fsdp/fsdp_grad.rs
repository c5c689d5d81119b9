//! `no_sync` gradient accumulation and `clip_grad_norm_` against unsharded training.

use crate::common;
use common::named_values;

use common::{assert_close, values};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, ShardingStrategy,
};
use fsdp::nn::{loss, visit_parameters, Context, InitKey, Linear, Module};
use fsdp::optim::{Optimizer, ParamGrad};
use fsdp::tensor::Tensor;

const ROWS: usize = 12;

fn model() -> Box<dyn Module> {
    common::uneven_model(11)
}

/// Forward + backward of rows `lo..hi` of micro-batch `micro` (MSE against targets).
fn micro_step(m: &mut dyn Module, micro: usize, lo: usize, hi: usize) -> fsdp::Result<()> {
    let x = values(500 + micro as u64, ROWS * 7);
    let y: Vec<f32> = values(600 + micro as u64, ROWS)
        .iter()
        .map(|v| 4.0 * v)
        .collect();
    let out = m.forward(
        &Tensor::from_vec(x[lo * 7..hi * 7].to_vec(), &[hi - lo, 7])?,
        &Context::train(),
    )?;
    let (_, g) = loss::mse_loss(&out, &Tensor::from_vec(y[lo..hi].to_vec(), &[hi - lo, 1])?)?;
    m.backward(&g, &Context::train())?;
    Ok(())
}

fn sgd() -> fsdp::optim::SGD {
    common::sgd(0.1)
}

fn unsharded_params_and_grads(m: &mut dyn Module) -> (Vec<ParamGrad>, Vec<f32>) {
    let mut pg = Vec::new();
    let mut flat = Vec::new();
    visit_parameters(m, "", false, &mut |_, p| {
        flat.extend(p.grad().unwrap().to_vec_f32().unwrap());
        pg.push(ParamGrad {
            param: p.data().unwrap().clone(),
            grad: p.grad().cloned(),
        });
        Ok(())
    })
    .unwrap();
    (pg, flat)
}

fn configs() -> Vec<(ShardingStrategy, bool)> {
    let mut v = Vec::new();
    for s in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
        ShardingStrategy::HybridShard,
        ShardingStrategy::HybridShardZero2,
    ] {
        for per_unit in [false, true] {
            v.push((s, per_unit));
        }
    }
    v
}

fn wrap(
    pg: fsdp::distributed::Group,
    s: ShardingStrategy,
    per_unit: bool,
) -> fsdp::Result<FullyShardedDataParallel> {
    let cfg = FsdpConfig {
        sharding_strategy: s,
        auto_wrap_policy: per_unit.then(|| transformer_auto_wrap_policy(["Linear"])),
        ranks_per_node: s
            .is_hybrid()
            .then(|| common::hybrid_ranks_per_node(pg.size())),
        ..Default::default()
    };
    FullyShardedDataParallel::new(model(), pg, cfg)
}

#[test]
fn no_sync_accumulates_the_sum_of_all_micro_batches() {
    // Reference: 4 micro-batches accumulated into .grad, then one SGD step.
    let mut reference = model();
    for micro in 0..4 {
        micro_step(reference.as_mut(), micro, 0, ROWS).unwrap();
    }
    let (pg, _) = unsharded_params_and_grads(reference.as_mut());
    sgd().step(&pg).unwrap();
    let want = named_values(reference.as_mut());
    // The last micro-batch alone gives a different update: the test can tell them apart.
    let mut last_only = model();
    micro_step(last_only.as_mut(), 3, 0, ROWS).unwrap();
    let (pg, _) = unsharded_params_and_grads(last_only.as_mut());
    sgd().step(&pg).unwrap();
    let last = named_values(last_only.as_mut());
    assert!((last[0].1[0] - want[0].1[0]).abs() > 1e-3);

    for (strategy, per_unit) in configs() {
        for world in 1..=4 {
            let got = launch(&LaunchOptions::new(world), |pg| {
                let rows = ROWS / world;
                let (lo, hi) = (pg.rank() * rows, (pg.rank() + 1) * rows);
                let mut m = wrap(pg, strategy, per_unit)?;
                m.no_sync(|m| (0..3).try_for_each(|micro| micro_step(m, micro, lo, hi)))?;
                // No gradient was communicated or sharded inside no_sync.
                assert!(m.optimizer_params().iter().all(|p| p.grad.is_none()));
                micro_step(&mut m, 3, lo, hi)?;
                sgd().step(&m.optimizer_params())?;
                m.full_parameters()
            })
            .unwrap();
            for (rank, params) in got.iter().enumerate() {
                for ((n, g), (_, w)) in params.iter().zip(&want) {
                    assert_close(
                        &format!("{strategy:?} per_unit {per_unit} world {world} rank {rank} {n}"),
                        g,
                        w,
                        1e-6,
                        1e-5,
                    );
                }
            }
        }
    }
}

#[test]
fn clip_grad_norm_matches_unsharded_and_is_identical_on_every_rank() {
    for norm_type in [2.0f32, f32::INFINITY] {
        let mut reference = model();
        micro_step(reference.as_mut(), 0, 0, ROWS).unwrap();
        let (pg, flat) = unsharded_params_and_grads(reference.as_mut());
        let want_norm = if norm_type == 2.0 {
            flat.iter().map(|g| (*g as f64).powi(2)).sum::<f64>().sqrt() as f32
        } else {
            flat.iter().fold(0.0f32, |m, g| m.max(g.abs()))
        };
        let max_norm = want_norm / 3.0; // forces clipping by 1/3
        let coef = max_norm / (want_norm + 1e-6);
        for p in &pg {
            let g = p.grad.as_ref().unwrap();
            let scaled: Vec<f32> = g.to_vec_f32().unwrap().iter().map(|v| v * coef).collect();
            g.f32_mut().unwrap().copy_from_slice(&scaled);
        }
        sgd().step(&pg).unwrap();
        let want = named_values(reference.as_mut());
        // At one rank every strategy must clip by the very same norm (same bits).
        let mut one_rank: Vec<(bool, ShardingStrategy, f32)> = Vec::new();
        for (strategy, per_unit) in configs() {
            for world in 1..=4 {
                let got = launch(&LaunchOptions::new(world), |pg| {
                    let rows = ROWS / world;
                    let mut m = wrap(pg.clone(), strategy, per_unit)?;
                    micro_step(&mut m, 0, pg.rank() * rows, (pg.rank() + 1) * rows)?;
                    let norm = m.clip_grad_norm_(max_norm, norm_type)?;
                    sgd().step(&m.optimizer_params())?;
                    Ok((norm, m.full_parameters()?))
                })
                .unwrap();
                let what = format!("{strategy:?} per_unit {per_unit} world {world} p={norm_type}");
                assert!(
                    (got[0].0 - want_norm).abs() <= 1e-5 * want_norm,
                    "{what}: norm {} vs {want_norm}",
                    got[0].0
                );
                assert!(
                    got.iter().all(|(n, _)| n.to_bits() == got[0].0.to_bits()),
                    "{what}: norms differ across ranks"
                );
                for ((n, g), (_, w)) in got[0].1.iter().zip(&want) {
                    assert_close(&format!("{what} {n}"), g, w, 1e-6, 1e-5);
                }
                if world == 1 {
                    one_rank.push((per_unit, strategy, got[0].0));
                }
            }
        }
        for &(per_unit, strategy, norm) in &one_rank {
            for &(p2, s2, n2) in &one_rank {
                if p2 == per_unit {
                    assert_eq!(
                        norm.to_bits(),
                        n2.to_bits(),
                        "p={norm_type} per_unit {per_unit}: {strategy:?} {norm} vs {s2:?} {n2} at one rank"
                    );
                }
            }
        }
    }
}

#[test]
fn clip_grad_norm_over_empty_shards_and_bad_arguments() {
    // Linear(1, 1): 2 parameters, so ranks 2 and 3 of 4 hold only padding.
    let out = launch(&LaunchOptions::new(4), |pg| {
        let mut m = FullyShardedDataParallel::new(
            Box::new(Linear::new(1, 1, true, &InitKey::new(3))?),
            pg.clone(),
            FsdpConfig::default(),
        )?;
        let x = Tensor::from_vec(vec![2.0f32], &[1, 1])?;
        let y = m.forward(&x, &Context::train())?;
        let (_, g) = loss::sum_loss(&y)?;
        m.backward(&g, &Context::train())?; // grads: d/dw = 2 * 4 ranks / 4 = 2, d/db = 1
        let bad = m.clip_grad_norm_(-1.0, 2.0).unwrap_err().to_string();
        let norm = m.clip_grad_norm_(100.0, 2.0)?;
        Ok((norm, bad))
    })
    .unwrap();
    for (norm, bad) in out {
        assert!((norm - 5.0f32.sqrt()).abs() < 1e-6, "{norm}");
        assert!(bad.contains("max_norm"), "{bad}");
    }
}

#[test]
fn frozen_parameters_beside_trainable_ones_are_never_updated() {
    // Frozen Linear(4, 4) + trainable Linear(4, 2) in one unit, 2 ranks, 2 AdamW steps with
    // weight decay: the frozen weights stay bitwise equal, the trainable ones match
    // unsharded training in which the frozen ones have no gradient.
    let build = || -> Box<dyn Module> {
        let k = InitKey::new(21);
        let mut frozen = Linear::new(4, 4, true, &k.child("0")).unwrap();
        frozen.weight.requires_grad = false;
        if let Some(b) = &mut frozen.bias {
            b.requires_grad = false;
        }
        Box::new(fsdp::nn::Sequential::new(vec![
            Box::new(frozen),
            Box::new(Linear::new(4, 2, true, &k.child("1")).unwrap()),
        ]))
    };
    let step = |m: &mut dyn Module, s: usize, lo: usize, hi: usize| -> fsdp::Result<()> {
        let x = values(700 + s as u64, 4 * 4);
        let out = m.forward(
            &Tensor::from_vec(x[lo * 4..hi * 4].to_vec(), &[hi - lo, 4])?,
            &Context::train(),
        )?;
        let target = Tensor::from_vec(vec![1.0f32; (hi - lo) * 2], &[hi - lo, 2])?;
        let (_, g) = loss::mse_loss(&out, &target)?;
        m.backward(&g, &Context::train())?;
        Ok(())
    };
    let adamw = || {
        fsdp::optim::AdamW::new(fsdp::optim::AdamConfig {
            lr: 0.1,
            weight_decay: 0.1,
            ..fsdp::optim::AdamConfig::adamw()
        })
    };
    let mut reference = build();
    let before = named_values(reference.as_mut());
    let mut o = adamw();
    for s in 0..2 {
        step(reference.as_mut(), s, 0, 4).unwrap();
        o.step(&fsdp::optim::parameters(reference.as_mut()))
            .unwrap();
        fsdp::nn::zero_grad(reference.as_mut());
    }
    let want = named_values(reference.as_mut());
    let got = launch(&LaunchOptions::new(2), |pg| {
        let mut m = FullyShardedDataParallel::new(build(), pg.clone(), FsdpConfig::default())?;
        let mut o = adamw();
        for s in 0..2 {
            step(&mut m, s, pg.rank() * 2, pg.rank() * 2 + 2)?;
            o.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        m.full_parameters()
    })
    .unwrap();
    for params in &got {
        for (((n, g), (_, w)), (_, b)) in params.iter().zip(&want).zip(&before) {
            if n.starts_with("0.") {
                assert_eq!(
                    g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{n} changed"
                );
            } else {
                assert_close(n, g, w, 1e-6, 1e-5);
                assert!(g != b, "{n} did not train");
            }
        }
    }
}

#[test]
fn sync_module_states_starts_every_rank_from_rank_0() {
    let got = launch(&LaunchOptions::new(3), |pg| {
        // Each rank initializes differently; rank 0's values must win.
        let m = Linear::new(5, 3, true, &InitKey::new(100 + pg.rank() as u64))?;
        let cfg = FsdpConfig {
            sync_module_states: true,
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(Box::new(m), pg, cfg)?;
        m.full_parameters()
    })
    .unwrap();
    let mut want = Linear::new(5, 3, true, &InitKey::new(100)).unwrap();
    let want = named_values(&mut want);
    for params in got {
        assert_eq!(params, want);
    }
}

#[test]
fn a_unit_unused_in_a_step_gets_no_gradient_and_the_rest_matches() {
    // Step 1 uses A(B(x)); step 2 only A(x): B's unit sees no forward and no backward.
    struct AB {
        a: Box<dyn Module>,
        b: Box<dyn Module>,
        use_b: bool,
    }
    impl Module for AB {
        fn type_name(&self) -> &str {
            "AB"
        }
        fn forward(&mut self, x: &Tensor, cx: &Context) -> fsdp::Result<Tensor> {
            let h = if self.use_b {
                self.b.forward(x, cx)?
            } else {
                x.clone()
            };
            self.a.forward(&h, cx)
        }
        fn backward(&mut self, g: &Tensor, cx: &Context) -> fsdp::Result<Tensor> {
            let g = self.a.backward(g, cx)?;
            if self.use_b {
                self.b.backward(&g, cx)
            } else {
                Ok(g)
            }
        }
        fn for_each_child(&mut self, f: &mut fsdp::nn::ChildVisitor<'_>) -> fsdp::Result<()> {
            f("a", &mut self.a)?;
            f("b", &mut self.b)
        }
        fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
            Some(self)
        }
        fn for_each_param(&mut self, f: &mut fsdp::nn::ParamVisitor<'_>) -> fsdp::Result<()> {
            fsdp::nn::no_params(f)
        }
    }
    let build = || AB {
        a: Box::new(Linear::new(3, 3, true, &InitKey::new(1).child("a")).unwrap()),
        b: Box::new(Linear::new(3, 3, true, &InitKey::new(1).child("b")).unwrap()),
        use_b: true,
    };
    let run_step = |m: &mut dyn Module, s: usize, lo: usize, hi: usize| -> fsdp::Result<()> {
        let x = values(800 + s as u64, 4 * 3);
        let out = m.forward(
            &Tensor::from_vec(x[lo * 3..hi * 3].to_vec(), &[hi - lo, 3])?,
            &Context::train(),
        )?;
        // A mean over rows, so averaging over ranks equals the unsharded batch mean.
        let target = Tensor::from_vec(vec![1.0f32; (hi - lo) * 3], &[hi - lo, 3])?;
        let (_, g) = loss::mse_loss(&out, &target)?;
        m.backward(&g, &Context::train())?;
        Ok(())
    };
    let mut reference = build();
    for s in 0..2 {
        reference.use_b = s == 0;
        run_step(&mut reference, s, 0, 4).unwrap();
        sgd()
            .step(&fsdp::optim::parameters(&mut reference))
            .unwrap();
        fsdp::nn::zero_grad(&mut reference);
    }
    let want = named_values(&mut reference);
    let got = launch(&LaunchOptions::new(2), |pg| {
        let cfg = FsdpConfig {
            auto_wrap_policy: Some(transformer_auto_wrap_policy(["Linear"])),
            ..Default::default()
        };
        let mut m = FullyShardedDataParallel::new(Box::new(build()), pg.clone(), cfg)?;
        let mut b_grad_none = false;
        for s in 0..2 {
            if let Some(ab) = m
                .module_mut()
                .as_any_mut()
                .and_then(|a| a.downcast_mut::<AB>())
            {
                ab.use_b = s == 0;
            }
            run_step(&mut m, s, pg.rank() * 2, pg.rank() * 2 + 2)?;
            if s == 1 {
                // Units: root, a, b in pre-order; b saw no backward this step.
                let mut grads = Vec::new();
                m.for_each_unit(&mut |u| {
                    grads.push(u.flat_param().grad_shard().is_some());
                    Ok(())
                })
                .unwrap();
                b_grad_none = !grads[2];
            }
            sgd().step(&m.optimizer_params())?;
            m.zero_grad();
        }
        Ok((b_grad_none, m.full_parameters()?))
    })
    .unwrap();
    for (b_grad_none, params) in got {
        assert!(b_grad_none, "the unused unit got a gradient");
        for ((n, g), (_, w)) in params.iter().zip(&want) {
            assert_close(n, g, w, 1e-6, 1e-5);
        }
    }
}
