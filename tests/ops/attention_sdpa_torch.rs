//! `ops::sdpa_causal` and its backward (bf16/f16 causal attention in one op) against
//! PyTorch 2.11's CPU `F.scaled_dot_product_attention(q, k, v, is_causal=True)`
//! (`tests/torch_ref/sdpa_refs.safetensors`, made by `tests/torch_ref/make_sdpa_refs.py`):
//! - forward: bf16 `out` and the saved log-sum-exp `lse` bit for bit in every case (T = 1
//!   to 200, multiples of 16 and not, head widths 8 to 64); f16 `out` within 1 ulp (1
//!   element of 25k differs) and `lse` within [`F16_LSE_ULPS`] f32 ulps: PyTorch runs f16
//!   GEMMs in a fallback (no oneDNN f16 GEMM on this CPU) that sums the scores in another
//!   order than its bf16 GEMM (and ours);
//! - backward: `dq, dk, dv` within [`ULPS`] of each value or [`SCALE_ULPS`] of the tensor's
//!   largest (a near-cancelled element), at most [`FRACTION`] of the elements differing at
//!   all. The steps are PyTorch's, but its GEMMs sum some products in another order (and
//!   round `alpha * sum + c` in f16 at per-query-block accumulations): measured, bf16 1
//!   element of 63k (a near-0 dq, 8 of its ulps, 8e-6 ulp of the largest), f16 55 of 63k
//!   (at most 2 ulps, or 1 ulp of the largest). (`expf` in place of `exp_u20` alone
//!   moves 2-31% of the outputs.)
//! - the CUDA variant (`_cuda`) runs the device kernels on the same inputs and compares
//!   them with the CPU op bit for bit under cuda-emu (`CUDA_EMU_DEVICES` set: the kernels
//!   are the host's arithmetic), within the tolerances above on a real GPU (its `expf`
//!   and `logf` differ).
//! - `CausalSelfAttention` in bf16 runs this op: its output equals the op's on the same
//!   projections.

use crate::common;
use crate::device_test;

use fsdp::backend::Device;
use fsdp::ops::{self, HeadDims};
use fsdp::tensor::{DType, Tensor};
use half::{bf16, f16};
use safetensors::SafeTensors;

/// Largest gradient difference accepted, in units in the last place of the dtype (of the
/// larger magnitude of the two values) ...
const ULPS: f32 = 2.0;
/// ... or in units in the last place of the tensor's largest magnitude (a near-cancelled
/// element).
const SCALE_ULPS: f32 = 1.0;
/// Largest difference of an f16 case's `lse` from PyTorch, in f32 ulps.
const F16_LSE_ULPS: f32 = 4.0;
/// Largest fraction of gradient elements allowed to differ from PyTorch at all.
const FRACTION: f64 = 0.005;

fn refs() -> Vec<u8> {
    std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/torch_ref/sdpa_refs.safetensors"
    ))
    .unwrap()
}

/// The cases in the file: `(dtype name, dims)`.
fn cases(st: &SafeTensors) -> Vec<(String, HeadDims)> {
    let mut keys: Vec<String> = st
        .names()
        .into_iter()
        .filter(|n| n.ends_with("/out"))
        .map(|n| n.trim_end_matches("/out").to_string())
        .collect();
    keys.sort();
    keys.into_iter()
        .map(|k| {
            let (dt, dims) = k.split_once('/').unwrap();
            let v: Vec<usize> = dims.split('x').map(|x| x.parse().unwrap()).collect();
            let d = HeadDims {
                b: v[0],
                h: v[1],
                t: v[2],
                hd: v[3],
            };
            (dt.to_string(), d)
        })
        .collect()
}

fn load(st: &SafeTensors, key: &str, dev: Device) -> Tensor {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
    let shape = t.shape().to_vec();
    let b = t.data();
    let host = match t.dtype() {
        safetensors::Dtype::BF16 => Tensor::from_vec(
            b.chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            &shape,
        ),
        safetensors::Dtype::F16 => Tensor::from_vec(
            b.chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            &shape,
        ),
        safetensors::Dtype::F32 => Tensor::from_vec(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            &shape,
        ),
        other => panic!("{key}: dtype {other:?}"),
    }
    .unwrap();
    if dev == Device::Cpu {
        host
    } else {
        host.to_device(dev).unwrap()
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec_f32().unwrap()
}

/// One unit in the last place of `x` in `dt` (values below the smallest normal count as
/// the smallest normal).
fn ulp(x: f32, dt: DType) -> f32 {
    let (mant, tiny) = match dt {
        DType::BF16 => (7, f32::MIN_POSITIVE),
        DType::F16 => (10, 6.103_515_6e-5),
        _ => (23, f32::MIN_POSITIVE),
    };
    2f32.powi(x.abs().max(tiny).log2().floor() as i32 - mant)
}

/// `(elements that differ, largest difference in ulps of the larger of the two)` of `got`
/// against `want` in `dt`.
fn ulp_diff(got: &[f32], want: &[f32], dt: DType) -> (usize, f32) {
    assert_eq!(got.len(), want.len());
    let mut n = 0;
    let mut worst = 0.0f32;
    for (&g, &w) in got.iter().zip(want) {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        n += 1;
        worst = worst.max((g - w).abs() / ulp(g.abs().max(w.abs()), dt));
    }
    (n, worst)
}

/// The largest gradient difference in ulps of the tensor's largest magnitude: where a
/// gradient element is a near-cancellation (much smaller than its neighbours), another
/// summation order moves it by many of its own ulps but by a fraction of the tensor's.
fn scale_ulps(got: &[f32], want: &[f32], dt: DType) -> f32 {
    let top = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    worst / ulp(top, dt)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn on_emulator() -> bool {
    std::env::var("CUDA_EMU_DEVICES").is_ok()
}

fn against_torch(dev: Device) -> fsdp::Result<()> {
    let bytes = refs();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let all = cases(&st);
    assert_eq!(all.len(), 18, "cases in the reference file");
    let (mut grads, mut differ, mut out_differ) = (0usize, 0usize, 0usize);
    for (dt_name, d) in all {
        let key = format!("{dt_name}/{}x{}x{}x{}", d.b, d.h, d.t, d.hd);
        let get = |n: &str| load(&st, &format!("{key}/{n}"), dev);
        let (q, k, v, dout) = (get("q"), get("k"), get("v"), get("dout"));
        let dt = q.dtype();
        let (out, lse) = ops::sdpa_causal(&q, &k, &v, d)?;
        assert_eq!(out.dtype(), dt);
        let [dq, dk, dv] = ops::sdpa_causal_backward((&q, &k, &v), &out, &lse, &dout, d)?;
        let want = |n: &str| values(&load(&st, &format!("{key}/{n}"), Device::Cpu));
        let exact = dev == Device::Cpu || on_emulator();
        for (name, got) in [("out", &out), ("lse", &lse)] {
            let (n, u) = ulp_diff(
                &values(got),
                &want(name),
                if name == "lse" { DType::F32 } else { dt },
            );
            eprintln!("{key}: {name}: {n} differ, {u} ulps");
            if exact && dt == DType::BF16 {
                assert_eq!(
                    n, 0,
                    "{key}: {name}: {n} elements differ from PyTorch ({u} ulps)"
                );
            }
            // f16: PyTorch's fallback GEMM sums the scores in another order (see the top).
            let tol = if name == "lse" { F16_LSE_ULPS } else { 1.0 };
            assert!(u <= tol, "{key}: {name} {u} ulps from PyTorch on {dev}");
            out_differ += n;
        }
        for (name, g) in [("dq", &dq), ("dk", &dk), ("dv", &dv)] {
            let got = values(g);
            let w = want(name);
            let (n, u) = ulp_diff(&got, &w, dt);
            let su = scale_ulps(&got, &w, dt);
            eprintln!("{key}: {name}: {n} differ, {u} ulps, {su} ulps of the largest");
            assert!(
                u <= ULPS || su <= SCALE_ULPS,
                "{key}: {name} {u} ulps ({su} of the largest) from PyTorch ({n} elements differ)"
            );
            grads += got.len();
            differ += n;
        }
        if dev != Device::Cpu {
            // The device kernels against the CPU op on the same inputs.
            let host = |t: &Tensor| t.to_device(Device::Cpu).unwrap();
            let (o2, l2) = ops::sdpa_causal(&host(&q), &host(&k), &host(&v), d)?;
            let g2 = ops::sdpa_causal_backward(
                (&host(&q), &host(&k), &host(&v)),
                &o2,
                &l2,
                &host(&dout),
                d,
            )?;
            for (name, a, b) in [
                ("out", &out, &o2),
                ("lse", &lse, &l2),
                ("dq", &dq, &g2[0]),
                ("dk", &dk, &g2[1]),
                ("dv", &dv, &g2[2]),
            ] {
                let (x, y) = (values(a), values(b));
                if on_emulator() {
                    let (n, u) = ulp_diff(&x, &y, DType::F32);
                    assert_eq!(
                        n, 0,
                        "{key}: {name} on {dev}: {n} differ from the CPU ({u} f32 ulps)"
                    );
                } else if name == "lse" {
                    common::assert_close(&format!("{key}: lse"), &x, &y, 1e-5, 1e-5);
                } else {
                    let (_, u) = ulp_diff(&x, &y, dt);
                    assert!(u <= ULPS, "{key}: {name} {u} ulps from the CPU on {dev}");
                }
            }
        }
    }
    eprintln!("sdpa outputs differing from PyTorch: {out_differ}");
    let frac = differ as f64 / grads as f64;
    eprintln!("sdpa gradients differing from PyTorch: {differ} of {grads} ({frac:.5})");
    assert!(
        frac <= FRACTION,
        "{differ} of {grads} gradient elements differ"
    );
    Ok(())
}

device_test!(sdpa_matches_pytorch, against_torch);

#[test]
fn sdpa_refuses_f32_and_mixed_dtypes() {
    let d = HeadDims {
        b: 1,
        h: 1,
        t: 4,
        hd: 2,
    };
    let x = Tensor::zeros(&[1, 1, 4, 2], DType::F32);
    assert!(matches!(
        ops::sdpa_causal(&x, &x, &x, d),
        Err(fsdp::Error::Unsupported(_))
    ));
    let y = x.to_dtype(DType::BF16).unwrap();
    let z = x.to_dtype(DType::F16).unwrap();
    assert!(matches!(
        ops::sdpa_causal(&y, &z, &y, d),
        Err(fsdp::Error::DTypeMismatch { .. })
    ));
    let short = Tensor::zeros(&[1, 1, 3, 2], DType::BF16);
    assert!(matches!(
        ops::sdpa_causal(&y, &short, &y, d),
        Err(fsdp::Error::ShapeMismatch { .. })
    ));
}

#[test]
fn bf16_attention_module_runs_the_op() {
    use fsdp::nn::{self, CausalSelfAttention, Context, InitKey, Module};
    let (b, t, c, h) = (2, 19, 16, 2);
    let mut attn = CausalSelfAttention::new(c, h, &InitKey::new(3)).unwrap();
    nn::visit_parameters(&mut attn, "", false, &mut |_, p| {
        let lp = p.data()?.to_dtype(DType::BF16)?;
        p.set_data(Some(lp))
    })
    .unwrap();
    let xv: Vec<f32> = (0..b * t * c).map(|i| (i as f32 * 0.37).sin()).collect();
    let x = Tensor::from_vec(xv, &[b, t, c])
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let cx = Context::train();
    let y = attn.forward(&x, &cx).unwrap();
    // The same computation by hand: c_attn, the op, merge, c_proj.
    let d = HeadDims { b, t, h, hd: c / h };
    let qkv = attn.c_attn.forward(&x, &cx).unwrap();
    let [q, k, v] = ops::split_qkv(&qkv, d).unwrap();
    let (yh, _) = ops::sdpa_causal(&q, &k, &v, d).unwrap();
    let want = attn
        .c_proj
        .forward(&ops::merge_heads(&yh, d).unwrap(), &cx)
        .unwrap();
    assert_eq!(bits(&values(&y)), bits(&values(&want)));
    let dx = attn.backward(&y, &cx).unwrap();
    assert_eq!(dx.dtype(), DType::BF16);
    assert!(values(&dx).iter().all(|v| v.is_finite()));
}
