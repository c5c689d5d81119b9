//! Causal scaled-dot-product attention of bf16/f16 heads in one op, forward and backward,
//! with PyTorch's rounding: `F.scaled_dot_product_attention(q, k, v, is_causal=True)` on
//! reduced-precision tensors, whose CPU kernel (flash attention) keeps its running max, sums
//! and accumulators in f32 and rounds at its own points ([Note: PyTorch's flash-attention
//! rounding] in [`crate::backend::cpu::sdpa`]).
//!
//! | op | in | out |
//! |---|---|---|
//! | [`sdpa_causal`] | `q, k, v (B, H, T, hd)` bf16 or f16 | `out (B, H, T, hd)` same dtype, `lse (B, H, T)` f32 |
//! | [`sdpa_causal_backward`] | `q, k, v, out, dout` as above, `lse` | `[dq, dk, dv] (B, H, T, hd)` |
//!
//! CPU: [`crate::backend::cpu::sdpa`]. CUDA: `sdpa_fwd_*` and `sdpa_bwd_*` of
//! `kernels/sdpa.cu`, the same steps in the same order (bit for bit on cuda-emu, whose
//! `expf` and `logf` are the host's). f32 and f64 attention keep their op-by-op path
//! ([`super::causal_matmul`], [`super::softmax_causal`]).

use super::attention::HeadDims;
use super::same_device;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use half::{bf16, f16};

/// Whether [`sdpa_causal`] runs heads of `d` on `device`: the CPU takes any size, CUDA
/// heads up to `SDPA_MAX_HD` wide (`kernels/sdpa.cu`'s per-thread accumulators).
pub fn sdpa_supported(device: Device, d: HeadDims) -> bool {
    match device {
        Device::Cpu => true,
        Device::Cuda(_) => d.hd <= crate::backend::cpu::sdpa_math::CUDA_MAX_HD,
        Device::Meta => false,
    }
}

/// The common 16-bit dtype of `ts`, or a `DTypeMismatch` / `Unsupported` error.
fn lp_dtype(op: &'static str, ts: &[&Tensor]) -> Result<DType> {
    let d = ts[0].dtype();
    if !matches!(d, DType::BF16 | DType::F16) {
        return Err(Error::Unsupported(format!(
            "{op}: dtype {d:?} (bf16 or f16 only; f32 attention runs op by op)"
        )));
    }
    if let Some(t) = ts.iter().find(|t| t.dtype() != d) {
        return Err(Error::DTypeMismatch {
            op,
            expected: d,
            got: t.dtype(),
        });
    }
    Ok(d)
}

fn check_numel(op: &'static str, ts: &[&Tensor], want: usize) -> Result<()> {
    if let Some(t) = ts.iter().find(|t| t.numel() != want) {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![want],
            got: t.shape().to_vec(),
        });
    }
    Ok(())
}

fn check_lse(op: &'static str, lse: &Tensor, d: HeadDims) -> Result<()> {
    if lse.dtype() != DType::F32 {
        return Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            got: lse.dtype(),
        });
    }
    check_numel(op, &[lse], d.b * d.h * d.t)
}

/// Causal attention of bf16/f16 heads: `out_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(hd))
/// v_j` rounded as PyTorch's CPU kernel rounds it, and `lse_i` (f32), the log-sum-exp of
/// row `i`'s scaled scores, which [`sdpa_causal_backward`] needs. Shapes in the module
/// docs.
///
/// # Errors
/// `ShapeMismatch` when an element count disagrees with `d`; `DTypeMismatch` when the
/// dtypes differ; `Unsupported` for f32/f64; device and CUDA errors.
pub fn sdpa_causal(q: &Tensor, k: &Tensor, v: &Tensor, d: HeadDims) -> Result<(Tensor, Tensor)> {
    const OP: &str = "sdpa_causal";
    let device = same_device(OP, &[q, k, v])?;
    let dtype = lp_dtype(OP, &[q, k, v])?;
    check_numel(OP, &[q, k, v], d.numel())?;
    let out = Tensor::zeros_on(&[d.b, d.h, d.t, d.hd], dtype, device)?;
    let lse = super::output(&[d.b, d.h, d.t], device)?;
    if let Device::Cuda(i) = device {
        let (q, k, v) = (
            q.as_device_tensor()?,
            k.as_device_tensor()?,
            v.as_device_tensor()?,
        );
        crate::backend::cuda::sdpa_forward(
            &*super::stream(i)?,
            (&q, &k, &v),
            &out.as_device_tensor()?,
            &lse.as_device_tensor()?,
            d,
        )?;
        return Ok((out, lse));
    }
    if device != Device::Cpu {
        return Err(Error::Unsupported(format!("{OP} on {device:?}")));
    }
    let mut l = lse.f32_mut()?;
    match dtype {
        DType::BF16 => crate::backend::cpu::sdpa::forward::<bf16>(
            &q.data()?,
            &k.data()?,
            &v.data()?,
            &mut out.data_mut()?,
            &mut l,
            d,
        )?,
        _ => crate::backend::cpu::sdpa::forward::<f16>(
            &q.data()?,
            &k.data()?,
            &v.data()?,
            &mut out.data_mut()?,
            &mut l,
            d,
        )?,
    }
    drop(l);
    Ok((out, lse))
}

/// Backward of [`sdpa_causal`]: from its inputs, its `out` and `lse` and the output gradient
/// `dout`, the input gradients `[dq, dk, dv]` (new tensors of the inputs' dtype).
///
/// # Errors
/// As [`sdpa_causal`]; `DTypeMismatch` unless `lse` is f32.
pub fn sdpa_causal_backward(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    d: HeadDims,
) -> Result<[Tensor; 3]> {
    const OP: &str = "sdpa_causal_backward";
    let device = same_device(OP, &[q, k, v, out, lse, dout])?;
    let dtype = lp_dtype(OP, &[q, k, v, out, dout])?;
    check_numel(OP, &[q, k, v, out, dout], d.numel())?;
    check_lse(OP, lse, d)?;
    let shape = [d.b, d.h, d.t, d.hd];
    let grads = [
        Tensor::zeros_on(&shape, dtype, device)?,
        Tensor::zeros_on(&shape, dtype, device)?,
        Tensor::zeros_on(&shape, dtype, device)?,
    ];
    if let Device::Cuda(i) = device {
        let [dq, dk, dv] = &grads;
        let dsum = super::output(&[d.b, d.h, d.t], device)?;
        let dev = |t: &Tensor| t.as_device_tensor();
        crate::backend::cuda::sdpa_backward(
            &*super::stream(i)?,
            (&dev(q)?, &dev(k)?, &dev(v)?),
            &dev(out)?,
            &dev(lse)?,
            &dev(dout)?,
            (&dev(dq)?, &dev(dk)?, &dev(dv)?),
            &dev(&dsum)?,
            d,
        )?;
        return Ok(grads);
    }
    if device != Device::Cpu {
        return Err(Error::Unsupported(format!("{OP} on {device:?}")));
    }
    {
        let [dq, dk, dv] = &grads;
        macro_rules! run {
            ($t:ty) => {
                crate::backend::cpu::sdpa::backward::<$t>(
                    (&q.data()?, &k.data()?, &v.data()?),
                    &out.data()?,
                    &lse.f32()?,
                    &dout.data()?,
                    (
                        &mut dq.data_mut()?,
                        &mut dk.data_mut()?,
                        &mut dv.data_mut()?,
                    ),
                    d,
                )?
            };
        }
        match dtype {
            DType::BF16 => run!(bf16),
            _ => run!(f16),
        }
    }
    Ok(grads)
}
