//! `fsdp bench --overhead`: FSDP's host cost per unit and per step, measured on a model whose
//! compute is negligible (width 8, one head, 4 tokens, one row), at world size 1.
//!
//! For each block count (one FSDP unit per block, plus the root) the model is trained
//! plainly and under FSDP FullShard, block counts and the two modes interleaved, repeated
//! `--repeats` times. Each run's median step time (and, apart, its 10th percentile, less
//! disturbed by other processes on a busy machine) is fitted by least squares against the
//! block count: the slope is the cost per block, the intercept the fixed cost per step.
//! FSDP's own share is the difference of the FSDP and plain fits. The figure printed is the
//! fit of each block count's median over the repeats (a repeat that another process
//! disturbed at one block count does not throw it off); the spread is the range of the
//! fits of single repeats, each FSDP's share taken from the FSDP and plain runs that ran
//! side by side.

use crate::bench::median;
use fsdp::train::{self, TrainConfig};

/// The compute-free model's width, heads, tokens per row and rows per step.
pub(crate) const SHAPE: (usize, usize, usize, usize) = (8, 1, 4, 1);

/// A fitted line: `(slope, intercept)`, µs per block and µs.
type Line = (f64, f64);

/// The plain and the FSDP fit of one set of runs.
type Fits = [Line; 2];

/// Which line of a [`Fits`] a row prints.
type Pick = fn(&Fits) -> Line;

/// The least-squares line `y = slope * x + intercept` through the points.
fn fit(points: &[(f64, f64)]) -> Line {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    let slope = sxy / sxx;
    (slope, my - slope * mx)
}

/// `head [min, max]` of the values, to one decimal.
fn spread(head: f64, v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{head:.1} [{lo:.1}, {hi:.1}]")
}

/// The statistics of a run's step times that are fitted: the median, and the 10th
/// percentile (the steps least disturbed by other processes on a busy machine).
const STATS: [(&str, f64); 2] = [("median", 0.5), ("10th-percentile", 0.1)];

/// [`STATS`] of one run's step times in µs, after `warmup` steps.
fn step_us(cfg: &TrainConfig, warmup: usize) -> fsdp::Result<[f64; 2]> {
    let report = train::train(cfg, &train::Silent)?;
    let mut t: Vec<f64> = report
        .records
        .iter()
        .skip(warmup)
        .map(|r| r.step_time_s * 1e6)
        .collect();
    t.sort_by(f64::total_cmp);
    Ok(STATS.map(|(_, q)| {
        t.get(((t.len() as f64 * q) as usize).min(t.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    }))
}

/// Runs `fsdp bench --overhead`: `base` is the FSDP configuration (world size 1) whose
/// `n_layer` is replaced by each of `blocks`.
pub(crate) fn run_overhead(
    base: &TrainConfig,
    blocks: &[usize],
    repeats: usize,
    warmup: usize,
) -> fsdp::Result<()> {
    if blocks.len() < 2 || blocks.contains(&0) || {
        let mut b = blocks.to_vec();
        b.sort_unstable();
        b.dedup();
        b.len() < 2
    } {
        return Err(fsdp::Error::InvalidArgument(format!(
            "--overhead-blocks must list at least two different positive block counts, got {blocks:?}"
        )));
    }
    if repeats == 0 {
        return Err(fsdp::Error::InvalidArgument(
            "--repeats must be at least 1".into(),
        ));
    }
    let configs: Vec<[TrainConfig; 2]> = blocks
        .iter()
        .map(|&n_layer| {
            let fsdp = TrainConfig {
                n_layer,
                ..base.clone()
            };
            let plain = TrainConfig {
                no_fsdp: true,
                ..fsdp.clone()
            };
            [plain, fsdp]
        })
        .collect();
    for c in configs.iter().flatten() {
        c.validate()?;
    }
    out!(
        "FSDP host overhead: n_embd {} n_head {} seq_len {} global_batch {}, world size 1, {} \
         unit per block + root; {} timed steps after {} warm-up, {} repeats",
        base.n_embd,
        base.n_head,
        base.seq_len,
        base.global_batch,
        base.strategy.flag_name(),
        base.steps - warmup,
        warmup,
        repeats
    );
    out!(
        "{:>6} {:>8} {:>22} {:>22}",
        "repeat",
        "blocks",
        "plain median step us",
        "fsdp median step us"
    );
    // [statistic][repeat][mode] -> points (blocks, µs).
    let mut points = vec![vec![[Vec::new(), Vec::new()]; repeats]; STATS.len()];
    for r in 0..repeats {
        for (&n, pair) in blocks.iter().zip(&configs) {
            let plain = step_us(&pair[0], warmup)?;
            let fsdp = step_us(&pair[1], warmup)?;
            out!("{:>6} {n:>8} {:>22.1} {:>22.1}", r + 1, plain[0], fsdp[0]);
            for (s, pts) in points.iter_mut().enumerate() {
                pts[r][0].push((n as f64, plain[s]));
                pts[r][1].push((n as f64, fsdp[s]));
            }
        }
    }
    for ((stat, _), points) in STATS.iter().zip(&points) {
        // Per repeat, and over the per-block medians of the repeats (robust to a repeat
        // that another process disturbed at one block count).
        let fits: Vec<Fits> = points.iter().map(|p| [fit(&p[0]), fit(&p[1])]).collect();
        let pooled: Fits = [0, 1].map(|mode| {
            let med: Vec<(f64, f64)> = (0..blocks.len())
                .map(|b| {
                    let at = points.iter().map(|p| p[mode][b].1).collect();
                    (blocks[b] as f64, median(at))
                })
                .collect();
            fit(&med)
        });
        out!(
            "\nleast-squares fit of the {stat} step time over blocks {blocks:?}: fit of the \
             per-block medians over the {repeats} repeats [min, max of the per-repeat fits]"
        );
        out!(
            "{:<22} {:>28} {:>28}",
            "",
            "us per block",
            "fixed us per step"
        );
        let rows: [(&str, Pick); 3] = [
            ("plain", |f| f[0]),
            ("fsdp", |f| f[1]),
            ("fsdp - plain (FSDP's)", |f| {
                (f[1].0 - f[0].0, f[1].1 - f[0].1)
            }),
        ];
        for (name, pick) in rows {
            let head = pick(&pooled);
            let slopes: Vec<f64> = fits.iter().map(|f| pick(f).0).collect();
            let intercepts: Vec<f64> = fits.iter().map(|f| pick(f).1).collect();
            out!(
                "{name:<22} {:>28} {:>28}",
                spread(head.0, &slopes),
                spread(head.1, &intercepts)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::fit;

    #[test]
    fn fit_recovers_a_line_and_the_least_squares_slope() {
        let (s, i) = fit(&[(2.0, 25.0), (4.0, 45.0), (8.0, 85.0)]);
        assert!(
            (s - 10.0).abs() < 1e-12 && (i - 5.0).abs() < 1e-12,
            "{s} {i}"
        );
        // Points (0,0), (1,1), (2,1): slope 0.5, intercept 1/6.
        let (s, i) = fit(&[(0.0, 0.0), (1.0, 1.0), (2.0, 1.0)]);
        assert!(
            (s - 0.5).abs() < 1e-12 && (i - 1.0 / 6.0).abs() < 1e-12,
            "{s} {i}"
        );
    }
}
