//! The loops that move and reduce data in the threads backend's collectives, over raw
//! pointers into the ranks' tensors (published by the rendezvous).
//!
//! Copies are `memcpy`. Reductions give, bit for bit, what the plain per-element loop gives
//! (`reduce_ref` in the tests below, the loop this backend used before): each value widens to
//! f64, the ranks combine left to right in rank order, `Avg` divides by the group size, and
//! the result narrows once per [`Element::from_f64`]. They run over chunks of [`CHUNK`]
//! elements; within a chunk up to [`GROUP`] sources are combined in one pass, with the op a
//! type parameter and the source count a const generic, so each inner loop is a plain loop
//! over equal-length slices that the compiler vectorizes (checked in the disassembly:
//! `vcvtps2pd`/`vaddpd` on 4 lanes with AVX2). Reducing through f64 is compute-bound at
//! L2-resident sizes: the fused passes are 4x faster than one pass per source over an f64
//! accumulator, and AVX2 (picked at run time) adds 10 - 30% (f32, bf16) over SSE2.

use super::rendezvous::Arrival;
use crate::distributed::ReduceOp;
use crate::tensor::Element;

/// Elements per reduction step: the f64 accumulators (8 KiB) and the rounded results (at
/// most 4 KiB) stay in L1 (48 KiB here) beside the inputs streaming through. 256 - 4096 time
/// the same within noise (`time_reduce_variants` below); 1024 is in the middle.
const CHUNK: usize = 1024;

/// `out (w * n) = concat over ranks s of input_s (n)`; `w = peers.len()`. Peer `s`'s input
/// is `peers[s].input`. Every rank copies the sources in rank order: ranks that run at the
/// same time then read the same lines at about the same time, and the second read hits the
/// cache the first one filled (15% faster at 16 - 64 MiB on two cores than each rank
/// starting at its own chunk). A source that is already in place is skipped.
///
/// # Safety
/// `out` is valid for writes of `w * n` elements of `T`, and every `peers[s].input` for reads
/// of `n`; an input either is exactly `out[s * n..]` or overlaps nothing this call writes;
/// nothing else accesses the written memory during the call.
pub(super) unsafe fn all_gather<T: Element>(out: *mut T, n: usize, peers: &[Arrival]) {
    for (s, peer) in peers.iter().enumerate() {
        let src = peer.input.cast::<T>() as *const T;
        // SAFETY: `s * n + n <= w * n`, inside `out` (caller's contract).
        let dst = unsafe { out.add(s * n) };
        if !std::ptr::eq(src, dst) {
            // SAFETY: the caller guarantees both ranges are valid and do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
        }
    }
}

/// For `i in 0..len`: `dst(d)[i] = reduce over s < nsrc of src(s)[i]`, for every
/// `d < ndst` (all-reduce writes every rank's tensor, reduce-scatter one shard).
///
/// Each chunk is read from every source before it is written to any destination, so a
/// destination may be one of the sources (in-place all-reduce and reduce-scatter).
/// `stream` writes the destinations with non-temporal stores (see [`STREAM_MIN_BYTES`]).
///
/// # Safety
/// Every `src(s)` is valid for reads and every `dst(d)` for writes of `len` elements of `T`;
/// a destination overlaps no other destination and no source other than exactly itself;
/// nothing else accesses these ranges during the call.
pub(crate) unsafe fn reduce<T, S, D>(
    op: ReduceOp,
    nsrc: usize,
    len: usize,
    src: S,
    ndst: usize,
    dst: D,
    stream: bool,
) where
    T: Element,
    S: Fn(usize) -> *const T,
    D: Fn(usize) -> *mut T,
{
    let n = nsrc as f64;
    let plain = |a: f64| T::from_f64(a);
    let dst = Dsts {
        n: ndst,
        at: dst,
        stream,
    };
    // SAFETY (each arm): the caller's contract, passed on.
    unsafe {
        match op {
            ReduceOp::Sum => dispatch::<T, Add, _, _, _>(nsrc, len, src, dst, plain),
            ReduceOp::Avg => {
                let avg = move |a: f64| T::from_f64(a / n);
                dispatch::<T, Add, _, _, _>(nsrc, len, src, dst, avg)
            }
            ReduceOp::Max => dispatch::<T, Max, _, _, _>(nsrc, len, src, dst, plain),
            ReduceOp::Min => dispatch::<T, Min, _, _, _>(nsrc, len, src, dst, plain),
            ReduceOp::Product => dispatch::<T, Mul, _, _, _>(nsrc, len, src, dst, plain),
        }
    }
}

/// Runs [`reduce_chunks`] compiled for AVX2 when the CPU has it (four f64 lanes instead of
/// SSE2's two: the f64 accumulation is compute-bound otherwise), else for the baseline.
///
/// # Safety
/// As [`reduce`].
#[inline(always)]
unsafe fn dispatch<T, C, S, D, F>(nsrc: usize, len: usize, src: S, dst: Dsts<D>, fin: F)
where
    T: Element,
    C: Combine,
    S: Fn(usize) -> *const T,
    D: Fn(usize) -> *mut T,
    F: Fn(f64) -> T + Copy,
{
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked above); the rest is the caller's contract.
        return unsafe { reduce_chunks_avx2::<T, C, S, D, F>(nsrc, len, src, dst, fin) };
    }
    // SAFETY: the caller's contract.
    unsafe { reduce_chunks::<T, C, S, D, F>(nsrc, len, src, dst, fin) }
}

/// [`reduce_chunks`] compiled with AVX2 enabled.
///
/// # Safety
/// The CPU supports AVX2; otherwise as [`reduce`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_chunks_avx2<T, C, S, D, F>(nsrc: usize, len: usize, src: S, dst: Dsts<D>, fin: F)
where
    T: Element,
    C: Combine,
    S: Fn(usize) -> *const T,
    D: Fn(usize) -> *mut T,
    F: Fn(f64) -> T + Copy,
{
    // SAFETY: the caller's contract.
    unsafe { reduce_chunks::<T, C, S, D, F>(nsrc, len, src, dst, fin) }
}

/// The reduction loop: per chunk, up to [`GROUP`] sources at a time fused into one pass
/// (all of them when there are at most [`GROUP`], with the rounding fused in too), the
/// rounded results into a stack buffer, then copied to every destination.
///
/// # Safety
/// As [`reduce`].
#[inline(always)]
unsafe fn reduce_chunks<T, C, S, D, F>(nsrc: usize, len: usize, src: S, dst: Dsts<D>, fin: F)
where
    T: Element,
    C: Combine,
    S: Fn(usize) -> *const T,
    D: Fn(usize) -> *mut T,
    F: Fn(f64) -> T + Copy,
{
    if nsrc == 0 {
        return;
    }
    let mut acc = [0f64; CHUNK];
    let mut out = [T::zero(); CHUNK];
    let mut off = 0;
    while off < len {
        let l = CHUNK.min(len - off);
        let (acc, out) = (&mut acc[..l], &mut out[..l]);
        // SAFETY: `off + l <= len`, inside every source (caller's contract); the slices end
        // before any destination is written.
        let s = |k: usize| unsafe { std::slice::from_raw_parts(src(k).add(off), l) };
        match nsrc {
            1 => fused::<T, C, F, 1>([s(0)], out, fin),
            2 => fused::<T, C, F, 2>([s(0), s(1)], out, fin),
            3 => fused::<T, C, F, 3>([s(0), s(1), s(2)], out, fin),
            4 => fused::<T, C, F, 4>([s(0), s(1), s(2), s(3)], out, fin),
            _ => {
                first::<T, C, GROUP>(acc, [s(0), s(1), s(2), s(3)]);
                let mut k = GROUP;
                while k < nsrc {
                    match nsrc - k {
                        1 => then::<T, C, 1>(acc, [s(k)]),
                        2 => then::<T, C, 2>(acc, [s(k), s(k + 1)]),
                        3 => then::<T, C, 3>(acc, [s(k), s(k + 1), s(k + 2)]),
                        _ => then::<T, C, 4>(acc, [s(k), s(k + 1), s(k + 2), s(k + 3)]),
                    }
                    k += GROUP;
                }
                out.iter_mut()
                    .zip(acc.iter())
                    .for_each(|(o, &a)| *o = fin(a));
            }
        }
        for d in 0..dst.n {
            let to = (dst.at)(d);
            // SAFETY: `off + l <= len`, inside every destination, which does not overlap the
            // stack buffer `out`.
            unsafe {
                if dst.stream {
                    stream_copy(out.as_ptr(), to.add(off), l);
                } else {
                    std::ptr::copy_nonoverlapping(out.as_ptr(), to.add(off), l);
                }
            }
        }
        off += l;
    }
    #[cfg(target_arch = "x86_64")]
    if dst.stream {
        // Orders the non-temporal stores before the release that ends the collective.
        // SAFETY: SSE2 is part of x86_64.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

/// The destinations of a reduction: `n` of them, the `d`-th at `at(d)`, written with
/// non-temporal stores when `stream`.
struct Dsts<D> {
    n: usize,
    at: D,
    stream: bool,
}

/// Outputs at least this large (bytes per rank) of an out-of-place reduce-scatter are
/// written with non-temporal stores: they bypass the caches (no read of the destination
/// lines before writing them, no eviction of the inputs). Measured on the collectives
/// bench, 2 ranks: a 32 MiB output per rank went from 0.39 to 0.67 of memcpy bandwidth, an
/// 8 MiB one gained nothing, and destinations that are also sources (in place, all-reduce)
/// lost half, so only separate outputs at least this large stream.
pub(super) const STREAM_MIN_BYTES: usize = 16 << 20;

/// `len` elements from `src` to `dst` with non-temporal stores for the 16-byte aligned
/// part of `dst` (plain copies for the ends; plain copies only off x86_64). The caller issues
/// an `sfence` after its last call.
///
/// # Safety
/// As `copy_nonoverlapping(src, dst, len)`.
#[inline(always)]
unsafe fn stream_copy<T>(src: *const T, dst: *mut T, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let (src, dst) = (src.cast::<u8>(), dst.cast::<u8>());
        let bytes = len * std::mem::size_of::<T>();
        let head = dst.align_offset(16).min(bytes);
        let body = (bytes - head) / 16 * 16;
        // SAFETY: all offsets stay within the `bytes` bytes of both ranges; the streamed
        // addresses are 16-byte aligned (`head` aligns them); SSE2 is part of x86_64.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let mut i = head;
            while i < head + body {
                let v = _mm_loadu_si128(src.add(i).cast::<__m128i>());
                _mm_stream_si128(dst.add(i).cast::<__m128i>(), v);
                i += 16;
            }
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), bytes - i);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    };
}

/// Sources combined per pass: the passes' loops keep one f64 per source and lane in
/// registers; more sources per pass measured no faster.
const GROUP: usize = 4;

/// How two widened values combine (the op is a type, so each loop is compiled for one op).
trait Combine {
    fn f(a: f64, b: f64) -> f64;
}
struct Add;
struct Max;
struct Min;
struct Mul;
impl Combine for Add {
    #[inline(always)]
    fn f(a: f64, b: f64) -> f64 {
        a + b
    }
}
impl Combine for Max {
    #[inline(always)]
    fn f(a: f64, b: f64) -> f64 {
        a.max(b)
    }
}
impl Combine for Min {
    #[inline(always)]
    fn f(a: f64, b: f64) -> f64 {
        a.min(b)
    }
}
impl Combine for Mul {
    #[inline(always)]
    fn f(a: f64, b: f64) -> f64 {
        a * b
    }
}

/// `out[i] = fin(x0[i] op x1[i] op ... )`, left to right: all sources in one pass.
#[inline(always)]
fn fused<T: Element, C: Combine, F: Fn(f64) -> T, const K: usize>(
    xs: [&[T]; K],
    out: &mut [T],
    fin: F,
) {
    let l = out.len();
    let xs = xs.map(|x| &x[..l]);
    for (i, o) in out.iter_mut().enumerate() {
        let mut a = xs[0][i].to_f64();
        for x in &xs[1..] {
            a = C::f(a, x[i].to_f64());
        }
        *o = fin(a);
    }
}

/// `acc[i] = x0[i] op x1[i] op ...`, left to right.
#[inline(always)]
fn first<T: Element, C: Combine, const K: usize>(acc: &mut [f64], xs: [&[T]; K]) {
    let l = acc.len();
    let xs = xs.map(|x| &x[..l]);
    for (i, a) in acc.iter_mut().enumerate() {
        let mut v = xs[0][i].to_f64();
        for x in &xs[1..] {
            v = C::f(v, x[i].to_f64());
        }
        *a = v;
    }
}

/// `acc[i] = acc[i] op x0[i] op x1[i] op ...`, left to right.
#[inline(always)]
fn then<T: Element, C: Combine, const K: usize>(acc: &mut [f64], xs: [&[T]; K]) {
    let l = acc.len();
    let xs = xs.map(|x| &x[..l]);
    for (i, a) in acc.iter_mut().enumerate() {
        let mut v = *a;
        for x in &xs {
            v = C::f(v, x[i].to_f64());
        }
        *a = v;
    }
}

/// The elements `lo..hi` of `len` that rank `rank` of `n` reduces in an all-reduce:
/// contiguous ranges in rank order whose boundaries are multiples of `align` elements (so
/// two ranks never write the same cache line of a 64-byte aligned buffer) and whose sizes
/// differ by at most `align`.
pub(crate) fn split(len: usize, n: usize, rank: usize, align: usize) -> (usize, usize) {
    let align = align.max(1);
    let blocks = len.div_ceil(align);
    let (per, extra) = (blocks / n, blocks % n);
    let lo = rank * per + rank.min(extra);
    let hi = lo + per + usize::from(rank < extra);
    ((lo * align).min(len), (hi * align).min(len))
}

/// The host locks of a reduce-scatter whose output may be chunk `rank` of its input (in
/// place): one write lock over the whole input then, else a read lock on the input and a
/// write lock on the output. Shared by the `threads` and `tcp` backends.
pub(crate) struct InOutGuards<'a, T: Element> {
    whole: Option<parking_lot::MappedRwLockWriteGuard<'a, [T]>>,
    inp: Option<parking_lot::MappedRwLockReadGuard<'a, [T]>>,
    out: Option<parking_lot::MappedRwLockWriteGuard<'a, [T]>>,
}

impl<'a, T: Element> InOutGuards<'a, T> {
    /// Locks `input` and `output` (only `input` when `in_place`).
    ///
    /// # Errors
    /// Those of `Tensor::data`/`data_mut` (dtype, device, meta).
    pub(crate) fn lock(
        input: &'a crate::tensor::Tensor,
        output: &'a crate::tensor::Tensor,
        in_place: bool,
    ) -> crate::error::Result<Self> {
        Ok(if in_place {
            InOutGuards {
                whole: Some(input.data_mut::<T>()?),
                inp: None,
                out: None,
            }
        } else {
            InOutGuards {
                whole: None,
                inp: Some(input.data::<T>()?),
                out: Some(output.data_mut::<T>()?),
            }
        })
    }

    /// `(input, output)` addresses; in place the output is the input's chunk at element
    /// `out_offset`. Valid while the guards live.
    pub(crate) fn ptrs(&mut self, out_offset: usize) -> (*const T, *mut T) {
        match (&mut self.whole, &self.inp, &mut self.out) {
            (Some(w), _, _) => {
                let p = w.as_mut_ptr();
                (p as *const T, p.wrapping_add(out_offset))
            }
            (None, Some(i), Some(o)) => (i.as_ptr(), o.as_mut_ptr()),
            // `lock` builds one of the two shapes above.
            _ => (std::ptr::null(), std::ptr::null_mut()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::threads::rendezvous::{Arg, Desc, Ptr};
    use crate::tensor::DType;
    use half::{bf16, f16};

    /// The per-element reduction this backend used before the chunked kernels: the oracle.
    fn reduce_ref<T: Element>(op: ReduceOp, n: usize, values: impl Iterator<Item = T>) -> T {
        let mut it = values.map(|v| v.to_f64());
        let first = it.next().unwrap_or(0.0);
        let r = it.fold(first, |acc, v| match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + v,
            ReduceOp::Max => acc.max(v),
            ReduceOp::Min => acc.min(v),
            ReduceOp::Product => acc * v,
        });
        let r = if op == ReduceOp::Avg { r / n as f64 } else { r };
        T::from_f64(r)
    }

    /// Values spanning many binades, signs, and a few exact ties, so that rounding differs
    /// between accumulation orders and precisions.
    fn values<T: Element>(seed: u64, n: usize) -> Vec<T> {
        let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                let mant = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let exp = ((z >> 8) % 24) as i32 - 12;
                T::from_f32(mant * 2f32.powi(exp) * if T::DTYPE == DType::I32 { 1e6 } else { 1.0 })
            })
            .collect()
    }

    fn check<T: Element + PartialEq>() {
        for w in 1..=5 {
            for len in [0, 1, 7, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 17] {
                let inputs: Vec<Vec<T>> = (0..w).map(|s| values(s as u64 + 7, len)).collect();
                for op in [
                    ReduceOp::Sum,
                    ReduceOp::Avg,
                    ReduceOp::Max,
                    ReduceOp::Min,
                    ReduceOp::Product,
                ] {
                    let want: Vec<T> = (0..len)
                        .map(|i| reduce_ref(op, w, inputs.iter().map(|v| v[i])))
                        .collect();
                    // Reduce into two destinations, one of them in place over source 0, with
                    // plain and with non-temporal stores.
                    for stream in [false, true] {
                        let mut bufs = inputs.clone();
                        let mut other = vec![T::zero(); len];
                        let ptrs: Vec<*mut T> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
                        let dsts = [ptrs[0], other.as_mut_ptr()];
                        let src = |s: usize| ptrs[s] as *const T;
                        // SAFETY: every pointer covers `len` elements of a live vector; the
                        // destinations are source 0 itself and a separate vector.
                        unsafe { reduce(op, w, len, src, 2, |d| dsts[d], stream) };
                        let bits = |v: &[T]| -> Vec<u8> { bytemuck::cast_slice(v).to_vec() };
                        let what = format!("{op:?} w {w} len {len} stream {stream}");
                        assert_eq!(bits(&bufs[0]), bits(&want), "{what}");
                        assert_eq!(bits(&other), bits(&want), "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn chunked_reduction_is_bit_identical_to_the_per_element_reference() {
        check::<f32>();
        check::<bf16>();
        check::<f16>();
        check::<i32>();
    }

    #[test]
    fn splits_cover_the_range_aligned_and_balanced() {
        for len in [0, 1, 15, 16, 17, 1000, 4096, 4099] {
            for n in 1..=8 {
                let mut next = 0;
                for r in 0..n {
                    let (lo, hi) = split(len, n, r, 16);
                    assert_eq!(lo, next, "len {len} n {n} rank {r}");
                    assert!(lo % 16 == 0 || lo == len);
                    assert!(hi - lo <= len.div_ceil(16).div_ceil(n) * 16);
                    next = hi;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn all_gather_skips_the_chunk_already_in_place() {
        let mut out = vec![0, 0, 3, 4, 0, 0];
        let base = out.as_mut_ptr();
        let (a, c) = ([1, 2], [5, 6]);
        let desc = Desc {
            op: "all_gather_into_tensor",
            dtype: DType::I32,
            in_numel: 2,
            out_numel: 6,
            arg: Arg::None,
            cuda: false,
            tag: None,
        };
        let arrival = |p: *const i32| Arrival::host(desc, Ptr::of(p), Ptr::NULL);
        let peers = [
            arrival(a.as_ptr()),
            arrival(base.wrapping_add(2)),
            arrival(c.as_ptr()),
        ];
        // SAFETY: out holds 3 x 2 elements; inputs hold 2 each; rank 1's input is its chunk.
        unsafe { all_gather::<i32>(base, 2, &peers) };
        assert_eq!(out, vec![1, 2, 3, 4, 5, 6]);
    }
}
