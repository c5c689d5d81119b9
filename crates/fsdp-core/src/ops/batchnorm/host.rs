//! The host loops of [`super::batch_norm`] and [`super::batch_norm_backward`] for an f32 or
//! f64 input: statistics and results accumulated in f64, written in the input's dtype (the
//! reference `kernels/batchnorm.cu`'s `batchnorm_*_{f32,f64}` follow operation for
//! operation). `x[i, k, j]` sits at `(i C + k) L + j`; `m = N L` values per channel.

use super::{
    accumulate, batch_values, channel_vec, overwrite, put, BatchNormSaved, RunningStats,
    SavedValues,
};
use crate::error::Result;
use crate::tensor::Tensor;

/// Forward over `x (N, C, L)` (`dims`), checked by the caller: `mean`, `var` per channel
/// from the batch (updating `running`) or from `running`, `y = (x - mean) rstd w + b`.
pub(super) fn forward(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    running: Option<RunningStats<'_>>,
    batch_stats: bool,
    eps: f64,
    (n, c, l): (usize, usize, usize),
) -> Result<(Tensor, BatchNormSaved)> {
    let op = "batch_norm";
    let device = x.device();
    let wv = channel_vec(op, w, c, 1.0)?;
    let bv = channel_vec(op, b, c, 0.0)?;
    let xv = x.to_vec_f64()?;
    let m = n * l;
    let at = |i: usize, k: usize, j: usize| (i * c + k) * l + j;
    let (mean, var) = match &running {
        Some(r) if !batch_stats => (
            channel_vec(op, Some(r.mean), c, 0.0)?,
            channel_vec(op, Some(r.var), c, 1.0)?,
        ),
        _ => {
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
                let f = r.factor.value()?;
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
        }
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
    let values = SavedValues::Host {
        xhat,
        rstd,
        mean: Vec::new(),
    };
    Ok((y, BatchNormSaved::new(values, batch_stats, (n, c, l), x)))
}

/// Backward from the host forward's `xhat` and `rstd` (see [`super::batch_norm_backward`]).
pub(super) fn backward(
    dy: &Tensor,
    saved: &BatchNormSaved,
    xhat: &[f64],
    rstd: &[f64],
    w: Option<&Tensor>,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "batch_norm_backward";
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
                sum_dy_xhat[k] += dyv[p] * xhat[p];
            }
        }
    }
    let mut dx = vec![0.0f64; dyv.len()];
    for i in 0..n {
        for k in 0..c {
            for j in 0..l {
                let p = at(i, k, j);
                let g = wv[k] * rstd[k];
                dx[p] = if saved.batch_stats {
                    // dxhat = dy w; sum dxhat = w sum dy; sum dxhat xhat = w sum dy xhat.
                    g * (dyv[p] - sum_dy[k] / m - xhat[p] * sum_dy_xhat[k] / m)
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
