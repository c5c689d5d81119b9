//! Index checks of device kernels, reported at the next host read instead of with a
//! synchronization of their own: PyTorch's device-side asserts (an out-of-range class or
//! token id fails later, at a synchronizing call), but with the op's own message.
//!
//! A kernel that validates indices (embedding, cross-entropy) writes the first bad
//! position into an 8-byte flag (`u64::MAX` when all are in range) and registers the flag
//! here, on the calling thread. The next [`DeviceTensor::to_vec`](super::DeviceTensor::to_vec)
//! on that thread queues a copy of every pending flag before its own copy, so one
//! synchronization serves both, and returns the first flagged op's error instead of the
//! data. More than [`MAX_PENDING`] flags without a read are checked at once (bounded
//! memory).

use super::memory::{stream_id, DeviceBuffer};
use super::{CudaDevice, Stream};
use crate::error::{Error, Result};
use cudarc::driver::result as cu;
use cudarc::driver::CudaStream;
use std::cell::RefCell;
use std::sync::Arc;

/// Flags kept without a host read before they are checked on their own.
const MAX_PENDING: usize = 64;

/// The message of a flagged op, given the first bad position.
pub(crate) type Report = Box<dyn Fn(usize) -> Error>;

/// One registered flag and where its value lands on the host.
pub(crate) struct Pending {
    dev: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    flag: DeviceBuffer,
    host: Box<[u64; 1]>,
    report: Report,
}

thread_local! {
    static PENDING: RefCell<Vec<Pending>> = const { RefCell::new(Vec::new()) };
}

/// Registers `flag`, written by work queued on `s`: its error (if any) is returned by the
/// calling thread's next host read.
///
/// # Errors
/// The error of an earlier flag when [`MAX_PENDING`] were waiting and had to be checked.
pub(crate) fn defer(s: &Stream, flag: DeviceBuffer, report: Report) -> Result<()> {
    let full = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.push(Pending {
            dev: s.dev.clone(),
            stream: s.inner.clone(),
            flag,
            host: Box::new([0]),
            report,
        });
        p.len() > MAX_PENDING
    });
    if full {
        let pending = queue_reads()?;
        return finish(pending, None);
    }
    Ok(())
}

/// Takes this thread's pending flags and queues the copy of each to the host on its
/// stream (call before the synchronization that [`finish`] completes).
///
/// # Errors
/// [`Error::Cuda`] when a copy cannot be queued.
pub(crate) fn queue_reads() -> Result<Vec<Pending>> {
    let mut pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for p in &mut pending {
        p.dev.bind_to_thread()?;
        // SAFETY: 8 bytes from an 8-byte buffer into a boxed u64 that outlives the
        // synchronization in `finish`.
        unsafe { cu::memcpy_dtoh_async(&mut p.host[..], p.flag.ptr(), p.stream.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyDtoHAsync (index check)", e))?;
    }
    Ok(pending)
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
    match pending.iter().find(|p| p.host[0] != u64::MAX) {
        Some(p) => Err((p.report)(p.host[0] as usize)),
        None => Ok(()),
    }
}
