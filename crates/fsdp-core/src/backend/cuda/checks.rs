//! Index checks of device kernels, reported at the next host read instead of with a
//! synchronization of their own: PyTorch's device-side asserts (an out-of-range class or
//! token id fails later, at a synchronizing call), but with the op's own message.
//!
//! A kernel that validates indices (embedding, cross-entropy) writes the first bad
//! position into an 8-byte flag (`u64::MAX` when all are in range) taken with [`flag`] and
//! registers the op's message with [`defer`], on the calling thread. The flags are slots
//! of one device buffer per stream and thread, allocated once, so a check allocates
//! nothing (a step's kernels would otherwise take a new block each, held until the next
//! read). The next [`DeviceTensor::to_vec`](super::DeviceTensor::to_vec) on that thread
//! queues one copy of each stream's used slots before its own copy, so one
//! synchronization serves both, and returns the first flagged op's error instead of the
//! data; the slots are then free again (reused in stream order, behind that copy). More
//! than [`MAX_PENDING`] flags on one stream without a read are checked at once.

use super::memory::{stream_id, DeviceBuffer};
use super::{CudaDevice, Stream};
use crate::error::{Error, Result};
use cudarc::driver::result as cu;
use cudarc::driver::CudaStream;
use std::cell::RefCell;
use std::sync::Arc;

/// Flags kept on one stream without a host read before they are checked on their own.
const MAX_PENDING: usize = 64;

/// The message of a flagged op, given the first bad position.
pub(crate) type Report = Box<dyn Fn(usize) -> Error>;

/// One stream's flag slots on this thread: slot `i` belongs to `reports[i]`.
struct Slab {
    dev: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    /// `MAX_PENDING` u64 slots.
    buf: DeviceBuffer,
    reports: Vec<Report>,
}

/// The registered flags of one stream, and where their values land on the host.
pub(crate) struct Pending {
    stream: Arc<CudaStream>,
    host: Vec<u64>,
    reports: Vec<Report>,
}

thread_local! {
    static SLABS: RefCell<Vec<Slab>> = const { RefCell::new(Vec::new()) };
}

/// The device address of a flag for a kernel queued next on `s`, set to `u64::MAX` on the
/// stream; register the kernel's message with [`defer`] once it is queued (a flag not
/// registered is handed out again).
///
/// # Errors
/// [`Error::Cuda`] when the slots cannot be allocated (first use on this thread and
/// stream) or the fill cannot be queued.
pub(crate) fn flag(s: &Stream) -> Result<u64> {
    let id = stream_id(&s.inner);
    let ptr = SLABS.with(|slabs| -> Result<u64> {
        let mut slabs = slabs.borrow_mut();
        let i = match slabs.iter().position(|x| stream_id(&x.stream) == id) {
            Some(i) => i,
            None => {
                slabs.push(Slab {
                    dev: s.dev.clone(),
                    stream: s.inner.clone(),
                    buf: s.alloc_bytes(8 * MAX_PENDING)?,
                    reports: Vec::with_capacity(MAX_PENDING),
                });
                slabs.len() - 1
            }
        };
        let slab = &slabs[i];
        Ok(slab.buf.ptr() + 8 * slab.reports.len() as u64)
    })?;
    s.bind()?;
    // SAFETY: one slot of 8 bytes inside the slab (fewer than MAX_PENDING are registered:
    // `defer` checks a full slab at once).
    unsafe { cu::memset_d8_async(ptr, 0xff, 8, s.inner.cu_stream()) }
        .map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
    Ok(ptr)
}

/// Registers the message of the kernel that writes the flag [`flag`] gave last on `s`:
/// its error (if any) is returned by the calling thread's next host read.
///
/// # Errors
/// The error of an earlier flag when [`MAX_PENDING`] were waiting and had to be checked.
pub(crate) fn defer(s: &Stream, report: Report) -> Result<()> {
    let id = stream_id(&s.inner);
    let full = SLABS.with(|slabs| {
        let mut slabs = slabs.borrow_mut();
        match slabs.iter_mut().find(|x| stream_id(&x.stream) == id) {
            Some(slab) => {
                slab.reports.push(report);
                slab.reports.len() >= MAX_PENDING
            }
            None => false,
        }
    });
    if full {
        let pending = queue_reads()?;
        return finish(pending, None);
    }
    Ok(())
}

/// Takes this thread's registered flags and queues one copy of each stream's used slots
/// to the host on that stream (call before the synchronization that [`finish`]
/// completes). The slots are free again for kernels queued after the copy.
///
/// # Errors
/// [`Error::Cuda`] when a copy cannot be queued.
pub(crate) fn queue_reads() -> Result<Vec<Pending>> {
    SLABS.with(|slabs| {
        let mut out = Vec::new();
        for slab in slabs.borrow_mut().iter_mut() {
            if slab.reports.is_empty() {
                continue;
            }
            let reports = std::mem::take(&mut slab.reports);
            let mut host = vec![0u64; reports.len()];
            slab.dev.bind_to_thread()?;
            // SAFETY: the used slots (at most MAX_PENDING u64) into a host vector of the
            // same length, whose heap block outlives the synchronization in `finish`.
            unsafe {
                cu::memcpy_dtoh_async(&mut host[..], slab.buf.ptr(), slab.stream.cu_stream())
            }
            .map_err(|e| Error::cuda("cuMemcpyDtoHAsync (index check)", e))?;
            out.push(Pending {
                stream: slab.stream.clone(),
                host,
                reports,
            });
        }
        Ok(out)
    })
}

/// Waits for the flags' streams (all but `synced`, which the caller synchronized after
/// queuing its own copy) and returns the first flagged op's error.
///
/// # Errors
/// That error; [`Error::Cuda`] from a synchronization.
pub(crate) fn finish(pending: Vec<Pending>, synced: Option<&Stream>) -> Result<()> {
    let mut waited: Vec<usize> = synced.map(|s| stream_id(&s.inner)).into_iter().collect();
    for p in &pending {
        let id = stream_id(&p.stream);
        if !waited.contains(&id) {
            crate::backend::counters::count_host_sync();
            p.stream
                .synchronize()
                .map_err(|e| Error::cuda("synchronizing for an index check", e))?;
            waited.push(id);
        }
    }
    for p in &pending {
        if let Some(i) = p.host.iter().position(|&v| v != u64::MAX) {
            return Err((p.reports[i])(p.host[i] as usize));
        }
    }
    Ok(())
}
