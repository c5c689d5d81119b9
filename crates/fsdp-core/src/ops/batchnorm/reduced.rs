//! `batch_norm` of a bf16/f16 input as PyTorch's CPU kernel computes it
//! (`aten/src/ATen/native/cpu/batch_norm_kernel.cpp` and `batch_norm_cpu_update_stats_template`
//! in `aten/src/ATen/native/Normalization.cpp`, torch 2.11), for the `param_t` of the
//! weight, bias and running stats: the input's dtype (`BatchNorm1d` under FSDP
//! `MixedPrecision(param_dtype, buffer_dtype)`: every tensor low precision) or f32 (a
//! "mixed type" call, where the rounding to `param_t` below is exact). `r` rounds to the
//! input's dtype, `rp` to `param_t`, `rs` to the dtype the statistics are kept in (`param_t`
//! for bf16, f32 for f16, see below); all arithmetic in f32, sums in PyTorch's order with
//! each product fused into its addition ([`chan_sum`]); `m = N L` values per channel.
//!
//! Training (batch statistics):
//! - `mean = sum(x) / m`, kept as `mean_t = rs(mean)`; `var_sum = rs(sum((x - mu)^2))` with
//!   `mu = mean` for `(N, C, L)` and `mu = mean_t` for `(N, C)` (PyTorch's channels-last loop
//!   reads the stored mean);
//! - saved `mean_s = rp(mean_t)`, `invstd_s = rp(1 / sqrt(rs(var_sum / rs(m)) + eps))`;
//! - running stats, with `f = rs(momentum)`, `g = rs(1 - f)` (bf16: `c10::BFloat16`
//!   operators, each product and sum rounded): `running_mean = rp(rs(rs(f mean_t) + rs(g
//!   running_mean)))`, `running_var = rp(rs(f rs(var_sum / rs(m - 1)) + rs(g running_var)))`;
//! - `y = r(fma(x, alpha, beta))`, `alpha = invstd_s w`, `beta = b - mean_s alpha`.
//!
//! Evaluation: `invstd = 1 / sqrt(running_var + eps)` (f32), `alpha`, `beta` as above with
//! `running_mean`; the backward's `invstd` is computed in f64 and read as f32 (PyTorch adds
//! the double `eps` to the `param_t` value there).
//!
//! Backward: `s = sum(dy)`, `dot = sum((x - mean) dy)`; training: `k = dot invstd^2 / m`,
//! `dx = r(fma(-(x - mean), k, dy - s / m) invstd w)`; evaluation: `dx = r(dy invstd w)`;
//! `dw += rp(dot invstd)`, `db += rp(s)`.
//!
//! Measured against torch 2.11 (AVX-512 machine, one thread; `tests/nn_optim/batchnorm_lowp.rs`, and
//! once 280k random values of both dtypes, training and evaluation, every value bit for
//! bit), three things the source does not show: (1) the kernel runs PyTorch's AVX2 build
//! (`Vectorized<Half>` / `<BFloat16>` of 16 values, converted into two 8-lane f32 vectors
//! that add into one 8-lane accumulator) and adds the 8 lanes in order
//! (`vec_reduce_all` with a size); (2) it is compiled with FMA contraction, so `x alpha +
//! beta`, `acc + a b` and `dy - s / m - (x - mean) k` are fused multiply-adds; (3) for Half
//! the statistics stay in f32 (`rs` is no rounding): the running stats are updated from the
//! unrounded f32 mean and variance sum in f32 arithmetic, and `invstd` from the f32
//! variance; only the saved mean and invstd are rounded. bf16's coarser rounding hides (1)
//! and (2) on most inputs; with (3) for bf16 too, its running stats differ.

use super::{accumulate, channel_vec, overwrite, put, BatchNormSaved, RunningStats, SavedValues};
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `v` rounded to nearest even in `dtype` (bf16, f16; others unchanged).
fn round(v: f32, dtype: DType) -> f32 {
    super::super::lowp::round(v, dtype)
}

/// PyTorch's vector loads along `L` in this kernel (AVX2 build: `Vectorized<Half>` and
/// `Vectorized<BFloat16>` hold 16 values): each block of 16 goes, as two halves, into one
/// 8-lane f32 accumulator (lane `l mod 8`).
pub(crate) const BLOCK: usize = 16;
pub(crate) const LANES: usize = 8;

/// PyTorch's per-channel f32 sum of `a b` over `n < nn`, `l < ll`, `(a, b) = f(n, l)`, each
/// product fused into its addition (`fma(a, b, acc)`: one rounding; a plain sum passes
/// `b = 1`): for `l` in the whole blocks of [`BLOCK`] the [`LANES`]-lane accumulator (lane
/// `l mod 8`), the rest in order into a scalar; the result is the scalar plus the lanes added
/// in order (`((l0 + l1) + l2) + ...`). For `ll < 16` that is the sum in order.
pub(crate) fn chan_sum(nn: usize, ll: usize, f: impl Fn(usize, usize) -> (f32, f32)) -> f32 {
    let vec_end = ll / BLOCK * BLOCK;
    let mut lanes = [0.0f32; LANES];
    let mut s = 0.0f32;
    for n in 0..nn {
        for l in 0..vec_end {
            let (a, b) = f(n, l);
            lanes[l % LANES] = a.mul_add(b, lanes[l % LANES]);
        }
        for l in vec_end..ll {
            let (a, b) = f(n, l);
            s = a.mul_add(b, s);
        }
    }
    s + lanes[1..].iter().fold(lanes[0], |acc, &v| acc + v)
}

/// The dtype PyTorch keeps a bf16/f16 input's batch statistics in: `param_t` for bf16, f32
/// for f16 (see the module doc).
pub(crate) fn stats_dtype(lp: DType, pt: DType) -> DType {
    if lp == DType::F16 {
        DType::F32
    } else {
        pt
    }
}

/// `values` of an optional channel tensor as f32 (`fill` when absent).
fn chan(op: &'static str, t: Option<&Tensor>, c: usize, fill: f64) -> Result<Vec<f32>> {
    Ok(channel_vec(op, t, c, fill)?
        .into_iter()
        .map(|v| v as f32)
        .collect())
}

/// Forward of [`crate::ops::batch_norm`] for a bf16/f16 `x (N, C, L)` (`dims`, checked by
/// the caller; see the module doc).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    running: Option<RunningStats<'_>>,
    batch_stats: bool,
    eps: f64,
    lp: DType,
    (n, c, l): (usize, usize, usize),
) -> Result<(Tensor, BatchNormSaved)> {
    let op = "batch_norm";
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
        let st = stats_dtype(lp, pt);
        let rs = |v: f32| round(v, st);
        let mut mean_t = vec![0.0f32; c];
        let mut var_sum = vec![0.0f32; c];
        for k in 0..c {
            let mean = chan_sum(n, l, |i, j| (xv[at(i, k, j)], 1.0)) / m as f32;
            mean_t[k] = rs(mean);
            let mu = if l > 1 { mean } else { mean_t[k] };
            var_sum[k] = rs(chan_sum(n, l, |i, j| {
                let d = xv[at(i, k, j)] - mu;
                (d, d)
            }));
        }
        let invstd = var_sum
            .iter()
            .map(|&vs| rp(1.0 / (rs(vs / rs(m as f32)) + eps as f32).sqrt()))
            .collect();
        if let Some(r) = &running {
            let (rm, rv) = (
                chan(op, Some(r.mean), c, 0.0)?,
                chan(op, Some(r.var), c, 1.0)?,
            );
            let f = rs(r.factor.value()? as f32);
            let g = rs(1.0 - f);
            let new_mean = (0..c).map(|k| rp(rs(rs(f * mean_t[k]) + rs(g * rm[k]))) as f64);
            let new_var = (0..c).map(|k| {
                let unbiased = rs(var_sum[k] / rs((m - 1) as f32));
                rp(rs(f * unbiased + rs(g * rv[k]))) as f64
            });
            overwrite(r.mean, new_mean.collect())?;
            overwrite(r.var, new_var.collect())?;
        }
        (mean_t.iter().map(|&v| rp(v)).collect(), invstd)
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
                y[p] = round(xv[p].mul_add(alpha, beta), lp) as f64;
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
    let values = SavedValues::Host {
        xhat: xv.iter().map(|&v| v as f64).collect(),
        rstd,
        mean: mean.iter().map(|&v| v as f64).collect(),
    };
    let saved = BatchNormSaved::new(values, batch_stats, (n, c, l), x);
    Ok((put(y, x.shape(), lp, x.device())?, saved))
}

/// The host values a bf16/f16 forward saved (`SavedValues::Host`), per element `(N, C, L)`
/// or channel `(C)`.
pub(crate) struct Saved<'a> {
    /// The input `x`.
    pub x: &'a [f64],
    /// PyTorch's saved `invstd` (evaluation: the backward's, see the module doc).
    pub invstd: &'a [f64],
    /// The saved mean (evaluation: the running mean).
    pub mean: &'a [f64],
}

/// Backward of [`forward`] (see the module doc).
pub(crate) fn backward(
    dy: &Tensor,
    saved: &BatchNormSaved,
    values: Saved<'_>,
    w: Option<&Tensor>,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "batch_norm_backward";
    let Saved {
        x: xhat,
        invstd: rstd,
        mean,
    } = values;
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
        let (mean, invstd) = (mean[k] as f32, rstd[k] as f32);
        let x = |i: usize, j: usize| xhat[at(i, k, j)] as f32;
        let s = chan_sum(n, l, |i, j| (dyv[at(i, k, j)], 1.0));
        let dot = chan_sum(n, l, |i, j| (x(i, j) - mean, dyv[at(i, k, j)]));
        let kk = dot * invstd * invstd / m;
        let gm = s / m;
        for i in 0..n {
            for j in 0..l {
                let p = at(i, k, j);
                let v = if saved.batch_stats {
                    (-(x(i, j) - mean)).mul_add(kk, dyv[p] - gm) * invstd * wv[k]
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
