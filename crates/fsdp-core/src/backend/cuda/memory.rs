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
//! Buffers that will live for the whole run (FSDP's `BufferPool`, `fsdp::fsdp`)
//! are made inside [`with_fresh_blocks`]: they take new blocks from the driver instead of
//! cached ones, so they never hold a block that the step's short-lived tensors come back
//! for (made from the cache during the first step, they would leave the second step
//! short of the blocks the first one reused).
//!
//! A CUDA graph's buffers come from a graph-private pool ([`PrivatePool`], PyTorch's
//! graph pool handle): while a region of a graph is recorded ([`Pool::set_private`],
//! `graph.rs`) every allocation on the device takes its block from that pool (a block freed
//! there goes back to it), so the blocks a captured step used stay the graph's, at the same
//! addresses, for every replay. A block that waits on another stream's event is not reused
//! inside the region (querying the event would be an error during a capture).
//!
//! A graph's constants (tables of kernel arguments, Adam's step count: written once before
//! the first launch, read at every replay) take blocks of their own
//! ([`Stream::alloc_graph_constant`](super::Stream::alloc_graph_constant)): a block that
//! other work of the graph also used, earlier in the step, would be overwritten by that
//! work at every replay before the constant is read. So they never share a block with
//! anything else: constant blocks are made during the warm-up, kept apart from the
//! region's other blocks, and served to the capture's constants only.
//!
//! [`MemAccount`]: bytes held by one rank (or any owner); every buffer is charged to one,
//! so several ranks sharing a GPU (the threads backend) each see their own figures.

use super::{MemAccount, MemStats};
use crate::error::{Error, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaStream};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A cached block waiting for reuse.
struct FreeBlock {
    ptr: CUdeviceptr,
    /// Events recorded at free time on the other streams that used the block.
    pending: Vec<CudaEvent>,
}

/// Free blocks of one CUDA graph (see the module docs), and whether a capture is under way
/// (then a miss is an error instead of a `cuMemAlloc`).
pub(crate) struct PrivatePool {
    device: Arc<Pool>,
    free: Mutex<HashMap<(usize, usize), Vec<FreeBlock>>>,
    /// Free blocks for the graph's constants only (never served to other buffers).
    consts: Mutex<HashMap<(usize, usize), Vec<FreeBlock>>>,
    /// Blocks of constants freed inside the region: not reused inside it (a captured graph
    /// reads them at every replay); they join `consts` at the end of a warm-up.
    held: Mutex<Vec<((usize, usize), FreeBlock)>>,
    capturing: std::sync::atomic::AtomicBool,
}

impl PrivatePool {
    /// An empty pool of `device`'s blocks.
    pub(crate) fn new(device: Arc<Pool>) -> Arc<PrivatePool> {
        Arc::new(PrivatePool {
            device,
            free: Mutex::new(HashMap::new()),
            consts: Mutex::new(HashMap::new()),
            held: Mutex::new(Vec::new()),
            capturing: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Makes the held blocks reusable by the next region's constants (the end of a
    /// warm-up region).
    pub(crate) fn release_held(&self) {
        let held = std::mem::take(&mut *self.held.lock());
        let mut consts = self.consts.lock();
        for (key, b) in held {
            consts.entry(key).or_default().push(b);
        }
    }

    /// Forgets the completed events the free blocks wait on (outside a capture: each is a
    /// query), so that the blocks a warm-up freed behind another stream's work serve the
    /// capture.
    pub(crate) fn settle(&self) {
        for list in [&self.free, &self.consts] {
            for blocks in list.lock().values_mut() {
                for b in blocks.iter_mut() {
                    b.pending.retain(|e| {
                        crate::backend::counters::count_event_query();
                        !e.is_complete()
                    });
                }
            }
        }
    }

    /// Marks a capture as under way (true) or over.
    pub(crate) fn set_capturing(&self, on: bool) {
        self.capturing.store(on, Ordering::Relaxed);
    }

    /// A free block of `key` for a constant (`constant`) or any other buffer.
    fn take(&self, key: (usize, usize), constant: bool) -> Option<CUdeviceptr> {
        let mut free = if constant {
            self.consts.lock()
        } else {
            self.free.lock()
        };
        let list = free.get_mut(&key)?;
        let pos = list.iter().position(|b| b.pending.is_empty())?;
        Some(list.swap_remove(pos).ptr)
    }
}

impl Drop for PrivatePool {
    fn drop(&mut self) {
        // No graph or buffer uses the blocks any more: they join the device's cache.
        self.release_held();
        let mut mine = std::mem::take(&mut *self.free.lock());
        let consts = std::mem::take(&mut *self.consts.lock());
        let mut all = self.device.free.lock();
        for (key, list) in mine.drain().chain(consts) {
            all.entry(key).or_default().extend(list);
        }
    }
}

/// The per-device cache of free blocks (see the module docs).
pub(crate) struct Pool {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    /// (stream id, rounded bytes) -> free blocks.
    free: Mutex<HashMap<(usize, usize), Vec<FreeBlock>>>,
    reserved: AtomicUsize,
    account: Arc<MemAccount>,
    /// The graph pool allocations go to while a graph region is recorded.
    private: Mutex<Option<Arc<PrivatePool>>>,
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
            private: Mutex::new(None),
        }
    }

    /// Routes the device's allocations to `pool` (None: back to the device's cache).
    pub(crate) fn set_private(&self, pool: Option<Arc<PrivatePool>>) {
        *self.private.lock() = pool;
    }

    /// Whether buffers are cached (not under `FSDP_CUDA_NO_CACHING=1`).
    pub(crate) fn caching() -> bool {
        !no_caching()
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
        self.alloc_as(bytes, stream, account, false)
    }

    /// [`Pool::alloc`] for a CUDA graph's constant (see the module docs): inside a graph
    /// region, a block of the graph's that no other buffer uses, held for the graph once
    /// freed; elsewhere an ordinary buffer.
    pub(crate) fn alloc_constant(
        self: &Arc<Self>,
        bytes: usize,
        stream: &Arc<CudaStream>,
        account: &Arc<MemAccount>,
    ) -> Result<DeviceBuffer> {
        self.alloc_as(bytes, stream, account, true)
    }

    fn alloc_as(
        self: &Arc<Self>,
        bytes: usize,
        stream: &Arc<CudaStream>,
        account: &Arc<MemAccount>,
        constant: bool,
    ) -> Result<DeviceBuffer> {
        crate::backend::counters::count_allocator_request();
        let size = if no_caching() {
            bytes.max(1)
        } else {
            round_size(bytes)
        };
        let key = (stream_id(stream), size);
        let private = self.private.lock().clone();
        if let Some(pp) = private {
            return self.alloc_private(pp, bytes, key, account, constant);
        }
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
        Ok(self.buffer(ptr, bytes, key, account, None))
    }

    /// The buffer of block `ptr` (`key`), `bytes` charged to `account` and the device;
    /// `private`: the graph pool it belongs to, and whether it is a graph's constant.
    fn buffer(
        self: &Arc<Self>,
        ptr: CUdeviceptr,
        bytes: usize,
        key: (usize, usize),
        account: &Arc<MemAccount>,
        private: Option<(Arc<PrivatePool>, bool)>,
    ) -> DeviceBuffer {
        account.charge(bytes);
        self.account.charge(bytes);
        let hold = private.as_ref().is_some_and(|p| p.1);
        DeviceBuffer {
            ptr,
            bytes,
            key,
            pool: self.clone(),
            account: account.clone(),
            other_streams: Mutex::new(Vec::new()),
            private: private.map(|p| p.0),
            hold,
        }
    }

    /// [`Pool::alloc`] from a graph's pool: a cached block of it (of its constants' blocks
    /// for a `constant`), else (outside a capture) a new block from the driver that becomes
    /// the graph's.
    fn alloc_private(
        self: &Arc<Self>,
        pp: Arc<PrivatePool>,
        bytes: usize,
        key: (usize, usize),
        account: &Arc<MemAccount>,
        constant: bool,
    ) -> Result<DeviceBuffer> {
        let ptr = match pp.take(key, constant) {
            Some(p) => p,
            None if pp.capturing.load(Ordering::Relaxed) => {
                return Err(Error::cuda(
                    format!(
                        "allocating {bytes} B on cuda:{} during a CUDA graph capture",
                        self.ordinal
                    ),
                    "the warm-up run left no free block of that size in the graph's pool (cuMemAlloc is not permitted while capturing): the captured step must allocate as the warm-up did",
                ));
            }
            None => {
                let p = self.malloc(key.1)?;
                self.reserved.fetch_add(key.1, Ordering::Relaxed);
                p
            }
        };
        Ok(self.buffer(ptr, bytes, key, account, Some((pp, constant))))
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
    /// The graph pool the block belongs to, if any (freed back there).
    private: Option<Arc<PrivatePool>>,
    /// A graph's constant: freed into the graph pool's held blocks, not its free ones.
    hold: bool,
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
        let block = FreeBlock {
            ptr: self.ptr,
            pending,
        };
        match &self.private {
            Some(pp) if self.hold => pp.held.lock().push((self.key, block)),
            Some(pp) => pp.free.lock().entry(self.key).or_default().push(block),
            None => self
                .pool
                .free
                .lock()
                .entry(self.key)
                .or_default()
                .push(block),
        }
    }
}
