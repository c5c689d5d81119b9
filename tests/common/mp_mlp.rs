//! The model and data of `tests/torch_ref/make_mixed_precision_refs.py`, shared by
//! tests/fsdp/mixed_precision_torch.rs and tests/fsdp/grad_scaler.rs (whose PyTorch references
//! `tests/torch_ref/make_grad_scaler_refs.py` builds from the same script): Linear(8, 16)
//! -> GELU -> LayerNorm(16) -> Linear(16, 16) -> ReLU -> Linear(16, 4) with closed-form
//! parameters, and a closed-form 12-row batch per step.
#![allow(dead_code)]

use fsdp::nn::{visit_parameters, InitKey, LayerNorm, Linear, Module, ReLU, Sequential, GELU};
use fsdp::optim::{Adam, AdamConfig, Optimizer, SgdConfig, SGD};

/// Rows of a step's global batch.
pub const ROWS: usize = 12;
/// Input features.
pub const IN: usize = 8;
/// Hidden width.
pub const HID: usize = 16;
/// Outputs.
pub const OUT: usize = 4;

/// `offset + scale * sin(a i + b j + k)` in f64, rounded to f32 (rows of `cols`; `cols` 0
/// for a vector).
pub fn closed(n: usize, cols: usize, a: f64, b: f64, k: f64, scale: f64, offset: f64) -> Vec<f32> {
    let mut v = Vec::new();
    for i in 0..n {
        for j in 0..cols.max(1) {
            v.push((offset + scale * (a * i as f64 + b * j as f64 + k).sin()) as f32);
        }
    }
    v
}

/// The closed-form parameters of `make_mixed_precision_refs.py::init_params`, by name.
pub fn init_params() -> Vec<(&'static str, Vec<f32>)> {
    vec![
        ("0.weight", closed(HID, IN, 0.37, 0.11, 1.0, 0.4, 0.0)),
        ("0.bias", closed(HID, 0, 0.5, 0.0, 0.3, 0.1, 0.0)),
        ("2.weight", closed(HID, 0, 1.0, 0.0, 0.0, 0.1, 1.0)),
        ("2.bias", closed(HID, 0, 1.0, 0.0, 0.5, 0.05, 0.0)),
        ("3.weight", closed(HID, HID, 0.29, 0.13, 2.0, 0.3, 0.0)),
        ("3.bias", closed(HID, 0, 0.7, 0.0, 0.1, 0.1, 0.0)),
        ("5.weight", closed(OUT, HID, 0.23, 0.17, 3.0, 0.3, 0.0)),
        ("5.bias", closed(OUT, 0, 0.9, 0.0, 0.2, 0.1, 0.0)),
    ]
}

/// Linear(8, 16) -> GELU -> LayerNorm(16) -> Linear(16, 16) -> ReLU -> Linear(16, 4).
pub fn model() -> Box<dyn Module> {
    let k = InitKey::new(0);
    let mut m = Sequential::new(vec![
        Box::new(Linear::new(IN, HID, true, &k).unwrap()),
        Box::new(GELU::new()),
        Box::new(LayerNorm::new(HID).unwrap()),
        Box::new(Linear::new(HID, HID, true, &k).unwrap()),
        Box::new(ReLU::new()),
        Box::new(Linear::new(HID, OUT, true, &k).unwrap()),
    ]);
    let init = init_params();
    let mut seen = 0;
    visit_parameters(&mut m, "", false, &mut |n, p| {
        let (_, v) = init.iter().find(|(name, _)| *name == n).unwrap();
        p.data()?.f32_mut()?.copy_from_slice(v);
        seen += 1;
        Ok(())
    })
    .unwrap();
    assert_eq!(seen, init.len());
    Box::new(m)
}

/// Step `s`'s global batch: x [12, 8] and target [12, 4].
pub fn batch(s: usize) -> (Vec<f32>, Vec<f32>) {
    let s = s as f64;
    let mut x = Vec::new();
    for n in 0..ROWS {
        for j in 0..IN {
            x.push((0.37 * n as f64 + 0.11 * j as f64 + 1.3 * s).sin() as f32);
        }
    }
    let mut t = Vec::new();
    for n in 0..ROWS {
        for k in 0..OUT {
            t.push((0.5 * (0.2 * n as f64 + 0.3 * k as f64 + s).cos()) as f32);
        }
    }
    (x, t)
}

/// One ulp at `v` of a binary format with `mant` stored mantissa bits whose smallest
/// normal exponent is `min_exp` (f16: 10, -14; bf16: 7, -126): the spacing of its values
/// around `|v|`, the subnormal spacing below the smallest normal.
pub fn ulp(v: f32, mant: i32, min_exp: i32) -> f32 {
    let e = if v == 0.0 {
        min_exp
    } else {
        (v.abs().log2().floor() as i32).max(min_exp)
    };
    2f32.powi(e - mant)
}

/// The references' optimizers by name: `sgd` (lr 0.1, momentum 0.9), `adam` (lr 0.01).
pub fn optimizer(name: &str) -> Box<dyn Optimizer> {
    match name {
        "sgd" => Box::new(SGD::new(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        })),
        "adam" => Box::new(Adam::new(AdamConfig {
            lr: 0.01,
            ..AdamConfig::adam()
        })),
        _ => unreachable!(),
    }
}
