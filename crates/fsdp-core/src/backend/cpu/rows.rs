//! Row reductions in the reference order, several rows at a time.
//!
//! A sum over one row in element order is a chain of dependent additions: one addition per
//! 4 cycles (the adder's latency), whatever the vector width. Summing [`LANES`] rows side
//! by side keeps as many independent chains in flight, so the adders are busy, while each
//! row's sum is still the same additions in the same order: the same bits as the
//! one-row-at-a-time reference loop (`fold(init, +)` over the row).

/// Rows summed side by side.
pub const LANES: usize = 8;

/// For each of `N` rows `r` of `lens[r]` elements: `init + f(r, 0) + f(r, 1) + ...`, added
/// left to right (exactly `(0..lens[r]).fold(init, |a, j| a + f(r, j))`).
#[inline(always)]
pub fn seq_sums<const N: usize>(
    lens: [usize; N],
    init: f32,
    f: impl Fn(usize, usize) -> f32,
) -> [f32; N] {
    let common = lens.iter().copied().min().unwrap_or(0);
    let mut acc = [init; N];
    for j in 0..common {
        for (r, a) in acc.iter_mut().enumerate() {
            *a += f(r, j);
        }
    }
    for (r, a) in acc.iter_mut().enumerate() {
        for j in common..lens[r] {
            *a += f(r, j);
        }
    }
    acc
}

/// The largest element (`f32::max` over the row, `-inf` when empty), 16 lanes at a time.
/// `max` picks one of its inputs, so the value is that of any other order (up to the sign
/// of a zero maximum, which no caller can tell apart: `x - 0.0 == x - (-0.0)` but for
/// `x = -0.0`, and `exp` of either zero is 1).
#[inline(always)]
pub fn max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v);
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    lanes.iter().fold(m, |m, &v| m.max(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_the_reference_folds() {
        let data: Vec<f32> = (0..300)
            .map(|i| ((i * 7919) % 113) as f32 * 0.37 - 20.0)
            .collect();
        let lens = [0, 1, 5, 17, 64, 63, 2, 299];
        let rows: Vec<&[f32]> = lens.iter().map(|&l| &data[..l]).collect();
        for init in [0.0f32, -0.0] {
            let got = seq_sums(lens, init, |r, j| rows[r][j] * 1.5);
            for (r, g) in got.iter().enumerate() {
                let want = rows[r].iter().fold(init, |a, &v| a + v * 1.5);
                assert_eq!(g.to_bits(), want.to_bits(), "row {r}, init {init}");
            }
        }
        for l in [0, 1, 15, 16, 17, 100, 299] {
            let want = data[..l].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            assert_eq!(max(&data[..l]), want);
        }
    }
}
