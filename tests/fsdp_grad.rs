//! `no_sync` gradient accumulation and `clip_grad_norm_` against unsharded training.

mod common;

use common::{assert_close, values};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    transformer_auto_wrap_policy, FsdpConfig, FullyShardedDataParallel, ShardingStrategy,
};
use fsdp::nn::{loss, visit_parameters, Context, InitKey, Linear, Module};
use fsdp::optim::{Optimizer, ParamGrad, SgdConfig, SGD};
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

fn sgd() -> SGD {
    SGD::new(SgdConfig {
        lr: 0.1,
        ..Default::default()
    })
}

fn named_values(m: &mut dyn Module) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    visit_parameters(m, "", false, &mut |n, p| {
        out.push((n.to_string(), p.data().unwrap().to_vec_f32().unwrap()))
    });
    out
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
    });
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
        ranks_per_node: Some(common::hybrid_ranks_per_node(pg.size())),
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
