//! The CPU buffer pool: host buffers of dropped tensors (every dtype: f32, bf16, f16, f64,
//! i32, i64) are kept, by the thread that made them, dtype and length, and handed to that
//! thread's next tensor of that dtype and length, so a training step allocates (and
//! page-faults) nothing once the first step has run: every step makes the same shapes in
//! the same order (a bf16 or f64 step as much as an f32 one). It is the host's
//! counterpart of PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`),
//! with exact sizes instead of rounded blocks.
//!
//! What it holds is bounded by what live tensors use ([Note: pool bound]) and given back:
//! by [`empty_cache`] (`torch.cuda.empty_cache`), and by itself when the last model or
//! process group using it drops ([`PoolUser`]). [`memory_stats`] reports the bytes in live
//! tensors and the bytes held free (`torch.cuda.memory_stats`), and the counts of buffers
//! served from the heap and from the pool.
//!
//! [`allocations`] counts the CPU tensor buffers that came from the heap (not from the
//! pool) since the process started; tests and `fsdp bench` read it per step.
//!
//! A pooled buffer is handed out either zeroed (`take` with `zeroed`) or holding a
//! previous tensor's values, for an op that overwrites every element of its output
//! ([`crate::ops`]' outputs): stale values are valid elements, never uninitialized memory.
//!
//! # [Note: pool bound]
//! Each (thread, dtype, length) is a bucket that counts its live host buffers (every
//! [`Storage`](super::Storage) of that dtype and length whose buffer the thread took from
//! the pool or handed in, `Tensor::from_vec`) and the most that were ever live at once, its
//! *peak*. A buffer belongs to that thread, its *owner*, for its whole life: whichever
//! thread drops it, it goes back to its owner's bucket. A dropped buffer is kept only when
//! - some tensor asked the pool for that dtype and length (its bucket is *demanded*):
//!   buffers of lengths only ever handed in (state dicts, a data loader's batches) are
//!   never asked for, so keeping them is pure growth. Replaying pytorch#149100 (a W=2
//!   model of 4 x Linear(1024, 1024) built, trained one step, its model and optimizer state
//!   dicts taken, and dropped, ten times over) the old pool, bounded only by a quarter of
//!   the machine's memory, grew by 84 MB a cycle: every state-dict tensor (1024 x 1024,
//!   a length no op asks for) was kept and a new one made the next cycle; and 17.7 MB over
//!   steps 10 to 100 of training, one batch's input vectors a step;
//! - the bucket's live and free buffers together stay within its peak: the pool holds,
//!   per thread and length, what the thread needed at once, never more. The same model
//!   built again (or the next step) asks for the same lengths in the same order and is
//!   served from what the last one gave back; a length that is needed less than before
//!   sheds the excess when it is dropped;
//! - the free bytes stay within [`pool_limit`] (a quarter of the machine's memory unless
//!   [`set_pool_limit`] chose another), a ceiling for programs whose shapes change every
//!   step: with the 8 x 256, seq 128, batch 64 job (about 1.3 GB of buffers a step) a fixed
//!   1 GiB ceiling left ~40 buffers of 16-32 MB a step to the allocator, and the kernel's
//!   zeroing of their pages (`clear_page_erms`) took 16-25% of the CPU time of a step.
//!
//! So a steady step is served entirely from the pool: a take finds no free buffer only when
//! every buffer the bucket holds is live, which raises its peak, and peaks stop rising
//! once the program repeats itself. What it costs is per-length peaks summed (the most
//! held is `sum over threads and lengths of peak x bytes`), which can exceed the peak of
//! the sum when phases use different lengths (a state dict's gather next to a step's
//! activations) or threads reach their peaks at different times.
//!
//! Why per thread: the thread ranks of `fsdp::distributed::launch` share this
//! pool, and how far one rank runs ahead of another changes from step to step with the
//! machine's load. With one bucket per length for the whole process, the peak was the most
//! buffers *all ranks together* ever had live at once, so a step where the ranks
//! overlapped in a new way raised it and left one more buffer pooled for good (the replay
//! above: 0 to 2 unsharded 4 MiB flat parameters more over 10 cycles, up to 2 more between
//! steps 10 and 100, varying from run to run). A thread's own takes and drops follow its
//! program, the same in every step and every cycle, so its peaks are reached in the first
//! step and the pool's bound, their sum, no longer depends on the interleaving. That holds
//! as long as a thread's buffers are not freed by another thread at a time set by the
//! schedule: FSDP's communication threads drop the flat gradients they reduce when the
//! peer rank's half arrives, so FSDP keeps those (and its other per-step buffers) in its
//! own `BufferPool` (`fsdp::fsdp::BufferPool`) on the host too, reused in program order.
//! Measured on the replay (2-core machine, loaded by other builds): 0 B of new peaks over
//! 10 cycles and over steps 10 to 100, in each of 15 runs, where the process-wide buckets
//! had 0 to 3 (`tests/isolated/cpu_pool_memory.rs`, docs/speed.md). The cost: the threads'
//! peaks summed can exceed the peak of their sum (218.8 MB after the replay's first cycle,
//! against 197.8-206.2 MB, which then grew).
//!
//! A thread's buckets go when the thread exits: their free buffers are freed, and its
//! buffers still live go back to the allocator when they drop. [`HostMemoryStats::owners`]
//! counts the threads the pool holds buckets for.
//!
//! Peaks are forgotten when the last [`PoolUser`] (an FSDP unit, a process group's world)
//! drops: the pool then frees what it holds and stops keeping the lengths it served, and a
//! model built later starts afresh. [`empty_cache`] frees what is held without forgetting
//! the peaks of lengths still live.

mod owner;
mod stats;

use super::storage::Buffer;
use crate::dtype::DType;
pub(crate) use owner::Owner;
use owner::{current_owner, Key};
use parking_lot::Mutex;
pub use stats::HostMemoryStats;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The least [`pool_limit`] is by default (bytes): 1 GiB holds every activation of the main
/// job's step (about 60 MB at world size 1).
pub const POOL_BYTES: usize = 1 << 30;

/// 0: not yet decided (the first use reads the machine's memory).
static LIMIT: AtomicUsize = AtomicUsize::new(0);

/// Most free bytes the pool keeps, whatever the peaks ([Note: pool bound]); a buffer
/// dropped beyond that goes back to the allocator. Unless [`set_pool_limit`] chose one: a
/// quarter of the machine's physical memory, at least [`POOL_BYTES`].
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

/// Sets the most free bytes the pool keeps (0 keeps nothing: every buffer goes back to the
/// allocator). Buffers already pooled beyond a lower limit are kept until taken.
pub fn set_pool_limit(bytes: usize) {
    // 0 means "undecided" in LIMIT; a limit of 0 bytes is stored as 1 (no buffer fits).
    LIMIT.store(bytes.max(1), Ordering::Relaxed);
}

/// Shortest buffer (elements) the pool keeps (an empty one is no allocation).
pub const POOL_MIN_LEN: usize = 1;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static REUSES: AtomicU64 = AtomicU64::new(0);

/// One (dtype, length): its free buffers and how many are live ([Note: pool bound]).
#[derive(Default)]
struct Bucket {
    free: Vec<Buffer>,
    /// Live storages of this dtype and length, wherever their buffer came from.
    live: usize,
    /// The most that were live at once since the bucket was made (or the pool forgot).
    peak: usize,
    /// Some tensor asked the pool for this dtype and length.
    demanded: bool,
}

impl Bucket {
    fn went_live(&mut self) {
        self.live += 1;
        self.peak = self.peak.max(self.live);
    }
}

#[derive(Default)]
struct Pool {
    /// Hashed with rustc-hash's FxHash: a key is hashed on every take and drop, and
    /// SipHash's resistance to chosen keys buys nothing for keys the program makes.
    buckets: HashMap<Key, Bucket, rustc_hash::FxBuildHasher>,
    free_bytes: usize,
    free_buffers: usize,
    active_bytes: usize,
    active_buffers: usize,
    active_peak: usize,
    reserved_peak: usize,
    misses: u64,
    miss_bytes: u64,
    released: u64,
    /// Live [`PoolUser`]s.
    users: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn bytes_of(dtype: DType, len: usize) -> usize {
    len * dtype.size_in_bytes()
}

impl Pool {
    /// A buffer of this owner, dtype and length goes live.
    fn went_live(&mut self, key: Key) {
        self.buckets.entry(key).or_default().went_live();
        self.active_went_up(bytes_of(key.1, key.2));
    }

    /// One more live buffer of `bytes`, in the figures of every bucket together.
    fn active_went_up(&mut self, bytes: usize) {
        self.active_bytes += bytes;
        self.active_buffers += 1;
        self.active_peak = self.active_peak.max(self.active_bytes);
        self.reserved_peak = self.reserved_peak.max(self.active_bytes + self.free_bytes);
    }

    /// Undoes [`Pool::went_live`] for a buffer that could not be allocated.
    fn undo_live(&mut self, key: Key) {
        if let Some(b) = self.buckets.get_mut(&key) {
            b.live = b.live.saturating_sub(1);
        }
        self.active_bytes = self.active_bytes.saturating_sub(bytes_of(key.1, key.2));
        self.active_buffers = self.active_buffers.saturating_sub(1);
    }

    /// A free buffer of this owner, dtype and length, if the bucket holds one; marks it
    /// demanded, and counts one buffer of it live when `live` (as [`Pool::went_live`], with
    /// one lookup).
    fn take(&mut self, key: Key, live: bool) -> Option<Buffer> {
        let bytes = bytes_of(key.1, key.2);
        let b = self.buckets.entry(key).or_default();
        b.demanded = true;
        let hit = b.free.pop();
        if live {
            b.went_live();
        }
        match &hit {
            Some(_) => {
                self.free_bytes -= bytes;
                self.free_buffers -= 1;
            }
            None => {
                self.misses += 1;
                self.miss_bytes += bytes as u64;
            }
        }
        if live {
            self.active_went_up(bytes);
        }
        hit
    }

    /// A live buffer of `owner` dropped (by any thread): kept in its owner's bucket within
    /// the bounds of [Note: pool bound], else returned for the caller to free outside the
    /// lock.
    fn dropped(&mut self, buf: Buffer, owner: Owner) -> Option<Buffer> {
        let key = (owner, buf.dtype(), buf.len());
        let bytes = bytes_of(key.1, key.2);
        self.active_bytes = self.active_bytes.saturating_sub(bytes);
        self.active_buffers = self.active_buffers.saturating_sub(1);
        let Some(b) = self.buckets.get_mut(&key) else {
            return Some(buf);
        };
        b.live = b.live.saturating_sub(1);
        let keep =
            b.demanded && b.live + b.free.len() < b.peak && self.free_bytes + bytes <= pool_limit();
        if keep {
            b.free.push(buf);
            self.free_bytes += bytes;
            self.free_buffers += 1;
            return None;
        }
        if b.live == 0 && b.free.is_empty() && !b.demanded {
            // A length only ever handed in: forget it, so such lengths do not pile up.
            self.buckets.remove(&key);
        }
        self.released += 1;
        Some(buf)
    }

    /// Takes every free buffer out (for the caller to free outside the lock); with
    /// `forget`, also the peaks and demand of every length (the last user dropped). Buckets
    /// left with nothing live are removed.
    fn release(&mut self, forget: bool) -> Vec<Buffer> {
        let mut out = Vec::with_capacity(self.free_buffers);
        for b in self.buckets.values_mut() {
            out.append(&mut b.free);
            if forget {
                b.peak = b.live;
                b.demanded = false;
            }
        }
        self.buckets.retain(|_, b| b.live > 0);
        self.buckets.shrink_to_fit();
        self.released += out.len() as u64;
        self.free_bytes = 0;
        self.free_buffers = 0;
        out
    }

    /// Takes out every free buffer `owner`'s buckets hold (for the caller to free outside
    /// the lock) and forgets their peaks and demand: the owner thread exited. Its buffers
    /// still live go back to the allocator when they drop.
    fn forget_owner(&mut self, owner: Owner) -> Vec<Buffer> {
        let mut out = Vec::new();
        self.buckets.retain(|k, b| {
            if k.0 != owner {
                return true;
            }
            let bytes = bytes_of(k.1, k.2) * b.free.len();
            self.free_bytes -= bytes;
            self.free_buffers -= b.free.len();
            out.append(&mut b.free);
            b.peak = b.live;
            b.demanded = false;
            b.live > 0
        });
        self.released += out.len() as u64;
        out
    }

    /// Threads the pool keeps buckets for.
    fn owners(&self) -> usize {
        let mut owners: Vec<Owner> = self.buckets.keys().map(|k| k.0).collect();
        owners.sort_unstable();
        owners.dedup();
        owners.len()
    }

    fn stats(&self) -> HostMemoryStats {
        HostMemoryStats {
            active_bytes: self.active_bytes,
            active_bytes_peak: self.active_peak,
            pooled_bytes: self.free_bytes,
            reserved_bytes: self.active_bytes + self.free_bytes,
            reserved_bytes_peak: self.reserved_peak,
            active_buffers: self.active_buffers,
            pooled_buffers: self.free_buffers,
            heap_allocations: allocations(),
            pool_hits: reuses(),
            pool_misses: self.misses,
            pool_miss_bytes: self.miss_bytes,
            pool_releases: self.released,
            users: self.users,
            owners: self.owners(),
        }
    }
}

/// Runs `f` on the pool (made on first use).
fn with_pool<R>(f: impl FnOnce(&mut Pool) -> R) -> R {
    f(POOL.lock().get_or_insert_with(Pool::default))
}

/// The pool's figures now (`torch.cuda.memory_stats()`; see [`HostMemoryStats`]).
pub fn memory_stats() -> HostMemoryStats {
    with_pool(|p| p.stats())
}

/// Sets the peaks of [`memory_stats`] to the current values
/// (`torch.cuda.reset_peak_memory_stats()`).
pub fn reset_peak_memory_stats() {
    with_pool(|p| {
        p.active_peak = p.active_bytes;
        p.reserved_peak = p.active_bytes + p.free_bytes;
    });
}

/// Gives every free buffer the pool holds back to the allocator
/// (`torch.cuda.empty_cache()`): [`HostMemoryStats::pooled_bytes`] drops to 0, live
/// tensors are untouched, and lengths nothing holds are forgotten. The next step of a
/// live model allocates its buffers again and the pool fills back up to their peaks.
pub fn empty_cache() {
    let freed = {
        let mut guard = POOL.lock();
        let Some(p) = guard.as_mut() else {
            return;
        };
        p.release(false)
    };
    drop(freed);
}

/// A model or process group the pool serves: while one lives, the pool keeps the lengths
/// it has served; when the last one drops, the pool frees what it holds and forgets every
/// peak ([Note: pool bound]), as if the process had just started. Each FSDP unit and each
/// process group's world (thread ranks, TCP) holds one.
#[derive(Debug)]
pub struct PoolUser(());

impl PoolUser {
    /// Counts a new user.
    pub fn new() -> PoolUser {
        with_pool(|p| p.users += 1);
        PoolUser(())
    }
}

impl Default for PoolUser {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PoolUser {
    fn drop(&mut self) {
        let freed = with_pool(|p| {
            p.users = p.users.saturating_sub(1);
            match p.users {
                0 => p.release(true),
                _ => Vec::new(),
            }
        });
        drop(freed);
    }
}

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

/// Bytes the pool holds free now ([`HostMemoryStats::pooled_bytes`]).
pub fn pooled_bytes() -> usize {
    POOL.lock().as_ref().map_or(0, |p| p.free_bytes)
}

/// Counts a buffer of `len` elements that came from the heap (an empty one did not).
pub(crate) fn count_allocation(len: usize) {
    if len > 0 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Aborts for a buffer the allocator could not serve (`handle_alloc_error`, as `vec!`).
fn abort_alloc(dtype: DType, len: usize) -> ! {
    std::alloc::handle_alloc_error(
        std::alloc::Layout::from_size_align(
            len.saturating_mul(dtype.size_in_bytes()),
            dtype.size_in_bytes(),
        )
        .unwrap_or(std::alloc::Layout::new::<u8>()),
    )
}

/// A host buffer of `len` elements of `dtype`: a pooled one when there is one (zeroed when
/// `zeroed`, else holding stale values), else a new zeroed allocation. Aborts when the
/// allocator cannot serve it (`handle_alloc_error`, as `vec!` does); [`try_take`] returns
/// the error instead.
pub(crate) fn take(dtype: DType, len: usize, zeroed: bool) -> Buffer {
    try_take(dtype, len, zeroed).unwrap_or_else(|_| abort_alloc(dtype, len))
}

/// [`take`], or [`Error::OutOfMemory`](crate::Error::OutOfMemory) when no pooled buffer
/// fits and the allocator cannot serve a new one. The buffer is not live until a
/// [`Storage`](super::Storage) holds it.
pub(crate) fn try_take(dtype: DType, len: usize, zeroed: bool) -> crate::Result<Buffer> {
    take_inner(current_owner(), dtype, len, zeroed, false)
}

/// A [`Storage`](super::Storage) of a buffer from [`try_take`], counted live under the
/// same lock as the take.
pub(crate) fn try_take_storage(
    dtype: DType,
    len: usize,
    zeroed: bool,
) -> crate::Result<super::Storage> {
    let owner = current_owner();
    let buf = take_inner(owner, dtype, len, zeroed, true)?;
    Ok(super::Storage::counted(buf, owner))
}

/// [`try_take_storage`], aborting as [`take`] does.
pub(crate) fn take_storage(dtype: DType, len: usize, zeroed: bool) -> super::Storage {
    try_take_storage(dtype, len, zeroed).unwrap_or_else(|_| abort_alloc(dtype, len))
}

/// A buffer from `owner`'s bucket, or a new one; counted live (as `owner`'s) when `live`.
fn take_inner(
    owner: Owner,
    dtype: DType,
    len: usize,
    zeroed: bool,
    live: bool,
) -> crate::Result<Buffer> {
    if len < POOL_MIN_LEN {
        return Buffer::try_new_zeroed(dtype, len);
    }
    let key = (owner, dtype, len);
    let hit = with_pool(|p| p.take(key, live));
    if let Some(mut b) = hit {
        REUSES.fetch_add(1, Ordering::Relaxed);
        if zeroed {
            b.fill_zero();
        }
        return Ok(b);
    }
    match Buffer::try_new_zeroed(dtype, len) {
        Ok(b) => {
            count_allocation(len);
            Ok(b)
        }
        Err(e) => {
            if live {
                // Never went live after all.
                with_pool(|p| p.undo_live(key));
            }
            Err(e)
        }
    }
}

/// Counts a host buffer a new [`Storage`](super::Storage) holds as live, as the calling
/// thread's; its owner, for [`give_back`].
pub(crate) fn went_live(buf: &Buffer) -> Owner {
    if buf.len() >= POOL_MIN_LEN && buf.is_host_vec() {
        let owner = current_owner();
        with_pool(|p| p.went_live((owner, buf.dtype(), buf.len())));
        owner
    } else {
        0
    }
}

/// Takes back the host buffer of a dropped tensor, into `owner`'s bucket, when it is within
/// the pool's bound ([Note: pool bound]); other buffers go back to the allocator.
pub(crate) fn give_back(b: Buffer, owner: Owner) {
    if b.len() < POOL_MIN_LEN || !b.is_host_vec() {
        return;
    }
    let freed = with_pool(|p| p.dropped(b, owner));
    drop(freed);
}

#[cfg(test)]
mod tests;
