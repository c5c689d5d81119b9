//! Typed ops for the LayerNorm kernels of `nn.cu` (f32 or f64 tensors, as the other layer
//! ops in `nn_ops.rs`), with the residual add fused in where the GPT block has one: the
//! forward of `LayerNorm(x + r)` also writes `x + r` (one launch instead of the add's and
//! the norm's), the backward adds the residual stream's gradient into `dx`, and computes the
//! parameter gradients in the same launch. CPU references: `backend::cpu::kernels::
//! {layernorm_fwd, layernorm_bwd, layernorm_bwd_params}` after `ops::add` (f32), the f64
//! ops of `ops::double`.

use super::launch::{self, Arg, Grid};
use super::nn_ops::{floats, row_block, rows_of};
use super::ops::{check_numel, kname};
use super::{DeviceTensor, Stream};
use crate::error::Result;
use crate::tensor::DType;

/// LayerNorm forward over rows of `x (rows, C)`: writes `y`, `xhat` (same shape) and
/// `rstd (rows)` (`layernorm_fwd_{f32,f64}`), as `nn::LayerNorm::forward`.
///
/// # Errors
/// `ShapeMismatch` when the sizes disagree; `DTypeMismatch`; [`Error::Cuda`](crate::Error::Cuda).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    eps: f64,
    y: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
) -> Result<()> {
    fwd(s, x, None, w, b, eps, y, xhat, rstd)
}

/// The residual add fused with the LayerNorm after it: `sum = x + r` (as `ops::add` rounds
/// it), then [`layernorm_fwd`] of `sum`, in one launch (`layernorm_fwd_{f32,f64}` with a
/// residual). `x, r, sum, y, xhat (rows, C)`, `rstd (rows)`.
///
/// # Errors
/// As [`layernorm_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn add_layernorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    r: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    eps: f64,
    sum: &DeviceTensor,
    y: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
) -> Result<()> {
    fwd(s, x, Some((r, sum)), w, b, eps, y, xhat, rstd)
}

#[allow(clippy::too_many_arguments)]
fn fwd(
    s: &Stream,
    x: &DeviceTensor,
    res: Option<(&DeviceTensor, &DeviceTensor)>,
    w: &DeviceTensor,
    b: &DeviceTensor,
    eps: f64,
    y: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
) -> Result<()> {
    let mut ts = vec![x, w, b, y, xhat, rstd];
    if let Some((r, sum)) = res {
        ts.extend([r, sum]);
    }
    let dt = floats("layernorm_fwd", s, &ts)?;
    let c = w.numel();
    check_numel("layernorm_fwd", c, b)?;
    let rows = rows_of("layernorm_fwd", x, c)?;
    check_numel("layernorm_fwd", x.numel(), y)?;
    check_numel("layernorm_fwd", x.numel(), xhat)?;
    check_numel("layernorm_fwd", rows, rstd)?;
    if let Some((r, sum)) = res {
        check_numel("layernorm_fwd(residual)", x.numel(), r)?;
        check_numel("layernorm_fwd(sum)", x.numel(), sum)?;
    }
    if rows == 0 {
        return Ok(());
    }
    let (r, sum) = res.map_or((0, 0), |(r, sum)| (r.ptr(), sum.ptr()));
    // SAFETY: sizes checked above; `r` and `sum` are null together or both hold rows * C.
    unsafe {
        launch::layernorm_fwd(
            s,
            kname!("layernorm_fwd", dt),
            Grid::rows(s, rows, row_block(c)),
            x.ptr(),
            r,
            w.ptr(),
            b.ptr(),
            sum,
            y.ptr(),
            xhat.ptr(),
            rstd.ptr(),
            rows as i64,
            c as i64,
            Arg::float_of(dt, eps),
        )
    }
}

/// LayerNorm backward: `dx` (=), and `dw += sum dy xhat`, `db += sum dy` (+=), in one
/// launch (`layernorm_bwd_{f32,f64}`: row blocks for `dx`, column blocks for `dw, db`).
///
/// # Errors
/// As [`layernorm_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_bwd(
    s: &Stream,
    dy: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
    w: &DeviceTensor,
    dx: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    bwd(s, dy, xhat, rstd, w, None, dx, dw, db)
}

/// [`layernorm_bwd`] with the residual stream's gradient `res` added into `dx` after its
/// rounding (`dx = res + LayerNorm'(dy)`, as `ops::add` of the two), in the same launch;
/// and, when `res_sum` is given, `res_sum[j] += sum_r res[r, j]` ([`super::bias_grad`] of
/// `res`, same bits: the bias gradient of the `Linear` whose output gradient `res` is).
///
/// # Errors
/// As [`layernorm_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_bwd_add(
    s: &Stream,
    dy: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
    w: &DeviceTensor,
    res: &DeviceTensor,
    res_sum: Option<&DeviceTensor>,
    dx: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    bwd(s, dy, xhat, rstd, w, Some((res, res_sum)), dx, dw, db)
}

#[allow(clippy::too_many_arguments)]
fn bwd(
    s: &Stream,
    dy: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
    w: &DeviceTensor,
    res: Option<(&DeviceTensor, Option<&DeviceTensor>)>,
    dx: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    let mut ts = vec![dy, xhat, rstd, w, dx, dw, db];
    let (res, res_sum) = (res.map(|r| r.0), res.and_then(|r| r.1));
    ts.extend(res);
    ts.extend(res_sum);
    let dt = floats("layernorm_bwd", s, &ts)?;
    let c = w.numel();
    let rows = rows_of("layernorm_bwd", dy, c)?;
    check_numel("layernorm_bwd", dy.numel(), xhat)?;
    check_numel("layernorm_bwd", dy.numel(), dx)?;
    check_numel("layernorm_bwd", rows, rstd)?;
    check_numel("layernorm_bwd", c, dw)?;
    check_numel("layernorm_bwd", c, db)?;
    if let Some(r) = res {
        check_numel("layernorm_bwd(residual)", dy.numel(), r)?;
    }
    if let Some(r) = res_sum {
        check_numel("layernorm_bwd(residual sum)", c, r)?;
    }
    if rows == 0 {
        return Ok(());
    }
    // Row blocks as the forward's, then one block per 32 columns, all of the row size.
    let block = row_block(c);
    let row_blocks = Grid::rows(s, rows, block).grid.0;
    let g = Grid {
        grid: (row_blocks + Grid::columns(c).grid.0, 1, 1),
        block,
    };
    // SAFETY: sizes checked above; `res` null or rows * C, `res_sum` null or C.
    unsafe {
        launch::layernorm_bwd(
            s,
            kname!("layernorm_bwd", dt),
            g,
            dy.ptr(),
            xhat.ptr(),
            rstd.ptr(),
            w.ptr(),
            res.map_or(0, DeviceTensor::ptr),
            dx.ptr(),
            dw.ptr(),
            db.ptr(),
            res_sum.map_or(0, DeviceTensor::ptr),
            rows as i64,
            c as i64,
            i64::from(row_blocks),
        )
    }
}
