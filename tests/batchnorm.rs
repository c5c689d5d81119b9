//! `BatchNorm1d`, module buffers and eval mode, alone and under FSDP: finite-difference
//! gradients in f64, the running-stats update and eval mode against the formulas, FSDP at
//! world sizes 1-4 (each rank normalizes its own batch, no SyncBatchNorm) against a
//! single-process reference of replicas and against PyTorch
//! (`tests/torch_ref/make_batchnorm_refs.py`), `sync_module_states` on buffers, buffers in
//! state dicts and checkpoints, and `buffer_dtype`.

mod common;

use fsdp::checkpoint::{load_checkpoint, save_checkpoint};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{
    module_wrap_policy, FsdpConfig, FullStateDictConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy, StateDict, StateDictConfig, StateDictType,
};
use fsdp::nn::{
    self, loss, BatchNorm1d, BufferVisitor, Context, InitKey, Linear, Module, ModuleBuffer, ReLU,
    Sequential,
};
use fsdp::optim::Optimizer;
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

const B: usize = 5;
const IN: usize = 4;
const HID: usize = 6;
const OUT: usize = 3;
const STEPS: usize = 3;
const LR: f32 = 0.1;

fn closed(n: usize, cols: usize, a: f64, b: f64, k: f64, scale: f64) -> Vec<f32> {
    let mut v = Vec::with_capacity(n * cols.max(1));
    for i in 0..n {
        if cols == 0 {
            v.push((scale * (a * i as f64 + k).sin()) as f32);
        } else {
            for j in 0..cols {
                v.push((scale * (a * i as f64 + b * j as f64 + k).sin()) as f32);
            }
        }
    }
    v
}

fn set(m: &mut dyn Module, name: &str, v: Vec<f32>) {
    nn::visit_parameters(m, "", false, &mut |n, p| {
        if n == name {
            p.data()?.f32_mut()?.copy_from_slice(&v);
        }
        Ok(())
    })
    .unwrap();
}

/// Linear(4, 6) -> BatchNorm1d(6) -> ReLU -> Linear(6, 3) with the closed-form parameters
/// of `make_batchnorm_refs.py`.
fn model() -> Box<dyn Module> {
    let k = InitKey::new(0);
    let mut m = Sequential::new(vec![
        Box::new(Linear::new(IN, HID, true, &k).unwrap()),
        Box::new(BatchNorm1d::new(HID).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(HID, OUT, true, &k).unwrap()),
    ]);
    set(&mut m, "0.weight", closed(HID, IN, 0.37, 0.11, 1.0, 0.5));
    set(&mut m, "0.bias", closed(HID, 0, 0.5, 0.0, 0.3, 0.1));
    let w: Vec<f32> = closed(HID, 0, 1.0, 0.0, 0.0, 0.1)
        .iter()
        .map(|v| (1.0 + *v as f64) as f32)
        .collect();
    set(&mut m, "1.weight", w);
    set(&mut m, "1.bias", closed(HID, 0, 1.0, 0.0, 0.5, 0.05));
    set(&mut m, "3.weight", closed(OUT, HID, 0.29, 0.13, 2.0, 0.4));
    set(&mut m, "3.bias", closed(OUT, 0, 0.7, 0.0, 0.1, 0.1));
    Box::new(m)
}

fn batch(r: usize, s: usize) -> (Tensor, Tensor) {
    let mut x = Vec::new();
    for n in 0..B {
        for j in 0..IN {
            x.push(
                (0.37 * n as f64 + 0.11 * j as f64 + 0.7 * r as f64 + 1.3 * s as f64).sin() as f32,
            );
        }
    }
    let mut t = Vec::new();
    for n in 0..B {
        for k in 0..OUT {
            t.push((0.2 * n as f64 + 0.3 * k as f64 + r as f64 + s as f64).cos() as f32);
        }
    }
    (
        Tensor::from_vec(x, &[B, IN]).unwrap(),
        Tensor::from_vec(t, &[B, OUT]).unwrap(),
    )
}

/// `(name, values)` pairs.
type Named = Vec<(String, Vec<f64>)>;

/// Every buffer as f64 values, by name.
fn buffers(m: &mut dyn Module) -> Vec<(String, Vec<f64>)> {
    nn::named_buffers(m, false)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
        .collect()
}

fn max_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn check(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = max_err(got, want);
    assert!(
        e <= tol,
        "{what}: max error {e:e} > {tol:e}\n got {got:?}\nwant {want:?}"
    );
}

// ---------------------------------------------------------------- the layer alone

/// `L = sum(y * r)` in f64 of a BatchNorm1d in f64.
fn bn_loss(bn: &mut BatchNorm1d, x: &Tensor, r: &[f64], cx: &Context) -> f64 {
    let y = bn.forward(x, cx).unwrap();
    y.to_vec_f64()
        .unwrap()
        .iter()
        .zip(r)
        .map(|(a, b)| a * b)
        .sum()
}

fn gradcheck(shape: &[usize], training: bool) {
    let c = shape[1];
    let n: usize = shape.iter().product();
    let mut bn = BatchNorm1d::new(c).unwrap();
    bn.to_dtype(DType::F64).unwrap();
    let v = common::values(7, 4 * c + n * 2);
    let f64s = |o: usize, k: usize| -> Vec<f64> { v[o..o + k].iter().map(|&x| x as f64).collect() };
    nn::visit_parameters(&mut bn, "", false, &mut |name, p| {
        let d = p.data()?;
        let vals: Vec<f64> = if name == "weight" {
            f64s(0, c).iter().map(|x| 1.0 + 0.5 * x).collect()
        } else {
            f64s(c, c)
        };
        d.data_mut::<f64>()?.copy_from_slice(&vals);
        Ok(())
    })
    .unwrap();
    // Eval mode: running stats of our own, not the defaults.
    nn::visit_buffers(&mut bn, "", false, &mut |name, b| {
        match name {
            "running_mean" => b.data.data_mut::<f64>()?.copy_from_slice(&f64s(2 * c, c)),
            "running_var" => b.data.data_mut::<f64>()?.copy_from_slice(
                &f64s(3 * c, c)
                    .iter()
                    .map(|x| 1.0 + x * x)
                    .collect::<Vec<_>>(),
            ),
            _ => {}
        }
        Ok(())
    })
    .unwrap();
    let xv = f64s(4 * c, n);
    let r = f64s(4 * c + n, n);
    let x = Tensor::from_vec(xv.clone(), shape).unwrap();
    let train = Context::train().with_training(training);
    let probe = Context::no_grad().with_training(training);
    bn_loss(&mut bn, &x, &r, &train);
    let dx = bn
        .backward(&Tensor::from_vec(r.clone(), shape).unwrap(), &train)
        .unwrap()
        .to_vec_f64()
        .unwrap();
    let h = 1e-6;
    let tol = 1e-7;
    for i in 0..n {
        let mut xp = xv.clone();
        xp[i] += h;
        let lp = bn_loss(
            &mut bn,
            &Tensor::from_vec(xp.clone(), shape).unwrap(),
            &r,
            &probe,
        );
        xp[i] -= 2.0 * h;
        let lm = bn_loss(&mut bn, &Tensor::from_vec(xp, shape).unwrap(), &r, &probe);
        let num = (lp - lm) / (2.0 * h);
        assert!(
            (num - dx[i]).abs() <= tol * (1.0 + num.abs()),
            "dx[{i}] ({shape:?}, training {training}): analytic {} numeric {num}",
            dx[i]
        );
    }
    for pname in ["weight", "bias"] {
        let mut grad = Vec::new();
        let mut data = None;
        nn::visit_parameters(&mut bn, "", false, &mut |name, p| {
            if name == pname {
                grad = p.grad().unwrap().to_vec_f64()?;
                data = Some(p.data()?.clone());
            }
            Ok(())
        })
        .unwrap();
        let data = data.unwrap();
        assert_eq!(grad.len(), c);
        for (k, &gk) in grad.iter().enumerate() {
            let orig = data.data::<f64>().unwrap()[k];
            data.data_mut::<f64>().unwrap()[k] = orig + h;
            let lp = bn_loss(&mut bn, &x, &r, &probe);
            data.data_mut::<f64>().unwrap()[k] = orig - h;
            let lm = bn_loss(&mut bn, &x, &r, &probe);
            data.data_mut::<f64>().unwrap()[k] = orig;
            let num = (lp - lm) / (2.0 * h);
            assert!(
                (num - gk).abs() <= tol * (1.0 + num.abs()),
                "d{pname}[{k}] ({shape:?}, training {training}): analytic {gk} numeric {num}"
            );
        }
    }
}

#[test]
fn batchnorm_gradcheck_f64() {
    for shape in [&[5, 3][..], &[4, 2, 3], &[2, 1], &[7, 5]] {
        gradcheck(shape, true);
        gradcheck(shape, false);
    }
}

#[test]
fn running_stats_follow_pytorch_formulas() -> Result<()> {
    let (n, c) = (4, 3);
    for momentum in [Some(0.1), Some(0.5), None] {
        let mut bn = BatchNorm1d::with_options(c, 1e-5, momentum, true, true)?;
        let (mut rm, mut rv) = (vec![0.0f64; c], vec![1.0f64; c]);
        for step in 0..3 {
            let xv: Vec<f32> = common::values(step as u64 + 11, n * c)
                .iter()
                .map(|v| 2.0 * v + 0.5)
                .collect();
            let x = Tensor::from_vec(xv.clone(), &[n, c])?;
            let y = bn.forward(&x, &Context::no_grad())?.to_vec_f64()?;
            let f = momentum.unwrap_or(1.0 / (step + 1) as f64);
            for k in 0..c {
                let col: Vec<f64> = (0..n).map(|i| xv[i * c + k] as f64).collect();
                let mean = col.iter().sum::<f64>() / n as f64;
                let var = col.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
                for i in 0..n {
                    // weight 1, bias 0: the normalized input, biased variance.
                    let want = (col[i] - mean) / (var + 1e-5).sqrt();
                    assert!((y[i * c + k] - want).abs() < 1e-6, "y[{i},{k}]");
                }
                rm[k] = (1.0 - f) * rm[k] + f * mean;
                rv[k] = (1.0 - f) * rv[k] + f * var * n as f64 / (n as f64 - 1.0);
            }
            check(
                "running_mean",
                &bn.running_mean().unwrap().to_vec_f64()?,
                &rm,
                1e-6,
            );
            check(
                "running_var",
                &bn.running_var().unwrap().to_vec_f64()?,
                &rv,
                1e-6,
            );
            assert_eq!(bn.num_batches_tracked()?, Some(step as i64 + 1));
        }
        // Eval mode: running stats, unchanged by the forward; a single row is fine.
        let x = Tensor::from_vec(vec![0.3f32, -1.0, 2.0], &[1, c])?;
        let kept = bn.running_mean().unwrap().to_vec_f64()?;
        let y = bn.forward(&x, &Context::eval())?.to_vec_f64()?;
        for k in 0..c {
            let want = (x.to_vec_f64()?[k] - rm[k]) / (rv[k] + 1e-5).sqrt();
            assert!((y[k] - want).abs() < 1e-6);
        }
        check(
            "eval keeps running_mean",
            &bn.running_mean().unwrap().to_vec_f64()?,
            &kept,
            0.0,
        );
        assert_eq!(bn.num_batches_tracked()?, Some(3));
        // Training on one value per channel is PyTorch's error.
        let e = bn.forward(&x, &Context::train()).unwrap_err();
        assert!(
            e.to_string().contains("more than 1 value per channel"),
            "{e}"
        );
    }
    // No running stats: batch statistics in both modes, no buffers.
    let mut bn = BatchNorm1d::with_options(2, 1e-5, Some(0.1), false, false)?;
    assert!(nn::named_buffers(&mut bn, false)?.is_empty());
    assert!(nn::parameter_shapes(&mut bn).is_empty());
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 5.0], &[2, 2])?;
    let a = bn.forward(&x, &Context::eval())?.to_vec_f64()?;
    let b = bn.forward(&x, &Context::train())?.to_vec_f64()?;
    assert_eq!(a, b);
    // Bad input: a clear error, no panic.
    let mut bn = BatchNorm1d::new(3)?;
    assert!(bn
        .forward(
            &Tensor::from_vec(vec![1.0f32; 8], &[4, 2])?,
            &Context::train()
        )
        .is_err());
    assert!(BatchNorm1d::with_options(3, -1.0, None, true, true).is_err());
    assert!(BatchNorm1d::with_options(3, 1e-5, Some(1.5), true, true).is_err());
    assert!(bn
        .backward(
            &Tensor::from_vec(vec![1.0f32; 3], &[1, 3])?,
            &Context::train()
        )
        .is_err());
    Ok(())
}

/// A module with a persistent and a non-persistent buffer (PyTorch's
/// `register_buffer(..., persistent=False)`).
struct WithBuffers {
    lin: Linear,
    kept: ModuleBuffer,
    scratch: ModuleBuffer,
}

impl Module for WithBuffers {
    fn type_name(&self) -> &'static str {
        "WithBuffers"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.lin.forward(x, cx)
    }
    fn backward(&mut self, g: &Tensor, cx: &Context) -> Result<Tensor> {
        self.lin.backward(g, cx)
    }
    fn for_each_param(&mut self, f: &mut nn::ParamVisitor<'_>) -> Result<()> {
        self.lin.for_each_param(f)
    }
    fn for_each_buffer(&mut self, f: &mut BufferVisitor<'_>) -> Result<()> {
        f("kept", &mut self.kept)?;
        f("scratch", &mut self.scratch)
    }
}

#[test]
fn named_buffers_order_and_persistence() -> Result<()> {
    let wb = WithBuffers {
        lin: Linear::new(2, 2, true, &InitKey::new(1))?,
        kept: ModuleBuffer::new(Tensor::from_vec(vec![1.0f32, 2.0], &[2])?),
        scratch: ModuleBuffer::non_persistent(Tensor::from_vec(vec![9.0f32], &[1])?),
    };
    let mut m = Sequential::new(vec![
        Box::new(BatchNorm1d::new(2)?),
        Box::new(wb),
        Box::new(BatchNorm1d::new(2)?),
    ]);
    let all: Vec<String> = nn::named_buffers(&mut m, false)?
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        all,
        [
            "0.running_mean",
            "0.running_var",
            "0.num_batches_tracked",
            "1.kept",
            "1.scratch",
            "2.running_mean",
            "2.running_var",
            "2.num_batches_tracked"
        ]
    );
    let kept: Vec<String> = nn::named_buffers(&mut m, true)?
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!kept.contains(&"1.scratch".to_string()) && kept.len() == 7);
    let nbt = nn::named_buffers(&mut m, true)?;
    assert_eq!(nbt[2].1.dtype(), DType::I64);
    assert_eq!(nbt[2].1.shape(), &[] as &[usize]);
    // Under FSDP the full state dict holds parameters and persistent buffers in
    // model.state_dict() order, the non-persistent one left out.
    let keys = launch(&LaunchOptions::new(2), move |pg| {
        let wb = WithBuffers {
            lin: Linear::new(2, 2, true, &InitKey::new(1))?,
            kept: ModuleBuffer::new(Tensor::from_vec(vec![1.0f32, 2.0], &[2])?),
            scratch: ModuleBuffer::non_persistent(Tensor::from_vec(vec![9.0f32], &[1])?),
        };
        let m = Sequential::new(vec![Box::new(BatchNorm1d::new(2)?), Box::new(wb)]);
        let mut f = FullyShardedDataParallel::new(Box::new(m), pg, FsdpConfig::default())?;
        let sd = f.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?;
        Ok(sd.keys().iter().map(|s| s.to_string()).collect::<Vec<_>>())
    })?;
    assert_eq!(
        keys[0],
        [
            "0.weight",
            "0.bias",
            "0.running_mean",
            "0.running_var",
            "0.num_batches_tracked",
            "1.weight",
            "1.bias",
            "1.kept"
        ]
    );
    Ok(())
}

// ---------------------------------------------------------------- under FSDP

/// One training run: `world` ranks, `steps` SGD steps. Returns per rank the full
/// parameters (by name, f64) and the rank's own buffers.
type RankResult = (Vec<(String, Vec<f64>)>, Vec<(String, Vec<f64>)>, Vec<f32>);

fn fsdp_run(world: usize, strategy: ShardingStrategy, wrap_bn: bool) -> Vec<RankResult> {
    launch(&LaunchOptions::new(world), move |pg| {
        let r = pg.rank();
        let cfg = FsdpConfig {
            sharding_strategy: strategy,
            ranks_per_node: strategy
                .is_hybrid()
                .then(|| common::hybrid_ranks_per_node(world)),
            auto_wrap_policy: wrap_bn.then(|| module_wrap_policy(["BatchNorm1d", "Linear"])),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(model(), pg, cfg)?;
        let mut opt = common::sgd(LR);
        let mut losses = Vec::new();
        for s in 0..STEPS {
            let (x, t) = batch(r, s);
            let y = m.forward(&x, &Context::train())?;
            let (l, dy) = loss::mse_loss(&y, &t)?;
            m.backward(&dy, &Context::train())?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
            losses.push(l);
        }
        let params = m
            .full_parameters()?
            .into_iter()
            .map(|(n, v)| (n, v.into_iter().map(f64::from).collect()))
            .collect();
        Ok((params, buffers(&mut m), losses))
    })
    .unwrap()
}

/// The single-process reference: one unwrapped replica per rank, each normalizing its own
/// batch with its own running stats; the replicas' gradients are averaged (what FSDP's
/// reduction computes) and every replica takes the same SGD step.
fn replica_reference(world: usize) -> (Named, Vec<Named>) {
    let mut reps: Vec<Box<dyn Module>> = (0..world).map(|_| model()).collect();
    for s in 0..STEPS {
        let mut sum: Vec<Vec<f64>> = Vec::new();
        for (r, m) in reps.iter_mut().enumerate() {
            nn::zero_grad(m.as_mut());
            let (x, t) = batch(r, s);
            let y = m.forward(&x, &Context::train()).unwrap();
            let (_, dy) = loss::mse_loss(&y, &t).unwrap();
            m.backward(&dy, &Context::train()).unwrap();
            let mut k = 0;
            nn::visit_parameters(m.as_mut(), "", false, &mut |_, p| {
                let g = p.grad().unwrap().to_vec_f64()?;
                if sum.len() <= k {
                    sum.push(vec![0.0; g.len()]);
                }
                sum[k].iter_mut().zip(&g).for_each(|(a, b)| *a += b);
                k += 1;
                Ok(())
            })
            .unwrap();
        }
        for m in reps.iter_mut() {
            let mut k = 0;
            nn::visit_parameters(m.as_mut(), "", false, &mut |_, p| {
                let mut d = p.data()?.f32_mut()?;
                for (v, g) in d.iter_mut().zip(&sum[k]) {
                    *v -= LR * (*g / world as f64) as f32;
                }
                k += 1;
                Ok(())
            })
            .unwrap();
        }
    }
    let params = common::named_values(reps[0].as_mut())
        .into_iter()
        .map(|(n, v)| (n, v.into_iter().map(f64::from).collect()))
        .collect();
    let bufs = reps.iter_mut().map(|m| buffers(m.as_mut())).collect();
    (params, bufs)
}

fn torch_refs() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/torch_ref/batchnorm_refs.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn json_vec(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn fsdp_batchnorm_matches_per_rank_reference_world_1_to_4() {
    let refs = torch_refs();
    for world in 1..=4 {
        let (want_params, want_bufs) = replica_reference(world);
        let torch = &refs["worlds"][world.to_string()];
        let mut runs = vec![
            (
                "FullShard",
                fsdp_run(world, ShardingStrategy::FullShard, false),
            ),
            (
                "FullShard, nested units",
                fsdp_run(world, ShardingStrategy::FullShard, true),
            ),
            ("NoShard", fsdp_run(world, ShardingStrategy::NoShard, false)),
        ];
        if world == 4 {
            runs.push((
                "HybridShard",
                fsdp_run(world, ShardingStrategy::HybridShard, true),
            ));
        }
        for (what, ranks) in runs {
            for (r, (params, bufs, losses)) in ranks.iter().enumerate() {
                let at = format!("world {world}, {what}, rank {r}");
                for ((n, got), (wn, want)) in params.iter().zip(&want_params) {
                    assert_eq!(n, wn);
                    check(&format!("{at}: {n}"), got, want, 1e-6);
                    check(
                        &format!("{at}: {n} vs PyTorch"),
                        got,
                        &json_vec(&torch["params"][n]),
                        2e-5,
                    );
                }
                assert_eq!(bufs.len(), 3, "{at}: buffers {bufs:?}");
                for ((n, got), (wn, want)) in bufs.iter().zip(&want_bufs[r]) {
                    assert_eq!(n, wn);
                    check(&format!("{at}: {n}"), got, want, 1e-6);
                    let t = json_vec(&torch["buffers"][r][n]);
                    check(&format!("{at}: {n} vs PyTorch"), got, &t, 2e-5);
                }
                let tl: Vec<f64> = torch["losses"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s[r].as_f64().unwrap())
                    .collect();
                check(
                    &format!("{at}: losses vs PyTorch"),
                    &losses.iter().map(|&l| l as f64).collect::<Vec<_>>(),
                    &tl,
                    2e-5,
                );
            }
            if world > 1 {
                // Each rank's running stats are its own (different batches).
                assert_ne!(ranks[0].1[0].1, ranks[1].1[0].1, "world {world}, {what}");
            }
        }
    }
}

#[test]
fn eval_mode_under_fsdp_uses_running_stats() -> Result<()> {
    let refs = torch_refs();
    let want = json_vec(&refs["worlds"]["2"]["eval_out"]);
    let out = launch(&LaunchOptions::new(2), |pg| {
        let r = pg.rank();
        let mut m = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
        let mut opt = common::sgd(LR);
        for s in 0..STEPS {
            let (x, t) = batch(r, s);
            let y = m.forward(&x, &Context::train())?;
            let (_, dy) = loss::mse_loss(&y, &t)?;
            m.backward(&dy, &Context::train())?;
            opt.step(&m.optimizer_params())?;
            m.zero_grad();
        }
        let before = buffers(&mut m);
        let y = m.forward(&batch(0, 0).0, &Context::eval())?.to_vec_f64()?;
        assert_eq!(before, buffers(&mut m), "eval changed the running stats");
        Ok(y)
    })?;
    check("rank 0 eval output vs PyTorch", &out[0], &want, 2e-5);
    Ok(())
}

/// Gives each rank's BatchNorm distinct buffers, as if each had seen other data.
fn perturb_buffers(m: &mut dyn Module, rank: usize) {
    nn::visit_buffers(m, "", false, &mut |name, b| {
        let n = b.data.numel();
        let v: Vec<f64> = (0..n)
            .map(|i| 0.25 + rank as f64 * 1.5 + i as f64 / 3.0)
            .collect();
        match name {
            n if n.ends_with("num_batches_tracked") => b
                .data
                .copy_from(&Tensor::from_vec(vec![rank as i64 * 7 + 1], &[])?),
            _ => b.data.copy_from(&Tensor::from_vec(v, b.data.shape())?),
        }
    })
    .unwrap();
}

fn bits(v: &[(String, Vec<f64>)]) -> Vec<(String, Vec<u64>)> {
    v.iter()
        .map(|(n, x)| (n.clone(), x.iter().map(|f| f.to_bits()).collect()))
        .collect()
}

#[test]
fn sync_module_states_broadcasts_buffers() {
    for (world, strategy) in [
        (3, ShardingStrategy::FullShard),
        (4, ShardingStrategy::HybridShard),
        (2, ShardingStrategy::NoShard),
    ] {
        for sync in [true, false] {
            let got = launch(&LaunchOptions::new(world), move |pg| {
                let r = pg.rank();
                let mut base = model();
                perturb_buffers(base.as_mut(), r);
                let cfg = FsdpConfig {
                    sharding_strategy: strategy,
                    ranks_per_node: strategy.is_hybrid().then_some(2),
                    sync_module_states: sync,
                    auto_wrap_policy: Some(module_wrap_policy(["BatchNorm1d"])),
                    ..FsdpConfig::default()
                };
                let mut m = FullyShardedDataParallel::new(base, pg, cfg)?;
                Ok(bits(&buffers(&mut m)))
            })
            .unwrap();
            for (r, b) in got.iter().enumerate() {
                assert_eq!(b.len(), 3);
                if sync {
                    assert_eq!(
                        b, &got[0],
                        "world {world} {strategy:?}: rank {r} differs from rank 0"
                    );
                } else if r > 0 {
                    assert_ne!(
                        b, &got[0],
                        "world {world}: without sync_module_states ranks keep their own"
                    );
                }
            }
        }
    }
}

#[test]
fn state_dicts_carry_buffers_and_load_them() -> Result<()> {
    launch(&LaunchOptions::new(2), |pg| {
        let r = pg.rank();
        let mut base = model();
        perturb_buffers(base.as_mut(), r);
        let mut m = FullyShardedDataParallel::new(base, pg, FsdpConfig::default())?;
        let mine = buffers(&mut m);
        let full = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?;
        let sharded = m.state_dict(StateDictConfig::Sharded)?;
        let local = m.state_dict(StateDictConfig::Local)?;
        let StateDict::Full(f) = &full else {
            unreachable!()
        };
        let keys: Vec<&str> = full.keys();
        assert_eq!(
            keys,
            [
                "0.weight",
                "0.bias",
                "1.weight",
                "1.bias",
                "1.running_mean",
                "1.running_var",
                "1.num_batches_tracked",
                "3.weight",
                "3.bias"
            ]
        );
        assert_eq!(f.get("1.num_batches_tracked").unwrap().dtype(), DType::I64);
        assert_eq!(f.get("1.running_var").unwrap().to_vec_f64()?, mine[1].1);
        let StateDict::Sharded(s) = &sharded else {
            unreachable!()
        };
        assert_eq!(
            s.get("1.running_mean").unwrap().pieces[0]
                .data
                .to_vec_f64()?,
            mine[0].1
        );
        let StateDict::Local(l) = &local else {
            unreachable!()
        };
        assert_eq!(l.buffers.len(), 3);
        // Each kind loads back: zero the buffers, load, compare.
        for sd in [&full, &sharded, &local] {
            nn::visit_buffers(&mut m, "", false, &mut |_, b| b.data.zero_())?;
            m.load_state_dict(sd, true)?;
            assert_eq!(buffers(&mut m), mine, "{:?}", sd.state_dict_type());
        }
        // A wrong shape or a missing buffer is a clear error; nothing is written.
        let StateDict::Full(mut bad) = full.clone() else {
            unreachable!()
        };
        bad.tensors.retain(|(n, _)| n != "1.running_mean");
        let e = m
            .load_state_dict(&StateDict::Full(bad.clone()), true)
            .unwrap_err();
        assert!(e.to_string().contains("1.running_mean"), "{e}");
        let keys = m.load_state_dict(&StateDict::Full(bad.clone()), false)?;
        assert_eq!(keys.missing_keys, ["1.running_mean"]);
        bad.tensors.push((
            "1.running_mean".into(),
            Tensor::from_vec(vec![0.0f32; 5], &[5])?,
        ));
        let e = m.load_state_dict(&StateDict::Full(bad), true).unwrap_err();
        assert!(e.to_string().contains("expected shape [6]"), "{e}");
        Ok(())
    })?;
    Ok(())
}

#[test]
fn buffers_survive_checkpoint_resume_at_another_world_size() -> Result<()> {
    for ty in [StateDictType::Sharded, StateDictType::Full] {
        let dir = std::env::temp_dir().join(format!("fsdp-bn-{}-{ty:?}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let d = dir.clone();
        let saved = launch(&LaunchOptions::new(2), move |pg| {
            let r = pg.rank();
            let mut m = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
            let mut opt = common::sgd(LR);
            for s in 0..2 {
                let (x, t) = batch(r, s);
                let y = m.forward(&x, &Context::train())?;
                let (_, dy) = loss::mse_loss(&y, &t)?;
                m.backward(&dy, &Context::train())?;
                opt.step(&m.optimizer_params())?;
                m.zero_grad();
            }
            save_checkpoint(&d, &mut m, Some(&opt), ty, serde_json::Value::Null)?;
            Ok((buffers(&mut m), m.full_parameters()?))
        })?;
        let d = dir.clone();
        let loaded = launch(&LaunchOptions::new(3), move |pg| {
            let mut m = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
            let mut opt = common::sgd(LR);
            load_checkpoint(&d, &mut m, Some(&mut opt))?;
            Ok((buffers(&mut m), m.full_parameters()?))
        })?;
        for (r, (b, p)) in loaded.iter().enumerate() {
            // Every rank resumes with rank 0's saved buffers (as a PyTorch load does).
            assert_eq!(b, &saved[0].0, "{ty:?}: rank {r} buffers");
            assert_eq!(p, &saved[0].1, "{ty:?}: rank {r} parameters");
        }
        assert_eq!(
            saved[0].0[2].1,
            vec![2.0],
            "num_batches_tracked after 2 steps"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

#[test]
fn buffer_dtype_rounds_buffers_at_forward() -> Result<()> {
    let out = launch(&LaunchOptions::new(2), |pg| {
        let mut base = model();
        // Values that bf16 cannot hold.
        nn::visit_buffers(base.as_mut(), "", false, &mut |n, b| {
            if n.ends_with("running_mean") {
                b.data
                    .copy_from(&Tensor::from_vec(vec![0.1f32 + 1e-4; HID], &[HID])?)?;
            }
            Ok(())
        })?;
        let cfg = FsdpConfig {
            mixed_precision: Some(MixedPrecision {
                buffer_dtype: Some(DType::BF16),
                ..MixedPrecision::default()
            }),
            ..FsdpConfig::default()
        };
        let mut m = FullyShardedDataParallel::new(base, pg, cfg)?;
        let before = buffers(&mut m)[0].1.clone();
        m.forward(&batch(0, 0).0, &Context::eval())?;
        let after = buffers(&mut m)[0].1.clone();
        let sd = m.state_dict(StateDictConfig::Full(FullStateDictConfig::default()))?;
        let StateDict::Full(f) = sd else {
            unreachable!()
        };
        Ok((before, after, f.get("1.running_mean").unwrap().dtype()))
    })?;
    let (before, after, dtype) = &out[0];
    assert!(before.iter().all(|&v| v as f32 == 0.1f32 + 1e-4));
    let want = half::bf16::from_f32(0.1f32 + 1e-4).to_f32() as f64;
    assert!(after.iter().all(|&v| v == want), "{after:?} vs {want}");
    assert_eq!(
        *dtype,
        DType::F32,
        "state dicts return buffers in full precision"
    );
    Ok(())
}
