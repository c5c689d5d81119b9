//! Elementwise ops and reductions on f32 tensors (bf16/f16 and f64 where said), on any device.
//! CPU references: [`crate::backend::cpu::ops`]; CUDA: `reduce_scatter.cu`, `flat_param.cu`.

use super::{lowp, same_device};
use crate::backend::cpu::ops as cpu_ops;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

fn numel_eq(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.numel() != b.numel() {
        return Err(Error::ShapeMismatch {
            op,
            expected: a.shape().to_vec(),
            got: b.shape().to_vec(),
        });
    }
    Ok(())
}

/// `dst += src` elementwise (`Tensor.add_`); same element count and float dtype. Floats of
/// 16 bits add in f32 and round once.
///
/// # Errors
/// `DeviceMismatch`, `ShapeMismatch`, `DTypeMismatch`.
pub fn add_(dst: &Tensor, src: &Tensor) -> Result<()> {
    numel_eq("add_", dst, src)?;
    let device = same_device("add_", &[dst, src])?;
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::sum_into(
            &*super::stream(i)?,
            &dst.as_device_tensor()?,
            &src.as_device_tensor()?,
        );
    }
    if dst.dtype() != src.dtype() {
        return Err(Error::DTypeMismatch {
            op: "add_",
            expected: dst.dtype(),
            got: src.dtype(),
        });
    }
    if dst.shares_storage(src) {
        // One lock guards both views: add from a copy.
        return add_(dst, &src.deep_clone()?);
    }
    match dst.dtype() {
        DType::F32 => {
            let sv = src.f32()?;
            let ss: &[f32] = &sv;
            par::chunks_mut(&mut dst.f32_mut()?, par::ELEMENTWISE_GRAIN, |r, d| {
                cpu_ops::add_(d, &ss[r]);
                Ok(())
            })
        }
        DType::BF16 => crate::backend::cpu::kernels::sum_into(
            &mut dst.data_mut::<half::bf16>()?,
            &src.data::<half::bf16>()?,
        ),
        DType::F16 => crate::backend::cpu::kernels::sum_into(
            &mut dst.data_mut::<half::f16>()?,
            &src.data::<half::f16>()?,
        ),
        DType::F64 => {
            let sv = src.data::<f64>()?;
            for (d, &v) in dst.data_mut::<f64>()?.iter_mut().zip(sv.iter()) {
                *d += v;
            }
            Ok(())
        }
        d @ (DType::I32 | DType::I64) => Err(Error::DTypeMismatch {
            op: "add_",
            expected: DType::F32,
            got: d,
        }),
    }
}

/// `dst += src` where `src` may have another float dtype than `dst` (an f32 gradient added
/// into a bf16/f16 one): the sum in f32, rounded once to `dst`'s dtype, as PyTorch's
/// `Tensor.add_` after type promotion. Tensors of one dtype go to [`add_`].
///
/// ```
/// use fsdp_core::tensor::{DType, Tensor};
/// let dst = Tensor::from_vec(vec![1.0f32, 256.0], &[2])?.to_dtype(DType::BF16)?;
/// let src = Tensor::from_vec(vec![0.5f32, 1.0], &[2])?;
/// fsdp_core::ops::add_promoted_(&dst, &src)?;
/// // 257 is not a bf16: the f32 sum rounds to nearest even, once.
/// assert_eq!(dst.to_vec_f32()?, [1.5, 256.0]);
/// # Ok::<(), fsdp_core::Error>(())
/// ```
///
/// # Errors
/// `DeviceMismatch`, `ShapeMismatch`; `DTypeMismatch` when the dtypes differ and either is
/// not f32, bf16 or f16.
pub fn add_promoted_(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.dtype() == src.dtype() {
        return add_(dst, src);
    }
    for t in [dst, src] {
        if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::DTypeMismatch {
                op: "add_promoted_",
                expected: DType::F32,
                got: t.dtype(),
            });
        }
    }
    numel_eq("add_promoted_", dst, src)?;
    same_device("add_promoted_", &[dst, src])?;
    add_rounded_(dst, src)
}

/// `dst = round(dst + src)` for float tensors of any dtypes (an f32 gradient of a
/// low-precision computation): both widened, the sum by [`add_`] in f32 (its checks),
/// rounded once to `dst`'s dtype. Without [`add_promoted_`]'s dtype check.
///
/// # Errors
/// As [`add_`].
pub(crate) fn add_rounded_(dst: &Tensor, src: &Tensor) -> Result<()> {
    lowp::into(dst, true, |d32| add_(d32, &lowp::up(src)?))
}

/// `a + b` as a new tensor on their device (`torch.add`). Equal shapes: one pass on the
/// CPU (f32) and on CUDA (one dtype), else a copy of `a`, then [`add_`]. Other shapes broadcast as PyTorch's do ([`binary`](super::arith::binary), CPU
/// f32).
///
/// # Errors
/// As [`add_`]; for different shapes, as [`binary`](super::arith::binary) (shapes that do
/// not broadcast, a CUDA tensor).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return super::arith::binary(super::arith::BinaryOp::Add, a, b);
    }
    numel_eq("add", a, b)?;
    let device = same_device("add", &[a, b])?;
    if device == crate::backend::Device::Cpu
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
        && !a.shares_storage(b)
    {
        // One pass: out[i] = a[i] + b[i], into a pooled buffer.
        let out = super::output(a.shape(), device)?;
        {
            let (av, bv) = (a.f32()?, b.f32()?);
            let (as_, bs): (&[f32], &[f32]) = (&av, &bv);
            par::chunks_mut(&mut out.f32_mut()?, par::ELEMENTWISE_GRAIN, |r, o| {
                cpu_ops::add_into(o, &as_[r.clone()], &bs[r]);
                Ok(())
            })?;
        }
        return Ok(out);
    }
    if let (Device::Cuda(i), true) = (device, a.dtype() == b.dtype()) {
        // One launch (a copy then `add_` would be two), the same rounding.
        let out = super::output_as(a.shape(), device, a.dtype())?;
        crate::backend::cuda::add(
            &*super::stream(i)?,
            &a.as_device_tensor()?,
            &b.as_device_tensor()?,
            &out.as_device_tensor()?,
        )?;
        return Ok(out);
    }
    let out = a.deep_clone()?;
    add_(&out, b)?;
    Ok(out)
}

/// `t *= alpha` in place on an f32 tensor, an f64 one (by `alpha` widened), or a bf16/f16
/// one (the product in f32, rounded once) (`Tensor.mul_`).
///
/// # Errors
/// `DTypeMismatch` for a non-f32 tensor; `NotMaterialized` on meta.
pub fn scale_(t: &Tensor, alpha: f32) -> Result<()> {
    let device = same_device("scale_", &[t])?;
    if lowp::lp_of(&[t]).is_some() {
        // round(t * alpha): the product in f32.
        return lowp::into(t, true, |t32| scale_native(t32, alpha, device));
    }
    scale_native(t, alpha, device)
}

/// [`scale_`] of an f32 or f64 tensor: the `scale` kernel on CUDA, else the host loop.
fn scale_native(t: &Tensor, alpha: f32, device: Device) -> Result<()> {
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::scale(&*super::stream(i)?, &t.as_device_tensor()?, alpha);
    }
    if t.dtype() == DType::F64 {
        t.data_mut::<f64>()?
            .iter_mut()
            .for_each(|v| *v *= f64::from(alpha));
        return Ok(());
    }
    par::chunks_mut(&mut t.f32_mut()?, par::ELEMENTWISE_GRAIN, |_, d| {
        cpu_ops::scale_(d, alpha);
        Ok(())
    })
}

/// `t[i] = value` (rounded to the dtype; truncated toward zero for i32) (`Tensor.fill_`).
///
/// # Errors
/// `NotMaterialized` on meta.
pub fn fill_(t: &Tensor, value: f32) -> Result<()> {
    let device = same_device("fill_", &[t])?;
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::fill(&*super::stream(i)?, &t.as_device_tensor()?, value);
    }
    match t.dtype() {
        DType::F32 => t.f32_mut()?.fill(value),
        DType::BF16 => t
            .data_mut::<half::bf16>()?
            .fill(half::bf16::from_f32(value)),
        DType::F16 => t.data_mut::<half::f16>()?.fill(half::f16::from_f32(value)),
        DType::I32 => t.data_mut::<i32>()?.fill(value as i32),
        DType::F64 => t.data_mut::<f64>()?.fill(f64::from(value)),
        DType::I64 => t.data_mut::<i64>()?.fill(value as i64),
    }
    Ok(())
}

/// `sum_i t[i]^2` of an f32 tensor, accumulated in f64 (the square of the 2-norm that
/// `clip_grad_norm_` needs), or of an f64 tensor in f64. On CUDA this waits for the
/// current stream.
///
/// # Errors
/// `DTypeMismatch` for a tensor neither f32 nor f64; [`Error::Cuda`].
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    let device = same_device("sum_squares", &[t])?;
    if t.dtype() == DType::F64 && !device.is_cuda() {
        return super::double::sum_squares(t);
    }
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::sum_squares(&*super::stream(i)?, &t.as_device_tensor()?);
    }
    Ok(crate::backend::cpu::ops::sum_squares(&t.f32()?))
}
