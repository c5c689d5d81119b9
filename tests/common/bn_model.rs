//! The model, data and checks shared by tests/nn_optim/batchnorm.rs and tests/fsdp/batchnorm_fsdp.rs:
//! Linear(4, 6) -> BatchNorm1d(6) -> ReLU -> Linear(6, 3) with the closed-form parameters
//! and batches of `tests/torch_ref/make_batchnorm_refs.py`, and its PyTorch reference.
#![allow(dead_code)]

use fsdp::nn::{self, BatchNorm1d, InitKey, Linear, Module, ReLU, Sequential};
use fsdp::tensor::Tensor;

pub const B: usize = 5;
pub const IN: usize = 4;
pub const HID: usize = 6;
pub const OUT: usize = 3;
pub const STEPS: usize = 3;
pub const LR: f32 = 0.1;

pub fn closed(n: usize, cols: usize, a: f64, b: f64, k: f64, scale: f64) -> Vec<f32> {
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

pub fn set(m: &mut dyn Module, name: &str, v: Vec<f32>) {
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
pub fn model() -> Box<dyn Module> {
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

pub fn batch(r: usize, s: usize) -> (Tensor, Tensor) {
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
pub type Named = Vec<(String, Vec<f64>)>;

/// Every buffer as f64 values, by name.
pub fn buffers(m: &mut dyn Module) -> Vec<(String, Vec<f64>)> {
    nn::named_buffers(m, false)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f64().unwrap()))
        .collect()
}

pub fn max_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Asserts `max |got - want| <= tol` and returns the max error.
pub fn check(what: &str, got: &[f64], want: &[f64], tol: f64) -> f64 {
    let e = max_err(got, want);
    assert!(
        e <= tol,
        "{what}: max error {e:e} > {tol:e}\n got {got:?}\nwant {want:?}"
    );
    e
}

pub fn torch_refs() -> serde_json::Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/torch_ref/batchnorm_refs.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn json_vec(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Gives each rank's BatchNorm distinct buffers, as if each had seen other data.
pub fn perturb_buffers(m: &mut dyn Module, rank: usize) {
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

pub fn bits(v: &[(String, Vec<f64>)]) -> Vec<(String, Vec<u64>)> {
    v.iter()
        .map(|(n, x)| (n.clone(), x.iter().map(|f| f.to_bits()).collect()))
        .collect()
}

/// Plain SGD (`p -= LR * grad`) on the unwrapped model, one training-mode step on rank
/// `r`'s batch of each step in `steps` (one rank of FSDP at world size 1 computes the
/// same), so its running stats and `num_batches_tracked` move.
pub fn train_unwrapped(m: &mut dyn Module, r: usize, steps: std::ops::Range<usize>) {
    for s in steps {
        nn::zero_grad(m);
        let (x, t) = batch(r, s);
        let y = m.forward(&x, &nn::Context::train()).unwrap();
        let (_, dy) = nn::loss::mse_loss(&y, &t).unwrap();
        m.backward(&dy, &nn::Context::train()).unwrap();
        nn::visit_parameters(m, "", false, &mut |_, p| {
            let g = p.grad().unwrap().to_vec_f32()?;
            let mut d = p.data()?.f32_mut()?;
            d.iter_mut().zip(&g).for_each(|(v, g)| *v -= LR * g);
            Ok(())
        })
        .unwrap();
    }
}

/// The eval-mode output (running stats, nothing saved) of `m` on rank 0's step-0 batch:
/// the input of the PyTorch reference's `eval_out`.
pub fn eval_out(m: &mut dyn Module) -> Vec<f32> {
    m.forward(&batch(0, 0).0, &nn::Context::eval())
        .unwrap()
        .to_vec_f32()
        .unwrap()
}

/// Bits of f32 values, for exact comparisons.
pub fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The keys of `model.state_dict()` for [`model`], in order: each module's parameters,
/// then its persistent buffers.
pub const STATE_DICT_KEYS: [&str; 9] = [
    "0.weight",
    "0.bias",
    "1.weight",
    "1.bias",
    "1.running_mean",
    "1.running_var",
    "1.num_batches_tracked",
    "3.weight",
    "3.bias",
];

/// `(key, dtype)` of every entry of a state dict, in its order.
pub fn keys_and_dtypes(sd: &nn::FullStateDict) -> Vec<(String, fsdp::tensor::DType)> {
    sd.tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.dtype()))
        .collect()
}
