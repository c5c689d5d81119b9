//! The f64 host paths of the transformer ops (float64 modules compute in float64, as
//! PyTorch's): LayerNorm forward and backward, the causal softmax and its backward,
//! attention's permutes between token-major and head-major layouts, embedding lookup and
//! its gradient, cross-entropy, and the sum of squares `clip_grad_norm_` needs. Each is the
//! textbook loop of the f32 op it stands for (the formulas in `ops::layernorm`,
//! `ops::attention`, `ops::embedding`, `ops::loss`), one row after another, sums in index
//! order. The callers in `ops` have checked shapes; these check dtypes and the device.

use super::super::types::LayerNormSaved;
use super::{check, scratch};
use crate::backend::cpu::kernels::HeadDims;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

pub use crate::dtype::widen;

/// `y = (x - mean) rstd w + b` per row of `x (rows, C)`, `rstd = 1 / sqrt(var + eps)` with
/// the biased variance; saves `xhat` and `rstd` (f64) for the backward.
pub(crate) fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
) -> Result<(Tensor, LayerNormSaved)> {
    check("layer_norm", &[x, w, b])?;
    let c = w.numel();
    let n = x.numel().checked_div(c).unwrap_or(0);
    let (xv, wv, bv) = (x.data::<f64>()?, w.data::<f64>()?, b.data::<f64>()?);
    let (yt, xhat_t, rstd_t) = (scratch(x.shape()), scratch(x.shape()), scratch(&[n]));
    let (mut y, mut xhat, mut rstd) = (
        yt.data_mut::<f64>()?,
        xhat_t.data_mut::<f64>()?,
        rstd_t.data_mut::<f64>()?,
    );
    for r in 0..n {
        let row = &xv[r * c..(r + 1) * c];
        let mean = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
        let rs = 1.0 / (var + eps).sqrt();
        rstd[r] = rs;
        for j in 0..c {
            let h = (row[j] - mean) * rs;
            xhat[r * c + j] = h;
            y[r * c + j] = h * wv[j] + bv[j];
        }
    }
    drop((y, xhat, rstd));
    Ok((
        yt,
        LayerNormSaved {
            xhat: xhat_t,
            rstd: rstd_t,
            mean: None,
        },
    ))
}

/// `dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat))` per row; `dw += sum_rows dy xhat`,
/// `db += sum_rows dy` for the gradients given.
pub(crate) fn layer_norm_backward(
    dy: &Tensor,
    saved: &LayerNormSaved,
    w: &Tensor,
    dw: Option<&Tensor>,
    db: Option<&Tensor>,
) -> Result<Tensor> {
    let LayerNormSaved { xhat, rstd, .. } = saved;
    let mut ts = vec![dy, xhat, rstd, w];
    ts.extend(dw);
    ts.extend(db);
    check("layer_norm_backward", &ts)?;
    let c = w.numel();
    let (dyv, xh, rs, wv) = (
        dy.data::<f64>()?,
        xhat.data::<f64>()?,
        rstd.data::<f64>()?,
        w.data::<f64>()?,
    );
    let n = rs.len();
    if let Some(g) = dw {
        let mut g = g.data_mut::<f64>()?;
        for r in 0..n {
            for j in 0..c {
                g[j] += dyv[r * c + j] * xh[r * c + j];
            }
        }
    }
    if let Some(g) = db {
        let mut g = g.data_mut::<f64>()?;
        for r in 0..n {
            for j in 0..c {
                g[j] += dyv[r * c + j];
            }
        }
    }
    let dx_t = scratch(dy.shape());
    let mut dx = dx_t.data_mut::<f64>()?;
    for r in 0..n {
        let (d, h) = (&dyv[r * c..(r + 1) * c], &xh[r * c..(r + 1) * c]);
        let (mut m1, mut m2) = (0.0, 0.0);
        for j in 0..c {
            m1 += d[j] * wv[j];
            m2 += d[j] * wv[j] * h[j];
        }
        let (m1, m2) = (m1 / c as f64, m2 / c as f64);
        for j in 0..c {
            dx[r * c + j] = rs[r] * (d[j] * wv[j] - m1 - h[j] * m2);
        }
    }
    drop(dx);
    Ok(dx_t)
}

/// Causal softmax of `s (rows, T)`, row `r` being query `r mod T`: `p[j] = exp(s[j] scale -
/// max) / sum` for `j <= r mod T`, 0 after.
pub(crate) fn softmax_causal(s: &Tensor, t: usize, scale: f64) -> Result<Tensor> {
    check("softmax_causal", &[s])?;
    let sv = s.data::<f64>()?;
    let p_t = Tensor::zeros(s.shape(), DType::F64);
    let mut p = p_t.data_mut::<f64>()?;
    for (r, (row, out)) in sv
        .chunks_exact(t.max(1))
        .zip(p.chunks_exact_mut(t.max(1)))
        .enumerate()
    {
        let q = r % t;
        let max = row[..=q]
            .iter()
            .map(|v| v * scale)
            .fold(f64::NEG_INFINITY, f64::max);
        let mut sum = 0.0;
        for j in 0..=q {
            out[j] = (row[j] * scale - max).exp();
            sum += out[j];
        }
        out[..=q].iter_mut().for_each(|v| *v /= sum);
    }
    drop(p);
    Ok(p_t)
}

/// In place: `dp` becomes `p (dp - <p, dp>) scale` per row, 0 above the diagonal.
pub(crate) fn softmax_causal_backward_(
    p: &Tensor,
    dp: &Tensor,
    t: usize,
    scale: f64,
) -> Result<()> {
    check("softmax_causal_backward_", &[p, dp])?;
    let pv = p.data::<f64>()?;
    let mut g = dp.data_mut::<f64>()?;
    for (r, (pr, gr)) in pv
        .chunks_exact(t.max(1))
        .zip(g.chunks_exact_mut(t.max(1)))
        .enumerate()
    {
        let q = r % t;
        let dot = (0..=q).map(|j| pr[j] * gr[j]).sum::<f64>();
        for j in 0..t {
            gr[j] = if j <= q {
                pr[j] * (gr[j] - dot) * scale
            } else {
                0.0
            };
        }
    }
    Ok(())
}

/// `qkv (B, T, 3C)` -> `[q, k, v]`, each `(B, H, T, hd)`.
pub(crate) fn split_qkv(qkv: &Tensor, d: HeadDims) -> Result<[Tensor; 3]> {
    check("split_qkv", &[qkv])?;
    let HeadDims { b, t, h, hd } = d;
    let c = h * hd;
    let src = qkv.data::<f64>()?;
    let shape = [b, h, t, hd];
    let ts = [scratch(&shape), scratch(&shape), scratch(&shape)];
    let mut out = [
        ts[0].data_mut::<f64>()?,
        ts[1].data_mut::<f64>()?,
        ts[2].data_mut::<f64>()?,
    ];
    for bi in 0..b {
        for ti in 0..t {
            for hi in 0..h {
                let dst = ((bi * h + hi) * t + ti) * hd;
                for (w, o) in out.iter_mut().enumerate() {
                    let from = (bi * t + ti) * 3 * c + w * c + hi * hd;
                    o[dst..dst + hd].copy_from_slice(&src[from..from + hd]);
                }
            }
        }
    }
    drop(out);
    Ok(ts)
}

/// `dq, dk, dv (B, H, T, hd)` -> `dqkv (B, T, 3C)`.
pub(crate) fn merge_qkv(dq: &Tensor, dk: &Tensor, dv: &Tensor, d: HeadDims) -> Result<Tensor> {
    check("merge_qkv", &[dq, dk, dv])?;
    let HeadDims { b, t, h, hd } = d;
    let c = h * hd;
    let out_t = scratch(&[b, t, 3 * c]);
    let mut out = out_t.data_mut::<f64>()?;
    for (w, src) in [dq, dk, dv].into_iter().enumerate() {
        let sv = src.data::<f64>()?;
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let from = ((bi * h + hi) * t + ti) * hd;
                    let to = (bi * t + ti) * 3 * c + w * c + hi * hd;
                    out[to..to + hd].copy_from_slice(&sv[from..from + hd]);
                }
            }
        }
    }
    drop(out);
    Ok(out_t)
}

/// `(B, T, C)` -> `(B, H, T, hd)` when `split`, else back.
pub(crate) fn permute_heads(src: &Tensor, d: HeadDims, split: bool) -> Result<Tensor> {
    check(if split { "split_heads" } else { "merge_heads" }, &[src])?;
    let HeadDims { b, t, h, hd } = d;
    let c = h * hd;
    let sv = src.data::<f64>()?;
    let out_t = if split {
        scratch(&[b, h, t, hd])
    } else {
        scratch(&[b, t, c])
    };
    let mut out = out_t.data_mut::<f64>()?;
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let head_major = ((bi * h + hi) * t + ti) * hd;
                let token_major = (bi * t + ti) * c + hi * hd;
                let (from, to) = if split {
                    (token_major, head_major)
                } else {
                    (head_major, token_major)
                };
                out[to..to + hd].copy_from_slice(&sv[from..from + hd]);
            }
        }
    }
    drop(out);
    Ok(out_t)
}

/// `out[i, :] = table (V, C)[ids[i], :]`; the ids were checked against `V` by the caller.
pub(crate) fn embedding(table: &Tensor, ids: &[i32], shape: &[usize]) -> Result<Tensor> {
    check("embedding", &[table])?;
    let c = table.shape()[1];
    let tv = table.data::<f64>()?;
    let mut out = Vec::with_capacity(ids.len() * c);
    for &id in ids {
        let r = id as usize;
        out.extend_from_slice(&tv[r * c..(r + 1) * c]);
    }
    Tensor::from_vec(out, shape)
}

/// `grad (V, C)[ids[i], :] += dout[i, :]`, in the order of `ids`; ids outside `0..V`
/// skipped (the forward reported them).
pub(crate) fn embedding_backward(ids: &Tensor, dout: &Tensor, grad: &Tensor) -> Result<()> {
    check("embedding_backward", &[dout, grad])?;
    let (v, c) = (grad.shape()[0], grad.shape()[1]);
    let (iv, dv) = (ids.data::<i32>()?, dout.data::<f64>()?);
    let mut g = grad.data_mut::<f64>()?;
    for (i, &id) in iv.iter().enumerate() {
        if id < 0 || id as usize >= v {
            continue;
        }
        let r = id as usize;
        for j in 0..c {
            g[r * c + j] += dv[i * c + j];
        }
    }
    Ok(())
}

/// Mean cross-entropy of `logits (N, V)` against `targets (N)` (checked to lie in `0..V`
/// by the caller) and `d loss / d logits = (softmax - onehot) / N`. The loss is summed in
/// f64 and returned as the f32 the API gives alongside the exact f64 value.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &[i32], v: usize) -> Result<(f64, Tensor)> {
    check("cross_entropy", &[logits])?;
    let lv = logits.data::<f64>()?;
    let n = targets.len();
    let inv_n = 1.0 / n as f64;
    let grad_t = scratch(logits.shape());
    let mut grad = grad_t.data_mut::<f64>()?;
    let mut total = 0.0;
    for (r, &y) in targets.iter().enumerate() {
        let row = &lv[r * v..(r + 1) * v];
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum = row.iter().map(|x| (x - max).exp()).sum::<f64>();
        let lse = max + sum.ln();
        total += lse - row[y as usize];
        for j in 0..v {
            let p = (row[j] - lse).exp();
            let onehot = if j == y as usize { 1.0 } else { 0.0 };
            grad[r * v + j] = (p - onehot) * inv_n;
        }
    }
    drop(grad);
    Ok((total * inv_n, grad_t))
}

/// `sum_i t[i]^2` of an f64 tensor, in index order.
pub(crate) fn sum_squares(t: &Tensor) -> Result<f64> {
    check("sum_squares", &[t])?;
    Ok(t.data::<f64>()?.iter().fold(0.0, |s, v| s + v * v))
}
