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
        DType::F64 => cast_slice(&src.data::<f64>()?, dst),
        DType::I64 => cast_slice(&src.data::<i64>()?, dst),
    }
    Ok(())
}

/// `dst[i] = cast(src[i])` through f32, or through f64 when either side is 64-bit (so an
/// f64 or i64 value is rounded once, and an f32 widens exactly).
pub fn cast_slice<S: Element, T: Element>(src: &[S], dst: &mut [T]) {
    if S::DTYPE == T::DTYPE {
        dst.copy_from_slice(bytemuck::cast_slice(src));
        return;
    }
    // bf16 <-> f32, the mixed-precision casts: vectorized, the same bits (`bf16.rs`).
    match (S::DTYPE, T::DTYPE) {
        (DType::F32, DType::BF16) => {
            return super::bf16::from_f32_slice(
                bytemuck::cast_slice(src),
                bytemuck::cast_slice_mut(dst),
            );
        }
        (DType::BF16, DType::F32) => {
            return super::bf16::to_f32_slice(
                bytemuck::cast_slice(src),
                bytemuck::cast_slice_mut(dst),
            );
        }
        _ => {}
    }
    if S::DTYPE.size_in_bytes() == 8 || T::DTYPE.size_in_bytes() == 8 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f64(s.to_f64());
        }
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(s.to_f32());
    }
}

pub use super::scalar::exp;

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
