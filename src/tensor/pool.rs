//! The CPU buffer pool: f32 buffers of dropped tensors are kept, by length, and handed to
//! the next tensor of that length, so a training step allocates (and page-faults) nothing
//! once the first step has run: every step makes the same shapes in the same order.
//!
//! [`allocations`] counts the CPU tensor buffers that came from the heap (not from the
//! pool) since the process started; tests and `fsdp bench` read it per step. The pool
//! keeps at most [`POOL_BYTES`].
//!
//! A pooled buffer is handed out either zeroed (`take_f32` with `zeroed`) or holding a
//! previous tensor's values, for an op that overwrites every element of its output
//! ([`crate::ops`]' outputs): stale values are valid f32s, never uninitialized memory.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most bytes the pool keeps; a buffer dropped beyond that goes back to the allocator.
/// 1 GiB holds every activation of the main job's step (about 60 MB at world size 1) and
/// of the 8 x 256, seq 128 configuration with room to spare.
pub const POOL_BYTES: usize = 1 << 30;

/// Shortest buffer (elements) the pool keeps (an empty one is no allocation).
pub const POOL_MIN_LEN: usize = 1;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static REUSES: AtomicU64 = AtomicU64::new(0);

struct Pool {
    free: HashMap<usize, Vec<Vec<f32>>>,
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

/// An f32 buffer of `len` elements: a pooled one when there is one (zeroed when `zeroed`,
/// else holding stale values), else a new zeroed allocation.
pub(crate) fn take_f32(len: usize, zeroed: bool) -> Vec<f32> {
    if len >= POOL_MIN_LEN {
        let hit = POOL.lock().as_mut().and_then(|p| {
            let v = p.free.get_mut(&len)?.pop()?;
            p.bytes -= len * 4;
            Some(v)
        });
        if let Some(mut v) = hit {
            REUSES.fetch_add(1, Ordering::Relaxed);
            if zeroed {
                v.fill(0.0);
            }
            return v;
        }
    }
    count_allocation(len);
    vec![0.0; len]
}

/// Takes back the buffer of a dropped tensor, when it is worth keeping and fits.
pub(crate) fn give_back(v: Vec<f32>) {
    let len = v.len();
    if len < POOL_MIN_LEN {
        return;
    }
    let mut guard = POOL.lock();
    let p = guard.get_or_insert_with(|| Pool {
        free: HashMap::new(),
        bytes: 0,
    });
    if p.bytes + len * 4 <= POOL_BYTES {
        p.bytes += len * 4;
        p.free.entry(len).or_default().push(v);
    }
}
