//! Causal scaled-dot-product attention of bf16/f16 heads on the CPU, computing what
//! PyTorch 2.11's CPU flash-attention kernel computes for `scaled_dot_product_attention(q,
//! k, v, is_causal=True)` with reduced-precision inputs
//! (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp` on an AVX-512 CPU), value for
//! value.
//!
//! # [Note: PyTorch's flash-attention rounding]
//! Per head, with `q, k, v, out, dout (T, hd)` of dtype `D` (bf16 or f16), the scale
//! `s = 1 / sqrt(hd)` ([`scale`]), queries in blocks of [`q_split`] rows and keys in blocks
//! of [`kv_split`] (T <= 512 is one key block). Products of two `D` values are exact in
//! f32, so every GEMM below is a sum of exact products; each is summed in index order.
//!
//! Forward, per query block and key block (`kvb` keys, the first `16 floor(kvb / 16)` of
//! them the "vector part"), per row `i`:
//! - `x_j = (q_i . k_j) s` (f32) for the keys `j <= i`, `-inf` after;
//! - `M = max(M_old, max_j x_j)`; `e_j = exp(x_j - M)`, with [`fexp_u20`] in the vector part
//!   and `expf` after it; `sum = tree16(lanes) + e_tail...` (16 lane sums of the vector
//!   part reduced by [`tree16`], then the tail added in order);
//! - `p_j = round_D(e_j)` (PyTorch rounds the probabilities before the P V GEMM);
//!   `l = sum + exp(M_old - M) l_old`; `acc = acc exp(M_old - M) + sum_j p_j v_j` (f32);
//! - at the end: `out_i = round_D(acc (1 / l))`, `lse_i = M + log(l)` (f32, saved).
//!
//! Backward, per query block (in order) and key block:
//! - `dsum_i = dout_i . out_i` ([`dot_rows`], PyTorch's `map2_reduce_all`);
//! - `a_ij = exp_sleef((q_i . k_j) s - lse_i)` ([`sleef_expf_u10`]), 0 above the diagonal;
//!   `g_ij = a_ij (dout_i . v_j - dsum_i)`; both rounded to `D`;
//! - `dv_j = round_D(dv_j + sum_i round(a_ij) dout_i)`, `dk_j = round_D(dk_j + s (sum_i
//!   round(g_ij) q_i))`, `dq_i = round_D(dq_i + s (sum_j round(g_ij) k_j))`, from zero:
//!   `dk` and `dv` are rounded once per query block, as PyTorch accumulates them in `D`.
//!
//! Measured against PyTorch 2.11 (`tests/ops/attention_sdpa_torch.rs`, 9 shapes): bf16 `out`
//! and `lse` bit for bit, 1 gradient element of 63k off (a near-0 value); f16, whose GEMMs
//! PyTorch runs in a fallback that sums the scores in another order, `lse` within 3 f32
//! ulps, 1 output element and 55 gradient elements of 63k off by 1-2 ulps (or 1 ulp of the
//! tensor's largest value).
//!
//! `kernels/sdpa.cu` runs the same steps in the same order (the CUDA variant of the test
//! compares the two bit for bit on cuda-emu).

// Index loops spell PyTorch's (and sdpa.cu's) loops one to one.
#![allow(clippy::needless_range_loop)]

use super::kernels::HeadDims;
use super::parallel as par;
use super::sdpa_math::{dot_rows, fexp_u20, sleef_expf_u10, tree16, LANES};
pub use super::sdpa_math::{kv_split, q_split, scale};
use super::simd::multiversion;
use crate::error::{Error, Result};
use crate::tensor::{DType, Element};
use std::cell::RefCell;

/// The 16-bit float an attention rounds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lp {
    Bf16,
    F16,
}

impl Lp {
    fn of(d: DType) -> Result<Lp> {
        match d {
            DType::BF16 => Ok(Lp::Bf16),
            DType::F16 => Ok(Lp::F16),
            other => Err(Error::Unsupported(format!(
                "causal sdpa kernel: dtype {other:?} (bf16 or f16 only)"
            ))),
        }
    }

    /// `x` rounded to nearest even in this dtype, as an f32 (bf16 through
    /// [`super::bf16::round`], branch-free so that loops vectorize; the same values as
    /// `half::bf16`).
    #[inline(always)]
    fn round(self, x: f32) -> f32 {
        match self {
            Lp::Bf16 => super::bf16::round(x),
            Lp::F16 => half::f16::from_f32(x).to_f32(),
        }
    }
}

/// One thread's buffers (kept between calls: no allocation per step once grown).
#[derive(Default)]
struct Work {
    q: Vec<f32>,
    k: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    vt: Vec<f32>,
    g: Vec<f32>,
    o: Vec<f32>,
    /// Scores, then probabilities `(q_split, kv_split)`.
    s: Vec<f32>,
    /// Rounded probabilities, or (backward) their gradient.
    p: Vec<f32>,
    pr: Vec<f32>,
    gr: Vec<f32>,
    acc: Vec<f32>,
    acc2: Vec<f32>,
    dst: Vec<f32>,
    rows: Vec<f32>,
    rows2: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

thread_local! {
    static WORK: RefCell<Work> = RefCell::new(Work::default());
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// `dst = src` widened; with `transpose`, `dst (hd, t)` from `src (t, hd)`.
fn widen<T: Element>(dst: &mut Vec<f32>, src: &[T], (t, hd): (usize, usize), transpose: bool) {
    let d = grow(dst, t * hd);
    if transpose {
        for (j, row) in src.chunks_exact(hd).enumerate() {
            for (l, x) in row.iter().enumerate() {
                d[l * t + j] = x.to_f32();
            }
        }
    } else {
        for (o, x) in d.iter_mut().zip(src) {
            *o = x.to_f32();
        }
    }
}

/// The keys `0..live` of key block `n..` that query `i` sees (`j <= i`), at most `ncol`.
#[inline(always)]
fn live(i: usize, n: usize, ncol: usize) -> usize {
    (i + 1).saturating_sub(n).min(ncol)
}

/// `out[..live] = (a_i . b_j)` for keys `n..n + live`, `a (t, hd)` row `i`, `bt (hd, t)`,
/// summed over `hd` in order.
#[inline(always)]
fn dots(out: &mut [f32], a: &[f32], bt: &[f32], t: usize, n: usize) {
    out.fill(0.0);
    let w = out.len();
    for (l, &x) in a.iter().enumerate() {
        let b = &bt[l * t + n..l * t + n + w];
        for (o, &y) in out.iter_mut().zip(b) {
            *o += x * y;
        }
    }
}

/// `acc += x b` over a row.
#[inline(always)]
fn axpy(acc: &mut [f32], x: f32, b: &[f32]) {
    for (o, &y) in acc.iter_mut().zip(b) {
        *o += x * y;
    }
}

multiversion! {
    /// One head's forward from widened `q, kt (transposed k), v`: `out (t, hd)` (rounded
    /// values) and `lse (t)`.
    fn head_forward(w: &mut Work, t: usize, hd: usize, bf16: bool, out: &mut [f32], lse: &mut [f32]) {
        let lp = if bf16 { Lp::Bf16 } else { Lp::F16 };
        let sc = scale(hd);
        let (qs, kvs) = (q_split(t), kv_split(t));
        let Work { q, kt, v, s, p, acc, dst, rows, rows2, .. } = w;
        let (s, p) = (grow(s, kvs), grow(p, kvs));
        let (acc, dst) = (grow(acc, hd), grow(dst, qs * hd));
        let (mx, sm) = (grow(rows, qs), grow(rows2, qs));
        let mut m = 0;
        while m < t {
            let qb = qs.min(t - m);
            let num_keys = (m + qb).min(t);
            mx.fill(f32::NEG_INFINITY);
            sm.fill(0.0);
            dst[..qb * hd].fill(0.0);
            let mut n = 0;
            while n < num_keys {
                let kvb = kvs.min(t - n);
                let ncol = kvb.min(num_keys - n);
                let nv = LANES * (kvb / LANES);
                for r in 0..qb {
                    let i = m + r;
                    let lv = live(i, n, ncol);
                    let x = &mut s[..lv];
                    dots(x, &q[i * hd..(i + 1) * hd], kt, t, n);
                    let mut tmax = f32::NEG_INFINITY;
                    for e in x.iter_mut() {
                        *e *= sc;
                        tmax = tmax.max(*e);
                    }
                    let tmax = if mx[r] > tmax { mx[r] } else { tmax };
                    if tmax == f32::NEG_INFINITY {
                        continue; // a row with no key yet: zero probabilities
                    }
                    let vend = lv.min(nv);
                    let mut lanes = [0.0f32; LANES];
                    for (xc, pc) in x[..vend].chunks(LANES).zip(p[..vend].chunks_mut(LANES)) {
                        for ((l, &xe), pe) in lanes.iter_mut().zip(xc).zip(pc) {
                            let e = fexp_u20(xe - tmax);
                            *l += e;
                            *pe = lp.round(e);
                        }
                    }
                    let mut sum = tree16(lanes);
                    for c in vend..lv {
                        let e = (x[c] - tmax).exp();
                        sum += e;
                        p[c] = lp.round(e);
                    }
                    let et = (mx[r] - tmax).exp();
                    sm[r] = sum + et * sm[r];
                    mx[r] = tmax;
                    let d = &mut dst[r * hd..(r + 1) * hd];
                    if n == 0 {
                        for c in 0..lv {
                            axpy(d, p[c], &v[(n + c) * hd..(n + c + 1) * hd]);
                        }
                    } else {
                        for e in d.iter_mut() {
                            *e *= et;
                        }
                        acc.fill(0.0);
                        for c in 0..lv {
                            axpy(acc, p[c], &v[(n + c) * hd..(n + c + 1) * hd]);
                        }
                        for (e, a) in d.iter_mut().zip(acc.iter()) {
                            *e += *a;
                        }
                    }
                }
                n += kvs;
            }
            for r in 0..qb {
                let mr = if mx[r] == f32::NEG_INFINITY { 0.0 } else { mx[r] };
                let lr = if sm[r] == 0.0 { 1.0 } else { sm[r] };
                let rec = 1.0 / lr;
                let o = &mut out[(m + r) * hd..(m + r + 1) * hd];
                for (o, &d) in o.iter_mut().zip(&dst[r * hd..(r + 1) * hd]) {
                    *o = lp.round(d * rec);
                }
                lse[m + r] = mr + lr.ln();
            }
            m += qs;
        }
    }
}

multiversion! {
    /// One head's backward from widened `q, k, kt, vt, g (dout), o (out)` and `lse`: the
    /// rounded gradients in `w.dq, w.dk, w.dv`.
    fn head_backward(w: &mut Work, t: usize, hd: usize, bf16: bool, lse: &[f32]) {
        let lp = if bf16 { Lp::Bf16 } else { Lp::F16 };
        let sc = scale(hd);
        let (qs, kvs) = (q_split(t), kv_split(t));
        let Work { q, k, kt, vt, g, o, s, p, pr, gr, acc, acc2, rows, dq, dk, dv, .. } = w;
        let (a, gg) = (grow(s, kvs), grow(p, kvs));
        let (ar, grr) = (grow(pr, qs * kvs), grow(gr, qs * kvs));
        let (accv, acck) = (grow(acc, kvs * hd), grow(acc2, kvs * hd));
        let dsum = grow(rows, qs);
        let (dq, dk, dv) = (grow(dq, t * hd), grow(dk, t * hd), grow(dv, t * hd));
        dq.fill(0.0);
        dk.fill(0.0);
        dv.fill(0.0);
        let mut m = 0;
        while m < t {
            let qb = qs.min(t - m);
            let num_keys = (m + qb).min(t);
            for r in 0..qb {
                let i = m + r;
                dsum[r] = dot_rows(&g[i * hd..(i + 1) * hd], &o[i * hd..(i + 1) * hd]);
            }
            let mut n = 0;
            while n < num_keys {
                let ncol = kvs.min(t - n).min(num_keys - n);
                for r in 0..qb {
                    let i = m + r;
                    let lv = live(i, n, ncol);
                    let (a, gg) = (&mut a[..lv], &mut gg[..lv]);
                    dots(a, &q[i * hd..(i + 1) * hd], kt, t, n);
                    for x in a.iter_mut() {
                        *x = sleef_expf_u10(*x * sc - lse[i]);
                    }
                    dots(gg, &g[i * hd..(i + 1) * hd], vt, t, n);
                    let (arow, grad_row) = (&mut ar[r * kvs..r * kvs + lv], &mut grr[r * kvs..r * kvs + lv]);
                    for c in 0..lv {
                        arow[c] = lp.round(a[c]);
                        grad_row[c] = lp.round(a[c] * (gg[c] - dsum[r]));
                    }
                    // dq_i = round(dq_i + s sum_j round(g_ij) k_j)
                    let acc = &mut accv[..hd];
                    acc.fill(0.0);
                    for c in 0..lv {
                        axpy(acc, grad_row[c], &k[(n + c) * hd..(n + c + 1) * hd]);
                    }
                    for (d, &x) in dq[i * hd..(i + 1) * hd].iter_mut().zip(acc.iter()) {
                        *d = lp.round(x * sc + *d);
                    }
                }
                // dv_j, dk_j: sums over this block's rows in order (rows before j add 0).
                accv[..ncol * hd].fill(0.0);
                acck[..ncol * hd].fill(0.0);
                for r in 0..qb {
                    let i = m + r;
                    let lv = live(i, n, ncol);
                    let (gi, qi) = (&g[i * hd..(i + 1) * hd], &q[i * hd..(i + 1) * hd]);
                    for c in 0..lv {
                        axpy(&mut accv[c * hd..(c + 1) * hd], ar[r * kvs + c], gi);
                        axpy(&mut acck[c * hd..(c + 1) * hd], grr[r * kvs + c], qi);
                    }
                }
                for c in 0..ncol {
                    let j = n + c;
                    for e in 0..hd {
                        dv[j * hd + e] = lp.round(accv[c * hd + e] + dv[j * hd + e]);
                        dk[j * hd + e] = lp.round(acck[c * hd + e] * sc + dk[j * hd + e]);
                    }
                }
                n += kvs;
            }
            m += qs;
        }
    }
}

fn check(op: &'static str, what: &[(usize, usize)]) -> Result<()> {
    match what.iter().find(|(got, want)| got != want) {
        Some(&(got, want)) => Err(Error::ShapeMismatch {
            op,
            expected: vec![want],
            got: vec![got],
        }),
        None => Ok(()),
    }
}

/// Forward: `q, k, v (B, H, T, hd)` of one 16-bit float type -> `out (B, H, T, hd)` (=,
/// same type) and `lse (B, H, T)` f32 (the log-sum-exp of each row's scaled scores, what
/// the backward needs), as in [Note: PyTorch's flash-attention rounding]. Heads run in
/// parallel (each is independent: same bits for any thread count).
///
/// # Errors
/// `ShapeMismatch` when a length disagrees with `d`; `Unsupported` unless `T` is bf16 or
/// f16.
pub fn forward<T: Element>(
    q: &[T],
    k: &[T],
    v: &[T],
    out: &mut [T],
    lse: &mut [f32],
    d: HeadDims,
) -> Result<()> {
    let bf16 = Lp::of(T::DTYPE)? == Lp::Bf16;
    let HeadDims { b, t, h, hd } = d;
    let n = d.numel();
    check(
        "sdpa forward",
        &[
            (q.len(), n),
            (k.len(), n),
            (v.len(), n),
            (out.len(), n),
            (lse.len(), b * h * t),
        ],
    )?;
    if n == 0 {
        return Ok(());
    }
    let th = t * hd;
    par::rows_mut2((out, th), (lse, t), b * h, 1, |r, out, lse| {
        WORK.with(|w| {
            let w = &mut *w.borrow_mut();
            let mut o32 = vec![0.0f32; th];
            for (j, bh) in r.enumerate() {
                let at = bh * th..(bh + 1) * th;
                widen(&mut w.q, &q[at.clone()], (t, hd), false);
                widen(&mut w.kt, &k[at.clone()], (t, hd), true);
                widen(&mut w.v, &v[at], (t, hd), false);
                head_forward(w, t, hd, bf16, &mut o32, &mut lse[j * t..(j + 1) * t]);
                for (o, &x) in out[j * th..(j + 1) * th].iter_mut().zip(&o32) {
                    *o = T::from_f32(x);
                }
            }
            Ok(())
        })
    })
}

/// Backward of [`forward`]: from `q, k, v`, the forward's `out` and `lse` and the output
/// gradient `dout` (all `(B, H, T, hd)` of one 16-bit type but `lse (B, H, T)` f32), the
/// gradients `dq, dk, dv` (=), as in [Note: PyTorch's flash-attention rounding].
///
/// # Errors
/// As [`forward`].
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    (q, k, v): (&[T], &[T], &[T]),
    out: &[T],
    lse: &[f32],
    dout: &[T],
    (dq, dk, dv): (&mut [T], &mut [T], &mut [T]),
    d: HeadDims,
) -> Result<()> {
    let bf16 = Lp::of(T::DTYPE)? == Lp::Bf16;
    let HeadDims { b, t, h, hd } = d;
    let n = d.numel();
    check(
        "sdpa backward",
        &[
            (q.len(), n),
            (k.len(), n),
            (v.len(), n),
            (out.len(), n),
            (dout.len(), n),
            (dq.len(), n),
            (dk.len(), n),
            (dv.len(), n),
            (lse.len(), b * h * t),
        ],
    )?;
    if n == 0 {
        return Ok(());
    }
    let th = t * hd;
    par::rows_mut3((dq, th), (dk, th), (dv, th), b * h, 1, |r, dq, dk, dv| {
        WORK.with(|w| {
            let w = &mut *w.borrow_mut();
            for (j, bh) in r.enumerate() {
                let at = bh * th..(bh + 1) * th;
                widen(&mut w.q, &q[at.clone()], (t, hd), false);
                widen(&mut w.k, &k[at.clone()], (t, hd), false);
                widen(&mut w.kt, &k[at.clone()], (t, hd), true);
                widen(&mut w.vt, &v[at.clone()], (t, hd), true);
                widen(&mut w.g, &dout[at.clone()], (t, hd), false);
                widen(&mut w.o, &out[at], (t, hd), false);
                head_backward(w, t, hd, bf16, &lse[bh * t..(bh + 1) * t]);
                let jt = j * th..(j + 1) * th;
                for (dst, src) in [
                    (&mut dq[jt.clone()], &w.dq),
                    (&mut dk[jt.clone()], &w.dk),
                    (&mut dv[jt], &w.dv),
                ] {
                    for (o, &x) in dst.iter_mut().zip(src.iter()) {
                        *o = T::from_f32(x);
                    }
                }
            }
            Ok(())
        })
    })
}
