//! Row kernels 16 rows at a time with AVX-512: the row sums of LayerNorm and the causal
//! softmax, forward and backward, as 16 chains in the lanes of one vector.
//!
//! A row sum in element order is a chain of dependent additions ([`super::rows`]). Here a
//! block of 16 rows is read 16 columns at a time and transposed in registers, so that
//! column `j` of the block is one vector; adding the columns in order adds each row's
//! elements in order, one lane per row: the same additions, in the same order, as the
//! reference loop of each row (the same bits), at a fraction of the instructions of
//! [`super::rows::seq_sums`] (which reads one element per row and step). Products are
//! rounded before they are added (`mul` then `add`, never a fused multiply-add), as in
//! the references. The elementwise passes around the sums are the references' loops,
//! compiled with AVX-512 enabled.
//!
//! Callers ([`super::fast`]) use these only when [`available`] says the CPU has AVX-512;
//! rows left over after the last block of 16 run the [`super::fast`] loops.

// The AVX-512 intrinsics are stable since rustc 1.89; build.rs sets `fsdp_avx512` only
// for such compilers, and older ones build this module without them.
#![allow(clippy::incompatible_msrv)]

#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
use std::arch::x86_64::*;

#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
use super::ops::exp;

/// Rows per block.
pub const ROWS: usize = 16;

/// True when this CPU runs the kernels of this module (AVX-512 F, VL, BW, DQ).
#[inline]
pub fn available() -> bool {
    #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
    {
        super::simd::has_avx512()
    }
    #[cfg(not(all(target_arch = "x86_64", fsdp_avx512)))]
    {
        false
    }
}

/// Loads the 16 x 16 block whose row `r` starts at `p + r * stride` and returns its
/// columns: `out[j]` lane `r` is element `(r, j)`.
///
/// # Safety
/// AVX-512 F; `p + r * stride + j` readable for `r, j < 16`.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn columns(p: *const f32, stride: usize) -> [__m512; 16] {
    let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(p.add(i * stride)));
    // 32-bit interleave of row pairs.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // 64-bit interleave: u[4g + q] holds, per 128-bit lane, column q of rows 4g..4g+4.
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let (a, b, c, d) = (
            _mm512_castps_pd(t[4 * g]),
            _mm512_castps_pd(t[4 * g + 1]),
            _mm512_castps_pd(t[4 * g + 2]),
            _mm512_castps_pd(t[4 * g + 3]),
        );
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // 128-bit lanes: gather lane l of the four row groups.
    let mut v = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let lo01 = _mm512_shuffle_f32x4::<0x44>(u[q], u[4 + q]); // lanes 0,1 of g0 | g1
        let hi01 = _mm512_shuffle_f32x4::<0xEE>(u[q], u[4 + q]); // lanes 2,3 of g0 | g1
        let lo23 = _mm512_shuffle_f32x4::<0x44>(u[8 + q], u[12 + q]);
        let hi23 = _mm512_shuffle_f32x4::<0xEE>(u[8 + q], u[12 + q]);
        // lane l of groups 0..4 in order: column 4l + q.
        v[q] = _mm512_shuffle_f32x4::<0x88>(lo01, lo23);
        v[4 + q] = _mm512_shuffle_f32x4::<0xDD>(lo01, lo23);
        v[8 + q] = _mm512_shuffle_f32x4::<0x88>(hi01, hi23);
        v[12 + q] = _mm512_shuffle_f32x4::<0xDD>(hi01, hi23);
    }
    v
}

/// Asks for the cache lines of `rows` rows of `width` elements, `stride` apart, from `p`
/// (the next block, while this one is summed: the column-wise reads of [`columns`] touch
/// 16 rows at once, which the hardware prefetchers follow poorly). Addresses past the end
/// of the data are never dereferenced by a prefetch.
///
/// # Safety
/// SSE (every x86-64).
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[inline(always)]
unsafe fn prefetch_rows(p: *const f32, stride: usize, rows: usize, width: usize) {
    for r in 0..rows {
        let row = p.wrapping_add(r * stride);
        for j in (0..width).step_by(16) {
            _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(j) as *const i8);
        }
    }
}

/// `max(s[j] * scale)` over `row[..len]`, as the reference fold (`f32::max` picks one of
/// its inputs, so the order does not matter); `row.len()` is `len` rounded up to 16.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[inline(always)]
fn scaled_max(row: &[f32], len: usize, scale: f32) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    for (c, chunk) in row.chunks_exact(16).enumerate() {
        for (q, (l, &v)) in lanes.iter_mut().zip(chunk).enumerate() {
            let v = if c * 16 + q < len {
                v * scale
            } else {
                f32::NEG_INFINITY
            };
            *l = l.max(v);
        }
    }
    lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// [`super::fast::softmax_causal_fwd`] on whole `(T, T)` matrices, `T` a multiple of 16.
///
/// # Safety
/// AVX-512 ([`available`]); `s.len() == p.len()`, a multiple of `t * t`; `t % 16 == 0`.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
pub unsafe fn softmax_causal_fwd(s: &[f32], p: &mut [f32], t: usize, scale: f32) {
    let n = s.len() / t;
    for r0 in (0..n).step_by(ROWS) {
        let i0 = r0 % t;
        for r in 0..ROWS {
            // Whole vectors up to `wide` (columns past `len` are computed, then zeroed).
            let (len, wide) = (i0 + r + 1, (i0 + r + 16) / 16 * 16);
            let (sr, pr) = (&s[(r0 + r) * t..][..wide], &mut p[(r0 + r) * t..][..t]);
            let max = scaled_max(sr, len, scale);
            for (pc, sc) in pr[..wide].chunks_exact_mut(16).zip(sr.chunks_exact(16)) {
                for (pj, &v) in pc.iter_mut().zip(sc) {
                    *pj = exp(v * scale - max);
                }
            }
            pr[len..].fill(0.0);
        }
        // Row sums from 0.0 over columns 0..i0 + 16: the columns past a row's end hold
        // +0.0, and adding +0.0 to a sum of exponentials (>= +0.0) leaves it unchanged.
        let base = p.as_ptr().add(r0 * t);
        let mut acc = _mm512_setzero_ps();
        for j0 in (0..i0 + ROWS).step_by(16) {
            let c = columns(base.add(j0), t);
            for col in c {
                acc = _mm512_add_ps(acc, col);
            }
        }
        let mut sums = [0.0f32; 16];
        _mm512_storeu_ps(sums.as_mut_ptr(), acc);
        for (r, &sum) in sums.iter().enumerate() {
            // 1 / sum is finite and positive (the sum is at least exp(0) = 1): the zeros
            // past the row's end stay +0.0.
            let inv = 1.0 / sum;
            let wide = (i0 + r + 16) / 16 * 16;
            for c in p[(r0 + r) * t..][..wide].chunks_exact_mut(16) {
                c.iter_mut().for_each(|v| *v *= inv);
            }
        }
    }
}

/// [`super::fast::softmax_causal_bwd`] on whole `(T, T)` matrices, `T` a multiple of 16.
///
/// # Safety
/// As [`softmax_causal_fwd`], with `dp` for `s`.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
pub unsafe fn softmax_causal_bwd(p: &[f32], dp: &mut [f32], t: usize, scale: f32) {
    let n = p.len() / t;
    for r0 in (0..n).step_by(ROWS) {
        let i0 = r0 % t;
        // dot = -0.0 + p[0] dp[0] + ... over j <= i (the reference `sum()`): lane r adds
        // column j only while j <= i0 + r.
        let (pb, db) = (p.as_ptr().add(r0 * t), dp.as_ptr().add(r0 * t));
        if r0 + ROWS < n {
            let next = ((r0 + ROWS) % t + ROWS).min(t);
            prefetch_rows(pb.wrapping_add(ROWS * t), t, ROWS, next);
            prefetch_rows(db.wrapping_add(ROWS * t), t, ROWS, next);
        }
        let mut acc = _mm512_set1_ps(-0.0);
        for j0 in (0..i0 + ROWS).step_by(16) {
            let (pc, dc) = (columns(pb.add(j0), t), columns(db.add(j0), t));
            for q in 0..16 {
                let j = j0 + q;
                // Lanes r with i0 + r >= j.
                let mask: __mmask16 = if j <= i0 {
                    0xFFFF
                } else {
                    (0xFFFFu32 << (j - i0)) as u16
                };
                acc = _mm512_mask_add_ps(acc, mask, acc, _mm512_mul_ps(pc[q], dc[q]));
            }
        }
        let mut dots = [0.0f32; 16];
        _mm512_storeu_ps(dots.as_mut_ptr(), acc);
        for (r, &dot) in dots.iter().enumerate() {
            let (len, wide) = (i0 + r + 1, (i0 + r + 16) / 16 * 16);
            let (pr, dr) = (&p[(r0 + r) * t..][..t], &mut dp[(r0 + r) * t..][..t]);
            for (dc, pc) in dr[..wide].chunks_exact_mut(16).zip(pr.chunks_exact(16)) {
                for (d, &pj) in dc.iter_mut().zip(pc) {
                    *d = pj * (*d - dot) * scale;
                }
            }
            dr[len..].fill(0.0);
        }
    }
}

/// [`super::fast::layernorm_fwd`] on the first `rows / 16 * 16` rows; returns how many
/// rows it did.
///
/// # Safety
/// AVX-512 ([`available`]); `c % 16 == 0`; the slices sized as the reference's.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn layernorm_fwd(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
    y: &mut [f32],
    xhat: &mut [f32],
    rstd: &mut [f32],
) -> usize {
    let c = w.len();
    let full = rstd.len() / ROWS * ROWS;
    let cf = _mm512_set1_ps(c as f32);
    for r0 in (0..full).step_by(ROWS) {
        let base = x.as_ptr().add(r0 * c);
        if r0 + ROWS < full {
            prefetch_rows(base.wrapping_add(ROWS * c), c, ROWS, c);
        }
        // mean = (-0.0 + x0 + x1 + ...) / c, per lane.
        let mut s = _mm512_set1_ps(-0.0);
        for j0 in (0..c).step_by(16) {
            for col in columns(base.add(j0), c) {
                s = _mm512_add_ps(s, col);
            }
        }
        let mean = _mm512_div_ps(s, cf);
        let mut v = _mm512_set1_ps(-0.0);
        for j0 in (0..c).step_by(16) {
            for col in columns(base.add(j0), c) {
                let d = _mm512_sub_ps(col, mean);
                v = _mm512_add_ps(v, _mm512_mul_ps(d, d));
            }
        }
        let var = _mm512_div_ps(v, cf);
        let (mut means, mut vars) = ([0.0f32; 16], [0.0f32; 16]);
        _mm512_storeu_ps(means.as_mut_ptr(), mean);
        _mm512_storeu_ps(vars.as_mut_ptr(), var);
        for r in 0..ROWS {
            let rs = 1.0 / (vars[r] + eps).sqrt();
            rstd[r0 + r] = rs;
            let span = (r0 + r) * c..(r0 + r + 1) * c;
            let row = &x[span.clone()];
            let (xh, yr) = (&mut xhat[span.clone()], &mut y[span]);
            let m = means[r];
            for ((((xh, yr), &v), &wj), &bj) in
                xh.iter_mut().zip(yr.iter_mut()).zip(row).zip(w).zip(b)
            {
                let n = (v - m) * rs;
                *xh = n;
                *yr = n * wj + bj;
            }
        }
    }
    full
}

/// [`super::fast::layernorm_bwd`] on the first `rows / 16 * 16` rows; returns how many
/// rows it did.
///
/// # Safety
/// AVX-512 ([`available`]); `c % 16 == 0`; the slices sized as the reference's.
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
pub unsafe fn layernorm_bwd(
    dy: &[f32],
    xhat: &[f32],
    rstd: &[f32],
    w: &[f32],
    dx: &mut [f32],
) -> usize {
    let c = w.len();
    let full = rstd.len() / ROWS * ROWS;
    let cf = _mm512_set1_ps(c as f32);
    for r0 in (0..full).step_by(ROWS) {
        let (db, xb) = (dy.as_ptr().add(r0 * c), xhat.as_ptr().add(r0 * c));
        if r0 + ROWS < full {
            prefetch_rows(db.wrapping_add(ROWS * c), c, ROWS, c);
            prefetch_rows(xb.wrapping_add(ROWS * c), c, ROWS, c);
        }
        // m1 = 0.0 + dy0 w0 + ..., m2 = 0.0 + (dy0 w0) x0 + ...
        let (mut m1, mut m2) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for j0 in (0..c).step_by(16) {
            let (dc, xc) = (columns(db.add(j0), c), columns(xb.add(j0), c));
            for q in 0..16 {
                let d = _mm512_mul_ps(dc[q], _mm512_set1_ps(w[j0 + q]));
                m1 = _mm512_add_ps(m1, d);
                m2 = _mm512_add_ps(m2, _mm512_mul_ps(d, xc[q]));
            }
        }
        let (mut a, mut b) = ([0.0f32; 16], [0.0f32; 16]);
        _mm512_storeu_ps(a.as_mut_ptr(), _mm512_div_ps(m1, cf));
        _mm512_storeu_ps(b.as_mut_ptr(), _mm512_div_ps(m2, cf));
        for r in 0..ROWS {
            let (m1, m2, rs) = (a[r], b[r], rstd[r0 + r]);
            let span = (r0 + r) * c..(r0 + r + 1) * c;
            let (dyr, xr, out) = (&dy[span.clone()], &xhat[span.clone()], &mut dx[span]);
            for (((o, &d), &x), &wj) in out.iter_mut().zip(dyr).zip(xr).zip(w) {
                *o = rs * (d * wj - m1 - x * m2);
            }
        }
    }
    full
}

#[cfg(all(test, target_arch = "x86_64", fsdp_avx512))]
mod tests {
    use super::*;

    #[test]
    fn columns_transposes() {
        if !available() {
            return;
        }
        let stride = 21;
        let a: Vec<f32> = (0..16 * stride).map(|i| i as f32).collect();
        // SAFETY: AVX-512 checked; rows 0..16 of 16 elements lie inside `a`.
        let c = unsafe { columns(a.as_ptr(), stride) };
        for (j, col) in c.iter().enumerate() {
            let mut lanes = [0.0f32; 16];
            // SAFETY: AVX-512 checked; `lanes` holds 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *col) };
            for (r, &v) in lanes.iter().enumerate() {
                assert_eq!(v, (r * stride + j) as f32, "column {j} row {r}");
            }
        }
    }
}
