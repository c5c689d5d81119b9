//! bf16 <-> f32 conversions without branches, so that slice loops vectorize: the same bits
//! as the `half` crate's `bf16::from_f32` (round to nearest even; a NaN keeps its sign and
//! top mantissa bits and is made quiet) and `bf16::to_f32` (exact; a signalling NaN is
//! made quiet), which are branchy scalar code the compiler leaves one element at a time.
//! `tests` compare them with `half` on every bf16 and on a spread of f32 bit patterns.

use super::simd::multiversion;
use half::bf16;

/// The bits of `x` rounded to bf16, as `half::bf16::from_f32(x).to_bits()`.
#[inline(always)]
pub fn bits_of(x: f32) -> u16 {
    let x = x.to_bits();
    let nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    // Round up when the dropped half is above the tie, or at the tie with an odd result.
    let up = (x & 0x8000 != 0) & (x & 0x1_7FFF != 0);
    let rounded = (x >> 16) + u32::from(up);
    let quiet = (x >> 16) | 0x0040;
    (if nan { quiet } else { rounded }) as u16
}

/// The f32 value of bf16 bits `b`, as `half::bf16::from_bits(b).to_f32()`.
#[inline(always)]
pub fn value_of(b: u16) -> f32 {
    let nan = b & 0x7FFF > 0x7F80;
    let b = if nan { b | 0x0040 } else { b };
    f32::from_bits(u32::from(b) << 16)
}

/// `x` rounded to bf16 and back: `half::bf16::from_f32(x).to_f32()`.
#[inline(always)]
pub fn round(x: f32) -> f32 {
    value_of(bits_of(x))
}

multiversion! {
    /// `dst[i] = bf16(src[i])`, round to nearest even (lengths equal: the caller's check).
    pub fn from_f32_slice(src: &[f32], dst: &mut [bf16]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(bits_of(s));
        }
    }
}

multiversion! {
    /// `dst[i] = f32(src[i])`, exact (lengths equal: the caller's check).
    pub fn to_f32_slice(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = value_of(s.to_bits());
        }
    }
}

multiversion! {
    /// `v[i] = round(v[i])` in place: each value rounded to bf16, kept as f32.
    pub fn round_slice_(v: &mut [f32]) {
        for x in v.iter_mut() {
            *x = round(*x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 bit patterns: every sign, exponent and a spread of mantissas, the ties and their
    /// neighbours, infinities and NaNs.
    fn patterns() -> Vec<u32> {
        let mut v = Vec::new();
        for hi in 0..=0xFFFFu32 {
            for lo in [
                0u32,
                1,
                0x7FFF,
                0x8000,
                0x8001,
                0xFFFF,
                (hi * 7919) & 0xFFFF,
            ] {
                v.push((hi << 16) | lo);
            }
        }
        v
    }

    #[test]
    fn narrowing_matches_half_bit_for_bit() {
        let p = patterns();
        let src: Vec<f32> = p.iter().map(|&b| f32::from_bits(b)).collect();
        let mut dst = vec![bf16::ZERO; src.len()];
        from_f32_slice(&src, &mut dst);
        let mut rounded = src.clone();
        round_slice_(&mut rounded);
        for (i, &x) in src.iter().enumerate() {
            let want = bf16::from_f32(x);
            assert_eq!(bits_of(x), want.to_bits(), "{:#010x}", p[i]);
            assert_eq!(dst[i].to_bits(), want.to_bits(), "{:#010x}", p[i]);
            assert_eq!(
                rounded[i].to_bits(),
                want.to_f32().to_bits(),
                "{:#010x}",
                p[i]
            );
        }
    }

    #[test]
    fn widening_matches_half_on_every_bf16() {
        let src: Vec<bf16> = (0..=0xFFFFu16).map(bf16::from_bits).collect();
        let mut dst = vec![0.0f32; src.len()];
        to_f32_slice(&src, &mut dst);
        for (s, d) in src.iter().zip(&dst) {
            assert_eq!(d.to_bits(), s.to_f32().to_bits(), "{:#06x}", s.to_bits());
            assert_eq!(value_of(s.to_bits()).to_bits(), s.to_f32().to_bits());
        }
    }
}
