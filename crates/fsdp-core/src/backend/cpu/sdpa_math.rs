//! The scalar pieces that fix the bits of PyTorch's CPU flash attention for bf16/f16
//! (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`, PyTorch 2.11 on an AVX-512 CPU):
//! its block sizes, its score scale, its two exponentials and its two lane reductions, each
//! as plain f32 operations in the order its vector code runs them, so that
//! [`super::sdpa`] (and `kernels/sdpa.cu`, which spells the same steps in C++) compute
//! PyTorch's values exactly.
//!
//! - [`fexp_u20`]: `_mm512_fexp_u20_ps` (Malossi et al.'s exponent-bits trick with a cubic
//!   correction), the exponential of the forward's vector loop (`exp_u20`);
//! - [`sleef_expf_u10`]: SLEEF's `expf` (`Sleef_expf16_u10`), `Vectorized<float>::exp`,
//!   which the backward uses to rebuild the probabilities;
//! - [`tree16`]: `vec_reduce_all` of a 16-lane sum (halves, then quarters, ...);
//! - [`dot_rows`]: `map2_reduce_all` of `dout * out` over a row of a reduced-precision
//!   dtype (32 elements a step in two 16-lane accumulators).
//!
//! Everything is `mul`/`add` or an explicit `mul_add` where the vector code has an FMA:
//! the results do not depend on the machine running them.

// Index loops spell PyTorch's (and sdpa.cu's) loops one to one.
#![allow(clippy::needless_range_loop)]

/// Query rows per block of PyTorch's kernel for a sequence of `t` queries (its
/// `q_split_size`: 32 below 192 queries, 64 below 768, 256 from there; at most `t`).
pub fn q_split(t: usize) -> usize {
    let s = if t >= 768 {
        256
    } else if t >= 192 {
        64
    } else {
        32
    };
    s.min(t).max(1)
}

/// Keys per block of PyTorch's kernel (its `kv_split_size`, 512; at most `t`).
pub fn kv_split(t: usize) -> usize {
    512.min(t).max(1)
}

/// The score scale `1 / sqrt(hd)` as PyTorch computes it (`sdp::calculate_scale`: in f64,
/// then rounded to f32).
pub fn scale(hd: usize) -> f32 {
    (1.0 / (hd as f64).sqrt()) as f32
}

/// Widest head `kernels/sdpa.cu` takes (its per-thread accumulators, `SDPA_MAX_HD`).
pub const CUDA_MAX_HD: usize = 256;

/// The lanes of one vector of f32 (AVX-512).
pub const LANES: usize = 16;

const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
const LN_FLT_MIN: f32 = f32::from_bits(0xc2ae_ac50);
const LN_FLT_MAX: f32 = f32::from_bits(0x42b1_7218);

/// `exp(x)` as `_mm512_fexp_u20_ps` computes it: `s = x log2(e)`, the fraction
/// `f = s - floor(s)`, `s - (c0 + f (c1 + f (c2 + f c3)))` written into the exponent bits
/// (`trunc(2^23 s' + 127 2^23)`); 0 below `ln(FLT_MIN)`, infinity above `ln(FLT_MAX)`.
/// Relative error up to about 1e-4 (measured on `[-80, 0]`).
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn fexp_u20(x: f32) -> f32 {
    // The source's literals: c0 and c1 are float literals, c2 and c3 doubles rounded to f32.
    const C0: f32 = 0.000_107_034_349_484_582_72;
    const C1: f32 = 0.303_542_605_006_496_82;
    const C2: f32 = -0.224_338_364_786_723_56_f64 as f32;
    const C3: f32 = -0.079_204_240_219_773_236_f64 as f32;
    const A: f32 = 8_388_608.0; // 2^23
    const B: f32 = 1_065_353_216.0; // 2^23 * 127
    let s = x * LOG2E;
    let f = s - s.floor();
    let mut r = f.mul_add(C3, C2);
    r = f.mul_add(r, C1);
    r = f.mul_add(r, C0);
    // In range, A (s - r) + B lies in (0, 2^31): the truncation is the hardware's.
    let bits = A.mul_add(s - r, B) as i32;
    if x < LN_FLT_MIN {
        0.0
    } else if x > LN_FLT_MAX {
        f32::INFINITY
    } else {
        f32::from_bits(bits as u32)
    }
}

/// `2^q` for `q` in the normal range, built from its exponent bits (SLEEF's `vpow2i`).
#[inline(always)]
fn pow2i(q: i32) -> f32 {
    f32::from_bits((q.wrapping_add(0x7f) as u32).wrapping_shl(23))
}

/// `exp(d)` as SLEEF's `expf` (`xexpf`, 1-ulp) computes it with FMA: `q = rint(d / ln 2)`,
/// `s = d - q ln2_hi - q ln2_lo`, a degree-6 polynomial, `u 2^(q/2) 2^(q - q/2)`; 0 below
/// -104, infinity above 1e38.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn sleef_expf_u10(d: f32) -> f32 {
    const R_LN2: f32 = std::f32::consts::LOG2_E;
    const L2U: f32 = 0.693_145_751_953_125;
    const L2L: f32 = 1.428_606_765_330_187_045e-6;
    let qf = (d * R_LN2).round_ties_even();
    let q = qf as i32;
    let mut s = qf.mul_add(-L2U, d);
    s = qf.mul_add(-L2L, s);
    let mut u = 0.000_198_527_617_612_853_646_278_381_f32;
    u = u.mul_add(s, 0.001_393_043_552_525_341_510_772_71);
    u = u.mul_add(s, 0.008_333_360_776_305_198_669_433_59);
    u = u.mul_add(s, 0.041_666_485_369_205_474_853_515_6);
    u = u.mul_add(s, 0.166_666_671_633_720_397_949_219);
    u = u.mul_add(s, 0.5);
    u = 1.0 + (s * s).mul_add(u, s);
    let h = q >> 1;
    u = u * pow2i(h) * pow2i(q.wrapping_sub(h));
    if d < -104.0 {
        0.0
    } else if d > 1e38 {
        f32::INFINITY
    } else {
        u
    }
}

/// `vec_reduce_all` of a 16-lane sum: lanes `i` and `i ^ 8` added, then `i ^ 4`, `i ^ 2`,
/// `i ^ 1`; lane 0's value.
#[inline]
pub fn tree16(mut v: [f32; LANES]) -> f32 {
    for sh in [8, 4, 2, 1] {
        let w = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = w[i] + w[i ^ sh];
        }
    }
    v[0]
}

/// The 16-lane sum of `v[..n]` added in lane order (the `vec_reduce_all` of a partial
/// vector: lane 0, then + lane 1, ...).
#[inline]
fn seq_lanes(v: &[f32; LANES], n: usize) -> f32 {
    v[1..n.max(1)].iter().fold(v[0], |a, &x| a + x)
}

/// `sum_i a[i] b[i]` as `vec::map2_reduce_all<bf16 or f16>(x * y, x + y)` adds it: products
/// rounded to f32; rows of 32 or more in two 16-lane accumulators (elements `32 s + i` and
/// `32 s + 16 + i`), the tail masked into them, the two added and reduced by [`tree16`];
/// shorter rows as one or two partial vectors reduced lane by lane in order.
pub fn dot_rows(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let p = |i: usize| a[i] * b[i];
    let mut lo = [0.0f32; LANES];
    let mut hi = [0.0f32; LANES];
    if n < 2 * LANES {
        for (i, x) in lo.iter_mut().enumerate().take(n.min(LANES)) {
            *x = p(i);
        }
        if n > LANES {
            for i in 0..n - LANES {
                lo[i] += p(LANES + i);
            }
            return seq_lanes(&lo, LANES);
        }
        return seq_lanes(&lo, n);
    }
    for i in 0..LANES {
        lo[i] = p(i);
        hi[i] = p(LANES + i);
    }
    let full = n - n % (2 * LANES);
    let mut d = 2 * LANES;
    while d < full {
        for i in 0..LANES {
            lo[i] += p(d + i);
            hi[i] += p(d + LANES + i);
        }
        d += 2 * LANES;
    }
    let rest = n - d;
    for i in 0..rest.min(LANES) {
        lo[i] += p(d + i);
    }
    for i in 0..rest.saturating_sub(LANES) {
        hi[i] += p(d + LANES + i);
    }
    for i in 0..LANES {
        lo[i] += hi[i];
    }
    tree16(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponentials_are_close_to_exp_and_exact_at_the_edges() {
        // Softmax arguments (<= 0), away from the underflow edge near -87.3.
        for i in 0..20000 {
            let x = -80.0 + i as f32 * 0.004;
            let e = x.exp();
            let f = fexp_u20(x);
            let s = sleef_expf_u10(x);
            // The cubic correction leaves about 1e-4 (relative): an approximation.
            assert!(((f - e) / e).abs() < 2e-4, "fexp {x}: {f} vs {e}");
            assert!(((s - e) / e).abs() < 2.5e-7, "sleef {x}: {s} vs {e}");
        }
        assert_eq!(fexp_u20(f32::NEG_INFINITY), 0.0);
        assert_eq!(sleef_expf_u10(f32::NEG_INFINITY), 0.0);
        assert_eq!(sleef_expf_u10(0.0), 1.0);
        assert_eq!(fexp_u20(100.0), f32::INFINITY);
    }

    #[test]
    fn lane_sums_follow_the_vector_order() {
        let v: [f32; 16] =
            std::array::from_fn(|i| (i as f32 * 0.37).sin() * 1e3f32.powi(i as i32 % 3));
        let want = (((v[0] + v[8]) + (v[4] + v[12])) + ((v[2] + v[10]) + (v[6] + v[14])))
            + (((v[1] + v[9]) + (v[5] + v[13])) + ((v[3] + v[11]) + (v[7] + v[15])));
        assert_eq!(tree16(v).to_bits(), want.to_bits());
        // 24 elements: lanes 0..8 hold two products, summed lane by lane in order.
        let a: Vec<f32> = (0..24).map(|i| (i as f32 * 0.7).cos()).collect();
        let b: Vec<f32> = (0..24).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut lanes: Vec<f32> = (0..16).map(|i| a[i] * b[i]).collect();
        for i in 0..8 {
            lanes[i] += a[16 + i] * b[16 + i];
        }
        let want = lanes[1..].iter().fold(lanes[0], |s, &x| s + x);
        assert_eq!(dot_rows(&a, &b).to_bits(), want.to_bits());
    }
}
