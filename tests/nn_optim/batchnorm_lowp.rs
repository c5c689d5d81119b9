//! `BatchNorm1d` with a bf16/f16 input, weight, bias and running stats against PyTorch
//! 2.11's CPU kernel (`tests/torch_ref/batchnorm_lowp_refs.json`, made by
//! `tests/torch_ref/make_batchnorm_lowp_refs.py`): training forward (output and the
//! running-stats update), its backward (dx, dw, db), then evaluation with the updated
//! running stats, forward and backward. Inputs `(N, C)` and `(N, C, L)`, with `L` below, at
//! and above PyTorch's 16-value blocks and 32-value vectors.
//!
//! Every value bit for bit, both dtypes (8 cases x 2 modes): with PyTorch's rounding points
//! and summation order (`ops/batchnorm/reduced.rs`: its AVX2 kernel's 16-value blocks and 8
//! lanes added in order, fused multiply-adds where its compiler forms them, and f32
//! statistics for f16 where bf16 rounds them to the parameters' dtype).

use fsdp::nn::{self, BatchNorm1d, Context, Module};
use fsdp::tensor::{DType, Tensor};
use serde_json::Value;

fn refs() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/torch_ref/batchnorm_lowp_refs.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The f32 values of a list of bf16/f16 bit patterns.
fn vals(v: &Value, dtype: DType) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| {
            let b = b.as_u64().unwrap() as u16;
            if dtype == DType::BF16 {
                half::bf16::from_bits(b).to_f32()
            } else {
                half::f16::from_bits(b).to_f32()
            }
        })
        .collect()
}

fn tensor(v: Vec<f32>, shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v, shape).unwrap().to_dtype(dtype).unwrap()
}

/// Number of elements of `got` that differ from the reference `want` (bits of the dtype),
/// and the largest difference in ulps of the dtype at the tensor's largest magnitude.
fn mismatches(got: &Tensor, want: &Value, dtype: DType) -> (usize, f64) {
    assert_eq!(got.dtype(), dtype);
    let w = vals(want, dtype);
    let g = got.to_vec_f32().unwrap();
    assert_eq!(g.len(), w.len());
    let big = w.iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs())) as f64;
    let bits = if dtype == DType::BF16 { 8.0 } else { 11.0 };
    let ulp = 2f64.powf(big.log2().floor() - (bits - 1.0));
    let worst = g
        .iter()
        .zip(&w)
        .map(|(a, b)| (a - b).abs() as f64 / ulp)
        .fold(0.0, f64::max);
    let bad = g
        .iter()
        .zip(&w)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    (bad, worst)
}

#[test]
fn bf16_and_f16_batchnorm_match_pytorch_bit_for_bit() {
    let refs = refs();
    let mut failures = Vec::new();
    for (name, dtype) in [("bf16", DType::BF16), ("f16", DType::F16)] {
        for case in refs["cases"][name].as_array().unwrap() {
            let shape: Vec<usize> = case["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let c = shape[1];
            let mut bn = BatchNorm1d::new(c).unwrap();
            bn.to_dtype(dtype).unwrap();
            nn::visit_parameters(&mut bn, "", false, &mut |n, p| {
                let key = if n == "weight" { "w" } else { "b" };
                p.data()?
                    .copy_from(&tensor(vals(&case[key], dtype), &[c], dtype))
            })
            .unwrap();
            nn::visit_buffers(&mut bn, "", false, &mut |n, b| {
                let key = match n {
                    "running_mean" => "rm",
                    "running_var" => "rv",
                    _ => return Ok(()),
                };
                b.data
                    .copy_from(&tensor(vals(&case[key], dtype), &[c], dtype))
            })
            .unwrap();
            let x = tensor(vals(&case["x"], dtype), &shape, dtype);
            let dy = tensor(vals(&case["dy"], dtype), &shape, dtype);
            for mode in ["train", "eval"] {
                let cx = Context::train().with_training(mode == "train");
                let want = &case[mode];
                let mut check = |what: &str, t: &Tensor| {
                    let (bad, ulps) = mismatches(t, &want[what], dtype);
                    println!(
                        "{name} {shape:?} {mode} {what}: {bad} of {} differ, worst {ulps:.3} ulps",
                        t.numel()
                    );
                    if bad > 0 {
                        failures.push(format!("{name} {shape:?} {mode} {what}: {bad}"));
                    }
                };
                let y = bn.forward(&x, &cx).unwrap();
                check("y", &y);
                if mode == "train" {
                    nn::visit_buffers(&mut bn, "", false, &mut |n, b| {
                        match n {
                            "running_mean" => check("rm", &b.data),
                            "running_var" => check("rv", &b.data),
                            _ => {}
                        }
                        Ok(())
                    })
                    .unwrap();
                }
                nn::visit_parameters(&mut bn, "", false, &mut |_, p| {
                    p.set_grad(None);
                    Ok(())
                })
                .unwrap();
                let dx = bn.backward(&dy, &cx).unwrap();
                check("dx", &dx);
                nn::visit_parameters(&mut bn, "", false, &mut |n, p| {
                    let g = p.grad().unwrap().clone();
                    check(if n == "weight" { "dw" } else { "db" }, &g);
                    Ok(())
                })
                .unwrap();
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
