//! Batch normalization over the batch (and length) dimensions per channel
//! (`F.batch_norm` on `(N, C)` or `(N, C, L)`), training and evaluation, forward and
//! backward, with the running-statistics update of `nn.BatchNorm1d`
//! (`torch/nn/modules/batchnorm.py`, `aten/src/ATen/native/Normalization.cpp`).
//!
//! The reference loops run on the host and accumulate in f64, writing results in the
//! input's dtype (f32 or f64). A bf16/f16 input takes PyTorch's reduced-precision CPU
//! kernel instead (f32 statistics, rounded saved statistics, one rounding per output:
//! `lowp/batchnorm.rs`). A CUDA tensor is computed through the same loops: its
//! values are copied to the host and the results back to its device, so every tensor a
//! caller sees stays on the device (no kernel yet; one `(N, C)` copy each way per call).

use super::same_device;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// What [`batch_norm_backward`] needs from the forward (host memory).
#[derive(Debug, Clone)]
pub struct BatchNormSaved {
    /// `(x - mean) * rstd` per element, row-major `(N, C, L)` (bf16/f16 input: `x`).
    pub(super) xhat: Vec<f64>,
    /// `1 / sqrt(var + eps)` per channel `(C)` (batch variance in training, running
    /// variance in evaluation; bf16/f16 input: PyTorch's saved `invstd`, see
    /// `lowp/batchnorm.rs`).
    pub(super) rstd: Vec<f64>,
    /// The mean per channel a bf16/f16 backward reads (empty for f32/f64).
    pub(super) mean: Vec<f64>,
    /// Whether the statistics were the batch's (the backward then differentiates through
    /// them).
    pub(super) batch_stats: bool,
    /// `(N, C, L)` of the input, and its shape, dtype and device.
    pub(super) dims: (usize, usize, usize),
    pub(super) shape: Vec<usize>,
    pub(super) dtype: DType,
    pub(super) device: Device,
}

/// The running statistics a training forward updates: `running = (1 - f) running + f
/// batch` with the unbiased batch variance for `var` (PyTorch's `momentum`, or
/// `1 / num_batches_tracked` for a cumulative average).
#[derive(Debug, Clone, Copy)]
pub struct RunningStats<'a> {
    /// `running_mean (C)`, f32 or f64, updated in place.
    pub mean: &'a Tensor,
    /// `running_var (C)`, updated in place.
    pub var: &'a Tensor,
    /// The factor `f` of the update.
    pub factor: f64,
}

/// `(N, C, L)` of an input `(N, C)` or `(N, C, L)` with `C` channels.
pub(super) fn dims(op: &'static str, x: &Tensor, c: usize) -> Result<(usize, usize, usize)> {
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

pub(super) fn float(op: &'static str, t: &Tensor) -> Result<()> {
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
pub(super) fn input_dims(
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
pub(super) fn batch_values(x: &Tensor, m: usize, c: usize) -> Result<()> {
    if m <= 1 && c > 0 {
        crate::error::bail_arg!(
            "batch_norm: expected more than 1 value per channel when training, got input of shape {:?}",
            x.shape()
        );
    }
    Ok(())
}

pub(super) fn channel_vec(
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
pub(super) fn put(v: Vec<f64>, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let host = Tensor::from_vec(v, shape)?;
    let host = if dtype == DType::F64 {
        host
    } else {
        host.to_dtype(dtype)?
    };
    host.to_device(device)
}

/// Overwrites `t` with `v` (cast to its dtype, on its device).
pub(super) fn overwrite(t: &Tensor, v: Vec<f64>) -> Result<()> {
    t.copy_from(&Tensor::from_vec(v, t.shape())?)
}

/// `t += v` (cast to its dtype, on its device): a parameter gradient accumulates.
pub(super) fn accumulate(t: &Tensor, v: &[f64]) -> Result<()> {
    let sum: Vec<f64> = t.to_vec_f64()?.iter().zip(v).map(|(a, b)| a + b).collect();
    overwrite(t, sum)
}

/// `y = (x - mean) * rstd * w + b` per channel of `x (N, C)` or `(N, C, L)`, f32 or f64,
/// with `w, b (C)` (`None`: 1 and 0, `affine=False`). With `running` absent or in
/// training, `mean` and the biased `var` are the batch's over `N` (and `L`), and a given
/// `running` is updated (unbiased variance, `var * m / (m - 1)` over `m = N L` values);
/// in evaluation (`batch_stats` false) they are `running`'s values, left unchanged. `y` has
/// `x`'s shape, dtype and device.
///
/// # Errors
/// `ShapeMismatch` for an input not `(N, C)` / `(N, C, L)` or channel tensors not `(C)`;
/// `DTypeMismatch` for a non-float tensor; `InvalidArgument` for a training forward over
/// a single value per channel (PyTorch: "Expected more than 1 value per channel when
/// training") and for evaluation without running stats; `DeviceMismatch`.
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
    if let Some(lp) = super::lowp::lp_of(&[x]) {
        return super::lowp::batchnorm::forward(x, w, b, running, batch_stats, eps, lp);
    }
    let (n, c, l) = input_dims(op, x, w, running.as_ref())?;
    let wv = channel_vec(op, w, c, 1.0)?;
    let bv = channel_vec(op, b, c, 0.0)?;
    let xv = x.to_vec_f64()?;
    let m = n * l;
    // x[i, k, j] sits at (i C + k) L + j.
    let at = |i: usize, k: usize, j: usize| (i * c + k) * l + j;
    let (mean, var) = if batch_stats {
        batch_values(x, m, c)?;
        let mut mean = vec![0.0f64; c];
        let mut var = vec![0.0f64; c];
        for k in 0..c {
            let mut s = 0.0;
            for i in 0..n {
                for j in 0..l {
                    s += xv[at(i, k, j)];
                }
            }
            mean[k] = s / m as f64;
            let mut q = 0.0;
            for i in 0..n {
                for j in 0..l {
                    let d = xv[at(i, k, j)] - mean[k];
                    q += d * d;
                }
            }
            var[k] = q / m as f64;
        }
        if let Some(r) = &running {
            let (rm, rv) = (
                channel_vec(op, Some(r.mean), c, 0.0)?,
                channel_vec(op, Some(r.var), c, 1.0)?,
            );
            let f = r.factor;
            let unbias = m as f64 / (m as f64 - 1.0);
            overwrite(
                r.mean,
                (0..c).map(|k| (1.0 - f) * rm[k] + f * mean[k]).collect(),
            )?;
            overwrite(
                r.var,
                (0..c)
                    .map(|k| (1.0 - f) * rv[k] + f * var[k] * unbias)
                    .collect(),
            )?;
        }
        (mean, var)
    } else {
        let Some(r) = &running else {
            crate::error::bail_arg!(
                "batch_norm: evaluation with running stats needs running_mean and running_var"
            );
        };
        (
            channel_vec(op, Some(r.mean), c, 0.0)?,
            channel_vec(op, Some(r.var), c, 1.0)?,
        )
    };
    let rstd: Vec<f64> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let mut xhat = vec![0.0f64; xv.len()];
    let mut y = vec![0.0f64; xv.len()];
    for i in 0..n {
        for k in 0..c {
            for j in 0..l {
                let p = at(i, k, j);
                xhat[p] = (xv[p] - mean[k]) * rstd[k];
                y[p] = xhat[p] * wv[k] + bv[k];
            }
        }
    }
    let y = put(y, x.shape(), x.dtype(), device)?;
    Ok((
        y,
        BatchNormSaved {
            xhat,
            rstd,
            mean: Vec::new(),
            batch_stats,
            dims: (n, c, l),
            shape: x.shape().to_vec(),
            dtype: x.dtype(),
            device,
        },
    ))
}

/// The backward of [`batch_norm`]: returns `dx` (the input's shape, dtype and device) and
/// accumulates (`+=`) `dw = sum dy * xhat` and `db = sum dy` per channel into the given
/// gradients. With batch statistics, `dx = rstd / m * (m dxhat - sum dxhat - xhat sum(dxhat
/// xhat))` with `dxhat = dy * w` over the `m = N L` values of a channel; with running
/// statistics (evaluation) `dx = dy * w * rstd`.
///
/// # Errors
/// `ShapeMismatch` when `dy` is not the forward input's shape or a channel tensor not
/// `(C)`; `DTypeMismatch`; `DeviceMismatch`.
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
    if !saved.mean.is_empty() {
        return super::lowp::batchnorm::backward(dy, saved, w, dw, db);
    }
    let (n, c, l) = saved.dims;
    let wv = channel_vec(op, w, c, 1.0)?;
    let dyv = dy.to_vec_f64()?;
    let at = |i: usize, k: usize, j: usize| (i * c + k) * l + j;
    let m = (n * l) as f64;
    let mut sum_dy = vec![0.0f64; c];
    let mut sum_dy_xhat = vec![0.0f64; c];
    for i in 0..n {
        for k in 0..c {
            for j in 0..l {
                let p = at(i, k, j);
                sum_dy[k] += dyv[p];
                sum_dy_xhat[k] += dyv[p] * saved.xhat[p];
            }
        }
    }
    let mut dx = vec![0.0f64; dyv.len()];
    for i in 0..n {
        for k in 0..c {
            for j in 0..l {
                let p = at(i, k, j);
                let g = wv[k] * saved.rstd[k];
                dx[p] = if saved.batch_stats {
                    // dxhat = dy w; sum dxhat = w sum dy; sum dxhat xhat = w sum dy xhat.
                    g * (dyv[p] - sum_dy[k] / m - saved.xhat[p] * sum_dy_xhat[k] / m)
                } else {
                    g * dyv[p]
                };
            }
        }
    }
    if let Some(dw) = dw {
        channel_vec(op, Some(dw), c, 0.0)?;
        accumulate(dw, &sum_dy_xhat)?;
    }
    if let Some(db) = db {
        channel_vec(op, Some(db), c, 0.0)?;
        accumulate(db, &sum_dy)?;
    }
    put(dx, &saved.shape, saved.dtype, saved.device)
}
