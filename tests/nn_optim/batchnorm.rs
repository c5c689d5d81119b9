//! `BatchNorm1d`, module buffers and eval mode on one process: finite-difference
//! gradients in f64, the running-stats update and eval mode against PyTorch's formulas,
//! `named_buffers()` order and non-persistent buffers, buffers in the unwrapped model's
//! state dict and its files. Under FSDP: tests/fsdp/batchnorm_fsdp.rs.

use crate::bn_model;
use crate::common;

use bn_model::check;
use fsdp::checkpoint::{load_state_dict_file, save_state_dict_file};
use fsdp::distributed::{launch, LaunchOptions};
use fsdp::fsdp::{FsdpConfig, FullStateDictConfig, FullyShardedDataParallel, StateDictConfig};
use fsdp::nn::{
    self, BatchNorm1d, BufferVisitor, Context, InitKey, Linear, Module, ModuleBuffer, Sequential,
};
use fsdp::tensor::{DType, Tensor};
use fsdp::Result;

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
    fn for_each_child(&mut self, f: &mut nn::ChildVisitor<'_>) -> Result<()> {
        nn::no_children(f)
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
    let two = || -> Result<Sequential> {
        let wb = WithBuffers {
            lin: Linear::new(2, 2, true, &InitKey::new(1))?,
            kept: ModuleBuffer::new(Tensor::from_vec(vec![1.0f32, 2.0], &[2])?),
            scratch: ModuleBuffer::non_persistent(Tensor::from_vec(vec![9.0f32], &[1])?),
        };
        Ok(Sequential::new(vec![
            Box::new(BatchNorm1d::new(2)?),
            Box::new(wb),
        ]))
    };
    let keys = launch(&LaunchOptions::new(2), move |pg| {
        let mut f = FullyShardedDataParallel::new(Box::new(two()?), pg, FsdpConfig::default())?;
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
    // The unwrapped model's state dict: the same keys.
    let sd = nn::state_dict(&mut two()?)?;
    assert_eq!(sd.keys().collect::<Vec<_>>(), keys[0]);
    Ok(())
}

// ---------------------------------------------------------------- unwrapped state dicts

/// `nn::state_dict` of the unwrapped BatchNorm model after 3 training steps: PyTorch's
/// `state_dict()` keys (its `named_parameters()` and `named_buffers()` in
/// `batchnorm_refs.json`, `num_batches_tracked` an integer there), in `state_dict()` order,
/// the same keys and dtypes as FSDP's full state dict of the model; saved to a file and
/// loaded strictly into a fresh model, the eval output is the same bits (and PyTorch's).
#[test]
fn unwrapped_state_dict_carries_buffers_through_a_file() -> Result<()> {
    use bn_model::*;
    let mut a = model();
    train_unwrapped(a.as_mut(), 0, 0..STEPS);
    let sd = nn::state_dict(a.as_mut())?;
    assert_eq!(sd.keys().collect::<Vec<_>>(), STATE_DICT_KEYS);
    let dtypes = keys_and_dtypes(&sd);
    for (n, d) in &dtypes {
        let want = if n.ends_with("num_batches_tracked") {
            DType::I64
        } else {
            DType::F32
        };
        assert_eq!(*d, want, "{n}");
    }
    // PyTorch's keys: the reference's parameters and (all persistent) buffers.
    let refs = torch_refs();
    let w1 = &refs["worlds"]["1"];
    let mut torch_keys: Vec<String> = w1["params"].as_object().unwrap().keys().cloned().collect();
    torch_keys.extend(w1["buffers"][0].as_object().unwrap().keys().cloned());
    torch_keys.sort();
    let mut ours: Vec<String> = sd.keys().map(str::to_string).collect();
    ours.sort();
    assert_eq!(ours, torch_keys);
    let nbt = &w1["buffers"][0]["1.num_batches_tracked"][0];
    assert!(
        nbt.is_i64(),
        "PyTorch's num_batches_tracked is an integer: {nbt}"
    );
    assert_eq!(
        sd.get("1.num_batches_tracked").unwrap().data::<i64>()?[0],
        nbt.as_i64().unwrap()
    );
    for n in ["1.running_mean", "1.running_var"] {
        let got = sd.get(n).unwrap().to_vec_f64()?;
        check(
            &format!("{n} vs PyTorch"),
            &got,
            &json_vec(&w1["buffers"][0][n]),
            1e-6,
        );
    }
    // FSDP's full state dict of the same model: the same keys, order and dtypes.
    let wrapped = launch(&LaunchOptions::new(1), |pg| {
        let mut f = FullyShardedDataParallel::new(model(), pg, FsdpConfig::default())?;
        Ok(keys_and_dtypes(
            &f.full_state_dict(FullStateDictConfig::default())?,
        ))
    })?;
    assert_eq!(wrapped[0], dtypes);

    // Through a file into a fresh model: strict, every entry used, same eval bits.
    let dir = std::env::temp_dir().join(format!("fsdp-bn-unwrapped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    save_state_dict_file(&path, &sd)?;
    let loaded = load_state_dict_file(&path)?;
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        loaded.get("1.num_batches_tracked").unwrap().dtype(),
        DType::I64
    );
    let mut b = model();
    let want = eval_out(a.as_mut());
    assert_ne!(
        f32_bits(&eval_out(b.as_mut())),
        f32_bits(&want),
        "untrained model"
    );
    let skipped = nn::load_state_dict(b.as_mut(), &loaded, true)?;
    assert_eq!(skipped, nn::IncompatibleKeys::default());
    assert_eq!(bits(&buffers(b.as_mut())), bits(&buffers(a.as_mut())));
    assert_eq!(f32_bits(&eval_out(b.as_mut())), f32_bits(&want));
    let got: Vec<f64> = want.iter().map(|&v| v as f64).collect();
    check(
        "eval output vs PyTorch",
        &got,
        &json_vec(&w1["eval_out"]),
        1e-6,
    );
    Ok(())
}

/// A strict load into the unwrapped model names each missing, unexpected, misshapen and
/// mistyped buffer and writes nothing; a non-strict one loads the rest and reports the
/// skipped keys; a non-persistent buffer is neither saved nor loaded.
#[test]
fn unwrapped_load_checks_buffers() -> Result<()> {
    use bn_model::*;
    let mut a = model();
    train_unwrapped(a.as_mut(), 1, 0..2);
    let sd = nn::state_dict(a.as_mut())?;
    let mut m = model();
    let before = bits(&buffers(m.as_mut()));
    let mut bad = sd.clone();
    bad.tensors.retain(|(n, _)| n != "1.num_batches_tracked");
    bad.tensors
        .push(("1.bogus".into(), Tensor::from_vec(vec![1.0f32], &[1])?));
    for (n, t) in bad.tensors.iter_mut() {
        match n.as_str() {
            "1.running_var" => *t = Tensor::from_vec(vec![1.0f32; 5], &[5])?,
            "1.running_mean" => *t = Tensor::from_vec(vec![0i64; HID], &[HID])?,
            _ => {}
        }
    }
    let e = nn::load_state_dict(m.as_mut(), &bad, true)
        .unwrap_err()
        .to_string();
    for want in [
        "'1.running_var': expected shape [6], got [5]",
        "'1.running_mean': expected a buffer of dtype f32, got i64",
        "missing key(s): '1.num_batches_tracked' (buffer of shape [], i64)",
        "unexpected key(s): '1.bogus'",
        "nothing was modified",
    ] {
        assert!(e.contains(want), "{want}\nnot in: {e}");
    }
    assert_eq!(bits(&buffers(m.as_mut())), before, "a failed load wrote");
    // Only the missing and unexpected keys: strict refuses, non-strict loads the rest.
    let mut partial = sd.clone();
    partial
        .tensors
        .retain(|(n, _)| n != "1.num_batches_tracked");
    partial
        .tensors
        .push(("1.bogus".into(), Tensor::from_vec(vec![1.0f32], &[1])?));
    let e = nn::load_state_dict(m.as_mut(), &partial, true).unwrap_err();
    assert!(e.to_string().contains("'1.num_batches_tracked'"), "{e}");
    let keys = nn::load_state_dict(m.as_mut(), &partial, false)?;
    assert_eq!(keys.missing_keys, ["1.num_batches_tracked"]);
    assert_eq!(keys.unexpected_keys, ["1.bogus"]);
    let (got, want) = (buffers(m.as_mut()), buffers(a.as_mut()));
    assert_eq!(bits(&got[..2]), bits(&want[..2]), "running stats loaded");
    assert_eq!(got[2].1, [0.0], "num_batches_tracked left as it was");
    assert_eq!(want[2].1, [2.0]);

    // A non-persistent buffer: not in the state dict, and unexpected in one.
    let wb = || -> Result<WithBuffers> {
        Ok(WithBuffers {
            lin: Linear::new(2, 2, true, &InitKey::new(1))?,
            kept: ModuleBuffer::new(Tensor::from_vec(vec![1.0f32, 2.0], &[2])?),
            scratch: ModuleBuffer::non_persistent(Tensor::from_vec(vec![9.0f32], &[1])?),
        })
    };
    let mut w = wb()?;
    let mut sd = nn::state_dict(&mut w)?;
    assert_eq!(sd.keys().collect::<Vec<_>>(), ["weight", "bias", "kept"]);
    sd.tensors
        .push(("scratch".into(), Tensor::from_vec(vec![0.0f32], &[1])?));
    let e = nn::load_state_dict(&mut wb()?, &sd, true).unwrap_err();
    assert!(
        e.to_string().contains("unexpected key(s): 'scratch'"),
        "{e}"
    );
    Ok(())
}
