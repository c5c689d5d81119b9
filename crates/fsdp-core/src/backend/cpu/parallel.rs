//! The CPU thread budget and the intra-op parallel loops of the CPU ops.
//!
//! One pool per process: rayon's global pool (one worker per core), shared by every rank
//! thread of the process and by the `gemm` crate's own parallelism. Each rank thread has a
//! *budget*, the number of parts an op issued from it may split into ([`set_num_threads`]);
//! the launchers give each of `R` ranks on `N` cores `max(1, N / R)`, so ranks x intra-op
//! threads = cores (a world of 1 on 2 cores uses both; 4 thread ranks on 2 cores use one
//! each). A budget of 1 runs every op inline on the calling thread, with no hand-off.
//!
//! See [Note: determinism across thread counts]: work is split so that every output element
//! is computed by the same sequence of operations whatever the split (contiguous rows or
//! columns, each computed by the reference loop), and reductions across parts are added in
//! a fixed order by the caller, so results are the same bits for any budget.
//!
//! # [Note: determinism across thread counts]
//! - elementwise ops: any split; each element is one expression.
//! - row ops (LayerNorm, softmax, cross-entropy, embedding lookup): split by whole rows;
//!   the reference loop runs on each block of rows.
//! - column reductions (bias and LayerNorm parameter gradients, embedding backward): split
//!   by columns; each part adds all rows, in row order, into its own columns.
//! - GEMMs: the `gemm` crate splits the output tiles, never the summed dimension, and its
//!   blocking does not depend on the thread count; batched products split by batch.

use crate::error::Result;
use rayon::prelude::*;
use std::cell::Cell;
use std::ops::Range;

thread_local! {
    /// Parts an op issued from this thread may split into. Rayon's workers keep the
    /// default 1, so an op never nests parallel loops.
    static THREADS: Cell<usize> = const { Cell::new(1) };
}

/// Sets how many threads ops issued from the calling thread may use (at least 1): the
/// calling rank's share of the cores.
pub fn set_num_threads(n: usize) {
    THREADS.with(|c| c.set(n.max(1)));
}

/// Threads ops issued from the calling thread may use.
pub fn num_threads() -> usize {
    THREADS.with(|c| c.get())
}

/// Runs `f` with the calling thread's budget set to `n`, then restores it (tests, benches).
pub fn with_num_threads<R>(n: usize, f: impl FnOnce() -> R) -> R {
    let previous = num_threads();
    set_num_threads(n);
    let r = f();
    set_num_threads(previous);
    r
}

/// The share of `cores` each of `ranks` ranks on one machine gets: `max(1, cores / ranks)`.
pub fn budget_for(ranks: usize, cores: usize) -> usize {
    (cores / ranks.max(1)).max(1)
}

/// This machine's cores as the standard library sees them (1 when unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How many parts `n` items split into when each part should hold at least `grain` items:
/// at most the budget, 1 when there is not enough work for two parts.
pub fn parts(n: usize, grain: usize) -> usize {
    let t = num_threads();
    if t <= 1 {
        return 1;
    }
    (n / grain.max(1)).clamp(1, t)
}

/// The `i`-th of `p` near-equal contiguous ranges of `0..n`.
fn bounds(n: usize, p: usize, i: usize) -> Range<usize> {
    n * i / p..n * (i + 1) / p
}

/// Runs `f` on contiguous ranges covering `0..n`, in parallel when the budget and the
/// work allow (`grain`: the fewest items worth a part of their own).
pub fn for_ranges(n: usize, grain: usize, f: impl Fn(Range<usize>) + Sync) {
    let p = parts(n, grain);
    if p <= 1 {
        if n > 0 {
            f(0..n);
        }
        return;
    }
    (0..p).into_par_iter().for_each(|i| f(bounds(n, p, i)));
}

/// Splits `s` into the pieces `ranges` (consecutive, covering a prefix of it), each range
/// scaled by `unit` elements.
fn split_by<'a, T>(mut s: &'a mut [T], ranges: &[Range<usize>], unit: usize) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(ranges.len());
    for r in ranges {
        let (head, tail) = s.split_at_mut((r.end - r.start) * unit);
        out.push(head);
        s = tail;
    }
    out
}

fn ranges_of(n: usize, grain: usize) -> Vec<Range<usize>> {
    let p = parts(n, grain);
    (0..p).map(|i| bounds(n, p, i)).collect()
}

/// Runs `f(rows, out_rows)` over blocks of the rows of `out` (`n` rows of `row` elements;
/// `out.len() >= n * row`), in parallel when the budget and `grain` (rows) allow. Returns
/// the error of a failing part (parts are independent: the others still run).
///
/// # Errors
/// An error `f` returned.
pub fn rows_mut<T: Send>(
    out: &mut [T],
    n: usize,
    row: usize,
    grain: usize,
    f: impl Fn(Range<usize>, &mut [T]) -> Result<()> + Sync,
) -> Result<()> {
    let ranges = ranges_of(n, grain);
    if ranges.len() <= 1 {
        return f(0..n, &mut out[..n * row]);
    }
    let a = split_by(out, &ranges, row);
    ranges.into_par_iter().zip(a).try_for_each(|(r, a)| f(r, a))
}

/// As [`rows_mut`] with two outputs cut at the same rows (`row_a`, `row_b` elements a row).
///
/// # Errors
/// An error `f` returned.
pub fn rows_mut2<A: Send, B: Send>(
    (a, row_a): (&mut [A], usize),
    (b, row_b): (&mut [B], usize),
    n: usize,
    grain: usize,
    f: impl Fn(Range<usize>, &mut [A], &mut [B]) -> Result<()> + Sync,
) -> Result<()> {
    let ranges = ranges_of(n, grain);
    if ranges.len() <= 1 {
        return f(0..n, &mut a[..n * row_a], &mut b[..n * row_b]);
    }
    let (pa, pb) = (split_by(a, &ranges, row_a), split_by(b, &ranges, row_b));
    ranges
        .into_par_iter()
        .zip(pa)
        .zip(pb)
        .try_for_each(|((r, a), b)| f(r, a, b))
}

/// As [`rows_mut`] with three outputs cut at the same rows.
///
/// # Errors
/// An error `f` returned.
#[allow(clippy::type_complexity)]
pub fn rows_mut3<A: Send, B: Send, C: Send>(
    (a, row_a): (&mut [A], usize),
    (b, row_b): (&mut [B], usize),
    (c, row_c): (&mut [C], usize),
    n: usize,
    grain: usize,
    f: impl Fn(Range<usize>, &mut [A], &mut [B], &mut [C]) -> Result<()> + Sync,
) -> Result<()> {
    let ranges = ranges_of(n, grain);
    if ranges.len() <= 1 {
        return f(
            0..n,
            &mut a[..n * row_a],
            &mut b[..n * row_b],
            &mut c[..n * row_c],
        );
    }
    let (pa, pb, pc) = (
        split_by(a, &ranges, row_a),
        split_by(b, &ranges, row_b),
        split_by(c, &ranges, row_c),
    );
    ranges
        .into_par_iter()
        .zip(pa)
        .zip(pb)
        .zip(pc)
        .try_for_each(|(((r, a), b), c)| f(r, a, b, c))
}

/// Elementwise over `out` (any split): `f(range, &mut out[range])`; `grain` in elements.
///
/// # Errors
/// An error `f` returned.
pub fn chunks_mut<T: Send>(
    out: &mut [T],
    grain: usize,
    f: impl Fn(Range<usize>, &mut [T]) -> Result<()> + Sync,
) -> Result<()> {
    let n = out.len();
    rows_mut(out, n, 1, grain, f)
}

/// A column reduction `acc (C) op= f(rows of a (rows, C))` split by columns: `f(cols,
/// &mut acc[cols])` for contiguous column blocks, each adding every row in row order into
/// its own columns ([Note: determinism across thread counts]). A part gets at least
/// [`ELEMENTWISE_GRAIN`] elements of the summed input (`rows` times its columns, so a
/// small reduction runs on the caller's thread without waking a worker) and at least 16
/// columns; parts are aligned to 16 columns (a cache line of f32).
///
/// # Errors
/// An error `f` returned.
pub fn cols_mut<T: Send>(
    acc: &mut [T],
    rows: usize,
    f: impl Fn(Range<usize>, &mut [T]) -> Result<()> + Sync,
) -> Result<()> {
    let c = acc.len();
    let lines = c.div_ceil(16);
    // Cache lines (16 columns) worth a part: ELEMENTWISE_GRAIN elements of the input.
    let grain = ELEMENTWISE_GRAIN.div_ceil(16 * rows.max(1)).max(1);
    let ranges: Vec<Range<usize>> = ranges_of(lines, grain)
        .into_iter()
        .map(|r| (r.start * 16).min(c)..(r.end * 16).min(c))
        .collect();
    if ranges.len() <= 1 {
        return f(0..c, acc);
    }
    let pieces = split_by(acc, &ranges, 1);
    ranges
        .into_par_iter()
        .zip(pieces)
        .try_for_each(|(r, a)| f(r, a))
}

/// Elements worth a part of their own in a memory-bound elementwise loop (a few tens of
/// microseconds of work; hand-off to a sleeping worker costs ~10 us on the 2-core target).
pub const ELEMENTWISE_GRAIN: usize = 1 << 15;

/// Elements worth a part in a loop of a few tens of flops per element (exp, erf, Adam).
pub const HEAVY_GRAIN: usize = 1 << 13;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_split_the_cores() {
        assert_eq!(budget_for(1, 2), 2);
        assert_eq!(budget_for(2, 2), 1);
        assert_eq!(budget_for(4, 2), 1);
        assert_eq!(budget_for(0, 8), 8);
        assert_eq!(budget_for(3, 8), 2);
    }

    #[test]
    fn ranges_cover_every_item_once() {
        for threads in [1, 2, 3, 7] {
            with_num_threads(threads, || {
                for n in [0usize, 1, 5, 100, 1001] {
                    let mut seen = vec![0u8; n];
                    rows_mut(&mut seen, n, 1, 1, |r, s| {
                        assert_eq!(r.len(), s.len());
                        s.iter_mut().for_each(|v| *v += 1);
                        Ok(())
                    })
                    .unwrap();
                    assert!(seen.iter().all(|&v| v == 1), "n {n} threads {threads}");
                    // As many rows as one part's worth of input: every cache line a part.
                    cols_mut(&mut seen, ELEMENTWISE_GRAIN, |r, s| {
                        assert_eq!(r.len(), s.len());
                        s.iter_mut().for_each(|v| *v += 1);
                        Ok(())
                    })
                    .unwrap();
                    assert!(seen.iter().all(|&v| v == 2), "n {n} threads {threads}");
                    let hits = std::sync::atomic::AtomicUsize::new(0);
                    for_ranges(n, 1, |r| {
                        hits.fetch_add(r.len(), std::sync::atomic::Ordering::Relaxed);
                    });
                    assert_eq!(hits.into_inner(), n);
                }
            });
        }
    }

    #[test]
    fn the_budget_is_per_thread_and_restored() {
        set_num_threads(1);
        with_num_threads(3, || {
            assert_eq!(num_threads(), 3);
            std::thread::spawn(|| assert_eq!(num_threads(), 1))
                .join()
                .unwrap();
        });
        assert_eq!(num_threads(), 1);
    }
}
