//! Causal self-attention on the CPU, one head at a time: each head's scores, softmax and
//! products run back to back on a `(T, T)` scratch that stays in cache, reading q, k, v
//! straight from the `(B, T, 3C)` projection and writing the output in `(B, T, C)` (and,
//! backward, `dq, dk, dv` into `(B, T, 3C)`), so that no head-major copies are made.
//!
//! # [Note: per-head attention, same bits]
//! The same operations as the op-by-op path of `nn::CausalSelfAttention` (`ops::split_qkv`,
//! `ops::causal_matmul`, `ops::softmax_causal` and their backward, `ops::merge_heads`,
//! `ops::merge_qkv`), in another order across heads only: every product is the same
//! `gemm` call on the same operands (row strides differ; the `gemm` crate's sums do not
//! depend on them: packing only copies), the `LowerT` products are the same row blocks as
//! [`crate::ops::causal`], and the softmax kernels are the same. So every value has the
//! same bits (`tests/ops/attention_fused.rs` compares the two paths bit for bit).

use super::fast;
use super::gemm::{self, Strides, Transpose};
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
use super::head_gemm::{self, Lhs};
use super::kernels::{HeadDims, CAUSAL_BLOCK as BLOCK};
use super::parallel as par;
use crate::error::{Error, Result};
use std::cell::RefCell;

thread_local! {
    /// One head's `(T, T)` scores or their gradient (kept between calls: no allocation
    /// per step).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Whether `ops::causal` runs `LowerT` by row blocks at these sizes (its `blocked`).
fn blocked(t: usize, hd: usize) -> bool {
    (2 * BLOCK..=512).contains(&t) && hd >= 16
}

/// `out (T, hd) = a^T @ b` with `a (T, T)` lower triangular (rows `t` apart), `b (T, hd)`
/// rows `sb` apart, `out` rows `so` apart: `ops::causal`'s `LowerT` product.
fn lower_t(
    out: &mut [f32],
    so: usize,
    a: &[f32],
    b: &[f32],
    sb: usize,
    (t, hd): (usize, usize),
) -> Result<()> {
    let s = Strides {
        out: so,
        a: t,
        b: sb,
    };
    if !blocked(t, hd) {
        return gemm::matmul_strided(out, a, b, (t, t, hd), Transpose::TN, s, false);
    }
    let n = (t / BLOCK).max(1);
    for i in 0..n {
        let (r0, r1) = (i * BLOCK, if i + 1 == n { t } else { (i + 1) * BLOCK });
        // out[r0..r1] = a[r0..t, r0..r1]^T @ b[r0..t]
        gemm::matmul_strided(
            &mut out[r0 * so..],
            &a[r0 * t + r0..],
            &b[r0 * sb..],
            (r1 - r0, t - r0, hd),
            Transpose::TN,
            s,
            false,
        )?;
    }
    Ok(())
}

/// Whether the heads run [`head_gemm`]'s products (AVX-512; `T` and `hd` multiples of 16,
/// `T <= 512` as the crate's single sum block) instead of the `gemm` crate's.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
fn own_products(t: usize, hd: usize) -> bool {
    super::wide::available() && t % 16 == 0 && hd % 16 == 0 && t <= 512 && hd <= 512
}

#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
fn lhs(a: &[f32], rs: usize, cs: usize) -> Lhs<'_> {
    Lhs { a, rs, cs }
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

/// Forward: `qkv (B, T, 3C)` (q, k, v concatenated, head `h` at columns `h hd..`) ->
/// `y (B, T, C)` (heads merged) and the probabilities `p (B, H, T, T)` (=), with the scores
/// scaled by `scale`. Parts own whole sequences.
///
/// # Errors
/// `ShapeMismatch` when a length disagrees with `d`.
pub fn forward(qkv: &[f32], y: &mut [f32], p: &mut [f32], d: HeadDims, scale: f32) -> Result<()> {
    let HeadDims { b, t, h, hd } = d;
    let c = h * hd;
    check(
        "attention forward",
        &[
            (qkv.len(), b * t * 3 * c),
            (y.len(), b * t * c),
            (p.len(), b * h * t * t),
        ],
    )?;
    if y.is_empty() || p.is_empty() {
        return Ok(());
    }
    par::rows_mut2((y, t * c), (p, h * t * t), b, 1, |r, y, p| {
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.resize(t * t + t * hd, 0.0);
            for (j, bi) in r.enumerate() {
                let x = &qkv[bi * t * 3 * c..(bi + 1) * t * 3 * c];
                let yb = &mut y[j * t * c..(j + 1) * t * c];
                for hi in 0..h {
                    let ph = &mut p[(j * h + hi) * t * t..][..t * t];
                    let (q, k, v) = (&x[hi * hd..], &x[c + hi * hd..], &x[2 * c + hi * hd..]);
                    #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
                    if own_products(t, hd) {
                        let (s, kt) = s.split_at_mut(t * t);
                        head_gemm::transpose(kt, k, 3 * c, (t, hd));
                        let yh = &mut yb[hi * hd..];
                        // SAFETY: `own_products` checked AVX-512.
                        unsafe {
                            head_gemm::product(
                                s,
                                t,
                                lhs(q, 3 * c, 1),
                                kt,
                                t,
                                (t, hd, t),
                                false,
                                true,
                            );
                            fast::softmax_causal_fwd(s, ph, t, scale)?;
                            head_gemm::product(
                                yh,
                                c,
                                lhs(ph, t, 1),
                                v,
                                3 * c,
                                (t, t, hd),
                                false,
                                false,
                            );
                        }
                        continue;
                    }
                    // S (T, T) = q (T, hd) @ k^T
                    let st = Strides {
                        out: t,
                        a: 3 * c,
                        b: 3 * c,
                    };
                    gemm::matmul_strided(
                        &mut s[..t * t],
                        q,
                        k,
                        (t, hd, t),
                        Transpose::NT,
                        st,
                        false,
                    )?;
                    fast::softmax_causal_fwd(&s[..t * t], ph, t, scale)?;
                    // y_h (T, hd) = P @ v
                    let st = Strides {
                        out: c,
                        a: t,
                        b: 3 * c,
                    };
                    gemm::matmul_strided(
                        &mut yb[hi * hd..],
                        ph,
                        v,
                        (t, t, hd),
                        Transpose::NN,
                        st,
                        false,
                    )?;
                }
            }
            Ok(())
        })
    })
}

/// Backward of [`forward`]: from `qkv`, `p` and the output gradient `dy (B, T, C)`, the
/// projection gradient `dqkv (B, T, 3C)` (=). Parts own whole sequences.
///
/// # Errors
/// `ShapeMismatch` when a length disagrees with `d`.
pub fn backward(
    qkv: &[f32],
    p: &[f32],
    dy: &[f32],
    dqkv: &mut [f32],
    d: HeadDims,
    scale: f32,
) -> Result<()> {
    let HeadDims { b, t, h, hd } = d;
    let c = h * hd;
    check(
        "attention backward",
        &[
            (qkv.len(), b * t * 3 * c),
            (dqkv.len(), b * t * 3 * c),
            (dy.len(), b * t * c),
            (p.len(), b * h * t * t),
        ],
    )?;
    if dqkv.is_empty() || p.is_empty() {
        return Ok(());
    }
    par::rows_mut(dqkv, b, t * 3 * c, 1, |r, dx| {
        SCRATCH.with(|s| {
            let mut dp = s.borrow_mut();
            dp.resize(t * t + t * hd, 0.0);
            for (j, bi) in r.enumerate() {
                let x = &qkv[bi * t * 3 * c..(bi + 1) * t * 3 * c];
                let g = &dy[bi * t * c..(bi + 1) * t * c];
                let dxb = &mut dx[j * t * 3 * c..(j + 1) * t * 3 * c];
                for hi in 0..h {
                    let ph = &p[(bi * h + hi) * t * t..][..t * t];
                    let (q, k, v) = (&x[hi * hd..], &x[c + hi * hd..], &x[2 * c + hi * hd..]);
                    let gh = &g[hi * hd..];
                    #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
                    if own_products(t, hd) {
                        let (dp, vt) = dp.split_at_mut(t * t);
                        head_gemm::transpose(vt, v, 3 * c, (t, hd));
                        let prod = head_gemm::product;
                        let (x3, th) = (3 * c, (t, t, hd));
                        // SAFETY: `own_products` checked AVX-512.
                        unsafe {
                            prod(dp, t, lhs(gh, c, 1), vt, t, (t, hd, t), false, true);
                            let dv = &mut dxb[2 * c + hi * hd..];
                            prod(dv, x3, lhs(ph, 1, t), gh, c, th, true, false);
                            fast::softmax_causal_bwd(ph, dp, t, scale)?;
                            let dq = &mut dxb[hi * hd..];
                            prod(dq, x3, lhs(dp, t, 1), k, x3, th, false, false);
                            let dk = &mut dxb[c + hi * hd..];
                            prod(dk, x3, lhs(dp, 1, t), q, x3, th, true, false);
                        }
                        continue;
                    }
                    // dP (T, T) = dy_h (T, hd) @ v^T
                    let st = Strides {
                        out: t,
                        a: c,
                        b: 3 * c,
                    };
                    gemm::matmul_strided(
                        &mut dp[..t * t],
                        gh,
                        v,
                        (t, hd, t),
                        Transpose::NT,
                        st,
                        false,
                    )?;
                    // dv = P^T @ dy_h
                    lower_t(&mut dxb[2 * c + hi * hd..], 3 * c, ph, gh, c, (t, hd))?;
                    // dS = P * (dP - <P, dP>) * scale, in place
                    fast::softmax_causal_bwd(ph, &mut dp[..t * t], t, scale)?;
                    // dq = dS @ k
                    let st = Strides {
                        out: 3 * c,
                        a: t,
                        b: 3 * c,
                    };
                    gemm::matmul_strided(
                        &mut dxb[hi * hd..],
                        &dp[..t * t],
                        k,
                        (t, t, hd),
                        Transpose::NN,
                        st,
                        false,
                    )?;
                    // dk = dS^T @ q
                    lower_t(
                        &mut dxb[c + hi * hd..],
                        3 * c,
                        &dp[..t * t],
                        q,
                        3 * c,
                        (t, hd),
                    )?;
                }
            }
            Ok(())
        })
    })
}
