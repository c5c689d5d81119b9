//! Pointwise activations on any device: `y = f(x)` and `dx = dy * f'(x)` for ReLU and
//! exact (erf) GELU. CPU: the reference loops of [`crate::backend::cpu::kernels`] (the
//! scalar functions of [`crate::backend::cpu::scalar`]) over contiguous pieces, in
//! parallel; CUDA: `relu_*_f32` / `gelu_*_f32` of `nn.cu`, which use the same polynomials
//! and round alike (bitwise equal). f64: the host loops of `double/`, on CUDA the `_f64`
//! kernels (erf and exp in double).

pub use super::types::Pointwise;
use super::{compute_dtype, lowp, same_device};
use crate::backend::cpu::kernels as cpu;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `y = f(x)`, a new tensor of `x`'s shape and dtype on its device.
///
/// # Errors
/// `DTypeMismatch` for an input neither f32, f64 nor bf16/f16; `NotMaterialized` on meta;
/// [`Error::Cuda`].
pub fn pointwise(f: Pointwise, x: &Tensor) -> Result<Tensor> {
    let device = same_device(f.name(), &[x])?;
    if let Some(lp) = lowp::lp_of(&[x]) {
        if f == Pointwise::Gelu && device == Device::Cpu {
            // PyTorch's reduced-precision CPU kernel (its own erf), rounded once.
            return lowp::gelu_host(x, lp);
        }
        return lowp::map(x, lp, |x32| pointwise_native(f, x32, device));
    }
    if super::double::any_f64(&[x]) && !device.is_cuda() {
        return super::double::pointwise(f, x);
    }
    pointwise_native(f, x, device)
}

/// [`pointwise`] of an f32 tensor (or an f64 one on CUDA): the kernel on CUDA, else the
/// host loop.
fn pointwise_native(f: Pointwise, x: &Tensor, device: Device) -> Result<Tensor> {
    let dt = compute_dtype(f.name(), &[x], device)?;
    if let Device::Cuda(i) = device {
        use crate::backend::cuda;
        let y = super::output_as(x.shape(), device, dt)?;
        let (s, xd, yd) = (
            super::stream(i)?,
            x.as_device_tensor()?,
            y.as_device_tensor()?,
        );
        match f {
            Pointwise::Relu => cuda::relu_fwd(&s, &xd, &yd)?,
            Pointwise::Gelu => cuda::gelu_fwd(&s, &xd, &yd)?,
        }
        return Ok(y);
    }
    let y = super::output(x.shape(), device)?;
    {
        let (xv, mut yv) = (x.f32()?, y.f32_mut()?);
        let xs: &[f32] = &xv;
        // Elementwise: any split gives the same bits.
        par::chunks_mut(&mut yv, par::HEAVY_GRAIN, |r, out| match f {
            Pointwise::Relu => cpu::relu_fwd(&xs[r], out),
            Pointwise::Gelu => cpu::gelu_fwd(&xs[r], out),
        })?;
    }
    Ok(y)
}

/// `dx = dy * f'(x)`, a new tensor of `x`'s shape and dtype on its device.
///
/// # Errors
/// `ShapeMismatch` when `dy` and `x` differ in element count; as [`pointwise`].
pub fn pointwise_backward(f: Pointwise, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let device = same_device(f.name(), &[x, dy])?;
    if x.numel() != dy.numel() {
        return Err(Error::ShapeMismatch {
            op: "pointwise_backward",
            expected: x.shape().to_vec(),
            got: dy.shape().to_vec(),
        });
    }
    if super::double::any_f64(&[x, dy]) && !device.is_cuda() {
        return super::double::pointwise_backward(f, x, dy);
    }
    if let Some(lp) = lowp::lp_of(&[x, dy]) {
        // The input gradient from the widened input and output gradient, one rounding.
        let dx = pointwise_backward_native(f, &lowp::up(x)?, &lowp::up(dy)?, device)?;
        return lowp::down(&dx, lp);
    }
    pointwise_backward_native(f, x, dy, device)
}

/// [`pointwise_backward`] of f32 tensors (or f64 ones on CUDA), checked: the kernel on
/// CUDA, else the host loop.
fn pointwise_backward_native(
    f: Pointwise,
    x: &Tensor,
    dy: &Tensor,
    device: Device,
) -> Result<Tensor> {
    let dt = compute_dtype(f.name(), &[x, dy], device)?;
    if let Device::Cuda(i) = device {
        use crate::backend::cuda;
        let dx = super::output_as(x.shape(), device, dt)?;
        let s = super::stream(i)?;
        let (xd, gd, dxd) = (
            x.as_device_tensor()?,
            dy.as_device_tensor()?,
            dx.as_device_tensor()?,
        );
        match f {
            Pointwise::Relu => cuda::relu_bwd(&s, &xd, &gd, &dxd)?,
            Pointwise::Gelu => cuda::gelu_bwd(&s, &xd, &gd, &dxd)?,
        }
        return Ok(dx);
    }
    let dx = super::output(x.shape(), device)?;
    {
        let (xv, gv, mut dxv) = (x.f32()?, dy.f32()?, dx.f32_mut()?);
        let (xs, gs): (&[f32], &[f32]) = (&xv, &gv);
        par::chunks_mut(&mut dxv, par::HEAVY_GRAIN, |r, out| match f {
            Pointwise::Relu => cpu::relu_bwd(&xs[r.clone()], &gs[r], out),
            Pointwise::Gelu => cpu::gelu_bwd(&xs[r.clone()], &gs[r], out),
        })?;
    }
    Ok(dx)
}

/// GELU backward fused with the bias gradient of the `Linear` whose output it read (an
/// MLP's `c_fc`): `dx = dy * gelu'(x)` (a new tensor) and `db += ` the sum over rows of
/// `dx`, in one pass instead of two, with the bits of [`pointwise_backward`] followed by
/// [`super::bias_grad`]. `x` and `dy` are `(.., C)` f32, `db` is `(C)` f32; on CUDA f32
/// or f64, all three of one dtype (`gelu_bwd_bias_grad`, one launch).
///
/// Returns `None`, touching nothing, where the fused pass does not run: on the CPU for
/// another dtype or when the calling thread may use more than one intra-op thread (there the
/// two passes are split across threads), or when the shapes do not line up; the caller
/// then runs the two ops.
///
/// # Errors
/// Only a failed borrow of a tensor's storage.
pub fn gelu_backward_bias_grad(x: &Tensor, dy: &Tensor, db: &Tensor) -> Result<Option<Tensor>> {
    if let (Device::Cuda(i), true) = (x.device(), fusable_on_cuda(x, dy, db)) {
        // One launch: each column block computes the dx it sums (`gelu_bwd_bias_grad`).
        let c = db.numel();
        if x.shape() != dy.shape()
            || c == 0
            || x.shape().last() != Some(&c)
            || db.shares_storage(dy)
            || db.shares_storage(x)
        {
            return Ok(None);
        }
        let dx = super::output_as(x.shape(), x.device(), x.dtype())?;
        crate::backend::cuda::gelu_bwd_bias_grad(
            &*super::stream(i)?,
            &x.as_device_tensor()?,
            &dy.as_device_tensor()?,
            &dx.as_device_tensor()?,
            &db.as_device_tensor()?,
        )?;
        return Ok(Some(dx));
    }
    let off = [x, dy, db].iter().any(|t| {
        t.device() != crate::backend::Device::Cpu || t.dtype() != crate::tensor::DType::F32
    });
    let c = db.numel();
    if off
        || par::num_threads() != 1
        || x.shape() != dy.shape()
        || c == 0
        || x.numel() % c != 0
        || x.shape().last() != Some(&c)
        || db.shares_storage(dy)
        || db.shares_storage(x)
    {
        return Ok(None);
    }
    let dx = super::output(x.shape(), crate::backend::Device::Cpu)?;
    {
        let (xv, gv) = (x.f32()?, dy.f32()?);
        let (mut dxv, mut dbv) = (dx.f32_mut()?, db.f32_mut()?);
        cpu::gelu_bwd_bias_grad(&xv, &gv, &mut dxv, &mut dbv)?;
    }
    Ok(Some(dx))
}

/// Whether `x`, `w` and `b` are on one CUDA device, all f32 or all f64: where
/// [`bias_gelu_`] and [`gelu_backward_bias_grad`] run one kernel each, with the bits of
/// the ops they replace (on CUDA a `Linear`'s bias is added after its product, so the
/// MLP may take the product alone and add the bias here).
pub fn bias_gelu_fusable(x: &Tensor, w: &Tensor, b: &Tensor) -> bool {
    x.device().is_cuda() && fusable_on_cuda(x, w, b)
}

fn fusable_on_cuda(a: &Tensor, b: &Tensor, c: &Tensor) -> bool {
    let d = a.dtype();
    matches!(d, crate::tensor::DType::F32 | crate::tensor::DType::F64)
        && [b, c]
            .iter()
            .all(|t| t.dtype() == d && t.device() == a.device())
}

/// The bias of a `Linear` and the GELU after it (an MLP's `c_fc`): `h += b` over rows of
/// `h (.., C)`, in place (the GELU's input, which its backward reads), and returns
/// `gelu(h)`. On CUDA ([`bias_gelu_fusable`]) one kernel (`bias_gelu_fwd`); elsewhere
/// [`bias_add_`](super::bias_add_) then [`pointwise`], the same bits.
///
/// # Errors
/// As [`bias_add_`](super::bias_add_) and [`pointwise`].
pub fn bias_gelu_(h: &Tensor, b: &Tensor) -> Result<Tensor> {
    if let (Device::Cuda(i), true) = (h.device(), bias_gelu_fusable(h, b, b)) {
        let y = super::output_as(h.shape(), h.device(), h.dtype())?;
        crate::backend::cuda::bias_gelu_fwd(
            &*super::stream(i)?,
            &h.as_device_tensor()?,
            &b.as_device_tensor()?,
            &y.as_device_tensor()?,
        )?;
        return Ok(y);
    }
    super::bias_add_(h, b)?;
    pointwise(Pointwise::Gelu, h)
}
