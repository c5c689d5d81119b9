//! CUDA graphs of whole steps: a step is run once eagerly with its buffers taken from a
//! graph-private pool (the warm-up), then captured with the driver's stream capture
//! (`cuStreamBeginCapture` ... `cuStreamEndCapture`, `cuGraphInstantiate`) and replayed
//! with one `cuGraphLaunch` per step. After PyTorch's `torch.cuda.graphs.CUDAGraph`: the
//! private pool keeps every block the captured step allocates at the address the graph
//! baked in, for as long as the graph lives ([`super::memory`]'s `PrivatePool`).
//!
//! The capture allocates exactly as the warm-up did, from the blocks the warm-up left in
//! the pool: `cuMemAlloc` is not permitted during a capture, so a capture that would need a
//! new block fails with an error naming the size. So do a host synchronization, an event
//! query or a copy to pageable host memory inside the captured closure: the driver refuses
//! them (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), and [`GraphRecorder::capture`] returns
//! the error of the operation that was refused, named.
//!
//! What the host computes per step must not be baked into the graph as a constant:
//! - tables of kernel arguments ([`upload_table`](super::ops)) are written once, before the
//!   first launch, into blocks the graph keeps for them alone ([`write_once`],
//!   `Stream::alloc_graph_constant`: a block shared with other work of the step would be
//!   overwritten by it at every replay);
//! - Adam's step count lives in device memory, advanced by the graph itself
//!   (`kernels/graph.cu`, PyTorch's `capturable=True`; see `optim.rs`);
//! - a learning-rate schedule is a table of every replay's rate, given to the recorder
//!   ([`GraphRecorder::set_lr_table`]) and uploaded with the graph's constants: Adam's
//!   bias kernel reads the rate of its step count from it (see [Note: lr table]);
//! - inputs are copied into static buffers before each launch, outputs read after it, by
//!   the caller (`fsdp train --cuda-graphs`, `train/graph_step.rs`).
//!
//! Only one region (warm-up or capture) is recorded at a time in a process.
//!
//! Several streams may take part in a capture: a stream joins it by waiting on an event
//! recorded on a stream of the capture (FSDP's communication streams do at each collective
//! they run, `distributed::CommStream`), and must be joined back (the capturing stream waits
//! on its last work) before the capture ends. A capture begins on an idle device (the
//! recorder synchronizes it), so no stream joins it with earlier work pending. NCCL
//! collectives issued on a capturing stream are captured with it (NCCL >= 2.9); the NCCL
//! group hands the watchdog no event of a captured collective, and the watchdog queries no
//! event while a capture is under way ([`outside_captures`]): in the global capture mode
//! an event query from any thread fails the capture.

use super::memory::PrivatePool;
use super::Stream;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::sync::Arc;

/// The region being recorded: whether it is a capture, the writes to make once before
/// the captured graph's first launch (device address, bytes), and the recorder's
/// learning-rate table with the index of this region's step in it.
struct Region {
    capture: bool,
    inits: Vec<(u64, Vec<u8>)>,
    lrs: Option<(Arc<[f32]>, usize)>,
}

// [Note: lr table]
// An eager step passes its learning rate to the optimizer's kernels as an argument; a
// captured one would replay the captured step's rate forever. So the recorder is given the
// rate of every step from the warm-up on, computed once on the host by the schedule the
// eager run uses (`optim::Scheduler::lrs_at`), and Adam's graph step reads it from the
// device: `adam_bias` (graph.cu) looks up the entry of its device step count and writes it
// to a scalar that `adam_{f32,f64}` reads instead of its `lr` argument. Entry 0 is the
// warm-up step's (so that the warm-up allocates and uses the same graph constants as the
// capture), entry 1 the captured step's (the first launch), entry j the j-th launch's. The
// table holds each f32 rate as the eager step widens it (f64::from, or the decimal it
// spells for f64 tensors), so a replay does the eager step's arithmetic bit for bit.

/// The learning-rate table of the region being recorded (the warm-up step's rate first)
/// and the index of the recorded step's rate in it (0: warm-up, 1: capture); None outside
/// a region or when the recorder was given no table.
pub(crate) fn lr_table() -> Option<(Arc<[f32]>, usize)> {
    REGION.lock().as_ref().and_then(|r| r.lrs.clone())
}

static REGION: Mutex<Option<Region>> = Mutex::new(None);

/// Held for writing from the beginning of a capture to its end; [`outside_captures`] reads.
static CAPTURING: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

/// Runs `f` while no CUDA graph capture is under way in this process: waits for one to
/// end, and a capture waits for `f` to return before it begins. For threads that make
/// calls a global-mode capture forbids from any thread (event queries and
/// synchronizations, allocations): the NCCL watchdog's polls.
pub fn outside_captures<R>(f: impl FnOnce() -> R) -> R {
    let _gate = CAPTURING.read();
    f()
}

/// Whether a graph region (warm-up or capture) is being recorded.
pub(crate) fn recording() -> bool {
    REGION.lock().is_some()
}

/// Writes `bytes` to device address `ptr` on `s`: at once (a copy on `s`), or, during a
/// capture, once after it ends and before the graph's first launch (the graph then reads
/// what was written at every replay, so the block must be the graph's and no other
/// buffer's: `Stream::alloc_graph_constant`).
///
/// # Errors
/// [`Error::Cuda`] from the copy.
pub(crate) fn write_once(s: &Stream, ptr: u64, bytes: &[u8]) -> Result<()> {
    if let Some(r) = REGION.lock().as_mut() {
        if r.capture {
            r.inits.push((ptr, bytes.to_vec()));
            return Ok(());
        }
    }
    copy_to_device(s, ptr, bytes)
}

fn copy_to_device(s: &Stream, ptr: u64, bytes: &[u8]) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    s.bind()?;
    // SAFETY: `ptr` addresses at least `bytes.len()` bytes of device memory on `s`'s
    // device (the caller's buffer); a copy from pageable memory stages the source before
    // returning.
    unsafe { cudarc::driver::result::memcpy_htod_async(ptr, bytes, s.inner.cu_stream()) }
        .map_err(|e| Error::cuda("cuMemcpyHtoDAsync (a CUDA graph's constant)", e))
}

/// Records one step as a CUDA graph on one stream: [`warm_up`](Self::warm_up) runs it
/// eagerly with its buffers from the graph's pool, [`capture`](Self::capture) captures it.
pub struct GraphRecorder {
    stream: Arc<Stream>,
    pool: Arc<PrivatePool>,
    lrs: Option<Arc<[f32]>>,
}

/// Routes the device's allocations to the graph pool and marks the region; undone on drop
/// (also when the recorded closure fails).
struct RegionGuard<'a> {
    rec: &'a GraphRecorder,
}

impl<'a> RegionGuard<'a> {
    fn new(rec: &'a GraphRecorder, capture: bool) -> Result<RegionGuard<'a>> {
        let mut r = REGION.lock();
        if r.is_some() {
            return Err(Error::InvalidArgument(
                "a CUDA graph region is already being recorded in this process".into(),
            ));
        }
        *r = Some(Region {
            capture,
            inits: Vec::new(),
            lrs: rec.lrs.clone().map(|t| (t, usize::from(capture))),
        });
        rec.pool.set_capturing(capture);
        rec.stream.dev.pool.set_private(Some(rec.pool.clone()));
        Ok(RegionGuard { rec })
    }
}

impl Drop for RegionGuard<'_> {
    fn drop(&mut self) {
        self.rec.stream.dev.pool.set_private(None);
        self.rec.pool.set_capturing(false);
        *REGION.lock() = None;
    }
}

impl GraphRecorder {
    /// A recorder for work on `stream` (the step's compute stream: where it is captured
    /// and replayed), with a new, empty graph pool on its device.
    ///
    /// # Errors
    /// `InvalidArgument` under `FSDP_CUDA_NO_CACHING=1`: without the caching allocator
    /// every buffer is a `cuMemAlloc`, which a capture does not permit.
    pub fn new(stream: &Arc<Stream>) -> Result<GraphRecorder> {
        if !super::memory::Pool::caching() {
            return Err(Error::InvalidArgument(
                "CUDA graphs need the caching allocator: unset FSDP_CUDA_NO_CACHING".into(),
            ));
        }
        Ok(GraphRecorder {
            stream: stream.clone(),
            pool: PrivatePool::new(stream.dev.pool.clone()),
            lrs: None,
        })
    }

    /// The learning rate of the warm-up step (`lrs[0]`), of the captured step (`lrs[1]`,
    /// its first launch) and of each later launch (`lrs[j]`: the j-th launch; the last
    /// entry for launches past the table), read on the device by the optimizer steps the
    /// regions record ([Note: lr table]). Without a table a capture keeps the captured
    /// step's rate.
    ///
    /// # Errors
    /// `InvalidArgument` for a table of fewer than 2 rates or a NaN, infinite or negative
    /// rate.
    pub fn set_lr_table(&mut self, lrs: Vec<f32>) -> Result<()> {
        if lrs.len() < 2 {
            crate::error::bail_arg!(
                "a CUDA graph's learning-rate table needs the warm-up's and the capture's rates (got {})",
                lrs.len()
            );
        }
        if let Some((j, lr)) = lrs
            .iter()
            .enumerate()
            .find(|(_, l)| !l.is_finite() || **l < 0.0)
        {
            crate::error::bail_arg!(
                "a CUDA graph's learning-rate table holds {lr} at launch {j} (rates are finite and >= 0)"
            );
        }
        self.lrs = Some(lrs.into());
        Ok(())
    }

    /// Runs `f` eagerly (its work runs), every device allocation taken from the graph's
    /// pool, so that the pool then holds the blocks a capture of the same work needs.
    ///
    /// # Errors
    /// `f`'s; `InvalidArgument` when another region is being recorded.
    pub fn warm_up<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let out = {
            let _region = RegionGuard::new(self, false)?;
            f()
        };
        self.pool.release_held();
        out
    }

    /// Captures `f`'s work on the recorder's stream (global capture mode, PyTorch's
    /// default) into a graph; nothing runs until [`StepGraph::launch`]. Streams that
    /// wait on the stream's events join the capture and must be waited on again before
    /// `f` returns.
    ///
    /// # Errors
    /// `f`'s error, naming the refused operation when the driver refused one (a host
    /// synchronization, an event query, a copy to pageable host memory:
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), or an allocation the warm-up did not
    /// make; the driver's error ending the capture (`CUDA_ERROR_STREAM_CAPTURE_*`).
    pub fn capture<R>(self, f: impl FnOnce() -> Result<R>) -> Result<(StepGraph, R)> {
        let s = self.stream.clone();
        let (out, ended, inits) = {
            let _gate = CAPTURING.write();
            // An idle device: no stream joins the capture with work of its own pending, and
            // the events the warm-up's blocks wait on have completed (so the capture can
            // reuse those blocks, as the warm-up would have had it been longer).
            s.dev.synchronize()?;
            self.pool.settle();
            let _region = RegionGuard::new(&self, true)?;
            s.inner
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
                .map_err(|e| Error::cuda("cuStreamBeginCapture", e))?;
            let out = f();
            let ended = s
                .inner
                .end_capture(sys::CUgraphInstantiate_flags(0))
                .map_err(|e| Error::cuda("cuStreamEndCapture (the captured step)", e));
            let inits = REGION
                .lock()
                .as_mut()
                .map(|r| std::mem::take(&mut r.inits))
                .unwrap_or_default();
            (out, ended, inits)
        };
        let out = out.map_err(|e| match e {
            Error::Cuda { context, message } => Error::Cuda {
                context: format!("during a CUDA graph capture: {context}"),
                message,
            },
            other => other,
        })?;
        let graph = ended?
            .ok_or_else(|| Error::cuda("cuStreamEndCapture", "the capture recorded no work"))?;
        for (ptr, bytes) in &inits {
            copy_to_device(&s, *ptr, bytes)?;
        }
        Ok((
            StepGraph {
                graph,
                _pool: self.pool,
            },
            out,
        ))
    }
}

/// A captured, instantiated step: [`launch`](Self::launch) replays it on the stream it was
/// captured on. Holds the graph's pool: its blocks stay the graph's until it is dropped.
pub struct StepGraph {
    graph: cudarc::driver::CudaGraph,
    _pool: Arc<PrivatePool>,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StepGraph")
    }
}

impl StepGraph {
    /// Queues one replay of the captured work on its stream (one `cuGraphLaunch`; counted
    /// in [`Counters::graph_launches`](crate::backend::counters::Counters::graph_launches)).
    ///
    /// # Errors
    /// [`Error::Cuda`] from the driver.
    pub fn launch(&self) -> Result<()> {
        crate::backend::counters::count_graph_launch();
        self.graph
            .launch()
            .map_err(|e| Error::cuda("cuGraphLaunch", e))
    }
}
