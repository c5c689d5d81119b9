//! Scalar reference math: the one-value functions that the CPU loops apply elementwise and
//! the CUDA kernels of `nn.cu` reproduce (`relu_*`, `gelu_*`), with the fast `exp` and
//! `erf` they are built from. Plain `f32 -> f32` functions, inline so the loops over tensors
//! vectorize; `nn`'s activations re-export them.

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

/// ReLU of one value, `max(x, 0)` (the CPU reference of `relu_fwd_f32`).
#[inline]
pub fn relu(x: f32) -> f32 {
    x.max(0.0)
}

/// d ReLU / dx: 1 for `x > 0`, else 0.
#[inline]
pub fn relu_grad(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else {
        0.0
    }
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1 / sqrt(2 pi)
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// erf(x) to within 1.5e-7 absolute in exact arithmetic, 6e-7 in f32 (Abramowitz & Stegun 7.1.26): a polynomial and one
/// exp, so the loop over a tensor vectorizes (libm's erff does not, and was 13% of a CPU
/// training step in a profile).
#[inline]
pub fn erf(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_7,
        -1.453_152_1,
        1.061_405_4,
    ];
    let ax = x.abs();
    let t = 1.0 / (1.0 + P * ax);
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    let y = 1.0 - poly * exp(-ax * ax);
    y.copysign(x)
}

/// GELU of one value (the CPU reference of the `gelu_f32` kernel).
#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// d GELU / dx = Phi(x) + x * phi(x).
#[inline]
pub fn gelu_grad(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
    let pdf = INV_SQRT_2PI * exp(-0.5 * x * x);
    cdf + x * pdf
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
    fn fast_erf_matches_libm() {
        let worst = (-4000..=4000)
            .map(|i| i as f32 / 1000.0)
            .map(|x| (erf(x) - libm::erff(x)).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-6, "max |erf - libm erff| = {worst}");
    }
}
