//! Faster CPU paths of the row kernels, beside their references in [`super::kernels`]: the
//! same operations in the same order per row (the same bits, tests below and in
//! tests/ops/cpu_threads.rs), with the row sums of [`LANES`] rows interleaved
//! ([`super::rows`]) and the exponentials in their own loop so that it vectorizes. Rows
//! left over after the last full group of [`LANES`] run the reference loop.

use super::kernels;
use super::ops::exp;
use super::rows::{self, seq_sums, LANES};
use super::simd::multiversion;
#[cfg(all(target_arch = "x86_64", fsdp_avx512))]
use super::wide;
use crate::error::{bail_arg, Error, Result};

fn check_len(op: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![expected],
            got: vec![got],
        });
    }
    Ok(())
}

multiversion! {
    /// [`kernels::layernorm_fwd`]: per row of `x (rows, C)`, `rstd = 1 / sqrt(var + eps)`,
    /// `xhat = (x - mean) rstd`, `y = xhat w + b` (=).
    pub fn layernorm_fwd(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        xhat: &mut [f32],
        rstd: &mut [f32],
    ) -> Result<()> {
        let c = w.len();
        check_len("layernorm_fwd", c, b.len())?;
        check_len("layernorm_fwd", x.len(), y.len())?;
        check_len("layernorm_fwd", x.len(), xhat.len())?;
        check_len("layernorm_fwd", x.len(), rstd.len() * c)?;
        #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
        if wide::available() && c % 16 == 0 && c > 0 {
            // SAFETY: the CPU has AVX-512 (checked), c is a multiple of 16 and the lengths
            // were checked above.
            let done = unsafe { wide::layernorm_fwd(x, w, b, eps, y, xhat, rstd) };
            if done > 0 {
                let k = done * c;
                return layernorm_fwd(
                    &x[k..],
                    w,
                    b,
                    eps,
                    &mut y[k..],
                    &mut xhat[k..],
                    &mut rstd[done..],
                );
            }
        }
        let full = rstd.len() / LANES * LANES;
        for r0 in (0..full).step_by(LANES) {
            let xs = &x[r0 * c..(r0 + LANES) * c];
            let sums = seq_sums([c; LANES], -0.0, |r, j| xs[r * c + j]);
            let mean = sums.map(|s| s / c as f32);
            let vars = seq_sums([c; LANES], -0.0, |r, j| {
                let d = xs[r * c + j] - mean[r];
                d * d
            });
            for r in 0..LANES {
                let rs = 1.0 / (vars[r] / c as f32 + eps).sqrt();
                rstd[r0 + r] = rs;
                let span = (r0 + r) * c..(r0 + r + 1) * c;
                let row = &xs[r * c..(r + 1) * c];
                let (xh, yr) = (&mut xhat[span.clone()], &mut y[span]);
                for ((((xh, yr), &v), &wj), &bj) in
                    xh.iter_mut().zip(yr.iter_mut()).zip(row).zip(w).zip(b)
                {
                    let n = (v - mean[r]) * rs;
                    *xh = n;
                    *yr = n * wj + bj;
                }
            }
        }
        kernels::layernorm_fwd(
            &x[full * c..],
            w,
            b,
            eps,
            &mut y[full * c..],
            &mut xhat[full * c..],
            &mut rstd[full..],
        )
    }
}

multiversion! {
    /// [`kernels::layernorm_bwd`]: `dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat))`
    /// per row (=).
    pub fn layernorm_bwd(
        dy: &[f32],
        xhat: &[f32],
        rstd: &[f32],
        w: &[f32],
        dx: &mut [f32],
    ) -> Result<()> {
        let c = w.len();
        check_len("layernorm_bwd", dy.len(), xhat.len())?;
        check_len("layernorm_bwd", dy.len(), dx.len())?;
        check_len("layernorm_bwd", dy.len(), rstd.len() * c)?;
        #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
        if wide::available() && c % 16 == 0 && c > 0 {
            // SAFETY: as in `layernorm_fwd`.
            let done = unsafe { wide::layernorm_bwd(dy, xhat, rstd, w, dx) };
            if done > 0 {
                let k = done * c;
                return layernorm_bwd(&dy[k..], &xhat[k..], &rstd[done..], w, &mut dx[k..]);
            }
        }
        let full = rstd.len() / LANES * LANES;
        for r0 in (0..full).step_by(LANES) {
            let (dys, xs) = (&dy[r0 * c..(r0 + LANES) * c], &xhat[r0 * c..(r0 + LANES) * c]);
            let m1 = seq_sums([c; LANES], 0.0, |r, j| dys[r * c + j] * w[j]);
            let m2 = seq_sums([c; LANES], 0.0, |r, j| (dys[r * c + j] * w[j]) * xs[r * c + j]);
            for r in 0..LANES {
                let (m1, m2, rs) = (m1[r] / c as f32, m2[r] / c as f32, rstd[r0 + r]);
                let out = &mut dx[(r0 + r) * c..(r0 + r + 1) * c];
                let (dyr, xr) = (&dys[r * c..(r + 1) * c], &xs[r * c..(r + 1) * c]);
                for (((o, &d), &x), &wj) in out.iter_mut().zip(dyr).zip(xr).zip(w) {
                    *o = rs * (d * wj - m1 - x * m2);
                }
            }
        }
        kernels::layernorm_bwd(
            &dy[full * c..],
            &xhat[full * c..],
            &rstd[full..],
            w,
            &mut dx[full * c..],
        )
    }
}

multiversion! {
    /// [`kernels::softmax_causal_fwd`]: row `r` of `s (rows, T)` is query `i = r mod T`;
    /// `p[j] = exp(s[j] scale - max) / sum` for `j <= i`, 0 after (=).
    pub fn softmax_causal_fwd(s: &[f32], p: &mut [f32], t: usize, scale: f32) -> Result<()> {
        check_len("softmax_causal_fwd", s.len(), p.len())?;
        if t == 0 {
            return check_len("softmax_causal_fwd", 0, s.len());
        }
        #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
        if wide::available() && t % wide::ROWS == 0 && s.len() % (t * t) == 0 {
            // SAFETY: the CPU has AVX-512 (checked); whole (T, T) matrices, T a multiple of
            // 16, lengths checked above.
            unsafe { wide::softmax_causal_fwd(s, p, t, scale) };
            return Ok(());
        }
        let n = s.len() / t;
        let full = n / LANES * LANES;
        for r0 in (0..full).step_by(LANES) {
            let lens: [usize; LANES] = std::array::from_fn(|r| (r0 + r) % t + 1);
            for (r, &len) in lens.iter().enumerate() {
                let (sr, pr) = (&s[(r0 + r) * t..][..len], &mut p[(r0 + r) * t..][..t]);
                for (pj, &v) in pr.iter_mut().zip(sr) {
                    *pj = v * scale;
                }
                let max = rows::max(&pr[..len]);
                for pj in &mut pr[..len] {
                    *pj = exp(*pj - max);
                }
            }
            let ps = &p[r0 * t..(r0 + LANES) * t];
            let sums = seq_sums(lens, 0.0, |r, j| ps[r * t + j]);
            for (r, &len) in lens.iter().enumerate() {
                let pr = &mut p[(r0 + r) * t..][..t];
                let inv = 1.0 / sums[r];
                pr[..len].iter_mut().for_each(|v| *v *= inv);
                pr[len..].fill(0.0);
            }
        }
        // The remaining rows start at row `full`, query `full mod T`: run the reference on
        // whole rows with its own query numbering shifted to match.
        for r in full..n {
            let i = r % t;
            let (sr, pr) = (&s[r * t..(r + 1) * t], &mut p[r * t..(r + 1) * t]);
            let max = sr[..=i]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
            let mut sum = 0.0f32;
            for j in 0..=i {
                pr[j] = exp(sr[j] * scale - max);
                sum += pr[j];
            }
            let inv = 1.0 / sum;
            pr[..=i].iter_mut().for_each(|v| *v *= inv);
            pr[i + 1..].fill(0.0);
        }
        Ok(())
    }
}

multiversion! {
    /// [`kernels::softmax_causal_bwd`]: `ds[j] = p[j] (dp[j] - <p, dp>) scale` for
    /// `j <= i`, 0 after (=), in place of `dp`.
    pub fn softmax_causal_bwd(p: &[f32], dp: &mut [f32], t: usize, scale: f32) -> Result<()> {
        check_len("softmax_causal_bwd", p.len(), dp.len())?;
        if t == 0 {
            return check_len("softmax_causal_bwd", 0, p.len());
        }
        #[cfg(all(target_arch = "x86_64", fsdp_avx512))]
        if wide::available() && t % wide::ROWS == 0 && p.len() % (t * t) == 0 {
            // SAFETY: as in `softmax_causal_fwd`.
            unsafe { wide::softmax_causal_bwd(p, dp, t, scale) };
            return Ok(());
        }
        let n = p.len() / t;
        let mut r0 = 0;
        while r0 < n {
            let k = LANES.min(n - r0);
            let mut dots = [0.0f32; LANES];
            if k == LANES {
                let lens: [usize; LANES] = std::array::from_fn(|r| (r0 + r) % t + 1);
                let (ps, ds) = (&p[r0 * t..(r0 + LANES) * t], &dp[r0 * t..(r0 + LANES) * t]);
                dots = seq_sums(lens, -0.0, |r, j| ps[r * t + j] * ds[r * t + j]);
            } else {
                for (r, d) in dots.iter_mut().enumerate().take(k) {
                    let len = (r0 + r) % t + 1;
                    let (pr, dr) = (&p[(r0 + r) * t..][..len], &dp[(r0 + r) * t..][..len]);
                    *d = pr.iter().zip(dr).map(|(a, b)| a * b).sum();
                }
            }
            for (r, &dot) in dots.iter().enumerate().take(k) {
                let len = (r0 + r) % t + 1;
                let (pr, dr) = (&p[(r0 + r) * t..][..t], &mut dp[(r0 + r) * t..][..t]);
                for (d, &pj) in dr[..len].iter_mut().zip(&pr[..len]) {
                    *d = pj * (*d - dot) * scale;
                }
                dr[len..].fill(0.0);
            }
            r0 += k;
        }
        Ok(())
    }
}

multiversion! {
    /// [`kernels::cross_entropy`]: per row of `logits (N, V)`, `losses[r] = logsumexp -
    /// logits[y]`, `dlogits = (softmax - onehot(y)) * inv_n` (=).
    ///
    /// # Errors
    /// `InvalidArgument` naming the first target outside `0..V`.
    pub fn cross_entropy(
        logits: &[f32],
        targets: &[i32],
        inv_n: f32,
        losses: &mut [f32],
        dlogits: &mut [f32],
    ) -> Result<()> {
        let n = targets.len();
        check_len("cross_entropy", n, losses.len())?;
        check_len("cross_entropy", logits.len(), dlogits.len())?;
        if n == 0 {
            return Ok(());
        }
        let v = logits.len() / n;
        check_len("cross_entropy", n * v, logits.len())?;
        if let Some(r) = targets.iter().position(|&y| y < 0 || y as usize >= v) {
            let y = targets[r];
            bail_arg!("cross_entropy: target {y} at position {r} is outside 0..{v}");
        }
        let full = n / LANES * LANES;
        for r0 in (0..full).step_by(LANES) {
            let mut maxes = [0.0f32; LANES];
            for (r, m) in maxes.iter_mut().enumerate() {
                let (row, g) = (&logits[(r0 + r) * v..][..v], &mut dlogits[(r0 + r) * v..][..v]);
                *m = rows::max(row);
                for (gj, &x) in g.iter_mut().zip(row) {
                    *gj = exp(x - *m);
                }
            }
            let gs = &dlogits[r0 * v..(r0 + LANES) * v];
            let sums = seq_sums([v; LANES], 0.0, |r, j| gs[r * v + j]);
            for (r, (&sum, &max)) in sums.iter().zip(&maxes).enumerate() {
                let (row, g) = (&logits[(r0 + r) * v..][..v], &mut dlogits[(r0 + r) * v..][..v]);
                let y = targets[r0 + r] as usize;
                let inv = inv_n / sum;
                g.iter_mut().for_each(|gj| *gj *= inv);
                g[y] -= inv_n;
                losses[r0 + r] = sum.ln() + max - row[y];
            }
        }
        kernels::cross_entropy(
            &logits[full * v..],
            &targets[full..],
            inv_n,
            &mut losses[full..],
            &mut dlogits[full * v..],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 1009) as f32 / 97.0 - 5.0)
            .collect()
    }

    type LayerNormFwd =
        fn(&[f32], &[f32], &[f32], f32, &mut [f32], &mut [f32], &mut [f32]) -> Result<()>;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn layernorm_matches_the_reference_bit_for_bit() {
        for (rows, c) in [(19, 7), (8, 128), (3, 5), (0, 4), (33, 64), (50, 256)] {
            let (x, dy) = (data(rows * c, 1), data(rows * c, 2));
            let (w, b) = (data(c, 3), data(c, 4));
            let run = |fwd: LayerNormFwd| {
                let (mut y, mut xh, mut rs) =
                    (vec![0.0; rows * c], vec![0.0; rows * c], vec![0.0; rows]);
                fwd(&x, &w, &b, 1e-5, &mut y, &mut xh, &mut rs).unwrap();
                (y, xh, rs)
            };
            let (want, got) = (run(kernels::layernorm_fwd), run(layernorm_fwd));
            assert_eq!(bits(&got.0), bits(&want.0), "y {rows}x{c}");
            assert_eq!(bits(&got.1), bits(&want.1), "xhat {rows}x{c}");
            assert_eq!(bits(&got.2), bits(&want.2), "rstd {rows}x{c}");
            let (mut d1, mut d2) = (vec![0.0; rows * c], vec![0.0; rows * c]);
            kernels::layernorm_bwd(&dy, &want.1, &want.2, &w, &mut d1).unwrap();
            layernorm_bwd(&dy, &want.1, &want.2, &w, &mut d2).unwrap();
            assert_eq!(bits(&d2), bits(&d1), "dx {rows}x{c}");
        }
    }

    #[test]
    fn softmax_matches_the_reference_bit_for_bit() {
        for (mats, t) in [(3, 5), (2, 64), (1, 1), (5, 13), (0, 8), (3, 128), (2, 16)] {
            let (s, g) = (data(mats * t * t, 5), data(mats * t * t, 6));
            let (mut p1, mut p2) = (vec![1.0; s.len()], vec![2.0; s.len()]);
            kernels::softmax_causal_fwd(&s, &mut p1, t, 0.3).unwrap();
            softmax_causal_fwd(&s, &mut p2, t, 0.3).unwrap();
            assert_eq!(bits(&p2), bits(&p1), "fwd {mats}x{t}");
            let (mut d1, mut d2) = (g.clone(), g);
            kernels::softmax_causal_bwd(&p1, &mut d1, t, 0.3).unwrap();
            softmax_causal_bwd(&p1, &mut d2, t, 0.3).unwrap();
            assert_eq!(bits(&d2), bits(&d1), "bwd {mats}x{t}");
        }
    }

    #[test]
    fn cross_entropy_matches_the_reference_bit_for_bit() {
        for (n, v) in [(17, 11), (8, 256), (1, 3), (0, 5)] {
            let logits = data(n * v, 7);
            let targets: Vec<i32> = (0..n).map(|i| ((i * 31) % v) as i32).collect();
            let (mut l1, mut l2) = (vec![0.0; n], vec![0.0; n]);
            let (mut g1, mut g2) = (vec![0.0; n * v], vec![0.0; n * v]);
            kernels::cross_entropy(&logits, &targets, 0.1, &mut l1, &mut g1).unwrap();
            cross_entropy(&logits, &targets, 0.1, &mut l2, &mut g2).unwrap();
            assert_eq!(bits(&l2), bits(&l1), "losses {n}x{v}");
            assert_eq!(bits(&g2), bits(&g1), "grad {n}x{v}");
        }
        let mut g = vec![0.0; 6];
        let err = cross_entropy(&[0.0; 6], &[0, 3], 0.5, &mut [0.0; 2], &mut g).unwrap_err();
        assert!(err.to_string().contains("target 3 at position 1"), "{err}");
    }
}
