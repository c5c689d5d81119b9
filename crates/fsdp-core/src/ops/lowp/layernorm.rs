//! `layer_norm` of a bf16/f16 input (PyTorch `native_layer_norm` for a reduced-precision
//! input with weight and bias of the same dtype): statistics and output in f32, the output
//! rounded once; `mean` and `rstd` are kept rounded to the input's dtype (they are
//! `input.dtype` tensors in PyTorch's CPU kernel), and the backward runs PyTorch's CPU
//! formula on the saved input and those rounded statistics (host loops on the CPU, the
//! `lowp.cu` kernels on CUDA, the same operations in the same order).

use super::{down, store, up, work_out};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::ops::{LayerNormSaved, MatmulDims, Transpose};
use crate::tensor::{DType, Tensor};

/// `y = round((x - mean) * rstd * w + b)`; saves `x`, `mean` and `rstd` (rounded).
pub(crate) fn forward(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
    dtype: DType,
) -> Result<(Tensor, LayerNormSaved)> {
    let x32 = up(x)?;
    let (y32, s32) = crate::ops::layer_norm(&x32, &up(w)?, &up(b)?, eps)?;
    let c = w.numel();
    let n = s32.rstd.numel();
    // Row means in f32: sum_j x[r, j] * (1 / C), one product per row (any device).
    let mean32 = crate::ops::output(&[n], x.device())?;
    if n > 0 && c > 0 {
        let inv_c = crate::ops::output(&[c], x.device())?;
        crate::ops::fill_(&inv_c, 1.0 / c as f32)?;
        let _f32 = crate::ops::autocast(None);
        crate::ops::matmul(
            &mean32,
            &x32,
            &inv_c,
            MatmulDims::new(n, c, 1, Transpose::NN),
            false,
        )?;
    } else {
        crate::ops::fill_(&mean32, 0.0)?;
    }
    let saved = LayerNormSaved {
        xhat: x.clone(),
        rstd: down(&s32.rstd, dtype)?,
        mean: Some(down(&mean32, dtype)?),
    };
    Ok((down(&y32, dtype)?, saved))
}

/// The backward of [`forward`], as PyTorch's CPU `layer_norm_backward` runs it on a
/// reduced-precision input (host loops; on CUDA through the host), from `x` and the
/// ROUNDED saved `mean` `m` and `rstd` `a`, per row of `C` elements:
/// - `dx = round(a dy w + bb x + c)` with `ds = sum dy x w`, `db = sum dy w`,
///   `bb = (db m - ds) a^3 / C`, `c = -bb m - db a / C`, all in f32 (one rounding);
/// - `dw`, `db`: accumulated row after row in a low-precision buffer
///   (`acc_w = round(acc_w + dy (a x - a m))`, `acc_b = round(acc_b + dy)`, from zero),
///   then added to the gradients (`round(g + acc)`, exact for a fresh zero gradient).
pub(crate) fn backward(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let dtype = super::lp_of(&[dy, w, &saved.xhat]).unwrap_or(DType::BF16);
    let Some(mean) = &saved.mean else {
        // An f32 forward with a low-precision output gradient: the f32 backward.
        let dw32 = dw.map(|g| work_out(g, true)).transpose()?;
        let db32 = db.map(|g| work_out(g, true)).transpose()?;
        let dx = crate::ops::layer_norm_backward(
            &up(dy)?,
            saved,
            &up(w)?,
            dw32.as_ref(),
            db32.as_ref(),
        )?;
        for (g, g32) in [(dw, &dw32), (db, &db32)] {
            if let (Some(g), Some(g32)) = (g, g32) {
                store(g, g32)?;
            }
        }
        return down(&dx, dtype);
    };
    let x = &saved.xhat;
    let n = saved.rstd.numel();
    let c = w.numel();
    if dy.numel() != x.numel() || n * c != x.numel() || mean.numel() != n {
        return Err(Error::ShapeMismatch {
            op: "LayerNorm.backward",
            expected: x.shape().to_vec(),
            got: dy.shape().to_vec(),
        });
    }
    crate::ops::layernorm::check_grad_shapes(dw, db, c)?;
    if let Device::Cuda(i) = dy.device() {
        return backward_cuda(i, dy, x, w, mean, &saved.rstd, (dw, db), dtype);
    }
    // Pooled f32 copies (the CPU's host loops read f32).
    let [x32, dy32, w32, m32, a32] = [x, dy, w, mean, &saved.rstd].map(up);
    let (x32, dy32, w32, m32, a32) = (x32?, dy32?, w32?, m32?, a32?);
    let (xv, dyv, wv) = (x32.f32()?, dy32.f32()?, w32.f32()?);
    let (mv, av) = (m32.f32()?, a32.f32()?);
    let r = |v: f32| super::loss::round(v, dtype);
    let scale = 1.0 / c as f32;
    let dx32 = crate::ops::output(dy.shape(), Device::Cpu)?;
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
    for (g, acc) in [(dw, acc_w32), (db, acc_b32)] {
        if let Some(g) = g {
            let acc = down(&acc, g.dtype())?;
            if g.dtype() == acc.dtype() {
                crate::ops::add_(g, &acc)?;
            } else {
                super::add_(g, &acc)?;
            }
        }
    }
    down(&dx32, dtype)
}

/// [`backward`] on `cuda:ordinal`: the `lowp.cu` kernels on the current stream (no host
/// read). Every tensor is converted to `dtype` first (a no-op for a unit's own tensors).
#[allow(clippy::too_many_arguments)]
fn backward_cuda(
    ordinal: usize,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    (dw, db): (Option<&Tensor>, Option<&Tensor>),
    dtype: DType,
) -> Result<Tensor> {
    use crate::backend::cuda;
    let s = crate::ops::stream(ordinal)?;
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
    if dw.is_some() || db.is_some() {
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
        for (g, acc) in [(dw, acc_w), (db, acc_b)] {
            if let Some(g) = g {
                if g.dtype() == acc.dtype() {
                    crate::ops::add_(g, &acc)?;
                } else {
                    super::add_(g, &acc)?;
                }
            }
        }
    }
    Ok(dx)
}
