//! Device primitives of the threads process group on CUDA tensors
//! (`distributed::threads::device`): the rank-order reduction kernel of `collective.cu`,
//! byte copies between buffers of one device or of two devices, and waiting on an event
//! that another rank's thread recorded. Everything here takes raw device addresses that a
//! peer published in the rendezvous, so the entry points are `unsafe fn`s whose contracts
//! the rendezvous upholds (the peer keeps the memory and the event alive until every rank
//! departed).

use super::launch::{self, Arg, Grid};
use super::{CudaDevice, Event, Stream};
use crate::error::{Error, Result};
use crate::reduce::ReduceOp;
use crate::tensor::DType;
use cudarc::driver::{result as cu, sys};

/// The address of an event's driver handle, to publish to the threads of other ranks
/// (who wait on it with [`wait_event_ptr`]).
pub fn event_ptr(e: &Event) -> *mut u8 {
    e.inner.cu_event() as *mut u8
}

/// Makes `s`'s later work wait for the event whose handle is `event` (from
/// [`event_ptr`]; the event may belong to another thread, stream or device).
///
/// # Safety
/// `event` is the handle of a live event: its owner does not destroy it before this call
/// returns (the wait is captured at call time, so it may be destroyed afterwards).
pub unsafe fn wait_event_ptr(s: &Stream, event: *mut u8) -> Result<()> {
    s.dev
        .ctx
        .bind_to_thread()
        .map_err(|e| Error::cuda(format!("binding cuda:{}", s.dev.ordinal()), e))?;
    // SAFETY: the stream is alive (borrowed) and the caller guarantees the event is.
    unsafe {
        cu::stream::wait_event(
            s.inner.cu_stream(),
            event as sys::CUevent,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(|e| Error::cuda("making a stream wait for a peer's event", e))
}

/// Queues on `s` a copy of `bytes` bytes from `src` (on `cuda:src_ordinal`) to `dst` (on
/// `cuda:dst_ordinal`): `cuMemcpyDtoDAsync` within one device, `cuMemcpyPeerAsync`
/// between two (staged through the host by the driver when peer access is off).
///
/// # Safety
/// Both ranges are device memory of the named devices, valid for `bytes` bytes until the
/// copy has run on `s`, and do not overlap; nothing else writes them meanwhile.
pub unsafe fn copy_bytes(
    s: &Stream,
    dst: u64,
    dst_ordinal: usize,
    src: u64,
    src_ordinal: usize,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // The devices first (creating one may make its context current), then the stream's
    // context current for the copy.
    let peers = if dst_ordinal == src_ordinal {
        None
    } else {
        Some((CudaDevice::get(dst_ordinal)?, CudaDevice::get(src_ordinal)?))
    };
    s.dev
        .ctx
        .bind_to_thread()
        .map_err(|e| Error::cuda(format!("binding cuda:{}", s.dev.ordinal()), e))?;
    match peers {
        // SAFETY: the caller's contract.
        None => unsafe { cu::memcpy_dtod_async(dst, src, bytes, s.inner.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyDtoDAsync (collective)", e)),
        Some((d, sdev)) => {
            let (dctx, sctx) = (d.ctx.cu_ctx(), sdev.ctx.cu_ctx());
            // SAFETY: the caller's contract; both contexts are the devices' primary
            // contexts, alive for the process.
            unsafe { cu::memcpy_peer_async(dctx, dst, sctx, src, bytes, s.inner.cu_stream()) }
                .map_err(|e| {
                    Error::cuda(
                        format!("cuMemcpyPeerAsync cuda:{src_ordinal} -> cuda:{dst_ordinal}"),
                        e,
                    )
                })
        }
    }
}

/// The `op` argument of `reduce_ranks_*` (`collective.cu`).
fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Product => 4,
    }
}

/// For `i in 0..n`: every `dsts[d][i] = narrow(srcs[0][i] op srcs[1][i] op ...)` with the
/// sources widened to f64 and combined left to right, `Avg` dividing by `srcs.len()`, one
/// rounding into `dtype` (`reduce_ranks_{dtype}`): bit for bit the threads backend's CPU
/// reduction. A destination may be one of the sources. Queued on `s`.
///
/// # Errors
/// `InvalidArgument` without sources; [`Error::Cuda`] on launch failure.
///
/// # Safety
/// Every source and destination addresses `n` elements of `dtype` in device memory of
/// `s`'s device, valid until the kernel has run on `s`; a destination overlaps no other
/// destination and no source other than exactly itself; nothing else writes them
/// meanwhile.
pub unsafe fn reduce_ranks(
    s: &Stream,
    dtype: DType,
    srcs: &[u64],
    dsts: &[u64],
    n: usize,
    op: ReduceOp,
) -> Result<()> {
    if srcs.is_empty() {
        crate::error::bail_arg!("reduce_ranks: no sources");
    }
    if n == 0 || dsts.is_empty() {
        return Ok(());
    }
    let name = match dtype {
        DType::F32 => "reduce_ranks_f32",
        DType::BF16 => "reduce_ranks_bf16",
        DType::F16 => "reduce_ranks_f16",
        DType::I32 => "reduce_ranks_i32",
        DType::F64 => "reduce_ranks_f64",
        d @ DType::I64 => {
            return Err(Error::Unsupported(format!(
                "reducing {d} tensors on CUDA devices (no reduce_ranks kernel)"
            )))
        }
    };
    // The tables' host-to-device copies need the stream's context current.
    s.dev
        .ctx
        .bind_to_thread()
        .map_err(|e| Error::cuda(format!("binding cuda:{}", s.dev.ordinal()), e))?;
    let (src_table, dst_table) = (
        super::ops::upload_table(s, srcs)?,
        super::ops::upload_table(s, dsts)?,
    );
    let args = [
        Arg::Ptr(src_table.ptr()),
        Arg::I64(srcs.len() as i64),
        Arg::Ptr(dst_table.ptr()),
        Arg::I64(dsts.len() as i64),
        Arg::I64(n as i64),
        Arg::I32(op_code(op)),
    ];
    // SAFETY: the arguments match `reduce_ranks_{dtype}(const uint64_t*, int64_t, const
    // uint64_t*, int64_t, int64_t, int32_t)`; the tables hold `k` and `m` addresses of `n`
    // elements each (caller's contract) and live until the kernel ran (their blocks are
    // reused only by later work on `s`).
    unsafe { launch::launch(s, "collective", name, Grid::elementwise(s, n), &args) }
}
