//! The CUDA path of [`super::batch_norm`] and [`super::batch_norm_backward`]: the kernels of
//! `kernels/batchnorm.cu` on the calling thread's current stream, with the input and the
//! per-channel statistics kept on the device for the backward. Nothing is read back to the
//! host (the cumulative average's count included), and every buffer comes from the caching
//! allocator (no device allocation once a step has run).
//!
//! Covered: an f32/f64 input with every channel tensor of its dtype, and a bf16/f16 input
//! with the weight and bias of one dtype and the running stats of one dtype, each the
//! input's or f32 (what `BatchNorm1d` under FSDP mixed precision has: low-precision
//! parameters, f32 buffer storage). Other combinations return `None` and run the host
//! loops.

use super::{BatchNormSaved, RunningStats, SavedValues, UpdateFactor};
use crate::backend::cuda::{self, BnDims, BnRunning, BnTypes, DeviceTensor};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The dtypes of a forward, when the kernels cover them: the weight's (else the running
/// mean's, else the input's) for the parameters, as `reduced.rs` picks `param_t`.
fn forward_types(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    running: Option<&RunningStats<'_>>,
) -> Option<BnTypes> {
    let param = w
        .or(running.map(|r| r.mean))
        .map_or(x.dtype(), Tensor::dtype);
    let run = running.map_or(x.dtype(), |r| r.mean.dtype());
    let types = BnTypes {
        x: x.dtype(),
        param,
        running: run,
    };
    let same = w.iter().chain(b.iter()).all(|t| t.dtype() == types.param)
        && running.is_none_or(|r| r.var.dtype() == run);
    (same && types.supported()).then_some(types)
}

/// A new uninitialized device tensor (its kernel overwrites it).
fn empty(s: &cuda::Stream, shape: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_device_tensor(DeviceTensor::empty(
        s, shape, dtype,
    )?))
}

fn dev(t: Option<&Tensor>) -> Result<Option<DeviceTensor>> {
    t.map(Tensor::as_device_tensor).transpose()
}

/// Forward on `cuda:ordinal` (arguments checked by the caller), or `None` for dtypes the
/// kernels do not cover.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    ordinal: usize,
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    running: Option<&RunningStats<'_>>,
    batch_stats: bool,
    eps: f64,
    (n, c, l): (usize, usize, usize),
) -> Result<Option<(Tensor, BatchNormSaved)>> {
    let Some(types) = forward_types(x, w, b, running) else {
        return Ok(None);
    };
    let s = &*super::super::stream(ordinal)?;
    let dims = BnDims { n, c, l };
    let (sd, ss) = types.stats_shape(c);
    let stats = empty(s, &ss, sd)?;
    let y = empty(s, x.shape(), x.dtype())?;
    let xd = x.as_device_tensor()?;
    let (sdev, ydev) = (stats.as_device_tensor()?, y.as_device_tensor()?);
    let run = match running {
        Some(r) => {
            let (factor, count) = match r.factor {
                UpdateFactor::Momentum(f) => (f, None),
                UpdateFactor::CumulativeAverage(t) if t.device() == x.device() => {
                    (0.0, Some(t.as_device_tensor()?))
                }
                // A count elsewhere (the host): its value.
                other => (other.value()?, None),
            };
            Some((
                r.mean.as_device_tensor()?,
                r.var.as_device_tensor()?,
                factor,
                count,
            ))
        }
        None => None,
    };
    let run_ref = run.as_ref().map(|(mean, var, factor, count)| BnRunning {
        mean,
        var,
        factor: *factor,
        count: count.as_ref(),
    });
    cuda::batchnorm_stats(s, &xd, dims, types, run_ref, eps, batch_stats, &sdev)?;
    let (wd, bd) = (dev(w)?, dev(b)?);
    cuda::batchnorm_fwd(s, &xd, wd.as_ref(), bd.as_ref(), &sdev, &ydev, dims, types)?;
    let values = SavedValues::Device {
        x: x.clone(),
        stats,
    };
    Ok(Some((
        y,
        BatchNormSaved::new(values, batch_stats, (n, c, l), x),
    )))
}

/// Backward from a device forward's saved input `x` and statistics `stats`.
pub(super) fn backward(
    dy: &Tensor,
    saved: &BatchNormSaved,
    x: &Tensor,
    stats: &Tensor,
    w: Option<&Tensor>,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let Device::Cuda(ordinal) = saved.device else {
        return Err(Error::DeviceMismatch {
            op: "batch_norm_backward",
            expected: "cuda".into(),
            got: saved.device.to_string(),
        });
    };
    if dy.device() != saved.device {
        return Err(Error::DeviceMismatch {
            op: "batch_norm_backward",
            expected: saved.device.to_string(),
            got: dy.device().to_string(),
        });
    }
    let (n, c, l) = saved.dims;
    let dims = BnDims { n, c, l };
    let types = BnTypes {
        x: saved.dtype,
        param: w.map_or(saved.dtype, Tensor::dtype),
        running: saved.dtype,
    };
    let s = &*super::super::stream(ordinal)?;
    let (sd, ss) = types.sums_shape(c);
    let sums = empty(s, &ss, sd)?;
    let dx = empty(s, &saved.shape, saved.dtype)?;
    let (xd, dyd, sdev) = (
        x.as_device_tensor()?,
        dy.as_device_tensor()?,
        stats.as_device_tensor()?,
    );
    let (sumd, dxd) = (sums.as_device_tensor()?, dx.as_device_tensor()?);
    let (dwd, dbd, wd) = (dev(dw)?, dev(db)?, dev(w)?);
    cuda::batchnorm_bwd_stats(
        s,
        &xd,
        &dyd,
        &sdev,
        &sumd,
        dwd.as_ref(),
        dbd.as_ref(),
        dims,
        types,
    )?;
    cuda::batchnorm_bwd_dx(
        s,
        &xd,
        &dyd,
        wd.as_ref(),
        &sdev,
        &sumd,
        &dxd,
        dims,
        types,
        saved.batch_stats,
    )?;
    Ok(dx)
}
