//! Device-dispatching ops on FSDP's flat buffers: the fused gradient pack/unpack around the
//! reduce-scatter and the rounding of f32 values to a low-precision dtype.
//!
//! | op | CPU reference | CUDA kernel |
//! |---|---|---|
//! | [`pack_grad`] | [`crate::backend::cpu::kernels::pack_grad`] | `pack_grad_{dtype}` (`reduce_scatter.cu`) |
//! | [`unpack_grad`] | [`crate::backend::cpu::kernels::unpack_grad`] | `unpack_grad_{dtype}` |
//! | both, f64 (no cast) | a loop in f64 | `div_scale_f64` |
//! | [`round_to_`] | `dtype::from_f32(v).to_f32()` per element | `cast_f32_{dtype}` then `cast_{dtype}_f32` |
//!
//! The CPU paths are the exact loops FSDP ran before these ops existed, so CPU training is
//! bit-identical to it.

use super::same_device;
use crate::backend::cpu::kernels as cpu;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

fn check_pair(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(Error::ShapeMismatch {
            op,
            expected: a.shape().to_vec(),
            got: b.shape().to_vec(),
        });
    }
    if a.shares_storage(b) && !a.same_view(b) {
        crate::error::bail_arg!("{op}: input and output overlap without being the same view");
    }
    Ok(())
}

fn require(op: &'static str, t: &Tensor, dtype: DType) -> Result<()> {
    if t.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op,
            expected: dtype,
            got: t.dtype(),
        });
    }
    Ok(())
}

fn require_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            got: t.dtype(),
        });
    }
    Ok(())
}

/// `out[i] = cast<out.dtype>(grad[i] * scale)`: the predivide (`scale = 1 / pre`) and cast
/// to `reduce_dtype` of a flat gradient, giving the reduce-scatter input (FSDP1
/// `_post_backward_hook`: `grad.div_(predivide_factor)` then `.to(reduce_dtype)`). `grad`
/// `(n)` f32, or bf16/f16 (the `param_dtype` gradient of low-precision compute, read as
/// f32: one rounding, to `out`'s dtype), `out` `(n)` f32/bf16/f16, one device; `out` may
/// be `grad` itself when both are f32 (in place).
///
/// # Errors
/// `DeviceMismatch`, `ShapeMismatch`, `DTypeMismatch`, `InvalidArgument` (partial overlap),
/// [`Error::Cuda`].
pub fn pack_grad(grad: &Tensor, out: &Tensor, scale: f32) -> Result<()> {
    let device = same_device("pack_grad", &[grad, out])?;
    check_pair("pack_grad", grad, out)?;
    if grad.dtype() == DType::F64 {
        return scale_f64("pack_grad", grad, out, scale);
    }
    require_float("pack_grad", grad)?;
    require_float("pack_grad", out)?;
    if grad.same_view(out) && grad.dtype() == DType::F32 {
        // x * 1 is x: no pass (FSDP predivides by 1 at world size 1).
        return match scale == 1.0 {
            true => Ok(()),
            false => super::scale_(out, scale),
        };
    }
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::pack_grad(
            &*super::stream(i)?,
            &grad.as_device_tensor()?,
            &out.as_device_tensor()?,
            scale,
        );
    }
    if grad.dtype() != DType::F32 {
        if grad.shares_storage(out) {
            crate::error::bail_arg!(
                "pack_grad: a {} gradient packs into another tensor",
                grad.dtype()
            );
        }
        return pack_grad_lp(grad, out, scale);
    }
    let g = grad.f32()?;
    match out.dtype() {
        DType::F32 => cpu::pack_grad(&g, &mut out.data_mut::<f32>()?, scale),
        DType::BF16 => cpu::pack_grad(&g, &mut out.data_mut::<half::bf16>()?, scale),
        DType::F16 => cpu::pack_grad(&g, &mut out.data_mut::<half::f16>()?, scale),
        d @ (DType::F64 | DType::I32 | DType::I64) => Err(Error::DTypeMismatch {
            op: "pack_grad",
            expected: DType::F32,
            got: d,
        }),
    }
}

/// [`pack_grad`] of a bf16/f16 gradient on the host: `out[i] = cast(f32(grad[i]) * scale)`.
fn pack_grad_lp(grad: &Tensor, out: &Tensor, scale: f32) -> Result<()> {
    fn run<S: crate::tensor::Element>(g: &[S], out: &Tensor, scale: f32) -> Result<()> {
        fn into<S: crate::tensor::Element, D: crate::tensor::Element>(
            g: &[S],
            o: &mut [D],
            scale: f32,
        ) {
            for (o, &v) in o.iter_mut().zip(g) {
                *o = D::from_f32(v.to_f32() * scale);
            }
        }
        match out.dtype() {
            DType::F32 => into(g, &mut out.data_mut::<f32>()?, scale),
            DType::BF16 => into(g, &mut out.data_mut::<half::bf16>()?, scale),
            DType::F16 => into(g, &mut out.data_mut::<half::f16>()?, scale),
            d => {
                return Err(Error::DTypeMismatch {
                    op: "pack_grad",
                    expected: DType::F32,
                    got: d,
                })
            }
        }
        Ok(())
    }
    match grad.dtype() {
        DType::BF16 => run(&grad.data::<half::bf16>()?, out, scale),
        DType::F16 => run(&grad.data::<half::f16>()?, out, scale),
        d => Err(Error::DTypeMismatch {
            op: "pack_grad",
            expected: DType::F32,
            got: d,
        }),
    }
}

/// `out[i] = x[i] * scale` in f64 (the f64 FlatParameter's pack and unpack: no cast, as
/// PyTorch FSDP reduces an f64 gradient in f64); `out` may be `x` itself. A `scale` that
/// is the f32 reciprocal of a divisor `d = k / 2^j` (FSDP's divide factors:
/// `gradient_divide_factors(3)` is `(2, 1.5)`) divides by `d` in f64, as PyTorch's
/// `div_(factor)` on an f64 gradient does, instead of multiplying by the rounded reciprocal.
/// On CUDA `div_scale_f64` (`reduce_scatter.cu`), the same arithmetic.
fn scale_f64(op: &'static str, x: &Tensor, out: &Tensor, scale: f32) -> Result<()> {
    require(op, x, DType::F64)?;
    require(op, out, DType::F64)?;
    let divisor = divisor_of(scale);
    if let Device::Cuda(i) = x.device() {
        let (factor, divide) = match divisor {
            Some(d) => (d, true),
            None => (f64::from(scale), false),
        };
        return crate::backend::cuda::div_scale_f64(
            &*super::stream(i)?,
            &x.as_device_tensor()?,
            &out.as_device_tensor()?,
            factor,
            divide,
        );
    }
    let f = |v: f64| match divisor {
        Some(d) => v / d,
        None => v * f64::from(scale),
    };
    if x.same_view(out) {
        out.data_mut::<f64>()?.iter_mut().for_each(|v| *v = f(*v));
        return Ok(());
    }
    let src = x.data::<f64>()?;
    for (o, &v) in out.data_mut::<f64>()?.iter_mut().zip(src.iter()) {
        *o = f(v);
    }
    Ok(())
}

/// The divisor `d = k / 2^j` (`j <= 8`, `d >= 1`) whose f32 reciprocal is `scale`, if any.
fn divisor_of(scale: f32) -> Option<f64> {
    let inv = 1.0 / f64::from(scale);
    (0..=8).find_map(|j| {
        let p = f64::from(1u32 << j);
        let d = (inv * p).round() / p;
        (d >= 1.0 && (1.0 / d) as f32 == scale).then_some(d)
    })
}

/// `out[i] = f32(cast<x.dtype>(f32(x[i]) * scale))`: the postdivide (`scale = 1 / post`)
/// in `reduce_dtype` and the upcast of a reduced gradient shard to f32 (FSDP1
/// `_post_reduce_grad_callback`: `div_(postdivide_factor)` in reduce dtype, then the cast
/// to the parameter dtype). `x` `(n)` f32/bf16/f16, `out` `(n)` f32, one device; `out` may
/// be `x` itself (f32, in place).
///
/// # Errors
/// As [`pack_grad`].
pub fn unpack_grad(x: &Tensor, out: &Tensor, scale: f32) -> Result<()> {
    let device = same_device("unpack_grad", &[x, out])?;
    check_pair("unpack_grad", x, out)?;
    if out.dtype() == DType::F64 {
        return scale_f64("unpack_grad", x, out, scale);
    }
    require("unpack_grad", out, DType::F32)?;
    require_float("unpack_grad", x)?;
    if x.same_view(out) {
        // x * 1 is x: no pass (FSDP postdivides by 1 at world sizes 1 and 2).
        return match scale == 1.0 {
            true => Ok(()),
            false => super::scale_(out, scale),
        };
    }
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::unpack_grad(
            &*super::stream(i)?,
            &x.as_device_tensor()?,
            &out.as_device_tensor()?,
            scale,
        );
    }
    let mut o = out.data_mut::<f32>()?;
    match x.dtype() {
        DType::F32 => cpu::unpack_grad(&x.data::<f32>()?, &mut o, scale),
        DType::BF16 => cpu::unpack_grad(&x.data::<half::bf16>()?, &mut o, scale),
        DType::F16 => cpu::unpack_grad(&x.data::<half::f16>()?, &mut o, scale),
        d @ (DType::F64 | DType::I32 | DType::I64) => Err(Error::DTypeMismatch {
            op: "unpack_grad",
            expected: DType::F32,
            got: d,
        }),
    }
}

/// A copy of the f32 tensor `t` with every element rounded to `dtype` ([`round_to_`] on a
/// copy: `t.to(dtype).to(float32)`).
///
/// # Errors
/// As [`round_to_`]; [`Error::Cuda`] when the copy cannot be allocated.
pub fn rounded(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let c = t.deep_clone()?;
    round_to_(&c, dtype)?;
    Ok(c)
}

/// Rounds every element of an f32 tensor to the nearest `dtype` value, in place
/// (round-to-nearest-even; a no-op for f32): what a value becomes after a trip through a
/// low-precision tensor (`t.to(dtype).to(float32)`).
///
/// # Errors
/// `DTypeMismatch` when `t` is not f32 or `dtype` is i32; [`Error::Cuda`].
pub fn round_to_(t: &Tensor, dtype: DType) -> Result<()> {
    if dtype == DType::F32 || (dtype == DType::F64 && t.dtype() == DType::F64) {
        return Ok(());
    }
    let device = same_device("round_to_", &[t])?;
    require("round_to_", t, DType::F32)?;
    if !dtype.is_float() {
        return Err(Error::DTypeMismatch {
            op: "round_to_",
            expected: DType::BF16,
            got: dtype,
        });
    }
    if let Device::Cuda(_) = device {
        // Two casts on the current stream through a low-precision temporary.
        let low = Tensor::zeros_on(t.shape(), dtype, device)?;
        low.copy_from(t)?;
        return t.copy_from(&low);
    }
    match dtype {
        DType::BF16 => t
            .f32_mut()?
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32()),
        DType::F16 => t
            .f32_mut()?
            .iter_mut()
            .for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        _ => {}
    }
    Ok(())
}
