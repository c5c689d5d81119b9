//! The element-wise reduction of an emulated collective: every rank's value in rank order,
//! accumulated in f64 (floats) or i64 (integers), one rounding to the element type at the
//! end (fsdp's `threads` backend reduces the same way, so the two agree bit for bit).

use half::{bf16, f16};
use std::ffi::c_int;

/// Combines `a` and `b` by NCCL's operation `redop` (sum 0, prod 1, max 2, min 3; avg 4
/// sums here and divides at the end).
fn combine_f(redop: c_int, a: f64, b: f64) -> f64 {
    match redop {
        1 => a * b,
        2 => a.max(b),
        3 => a.min(b),
        _ => a + b,
    }
}

fn combine_i(redop: c_int, a: i64, b: i64) -> i64 {
    match redop {
        1 => a.wrapping_mul(b),
        2 => a.max(b),
        3 => a.min(b),
        _ => a.wrapping_add(b),
    }
}

macro_rules! float_reduce {
    ($parts:expr, $out:expr, $n:expr, $redop:expr, $size:expr, $read:expr, $write:expr) => {{
        for (i, o) in $out.chunks_exact_mut($size).enumerate() {
            let at = i * $size;
            let mut acc: f64 = $read(&$parts[0][at..at + $size]);
            for p in &$parts[1..] {
                acc = combine_f($redop, acc, $read(&p[at..at + $size]));
            }
            if $redop == 4 {
                acc /= $n as f64;
            }
            $write(o, acc);
        }
    }};
}

/// `out = parts[0] (op) parts[1] (op) ...` element-wise for NCCL datatype `dtype`
/// (int8 0, uint8 1, int32 2, uint32 3, int64 4, uint64 5, float16 6, float32 7, float64 8,
/// bfloat16 9). Every part and `out` hold the same number of bytes.
pub fn reduce(dtype: c_int, redop: c_int, n: usize, parts: &[&[u8]], out: &mut [u8]) {
    match dtype {
        7 => float_reduce!(
            parts,
            out,
            n,
            redop,
            4,
            |b: &[u8]| f32::from_le_bytes(b.try_into().unwrap()) as f64,
            |o: &mut [u8], v: f64| o.copy_from_slice(&(v as f32).to_le_bytes())
        ),
        8 => float_reduce!(
            parts,
            out,
            n,
            redop,
            8,
            |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap()),
            |o: &mut [u8], v: f64| o.copy_from_slice(&v.to_le_bytes())
        ),
        6 => float_reduce!(
            parts,
            out,
            n,
            redop,
            2,
            |b: &[u8]| f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            |o: &mut [u8], v: f64| o.copy_from_slice(&f16::from_f32(v as f32).to_le_bytes())
        ),
        9 => float_reduce!(
            parts,
            out,
            n,
            redop,
            2,
            |b: &[u8]| bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
            |o: &mut [u8], v: f64| o.copy_from_slice(&bf16::from_f32(v as f32).to_le_bytes())
        ),
        _ => {
            let (size, signed) = match dtype {
                0 => (1, true),
                1 => (1, false),
                2 => (4, true),
                3 => (4, false),
                _ => (8, dtype == 4),
            };
            let read = |b: &[u8]| -> i64 {
                let mut w = [0u8; 8];
                w[..size].copy_from_slice(b);
                let v = i64::from_le_bytes(w);
                let shift = 64 - 8 * size as u32;
                if signed && shift > 0 {
                    (v << shift) >> shift
                } else {
                    v
                }
            };
            for (i, o) in out.chunks_exact_mut(size).enumerate() {
                let at = i * size;
                let mut acc = read(&parts[0][at..at + size]);
                for p in &parts[1..] {
                    acc = combine_i(redop, acc, read(&p[at..at + size]));
                }
                if redop == 4 {
                    acc /= n as i64;
                }
                o.copy_from_slice(&acc.to_le_bytes()[..size]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_with_one_rounding() {
        let a: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = [0.5f32, -3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut out = vec![0u8; 8];
        reduce(7, 0, 2, &[&a, &b], &mut out);
        assert_eq!(&out[..4], &1.5f32.to_le_bytes());
        assert_eq!(&out[4..], &(-1.0f32).to_le_bytes());
        reduce(7, 4, 2, &[&a, &b], &mut out);
        assert_eq!(&out[..4], &0.75f32.to_le_bytes());
        let x: Vec<u8> = [-5i32, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        let y: Vec<u8> = [3i32, -9].iter().flat_map(|v| v.to_le_bytes()).collect();
        reduce(2, 2, 2, &[&x, &y], &mut out);
        assert_eq!(&out[..4], &3i32.to_le_bytes());
        assert_eq!(&out[4..], &7i32.to_le_bytes());
        // bf16: 1 + 3 x 2^-9 rounds once at the end, to 1 + 2^-7; rounding after each
        // addition would keep 1.
        let h = |v: f32| bf16::from_f32(v).to_le_bytes();
        let (p, q) = (h(1.0), h(2f32.powi(-9)));
        let mut o = [0u8; 2];
        reduce(9, 0, 4, &[&p, &q, &q, &q], &mut o);
        assert_eq!(bf16::from_le_bytes(o).to_f32(), 1.0 + 2f32.powi(-7));
    }
}
