//! CPU references of the `kernels/*.cu` kernels, one function per kernel family with the
//! kernel's name and semantics: plain loops over slices, the oracles the CUDA kernels are
//! tested against (tests/ops/kernels.rs). Where the computation is elementwise they round
//! exactly as the kernels (build.rs compiles with `--fmad=false`); row reductions sum in a
//! different order on the GPU, so those tests use dtype-aware tolerances.
//!
//! Shapes in comments; `(=)` overwrites, `(+=)` accumulates, as in the `.cu` headers. The nn
//! functions reproduce the loops of the modules in `src/nn/` (tests check they agree).

use super::ops::exp;
use super::scalar::{gelu, gelu_grad, relu, relu_grad};
use super::simd::multiversion;
use crate::error::{bail_arg, Error, Result};
use crate::tensor::Element;

fn check_len(op: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![expected],
            got: vec![got],
        });
    }
    Ok(())
}

/// Rows of a block of the blocked causal products on the CPU (`ops::causal` and the
/// per-head attention of [`super::attention`]): 32, 4 blocks at `T = 128`; smaller blocks
/// make more, smaller GEMM calls whose fixed costs eat the saved work.
pub const CAUSAL_BLOCK: usize = 32;

/// `pad_copy_{dtype}`: `dst[i] = src[i]` for `i < src.len()`, zero after (=).
///
/// # Errors
/// `ShapeMismatch` when `src` is longer than `dst`.
pub fn pad_copy<T: Element>(src: &[T], dst: &mut [T]) -> Result<()> {
    if src.len() > dst.len() {
        return Err(Error::ShapeMismatch {
            op: "pad_copy",
            expected: vec![dst.len()],
            got: vec![src.len()],
        });
    }
    dst[..src.len()].copy_from_slice(src);
    dst[src.len()..].fill(T::zero());
    Ok(())
}

/// `flatten_{dtype}`: concatenates `srcs` into `dst` (=); `dst` is at least their total
/// length, anything after is left alone. Returns the offsets table (`k + 1` entries).
///
/// # Errors
/// `ShapeMismatch` when `dst` is too short.
pub fn flatten<T: Element>(srcs: &[&[T]], dst: &mut [T]) -> Result<Vec<usize>> {
    let offsets = offsets_of(srcs.iter().map(|s| s.len()));
    let total = offsets[offsets.len() - 1];
    if total > dst.len() {
        return Err(Error::ShapeMismatch {
            op: "flatten",
            expected: vec![total],
            got: vec![dst.len()],
        });
    }
    for (s, src) in srcs.iter().enumerate() {
        dst[offsets[s]..offsets[s + 1]].copy_from_slice(src);
    }
    Ok(offsets)
}

/// `unflatten_{dtype}`: copies consecutive pieces of `src` out into `dsts` (=).
///
/// # Errors
/// `ShapeMismatch` when `src` is shorter than the pieces' total length.
pub fn unflatten<T: Element>(src: &[T], dsts: &mut [&mut [T]]) -> Result<()> {
    let offsets = offsets_of(dsts.iter().map(|s| s.len()));
    let total = offsets[offsets.len() - 1];
    if total > src.len() {
        return Err(Error::ShapeMismatch {
            op: "unflatten",
            expected: vec![total],
            got: vec![src.len()],
        });
    }
    for (s, dst) in dsts.iter_mut().enumerate() {
        dst.copy_from_slice(&src[offsets[s]..offsets[s + 1]]);
    }
    Ok(())
}

/// Prefix sums `[0, l0, l0 + l1, ..]` of segment lengths (the `offsets` argument of
/// `flatten_*` / `unflatten_*`).
pub fn offsets_of(lens: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut out = vec![0];
    for l in lens {
        out.push(out[out.len() - 1] + l);
    }
    out
}

/// `pack_grad_{dtype}`: `out[i] = cast(grad[i] * scale)` (=), the fused predivide and cast
/// to `reduce_dtype` (the runtime's `scale_` then `to_dtype`).
///
/// # Errors
/// `ShapeMismatch` when the lengths differ.
pub fn pack_grad<T: Element>(grad: &[f32], out: &mut [T], scale: f32) -> Result<()> {
    check_len("pack_grad", grad.len(), out.len())?;
    for (o, &g) in out.iter_mut().zip(grad) {
        *o = T::from_f32(g * scale);
    }
    Ok(())
}

/// `unpack_grad_{dtype}`: `out[i] = f32(cast(f32(x[i]) * scale))` (=), the postdivide in
/// `reduce_dtype` and the upcast of the reduced shard.
///
/// # Errors
/// `ShapeMismatch` when the lengths differ.
pub fn unpack_grad<T: Element>(x: &[T], out: &mut [f32], scale: f32) -> Result<()> {
    check_len("unpack_grad", x.len(), out.len())?;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = T::from_f32(v.to_f32() * scale).to_f32();
    }
    Ok(())
}

/// `sum_into_{dtype}`: `acc[i] = cast(f32(acc[i]) + f32(x[i]))` (+=).
///
/// # Errors
/// `ShapeMismatch` when the lengths differ.
pub fn sum_into<T: Element>(acc: &mut [T], x: &[T]) -> Result<()> {
    check_len("sum_into", acc.len(), x.len())?;
    for (a, &v) in acc.iter_mut().zip(x) {
        *a = T::from_f32(a.to_f32() + v.to_f32());
    }
    Ok(())
}

multiversion! {
    /// `gelu_fwd_f32`: `y = gelu(x)` (=).
    pub fn gelu_fwd(x: &[f32], y: &mut [f32]) -> Result<()> {
        check_len("gelu_fwd", x.len(), y.len())?;
        for (o, &v) in y.iter_mut().zip(x) {
            *o = gelu(v);
        }
        Ok(())
    }
}

multiversion! {
    /// `gelu_bwd_f32`: `dx = dy * gelu'(x)` (=).
    pub fn gelu_bwd(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<()> {
        check_len("gelu_bwd", x.len(), dy.len())?;
        check_len("gelu_bwd", x.len(), dx.len())?;
        for ((o, &g), &v) in dx.iter_mut().zip(dy).zip(x) {
            *o = g * gelu_grad(v);
        }
        Ok(())
    }
}

multiversion! {
    /// `dx = dy * gelu'(x)` for rows of `db.len()` elements, and `db += ` the sum of the
    /// rows of `dx`, added row after row: [`gelu_bwd`] followed by `ops::bias_grad` (the
    /// GELU before a `Linear`'s bias, backward), bit for bit, in one pass over memory.
    ///
    /// # Errors
    /// `ShapeMismatch` when the lengths differ or are not whole rows.
    pub fn gelu_bwd_bias_grad(
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        db: &mut [f32],
    ) -> Result<()> {
        check_len("gelu_bwd_bias_grad", x.len(), dy.len())?;
        check_len("gelu_bwd_bias_grad", x.len(), dx.len())?;
        let c = db.len();
        if c == 0 || x.len() % c != 0 {
            return Err(Error::ShapeMismatch {
                op: "gelu_bwd_bias_grad",
                expected: vec![x.len() / c.max(1), c],
                got: vec![x.len()],
            });
        }
        for ((xr, gr), or) in x.chunks_exact(c).zip(dy.chunks_exact(c)).zip(dx.chunks_exact_mut(c)) {
            for ((o, &g), &v) in or.iter_mut().zip(gr).zip(xr) {
                *o = g * gelu_grad(v);
            }
            for (b, &o) in db.iter_mut().zip(or.iter()) {
                *b += o;
            }
        }
        Ok(())
    }
}

multiversion! {
    /// `relu_fwd_f32`: `y = max(x, 0)` (=).
    pub fn relu_fwd(x: &[f32], y: &mut [f32]) -> Result<()> {
        check_len("relu_fwd", x.len(), y.len())?;
        for (o, &v) in y.iter_mut().zip(x) {
            *o = relu(v);
        }
        Ok(())
    }
}

multiversion! {
    /// `relu_bwd_f32`: `dx = dy * relu'(x)` (=).
    pub fn relu_bwd(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<()> {
        check_len("relu_bwd", x.len(), dy.len())?;
        check_len("relu_bwd", x.len(), dx.len())?;
        for ((o, &g), &v) in dx.iter_mut().zip(dy).zip(x) {
            *o = g * relu_grad(v);
        }
        Ok(())
    }
}

/// `bias_add_f32`: `y (rows, C)[r, j] += b[j]` (+=).
pub fn bias_add(y: &mut [f32], b: &[f32]) -> Result<()> {
    let c = b.len();
    if c == 0 || y.len() % c != 0 {
        check_len("bias_add", 0, y.len())?;
        return Ok(());
    }
    for row in y.chunks_exact_mut(c) {
        for (v, &bj) in row.iter_mut().zip(b) {
            *v += bj;
        }
    }
    Ok(())
}

/// `bias_grad_f32`: `db[j] += sum_r dy (rows, C)[r, j]` (+=), rows summed in order.
pub fn bias_grad(dy: &[f32], db: &mut [f32]) -> Result<()> {
    let c = db.len();
    if c == 0 || dy.len() % c != 0 {
        check_len("bias_grad", 0, dy.len())?;
        return Ok(());
    }
    for (j, d) in db.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for row in dy.chunks_exact(c) {
            acc += row[j];
        }
        *d += acc;
    }
    Ok(())
}

multiversion! {
    /// `layernorm_fwd_f32`: per row of `x (rows, C)`: `rstd = 1 / sqrt(var + eps)` (biased
    /// variance), `xhat = (x - mean) rstd`, `y = xhat w + b` (=), as `nn::LayerNorm::forward`.
    pub fn layernorm_fwd(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        xhat: &mut [f32],
        rstd: &mut [f32],
    ) -> Result<()> {
        let c = w.len();
        check_len("layernorm_fwd", c, b.len())?;
        check_len("layernorm_fwd", x.len(), y.len())?;
        check_len("layernorm_fwd", x.len(), xhat.len())?;
        check_len("layernorm_fwd", x.len(), rstd.len() * c)?;
        for (r, rs) in rstd.iter_mut().enumerate() {
            let row = &x[r * c..(r + 1) * c];
            let mean = row.iter().sum::<f32>() / c as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c as f32;
            *rs = 1.0 / (var + eps).sqrt();
            for j in 0..c {
                let n = (row[j] - mean) * *rs;
                xhat[r * c + j] = n;
                y[r * c + j] = n * w[j] + b[j];
            }
        }
        Ok(())
    }
}

multiversion! {
    /// `layernorm_bwd_f32`: `dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat))` per row (=).
    pub fn layernorm_bwd(
        dy: &[f32],
        xhat: &[f32],
        rstd: &[f32],
        w: &[f32],
        dx: &mut [f32],
    ) -> Result<()> {
        let c = w.len();
        check_len("layernorm_bwd", dy.len(), xhat.len())?;
        check_len("layernorm_bwd", dy.len(), dx.len())?;
        check_len("layernorm_bwd", dy.len(), rstd.len() * c)?;
        for (r, &rs) in rstd.iter().enumerate() {
            let (dyr, xr) = (&dy[r * c..(r + 1) * c], &xhat[r * c..(r + 1) * c]);
            let (mut m1, mut m2) = (0.0f32, 0.0f32);
            for j in 0..c {
                let d = dyr[j] * w[j];
                m1 += d;
                m2 += d * xr[j];
            }
            m1 /= c as f32;
            m2 /= c as f32;
            for j in 0..c {
                dx[r * c + j] = rs * (dyr[j] * w[j] - m1 - xr[j] * m2);
            }
        }
        Ok(())
    }
}

/// `layernorm_bwd_params_f32`: `dw[j] += sum_r dy xhat`, `db[j] += sum_r dy` (+=).
pub fn layernorm_bwd_params(
    dy: &[f32],
    xhat: &[f32],
    dw: &mut [f32],
    db: &mut [f32],
) -> Result<()> {
    check_len("layernorm_bwd_params", dy.len(), xhat.len())?;
    check_len("layernorm_bwd_params", dw.len(), db.len())?;
    let c = dw.len();
    if c == 0 {
        return check_len("layernorm_bwd_params", 0, dy.len());
    }
    for j in 0..c {
        let (mut aw, mut ab) = (0.0f32, 0.0f32);
        for r in 0..dy.len() / c {
            let d = dy[r * c + j];
            aw += d * xhat[r * c + j];
            ab += d;
        }
        dw[j] += aw;
        db[j] += ab;
    }
    Ok(())
}

/// Attention layout dims `(B, T, H, hd)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDims {
    /// Batch `B`.
    pub b: usize,
    /// Sequence length `T`.
    pub t: usize,
    /// Heads `H`.
    pub h: usize,
    /// Head width `hd = C / H`.
    pub hd: usize,
}

impl HeadDims {
    /// `B * H * T * hd`, the element count of one of q, k, v.
    pub fn numel(&self) -> usize {
        self.b * self.h * self.t * self.hd
    }
    /// Index in `(B, T, H, hd)` of element `i` of the head-major `(B, H, T, hd)` layout,
    /// with `3` interleaved blocks when `qkv` (`(B, T, 3, H, hd)`, block 0).
    fn token_major(&self, i: usize, qkv: bool) -> usize {
        let HeadDims { t, h, hd, .. } = *self;
        let (d, ti, hi, bi) = (i % hd, (i / hd) % t, (i / (hd * t)) % h, i / (hd * t * h));
        let groups = if qkv { 3 } else { 1 };
        ((bi * t + ti) * groups * h + hi) * hd + d
    }
}

/// `split_qkv_f32`: `qkv (B, T, 3, H, hd)` -> `q, k, v (B, H, T, hd)` (=).
pub fn split_qkv(
    qkv: &[f32],
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
    d: HeadDims,
) -> Result<()> {
    let n = d.numel();
    check_len("split_qkv", 3 * n, qkv.len())?;
    for out in [&*q, &*k, &*v] {
        check_len("split_qkv", n, out.len())?;
    }
    let hc = d.h * d.hd;
    for i in 0..n {
        let s = d.token_major(i, true);
        q[i] = qkv[s];
        k[i] = qkv[s + hc];
        v[i] = qkv[s + 2 * hc];
    }
    Ok(())
}

/// `merge_qkv_f32`: `dq, dk, dv (B, H, T, hd)` -> `dqkv (B, T, 3, H, hd)` (=).
pub fn merge_qkv(dq: &[f32], dk: &[f32], dv: &[f32], dqkv: &mut [f32], d: HeadDims) -> Result<()> {
    let n = d.numel();
    check_len("merge_qkv", 3 * n, dqkv.len())?;
    for x in [dq, dk, dv] {
        check_len("merge_qkv", n, x.len())?;
    }
    let hc = d.h * d.hd;
    for i in 0..n {
        let s = d.token_major(i, true);
        dqkv[s] = dq[i];
        dqkv[s + hc] = dk[i];
        dqkv[s + 2 * hc] = dv[i];
    }
    Ok(())
}

/// `merge_heads_f32`: `yh (B, H, T, hd)` -> `y (B, T, H, hd)` (=).
pub fn merge_heads(yh: &[f32], y: &mut [f32], d: HeadDims) -> Result<()> {
    check_len("merge_heads", d.numel(), yh.len())?;
    check_len("merge_heads", d.numel(), y.len())?;
    for (i, &v) in yh.iter().enumerate() {
        y[d.token_major(i, false)] = v;
    }
    Ok(())
}

/// `split_heads_f32`: `y (B, T, H, hd)` -> `yh (B, H, T, hd)` (=).
pub fn split_heads(y: &[f32], yh: &mut [f32], d: HeadDims) -> Result<()> {
    check_len("split_heads", d.numel(), yh.len())?;
    check_len("split_heads", d.numel(), y.len())?;
    for (i, o) in yh.iter_mut().enumerate() {
        *o = y[d.token_major(i, false)];
    }
    Ok(())
}

multiversion! {
    /// `softmax_causal_fwd_f32`: row `r` of `s (rows, T)` is query `t = r mod T`;
    /// `p[j] = exp(s[j] scale - max) / sum` for `j <= t`, 0 after (=), as the attention forward.
    pub fn softmax_causal_fwd(s: &[f32], p: &mut [f32], t: usize, scale: f32) -> Result<()> {
        check_len("softmax_causal_fwd", s.len(), p.len())?;
        if t == 0 {
            return check_len("softmax_causal_fwd", 0, s.len());
        }
        for (r, (sr, pr)) in s.chunks_exact(t).zip(p.chunks_exact_mut(t)).enumerate() {
            let i = r % t;
            let max = sr[..=i]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
            let mut sum = 0.0f32;
            for j in 0..=i {
                pr[j] = exp(sr[j] * scale - max);
                sum += pr[j];
            }
            let inv = 1.0 / sum;
            pr[..=i].iter_mut().for_each(|v| *v *= inv);
            pr[i + 1..].fill(0.0);
        }
        Ok(())
    }
}

multiversion! {
    /// `softmax_causal_bwd_f32`: `ds[j] = p[j] (dp[j] - <p, dp>) scale` for `j <= t`, 0 after
    /// (=), in place of `dp`.
    pub fn softmax_causal_bwd(p: &[f32], dp: &mut [f32], t: usize, scale: f32) -> Result<()> {
        check_len("softmax_causal_bwd", p.len(), dp.len())?;
        if t == 0 {
            return check_len("softmax_causal_bwd", 0, p.len());
        }
        for (r, (pr, dr)) in p.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate() {
            let i = r % t;
            let dot: f32 = pr[..=i].iter().zip(&dr[..=i]).map(|(a, b)| a * b).sum();
            for j in 0..t {
                dr[j] = if j <= i {
                    pr[j] * (dr[j] - dot) * scale
                } else {
                    0.0
                };
            }
        }
        Ok(())
    }
}

multiversion! {
    /// `cross_entropy_f32`: per row of `logits (N, V)`: `losses[r] = logsumexp - logits[y]`,
    /// `dlogits = (softmax - onehot(y)) * inv_n` (=), as `nn::loss::cross_entropy` (whose loss
    /// is the mean of `losses` in f64).
    ///
    /// # Errors
    /// `InvalidArgument` naming the first target outside `0..V`.
    pub fn cross_entropy(
        logits: &[f32],
        targets: &[i32],
        inv_n: f32,
        losses: &mut [f32],
        dlogits: &mut [f32],
    ) -> Result<()> {
        let n = targets.len();
        check_len("cross_entropy", n, losses.len())?;
        check_len("cross_entropy", logits.len(), dlogits.len())?;
        if n == 0 {
            return Ok(());
        }
        let v = logits.len() / n;
        check_len("cross_entropy", n * v, logits.len())?;
        for (r, &y) in targets.iter().enumerate() {
            if y < 0 || y as usize >= v {
                bail_arg!("cross_entropy: target {y} at position {r} is outside 0..{v}");
            }
            let (row, g) = (
                &logits[r * v..(r + 1) * v],
                &mut dlogits[r * v..(r + 1) * v],
            );
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0.0f32;
            for (gj, &x) in g.iter_mut().zip(row) {
                *gj = exp(x - max);
                sum += *gj;
            }
            let inv = inv_n / sum;
            g.iter_mut().for_each(|gj| *gj *= inv);
            g[y as usize] -= inv_n;
            losses[r] = sum.ln() + max - row[y as usize];
        }
        Ok(())
    }
}

multiversion! {
    /// `embedding_fwd_f32`: `out[i, :] = table (V, C)[ids[i], :]` (=). With `C = 0` there is
    /// nothing to copy and `V` cannot be read off the slices, so the ids go unchecked, as in
    /// the CUDA op; [`crate::ops::embedding()`] checks them against the table's shape.
    ///
    /// # Errors
    /// `InvalidArgument` naming the first id outside `0..V`.
    pub fn embedding_fwd(ids: &[i32], table: &[f32], c: usize, out: &mut [f32]) -> Result<()> {
        check_len("embedding_fwd", ids.len() * c, out.len())?;
        if c == 0 {
            return Ok(());
        }
        let v = table.len() / c;
        for (i, &id) in ids.iter().enumerate() {
            if id < 0 || id as usize >= v {
                bail_arg!("embedding: token id {id} at position {i} is outside the vocabulary 0..{v}");
            }
            let id = id as usize;
            out[i * c..(i + 1) * c].copy_from_slice(&table[id * c..(id + 1) * c]);
        }
        Ok(())
    }
}

/// `embedding_bwd_f32`: `grad[ids[i], :] += dout[i, :]` (+=); ids outside `0..V` skipped.
pub fn embedding_bwd(ids: &[i32], dout: &[f32], c: usize, grad: &mut [f32]) -> Result<()> {
    check_len("embedding_bwd", ids.len() * c, dout.len())?;
    let v = grad.len().checked_div(c).unwrap_or(0);
    for (i, &id) in ids.iter().enumerate() {
        if id >= 0 && (id as usize) < v {
            let g = &mut grad[id as usize * c..(id as usize + 1) * c];
            super::ops::add_(g, &dout[i * c..(i + 1) * c]);
        }
    }
    Ok(())
}
