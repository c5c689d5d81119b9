//! CUDA memory and streams at the boundary: the host's `stream` argument ordered with
//! fsdp's streams, and copies between the host's device memory (a `kDLCUDA` `DLTensor`)
//! and fsdp's device tensors.
//!
//! Every call that touches tensor memory takes the host's stream (a `CUstream` /
//! `cudaStream_t` as `void *`; NULL is the legacy default stream) and runs through
//! [`on_stream`]:
//!
//! 1. at entry, an event is recorded on the host's stream and fsdp's stream of the calling
//!    thread (its current stream on the model's device, where fsdp queues its own copies,
//!    casts and fills, and after which its unshard and post-backward streams order their
//!    jobs: `distributed::work`) waits on it: whatever the host queued before the call
//!    (the gradients it wrote, its last reads of parameters it is done with) comes first;
//! 2. at exit, an event is recorded on fsdp's stream and the host's stream waits on it: the
//!    host's later work sees what the call produced (gathered parameters, zeroed gradient
//!    buffers, a collective's result) and may reuse the memory fsdp read from.
//!
//! Neither side blocks the host thread on the device for this (FSDP2's
//! `wait_stream`/`record_stream` discipline between the default stream and its own). A
//! gather or collective that fsdp waits for inside the call (`Work::wait`, a device-side
//! wait of fsdp's stream on the job's event) is thereby ordered before the host's later
//! work too: the exit event is recorded after that wait.
//!
//! On the CPU (a model whose `fsdp_config.device` is `kDLCPU`, host-memory tensors) the
//! stream must be NULL. A build without the `cuda` feature refuses CUDA tensors and
//! devices with `FSDP_ERR_UNSUPPORTED`.

use super::{Fail, Res, FSDP_ERR_UNSUPPORTED};
use fsdp::backend::Device;
use fsdp::tensor::{DType, Tensor};
use std::ffi::c_void;

/// Runs `body` for a call on `device` with the host's `stream`, ordered as the module
/// docs say (on the CPU: `stream` must be NULL). The exit ordering runs after a failed
/// body too, so that nothing fsdp queued outlives the host's view of it unordered; the
/// body's error wins.
pub(crate) fn on_stream<R>(
    device: Device,
    stream: *mut c_void,
    body: impl FnOnce() -> Res<R>,
) -> Res<R> {
    match device {
        Device::Cuda(i) => {
            imp::fsdp_after_host(i, stream)?;
            let r = body();
            let done = imp::host_after_fsdp(i, stream);
            let v = r?;
            done.map(|()| v)
        }
        _ => {
            check_null(stream, device)?;
            body()
        }
    }
}

/// A stream given for host memory: refused (it orders nothing there).
fn check_null(stream: *mut c_void, device: Device) -> Res {
    if stream.is_null() {
        return Ok(());
    }
    let on = match device {
        Device::Meta => "no device",
        _ => "the CPU (host memory)",
    };
    Err(Fail::arg(format!(
        "stream {stream:p}: this call's tensors are on {on}, where the stream must be NULL; a CUstream orders work on a CUDA device (a model whose fsdp_config.device is kDLCUDA, or kDLCUDA tensors)"
    )))
}

/// The `FSDP_ERR_UNSUPPORTED` of a build without the `cuda` feature.
#[allow(dead_code)]
pub(crate) fn no_cuda(what: &str) -> Fail {
    Fail::new(
        FSDP_ERR_UNSUPPORTED,
        format!("{what}: {}", fsdp::backend::cuda::no_cuda_build()),
    )
}

/// A new fsdp tensor on `cuda:ordinal` holding a copy of the host's `shape`/`dtype`
/// device memory at `src` (queued on fsdp's stream of this thread).
///
/// # Safety
/// `src` is device memory of `cuda:ordinal` holding the tensor, readable in stream order.
pub(crate) unsafe fn copy_in(
    src: u64,
    dtype: DType,
    shape: &[usize],
    ordinal: usize,
    what: &str,
) -> Res<Tensor> {
    // SAFETY: forwarded.
    unsafe { imp::copy_in(src, dtype, shape, ordinal, what) }
}

/// Copies fsdp's device tensor `src` to the host's device memory at `dst` (queued on
/// fsdp's stream of this thread; `src.nbytes()` bytes).
///
/// # Safety
/// `dst` is device memory of `src`'s device, writable in stream order for those bytes, and
/// does not overlap `src`.
pub(crate) unsafe fn copy_out(dst: u64, src: &Tensor, what: &str) -> Res {
    // SAFETY: forwarded.
    unsafe { imp::copy_out(dst, src, what) }
}

/// The device address of a CUDA tensor's first element.
pub(crate) fn device_ptr(t: &Tensor) -> Res<u64> {
    imp::device_ptr(t)
}

#[cfg(feature = "cuda")]
mod imp {
    use super::super::{Fail, Res};
    use cudarc::driver::{result as cu, sys};
    use fsdp::backend::cuda::{self, DeviceTensor};
    use fsdp::error::Error;
    use fsdp::tensor::{DType, Tensor};
    use std::ffi::c_void;

    fn cuda_fail(what: &str, e: impl std::fmt::Display) -> Fail {
        Error::cuda(what.to_string(), e).into()
    }

    /// Makes stream `waiter` wait for the work queued so far on stream `first` (an event
    /// recorded on `first`, destroyed once the wait is queued, as CUDA allows).
    ///
    /// # Safety
    /// Both are streams (or NULL, the legacy stream) of the context current on this thread.
    unsafe fn order(waiter: sys::CUstream, first: sys::CUstream, what: &str) -> Res {
        let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_fail(what, e))?;
        // SAFETY: a live event; the streams are the caller's promise.
        let r = unsafe {
            cu::event::record(ev, first).and_then(|()| {
                cu::stream::wait_event(waiter, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            })
        };
        // SAFETY: created above, destroyed once; the queued wait keeps what it needs.
        let d = unsafe { cu::event::destroy(ev) };
        r.and(d).map_err(|e| cuda_fail(what, e))
    }

    /// fsdp's stream of this thread on `cuda:ordinal` waits for the host's `stream`.
    pub(super) fn fsdp_after_host(ordinal: usize, stream: *mut c_void) -> Res {
        let s = cuda::current_stream(ordinal)?;
        let what = format!(
            "ordering fsdp's stream after the host's stream {stream:p} on cuda:{ordinal} (a CUstream of that device, or NULL)"
        );
        // SAFETY: current_stream bound the device's context; `stream` is the host's
        // promise (a stream of that device or NULL).
        unsafe { order(s.cu_stream(), stream as sys::CUstream, &what) }
    }

    /// The host's `stream` waits for fsdp's stream of this thread on `cuda:ordinal`.
    pub(super) fn host_after_fsdp(ordinal: usize, stream: *mut c_void) -> Res {
        let s = cuda::current_stream(ordinal)?;
        let what = format!("ordering the host's stream {stream:p} after fsdp's on cuda:{ordinal}");
        // SAFETY: as in fsdp_after_host.
        unsafe { order(stream as sys::CUstream, s.cu_stream(), &what) }
    }

    pub(super) unsafe fn copy_in(
        src: u64,
        dtype: DType,
        shape: &[usize],
        ordinal: usize,
        what: &str,
    ) -> Res<Tensor> {
        let s = cuda::current_stream(ordinal)?;
        let t = DeviceTensor::empty(&s, shape, dtype)?;
        if t.nbytes() > 0 {
            // SAFETY: `t` is a fresh allocation of nbytes; `src` holds as many readable
            // bytes in stream order (the caller's promise).
            unsafe { cu::memcpy_dtod_async(t.ptr(), src, t.nbytes(), s.cu_stream()) }
                .map_err(|e| cuda_fail(&format!("{what}: copying the host's device memory"), e))?;
        }
        Ok(Tensor::from_device_tensor(t))
    }

    pub(super) unsafe fn copy_out(dst: u64, src: &Tensor, what: &str) -> Res {
        let d = src.as_device_tensor()?;
        let s = cuda::current_stream(d.ordinal())?;
        if d.nbytes() > 0 {
            // SAFETY: `d` holds nbytes; `dst` is writable for as many (the caller's
            // promise); the queued copy keeps `d`'s block from reuse by ordering (it was
            // allocated on, and is freed to, this stream).
            unsafe { cu::memcpy_dtod_async(dst, d.ptr(), d.nbytes(), s.cu_stream()) }.map_err(
                |e| cuda_fail(&format!("{what}: copying into the host's device memory"), e),
            )?;
        }
        Ok(())
    }

    pub(super) fn device_ptr(t: &Tensor) -> Res<u64> {
        Ok(t.as_device_tensor()?.ptr())
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::super::Res;
    use super::no_cuda;
    use fsdp::tensor::{DType, Tensor};
    use std::ffi::c_void;

    pub(super) fn fsdp_after_host(_: usize, _: *mut c_void) -> Res {
        Err(no_cuda("a CUDA device"))
    }

    pub(super) fn host_after_fsdp(_: usize, _: *mut c_void) -> Res {
        Err(no_cuda("a CUDA device"))
    }

    pub(super) unsafe fn copy_in(
        _: u64,
        _: DType,
        _: &[usize],
        _: usize,
        what: &str,
    ) -> Res<Tensor> {
        Err(no_cuda(what))
    }

    pub(super) unsafe fn copy_out(_: u64, _: &Tensor, what: &str) -> Res {
        Err(no_cuda(what))
    }

    pub(super) fn device_ptr(_: &Tensor) -> Res<u64> {
        Err(no_cuda("a CUDA tensor"))
    }
}
