//! Page-locked ("pinned") host memory and the asynchronous copies it allows.
//!
//! A copy between the device and pageable host memory cannot run behind the host's back:
//! to the device the driver stages the source before `cuMemcpyHtoDAsync` returns, and to
//! the host `cuMemcpyDtoHAsync` waits for the stream (a host-blocking synchronization).
//! Memory from `cuMemHostAlloc` can be read and written by the device's copy engines
//! directly, so both copies are queued on the stream and the host goes on. The price is
//! the ordering: the host must not write a pinned source before the copy that reads it
//! ran, nor read a pinned destination before the copy that fills it ran. Those are the
//! caller's to arrange (FSDP's CPU offload: one synchronization at the end of backward,
//! `fsdp/runtime.rs`), as with PyTorch's `copy_(src, non_blocking=True)` on pinned memory.
//!
//! A [`PinnedBuffer`] is the storage of a pinned CPU [`Tensor`] (`Buffer::Pinned`): the
//! CPU ops treat it as any host tensor. Allocations are counted
//! ([`Counters::pinned_allocs`](crate::backend::counters::Counters::pinned_allocs)); FSDP
//! keeps its pinned buffers from step to step (`fsdp::BufferPool`), as `cuMemHostAlloc`
//! and `cuMemFreeHost` are slow and may synchronize the device.

use super::{current_stream, CudaDevice, DeviceTensor};
use crate::error::{Error, Result};
use crate::tensor::{Buffer, DType, HostAllocation, Tensor};
use cudarc::driver::result as cu;
use std::sync::Arc;

/// `CU_MEMHOSTALLOC_PORTABLE`: the memory counts as pinned in every context (ranks on
/// other GPUs of the process copy through it too).
const PORTABLE: u32 = 0x01;

/// One `cuMemHostAlloc` allocation, freed with `cuMemFreeHost` when dropped.
pub struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
    dev: Arc<CudaDevice>,
}

// SAFETY: the buffer owns its allocation; access to the bytes goes through the storage's
// lock (host) or stream-ordered copies the owner orders (device).
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedBuffer({} B)", self.bytes)
    }
}

impl PinnedBuffer {
    /// `bytes` zeroed bytes of page-locked host memory, allocated in `cuda:ordinal`'s
    /// context (portable: usable from every context).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is unavailable or the allocation fails.
    pub fn zeroed(ordinal: usize, bytes: usize) -> Result<PinnedBuffer> {
        let dev = CudaDevice::get(ordinal)?;
        dev.ctx
            .bind_to_thread()
            .map_err(|e| Error::cuda(format!("binding cuda:{ordinal}"), e))?;
        crate::backend::counters::count_pinned_alloc();
        // At least one byte: a zero-length tensor still gets a valid, unique address.
        // SAFETY: the context is current; the pointer is freed by `Drop` only.
        let p = unsafe { cu::malloc_host(bytes.max(1), PORTABLE) }
            .map_err(|e| Error::cuda(format!("cuMemHostAlloc of {bytes} B"), e))?;
        let ptr = p.cast::<u8>();
        // SAFETY: the allocation holds at least `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(PinnedBuffer { ptr, bytes, dev })
    }
}

// SAFETY: `ptr` is a live `cuMemHostAlloc` allocation of at least `bytes` bytes (page
// aligned), owned by this buffer until it drops.
unsafe impl HostAllocation for PinnedBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn len_bytes(&self) -> usize {
        self.bytes
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // An error leaks the allocation (nothing to return it to).
        if self.dev.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc`, freed once; no tensor views it any
            // more, and the driver's free waits for copies still using it.
            let _ = unsafe { cu::free_host(self.ptr.cast()) };
        }
    }
}

/// A zeroed pinned CPU tensor of `shape` and `dtype` (`torch.zeros(..).pin_memory()`),
/// page-locked for `cuda:ordinal` (and every other device of the process).
///
/// # Errors
/// [`Error::Cuda`] when the device is unavailable or the allocation fails.
pub fn pinned_zeros(shape: &[usize], dtype: DType, ordinal: usize) -> Result<Tensor> {
    let len = crate::tensor::numel_of(shape);
    let buf = PinnedBuffer::zeroed(ordinal, len * dtype.size_in_bytes())?;
    Ok(Tensor::from_buffer_at(
        Buffer::Pinned {
            buf: Arc::new(buf),
            dtype,
            len,
        },
        0,
        shape,
    ))
}

/// `dst = src` (same element count and dtype) between a CUDA tensor and a pinned CPU
/// tensor, queued on the calling thread's current stream of the CUDA side's device with no
/// host wait (`copy_(src, non_blocking=True)`). `Ok(false)` when the pair is not one of a
/// pinned and a CUDA tensor of one dtype (the caller copies another way).
///
/// The host must not write a pinned source, nor read a pinned destination, before the
/// stream's work up to here has run (see the module docs), and both tensors must outlive
/// that work.
///
/// # Errors
/// [`Error::Cuda`] when the copy cannot be queued.
pub(crate) fn copy_async(dst: &Tensor, src: &Tensor) -> Result<bool> {
    if dst.dtype() != src.dtype() || dst.numel() != src.numel() {
        return Ok(false);
    }
    let bytes = dst.nbytes();
    match (dst.device().is_cuda(), src.device().is_cuda()) {
        (true, false) => {
            let Some(host) = src.pinned_ptr() else {
                return Ok(false);
            };
            let d: DeviceTensor = dst.as_device_tensor()?;
            let s = current_stream(d.ordinal())?;
            if bytes > 0 {
                // SAFETY: `host` points to `bytes` bytes of the pinned source view (the
                // storage outlives the copy: the caller's contract); the device range is
                // the destination view.
                let data = unsafe { std::slice::from_raw_parts(host.cast_const(), bytes) };
                s.bind()?;
                unsafe { cu::memcpy_htod_async(d.ptr(), data, s.inner.cu_stream()) }
                    .map_err(|e| Error::cuda("cuMemcpyHtoDAsync (pinned)", e))?;
            }
            Ok(true)
        }
        (false, true) => {
            let Some(host) = dst.pinned_ptr() else {
                return Ok(false);
            };
            let d: DeviceTensor = src.as_device_tensor()?;
            let s = current_stream(d.ordinal())?;
            if bytes > 0 {
                // SAFETY: as above, for the destination view.
                let data = unsafe { std::slice::from_raw_parts_mut(host, bytes) };
                s.bind()?;
                unsafe { cu::memcpy_dtoh_async(data, d.ptr(), s.inner.cu_stream()) }
                    .map_err(|e| Error::cuda("cuMemcpyDtoHAsync (pinned)", e))?;
            }
            Ok(true)
        }
        _ => Ok(false),
    }
}
