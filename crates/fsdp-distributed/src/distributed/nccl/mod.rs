//! The `nccl` backend: one process per GPU (or any number of ranks, one communicator each),
//! collectives by NVIDIA's NCCL through cudarc (loaded at run time: a machine without
//! `libnccl.so` gets an error, not a link failure).
//!
//! Semantics follow `torch.distributed`'s `ProcessGroupNCCL`
//! (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp):
//! - rank 0 of a group creates the NCCL unique id and publishes it in the job's key-value
//!   [`Store`] (the TCP store at `MASTER_ADDR:MASTER_PORT`); the others read it and
//!   every rank calls `ncclCommInitRank`;
//! - a collective is enqueued on the calling thread's current stream of the group's device
//!   (FSDP calls from its communication thread, whose stream is the unshard /
//!   post-backward stream) and not waited for: what the caller queues next on that stream
//!   is ordered after it, as with ProcessGroupNCCL;
//! - one watchdog thread per process (`watchdog.rs`, `TORCH_NCCL_ASYNC_ERROR_HANDLING`)
//!   polls every collective's completion event and `ncclCommGetAsyncError`; past the group
//!   timeout it aborts the communicator and records [`Error::Timeout`] naming the ranks
//!   that never entered the collective (a rank whose collective is slow, past a quarter of
//!   the timeout or 10 s, records its collective count in the store, as PyTorch's desync
//!   debugging asks its peers on a timeout; a healthy collective makes no store request and
//!   no host wait), and an asynchronous NCCL error or a peer's recorded failure becomes
//!   [`Error::PeerFailed`] naming the peer that failed first (`evidence.rs`); the
//!   group's next call (or [`barrier`](ProcessGroup::barrier), which waits on the host)
//!   returns it;
//! - rank processes that met through the store beat a heartbeat through it
//!   (`heartbeat.rs`, [Note: heartbeat]): a peer that stops as a whole (`SIGSTOP`)
//!   is named by [`Error::PeerFailed`] within the heartbeat timeout, and every group of the
//!   world aborts its communicator;
//! - an aborted communicator fails every later collective with the first error;
//! - a collective issued on a stream that is capturing a CUDA graph is captured (as NCCL
//!   2.9 and later permit): it runs at each launch of the graph, and the watchdog does not
//!   watch it (its event cannot be queried during the capture; nor are a replay's
//!   collectives watched: a peer that stops or exits meanwhile is named by the heartbeat);
//! - `new_group` builds a communicator for the members from a fresh unique id under a key
//!   naming the members and how many groups of them were made before.
//!
//! Reductions are NCCL's: `Sum`, `Avg` (`ncclAvg`), `Max`, `Min`, `Product`, accumulated
//! in the dtype along NCCL's ring or tree, so for more than one rank the low bits of
//! bf16/f16 (and the order of f32 additions) may differ from the `threads` backend's
//! rank-order f64 reduction; at world size 1 every collective is an exact copy.
//! NCCL cannot see that ranks called different collectives: a mismatch shows up as a
//! timeout naming the ranks that did not enter (or, for differing sizes, as corrupt data);
//! run the same job on the `threads` backend to get the exact mismatch.

mod evidence;
mod heartbeat;
mod watchdog;

use super::threads::{is_chunk_of, unaliased};
use super::{Group, ProcessGroup, ReduceOp, Store};
use crate::backend::cuda as cu;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use cudarc::nccl::{result as nccl, sys};
use evidence::Evidence;
use heartbeat::Peers;
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Bytes of an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// True when `libnccl.so` can be loaded.
pub fn is_available() -> bool {
    // SAFETY: only tries to dlopen libnccl by its usual names.
    unsafe { sys::is_culib_present() }
}

/// What NCCL says about result `code`: the code, its description (`ncclGetErrorString`)
/// and the last error message for `comm` (`ncclGetLastError`; null asks for the
/// process-wide one), which is where NCCL says what was wrong with the call.
fn nccl_message(code: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    let text = |p: *const std::ffi::c_char| {
        // SAFETY: NCCL returns null or a NUL-terminated string that lives at least until
        // the next NCCL call on this thread; it is copied at once.
        (!p.is_null())
            .then(|| {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .trim()
                    .to_string()
            })
            .filter(|s| !s.is_empty())
    };
    // SAFETY: plain queries; `comm` is null or a live communicator.
    let desc = text(unsafe { sys::ncclGetErrorString(code) });
    let last = text(unsafe { sys::ncclGetLastError(comm) });
    let mut msg = format!("NCCL error {code:?}");
    for part in [desc, last].into_iter().flatten() {
        if !msg.contains(&part) {
            msg.push_str(": ");
            msg.push_str(&part);
        }
    }
    msg
}

/// An NCCL failure of the call named by `context` as an [`Error::Cuda`], with
/// [`nccl_message`]'s text.
fn nccl_err(context: impl Into<String>, e: nccl::NcclError, comm: sys::ncclComm_t) -> Error {
    Error::cuda(context, nccl_message(e.0, comm))
}

fn require_nccl() -> Result<()> {
    if is_available() {
        Ok(())
    } else {
        Err(Error::cuda(
            "no NCCL library found (libnccl.so)",
            "install NCCL and make `libnccl.so` resolvable: the nvidia-nccl-cu13 wheel ships only libnccl.so.2, so link libnccl.so to it in a folder on LD_LIBRARY_PATH (scripts/gpu-check.sh does); or use the threads backend",
        ))
    }
}

/// A fresh NCCL unique id (what rank 0 publishes).
///
/// # Errors
/// [`Error::Cuda`] without libnccl or when NCCL cannot create one.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    require_nccl()?;
    let id =
        nccl::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e, std::ptr::null_mut()))?;
    Ok(id.internal.map(|c| c as u8))
}

struct Comm {
    raw: sys::ncclComm_t,
    /// The first fatal error; later collectives fail with a copy of it.
    failure: Option<Error>,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it are serialized,
// which the Mutex around `Comm` ensures.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: the communicator is ours and no call on it is in flight (we hold it
            // by value). Errors cannot be returned from drop; abort does not wait for peers.
            unsafe {
                let _ = if self.failure.is_some() {
                    nccl::comm_abort(self.raw)
                } else {
                    nccl::comm_destroy(self.raw)
                };
            }
        }
    }
}

/// A process group whose collectives run through one NCCL communicator on one CUDA device
/// (`ProcessGroupNCCL`). Tensors must be on that device.
pub struct NcclGroup {
    rank: usize,
    size: usize,
    ordinal: usize,
    /// World ranks of the members, in group-rank order.
    members: Vec<usize>,
    world_rank: usize,
    /// What this group shares with the watchdog (`watchdog.rs`): the communicator,
    /// the store, the timeout.
    shared: Arc<Shared>,
    seq: Mutex<u64>,
    created: crate::distributed::subgroups::NewGroupCounter,
    /// The groups of this rank's world, and its heartbeat when it has one
    /// (`heartbeat.rs`).
    peers: Arc<Peers>,
}

/// The part of a group the watchdog thread needs while the group's collectives are in
/// flight (and keeps alive until they end: the communicator is not destroyed under them).
struct Shared {
    world_rank: usize,
    timeout: Duration,
    /// This group's records in the store: collective counts, failures
    /// (`evidence.rs`).
    evidence: Evidence,
    comm: Mutex<Comm>,
    /// Whether this group's store handle was handed to `watchdog::linger` (once, at
    /// the group's failure).
    lingering: AtomicBool,
    /// When the watchdog last looked for a peer's recorded failure (a store request): at
    /// most once a second per group, however many collectives are in flight.
    last_peer_check: Mutex<std::time::Instant>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclGroup(rank {} of {}, cuda:{})",
            self.rank, self.size, self.ordinal
        )
    }
}

impl NcclGroup {
    /// The world group: rank `rank` of `world_size` on `cuda:ordinal`. Rank 0 creates the
    /// unique id and sets it under `"nccl/world/id"` in `store`; every rank reads it and
    /// joins (`ncclCommInitRank` blocks until all ranks joined, bounded by the store's wait
    /// for the id, then by NCCL's own bootstrap timeout).
    ///
    /// # Errors
    /// `InvalidArgument` for `rank >= world_size`; [`Error::Cuda`] without libnccl, a
    /// device, or when NCCL fails to initialize; the store's errors.
    pub fn new(
        rank: usize,
        world_size: usize,
        ordinal: usize,
        store: Arc<dyn Store>,
        timeout: Duration,
    ) -> Result<NcclGroup> {
        if rank >= world_size {
            crate::error::bail_arg!("nccl: rank {rank} is not in a world of {world_size}");
        }
        let members: Vec<usize> = (0..world_size).collect();
        Self::join(
            rank,
            members,
            rank,
            ordinal,
            store,
            timeout,
            "nccl/world".into(),
        )
        .map(|g| g.in_world(Arc::default()))
    }

    /// This group as one of the world whose groups `peers` lists (registered there: a stale
    /// peer fails it).
    fn in_world(mut self, peers: Arc<Peers>) -> NcclGroup {
        peers.add(&self.shared);
        self.peers = peers;
        self
    }

    fn join(
        rank: usize,
        members: Vec<usize>,
        world_rank: usize,
        ordinal: usize,
        store: Arc<dyn Store>,
        timeout: Duration,
        prefix: String,
    ) -> Result<NcclGroup> {
        require_nccl()?;
        let size = members.len();
        let key = format!("{prefix}/id");
        let id = if rank == 0 {
            let id = unique_id()?;
            store.set(&key, &id)?;
            id
        } else {
            let v = store.get(&key)?;
            <[u8; UNIQUE_ID_BYTES]>::try_from(v.as_slice()).map_err(|_| {
                Error::InvalidArgument(format!(
                    "nccl: store key '{key}' holds {} bytes, not an NCCL unique id of {UNIQUE_ID_BYTES}",
                    v.len()
                ))
            })?
        };
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // The communicator binds to the context current on this thread.
        let dev = cu::CudaDevice::get(ordinal)?;
        dev.bind_to_thread()?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the id came from ncclGetUniqueId on rank 0.
        unsafe { nccl::comm_init_rank(&mut raw, size as i32, uid, rank as i32) }.map_err(|e| {
            nccl_err(
                format!("ncclCommInitRank (rank {rank} of {size} on cuda:{ordinal})"),
                e,
                std::ptr::null_mut(),
            )
        })?;
        Ok(NcclGroup {
            rank,
            size,
            ordinal,
            members: members.clone(),
            world_rank,
            shared: Arc::new(Shared {
                world_rank,
                timeout,
                evidence: Evidence {
                    rank,
                    members,
                    store,
                    prefix,
                },
                comm: Mutex::new(Comm { raw, failure: None }),
                lingering: AtomicBool::new(false),
                last_peer_check: Mutex::new(std::time::Instant::now()),
            }),
            seq: Mutex::new(0),
            created: Default::default(),
            peers: Arc::default(),
        })
    }

    /// The world group of a resolved rendezvous (`init_process_group(backend="nccl")`): the
    /// store at `MASTER_ADDR:MASTER_PORT` (rank 0 hosts it), the device
    /// `cuda:(LOCAL_RANK or RANK) % device count`, as a torchrun script's
    /// `torch.cuda.set_device(local_rank)`. With more than one rank it starts this rank's
    /// heartbeat (`rv.heartbeat_timeout`, `heartbeat.rs`): a peer that stops as a whole
    /// fails every group of the world with [`Error::PeerFailed`] naming it.
    ///
    /// # Errors
    /// As [`NcclGroup::new`], the store's connection errors, and `Io` when the heartbeat's
    /// thread cannot start.
    pub(crate) fn init(rv: &super::Rendezvous) -> Result<Arc<NcclGroup>> {
        require_nccl()?;
        let devices = cu::detect()?.len().max(1);
        let what = format!("init_process_group (backend nccl, rendezvous '{}')", rv.key);
        let store = super::store::connect_for(rv, &what)?;
        let ordinal = rv.local_rank.unwrap_or(rv.rank) % devices;
        let group = Self::new(rv.rank, rv.world_size, ordinal, store, rv.timeout)?;
        group.peers.start(rv)?;
        Ok(Arc::new(group))
    }

    /// Records that this rank failed (`reason`) where every peer's watchdog looks, in the
    /// job's order of failures (they stop within a second, naming the rank that failed
    /// first: this one, unless it fails because a peer did), and marks the communicator
    /// failed so that it is aborted, not destroyed, when dropped. Never blocks on a
    /// collective in flight: that one ends by the watchdog.
    pub(crate) fn mark_failed(&self, reason: String) {
        self.shared.mark_failed(reason);
    }

    /// The device this group's tensors live on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn check_tensors(&self, op: &'static str, ts: &[&Tensor]) -> Result<()> {
        for t in ts {
            if t.device() != self.device() {
                return Err(Error::DeviceMismatch {
                    op,
                    expected: self.device().to_string(),
                    got: t.device().to_string(),
                });
            }
        }
        Ok(())
    }

    /// Runs one collective: enqueues `issue` on the calling thread's current stream and
    /// hands its completion event to the watchdog (`watchdog.rs`). No host wait: what
    /// the caller queues next on the stream is ordered after it, as with ProcessGroupNCCL.
    ///
    /// # Errors
    /// The group's first failure (found by the watchdog: a timeout naming the ranks that
    /// never entered, a failed peer, NCCL's asynchronous error), or NCCL's refusal.
    fn run(
        &self,
        op: &'static str,
        issue: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<(), nccl::NcclError>,
    ) -> Result<()> {
        let stream = cu::current_stream(self.ordinal)?;
        let mut comm = self.shared.comm.lock();
        if let Some(e) = &comm.failure {
            return Err(e.duplicate());
        }
        let seq = {
            let mut s = self.seq.lock();
            *s += 1;
            *s
        };
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        if let Err(e) = issue(comm.raw, cu_stream) {
            let err = nccl_err(format!("{op} on rank {}", self.world_rank), e, comm.raw);
            comm.failure = Some(err.duplicate());
            return Err(err);
        }
        // Captured into a CUDA graph (`fsdp train --cuda-graphs`): the collective runs at
        // each launch of the graph, not now, and its event could not be queried during the
        // capture (a global-mode capture forbids that from any thread): the watchdog is
        // not given it, as ProcessGroupNCCL enqueues no work of a capture to its watchdog.
        if stream.is_capturing()? {
            return Ok(());
        }
        // Recorded and handed over under the communicator's lock: the watchdog gets one
        // group's collectives on one stream in their stream order (it polls only the
        // newest of them, `watchdog.rs`).
        let done = stream.record()?;
        watchdog::watch(watchdog::InFlight::new(
            self.shared.clone(),
            op,
            seq,
            done,
            cu_stream as usize,
        ));
        drop(comm);
        Ok(())
    }

    /// The group's first failure, if the watchdog (or a refused call) found one.
    pub(crate) fn failure(&self) -> Option<Error> {
        self.shared
            .comm
            .lock()
            .failure
            .as_ref()
            .map(Error::duplicate)
    }
}

impl Shared {
    /// Records this rank's failure in the store (see [`NcclGroup::mark_failed`]).
    fn mark_failed(&self, reason: String) {
        self.evidence.record_failure(&reason);
        self.linger();
        let Some(mut comm) = self.comm.try_lock() else {
            return;
        };
        if comm.failure.is_none() {
            comm.failure = Some(Error::PeerFailed {
                failed_rank: self.world_rank,
                reason,
            });
        }
    }

    /// Keeps this failed group's store handle alive a while (once), past the group: the
    /// store server this rank may host stays up for the peers that look for the cause a
    /// little later (`watchdog::linger`).
    fn linger(&self) {
        if !self.lingering.swap(true, Ordering::AcqRel) {
            watchdog::linger(self.evidence.store.clone(), self.timeout);
        }
    }

    /// Whether the group already failed.
    fn has_failed(&self) -> bool {
        self.comm.lock().failure.is_some()
    }

    /// Records `err` as the group's failure (the first one stays) and aborts the
    /// communicator at once, as ProcessGroupNCCL's watchdog does: its kernels in flight end
    /// (their outputs undefined) and the streams drain; later collectives fail with `err`.
    fn fail(&self, err: Error) {
        self.linger();
        // Before the abort that fails the peers' collectives: they read it to name the same
        // ranks.
        if let Error::Timeout { missing_ranks, .. } = &err {
            self.evidence.record_timeout(missing_ranks);
        }
        let mut comm = self.comm.lock();
        if comm.failure.is_none() {
            comm.failure = Some(err);
        }
        if !comm.raw.is_null() {
            // SAFETY: our communicator; the lock keeps every other call out.
            unsafe {
                let _ = nccl::comm_abort(comm.raw);
            }
            comm.raw = std::ptr::null_mut();
        }
    }

    /// NCCL's asynchronous error as the error to report for collective number `seq`: a
    /// peer that recorded its failure is the cause; else a timeout a peer recorded (it
    /// aborted because ranks never arrived: the same [`Error::Timeout`] naming them); else
    /// the first other rank that had not entered the collective; else this one. None while
    /// healthy. With `wait`, waits for
    /// a communicator another thread holds; without (the watchdog, which must not stall
    /// behind a call), answers None then: it asks again at its next poll.
    fn async_failure(&self, op: &str, seq: u64, wait: bool) -> Option<Error> {
        let text = self.async_error(op, wait)?;
        if let Some((failed_rank, reason)) = self.evidence.failed_peer() {
            return Some(Error::PeerFailed {
                failed_rank,
                reason: format!("{reason} ({text})"),
            });
        }
        Some(match self.evidence.timed_out() {
            Some(missing_ranks) => Error::Timeout {
                op: op.to_string(),
                rank: self.world_rank,
                timeout_s: self.timeout.as_secs_f64(),
                missing_ranks,
            },
            None => Error::PeerFailed {
                failed_rank: self
                    .evidence
                    .lagging_ranks(seq)
                    .first()
                    .copied()
                    .unwrap_or(self.world_rank),
                reason: text,
            },
        })
    }

    /// NCCL's asynchronous error of the communicator, with its text; None while healthy
    /// (or, without `wait`, while another thread holds the communicator).
    fn async_error(&self, op: &str, wait: bool) -> Option<String> {
        let comm = if wait {
            self.comm.lock()
        } else {
            self.comm.try_lock()?
        };
        if comm.raw.is_null() {
            return None;
        }
        let mut status = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live communicator; `status` is a valid out-pointer.
        unsafe { sys::ncclCommGetAsyncError(comm.raw, &mut status) };
        (status != sys::ncclResult_t::ncclSuccess && status != sys::ncclResult_t::ncclInProgress)
            .then(|| format!("{} during {op}", nccl_message(status, comm.raw)))
    }

    /// Whether a second has passed since the last look for a failed peer (and if so, the
    /// clock restarts: the caller looks now).
    fn peer_check_due(&self) -> bool {
        let mut last = self.last_peer_check.lock();
        if last.elapsed() < Duration::from_secs(1) {
            return false;
        }
        *last = std::time::Instant::now();
        true
    }

    /// This rank's world rank.
    fn world_rank(&self) -> usize {
        self.world_rank
    }
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
    }
}

fn ptr(t: &Tensor) -> Result<u64> {
    Ok(t.as_device_tensor()?.ptr())
}

fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            got: b.dtype(),
        });
    }
    Ok(())
}

fn numel_is(op: &'static str, t: &Tensor, n: usize) -> Result<()> {
    if t.numel() != n {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![n],
            got: t.shape().to_vec(),
        });
    }
    Ok(())
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn collective_device(&self) -> Option<Device> {
        Some(Device::Cuda(self.ordinal))
    }

    fn world_rank(&self) -> usize {
        self.world_rank
    }

    fn ranks(&self) -> Vec<usize> {
        self.members.clone()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Group>> {
        if self.members.len() != self.size || self.members.iter().enumerate().any(|(i, &m)| i != m)
        {
            crate::error::bail_arg!(
                "new_group: call it on the world group (this group has ranks {:?})",
                self.members
            );
        }
        let (members, nth) = self.created.next(ranks, self.size)?;
        let Some(local) = members.iter().position(|&r| r == self.world_rank) else {
            return Ok(None);
        };
        let names: Vec<String> = members.iter().map(|r| r.to_string()).collect();
        let prefix = format!("nccl/group/{}/{nth}", names.join(","));
        let g = Self::join(
            local,
            members,
            self.world_rank,
            self.ordinal,
            self.shared.evidence.store.clone(),
            self.shared.timeout,
            prefix,
        )?
        .in_world(self.peers.clone());
        Ok(Some(Arc::new(g)))
    }

    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        let op = "all_gather_into_tensor";
        self.check_tensors(op, &[output, input])?;
        same_dtype(op, output, input)?;
        numel_is(op, output, input.numel() * self.size)?;
        // NCCL defines one overlap only, in place (input = this rank's chunk of output);
        // any other overlapping input is copied first.
        let in_place = is_chunk_of(input, output, self.rank * input.numel());
        let input = unaliased(input, output, in_place)?;
        let input: &Tensor = &input;
        let (src, dst, n, dt) = (
            ptr(input)?,
            ptr(output)?,
            input.numel(),
            nccl_dtype(input.dtype()),
        );
        self.run(op, |comm, s| {
            // SAFETY: both pointers hold the checked element counts on this group's device.
            unsafe { nccl::all_gather(src as *const c_void, dst as *mut c_void, n, dt, comm, s) }
                .map(|_| ())
        })
    }

    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        let name = "reduce_scatter_tensor";
        self.check_tensors(name, &[output, input])?;
        same_dtype(name, output, input)?;
        numel_is(name, input, output.numel() * self.size)?;
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            crate::error::bail_arg!("reduce_scatter_tensor: op {op:?}; only Sum and Avg");
        }
        // In place for NCCL is output = this rank's chunk of input; other overlaps are copied.
        let in_place = is_chunk_of(output, input, self.rank * output.numel());
        let input = unaliased(input, output, in_place)?;
        let input: &Tensor = &input;
        let (src, dst, n) = (ptr(input)?, ptr(output)?, output.numel());
        let (dt, rop) = (nccl_dtype(input.dtype()), nccl_op(op));
        self.run(name, |comm, s| {
            // SAFETY: input holds size * n and output n elements on this device.
            unsafe {
                nccl::reduce_scatter(
                    src as *const c_void,
                    dst as *mut c_void,
                    n,
                    dt,
                    rop,
                    comm,
                    s,
                )
            }
            .map(|_| ())
        })
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let name = "all_reduce";
        self.check_tensors(name, &[tensor])?;
        let (p, n) = (ptr(tensor)?, tensor.numel());
        let (dt, rop) = (nccl_dtype(tensor.dtype()), nccl_op(op));
        self.run(name, |comm, s| {
            // SAFETY: in place over n elements on this device.
            unsafe { nccl::all_reduce(p as *const c_void, p as *mut c_void, n, dt, rop, comm, s) }
                .map(|_| ())
        })
    }

    fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()> {
        let name = "broadcast";
        self.check_tensors(name, &[tensor])?;
        if src >= self.size {
            crate::error::bail_arg!(
                "broadcast: src {src} is not a rank of a group of {}",
                self.size
            );
        }
        let (p, n, dt) = (ptr(tensor)?, tensor.numel(), nccl_dtype(tensor.dtype()));
        self.run(name, |comm, s| {
            // SAFETY: in place over n elements on this device.
            unsafe {
                nccl::broadcast(
                    p as *const c_void,
                    p as *mut c_void,
                    n,
                    dt,
                    src as i32,
                    comm,
                    s,
                )
            }
            .map(|_| ())
        })
    }

    fn abort(&self, reason: &str) {
        self.mark_failed(reason.to_string());
    }

    fn barrier(&self) -> Result<()> {
        // As ProcessGroupNCCL: an all-reduce of one element on the device, then the host
        // waits for it (the one NCCL call that blocks), and reports what the watchdog found.
        let t = Tensor::zeros_on(&[1], DType::F32, self.device())?;
        self.all_reduce(&t, ReduceOp::Sum)?;
        cu::current_stream(self.ordinal)?.synchronize()?;
        // The watchdog may not have looked since the stream drained: look here too (and
        // wait for the communicator if the watchdog holds it, or a failure would pass).
        let seq = *self.seq.lock();
        if let Some(e) = self.shared.async_failure("barrier", seq, true) {
            self.shared.fail(e);
        }
        match self.failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message carries NCCL's own description of the code (skipped without libnccl).
    #[test]
    fn nccl_message_says_what_the_code_means() {
        if !is_available() {
            eprintln!("skipped: no libnccl");
            return;
        }
        let msg = nccl_message(sys::ncclResult_t::ncclInvalidUsage, std::ptr::null_mut());
        assert!(msg.starts_with("NCCL error ncclInvalidUsage: "), "{msg}");
        assert!(msg.contains("invalid usage"), "{msg}");
    }
}
