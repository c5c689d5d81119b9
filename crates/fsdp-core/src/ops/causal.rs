//! Causal attention's per-head products without the masked half: the score products
//! compute only the blocks of rows at or left of the diagonal, and the products with the
//! causal probabilities (or their gradient, both 0 above the diagonal) skip the zero terms.
//!
//! | [`CausalProduct`] | per head (`B H` of them) | as [`matmul_batched`](super::matmul_batched) |
//! |---|---|---|
//! | `Scores` | `out (T, T) = a (T, hd) @ b (T, hd)^T`, on and below the diagonal | `NT` |
//! | `Lower` | `out (T, hd) = a (T, T) @ b (T, hd)`, `a` 0 above the diagonal | `NN` |
//! | `LowerT` | `out (T, hd) = a^T @ b`, `a (T, T)` 0 above the diagonal | `TN` |
//!
//! # [Note: causal products, same bits]
//! The CPU splits each head's `T` rows into blocks of [`BLOCK`] rows (starting at multiples
//! of [`BLOCK`]; the last block takes the rest) and runs one GEMM per block on the part that
//! can be non-zero: `Scores` rows `R = r0..r1` against key rows `0..r1` (the columns right of
//! `r1` are not written: the causal softmax and its backward never read them); `Lower` rows
//! `R` summing `j < r1` only (`a[i][j] = 0` for `j > i`); `LowerT` rows `R` summing
//! `i >= r0` only. Every output element is the same chain of fused multiply-adds, in the
//! same order, as the full product: the `gemm` crate sums `k` in order in one block when
//! `k <= 512`, and dropping exact zero terms from the end (or, from a zero accumulator,
//! from the start) of a chain leaves its value unchanged. So losses keep their bits
//! (tests below compare with the full products bit for bit). Shapes outside that
//! argument (`T > 512`, fewer than two blocks, or `hd < 16`, where the `gemm` crate takes
//! other paths for small products) and CUDA run the full product.
//!
//! With `T = 128` and blocks of 32 rows the products compute 62.5% of the full ones, but
//! only `LowerT` (the backward's `dV = P^T dY` and `dK = dS^T Q`) runs blocked: measured,
//! the others lose more to the `gemm` crate's fixed cost per call than they save (see
//! `pays`).

use super::{check_f32, lowp, same_device, MatmulDims, Transpose};
use crate::backend::cpu::gemm::{self, Strides};
use crate::backend::cpu::kernels::HeadDims;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{bail_arg, Error, Result};
use crate::tensor::Tensor;

/// Rows of a block of the blocked CPU products
/// ([`crate::backend::cpu::kernels::CAUSAL_BLOCK`], where the per-head CPU attention reads it).
pub use crate::backend::cpu::kernels::CAUSAL_BLOCK as BLOCK;

/// Which causal product [`causal_matmul`] computes (the table in the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CausalProduct {
    /// `a @ b^T`, `(T, hd) x (T, hd) -> (T, T)`, valid on and below the diagonal.
    Scores,
    /// `a @ b`, `(T, T) x (T, hd) -> (T, hd)`, `a` lower triangular.
    Lower,
    /// `a^T @ b`, `(T, T) x (T, hd) -> (T, hd)`, `a` lower triangular.
    LowerT,
}

impl CausalProduct {
    /// The same product as a full per-head GEMM.
    fn dims(self, t: usize, hd: usize) -> MatmulDims {
        match self {
            CausalProduct::Scores => MatmulDims::new(t, hd, t, Transpose::NT),
            CausalProduct::Lower => MatmulDims::new(t, t, hd, Transpose::NN),
            CausalProduct::LowerT => MatmulDims::new(t, t, hd, Transpose::TN),
        }
    }
}

/// Whether the blocked CPU product beats the full one: only `LowerT`. One thread, 256
/// heads of `T = 128, hd = 32` (2026-12-01, Zen 5, `examples/causal_bench.rs`): `LowerT`
/// 2.17 ms full, 1.42 ms blocked (`T = 256`: 5.05 -> 2.59 ms), the full product's transposed
/// operand being the slow part; `Scores` 1.55 -> 1.95 ms and `Lower` 1.43 -> 1.96 ms: each
/// `gemm` call costs ~2 us of fixed work, more than the skipped third of the flops saves at
/// these sizes (blocks of 64 rows: about even).
fn pays(which: CausalProduct) -> bool {
    which == CausalProduct::LowerT
}

/// Whether the blocked CPU products give the full products' bits for these sizes
/// ([Note: causal products, same bits]).
fn blocked(t: usize, hd: usize) -> bool {
    (2 * BLOCK..=512).contains(&t) && hd >= 16
}

/// The row blocks of `0..t`: starts at multiples of [`BLOCK`], the last one to `t`.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = (t / BLOCK).max(1);
    (0..n).map(move |i| (i * BLOCK, if i + 1 == n { t } else { (i + 1) * BLOCK }))
}

/// One head's causal product `which` into `out` (see the module docs), by row blocks.
fn head_product(
    which: CausalProduct,
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    t: usize,
    hd: usize,
) -> Result<()> {
    for (r0, r1) in blocks(t) {
        let rb = r1 - r0;
        match which {
            // out[r0..r1, 0..r1] = a[r0..r1] @ b[0..r1]^T
            CausalProduct::Scores => gemm::matmul_strided(
                &mut out[r0 * t..],
                &a[r0 * hd..r1 * hd],
                &b[..r1 * hd],
                (rb, hd, r1),
                Transpose::NT,
                Strides {
                    out: t,
                    a: hd,
                    b: hd,
                },
                false,
            )?,
            // out[r0..r1] = a[r0..r1, 0..r1] @ b[0..r1]
            CausalProduct::Lower => gemm::matmul_strided(
                &mut out[r0 * hd..r1 * hd],
                &a[r0 * t..],
                &b[..r1 * hd],
                (rb, r1, hd),
                Transpose::NN,
                Strides {
                    out: hd,
                    a: t,
                    b: hd,
                },
                false,
            )?,
            // out[r0..r1] = a[r0..t, r0..r1]^T @ b[r0..t]
            CausalProduct::LowerT => gemm::matmul_strided(
                &mut out[r0 * hd..r1 * hd],
                &a[r0 * t + r0..],
                &b[r0 * hd..t * hd],
                (rb, t - r0, hd),
                Transpose::TN,
                Strides {
                    out: hd,
                    a: t,
                    b: hd,
                },
                false,
            )?,
        }
    }
    Ok(())
}

/// The causal product `which` for every head of `d` (`B H` products; `out =`). For
/// `Scores` the entries above the diagonal are unspecified (the causal softmax ignores
/// them); `Lower`/`LowerT` need `a` to be 0 above the diagonal (causal probabilities and
/// their gradients are). CPU: blocked products with the full products' bits ([Note: causal
/// products, same bits]); CUDA: the full batched GEMM.
///
/// # Errors
/// `ShapeMismatch` when a tensor's element count disagrees with `d`; as
/// [`matmul_batched`](super::matmul_batched).
pub fn causal_matmul(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    which: CausalProduct,
    d: HeadDims,
) -> Result<()> {
    let device = same_device("causal_matmul", &[out, a, b])?;
    if super::lowp::lp_of(&[out, a, b]).is_some() {
        // f32 products of the widened operands, rounded once into `out`.
        let (a32, b32) = (lowp::up(a)?, lowp::up(b)?);
        return lowp::into(out, false, |o32| {
            // The operands already hold their low-precision values: no second rounding.
            let _f32 = super::autocast(None);
            causal_matmul_native(o32, &a32, &b32, which, d, device)
        });
    }
    if super::double::any_f64(&[out, a, b]) {
        // f64: the full per-head products (the masked half of a causal operand is 0).
        let dims = which.dims(d.t, d.hd);
        return super::matmul_batched(out, a, b, dims, d.b * d.h, false);
    }
    causal_matmul_native(out, a, b, which, d, device)
}

/// [`causal_matmul`] of f32 tensors, checked: the full batched GEMM on CUDA (and where the
/// blocked product does not pay), else the blocked host products.
fn causal_matmul_native(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    which: CausalProduct,
    d: HeadDims,
    device: Device,
) -> Result<()> {
    let (t, hd, bh) = (d.t, d.hd, d.b * d.h);
    let dims = which.dims(t, hd);
    check_f32("causal_matmul", &[out, a, b])?;
    if device.is_cuda() || !pays(which) || !blocked(t, hd) {
        return super::matmul_batched(out, a, b, dims, bh, false);
    }
    let (a_len, out_len) = match which {
        CausalProduct::Scores => (t * hd, t * t),
        CausalProduct::Lower | CausalProduct::LowerT => (t * t, t * hd),
    };
    for (x, want) in [(a, a_len), (b, t * hd), (out, out_len)] {
        if x.numel() != want * bh {
            return Err(Error::ShapeMismatch {
                op: "causal_matmul",
                expected: vec![bh, want],
                got: x.shape().to_vec(),
            });
        }
    }
    if out.shares_storage(a) || out.shares_storage(b) {
        bail_arg!("causal_matmul: the output {out:?} shares storage with an input");
    }
    let (a, b) = (
        super::linalg::cpu_operand(a)?,
        super::linalg::cpu_operand(b)?,
    );
    let (mut o, av, bv) = (out.f32_mut()?, a.f32()?, b.f32()?);
    let (avs, bvs): (&[f32], &[f32]) = (&av, &bv);
    let b_len = t * hd;
    // Heads are independent: parts own whole heads ([Note: determinism across thread
    // counts]).
    par::rows_mut(&mut o, bh, out_len, 1, |r, o| {
        for (j, i) in r.enumerate() {
            head_product(
                which,
                &mut o[j * out_len..(j + 1) * out_len],
                &avs[i * a_len..(i + 1) * a_len],
                &bvs[i * b_len..(i + 1) * b_len],
                t,
                hd,
            )?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::matmul_batched;

    fn filled(shape: &[usize], seed: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.7548 + seed).sin() * 3.7).fract())
            .collect();
        Tensor::from_vec(v, shape).unwrap()
    }

    /// Zeroes what lies above the diagonal of each `(t, t)` block.
    fn lower(x: &Tensor, t: usize) -> Tensor {
        let mut v = x.f32().unwrap().to_vec();
        for (i, e) in v.iter_mut().enumerate() {
            let (row, col) = ((i / t) % t, i % t);
            if col > row {
                *e = 0.0;
            }
        }
        Tensor::from_vec(v, x.shape()).unwrap()
    }

    #[test]
    fn blocked_products_equal_the_full_ones_bit_for_bit() {
        for (t, hd) in [
            (64, 16),
            (100, 32),
            (128, 32),
            (130, 24),
            (256, 64),
            (512, 16),
        ] {
            let d = HeadDims { b: 2, t, h: 3, hd };
            let bh = d.b * d.h;
            assert!(blocked(t, hd));
            let q = filled(&[bh, t, hd], 0.3);
            let k = filled(&[bh, t, hd], 1.1);
            let p = lower(&filled(&[bh, t, t], 2.9), t);
            for threads in [1, 2, 3] {
                par::with_num_threads(threads, || {
                    for which in [
                        CausalProduct::Scores,
                        CausalProduct::Lower,
                        CausalProduct::LowerT,
                    ] {
                        let (a, shape) = match which {
                            CausalProduct::Scores => (&q, [bh, t, t]),
                            _ => (&p, [bh, t, hd]),
                        };
                        let want = Tensor::zeros(&shape, crate::tensor::DType::F32);
                        matmul_batched(&want, a, &k, which.dims(t, hd), bh, false).unwrap();
                        let got = filled(&shape, 7.0);
                        causal_matmul(&got, a, &k, which, d).unwrap();
                        // Every blocked product, also those `causal_matmul` runs full.
                        let blocked_out = filled(&shape, 5.0);
                        {
                            let (mut o, av, kv) = (
                                blocked_out.f32_mut().unwrap(),
                                a.f32().unwrap(),
                                k.f32().unwrap(),
                            );
                            let (on, an) = (o.len() / bh, av.len() / bh);
                            for i in 0..bh {
                                head_product(
                                    which,
                                    &mut o[i * on..(i + 1) * on],
                                    &av[i * an..(i + 1) * an],
                                    &kv[i * t * hd..(i + 1) * t * hd],
                                    t,
                                    hd,
                                )
                                .unwrap();
                            }
                        }
                        let w = want.f32().unwrap();
                        for (i, (w, g)) in
                            w.iter().zip(blocked_out.f32().unwrap().iter()).enumerate()
                        {
                            let (row, col) = ((i / shape[2]) % t, i % shape[2]);
                            if which == CausalProduct::Scores && col > row {
                                continue;
                            }
                            assert_eq!(
                                w.to_bits(),
                                g.to_bits(),
                                "blocked {which:?} t {t} hd {hd} at {i}"
                            );
                        }
                        let g = got.f32().unwrap();
                        for (i, (w, g)) in w.iter().zip(g.iter()).enumerate() {
                            let (row, col) = ((i / shape[2]) % t, i % shape[2]);
                            if which == CausalProduct::Scores && col > row {
                                continue; // unspecified above the diagonal
                            }
                            assert_eq!(
                                w.to_bits(),
                                g.to_bits(),
                                "{which:?} t {t} hd {hd} threads {threads} at {i}: {w} vs {g}"
                            );
                        }
                    }
                });
            }
        }
    }

    #[test]
    fn blocks_cover_the_rows() {
        for t in [64, 65, 95, 96, 128, 511] {
            let b: Vec<_> = blocks(t).collect();
            assert_eq!(b[0].0, 0);
            assert_eq!(b.last().unwrap().1, t);
            assert!(b.windows(2).all(|w| w[0].1 == w[1].0));
            assert!(b
                .iter()
                .all(|&(r0, r1)| r0 % BLOCK == 0 && r1 - r0 >= BLOCK));
        }
    }
}
