//! Batch normalization over the batch (and length) dimensions per channel
//! (`F.batch_norm` on `(N, C)` or `(N, C, L)`), training and evaluation, forward and
//! backward, with the running-statistics update of `nn.BatchNorm1d`
//! (`torch/nn/modules/batchnorm.py`, `aten/src/ATen/native/Normalization.cpp`).
//!
//! | input | CPU | CUDA |
//! |---|---|---|
//! | f32, f64 | `host.rs`: loops accumulating in f64, results in the input's dtype | `batchnorm_*_{f32,f64}` of `kernels/batchnorm.cu` (`cuda.rs`), the same operations in the same order |
//! | bf16, f16 | `reduced.rs`: PyTorch's reduced-precision CPU kernel (f32 arithmetic in its summation order, its rounding points) | `batchnorm_*_lp_*`, the same bit for bit |
//!
//! On CUDA nothing is read back to the host and the statistics stay on the device
//! ([`BatchNormSaved`]); a combination of dtypes the kernels do not cover (a channel tensor
//! of another dtype than the kernels take, see `cuda.rs`) runs the host loops on copies.

mod cuda;
mod host;
mod reduced;

use super::same_device;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// What [`batch_norm_backward`] needs from the forward, on the device it ran on.
#[derive(Debug, Clone)]
pub struct BatchNormSaved {
    pub(crate) values: SavedValues,
    /// Whether the statistics were the batch's (the backward then differentiates through
    /// them).
    pub(crate) batch_stats: bool,
    /// `(N, C, L)` of the input, and its shape, dtype and device.
    pub(crate) dims: (usize, usize, usize),
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
}

/// The saved values of [`BatchNormSaved`] by where the forward ran.
#[derive(Debug, Clone)]
pub(crate) enum SavedValues {
    /// The host loops: f32/f64 input: `xhat = (x - mean) * rstd` per element, row-major
    /// `(N, C, L)`, `rstd = 1 / sqrt(var + eps)` per channel `(C)` (batch variance in
    /// training, running variance in evaluation), `mean` empty; bf16/f16 input: `x` in
    /// `xhat`, PyTorch's saved `invstd` and mean (see `reduced.rs`).
    Host {
        xhat: Vec<f64>,
        rstd: Vec<f64>,
        mean: Vec<f64>,
    },
    /// The CUDA kernels: the input and the per-channel statistics on its device, `(2, C)`
    /// f64 `(mean, rstd)` for f32/f64, `(3, C)` f32 `(mean, invstd, the backward's invstd)`
    /// for bf16/f16 (`kernels/batchnorm.cu`).
    Device { x: Tensor, stats: Tensor },
}

impl BatchNormSaved {
    pub(crate) fn new(
        values: SavedValues,
        batch_stats: bool,
        dims: (usize, usize, usize),
        x: &Tensor,
    ) -> BatchNormSaved {
        BatchNormSaved {
            values,
            batch_stats,
            dims,
            shape: x.shape().to_vec(),
            dtype: x.dtype(),
            device: x.device(),
        }
    }
}

/// The factor `f` of a running-statistics update.
#[derive(Debug, Clone, Copy)]
pub enum UpdateFactor<'a> {
    /// PyTorch's `momentum`.
    Momentum(f64),
    /// `momentum=None`, a cumulative average: `f = 1 / num_batches_tracked`, the count an
    /// i64 scalar `()` the caller has already incremented for this forward (on CUDA read by
    /// the kernel, not by the host).
    CumulativeAverage(&'a Tensor),
}

impl UpdateFactor<'_> {
    /// The factor's value (a count on a device is read back).
    pub(crate) fn value(&self) -> Result<f64> {
        match self {
            UpdateFactor::Momentum(f) => Ok(*f),
            UpdateFactor::CumulativeAverage(t) => {
                let n = t.to_vec_f64()?.first().copied().unwrap_or(0.0) as i64;
                Ok(1.0 / n as f64)
            }
        }
    }
}

/// The running statistics of a forward: read in evaluation; in training updated in place,
/// `running = (1 - f) running + f batch` with the unbiased batch variance for `var`.
#[derive(Debug, Clone, Copy)]
pub struct RunningStats<'a> {
    /// `running_mean (C)`, float, updated in place.
    pub mean: &'a Tensor,
    /// `running_var (C)`, updated in place.
    pub var: &'a Tensor,
    /// The factor `f` of the update (unused in evaluation).
    pub factor: UpdateFactor<'a>,
}

/// `(N, C, L)` of an input `(N, C)` or `(N, C, L)` with `C` channels.
pub(crate) fn dims(op: &'static str, x: &Tensor, c: usize) -> Result<(usize, usize, usize)> {
    match *x.shape() {
        [n, cc] if cc == c => Ok((n, c, 1)),
        [n, cc, l] if cc == c => Ok((n, c, l)),
        _ => Err(Error::ShapeMismatch {
            op,
            expected: vec![0, c],
            got: x.shape().to_vec(),
        }),
    }
}

pub(crate) fn float(op: &'static str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        got => Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            got,
        }),
    }
}

/// `(N, C, L)` of `x` (`L = 1` for `(N, C)`), C taken from the weight, else the running
/// mean, else `x`'s second dimension; checked by [`dims`].
pub(crate) fn input_dims(
    op: &'static str,
    x: &Tensor,
    w: Option<&Tensor>,
    running: Option<&RunningStats<'_>>,
) -> Result<(usize, usize, usize)> {
    let c = match w.or(running.map(|r| r.mean)) {
        Some(t) => t.numel(),
        None => x.shape().get(1).copied().unwrap_or(0),
    };
    dims(op, x, c)
}

/// Batch statistics need more than one value per channel (`m = N L` of them): PyTorch's
/// `InvalidArgument` otherwise.
pub(crate) fn batch_values(x: &Tensor, m: usize, c: usize) -> Result<()> {
    if m <= 1 && c > 0 {
        crate::error::bail_arg!(
            "batch_norm: expected more than 1 value per channel when training, got input of shape {:?}",
            x.shape()
        );
    }
    Ok(())
}

pub(crate) fn channel_vec(
    op: &'static str,
    t: Option<&Tensor>,
    c: usize,
    fill: f64,
) -> Result<Vec<f64>> {
    match t {
        None => Ok(vec![fill; c]),
        Some(t) if t.numel() == c => {
            float(op, t)?;
            t.to_vec_f64()
        }
        Some(t) => Err(Error::ShapeMismatch {
            op,
            expected: vec![c],
            got: t.shape().to_vec(),
        }),
    }
}

/// A tensor of `shape` and `dtype` holding `v`, on `device`.
pub(crate) fn put(v: Vec<f64>, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let host = Tensor::from_vec(v, shape)?;
    let host = if dtype == DType::F64 {
        host
    } else {
        host.to_dtype(dtype)?
    };
    host.to_device(device)
}

/// Overwrites `t` with `v` (cast to its dtype, on its device).
pub(crate) fn overwrite(t: &Tensor, v: Vec<f64>) -> Result<()> {
    t.copy_from(&Tensor::from_vec(v, t.shape())?)
}

/// `t += v` (cast to its dtype, on its device): a parameter gradient accumulates.
pub(crate) fn accumulate(t: &Tensor, v: &[f64]) -> Result<()> {
    let sum: Vec<f64> = t.to_vec_f64()?.iter().zip(v).map(|(a, b)| a + b).collect();
    overwrite(t, sum)
}

/// `y = (x - mean) * rstd * w + b` per channel of `x (N, C)` or `(N, C, L)` (f32, f64, bf16
/// or f16), with `w, b (C)` (`None`: 1 and 0, `affine=False`). With `batch_stats`, `mean`
/// and the biased `var` are the batch's over `N` (and `L`), and a given `running` is
/// updated (unbiased variance, `var * m / (m - 1)` over `m = N L` values); otherwise
/// (evaluation) they are `running`'s values, left unchanged. `y` has `x`'s shape, dtype
/// and device. bf16/f16 inputs round as PyTorch's CPU kernel (`reduced.rs`).
///
/// # Errors
/// `ShapeMismatch` for an input not `(N, C)` / `(N, C, L)` or channel tensors not `(C)`;
/// `DTypeMismatch` for a non-float tensor; `InvalidArgument` for a training forward over
/// a single value per channel (PyTorch: "Expected more than 1 value per channel when
/// training") and for evaluation without running stats; `DeviceMismatch`; [`Error::Cuda`].
pub fn batch_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    running: Option<RunningStats<'_>>,
    batch_stats: bool,
    eps: f64,
) -> Result<(Tensor, BatchNormSaved)> {
    let op = "batch_norm";
    let mut all: Vec<&Tensor> = vec![x];
    all.extend(w);
    all.extend(b);
    if let Some(r) = &running {
        all.push(r.mean);
        all.push(r.var);
    }
    let device = same_device(op, &all)?;
    float(op, x)?;
    let dims = input_dims(op, x, w, running.as_ref())?;
    if batch_stats {
        batch_values(x, dims.0 * dims.2, dims.1)?;
    } else if running.is_none() {
        crate::error::bail_arg!(
            "batch_norm: evaluation with running stats needs running_mean and running_var"
        );
    }
    if let Device::Cuda(i) = device {
        if let Some(out) = cuda::forward(i, x, w, b, running.as_ref(), batch_stats, eps, dims)? {
            return Ok(out);
        }
    }
    let _ = device;
    if let Some(lp) = super::lowp::lp_of(&[x]) {
        return reduced::forward(x, w, b, running, batch_stats, eps, lp, dims);
    }
    host::forward(x, w, b, running, batch_stats, eps, dims)
}

/// The backward of [`batch_norm`]: returns `dx` (the input's shape, dtype and device) and
/// accumulates (`+=`) `dw = sum dy * xhat` and `db = sum dy` per channel into the given
/// gradients. With batch statistics, `dx = rstd / m * (m dxhat - sum dxhat - xhat sum(dxhat
/// xhat))` with `dxhat = dy * w` over the `m = N L` values of a channel; with running
/// statistics (evaluation) `dx = dy * w * rstd`.
///
/// # Errors
/// `ShapeMismatch` when `dy` is not the forward input's shape or a channel tensor not
/// `(C)`; `DTypeMismatch` (on CUDA also for `dy` or a gradient of another dtype than the
/// forward's kernels take); `DeviceMismatch`; [`Error::Cuda`].
pub fn batch_norm_backward(
    dy: &Tensor,
    saved: &BatchNormSaved,
    w: Option<&Tensor>,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "batch_norm_backward";
    let mut all: Vec<&Tensor> = vec![dy];
    all.extend(w);
    all.extend(dw);
    all.extend(db);
    same_device(op, &all)?;
    float(op, dy)?;
    if dy.shape() != saved.shape.as_slice() {
        return Err(Error::ShapeMismatch {
            op,
            expected: saved.shape.clone(),
            got: dy.shape().to_vec(),
        });
    }
    match &saved.values {
        SavedValues::Device { x, stats } => cuda::backward(dy, saved, x, stats, w, dw, db),
        SavedValues::Host { xhat, rstd, mean } if !mean.is_empty() => {
            let values = reduced::Saved {
                x: xhat,
                invstd: rstd,
                mean,
            };
            reduced::backward(dy, saved, values, w, dw, db)
        }
        SavedValues::Host { xhat, rstd, .. } => host::backward(dy, saved, xhat, rstd, w, dw, db),
    }
}

/// `count += 1` for an i64 scalar `()` on any device: `num_batches_tracked` of a training
/// forward (`nn.BatchNorm1d.forward`), without a host read on CUDA.
///
/// # Errors
/// `DTypeMismatch` for a count that is not i64; `ShapeMismatch` for one of more than one
/// element; [`Error::Cuda`].
pub fn batch_norm_count_(count: &Tensor) -> Result<()> {
    if count.dtype() != DType::I64 {
        return Err(Error::DTypeMismatch {
            op: "batch_norm_count_",
            expected: DType::I64,
            got: count.dtype(),
        });
    }
    if count.numel() != 1 {
        return Err(Error::ShapeMismatch {
            op: "batch_norm_count_",
            expected: vec![],
            got: count.shape().to_vec(),
        });
    }
    if let Device::Cuda(i) = count.device() {
        return crate::backend::cuda::batchnorm_count(
            &*super::stream(i)?,
            &count.as_device_tensor()?,
        );
    }
    if count.device() == Device::Meta {
        return Err(Error::NotMaterialized {
            name: "batch_norm_count_ input".into(),
            state: "meta",
        });
    }
    count.data_mut::<i64>()?[0] += 1;
    Ok(())
}
