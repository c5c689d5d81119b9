//! Streams and events. A [`Stream`] is one CUDA stream of one device plus the memory
//! account its allocations are charged to (normally the rank's), and a lazily created
//! cuBLAS handle bound to it. Work on one stream runs in order; between streams, order
//! only through [`Event`]s ([`Stream::record`], [`Stream::wait`]).
//!
//! FSDP's streams per rank (`fsdp/streams.rs`, after FSDP1's `_init_streams`), built by the runtime once it
//! runs on CUDA tensors: compute; unshard (all-gathers, overlapping the previous unit's
//! compute); post-backward (reduce-scatter and the hybrid all-reduce, overlapping the next
//! unit's backward); pre-unshard (offload H2D copies and low-precision casts).

use super::memory::DeviceBuffer;
use super::CudaDevice;
use super::{MemAccount, MemStats};
use crate::error::{Error, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaEvent, CudaStream};
use parking_lot::Mutex;
use std::sync::Arc;

/// A CUDA stream on one device, with the account its allocations are charged to.
pub struct Stream {
    pub(crate) dev: Arc<CudaDevice>,
    pub(crate) inner: Arc<CudaStream>,
    account: Arc<MemAccount>,
    blas: Mutex<Option<Arc<CudaBlas>>>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(cuda:{})", self.dev.ordinal())
    }
}

/// A recorded point in a stream's work; other streams and the host can wait for it.
pub struct Event {
    pub(crate) inner: CudaEvent,
}

impl Event {
    /// Blocks the host until the work before the event finished.
    ///
    /// # Errors
    /// [`Error::Cuda`] with the first asynchronous error of that work.
    pub fn synchronize(&self) -> Result<()> {
        crate::backend::counters::count_host_sync();
        self.inner
            .synchronize()
            .map_err(|e| Error::cuda("waiting for a CUDA event", e))
    }

    /// Whether the work before the event finished (never blocks).
    pub fn is_complete(&self) -> bool {
        crate::backend::counters::count_event_query();
        self.inner.is_complete()
    }

    /// As [`Event::is_complete`], but an error of that work (a faulting kernel, a sticky
    /// context error) is returned instead of reading as "not finished yet", so a poll loop
    /// fails at once rather than spinning until its timeout.
    ///
    /// # Errors
    /// [`Error::Cuda`] with the first asynchronous error of that work.
    pub fn query(&self) -> Result<bool> {
        crate::backend::counters::count_event_query();
        self.inner
            .try_is_complete()
            .map_err(|e| Error::cuda("querying a CUDA event", e))
    }

    /// Milliseconds between `self` and a later event `end` (both recorded with timing,
    /// as [`Stream::record`] does).
    ///
    /// # Errors
    /// [`Error::Cuda`] when either has not completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.inner
            .elapsed_ms(&end.inner)
            .map_err(|e| Error::cuda("reading CUDA event times", e))
    }
}

impl Stream {
    /// A new stream on `dev` charging its allocations to `account` (pass the rank's
    /// account; [`MemAccount::new`] for a private one).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the driver cannot create the stream.
    pub fn new(dev: &Arc<CudaDevice>, account: Arc<MemAccount>) -> Result<Stream> {
        let inner = dev
            .ctx
            .new_stream()
            .map_err(|e| Error::cuda(format!("creating a stream on cuda:{}", dev.ordinal()), e))?;
        Ok(Stream {
            dev: dev.clone(),
            inner,
            account,
            blas: Mutex::new(None),
        })
    }

    /// The device.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    /// The driver's handle of this stream, for ordering work this crate does not issue
    /// with it (the C ABI orders a host's `CUstream` after it with events). Valid while
    /// this `Stream` lives; work queued on it through the handle is not seen by the
    /// stream's memory account.
    pub fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.inner.cu_stream()
    }

    /// The account this stream's allocations are charged to.
    pub fn account(&self) -> &Arc<MemAccount> {
        &self.account
    }

    /// Bytes live and peak of this stream's account.
    pub fn mem_stats(&self) -> MemStats {
        self.account.stats()
    }

    /// Bytes live, peak and reserved over the whole device (every account).
    pub fn device_mem_stats(&self) -> MemStats {
        self.dev.pool.stats()
    }

    /// `bytes` bytes of uninitialized device memory for use on this stream.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is out of memory even after emptying the cache.
    pub fn alloc_bytes(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.dev.pool.alloc(bytes, &self.inner, &self.account)
    }

    /// `bytes` bytes for a CUDA graph's constant (a kernel's argument table, Adam's step
    /// count): while a graph region is recorded, a block of the graph's that no other
    /// buffer of the graph uses, kept for the graph once freed (`memory.rs`); otherwise as
    /// [`alloc_bytes`](Self::alloc_bytes).
    ///
    /// # Errors
    /// As [`alloc_bytes`](Self::alloc_bytes); during a capture, when the warm-up made no
    /// constant of that size.
    pub(crate) fn alloc_graph_constant(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.dev
            .pool
            .alloc_constant(bytes, &self.inner, &self.account)
    }

    /// Records an event (with timing) after the work queued so far.
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver.
    pub fn record(&self) -> Result<Event> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        self.inner
            .record_event(Some(flags))
            .map(|inner| Event { inner })
            .map_err(|e| Error::cuda("recording a CUDA event", e))
    }

    /// Makes this stream's later work wait for `event` (no host blocking).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver.
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.inner
            .wait(&event.inner)
            .map_err(|e| Error::cuda("making a stream wait for an event", e))
    }

    /// Blocks the host until this stream's work finished.
    ///
    /// # Errors
    /// [`Error::Cuda`] with the first asynchronous error (e.g. a faulting kernel).
    pub fn synchronize(&self) -> Result<()> {
        crate::backend::counters::count_host_sync();
        self.inner.synchronize().map_err(|e| {
            Error::cuda(
                format!("synchronizing a stream on cuda:{}", self.dev.ordinal()),
                e,
            )
        })
    }

    /// Makes this stream's device context current on the calling thread (raw driver calls
    /// such as `cuMemcpyHtoDAsync` use the thread's current context; a rank or
    /// communication thread has none until something binds it).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver.
    pub(crate) fn bind(&self) -> Result<()> {
        self.dev.bind_to_thread()
    }

    /// Whether this stream is capturing a CUDA graph (`cuStreamIsCapturing`: its work is
    /// recorded, not run; also while an invalidated capture has not ended).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver.
    pub fn is_capturing(&self) -> Result<bool> {
        use cudarc::driver::sys::CUstreamCaptureStatus as S;
        self.inner
            .capture_status()
            .map(|st| st != S::CU_STREAM_CAPTURE_STATUS_NONE)
            .map_err(|e| Error::cuda("cuStreamIsCapturing", e))
    }

    /// Marks `buf` as used by this stream (see [`DeviceBuffer::record_stream`]).
    pub fn record_use(&self, buf: &DeviceBuffer) {
        buf.record_stream(&self.inner);
    }

    /// The cuBLAS handle bound to this stream, created on first use.
    ///
    /// # Errors
    /// [`Error::Cuda`] when libcublas cannot be loaded (`"no cuBLAS library found
    /// (libcublas.so)"`) or the handle cannot be created.
    pub(crate) fn blas(&self) -> Result<Arc<CudaBlas>> {
        let mut slot = self.blas.lock();
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        // SAFETY: only tries to dlopen libcublas by its usual names.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(Error::cuda(
                "no cuBLAS library found (libcublas.so)",
                "install CUDA's cuBLAS (e.g. the nvidia-cublas wheel) and put its lib folder on LD_LIBRARY_PATH",
            ));
        }
        let b = Arc::new(
            CudaBlas::new(self.inner.clone())
                .map_err(|e| Error::cuda("creating a cuBLAS handle", e))?,
        );
        *slot = Some(b.clone());
        Ok(b)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Finish this stream's work before its handle can be destroyed and reused: the
        // pool keys cached blocks by stream handle, so a new stream that got the same
        // handle must not reuse a block that the old stream's kernels still touch.
        // An error here was already reported to whoever synchronized last; it cannot be
        // returned from `drop`.
        let _ = self.inner.synchronize();
    }
}
