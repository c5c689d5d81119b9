//! The backward of `layer_norm` for a bf16/f16 input (PyTorch `native_layer_norm` for a
//! reduced-precision input with weight and bias of the same dtype). The forward
//! (`ops::layernorm`) computes statistics and output in f32 and rounds the output once,
//! keeping `mean` and `rstd` rounded to the input's dtype (they are `input.dtype` tensors
//! in PyTorch's CPU kernel); the backward here runs PyTorch's CPU formula on the saved
//! input and those rounded statistics (host loops on the CPU, the `lowp.cu` kernels on
//! CUDA, the same operations in the same order), from `x` and the ROUNDED saved `mean` `m`
//! and `rstd` `a`, per row of `C` elements:
//! - `dx = round(a dy w + bb x + c)` with `ds = sum dy x w`, `db = sum dy w`,
//!   `bb = (db m - ds) a^3 / C`, `c = -bb m - db a / C`, all in f32 (one rounding);
//! - `dw`, `db`: accumulated row after row in a low-precision buffer
//!   (`acc_w = round(acc_w + dy (a x - a m))`, `acc_b = round(acc_b + dy)`, from zero),
//!   which `ops::layernorm` then adds to the gradients (`round(g + acc)`, exact for a fresh
//!   zero gradient).
//!
//! Shapes are checked by the caller: `x, dy (n, C)`, `w (C)`, `mean, rstd (n)`.

use super::{down, up};
use crate::backend::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// The host backward: `dx` (f32 holding values rounded to `dtype`) and the accumulated
/// `[acc_w, acc_b]` (f32 holding values rounded to `dtype`).
///
/// # Errors
/// A failed borrow of a tensor's storage; [`crate::Error::Cuda`] for a widening copy.
pub(crate) fn backward_host(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    dtype: DType,
) -> Result<(Tensor, [Tensor; 2])> {
    let (n, c) = (rstd.numel(), w.numel());
    // Pooled f32 copies (the CPU's host loops read f32).
    let [x32, dy32, w32, m32, a32] = [x, dy, w, mean, rstd].map(up);
    let (x32, dy32, w32, m32, a32) = (x32?, dy32?, w32?, m32?, a32?);
    let (xv, dyv, wv) = (x32.f32()?, dy32.f32()?, w32.f32()?);
    let (mv, av) = (m32.f32()?, a32.f32()?);
    let r = |v: f32| super::round(v, dtype);
    let scale = 1.0 / c as f32;
    let dx32 = super::super::output(dy.shape(), Device::Cpu)?;
    let mut dx = dx32.f32_mut()?;
    let (acc_w32, acc_b32) = (
        Tensor::zeros(&[c], DType::F32),
        Tensor::zeros(&[c], DType::F32),
    );
    let (mut acc_w, mut acc_b) = (acc_w32.f32_mut()?, acc_b32.f32_mut()?);
    for i in 0..n {
        let span = i * c..(i + 1) * c;
        let (xr, dyr) = (&xv[span.clone()], &dyv[span.clone()]);
        let (m, a) = (mv[i], av[i]);
        let (mut ds, mut dbs) = (0.0f32, 0.0f32);
        for j in 0..c {
            ds += dyr[j] * xr[j] * wv[j];
            dbs += dyr[j] * wv[j];
        }
        let bb = (dbs * m - ds) * a * a * a * scale;
        let cc = -bb * m - dbs * a * scale;
        for (j, o) in dx[span].iter_mut().enumerate() {
            *o = r(a * dyr[j] * wv[j] + bb * xr[j] + cc);
            acc_w[j] = r(acc_w[j] + dyr[j] * (a * xr[j] - a * m));
            acc_b[j] = r(acc_b[j] + dyr[j]);
        }
    }
    drop((dx, acc_w, acc_b));
    Ok((dx32, [acc_w32, acc_b32]))
}

/// The backward on `cuda:ordinal`: the `lowp.cu` kernels on the current stream (no host
/// read). Every tensor is converted to `dtype` first (a no-op for a unit's own tensors).
/// Returns `dx` in `dtype` and, when `grads`, `[acc_w, acc_b]` in `dtype`.
///
/// # Errors
/// [`crate::Error::Cuda`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_cuda(
    ordinal: usize,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    grads: bool,
    dtype: DType,
) -> Result<(Tensor, Option<[Tensor; 2]>)> {
    use crate::backend::cuda;
    let s = super::super::stream(ordinal)?;
    let [dy, x, w, mean, rstd] = [dy, x, w, mean, rstd].map(|t| down(t, dtype));
    let (dy, x, w, mean, rstd) = (dy?, x?, w?, mean?, rstd?);
    let dx = Tensor::zeros_on(dy.shape(), dtype, dy.device())?;
    cuda::layernorm_bwd_lp(
        &s,
        &x.as_device_tensor()?,
        &dy.as_device_tensor()?,
        &w.as_device_tensor()?,
        &mean.as_device_tensor()?,
        &rstd.as_device_tensor()?,
        &dx.as_device_tensor()?,
    )?;
    if grads {
        let c = w.numel();
        let acc_w = Tensor::zeros_on(&[c], dtype, dy.device())?;
        let acc_b = Tensor::zeros_on(&[c], dtype, dy.device())?;
        cuda::layernorm_wgrad_lp(
            &s,
            &x.as_device_tensor()?,
            &dy.as_device_tensor()?,
            &mean.as_device_tensor()?,
            &rstd.as_device_tensor()?,
            &acc_w.as_device_tensor()?,
            &acc_b.as_device_tensor()?,
        )?;
        return Ok((dx, Some([acc_w, acc_b])));
    }
    Ok((dx, None))
}
