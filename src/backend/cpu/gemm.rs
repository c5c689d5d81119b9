//! Row-major f32 matrix multiply on the CPU, through the `gemm` crate.
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

/// `out (m, n) (=|+=) op(a) @ op(b)` with f32 accumulation.
///
/// # Errors
/// `ShapeMismatch` when a slice length disagrees with `(m, k, n)`.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
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
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return Ok(());
    }
    // Strides in elements: (row stride, column stride) of each operand as used.
    let (a_rs, a_cs) = if t.a {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (b_rs, b_cs) = if t.b {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    let threads = num_threads();
    // Below ~2 MFLOP the rayon hand-off costs more than it saves (measured on 2 cores).
    let parallelism = if threads > 1 && m * n * k >= 1 << 20 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the lengths were checked above against (m, k, n) and the strides describe
    // row-major (m, n), (m, k)/(k, m) and (k, n)/(n, k) layouts inside those lengths; `out`
    // is a unique borrow that overlaps neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
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
