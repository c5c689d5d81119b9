//! Layer normalization over the last dimension on any device (`F.layer_norm` with an
//! affine weight and bias): the forward, and the backward to the input and parameters.
//! CPU: [`crate::backend::cpu::fast::layernorm_fwd`] / `layernorm_bwd` (the references in
//! `backend::cpu::kernels` with 8 rows interleaved, same bits) over blocks of rows in
//! parallel, and column-split parameter loops; CUDA: `layernorm_*_f32` of `nn.cu` (f64
//! tensors: `layernorm_*_f64` there, the host loops of `double/` on the CPU).

pub use super::types::LayerNormSaved;
use super::{lowp, same_device, MatmulDims, Transpose};
use crate::backend::cpu::fast;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

fn rows(op: &'static str, x: &Tensor, c: usize) -> Result<usize> {
    if x.shape().last() != Some(&c) {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![c],
            got: x.shape().to_vec(),
        });
    }
    Ok(x.shape()[..x.shape().len() - 1].iter().product())
}

/// `y = (x - mean) / sqrt(var + eps) * w + b` per row of `x (.., C)` with the biased
/// variance, `w, b (C)`. Returns `y` (shape of `x`) and what the backward needs.
///
/// # Errors
/// `ShapeMismatch` when `x`'s last dimension or `b` is not `C = w.numel()`; device and dtype
/// errors; [`Error::Cuda`].
pub fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
) -> Result<(Tensor, LayerNormSaved)> {
    forward(x, None, w, b, eps).map(|(_, y, saved)| (y, saved))
}

/// The residual add and the LayerNorm after it (the GPT block's `x1 = x + attn(..)`, then
/// `ln_2(x1)`): returns `sum = x + r` ([`add`](super::add)`(x, r)`, same bits) and
/// [`layer_norm`]`(sum, w, b, eps)`. On CUDA (f32 or f64, `x` and `r` of one dtype and
/// shape) one kernel computes both (`layernorm_fwd` with a residual); elsewhere the two ops
/// run one after the other.
///
/// # Errors
/// As [`add`](super::add) and [`layer_norm`].
pub fn add_layer_norm(
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor, LayerNormSaved)> {
    let (sum, y, saved) = forward(x, Some(r), w, b, eps)?;
    Ok((sum.unwrap_or_else(|| x.clone()), y, saved))
}

/// Whether `layernorm_fwd`/`layernorm_bwd` can take `res` as their residual: a CUDA tensor
/// of `like`'s shape and dtype, f32 or f64 (not under low precision).
fn fusable(res: &Tensor, like: &Tensor) -> bool {
    res.device().is_cuda()
        && res.device() == like.device()
        && res.shape() == like.shape()
        && res.dtype() == like.dtype()
        && matches!(
            like.dtype(),
            crate::tensor::DType::F32 | crate::tensor::DType::F64
        )
}

/// [`layer_norm`] of `x`, or of `x + res` (returned first) when `res` is given.
fn forward(
    x: &Tensor,
    res: Option<&Tensor>,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
) -> Result<(Option<Tensor>, Tensor, LayerNormSaved)> {
    if let Some(r) = res.filter(|r| !fusable(r, x) || super::lowp::lp_of(&[w, b]).is_some()) {
        let sum = super::add(x, r)?;
        let (y, saved) = layer_norm(&sum, w, b, eps)?;
        return Ok((Some(sum), y, saved));
    }
    let device = same_device("layer_norm", &[x, w, b])?;
    if let Some(lp) = lowp::lp_of(&[x, w, b]) {
        let (y, saved) = forward_lowp(x, w, b, eps, lp, device)?;
        return Ok((None, y, saved));
    }
    if super::double::any_f64(&[x, w, b]) && !device.is_cuda() {
        forward_dims(x, w, b)?;
        // eps as the decimal it spells (PyTorch's eps is a Python float).
        let (y, saved) = super::double::layer_norm(x, w, b, super::double::widen(eps))?;
        return Ok((None, y, saved));
    }
    forward_native(x, res, w, b, eps, device)
}

/// `(C, rows)` of [`layer_norm`]'s `x (rows, C)`, with `b` checked to be `(C)`.
fn forward_dims(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<(usize, usize)> {
    let c = w.numel();
    let n = rows("layer_norm", x, c)?;
    if b.numel() != c {
        return Err(Error::ShapeMismatch {
            op: "layer_norm(bias)",
            expected: vec![c],
            got: b.shape().to_vec(),
        });
    }
    Ok((c, n))
}

/// The forward of a bf16/f16 input: [`forward_native`] of the widened tensors, the output
/// rounded once to `dtype`; saves `x` itself, `mean` and `rstd` rounded to `dtype` (see
/// [`LayerNormSaved`] and `lowp/layernorm.rs`).
fn forward_lowp(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
    dtype: DType,
    device: Device,
) -> Result<(Tensor, LayerNormSaved)> {
    let x32 = lowp::up(x)?;
    let (_, y32, s32) = forward_native(&x32, None, &lowp::up(w)?, &lowp::up(b)?, eps, device)?;
    let c = w.numel();
    let n = s32.rstd.numel();
    // Row means in f32: sum_j x[r, j] * (1 / C), one product per row (any device).
    let mean32 = super::output(&[n], x.device())?;
    if n > 0 && c > 0 {
        let inv_c = super::output(&[c], x.device())?;
        super::fill_(&inv_c, 1.0 / c as f32)?;
        let _f32 = super::autocast(None);
        super::matmul(
            &mean32,
            &x32,
            &inv_c,
            MatmulDims::new(n, c, 1, Transpose::NN),
            false,
        )?;
    } else {
        super::fill_(&mean32, 0.0)?;
    }
    let saved = LayerNormSaved {
        xhat: x.clone(),
        rstd: lowp::down(&s32.rstd, dtype)?,
        mean: Some(lowp::down(&mean32, dtype)?),
    };
    Ok((lowp::down(&y32, dtype)?, saved))
}

/// [`forward`] of f32 tensors (or f64 ones on CUDA), checked: the kernels on CUDA (with
/// the residual fused in when given), else the host rows.
fn forward_native(
    x: &Tensor,
    res: Option<&Tensor>,
    w: &Tensor,
    b: &Tensor,
    eps: f32,
    device: Device,
) -> Result<(Option<Tensor>, Tensor, LayerNormSaved)> {
    let dt = super::compute_dtype("layer_norm", &[x, w, b], device)?;
    let (c, n) = forward_dims(x, w, b)?;
    if let Some(r) = res.filter(|r| r.dtype() != dt) {
        // A residual that the kernel cannot take with these parameters: add first.
        let sum = super::add(x, r)?;
        let (y, saved) = layer_norm(&sum, w, b, eps)?;
        return Ok((Some(sum), y, saved));
    }
    let (y, xhat, rstd) = (
        super::output_as(x.shape(), device, dt)?,
        super::output_as(x.shape(), device, dt)?,
        super::output_as(&[n], device, dt)?,
    );
    if c == 0 || n == 0 {
        let sum = res.map(|r| super::add(x, r)).transpose()?;
        return Ok((
            sum,
            y,
            LayerNormSaved {
                xhat,
                rstd,
                mean: None,
            },
        ));
    }
    if let Device::Cuda(i) = device {
        let s = super::stream(i)?;
        // f64: eps as the decimal it spells, as the host's f64 path.
        let eps = match dt {
            crate::tensor::DType::F64 => super::double::widen(eps),
            _ => f64::from(eps),
        };
        let (xd, wd, bd) = (
            x.as_device_tensor()?,
            w.as_device_tensor()?,
            b.as_device_tensor()?,
        );
        let (yd, xhd, rsd) = (
            y.as_device_tensor()?,
            xhat.as_device_tensor()?,
            rstd.as_device_tensor()?,
        );
        let sum = match res {
            Some(r) => {
                let sum = super::output_as(x.shape(), device, dt)?;
                let (rd, sd) = (r.as_device_tensor()?, sum.as_device_tensor()?);
                crate::backend::cuda::add_layernorm_fwd(
                    &s, &xd, &rd, &wd, &bd, eps, &sd, &yd, &xhd, &rsd,
                )?;
                Some(sum)
            }
            None => {
                crate::backend::cuda::layernorm_fwd(&s, &xd, &wd, &bd, eps, &yd, &xhd, &rsd)?;
                None
            }
        };
        return Ok((
            sum,
            y,
            LayerNormSaved {
                xhat,
                rstd,
                mean: None,
            },
        ));
    }
    // Only CUDA tensors come with a residual (`fusable`).
    if res.is_some() {
        return Err(Error::Fsdp("internal: a fused residual on the host".into()));
    }
    {
        let (xv, wv, bv) = (x.f32()?, w.f32()?, b.f32()?);
        let (xs, ws, bs): (&[f32], &[f32], &[f32]) = (&xv, &wv, &bv);
        let (mut yv, mut xh, mut rs) = (y.f32_mut()?, xhat.f32_mut()?, rstd.f32_mut()?);
        // Whole rows per part: each row is the reference loop.
        par::rows_mut3(
            (&mut yv, c),
            (&mut xh, c),
            (&mut rs, 1),
            n,
            par::HEAVY_GRAIN / c,
            |r, y, xhat, rstd| {
                fast::layernorm_fwd(&xs[r.start * c..r.end * c], ws, bs, eps, y, xhat, rstd)
            },
        )?;
    }
    Ok((
        None,
        y,
        LayerNormSaved {
            xhat,
            rstd,
            mean: None,
        },
    ))
}

/// Given `dy` (shape of the forward's `x`), returns `dx = rstd (dy w - mean(dy w) - xhat
/// mean(dy w xhat))` per row and accumulates `dw += sum_rows dy xhat`, `db += sum_rows dy`
/// into the gradients given (`None` for a frozen parameter).
///
/// # Errors
/// `ShapeMismatch` when `dy` does not match the saved forward or a gradient is not `(C)`;
/// device and dtype errors; [`Error::Cuda`].
pub fn layer_norm_backward(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    backward(dy, saved, w, dw, db, None)
}

/// [`layer_norm_backward`] plus the residual stream's gradient: `res + dx`
/// ([`add`](super::add)`(res, dx)`, same bits), as the GPT block's `dy + ln_2.backward(g)`;
/// and when `res_db` is given, `res_db += ` the column sums of `res`
/// ([`bias_grad`](super::bias_grad)`(res, res_db)`, same bits: the bias gradient of the
/// `Linear` whose output gradient `res` is, the block's `c_proj`). On CUDA (f32 or f64,
/// `res` of `dy`'s dtype and shape) one kernel computes `dx` with the add, the parameter
/// gradients and `res_db` (`layernorm_bwd` with a residual).
///
/// # Errors
/// As [`layer_norm_backward`], [`add`](super::add) and [`bias_grad`](super::bias_grad).
pub fn layer_norm_backward_add(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
    res: &Tensor,
    res_db: Option<&Tensor>,
) -> Result<Tensor> {
    let fused = res_db.is_none_or(|g| g.dtype() == res.dtype() && g.device() == res.device());
    let dx = backward(dy, saved, w, dw, db, Some((res, res_db.filter(|_| fused))))?;
    if let (Some(g), false) = (res_db, fused) {
        super::bias_grad(res, g)?;
    }
    Ok(dx)
}

/// `res`: the residual gradient to add into `dx`, with the gradient its column sums go
/// into (see [`layer_norm_backward_add`]).
fn backward(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
    res: Option<(&Tensor, Option<&Tensor>)>,
) -> Result<Tensor> {
    let res_db = res.and_then(|r| r.1);
    let res = res.map(|r| r.0);
    let fused = res.filter(|r| fusable(r, dy) && saved.mean.is_none() && r.dtype() == w.dtype());
    if let (Some(r), None) = (res, fused) {
        let dx = layer_norm_backward(dy, saved, w, dw, db)?;
        if let Some(g) = res_db {
            super::bias_grad(r, g)?;
        }
        return super::add(r, &dx);
    }
    if saved.mean.is_some() || lowp::lp_of(&[dy, w]).is_some() {
        return backward_lowp(dy, saved, w, dw, db);
    }
    backward_native(dy, saved, w, (dw, db), fused.map(|r| (r, res_db)))
}

/// The backward of a bf16/f16 forward (`saved.mean` given: PyTorch's formula on the saved
/// input and rounded statistics, `lowp/layernorm.rs`), or of an f32 forward with a
/// bf16/f16 output gradient or weight ([`backward_native`] of the widened tensors, each
/// output rounded once).
fn backward_lowp(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let dtype = lowp::lp_of(&[dy, w, &saved.xhat]).unwrap_or(DType::BF16);
    let Some(mean) = &saved.mean else {
        // An f32 forward with a low-precision output gradient: the f32 backward.
        let dw32 = dw.map(|g| lowp::work_out(g, true)).transpose()?;
        let db32 = db.map(|g| lowp::work_out(g, true)).transpose()?;
        let (dy32, w32) = (lowp::up(dy)?, lowp::up(w)?);
        let dx = backward_native(&dy32, saved, &w32, (dw32.as_ref(), db32.as_ref()), None)?;
        for (g, g32) in [(dw, &dw32), (db, &db32)] {
            if let (Some(g), Some(g32)) = (g, g32) {
                lowp::store(g, g32)?;
            }
        }
        return lowp::down(&dx, dtype);
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
    check_grad_shapes(dw, db, c)?;
    let rstd = &saved.rstd;
    if let Device::Cuda(i) = dy.device() {
        let grads = dw.is_some() || db.is_some();
        let (dx, acc) = lowp::layernorm::backward_cuda(i, dy, x, w, mean, rstd, grads, dtype)?;
        if let Some([acc_w, acc_b]) = acc {
            for (g, acc) in [(dw, acc_w), (db, acc_b)] {
                if let Some(g) = g {
                    add_grad(g, &acc)?;
                }
            }
        }
        return Ok(dx);
    }
    let (dx32, [acc_w, acc_b]) = lowp::layernorm::backward_host(dy, x, w, mean, rstd, dtype)?;
    for (g, acc) in [(dw, acc_w), (db, acc_b)] {
        if let Some(g) = g {
            add_grad(g, &lowp::down(&acc, g.dtype())?)?;
        }
    }
    lowp::down(&dx32, dtype)
}

/// `g = round(g + acc)`: a parameter gradient of any float dtype plus the low-precision
/// sums of [`backward_lowp`].
fn add_grad(g: &Tensor, acc: &Tensor) -> Result<()> {
    if g.dtype() == acc.dtype() {
        super::add_(g, acc)
    } else {
        super::elementwise::add_rounded_(g, acc)
    }
}

/// [`backward`] in the dtype of the tensors (after the low-precision check: f32, f64 on
/// CUDA, or the f64 host loops of `double/`, as the saved statistics are never widened);
/// `fused`: the residual to add into `dx` in the same kernel, with the gradient its column
/// sums go into (CUDA only).
fn backward_native(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    (dw, db): (Option<&Tensor>, Option<&Tensor>),
    fused: Option<(&Tensor, Option<&Tensor>)>,
) -> Result<Tensor> {
    let res_db = fused.and_then(|r| r.1);
    let fused = fused.map(|r| r.0);
    let LayerNormSaved { xhat, rstd, .. } = saved;
    let mut ts = vec![dy, xhat, rstd, w];
    ts.extend(dw);
    ts.extend(db);
    let device = same_device("layer_norm_backward", &ts)?;
    let f64_path = super::double::any_f64(&ts) && !device.is_cuda();
    let dt = match f64_path {
        true => crate::tensor::DType::F64,
        false => super::compute_dtype("layer_norm_backward", &ts, device)?,
    };
    let c = w.numel();
    if dy.numel() != xhat.numel() || rstd.numel() * c != xhat.numel() {
        return Err(Error::ShapeMismatch {
            op: "LayerNorm.backward",
            expected: vec![xhat.numel()],
            got: dy.shape().to_vec(),
        });
    }
    check_grad_shapes(dw, db, c)?;
    if f64_path {
        return super::double::layer_norm_backward(dy, saved, w, dw, db);
    }
    let dx = super::output_as(dy.shape(), device, dt)?;
    if c == 0 || dy.numel() == 0 {
        return match fused {
            Some(r) => {
                if let Some(g) = res_db {
                    super::bias_grad(r, g)?;
                }
                super::add(r, &dx)
            }
            None => Ok(dx),
        };
    }
    if let Device::Cuda(i) = device {
        // The kernels write both parameter gradients: a frozen one gets a scratch buffer.
        let scratch = |g: Option<&Tensor>| match g {
            Some(g) => Ok(g.clone()),
            None => Tensor::zeros_on(&[c], dt, device),
        };
        let (dw, db) = (scratch(dw)?, scratch(db)?);
        let s = super::stream(i)?;
        let (dyd, xhd, rsd, wd) = (
            dy.as_device_tensor()?,
            xhat.as_device_tensor()?,
            rstd.as_device_tensor()?,
            w.as_device_tensor()?,
        );
        let (dxd, dwd, dbd) = (
            dx.as_device_tensor()?,
            dw.as_device_tensor()?,
            db.as_device_tensor()?,
        );
        match fused {
            Some(r) => crate::backend::cuda::layernorm_bwd_add(
                &s,
                &dyd,
                &xhd,
                &rsd,
                &wd,
                &r.as_device_tensor()?,
                res_db.map(Tensor::as_device_tensor).transpose()?.as_ref(),
                &dxd,
                &dwd,
                &dbd,
            )?,
            None => {
                crate::backend::cuda::layernorm_bwd(&s, &dyd, &xhd, &rsd, &wd, &dxd, &dwd, &dbd)?
            }
        }
        return Ok(dx);
    }
    // Only CUDA tensors come with a residual (`fusable`).
    if fused.is_some() {
        return Err(Error::Fsdp("internal: a fused residual on the host".into()));
    }
    let (dyv, xh) = (dy.f32()?, xhat.f32()?);
    let (dys, xhs): (&[f32], &[f32]) = (&dyv, &xh);
    // Rows are added into the gradients one after another; parts own columns, so every
    // element sees the same additions in the same order for any thread count. One gradient
    // guard at a time: under FSDP both are views of one flat gradient buffer.
    if let Some(g) = dw {
        par::cols_mut(&mut g.f32_mut()?, dys.len() / c, |cols, g| {
            for (dyr, xr) in dys.chunks_exact(c).zip(xhs.chunks_exact(c)) {
                crate::backend::cpu::ops::add_mul_(g, &dyr[cols.clone()], &xr[cols.clone()]);
            }
            Ok(())
        })?;
    }
    if let Some(g) = db {
        par::cols_mut(&mut g.f32_mut()?, dys.len() / c, |cols, g| {
            for dyr in dys.chunks_exact(c) {
                crate::backend::cpu::ops::add_(g, &dyr[cols.clone()]);
            }
            Ok(())
        })?;
    }
    let n = rstd.numel();
    let (rv, wv) = (rstd.f32()?, w.f32()?);
    let (rs, ws): (&[f32], &[f32]) = (&rv, &wv);
    par::rows_mut(&mut dx.f32_mut()?, n, c, par::HEAVY_GRAIN / c, |r, dx| {
        let span = r.start * c..r.end * c;
        fast::layernorm_bwd(&dys[span.clone()], &xhs[span], &rs[r], ws, dx)
    })?;
    Ok(dx)
}

/// The parameter gradients `dw` and `db`, when given, hold `c` elements each (the
/// LayerNorm's normalized size).
///
/// # Errors
/// `ShapeMismatch` naming the first gradient of another size.
pub(crate) fn check_grad_shapes(dw: Option<&Tensor>, db: Option<&Tensor>, c: usize) -> Result<()> {
    match dw.into_iter().chain(db).find(|g| g.numel() != c) {
        Some(g) => Err(Error::ShapeMismatch {
            op: "layer_norm_backward(grad)",
            expected: vec![c],
            got: g.shape().to_vec(),
        }),
        None => Ok(()),
    }
}
