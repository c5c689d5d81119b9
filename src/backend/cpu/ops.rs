//! Elementwise CPU reference ops: casts, scaled accumulation, reductions.
//!
//! These are the oracles the CUDA kernels in `kernels/` are tested against (`cast.cu`,
//! `reduce_scatter.cu`), so they are written as the plain loops the kernels must reproduce.

use super::simd::multiversion;
use crate::error::Result;
use crate::tensor::{DType, Element, Tensor};

/// `dst = cast(src)` elementwise with round-to-nearest-even when narrowing (`cast_{a}_{b}`
/// kernels). Lengths must match (checked by the caller, [`Tensor::copy_from`]).
pub fn cast_into<T: Element>(src: &Tensor, dst: &mut [T]) -> Result<()> {
    match src.dtype() {
        DType::F32 => cast_slice(&src.data::<f32>()?, dst),
        DType::BF16 => cast_slice(&src.data::<half::bf16>()?, dst),
        DType::F16 => cast_slice(&src.data::<half::f16>()?, dst),
        DType::I32 => {
            let s = src.data::<i32>()?;
            if T::DTYPE == DType::I32 {
                dst.copy_from_slice(bytemuck::cast_slice(&s));
            } else {
                cast_slice(&s, dst);
            }
        }
    }
    Ok(())
}

/// `dst[i] = cast(src[i])` through f32.
pub fn cast_slice<S: Element, T: Element>(src: &[S], dst: &mut [T]) {
    if S::DTYPE == T::DTYPE {
        dst.copy_from_slice(bytemuck::cast_slice(src));
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(s.to_f32());
    }
}

/// `e^x` to within 2 ulp for x in [-87, 88] (clamped outside), as Cephes' `expf`:
/// `x = n ln2 + r`, a degree-6 polynomial for `e^r`, `2^n` from the exponent bits. Inline
/// and branch-free so loops over tensors vectorize (glibc's `expf` is a call per element and
/// was 9% of a CPU training step).
#[inline]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Round x / ln2 to the nearest integer n with the 1.5 * 2^23 trick: the sum's low
    // mantissa bits are n. Plain float ops and a bitcast, so the loop vectorizes (floor()
    // is a libm call and `as i32` a saturating scalar sequence on baseline x86-64).
    const MAGIC: f32 = 12_582_912.0;
    #[allow(clippy::manual_clamp)] // max/min: two SIMD ops, no NaN branch
    let x = x.max(-87.3).min(88.3);
    let z = x * LOG2E + MAGIC;
    let n = z - MAGIC;
    let k = z.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let r = x - n * C1 - n * C2;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    y * f32::from_bits((k.wrapping_add(127) as u32) << 23)
}

multiversion! {
    /// `dst[i] = dst[i] * alpha` in place.
    pub fn scale_(dst: &mut [f32], alpha: f32) {
        if alpha != 1.0 {
            dst.iter_mut().for_each(|v| *v *= alpha);
        }
    }
}

multiversion! {
    /// `dst[i] += src[i]`.
    pub fn add_(dst: &mut [f32], src: &[f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d += s;
        }
    }
}

multiversion! {
    /// `acc[i] += a[i] * b[i]` (a product then a sum, each rounded: no fused multiply-add).
    pub fn add_mul_(acc: &mut [f32], a: &[f32], b: &[f32]) {
        for ((d, &x), &y) in acc.iter_mut().zip(a).zip(b) {
            *d += x * y;
        }
    }
}

multiversion! {
    /// `out[i] = a[i] + b[i]`.
    pub fn add_into(out: &mut [f32], a: &[f32], b: &[f32]) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = x + y;
        }
    }
}

/// Sum of squares, accumulated in f64 so the global gradient norm does not depend on how
/// the vector was split across ranks beyond the final rounding.
pub fn sum_squares(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64) * (v as f64)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_std() {
        let mut worst = 0.0f32;
        for i in -87_000..=88_000 {
            let x = i as f32 / 1000.0;
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs() / f32::EPSILON);
        }
        assert!(worst <= 2.0, "worst relative error {worst} ulp");
    }

    #[test]
    fn casts_round_to_nearest_even() {
        let src = Tensor::from_vec(
            vec![1.0f32, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.5],
            &[4],
        )
        .unwrap();
        let bf = src.to_dtype(DType::BF16).unwrap();
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa wins (1.0).
        // 1 + 3 * 2^-8 is a tie between 1 + 2^-7 and 1 + 2^-6: even mantissa (1 + 2^-6).
        assert_eq!(
            bf.to_vec_f32().unwrap(),
            vec![1.0, 1.0, 1.0 + 4.0 / 256.0, -2.5]
        );
        let back = bf.to_dtype(DType::F32).unwrap();
        assert_eq!(back.to_vec_f32().unwrap(), vec![1.0, 1.0, 1.015625, -2.5]);
    }
}
