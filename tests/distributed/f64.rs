//! f64 parameters and collectives (PyTorch FSDP accepts float64 modules): the collectives
//! on the threads and tcp backends, an MLP trained under FSDP in f64 at world size 2
//! against unsharded f64 training (1e-12), and its gradient against finite differences
//! in f64.

use crate::common;
use crate::f64_model;
use common::{free_port, on_threads, torchrun_env};

use fsdp::distributed::{
    destroy_process_group, init_process_group, launch, Group, InitOptions, LaunchOptions, ReduceOp,
};
use fsdp::fsdp::{
    module_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy, StateDict, StateDictConfig,
};
use fsdp::nn::{self, loss, Context, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::optim::{Optimizer, ParamGrad, SgdConfig, SGD};
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

/// `(name, values)` pairs.
type Named = Vec<(String, Vec<f64>)>;

const ROWS: usize = 3;
const STEPS: usize = 3;

/// Linear(5, 7) -> ReLU -> Linear(7, 4) -> ReLU -> Linear(4, 3) in f64: 89 parameters, a
/// count no world size above 1 divides.
fn mlp() -> Box<dyn Module> {
    mlp_from(5)
}

fn mlp_from(seed: u64) -> Box<dyn Module> {
    let k = InitKey::new(seed);
    let mut m = Sequential::new(vec![
        Box::new(Linear::new(5, 7, true, &k).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(7, 4, true, &k).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(4, 3, true, &k).unwrap()),
    ]);
    nn::module_to_dtype(&mut m, DType::F64).unwrap();
    Box::new(m)
}

fn batch(r: usize, s: usize) -> (Tensor, Tensor) {
    let x: Vec<f64> = (0..ROWS * 5)
        .map(|i| (0.37 * i as f64 + 0.7 * r as f64 + 1.3 * s as f64).sin())
        .collect();
    let t: Vec<f64> = (0..ROWS * 3)
        .map(|i| (0.2 * i as f64 + r as f64 + s as f64).cos())
        .collect();
    (
        Tensor::from_vec(x, &[ROWS, 5]).unwrap(),
        Tensor::from_vec(t, &[ROWS, 3]).unwrap(),
    )
}

fn sgd() -> SGD {
    SGD::new(SgdConfig {
        lr: 0.05,
        momentum: 0.9,
        ..Default::default()
    })
}

fn check(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let e = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(e <= tol, "{what}: max error {e:e} > {tol:e}");
}

/// Unsharded f64 training of `world` ranks' batches: each step the gradients of every
/// rank's mean loss are averaged (FSDP's reduction) and SGD steps once. Returns the
/// parameters after every step's update and the averaged gradient of the first step.
fn reference(world: usize) -> (Named, Named) {
    let mut m = mlp();
    let mut opt = sgd();
    let mut first_grad = Vec::new();
    for s in 0..STEPS {
        nn::zero_grad(m.as_mut());
        for r in 0..world {
            let (x, t) = batch(r, s);
            let y = m.forward(&x, &Context::train()).unwrap();
            let (_, dy) = loss::mse_loss(&y, &t).unwrap();
            m.backward(&dy, &Context::train()).unwrap();
        }
        let mut pgs = Vec::new();
        let mut grads = Vec::new();
        nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
            let g: Vec<f64> = p
                .grad()
                .unwrap()
                .to_vec_f64()?
                .iter()
                .map(|g| g / world as f64)
                .collect();
            grads.push((n.to_string(), g.clone()));
            pgs.push(ParamGrad {
                param: p.data()?.reshape(&[p.numel()])?,
                grad: Some(Tensor::from_vec(g, &[p.numel()])?),
            });
            Ok(())
        })
        .unwrap();
        if s == 0 {
            first_grad = grads;
        }
        opt.step(&pgs).unwrap();
    }
    let mut params = Vec::new();
    nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
        params.push((n.to_string(), p.data()?.to_vec_f64()?));
        Ok(())
    })
    .unwrap();
    (params, first_grad)
}

type Run = (
    Vec<(String, Vec<f64>)>,
    Vec<(String, Option<(usize, usize)>, Vec<f64>)>,
);

/// FSDP f64 training at `world`: the full parameters after the steps (rank 0's full
/// state dict, f64) and each rank's gradient pieces of the first step.
fn fsdp_run(world: usize, strategy: ShardingStrategy, nested: bool) -> Vec<Run> {
    launch(&LaunchOptions::new(world), move |pg| {
        let r = pg.rank();
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            auto_wrap_policy: nested.then(|| module_wrap_policy(["Linear"])),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(mlp(), pg, cfg)?;
        assert_eq!(
            m.flat_param().dtype(),
            if nested { DType::F32 } else { DType::F64 }
        );
        let mut opt = sgd();
        let mut grads = Vec::new();
        for s in 0..STEPS {
            let (x, t) = batch(r, s);
            let y = m.forward(&x, &Context::train())?;
            assert_eq!(y.dtype(), DType::F64);
            let (_, dy) = loss::mse_loss(&y, &t)?;
            m.backward(&dy, &Context::train())?;
            if s == 0 {
                grads = f64_model::grad_pieces(&mut m)?;
            }
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        Ok((f64_model::full_params(&mut m)?, grads))
    })
    .unwrap()
}

#[test]
fn fsdp_f64_mlp_equals_unsharded_f64_training() {
    for world in [1, 2] {
        let (want, want_grad) = reference(world);
        for (strategy, nested) in [
            (ShardingStrategy::FullShard, false),
            (ShardingStrategy::FullShard, true),
            (ShardingStrategy::ShardGradOp, true),
            (ShardingStrategy::NoShard, false),
        ] {
            let runs = fsdp_run(world, strategy, nested);
            let at = format!("world {world}, {strategy:?}, nested {nested}");
            for (r, (params, grads)) in runs.iter().enumerate() {
                for ((n, got), (wn, w)) in params.iter().zip(&want) {
                    assert_eq!(n, wn);
                    check(&format!("{at}, rank {r}: {n}"), got, w, 1e-12);
                }
                for (n, range, g) in grads {
                    let (_, w) = want_grad.iter().find(|(wn, _)| wn == n).unwrap();
                    if let Some((lo, hi)) = range {
                        check(&format!("{at}, rank {r}: grad {n}"), g, &w[*lo..*hi], 1e-12);
                    }
                }
            }
        }
    }
}

/// `L(theta) = mean over ranks of mse(model(x_r), t_r)` with the parameters in `flat`
/// (f64), for finite differences.
fn avg_loss(world: usize, values: &[(String, Vec<f64>)]) -> f64 {
    let mut m = mlp();
    nn::visit_parameters(m.as_mut(), "", false, &mut |n, p| {
        let (_, v) = values.iter().find(|(vn, _)| vn == n).unwrap();
        p.data()?.data_mut::<f64>()?.copy_from_slice(v);
        Ok(())
    })
    .unwrap();
    let mut l = 0.0;
    for r in 0..world {
        let (x, t) = batch(r, 0);
        let y = m
            .forward(&x, &Context::eval())
            .unwrap()
            .to_vec_f64()
            .unwrap();
        let tv = t.to_vec_f64().unwrap();
        l += y
            .iter()
            .zip(&tv)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f64>()
            / y.len() as f64;
    }
    l / world as f64
}

#[test]
fn fsdp_f64_gradient_matches_finite_differences() {
    let world = 2;
    let runs = fsdp_run(world, ShardingStrategy::FullShard, false);
    let mut init = Vec::new();
    nn::visit_parameters(mlp().as_mut(), "", false, &mut |n, p| {
        init.push((n.to_string(), p.data()?.to_vec_f64()?));
        Ok(())
    })
    .unwrap();
    // Assemble the full gradient from the ranks' pieces.
    let mut full: Vec<(String, Vec<f64>)> = init
        .iter()
        .map(|(n, v)| (n.clone(), vec![f64::NAN; v.len()]))
        .collect();
    for (_, grads) in &runs {
        for (n, range, g) in grads {
            if let Some((lo, hi)) = range {
                let e = full.iter_mut().find(|(fname, _)| fname == n).unwrap();
                e.1[*lo..*hi].copy_from_slice(g);
            }
        }
    }
    let h = 1e-6;
    for (pi, (n, g)) in full.iter().enumerate() {
        for (i, &gi) in g.iter().enumerate() {
            assert!(!gi.is_nan(), "{n}[{i}] in no rank's piece");
            let mut v = init.clone();
            v[pi].1[i] += h;
            let lp = avg_loss(world, &v);
            v[pi].1[i] -= 2.0 * h;
            let lm = avg_loss(world, &v);
            let num = (lp - lm) / (2.0 * h);
            assert!(
                (num - gi).abs() <= 1e-8 * (1.0 + num.abs()),
                "{n}[{i}]: FSDP gradient {gi} vs finite difference {num}"
            );
        }
    }
}

#[test]
fn f64_refuses_mixed_precision_and_mixed_dtypes() {
    let e = launch(&LaunchOptions::new(2), |pg| {
        let cfg = FsdpConfig {
            mixed_precision: Some(MixedPrecision::uniform(DType::BF16)),
            ..FsdpConfig::default()
        };
        FullyShardedDataParallel::new(mlp(), pg, cfg).map(|_| ())
    })
    .unwrap_err();
    assert!(e.to_string().contains("f64"), "{e}");
    let e = launch(&LaunchOptions::new(1), |pg| {
        let mut m = Sequential::new(vec![
            Box::new(Linear::new(2, 2, true, &InitKey::new(0))?),
            Box::new(Linear::new(2, 2, true, &InitKey::new(0))?),
        ]);
        nn::visit_parameters(&mut m, "", false, &mut |n, p| {
            if n.starts_with('0') {
                let d = p.data()?.to_dtype(DType::F64)?;
                p.set_data(Some(d))?;
            }
            Ok(())
        })?;
        FullyShardedDataParallel::new(Box::new(m), pg, FsdpConfig::default()).map(|_| ())
    })
    .unwrap_err();
    assert!(e.to_string().contains("one dtype"), "{e}");
}

/// Rank `r`'s f64 values, over many binades and with bits beyond f32's.
fn input(r: usize, n: usize) -> Tensor {
    let v: Vec<f64> = (0..n)
        .map(|i| {
            (1.0 + 1e-13 * i as f64)
                * ((i * 7 + r * 3) as f64).sin()
                * 2f64.powi((i as i32 * 5 + r as i32) % 40 - 20)
        })
        .collect();
    Tensor::from_vec(v, &[n]).unwrap()
}

fn collectives(pg: &Group) -> Result<Vec<Vec<u64>>> {
    let (w, r) = (pg.size(), pg.rank());
    let n = 7;
    let bits = |t: &Tensor| -> Result<Vec<u64>> {
        Ok(t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect())
    };
    let mut out = Vec::new();
    let t = input(r, n);
    pg.all_reduce(&t, ReduceOp::Sum)?;
    // The sum in rank order, in f64: what every backend computes.
    let want: Vec<f64> = (0..n)
        .map(|i| {
            (0..w)
                .map(|q| input(q, n).to_vec_f64().unwrap()[i])
                .fold(0.0, |a, b| a + b)
        })
        .collect();
    for (g, w) in t.to_vec_f64()?.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 4.0 * f64::EPSILON * w.abs(),
            "all_reduce f64: {g} vs {w}"
        );
    }
    out.push(bits(&t)?);
    let full = Tensor::zeros(&[n * w], DType::F64);
    pg.all_gather_into_tensor(&full, &input(r, n))?;
    for q in 0..w {
        assert_eq!(
            full.to_vec_f64()?[q * n..(q + 1) * n],
            input(q, n).to_vec_f64()?[..]
        );
    }
    out.push(bits(&full)?);
    let shard = Tensor::zeros(&[n], DType::F64);
    pg.reduce_scatter_tensor(&shard, &input(r, n * w), ReduceOp::Sum)?;
    out.push(bits(&shard)?);
    let b = if r == 0 {
        input(9, n)
    } else {
        Tensor::zeros(&[n], DType::F64)
    };
    pg.broadcast(&b, 0)?;
    assert_eq!(b.to_vec_f64()?, input(9, n).to_vec_f64()?);
    let i = Tensor::from_vec(vec![r as i64 + (1i64 << 40)], &[1])?;
    pg.all_reduce(&i, ReduceOp::Sum)?;
    assert_eq!(
        i.data::<i64>()?[0],
        (0..w as i64).sum::<i64>() + w as i64 * (1i64 << 40)
    );
    Ok(out)
}

#[test]
fn f64_collectives_threads_and_tcp_agree_bitwise() {
    let world = 3;
    let threads = launch(&LaunchOptions::new(world), |pg| collectives(&pg)).unwrap();
    let port = free_port();
    let tcp = on_threads(world, |r| {
        let opts = InitOptions::new("tcp").with_env(torchrun_env(port, world, r));
        let pg = init_process_group(opts)?;
        let out = collectives(&pg)?;
        destroy_process_group()?;
        Ok(out)
    });
    for (r, t) in tcp.into_iter().enumerate() {
        assert_eq!(t.unwrap(), threads[r], "rank {r}: tcp differs from threads");
    }
}

/// Every entry of a full state dict as f64 bits.
fn full_bits(m: &mut FullyShardedDataParallel) -> Result<Vec<(String, Vec<u64>)>> {
    let StateDict::Full(f) = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?
    else {
        unreachable!()
    };
    f.tensors
        .iter()
        .map(|(n, t)| {
            assert_eq!(t.dtype(), DType::F64, "{n}");
            Ok((
                n.clone(),
                t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect(),
            ))
        })
        .collect()
}

#[test]
fn f64_state_dicts_and_checkpoints_reload_exactly_at_another_world_size() -> Result<()> {
    use fsdp::checkpoint::{load_checkpoint, save_checkpoint};
    use fsdp::fsdp::StateDictType;
    for ty in [StateDictType::Sharded, StateDictType::Full] {
        let dir = std::env::temp_dir().join(format!("fsdp-f64-{}-{ty:?}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.clone();
        let saved = launch(&LaunchOptions::new(2), move |pg| {
            let r = pg.rank();
            let mut m = FullyShardedDataParallel::new(mlp(), pg, FsdpConfig::default())?;
            let mut opt = sgd();
            let (x, t) = batch(r, 0);
            let y = m.forward(&x, &Context::train())?;
            let (_, dy) = loss::mse_loss(&y, &t)?;
            m.backward(&dy, &Context::train())?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
            // Each kind of state dict reloads into a differently initialized model.
            let want = full_bits(&mut m)?;
            for cfg in [
                StateDictConfig::Full(FullStateDictConfig::default()),
                StateDictConfig::Sharded,
                StateDictConfig::Local,
            ] {
                let sd = m.state_dict(cfg)?;
                let mut other = FullyShardedDataParallel::new(
                    mlp_from(9),
                    m.process_group().clone(),
                    FsdpConfig::default(),
                )?;
                assert_ne!(full_bits(&mut other)?, want);
                other.load_state_dict(&sd, true)?;
                assert_eq!(full_bits(&mut other)?, want, "{cfg:?}");
            }
            save_checkpoint(&d, &mut m, Some(&opt), ty, serde_json::Value::Null)?;
            Ok(want)
        })?;
        let d = dir.clone();
        let loaded = launch(&LaunchOptions::new(3), move |pg| {
            let r = pg.rank();
            let mut m = FullyShardedDataParallel::new(mlp_from(9), pg, FsdpConfig::default())?;
            let mut opt = sgd();
            load_checkpoint(&d, &mut m, Some(&mut opt))?;
            let loaded = full_bits(&mut m)?;
            // Training goes on in f64 with the loaded momentum buffers (f64 state, kept
            // exactly: tests/nn_optim/f64_optim.rs).
            let (x, t) = batch(r, 1);
            let y = m.forward(&x, &Context::train())?;
            let (_, dy) = loss::mse_loss(&y, &t)?;
            m.backward(&dy, &Context::train())?;
            opt.step(&m.optimizer_params())?;
            assert_eq!(m.flat_param().dtype(), DType::F64);
            Ok(loaded)
        })?;
        for (r, l) in loaded.iter().enumerate() {
            assert_eq!(
                l, &saved[0],
                "{ty:?}: rank {r} after resuming at world size 3"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
