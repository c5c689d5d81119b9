//! The per-head products of causal attention with AVX-512, without the `gemm` crate's
//! fixed cost per call (its packing buffers and block sizes, a few microseconds, paid
//! 13 times per head), computing the same sums.
//!
//! # [Note: per-head products, the gemm crate's bits]
//! For `k <= 512` the `gemm` crate computes each output element as one chain of fused
//! multiply-adds over `k` in order, from a zero accumulator, then stores it (`beta = 1`,
//! not reading the destination). [`product`] computes exactly that chain for every element
//! it writes (`_mm512_fmadd_ps`, `p` in order from `+0.0`), so its results are the crate's,
//! bit for bit, whatever the tiling. Two liberties, both exact:
//! - `lower_t`: rows `i0..` of a tile start their chains at `p = i0` instead of 0. The
//!   operand is lower triangular (`A(i, p) = 0` for `p < i`), so the skipped terms are
//!   `fma(0, b, +0.0) = +0.0` for finite `b`: the accumulator is `+0.0` either way
//!   ([Note: causal products, same bits] in `ops::causal` drops the same terms).
//! - `causal_cols`: only the columns of a tile's 16-column blocks at or left of its last
//!   row are written; the others are left as they were (the causal softmax and its
//!   backward never read them).
//!
//! `tests/ops/attention_fused.rs` compares the attention built on these with the op-by-op
//! path (the `gemm` crate) bit for bit.

// The AVX-512 intrinsics are stable since rustc 1.89; build.rs sets `fsdp_avx512` only
// for such compilers, and older ones build this module without them.
#![allow(clippy::incompatible_msrv)]

#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
use std::arch::x86_64::*;

/// Rows of a tile (6 rows x 2 vectors: 12 accumulators, as the crate's 64 x 6 kernel is 24).
const TILE_ROWS: usize = 6;

/// One tile: `out[i, j0..j0 + 16 V] = sum_{p in p0..p1} A(i, p) B(p, j0..)` for rows
/// `i0..i0 + R`, `A(i, p) = a[i ars + p acs]`, `B(p, j) = b[p sb + j]`, `out[i so + j]`.
///
/// # Safety
/// AVX-512 F; every address named is inside its slice (the caller's checks).
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const R: usize, const V: usize>(
    out: *mut f32,
    so: usize,
    (a, ars, acs): (*const f32, usize, usize),
    (b, sb): (*const f32, usize),
    i0: usize,
    j0: usize,
    (p0, p1): (usize, usize),
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    for p in p0..p1 {
        let bp = b.add(p * sb + j0);
        let bv: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(bp.add(16 * v)));
        for (r, row) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add((i0 + r) * ars + p * acs));
            for (x, &bx) in row.iter_mut().zip(&bv) {
                *x = _mm512_fmadd_ps(av, bx, *x);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, &x) in row.iter().enumerate() {
            _mm512_storeu_ps(out.add((i0 + r) * so + j0 + 16 * v), x);
        }
    }
}

/// The operand `A` of [`product`]: `A(i, p) = a[i * rs + p * cs]`.
#[derive(Clone, Copy)]
pub struct Lhs<'a> {
    /// The elements.
    pub a: &'a [f32],
    /// Stride between rows `i`.
    pub rs: usize,
    /// Stride between columns `p`.
    pub cs: usize,
}

/// `out (m, n) = A (m, k) @ B (k, n)`, `B(p, j) = b[p * sb + j]`, `out[i * so + j]`, the
/// `gemm` crate's bits ([Note: per-head products, the gemm crate's bits]); `lower_t` and
/// `causal_cols` as there. `n` must be a multiple of 16.
///
/// # Panics
/// When an operand is too short for its strides (a caller's bug: the attention's shapes
/// are checked before).
///
/// # Safety
/// The CPU has AVX-512 ([`super::wide::available`]).
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn product(
    out: &mut [f32],
    so: usize,
    lhs: Lhs<'_>,
    b: &[f32],
    sb: usize,
    (m, k, n): (usize, usize, usize),
    lower_t: bool,
    causal_cols: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(n % 16 == 0 && so >= n && sb >= n, "head product: n {n}");
    assert!(out.len() >= (m - 1) * so + n, "head product: out");
    assert!(k == 0 || b.len() >= (k - 1) * sb + n, "head product: b");
    assert!(
        k == 0 || lhs.a.len() > (m - 1) * lhs.rs + (k - 1) * lhs.cs,
        "head product: a"
    );
    let (o, a, bp) = (
        out.as_mut_ptr(),
        (lhs.a.as_ptr(), lhs.rs, lhs.cs),
        (b.as_ptr(), sb),
    );
    let mut i0 = 0;
    while i0 < m {
        let r = (m - i0).min(TILE_ROWS);
        let ps = (if lower_t { i0.min(k) } else { 0 }, k);
        let cols = if causal_cols {
            (i0 + r).div_ceil(16).saturating_mul(16).min(n)
        } else {
            n
        };
        let mut j0 = 0;
        while j0 < cols {
            let two = cols - j0 >= 32;
            macro_rules! run {
                ($($r:literal)*) => {
                    match (r, two) {
                        $(($r, true) => tile::<$r, 2>(o, so, a, bp, i0, j0, ps),
                          ($r, false) => tile::<$r, 1>(o, so, a, bp, i0, j0, ps),)*
                        _ => unreachable!(),
                    }
                };
            }
            run!(1 2 3 4 5 6);
            j0 += if two { 32 } else { 16 };
        }
        i0 += r;
    }
}

/// `dst (cols, rows)`, rows `rows` apart, = the transpose of `src (rows, cols)` whose rows
/// are `ss` apart (a per-head `k^T` or `v^T`).
pub fn transpose(dst: &mut [f32], src: &[f32], ss: usize, (rows, cols): (usize, usize)) {
    for (i, row) in src.chunks(ss).take(rows).enumerate() {
        for (j, &v) in row[..cols].iter().enumerate() {
            dst[j * rows + i] = v;
        }
    }
}
