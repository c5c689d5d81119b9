//! Typed ops for `batchnorm.cu`: BatchNorm1d's statistics, output and backward on the
//! device (CPU references: `ops/batchnorm/host.rs` for f32/f64, `ops/batchnorm/reduced.rs` for
//! bf16/f16). Each checks devices, dtypes and sizes, then launches on the stream; absent
//! optional tensors are null pointers. Channel kernels run one thread per channel (the
//! CPU's summation order), elementwise kernels one per element.

use super::launch::{self, Grid};
use super::ops::{check_device, check_dtype, check_numel};
use super::{BnDims, BnRunning, BnTypes, DeviceTensor, Stream};
use crate::error::{Error, Result};
use crate::tensor::DType;

impl BnTypes {
    /// The kernel `stem` for these dtypes (the statistics kernel's name has the running
    /// stats' dtype too).
    fn kernel(self, stem: Stem) -> Result<&'static str> {
        use DType::{BF16, F16, F32, F64};
        let unsupported = || Error::DTypeMismatch {
            op: "batchnorm kernel",
            expected: self.x,
            got: if self.param == self.x {
                self.running
            } else {
                self.param
            },
        };
        if !self.supported() {
            return Err(unsupported());
        }
        let (x, p, r) = (self.x, self.param, self.running);
        Ok(match (stem, x, p, r) {
            (Stem::Stats, F32, ..) => "batchnorm_stats_f32",
            (Stem::Stats, F64, ..) => "batchnorm_stats_f64",
            (Stem::Stats, F16, F16, F16) => "batchnorm_stats_lp_f16_f16_f16",
            (Stem::Stats, F16, F16, _) => "batchnorm_stats_lp_f16_f16_f32",
            (Stem::Stats, F16, _, F16) => "batchnorm_stats_lp_f16_f32_f16",
            (Stem::Stats, F16, ..) => "batchnorm_stats_lp_f16_f32_f32",
            (Stem::Stats, BF16, BF16, BF16) => "batchnorm_stats_lp_bf16_bf16_bf16",
            (Stem::Stats, BF16, BF16, _) => "batchnorm_stats_lp_bf16_bf16_f32",
            (Stem::Stats, BF16, _, BF16) => "batchnorm_stats_lp_bf16_f32_bf16",
            (Stem::Stats, BF16, ..) => "batchnorm_stats_lp_bf16_f32_f32",
            (Stem::Fwd, F32, ..) => "batchnorm_fwd_f32",
            (Stem::Fwd, F64, ..) => "batchnorm_fwd_f64",
            (Stem::Fwd, F16, F16, _) => "batchnorm_fwd_lp_f16_f16",
            (Stem::Fwd, F16, ..) => "batchnorm_fwd_lp_f16_f32",
            (Stem::Fwd, BF16, BF16, _) => "batchnorm_fwd_lp_bf16_bf16",
            (Stem::Fwd, BF16, ..) => "batchnorm_fwd_lp_bf16_f32",
            (Stem::BwdStats, F32, ..) => "batchnorm_bwd_stats_f32",
            (Stem::BwdStats, F64, ..) => "batchnorm_bwd_stats_f64",
            (Stem::BwdStats, F16, F16, _) => "batchnorm_bwd_stats_lp_f16_f16",
            (Stem::BwdStats, F16, ..) => "batchnorm_bwd_stats_lp_f16_f32",
            (Stem::BwdStats, BF16, BF16, _) => "batchnorm_bwd_stats_lp_bf16_bf16",
            (Stem::BwdStats, BF16, ..) => "batchnorm_bwd_stats_lp_bf16_f32",
            (Stem::BwdDx, F32, ..) => "batchnorm_bwd_dx_f32",
            (Stem::BwdDx, F64, ..) => "batchnorm_bwd_dx_f64",
            (Stem::BwdDx, F16, F16, _) => "batchnorm_bwd_dx_lp_f16_f16",
            (Stem::BwdDx, F16, ..) => "batchnorm_bwd_dx_lp_f16_f32",
            (Stem::BwdDx, BF16, BF16, _) => "batchnorm_bwd_dx_lp_bf16_bf16",
            (Stem::BwdDx, BF16, ..) => "batchnorm_bwd_dx_lp_bf16_f32",
            _ => return Err(unsupported()),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stem {
    Stats,
    Fwd,
    BwdStats,
    BwdDx,
}

/// A device pointer, or null for an absent tensor.
fn ptr(t: Option<&DeviceTensor>) -> u64 {
    t.map_or(0, DeviceTensor::ptr)
}

/// `t` (if given) on `s`'s device, of dtype `d` and `n` elements.
fn check_opt(
    op: &'static str,
    s: &Stream,
    t: Option<&DeviceTensor>,
    d: DType,
    n: usize,
) -> Result<()> {
    if let Some(t) = t {
        check_device(op, s, &[t])?;
        check_dtype(op, t, d)?;
        check_numel(op, n, t)?;
    }
    Ok(())
}

/// The per-channel statistics of `x (N, C, L)` into `stats` ([`BnTypes::stats_shape`]):
/// the batch's (`batch`, updating `running` when given) or `running`'s
/// (`batchnorm_stats_*`, one thread per channel).
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`, `InvalidArgument` for evaluation without running
/// stats; [`Error::Cuda`].
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_stats(
    s: &Stream,
    x: &DeviceTensor,
    dims: BnDims,
    types: BnTypes,
    running: Option<BnRunning<'_>>,
    eps: f64,
    batch: bool,
    stats: &DeviceTensor,
) -> Result<()> {
    let op = "batchnorm_stats";
    let name = types.kernel(Stem::Stats)?;
    check_opt(op, s, Some(x), types.x, dims.numel())?;
    let (sd, ss) = types.stats_shape(dims.c);
    check_opt(op, s, Some(stats), sd, ss[0] * ss[1])?;
    let (mean, var, count) = match running {
        Some(r) => {
            check_opt(op, s, Some(r.mean), types.running, dims.c)?;
            check_opt(op, s, Some(r.var), types.running, dims.c)?;
            check_opt(op, s, r.count, DType::I64, 1)?;
            (Some(r.mean), Some(r.var), r.count)
        }
        None if !batch => {
            crate::error::bail_arg!("batchnorm_stats: evaluation needs running stats")
        }
        None => (None, None, None),
    };
    let factor = running.map_or(0.0, |r| r.factor);
    if dims.c == 0 {
        return Ok(());
    }
    let (n, c, l) = dims.args();
    // SAFETY: sizes and dtypes checked above; absent tensors are null, which the kernel
    // does not read.
    unsafe {
        launch::batchnorm_stats(
            s,
            name,
            Grid::elementwise(s, dims.c),
            x.ptr(),
            ptr(mean),
            ptr(var),
            ptr(count),
            factor,
            eps,
            stats.ptr(),
            n,
            c,
            l,
            i32::from(batch),
        )
    }
}

/// `y` (`x`'s dtype and size) from `x`, the optional `w`, `b (C)` and the statistics of
/// [`batchnorm_stats`] (`batchnorm_fwd_*`).
///
/// # Errors
/// As [`batchnorm_stats`].
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    w: Option<&DeviceTensor>,
    b: Option<&DeviceTensor>,
    stats: &DeviceTensor,
    y: &DeviceTensor,
    dims: BnDims,
    types: BnTypes,
) -> Result<()> {
    let op = "batchnorm_fwd";
    let name = types.kernel(Stem::Fwd)?;
    for t in [x, y] {
        check_opt(op, s, Some(t), types.x, dims.numel())?;
    }
    check_opt(op, s, w, types.param, dims.c)?;
    check_opt(op, s, b, types.param, dims.c)?;
    let (sd, ss) = types.stats_shape(dims.c);
    check_opt(op, s, Some(stats), sd, ss[0] * ss[1])?;
    if dims.numel() == 0 {
        return Ok(());
    }
    let (n, c, l) = dims.args();
    // SAFETY: sizes and dtypes checked above.
    unsafe {
        launch::batchnorm_fwd(
            s,
            name,
            Grid::elementwise(s, dims.numel()),
            x.ptr(),
            ptr(w),
            ptr(b),
            stats.ptr(),
            y.ptr(),
            n,
            c,
            l,
        )
    }
}

/// The backward's channel sums `(sum dy, sum dy xhat)` (bf16/f16: `sum (x - mean) dy`) into
/// `sums` ([`BnTypes::sums_shape`]), and `dw += .., db += ..` into the given gradients
/// (`batchnorm_bwd_stats_*`, one thread per channel).
///
/// # Errors
/// As [`batchnorm_stats`].
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_bwd_stats(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    stats: &DeviceTensor,
    sums: &DeviceTensor,
    dw: Option<&DeviceTensor>,
    db: Option<&DeviceTensor>,
    dims: BnDims,
    types: BnTypes,
) -> Result<()> {
    let op = "batchnorm_bwd_stats";
    let name = types.kernel(Stem::BwdStats)?;
    for t in [x, dy] {
        check_opt(op, s, Some(t), types.x, dims.numel())?;
    }
    let (sd, ss) = types.stats_shape(dims.c);
    check_opt(op, s, Some(stats), sd, ss[0] * ss[1])?;
    check_opt(op, s, Some(sums), sd, 2 * dims.c)?;
    check_opt(op, s, dw, types.param, dims.c)?;
    check_opt(op, s, db, types.param, dims.c)?;
    if dims.c == 0 {
        return Ok(());
    }
    let (n, c, l) = dims.args();
    // SAFETY: sizes and dtypes checked above.
    unsafe {
        launch::batchnorm_bwd_stats(
            s,
            name,
            Grid::elementwise(s, dims.c),
            x.ptr(),
            dy.ptr(),
            stats.ptr(),
            sums.ptr(),
            ptr(dw),
            ptr(db),
            n,
            c,
            l,
        )
    }
}

/// `dx` (`x`'s dtype and size) from `x`, `dy`, the optional `w (C)`, the statistics and
/// the sums of [`batchnorm_bwd_stats`]; `batch`: through the batch statistics
/// (`batchnorm_bwd_dx_*`).
///
/// # Errors
/// As [`batchnorm_stats`].
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_bwd_dx(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    w: Option<&DeviceTensor>,
    stats: &DeviceTensor,
    sums: &DeviceTensor,
    dx: &DeviceTensor,
    dims: BnDims,
    types: BnTypes,
    batch: bool,
) -> Result<()> {
    let op = "batchnorm_bwd_dx";
    let name = types.kernel(Stem::BwdDx)?;
    for t in [x, dy, dx] {
        check_opt(op, s, Some(t), types.x, dims.numel())?;
    }
    check_opt(op, s, w, types.param, dims.c)?;
    let (sd, ss) = types.stats_shape(dims.c);
    check_opt(op, s, Some(stats), sd, ss[0] * ss[1])?;
    check_opt(op, s, Some(sums), sd, 2 * dims.c)?;
    if dims.numel() == 0 {
        return Ok(());
    }
    let (n, c, l) = dims.args();
    // SAFETY: sizes and dtypes checked above.
    unsafe {
        launch::batchnorm_bwd_dx(
            s,
            name,
            Grid::elementwise(s, dims.numel()),
            x.ptr(),
            dy.ptr(),
            ptr(w),
            stats.ptr(),
            sums.ptr(),
            dx.ptr(),
            n,
            c,
            l,
            i32::from(batch),
        )
    }
}

/// `count += 1` for an i64 `()` on the device (`batchnorm_count_i64`).
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`; [`Error::Cuda`].
pub fn batchnorm_count(s: &Stream, count: &DeviceTensor) -> Result<()> {
    check_opt("batchnorm_count", s, Some(count), DType::I64, 1)?;
    // SAFETY: one i64 on this device.
    unsafe {
        launch::batchnorm_count(
            s,
            "batchnorm_count_i64",
            Grid::elementwise(s, 1),
            count.ptr(),
        )
    }
}
