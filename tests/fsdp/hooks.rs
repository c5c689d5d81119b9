//! The FSDP hooks driven by a host that computes a unit's forward and backward itself
//! (plain loops on the parameter and gradient views, as a foreign framework would): the
//! result equals the same model trained through `fsdp::nn` modules, under FullShard,
//! ShardGradOp and NoShard at world sizes 1, 2 and 4; calls out of order (hooks, steps,
//! `zero_grad` before `finish_backward`) are errors naming the unit and what was expected.

use crate::common;

use fsdp::distributed::{launch, LaunchOptions};
use fsdp::embed::{fully_shard, ParamSpec, UnitSpec};
use fsdp::fsdp::{AutoWrapPolicy, FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use fsdp::nn::{loss, Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::optim::Optimizer;
use fsdp::tensor::Tensor;
use std::sync::Arc;

const ROWS: usize = 8;
const STEPS: usize = 3;

/// Linear(7, 5) - ReLU - Linear(5, 3), each Linear its own unit (modules "0" and "2").
fn model() -> Box<dyn Module> {
    let k = InitKey::new(11);
    Box::new(Sequential::new(vec![
        Box::new(Linear::new(7, 5, true, &k.child("0")).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(5, 3, true, &k.child("2")).unwrap()),
    ]))
}

fn config(strategy: ShardingStrategy) -> FsdpConfig {
    FsdpConfig {
        sharding_strategy: strategy,
        auto_wrap_policy: Some(AutoWrapPolicy::Custom(Arc::new(|m: &dyn Module, _| {
            m.type_name() == "Linear"
        }))),
        ..Default::default()
    }
}

/// Step `s`'s rows `lo..hi` of the inputs `(ROWS, 7)` and targets `(ROWS, 3)`.
fn batch(s: usize, lo: usize, hi: usize) -> (Vec<f32>, Vec<f32>) {
    let x = common::values(100 + s as u64, ROWS * 7);
    let t = common::values(200 + s as u64, ROWS * 3);
    (x[lo * 7..hi * 7].to_vec(), t[lo * 3..hi * 3].to_vec())
}

fn rows(rank: usize, world: usize) -> (usize, usize) {
    (rank * ROWS / world, (rank + 1) * ROWS / world)
}

/// Training through the modules.
fn through_modules(m: &mut FullyShardedDataParallel, s: usize, lo: usize, hi: usize) {
    let (x, t) = batch(s, lo, hi);
    let n = hi - lo;
    let x = Tensor::from_vec(x, &[n, 7]).unwrap();
    let t = Tensor::from_vec(t, &[n, 3]).unwrap();
    let y = m.forward(&x, &Context::train()).unwrap();
    let (_, dy) = loss::mse_loss(&y, &t).unwrap();
    m.backward(&dy, &Context::train()).unwrap();
}

/// `y (n, o) = x (n, i) W^T + b` with the unit's views, in plain loops.
fn linear(views: &[(String, Tensor)], x: &[f32], n: usize) -> (Vec<f32>, usize) {
    let w = views[0].1.to_vec_f32().unwrap();
    let b = views[1].1.to_vec_f32().unwrap();
    let (o, i) = (views[0].1.shape()[0], views[0].1.shape()[1]);
    let mut y = vec![0.0f32; n * o];
    for r in 0..n {
        for j in 0..o {
            let mut acc = b[j];
            for k in 0..i {
                acc += x[r * i + k] * w[j * i + k];
            }
            y[r * o + j] = acc;
        }
    }
    (y, o)
}

/// Adds `d W = dy^T x` and `d b = sum dy` into the unit's gradient views; returns
/// `dx = dy W`.
fn linear_backward(
    params: &[(String, Tensor)],
    grads: &[(String, Tensor)],
    x: &[f32],
    dy: &[f32],
    n: usize,
) -> Vec<f32> {
    let w = params[0].1.to_vec_f32().unwrap();
    let (o, i) = (params[0].1.shape()[0], params[0].1.shape()[1]);
    let mut dw = grads[0].1.to_vec_f32().unwrap();
    let mut db = grads[1].1.to_vec_f32().unwrap();
    let mut dx = vec![0.0f32; n * i];
    for r in 0..n {
        for j in 0..o {
            let g = dy[r * o + j];
            db[j] += g;
            for k in 0..i {
                dw[j * i + k] += g * x[r * i + k];
                dx[r * i + k] += g * w[j * i + k];
            }
        }
    }
    grads[0]
        .1
        .copy_from(&Tensor::from_vec(dw, &[o, i]).unwrap())
        .unwrap();
    grads[1]
        .1
        .copy_from(&Tensor::from_vec(db, &[o]).unwrap())
        .unwrap();
    dx
}

/// The same step with the host computing: hooks in the order a host framework calls them.
fn through_hooks(m: &mut FullyShardedDataParallel, s: usize, lo: usize, hi: usize) {
    let (x, t) = batch(s, lo, hi);
    let n = hi - lo;
    // Forward: the root encloses the units.
    m.pre_forward(true).unwrap();
    let (h, p0) = m
        .with_unit("0", |u| {
            u.pre_forward(true).unwrap();
            let v = u.param_views().unwrap();
            let (h, _) = linear(&v, &x, n);
            u.post_forward(true).unwrap();
            (h, v)
        })
        .unwrap();
    drop(p0);
    let a: Vec<f32> = h.iter().map(|v| v.max(0.0)).collect();
    let y = m
        .with_unit("2", |u| {
            u.pre_forward(true).unwrap();
            let (y, _) = linear(&u.param_views().unwrap(), &a, n);
            u.post_forward(true).unwrap();
            y
        })
        .unwrap();
    m.post_forward(true).unwrap();
    // mse_loss: mean over every element of (y - t)^2.
    let dy: Vec<f32> = y
        .iter()
        .zip(&t)
        .map(|(y, t)| 2.0 * (y - t) / (n * 3) as f32)
        .collect();
    // Backward, in reverse.
    m.pre_backward().unwrap();
    let da = m
        .with_unit("2", |u| {
            u.pre_backward().unwrap();
            let (p, g) = (u.param_views().unwrap(), u.grad_views().unwrap());
            let da = linear_backward(&p, &g, &a, &dy, n);
            u.post_backward(true).unwrap();
            da
        })
        .unwrap();
    let dh: Vec<f32> = da
        .iter()
        .zip(&h)
        .map(|(g, h)| if *h > 0.0 { *g } else { 0.0 })
        .collect();
    m.with_unit("0", |u| {
        u.pre_backward().unwrap();
        let (p, g) = (u.param_views().unwrap(), u.grad_views().unwrap());
        linear_backward(&p, &g, &x, &dh, n);
        u.post_backward(true).unwrap();
    })
    .unwrap();
    m.post_backward(true).unwrap();
    m.finish_backward().unwrap();
}

type Step = fn(&mut FullyShardedDataParallel, usize, usize, usize);

/// The model of [`model`] declared by its parameters (values as `Linear::new` drew them),
/// as a host framework with its own tensors would.
fn declared(
    pg: fsdp::distributed::Group,
    strategy: ShardingStrategy,
) -> fsdp::Result<FullyShardedDataParallel> {
    let values = common::named_values(model().as_mut());
    let unit = |name: &str| {
        let params = values
            .iter()
            .filter_map(|(n, v)| {
                let local = n.strip_prefix(&format!("{name}."))?;
                let shape = if local == "weight" {
                    if name == "0" {
                        vec![5, 7]
                    } else {
                        vec![3, 5]
                    }
                } else if name == "0" {
                    vec![5]
                } else {
                    vec![3]
                };
                Some(ParamSpec::values(local, &shape, v.clone()))
            })
            .collect();
        UnitSpec::new(name, params)
    };
    let cfg = FsdpConfig {
        auto_wrap_policy: None,
        ..config(strategy)
    };
    fully_shard(vec![unit("0"), unit("2")], Vec::new(), pg, cfg)
}

fn train(world: usize, strategy: ShardingStrategy, step: Step) -> Vec<(String, Vec<f32>)> {
    train_model(world, strategy, step, false)
}

fn train_model(
    world: usize,
    strategy: ShardingStrategy,
    step: Step,
    declare: bool,
) -> Vec<(String, Vec<f32>)> {
    launch(&LaunchOptions::new(world), |pg| {
        let (lo, hi) = rows(pg.rank(), world);
        let mut m = if declare {
            declared(pg, strategy)?
        } else {
            FullyShardedDataParallel::new(model(), pg, config(strategy))?
        };
        let mut opt = common::sgd(0.1);
        for s in 0..STEPS {
            step(&mut m, s, lo, hi);
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        m.full_parameters()
    })
    .unwrap()
    .remove(0)
}

#[test]
fn a_host_driving_the_hooks_trains_like_the_modules() {
    for strategy in [
        ShardingStrategy::FullShard,
        ShardingStrategy::ShardGradOp,
        ShardingStrategy::NoShard,
    ] {
        for world in [1, 2, 4] {
            let modules = train(world, strategy, through_modules);
            let hooks = train(world, strategy, through_hooks);
            // Declared by parameters: the same hooks, the same numbers, bit for bit.
            let declared = train_model(world, strategy, through_hooks, true);
            assert_eq!(declared, hooks, "{strategy:?} world {world} declared");
            assert_eq!(modules.len(), 4);
            let start = common::named_values(model().as_mut());
            for ((name, want), (got_name, got)) in modules.iter().zip(&hooks) {
                assert_eq!(name, got_name);
                // Plain loops against the GEMM: the same sums in another order.
                common::assert_close(
                    &format!("{strategy:?} world {world} {name}"),
                    got,
                    want,
                    1e-6,
                    1e-5,
                );
            }
            // And training moved every parameter.
            for ((name, a), (_, b)) in hooks.iter().zip(&start) {
                assert!(a != b, "{strategy:?} world {world}: {name} did not train");
            }
        }
    }
}

/// A forward that fails at the root after unit "0" finished its forward (and unit "2"
/// was cut short between its hooks); no backward follows.
fn failed_forward(m: &mut FullyShardedDataParallel) {
    m.pre_forward(true).unwrap();
    m.with_unit("0", |u| {
        u.pre_forward(true).unwrap();
        u.post_forward(true).unwrap();
    })
    .unwrap();
    m.with_unit("2", |u| u.pre_forward(true).unwrap()).unwrap();
    m.post_forward(false).unwrap();
}

#[test]
fn a_failed_forward_leaves_no_stale_gathered_parameters() {
    // ShardGradOp keeps a nested unit's parameters gathered after its forward, for the
    // backward. A failed root forward owes no backward, so it frees them: the optimizer
    // step that follows (on the gradients of the backward before) changes the shards,
    // and the next forward must gather the new values, not compute with the old ones.
    for strategy in [ShardingStrategy::ShardGradOp, ShardingStrategy::FullShard] {
        for world in [1, 2] {
            let clean = train(world, strategy, through_hooks);
            let with_failure = launch(&LaunchOptions::new(world), |pg| {
                let (lo, hi) = rows(pg.rank(), world);
                let mut m = declared(pg, strategy)?;
                let mut opt = common::sgd(0.1);
                for s in 0..STEPS {
                    through_hooks(&mut m, s, lo, hi);
                    if s == 0 {
                        failed_forward(&mut m);
                    }
                    opt.step(&m.optimizer_params())?;
                    m.zero_grad();
                }
                m.full_parameters()
            })
            .unwrap()
            .remove(0);
            assert_eq!(with_failure, clean, "{strategy:?} world {world}");
        }
    }
}

#[test]
fn hooks_called_out_of_order_are_errors_naming_the_unit() {
    let errs = launch(&LaunchOptions::new(2), |pg| {
        let mut m =
            FullyShardedDataParallel::new(model(), pg, config(ShardingStrategy::FullShard))?;
        let mut e = vec![
            m.post_forward(true).unwrap_err().to_string(),
            m.with_unit("2", |u| u.post_backward(true).unwrap_err().to_string())?,
            m.with_unit("2", |u| u.grad_views().unwrap_err().to_string())?,
            m.with_unit("0", |u| u.finish_backward().unwrap_err().to_string())?,
            m.with_unit("0", |u| u.param_views().unwrap_err().to_string())?,
            m.with_unit("9", |_| ()).unwrap_err().to_string(),
        ];
        // A forward begun twice without its post_forward (inside the root's forward, a
        // forward without grad so nothing is owed a backward after it).
        m.pre_forward(false)?;
        m.with_unit("0", |u| u.pre_forward(false))??;
        e.push(m.with_unit("0", |u| u.pre_forward(false).unwrap_err().to_string())?);
        m.with_unit("0", |u| u.post_forward(true))??;
        m.post_forward(true)?;
        // A nested unit's forward outside the root's.
        e.push(m.with_unit("0", |u| u.pre_forward(true).unwrap_err().to_string())?);
        // A backward with no forward with grad before it.
        e.push(m.pre_backward().unwrap_err().to_string());
        // The step's stages, in the Rust API's names: no step before a backward, nothing
        // but finish_backward after the root's post_backward.
        e.push(m.ready_for_step().unwrap_err().to_string());
        m.pre_forward(true)?;
        m.post_forward(true)?;
        m.pre_backward()?;
        m.post_backward(true)?;
        e.push(m.ready_for_step().unwrap_err().to_string());
        e.push(m.ready_for_zero_grad().unwrap_err().to_string());
        e.push(m.pre_forward(true).unwrap_err().to_string());
        m.finish_backward()?;
        m.ready_for_step()?;
        m.zero_grad();
        e.push(m.finish_backward().unwrap_err().to_string());
        Ok(e)
    })
    .unwrap();
    for e in &errs {
        assert!(
            e[0].contains("post_forward on unit '' without pre_forward"),
            "{}",
            e[0]
        );
        assert!(
            e[1].contains("post_backward on unit '2' without pre_backward"),
            "{}",
            e[1]
        );
        assert!(
            e[2].contains("grad_views on unit '2' without pre_backward"),
            "{}",
            e[2]
        );
        assert!(
            e[3].contains("finish_backward called on unit '0'"),
            "{}",
            e[3]
        );
        assert!(e[4].contains("not materialized"), "{}", e[4]);
        assert!(e[5].contains("no FSDP unit wraps module '9'"), "{}", e[5]);
        assert!(
            e[6].contains("pre_forward on unit '0' without its post_forward"),
            "{}",
            e[6]
        );
        assert!(
            e[7].contains("pre_forward on unit '0' outside the root's forward: the root's pre_forward comes first"),
            "{}",
            e[7]
        );
        assert!(
            e[8].contains("FSDP root: backward called without a saved forward"),
            "{}",
            e[8]
        );
        assert!(
            e[9].contains(
                "the optimizer's step without gradients: no backward finished since zero_grad"
            ),
            "{}",
            e[9]
        );
        for (k, call) in [
            (10, "the optimizer's step"),
            (11, "zero_grad"),
            (12, "pre_forward on unit ''"),
        ] {
            assert!(
                e[k].contains(&format!(
                    "{call} before finish_backward: the backward ended (the root's post_backward)"
                )),
                "{}",
                e[k]
            );
        }
        assert!(
            e[13].contains("finish_backward without a backward"),
            "{}",
            e[13]
        );
    }
}

#[test]
fn declared_units_nest_by_path_and_bad_declarations_are_named() {
    let out = launch(&LaunchOptions::new(2), |pg| {
        let p = |name: &str, n: usize| ParamSpec::values(name, &[n], vec![1.0; n]);
        let units = vec![
            UnitSpec::new("layers.0", vec![p("w", 3)]),
            UnitSpec::new("layers", vec![p("scale", 2)]),
            UnitSpec::new("head", vec![p("w", 5), p("frozen", 1).frozen()]),
        ];
        let mut m = fully_shard(
            units,
            vec![p("temperature", 1)],
            pg.clone(),
            FsdpConfig::default(),
        )?;
        let mut names = Vec::new();
        m.for_each_unit(&mut |u| {
            names.push(u.module_name().to_string());
            Ok(())
        })
        .unwrap();
        let params: Vec<String> = m.full_parameters()?.into_iter().map(|(n, _)| n).collect();
        let bad = |units: Vec<UnitSpec>| {
            fully_shard(units, Vec::new(), pg.clone(), FsdpConfig::default())
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let errors = vec![
            bad(vec![
                UnitSpec::new("a", vec![p("w", 1)]),
                UnitSpec::new("a", vec![]),
            ]),
            bad(vec![UnitSpec::new("a..b", vec![])]),
            bad(vec![UnitSpec::new("a", vec![p("w", 1), p("w", 1)])]),
            bad(vec![UnitSpec::new(
                "a",
                vec![ParamSpec::values("w", &[2, 2], vec![0.0; 3])],
            )]),
            bad(vec![UnitSpec::new("a", vec![p("x.y", 1)])]),
        ];
        // The host computes: the modules refuse to.
        let x = Tensor::from_vec(vec![0.0f32; 2], &[1, 2])?;
        let fwd = m.forward(&x, &Context::train()).unwrap_err().to_string();
        Ok((names, params, errors, fwd))
    })
    .unwrap();
    let (names, params, errors, fwd) = &out[0];
    assert_eq!(names, &["", "layers", "layers.0", "head"]);
    assert_eq!(
        params,
        &[
            "temperature",
            "layers.scale",
            "layers.0.w",
            "head.w",
            "head.frozen"
        ]
    );
    assert!(
        errors[0].contains("unit 'a' is declared twice"),
        "{}",
        errors[0]
    );
    assert!(errors[1].contains("unit name 'a..b'"), "{}", errors[1]);
    assert!(
        errors[2].contains("parameter 'a.w' is declared twice"),
        "{}",
        errors[2]
    );
    assert!(
        errors[3].contains("'a.w' of shape [2, 2] needs 4 values, got 3"),
        "{}",
        errors[3]
    );
    assert!(
        errors[4].contains("parameter name 'x.y' of unit 'a'"),
        "{}",
        errors[4]
    );
    assert!(fwd.contains("declared by a host that computes it"), "{fwd}");
}
