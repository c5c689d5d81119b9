//! Device memory: a caching allocator with per-rank byte accounting.
//!
//! [`Pool`] (one per device) keeps freed blocks in free lists keyed by (stream, rounded
//! size) instead of returning them to the driver: `cuMemAlloc`/`cuMemFree` synchronize the
//! device, and a training step allocates and frees the same sizes every step. A block is
//! reused only by the stream it was allocated on (stream order makes that safe, as in
//! PyTorch's caching allocator); a buffer that another stream also used must say so with
//! [`DeviceBuffer::record_stream`], and then its block is reused only after an event
//! recorded on that stream at free time has completed. When `cuMemAlloc` fails the pool
//! synchronizes, releases every cached block and tries once more.
//!
//! Sizes are rounded up to 512 B below 1 MiB and to 2 MiB above (few distinct classes, at
//! most 2 MiB of slack per large block, the granularity the driver maps anyway).
//!
//! `FSDP_CUDA_NO_CACHING=1` turns the cache off (PyTorch's
//! `PYTORCH_NO_CUDA_MEMORY_CACHING`): every buffer is its own `cuMemAlloc` of exactly its
//! size and is freed at once (the driver's free waits for the device). Slow; for finding
//! out-of-bounds accesses and use after free (`scripts/cuda-emu.sh` runs a pass with it).
//!
//! Buffers that will live for the whole run (FSDP's [`BufferPool`](crate::fsdp::BufferPool))
//! are made inside [`with_fresh_blocks`]: they take new blocks from the driver instead of
//! cached ones, so they never hold a block that the step's short-lived tensors come back
//! for (made from the cache during the first step, they would leave the second step
//! short of the blocks the first one reused).
//!
//! [`MemAccount`]: bytes held by one rank (or any owner); every buffer is charged to one,
//! so several ranks sharing a GPU (the threads backend) each see their own figures.

use crate::error::{Error, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaStream};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Bytes charged to one owner (a rank): what its live buffers hold, and the peak.
#[derive(Debug, Default)]
pub struct MemAccount {
    allocated: AtomicUsize,
    peak: AtomicUsize,
}

/// A snapshot of a [`MemAccount`] or of a device pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemStats {
    /// Bytes of live buffers (requested sizes).
    pub allocated: usize,
    /// Highest `allocated` seen.
    pub peak: usize,
    /// Bytes the pool holds from the driver, cached blocks included (pool stats only; 0
    /// for an account).
    pub reserved: usize,
}

impl MemAccount {
    /// A new account with nothing charged.
    pub fn new() -> Arc<MemAccount> {
        Arc::new(MemAccount::default())
    }

    /// Current and peak bytes.
    pub fn stats(&self) -> MemStats {
        MemStats {
            allocated: self.allocated.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            reserved: 0,
        }
    }

    fn charge(&self, bytes: usize) {
        let now = self.allocated.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn release(&self, bytes: usize) {
        self.allocated.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// A cached block waiting for reuse.
struct FreeBlock {
    ptr: CUdeviceptr,
    /// Events recorded at free time on the other streams that used the block.
    pending: Vec<CudaEvent>,
}

/// The per-device cache of free blocks (see the module docs).
pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    /// (stream id, rounded bytes) -> free blocks.
    free: Mutex<HashMap<(usize, usize), Vec<FreeBlock>>>,
    reserved: AtomicUsize,
    account: Arc<MemAccount>,
}

fn round_size(bytes: usize) -> usize {
    const SMALL: usize = 512;
    const LARGE: usize = 2 << 20;
    if bytes <= 1 << 20 {
        bytes.max(1).div_ceil(SMALL) * SMALL
    } else {
        bytes.div_ceil(LARGE) * LARGE
    }
}

thread_local! {
    static FRESH: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the calling thread's allocations taking new blocks from the driver rather
/// than cached ones (see the module docs): for buffers kept for the whole run.
pub fn with_fresh_blocks<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            FRESH.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(FRESH.with(|c| c.replace(true)));
    f()
}

/// `FSDP_CUDA_NO_CACHING=1`: no cache, exact sizes (see the module docs).
fn no_caching() -> bool {
    static NO_CACHING: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NO_CACHING.get_or_init(|| std::env::var("FSDP_CUDA_NO_CACHING").is_ok_and(|v| v == "1"))
}

/// The id the pool keys a stream by: its driver handle.
pub(crate) fn stream_id(s: &CudaStream) -> usize {
    s.cu_stream() as usize
}

impl Pool {
    pub(crate) fn new(ctx: Arc<CudaContext>, ordinal: usize) -> Pool {
        Pool {
            ctx,
            ordinal,
            free: Mutex::new(HashMap::new()),
            reserved: AtomicUsize::new(0),
            account: MemAccount::new(),
        }
    }

    /// The whole device's figures: live bytes over all accounts, peak, bytes reserved.
    pub(crate) fn stats(&self) -> MemStats {
        MemStats {
            reserved: self.reserved.load(Ordering::Relaxed),
            ..self.account.stats()
        }
    }

    fn take_cached(&self, key: (usize, usize)) -> Option<CUdeviceptr> {
        let mut free = self.free.lock();
        let list = free.get_mut(&key)?;
        let pos = list.iter().position(|b| {
            b.pending.iter().all(|e| {
                crate::backend::counters::count_event_query();
                e.is_complete()
            })
        })?;
        Some(list.swap_remove(pos).ptr)
    }

    fn malloc(&self, bytes: usize) -> Result<CUdeviceptr> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda(format!("binding cuda:{}", self.ordinal), e))?;
        crate::backend::counters::count_device_alloc();
        // SAFETY: the context is current on this thread; the pointer is freed by `empty_cache`
        // or `Drop` only.
        match unsafe { cu::malloc_sync(bytes) } {
            Ok(p) => Ok(p),
            Err(_) => {
                // Out of memory, maybe because of cached blocks: give them back and retry.
                self.empty_cache()?;
                crate::backend::counters::count_device_alloc();
                // SAFETY: as above.
                unsafe { cu::malloc_sync(bytes) }.map_err(|e| {
                    Error::cuda(
                        format!(
                            "cuMemAlloc of {bytes} B on cuda:{} ({} B reserved by this process)",
                            self.ordinal,
                            self.reserved.load(Ordering::Relaxed)
                        ),
                        e,
                    )
                })
            }
        }
    }

    /// Synchronizes the device and returns every cached block to the driver.
    pub(crate) fn empty_cache(&self) -> Result<()> {
        crate::backend::counters::count_host_sync();
        self.ctx
            .synchronize()
            .map_err(|e| Error::cuda(format!("synchronizing cuda:{}", self.ordinal), e))?;
        let blocks: Vec<((usize, usize), Vec<FreeBlock>)> = self.free.lock().drain().collect();
        for ((_, size), list) in blocks {
            for b in list {
                crate::backend::counters::count_device_free();
                // SAFETY: the device is idle and the block is not referenced by any buffer.
                unsafe { cu::free_sync(b.ptr) }
                    .map_err(|e| Error::cuda(format!("cuMemFree on cuda:{}", self.ordinal), e))?;
                self.reserved.fetch_sub(size, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// A buffer of at least `bytes` bytes for use on `stream`, charged to `account`.
    /// Contents are undefined.
    pub(crate) fn alloc(
        self: &Arc<Self>,
        bytes: usize,
        stream: &Arc<CudaStream>,
        account: &Arc<MemAccount>,
    ) -> Result<DeviceBuffer> {
        crate::backend::counters::count_allocator_request();
        let size = if no_caching() {
            bytes.max(1)
        } else {
            round_size(bytes)
        };
        let key = (stream_id(stream), size);
        let cached = if no_caching() || FRESH.with(std::cell::Cell::get) {
            None
        } else {
            self.take_cached(key)
        };
        let ptr = match cached {
            Some(p) => p,
            None => {
                if crate::backend::counters::alloc_debug() {
                    // Why the cache missed: no block of this size for this stream, or only
                    // blocks whose other streams' events have not completed.
                    let waiting = self.free.lock().get(&key).map_or(0, Vec::len);
                    eprintln!(
                        "fsdp: cache miss for {size} B on stream {:#x}: {waiting} cached block(s) of that size wait on events",
                        key.0
                    );
                }
                let p = self.malloc(size)?;
                self.reserved.fetch_add(size, Ordering::Relaxed);
                p
            }
        };
        account.charge(bytes);
        self.account.charge(bytes);
        Ok(DeviceBuffer {
            ptr,
            bytes,
            key,
            pool: self.clone(),
            account: account.clone(),
            other_streams: Mutex::new(Vec::new()),
        })
    }
}

/// One device allocation from the caching allocator, owned: freeing returns the block to
/// the pool for the stream it was allocated on. Sizes are in bytes; typed views are
/// [`super::DeviceTensor`]s.
pub struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: usize,
    key: (usize, usize),
    pool: Arc<Pool>,
    account: Arc<MemAccount>,
    other_streams: Mutex<Vec<Arc<CudaStream>>>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer({} B on cuda:{})",
            self.bytes, self.pool.ordinal
        )
    }
}

impl DeviceBuffer {
    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Requested size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Ordinal of the device the buffer is on.
    pub fn ordinal(&self) -> usize {
        self.pool.ordinal
    }

    /// Marks the buffer as used by `stream` as well as its own (PyTorch's
    /// `Tensor.record_stream`): when freed, its block waits for that stream's work
    /// queued so far before anyone reuses it.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) {
        if stream_id(stream) == self.key.0 {
            return;
        }
        let mut others = self.other_streams.lock();
        if !others.iter().any(|s| stream_id(s) == stream_id(stream)) {
            others.push(stream.clone());
        }
    }
}

/// How a CUDA [`Tensor`](crate::tensor::Tensor)'s storage holds its block: the tensor
/// layer sees an ordinal and a size, and `Tensor::as_device_tensor` downcasts back.
impl crate::tensor::DeviceAllocation for DeviceBuffer {
    fn ordinal(&self) -> usize {
        DeviceBuffer::ordinal(self)
    }

    fn len_bytes(&self) -> usize {
        DeviceBuffer::len_bytes(self)
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if no_caching() {
            self.account.release(self.bytes);
            self.pool.account.release(self.bytes);
            // The driver's free waits for the device's work on the block. An error leaks it.
            if self.pool.ctx.bind_to_thread().is_ok() {
                crate::backend::counters::count_device_free();
                // SAFETY: the context is current; no other buffer refers to the block.
                if unsafe { cu::free_sync(self.ptr) }.is_ok() {
                    self.pool.reserved.fetch_sub(self.key.1, Ordering::Relaxed);
                }
            }
            return;
        }
        // Errors here cannot be returned: an event that fails to record leaves the block
        // out of the cache (leaked until the process ends) rather than risking reuse.
        let mut pending = Vec::new();
        for s in self.other_streams.lock().drain(..) {
            match s.record_event(None) {
                Ok(e) => pending.push(e),
                Err(_) => {
                    self.account.release(self.bytes);
                    self.pool.account.release(self.bytes);
                    return;
                }
            }
        }
        self.account.release(self.bytes);
        self.pool.account.release(self.bytes);
        self.pool
            .free
            .lock()
            .entry(self.key)
            .or_default()
            .push(FreeBlock {
                ptr: self.ptr,
                pending,
            });
    }
}
