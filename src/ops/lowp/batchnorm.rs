//! `batch_norm` of a bf16/f16 input as PyTorch's CPU kernel computes it
//! (`aten/src/ATen/native/cpu/batch_norm_kernel.cpp` and `batch_norm_cpu_update_stats_template`
//! in `aten/src/ATen/native/Normalization.cpp`, torch 2.11), for the `param_t` of the
//! weight, bias and running stats: the input's dtype (`BatchNorm1d` under FSDP
//! `MixedPrecision(param_dtype, buffer_dtype)`: every tensor low precision) or f32 (a
//! "mixed type" call, where the rounding to `param_t` below is exact). `r` rounds to the
//! input's dtype, `rp` to `param_t`; all arithmetic in f32, sums in PyTorch's order
//! ([`chan_sum`]); `m = N L` values per channel.
//!
//! Training (batch statistics):
//! - `mean = sum(x) / m`; `var_sum = sum((x - mu)^2)` with `mu = mean` for `(N, C, L)`
//!   and `mu = rp(mean)` for `(N, C)` (PyTorch's channels-last loop reads the stored mean);
//! - saved `mean_s = rp(mean)`, `invstd_s = rp(1 / sqrt(rp(rp(var_sum) / rp(m)) + eps))`;
//! - running stats (`param_t` arithmetic, each product and sum rounded as `c10::BFloat16` /
//!   `c10::Half` operators do): with `f = rp(momentum)`, `g = rp(1 - f)`:
//!   `running_mean = rp(rp(f mean_s) + rp(g running_mean))`,
//!   `running_var = rp(f rp(rp(var_sum) / rp(m - 1)) + rp(g running_var))`;
//! - `y = r(x alpha + beta)`, `alpha = invstd_s w`, `beta = b - mean_s alpha`.
//!
//! Evaluation: `invstd = 1 / sqrt(running_var + eps)` (f32), `alpha`, `beta` as above with
//! `running_mean`; the backward's `invstd` is computed in f64 and read as f32 (PyTorch adds
//! the double `eps` to the `param_t` value there).
//!
//! Backward: `s = sum(dy)`, `dot = sum((x - mean) dy)`; training: `k = dot invstd^2 / m`,
//! `dx = r((dy - s / m - (x - mean) k) invstd w)`; evaluation: `dx = r(dy invstd w)`;
//! `dw += rp(dot invstd)`, `db += rp(s)`.

use crate::error::Result;
use crate::ops::batchnorm::{
    accumulate, batch_values, channel_vec, input_dims, overwrite, put, BatchNormSaved,
};
use crate::ops::RunningStats;
use crate::tensor::{DType, Tensor};

/// `v` rounded to nearest even in `dtype` (bf16, f16; others unchanged).
fn round(v: f32, dtype: DType) -> f32 {
    super::loss::round(v, dtype)
}

/// Width of PyTorch's reduced-precision vector loads (`Vectorized<BFloat16>::size()` on
/// AVX-512): along `L`, blocks of 32 values go to a 16-lane f32 accumulator.
const BLOCK: usize = 32;
const LANES: usize = 16;

/// PyTorch's per-channel f32 sum of `f(n, l)` over `n < nn`, `l < ll`: for `l` in the
/// whole blocks of 32 the 16-lane accumulator (lane `l mod 16`), the rest added in order
/// to a scalar; the result is the scalar plus the lanes halved pairwise (8, 4, 2, 1). For
/// `ll < 32` that is the sum in order.
fn chan_sum(nn: usize, ll: usize, f: impl Fn(usize, usize) -> f32) -> f32 {
    let vec_end = ll / BLOCK * BLOCK;
    let mut lanes = [0.0f32; LANES];
    let mut s = 0.0f32;
    for n in 0..nn {
        for l in 0..vec_end {
            lanes[l % LANES] += f(n, l);
        }
        for l in vec_end..ll {
            s += f(n, l);
        }
    }
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            lanes[i] += lanes[i + w];
        }
        w /= 2;
    }
    s + lanes[0]
}

/// `values` of an optional channel tensor as f32 (`fill` when absent).
fn chan(op: &'static str, t: Option<&Tensor>, c: usize, fill: f64) -> Result<Vec<f32>> {
    Ok(channel_vec(op, t, c, fill)?
        .into_iter()
        .map(|v| v as f32)
        .collect())
}

/// Forward of [`crate::ops::batch_norm`] for a bf16/f16 `x` (see the module doc).
pub(crate) fn forward(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    running: Option<RunningStats<'_>>,
    batch_stats: bool,
    eps: f64,
    lp: DType,
) -> Result<(Tensor, BatchNormSaved)> {
    let op = "batch_norm";
    let (n, c, l) = input_dims(op, x, w, running.as_ref())?;
    // param_t: the weight's (or running stats') dtype; the input's without either.
    let pt = w
        .or(running.as_ref().map(|r| r.mean))
        .map_or(lp, |t| t.dtype());
    let rp = |v: f32| round(v, pt);
    let (wv, bv) = (chan(op, w, c, 1.0)?, chan(op, b, c, 0.0)?);
    let xv = x.to_vec_f32()?;
    let m = n * l;
    let at = |i: usize, k: usize, j: usize| (i * c + k) * l + j;
    let (mean, invstd): (Vec<f32>, Vec<f32>) = if batch_stats {
        batch_values(x, m, c)?;
        let mut mean_s = vec![0.0f32; c];
        let mut var_sum = vec![0.0f32; c];
        for k in 0..c {
            let mean = chan_sum(n, l, |i, j| xv[at(i, k, j)]) / m as f32;
            mean_s[k] = rp(mean);
            let mu = if l > 1 { mean } else { mean_s[k] };
            var_sum[k] = rp(chan_sum(n, l, |i, j| {
                let d = xv[at(i, k, j)] - mu;
                d * d
            }));
        }
        let invstd = var_sum
            .iter()
            .map(|&vs| rp(1.0 / (rp(vs / rp(m as f32)) + eps as f32).sqrt()))
            .collect();
        if let Some(r) = &running {
            let (rm, rv) = (
                chan(op, Some(r.mean), c, 0.0)?,
                chan(op, Some(r.var), c, 1.0)?,
            );
            let f = rp(r.factor as f32);
            let g = rp(1.0 - f);
            let new_mean = (0..c).map(|k| rp(rp(f * mean_s[k]) + rp(g * rm[k])) as f64);
            let new_var = (0..c).map(|k| {
                let unbiased = rp(var_sum[k] / rp((m - 1) as f32));
                rp(f * unbiased + rp(g * rv[k])) as f64
            });
            overwrite(r.mean, new_mean.collect())?;
            overwrite(r.var, new_var.collect())?;
        }
        (mean_s, invstd)
    } else {
        let Some(r) = &running else {
            crate::error::bail_arg!(
                "batch_norm: evaluation with running stats needs running_mean and running_var"
            );
        };
        let rv = chan(op, Some(r.var), c, 1.0)?;
        (
            chan(op, Some(r.mean), c, 0.0)?,
            rv.iter().map(|v| 1.0 / (v + eps as f32).sqrt()).collect(),
        )
    };
    let mut y = vec![0.0f64; xv.len()];
    for k in 0..c {
        let alpha = invstd[k] * wv[k];
        let beta = bv[k] - mean[k] * alpha;
        for i in 0..n {
            for j in 0..l {
                let p = at(i, k, j);
                y[p] = round(xv[p] * alpha + beta, lp) as f64;
            }
        }
    }
    // The backward's invstd in evaluation: f64 sum with the double eps, read as f32.
    let rstd = if batch_stats {
        invstd.iter().map(|&v| v as f64).collect()
    } else {
        let rv = chan(op, running.as_ref().map(|r| r.var), c, 1.0)?;
        rv.iter()
            .map(|&v| (1.0 / (v as f64 + eps).sqrt()) as f32 as f64)
            .collect()
    };
    let device = x.device();
    let saved = BatchNormSaved {
        xhat: xv.iter().map(|&v| v as f64).collect(),
        rstd,
        mean: mean.iter().map(|&v| v as f64).collect(),
        batch_stats,
        dims: (n, c, l),
        shape: x.shape().to_vec(),
        dtype: lp,
        device,
    };
    Ok((put(y, x.shape(), lp, device)?, saved))
}

/// Backward of [`forward`] (see the module doc); `saved.xhat` holds `x`.
pub(crate) fn backward(
    dy: &Tensor,
    saved: &BatchNormSaved,
    w: Option<&Tensor>,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "batch_norm_backward";
    let (n, c, l) = saved.dims;
    let lp = saved.dtype;
    let pt = w.map_or(lp, |t| t.dtype());
    let wv = chan(op, w, c, 1.0)?;
    let dyv = dy.to_vec_f32()?;
    let at = |i: usize, k: usize, j: usize| (i * c + k) * l + j;
    let m = (n * l) as f32;
    let mut dx = vec![0.0f64; dyv.len()];
    let (mut gw, mut gb) = (vec![0.0f64; c], vec![0.0f64; c]);
    for k in 0..c {
        let (mean, invstd) = (saved.mean[k] as f32, saved.rstd[k] as f32);
        let x = |i: usize, j: usize| saved.xhat[at(i, k, j)] as f32;
        let s = chan_sum(n, l, |i, j| dyv[at(i, k, j)]);
        let dot = chan_sum(n, l, |i, j| (x(i, j) - mean) * dyv[at(i, k, j)]);
        let kk = dot * invstd * invstd / m;
        let gm = s / m;
        for i in 0..n {
            for j in 0..l {
                let p = at(i, k, j);
                let v = if saved.batch_stats {
                    (dyv[p] - gm - (x(i, j) - mean) * kk) * invstd * wv[k]
                } else {
                    dyv[p] * invstd * wv[k]
                };
                dx[p] = round(v, lp) as f64;
            }
        }
        gw[k] = round(dot * invstd, pt) as f64;
        gb[k] = round(s, pt) as f64;
    }
    if let Some(dw) = dw {
        channel_vec(op, Some(dw), c, 0.0)?;
        accumulate(dw, &gw)?;
    }
    if let Some(db) = db {
        channel_vec(op, Some(db), c, 0.0)?;
        accumulate(db, &gb)?;
    }
    put(dx, &saved.shape, lp, saved.device)
}
