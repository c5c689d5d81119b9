//! Row-major f32 and f64 matrix multiply on the CPU, through the `gemm` crate (its f32
//! and f64 kernels; [`GemmScalar`] names the two).
//!
//! `out (m, n) = [out +] op(a) @ op(b)` where `op(a)` is `a (m, k)` or, transposed, the
//! stored `a (k, m)`; likewise `op(b)` is `b (k, n)` or the stored `b (n, k)`. Transposes
//! are expressed as strides: nothing is copied.

/// The calling thread's CPU budget, which GEMMs obey too (see [`super::parallel`]).
pub use super::parallel::{num_threads, set_num_threads};
use crate::error::{Error, Result};

/// Which operand is transposed, as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transpose {
    /// `a` is stored `(k, m)`.
    pub a: bool,
    /// `b` is stored `(n, k)`.
    pub b: bool,
}

impl Transpose {
    /// `a @ b`.
    pub const NN: Transpose = Transpose { a: false, b: false };
    /// `a @ b^T`.
    pub const NT: Transpose = Transpose { a: false, b: true };
    /// `a^T @ b`.
    pub const TN: Transpose = Transpose { a: true, b: false };
}

/// An element type the `gemm` crate multiplies natively: f32 or f64, accumulated in the
/// same type.
pub trait GemmScalar: Copy + Send + Sync + 'static {
    /// Additive identity (an empty sum).
    const ZERO: Self;
    /// Multiplicative identity (the scale of both the old output and the product).
    const ONE: Self;
}

impl GemmScalar for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl GemmScalar for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// `out (m, n) (=|+=) op(a) @ op(b)`, accumulated in `T` (f32 or f64).
///
/// # Errors
/// `ShapeMismatch` when a slice length disagrees with `(m, k, n)`.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: GemmScalar>(
    out: &mut [T],
    a: &[T],
    b: &[T],
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
    accumulate: bool,
) -> Result<()> {
    for (name, len, want) in [
        ("out", out.len(), m * n),
        ("a", a.len(), m * k),
        ("b", b.len(), k * n),
    ] {
        if len != want {
            return Err(Error::ShapeMismatch {
                op: match name {
                    "out" => "matmul(out)",
                    "a" => "matmul(a)",
                    _ => "matmul(b)",
                },
                expected: vec![want],
                got: vec![len],
            });
        }
    }
    let s = Strides {
        out: n,
        a: if t.a { m } else { k },
        b: if t.b { k } else { n },
    };
    matmul_strided(out, a, b, (m, k, n), t, s, accumulate)
}

/// `batch` independent products over consecutive `(m, k)`, `(k, n)` and `(m, n)` blocks of
/// `a`, `b` and `out`, each one [`matmul`] (`(m, k, n)` = `mkn`): the host loop of
/// `ops::matmul_batched` for f32 and for f64 (`ops::double`). Parts of the thread budget
/// own whole products, so the result does not depend on the thread count.
///
/// # Errors
/// As [`matmul`], for any block.
pub(crate) fn matmul_batched<T: GemmScalar>(
    out: &mut [T],
    a: &[T],
    b: &[T],
    [m, k, n]: [usize; 3],
    t: Transpose,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    if batch == 1 {
        return matmul(out, a, b, m, k, n, t, accumulate);
    }
    let (mk, kn, mn) = (m * k, k * n, m * n);
    // Products are independent: parts own whole products, each one GEMM as without threads
    // (the gemm crate's result does not depend on its thread count).
    super::parallel::rows_mut(out, batch, mn, 1, |r, o| {
        for (j, i) in r.enumerate() {
            matmul(
                &mut o[j * mn..(j + 1) * mn],
                &a[i * mk..(i + 1) * mk],
                &b[i * kn..(i + 1) * kn],
                m,
                k,
                n,
                t,
                accumulate,
            )?;
        }
        Ok(())
    })
}

/// Row strides (elements) of the operands of [`matmul_strided`], as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Between rows of `out`.
    pub out: usize,
    /// Between stored rows of `a` (`(m, k)`, or `(k, m)` when transposed).
    pub a: usize,
    /// Between stored rows of `b` (`(k, n)`, or `(n, k)` when transposed).
    pub b: usize,
}

/// As [`matmul`] on sub-matrices of row-major arrays: row `i` of `out (m, n)` starts at
/// `out[i * s.out]`, stored row `r` of `a` at `a[r * s.a]`, of `b` at `b[r * s.b]`. Each
/// element is the same sum, in the same order, as [`matmul`] of the same operands
/// (the `gemm` crate sums `k` in order in one block for `k <= 512`).
///
/// # Errors
/// `ShapeMismatch` when a slice is too short for its rows or a stride is shorter than a
/// row.
pub fn matmul_strided<T: GemmScalar>(
    out: &mut [T],
    a: &[T],
    b: &[T],
    (m, k, n): (usize, usize, usize),
    t: Transpose,
    s: Strides,
    accumulate: bool,
) -> Result<()> {
    // (stored rows, stored columns, stride, length) of each operand.
    let (a_rows, a_cols) = if t.a { (k, m) } else { (m, k) };
    let (b_rows, b_cols) = if t.b { (n, k) } else { (k, n) };
    for (op, rows, cols, stride, len) in [
        ("matmul(out)", m, n, s.out, out.len()),
        ("matmul(a)", a_rows, a_cols, s.a, a.len()),
        ("matmul(b)", b_rows, b_cols, s.b, b.len()),
    ] {
        let need = if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * stride + cols
        };
        if len < need || (rows > 1 && stride < cols) {
            return Err(Error::ShapeMismatch {
                op,
                expected: vec![rows, cols, stride],
                got: vec![len],
            });
        }
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            out.chunks_mut(s.out.max(1))
                .take(m)
                .for_each(|row| row[..n].fill(T::ZERO));
        }
        return Ok(());
    }
    // Strides in elements: (row stride, column stride) of each operand as used.
    let (a_rs, a_cs) = if t.a {
        (1, s.a as isize)
    } else {
        (s.a as isize, 1)
    };
    let (b_rs, b_cs) = if t.b {
        (1, s.b as isize)
    } else {
        (s.b as isize, 1)
    };
    let threads = num_threads();
    // Below ~2 MFLOP the rayon hand-off costs more than it saves (measured on 2 cores).
    let parallelism = if threads > 1 && m * n * k >= 1 << 20 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the lengths were checked above: every element the strides reach, row
    // `rows - 1` column `cols - 1` at most, lies inside its slice; `out` is a unique borrow
    // that overlaps neither input, and its rows (stride >= n) do not overlap each other.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            s.out as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            T::ONE,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize, t: Transpose) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let av = if t.a { a[p * m + i] } else { a[i * k + p] };
                    let bv = if t.b { b[j * k + p] } else { b[p * n + j] };
                    s += av * bv;
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    #[test]
    fn matches_naive_in_every_layout() {
        let (m, k, n) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for t in [
            Transpose::NN,
            Transpose::NT,
            Transpose::TN,
            Transpose { a: true, b: true },
        ] {
            let want = naive(&a, &b, m, k, n, t);
            let mut out = vec![1.0; m * n];
            matmul(&mut out, &a, &b, m, k, n, t, false).unwrap();
            for (g, w) in out.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{t:?}: {g} vs {w}");
            }
            matmul(&mut out, &a, &b, m, k, n, t, true).unwrap();
            for (g, w) in out.iter().zip(&want) {
                assert!(
                    (g - 2.0 * w).abs() < 1e-5,
                    "{t:?} accumulate: {g} vs {}",
                    2.0 * w
                );
            }
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut out = vec![0.0; 4];
        assert!(matmul(
            &mut out,
            &[0.0; 3],
            &[0.0; 4],
            2,
            2,
            2,
            Transpose::NN,
            false
        )
        .is_err());
    }
}
