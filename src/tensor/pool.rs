//! The CPU buffer pool: host buffers of dropped tensors (every dtype: f32, bf16, f16, f64,
//! i32, i64) are kept, by dtype and length, and handed to the next tensor of that dtype
//! and length, so a training step allocates (and page-faults) nothing once the first step
//! has run: every step makes the same shapes in the same order (a bf16 or f64 step as much
//! as an f32 one).
//!
//! [`allocations`] counts the CPU tensor buffers that came from the heap (not from the
//! pool) since the process started; tests and `fsdp bench` read it per step. The pool
//! keeps at most [`pool_limit`] bytes (a quarter of the machine's memory, at least
//! [`POOL_BYTES`]; [`set_pool_limit`] changes it).
//!
//! A pooled buffer is handed out either zeroed (`take` with `zeroed`) or holding a
//! previous tensor's values, for an op that overwrites every element of its output
//! ([`crate::ops`]' outputs): stale values are valid elements, never uninitialized memory.
//!
//! # [Note: pool limit]
//! A step whose buffers do not all fit under the limit hands the excess back to the
//! allocator at its end and takes fresh pages next step: with the 8 x 256, seq 128, batch 64
//! job (about 1.3 GB of buffers a step) a fixed 1 GiB limit left ~40 buffers of 16-32 MB a
//! step to the allocator, and the kernel's zeroing of their pages (`clear_page_erms`) took
//! 16-25% of the CPU time of a step. The limit is therefore tied to the machine's memory
//! (what the pool holds is at most one step's buffers: the same memory the step needs
//! anyway), not to one job's size.

use super::storage::Buffer;
use crate::dtype::DType;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The least the pool may keep by default (bytes): 1 GiB holds every activation of the main
/// job's step (about 60 MB at world size 1).
pub const POOL_BYTES: usize = 1 << 30;

/// 0: not yet decided (the first use reads the machine's memory).
static LIMIT: AtomicUsize = AtomicUsize::new(0);

/// Most bytes the pool keeps; a buffer dropped beyond that goes back to the allocator.
/// Unless [`set_pool_limit`] chose one: a quarter of the machine's physical memory, at least
/// [`POOL_BYTES`] ([Note: pool limit]).
pub fn pool_limit() -> usize {
    match LIMIT.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf has no preconditions; a failure returns -1.
            let (pages, page) = unsafe {
                (
                    libc::sysconf(libc::_SC_PHYS_PAGES),
                    libc::sysconf(libc::_SC_PAGESIZE),
                )
            };
            let phys = if pages > 0 && page > 0 {
                (pages as usize).saturating_mul(page as usize)
            } else {
                0
            };
            let limit = (phys / 4).max(POOL_BYTES);
            LIMIT.store(limit, Ordering::Relaxed);
            limit
        }
        l => l,
    }
}

/// Sets the most bytes the pool keeps (0 keeps nothing: every buffer goes back to the
/// allocator). Buffers already pooled beyond a lower limit are kept until taken.
pub fn set_pool_limit(bytes: usize) {
    // 0 means "undecided" in LIMIT; a limit of 0 bytes is stored as 1 (no buffer fits).
    LIMIT.store(bytes.max(1), Ordering::Relaxed);
}

/// Shortest buffer (elements) the pool keeps (an empty one is no allocation).
pub const POOL_MIN_LEN: usize = 1;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static REUSES: AtomicU64 = AtomicU64::new(0);

struct Pool {
    /// Free host buffers by (dtype, length).
    free: HashMap<(DType, usize), Vec<Buffer>>,
    bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// CPU tensor buffers allocated from the heap since the process started (zero-filled
/// tensors, [`crate::tensor::Tensor::from_vec`]'s vectors, op outputs the pool could not
/// serve). The difference over a step is that step's allocations.
pub fn allocations() -> u64 {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// CPU tensor buffers served from the pool since the process started.
pub fn reuses() -> u64 {
    REUSES.load(Ordering::Relaxed)
}

/// Bytes the pool holds now.
pub fn pooled_bytes() -> usize {
    POOL.lock().as_ref().map_or(0, |p| p.bytes)
}

/// Empties the pool (its buffers go back to the allocator).
pub fn clear() {
    *POOL.lock() = None;
}

/// Counts a buffer of `len` elements that came from the heap (an empty one did not).
pub(crate) fn count_allocation(len: usize) {
    if len > 0 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

/// A host buffer of `len` elements of `dtype`: a pooled one when there is one (zeroed when
/// `zeroed`, else holding stale values), else a new zeroed allocation. Aborts when the
/// allocator cannot serve it (`handle_alloc_error`, as `vec!` does); [`try_take`] returns
/// the error instead.
pub(crate) fn take(dtype: DType, len: usize, zeroed: bool) -> Buffer {
    match try_take(dtype, len, zeroed) {
        Ok(b) => b,
        Err(_) => std::alloc::handle_alloc_error(
            std::alloc::Layout::from_size_align(
                len.saturating_mul(dtype.size_in_bytes()),
                dtype.size_in_bytes(),
            )
            .unwrap_or(std::alloc::Layout::new::<u8>()),
        ),
    }
}

/// [`take`], or [`Error::OutOfMemory`](crate::Error::OutOfMemory) when no pooled buffer
/// fits and the allocator cannot serve a new one.
pub(crate) fn try_take(dtype: DType, len: usize, zeroed: bool) -> crate::Result<Buffer> {
    if len >= POOL_MIN_LEN {
        let hit = POOL.lock().as_mut().and_then(|p| {
            let b = p.free.get_mut(&(dtype, len))?.pop()?;
            p.bytes -= len * dtype.size_in_bytes();
            Some(b)
        });
        if let Some(mut b) = hit {
            REUSES.fetch_add(1, Ordering::Relaxed);
            if zeroed {
                b.fill_zero();
            }
            return Ok(b);
        }
    }
    let b = Buffer::try_new_zeroed(dtype, len)?;
    count_allocation(len);
    Ok(b)
}

/// Takes back the host buffer of a dropped tensor, when it is worth keeping and fits
/// (other buffers are dropped).
pub(crate) fn give_back(b: Buffer) {
    let (dtype, len) = (b.dtype(), b.len());
    if len < POOL_MIN_LEN || !b.is_host_vec() {
        return;
    }
    let bytes = len * dtype.size_in_bytes();
    let mut guard = POOL.lock();
    let p = guard.get_or_insert_with(|| Pool {
        free: HashMap::new(),
        bytes: 0,
    });
    if p.bytes + bytes <= pool_limit() {
        p.bytes += bytes;
        p.free.entry((dtype, len)).or_default().push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_of_every_host_dtype_come_back_by_dtype_and_length() {
        // A length no other test uses, so parallel tests do not take these buffers.
        let len = 12_347;
        give_back(Buffer::BF16(vec![half::bf16::ONE; len]));
        give_back(Buffer::F64(vec![2.5; len]));
        // Stale values for an op that overwrites them, zeros when asked.
        match take(DType::BF16, len, false) {
            Buffer::BF16(v) => assert!(v.iter().all(|x| *x == half::bf16::ONE)),
            b => panic!("{:?}", b.dtype()),
        }
        match take(DType::F64, len, true) {
            Buffer::F64(v) => assert!(v.len() == len && v.iter().all(|x| *x == 0.0)),
            b => panic!("{:?}", b.dtype()),
        }
        // Another dtype of the same length is not served a bf16 buffer.
        give_back(Buffer::BF16(vec![half::bf16::ONE; len]));
        match take(DType::F16, len, false) {
            Buffer::F16(v) => assert!(v.iter().all(|x| *x == half::f16::ZERO)),
            b => panic!("{:?}", b.dtype()),
        }
    }

    #[test]
    fn the_limit_is_at_least_a_gib_and_can_be_set() {
        let default = pool_limit();
        assert!(default >= POOL_BYTES, "{default}");
        set_pool_limit(default + 4096);
        assert_eq!(pool_limit(), default + 4096);
        set_pool_limit(default);
        assert_eq!(pool_limit(), default);
    }
}
