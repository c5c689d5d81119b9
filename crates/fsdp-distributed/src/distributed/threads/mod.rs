//! The `threads` backend: every rank is a thread of this process and collectives run over
//! shared memory.
//!
//! A collective is a three-phase rendezvous on one mutex + condvar per group
//! (`rendezvous.rs`):
//! 1. *arrive*: each rank locks its tensors (read lock on what it only reads, write lock on
//!    what it writes), posts a descriptor (op, dtype, element counts, reduce op or source)
//!    and the addresses of its tensors; the last to arrive compares the descriptors of all
//!    ranks;
//! 2. *execute*: each rank moves its share of the data, reading (and for all-reduce
//!    writing) the peers' tensors directly through those addresses (`kernels.rs`);
//! 3. *depart*: a rank returns, and releases its locks, only after every rank finished
//!    executing, so the caller may reuse its tensors at once and no peer touches them later.
//!
//! Waiting for arrivals is bounded by the group timeout; a rank that fails, panics or exits
//! without joining wakes the others at once with its rank named. Once every rank has
//! arrived, the rest is bounded work without waiting on anything else. A waiting rank polls
//! for about 50 us (yielding its core between polls) before it sleeps: waking a sleeping
//! thread costs more than a small collective on this kind of machine.
//!
//! # Data paths
//!
//! Every element is read from where the caller put it and written where the caller wants
//! it, once; there are no staging buffers, and nothing is allocated per call once a group
//! has run its first collective (descriptors are `Copy`, each rank reuses one scratch list
//! of its peers' addresses).
//!
//! | collective | rank `r` of `w` executes | bytes per rank (message `S`) |
//! |---|---|---|
//! | `all_gather_into_tensor` | copies each rank's input straight into chunk `s` of its output (`memcpy`), all ranks in the same order; skips its own chunk when the input is that chunk (in place) | writes `S`, reads `S` (`(w-1)/w S` in place) |
//! | `reduce_scatter_tensor` | reduces chunk `r` of every peer's input into its output, one L1-sized chunk at a time; the output may be chunk `r` of its input (in place); a separate output of 16 MiB or more is written with non-temporal stores | reads `S`, writes `S/w` |
//! | `all_reduce` | reduces elements `r·S/w..(r+1)·S/w` of every rank's tensor and writes the result into that range of every rank's tensor, so the ranks share the work evenly | reads `S`, writes `S` |
//! | `broadcast` | copies the source's tensor into its own (not the source) | reads and writes `S` |
//!
//! Reductions widen every value to f64, combine the ranks in rank order, and round once into
//! the dtype (bf16/f16 through f32, i32 to nearest), per element exactly as a plain loop
//! would; the loops run over chunks with the op and dtype fixed outside them, so they
//! vectorize. With two or more ranks on two or more cores the ranks' threads do the work in
//! parallel; no collective leaves one rank doing everything. All-reduce writes the peers'
//! tensors directly rather than reduce-scattering into a scratch buffer and all-gathering
//! it back: that alternative moves twice the bytes and measured 1.5 - 3x slower.
//!
//! `cargo bench --bench collectives` measures these paths against a memcpy of the same
//! size (bus bandwidth as nccl-tests defines it).
//!
//! # CUDA tensors
//!
//! When a rank's tensors are on a CUDA device (`device.rs`, `cuda` feature), the same
//! rendezvous runs with device addresses and a ready event per rank; the data moves by
//! device-to-device or peer copies and the `reduce_ranks_{dtype}` kernel, with the same
//! split of the work, the same rank order and the same rounding as above, on the caller's
//! current stream, which the host synchronizes before departing. Every rank of one
//! collective must be on a device or every rank on the host ([`Error::CollectiveMismatch`]
//! otherwise), and one rank's tensors on one device (`DeviceMismatch`).
//!
//! Two costs remain: an input that overlaps the output other than as this rank's own chunk
//! is first copied (one allocation), and tensors are locked for the whole collective, so a
//! storage that one rank writes must not be passed by another rank of the same collective
//! (the second rank waits for the lock until the first times out).

mod device;
pub(crate) mod kernels;
mod rendezvous;

use super::{ProcessGroup, ReduceOp};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Element, Tensor};
use parking_lot::Mutex;
use rendezvous::{Arg, Arrival, Desc, Ptr, Shared};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Default collective timeout: 300 s. `torch.distributed`'s is 30 min (10 min for NCCL);
/// shorter here so that a rank that never arrives is reported sooner.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Every group of one in-process world, so that a rank's failure or exit reaches peers
/// waiting in any group, and so that the members of a `new_group` find the same one.
#[derive(Default)]
struct World {
    groups: Mutex<WorldGroups>,
    /// The world is a user of the CPU buffer pool: the last group or model to drop
    /// empties it.
    _pool_user: crate::tensor::PoolUser,
}

#[derive(Default)]
struct WorldGroups {
    /// All groups, the world first.
    all: Vec<Arc<Shared>>,
    /// Subgroups by (sorted world ranks, how many groups with these ranks the caller
    /// created before).
    by_key: HashMap<(Vec<usize>, usize), Arc<Shared>>,
}

/// One rank's handle to an in-process group. Create all ranks' handles of a world at once
/// with [`ThreadsGroup::new_world`] and move one into each rank's thread; subgroups come
/// from [`ProcessGroup::new_group`].
pub struct ThreadsGroup {
    rank: usize,
    shared: Arc<Shared>,
    world: Arc<World>,
    /// This rank's `new_group` calls so far, per rank list (the n-th call by every member
    /// yields the same group, as `torch.distributed.new_group` requires the same order).
    created: crate::distributed::subgroups::NewGroupCounter,
    /// Scratch for the peers' arrivals of the running collective (capacity: group size).
    peers: Mutex<Vec<Arrival>>,
}

use crate::distributed::desc::dispatch;

/// The input a collective reads: `input` itself, or a copy when it overlaps `output`
/// other than as this rank's own chunk (`in_place`): one lock covers the storage, and
/// peers must not read what this rank is writing.
/// Allocates nothing unless it copies.
pub(crate) fn unaliased<'a>(
    input: &'a Tensor,
    output: &Tensor,
    in_place: bool,
) -> Result<std::borrow::Cow<'a, Tensor>> {
    Ok(if input.shares_storage(output) && !in_place {
        std::borrow::Cow::Owned(input.deep_clone()?)
    } else {
        std::borrow::Cow::Borrowed(input)
    })
}

/// True when `part` is the `part.numel()` elements of `whole` starting `offset` elements in.
pub(crate) fn is_chunk_of(part: &Tensor, whole: &Tensor, offset: usize) -> bool {
    part.shares_storage(whole) && part.offset() == whole.offset() + offset
}

/// Where one rank's tensors of a collective live: host memory (the shared-memory path) or
/// one CUDA device (`device.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Host,
    Cuda(usize),
}

/// The place of `ts`, all on the host or all on one CUDA device.
///
/// # Errors
/// `DeviceMismatch` naming `op` when CUDA tensors are mixed with host tensors or with
/// tensors of another GPU (a rank's tensors of one collective must share a device; ranks
/// may be on different GPUs).
fn place(op: &'static str, ts: &[&Tensor]) -> Result<Place> {
    let first = ts.first().map_or(Device::Cpu, |t| t.device());
    for t in ts.iter().skip(1) {
        let d = t.device();
        if d != first && (d.is_cuda() || first.is_cuda()) {
            return Err(Error::DeviceMismatch {
                op,
                expected: first.to_string(),
                got: d.to_string(),
            });
        }
    }
    Ok(match first {
        Device::Cuda(i) => Place::Cuda(i),
        _ => Place::Host,
    })
}

impl ThreadsGroup {
    fn handle(rank: usize, shared: Arc<Shared>, world: Arc<World>) -> ThreadsGroup {
        let size = shared.size();
        ThreadsGroup {
            rank,
            shared,
            world,
            created: Default::default(),
            peers: Mutex::new(Vec::with_capacity(size)),
        }
    }

    /// Handles for ranks `0..size` of one new group whose collectives time out after
    /// `timeout`.
    ///
    /// # Errors
    /// `InvalidArgument` when `size == 0`.
    pub fn new_world(size: usize, timeout: Duration) -> Result<Vec<ThreadsGroup>> {
        if size == 0 {
            crate::error::bail_arg!("a process group needs at least one rank");
        }
        let shared = Shared::new((0..size).collect(), timeout);
        let world = Arc::new(World::default());
        world.groups.lock().all.push(shared.clone());
        Ok((0..size)
            .map(|rank| ThreadsGroup::handle(rank, shared.clone(), world.clone()))
            .collect())
    }

    /// This rank's index in the world.
    pub fn world_rank(&self) -> usize {
        self.shared.members()[self.rank]
    }

    /// World ranks of this group's members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        self.shared.members()
    }

    /// Records that this rank failed; every rank waiting in a collective of this group
    /// returns [`Error::PeerFailed`] naming it. The first failure
    /// recorded is kept. The failure is recorded in every group of the world (ranks named by
    /// world rank).
    pub fn mark_failed(&self, reason: impl Into<String>) {
        let reason = reason.into();
        let me = self.world_rank();
        for g in self.world.groups.lock().all.iter() {
            g.record_failure(me, &reason);
        }
    }

    /// Records that this rank will call no more collectives (in any group of the world);
    /// peers waiting for it fail at once instead of waiting out the timeout.
    pub fn mark_exited(&self) {
        let me = self.world_rank();
        for g in self.world.groups.lock().all.iter() {
            g.record_exit(me);
        }
    }

    /// Runs one collective of host tensors with this rank's descriptor and tensor
    /// addresses; `exec` moves this rank's share of the data once every rank has arrived.
    fn run(
        &self,
        desc: Desc,
        input: Ptr,
        output: Ptr,
        exec: impl FnOnce(&[Arrival]),
    ) -> Result<()> {
        self.run_arrival(Arrival::host(desc, input, output), |peers| {
            exec(peers);
            Ok(())
        })
    }

    /// Runs one collective with this rank's full arrival (device tensors publish their
    /// device and ready event too).
    fn run_arrival(
        &self,
        arrival: Arrival,
        exec: impl FnOnce(&[Arrival]) -> Result<()>,
    ) -> Result<()> {
        let mut peers = self.peers.lock();
        self.shared.collective(self.rank, arrival, &mut peers, exec)
    }

    /// [`run_arrival`](Self::run_arrival) for a device collective ordered on `side`'s
    /// stream (see `device.rs`).
    fn run_ordered(
        &self,
        side: &device::Side,
        arrival: Arrival,
        exec: impl FnOnce(&[Arrival]) -> Result<Option<rendezvous::Mark>>,
    ) -> Result<()> {
        let mut peers = self.peers.lock();
        let wait = |p| side.wait_peer(p);
        self.shared
            .collective_ordered(self.rank, arrival, &mut peers, exec, Some(&wait))
    }

    fn all_gather_typed<T: Element>(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        let (rank, n) = (self.rank, input.numel());
        let in_place = is_chunk_of(input, output, rank * n);
        // An input that overlaps the output elsewhere is read from a copy: one lock covers
        // the storage, and peers must not read what this rank is writing.
        let input = unaliased(input, output, in_place)?;
        let input: &Tensor = &input;
        // The guards live until the collective returned: every peer is done with them.
        let mut out = output.data_mut::<T>()?;
        let inp = if in_place {
            None
        } else {
            Some(input.data::<T>()?)
        };
        let out_ptr = out.as_mut_ptr();
        let in_ptr = match &inp {
            Some(g) => g.as_ptr(),
            None => out_ptr.wrapping_add(rank * n),
        };
        let desc = Desc {
            op: "all_gather_into_tensor",
            dtype: T::DTYPE,
            in_numel: n,
            out_numel: output.numel(),
            arg: Arg::None,
            cuda: false,
            tag: None,
        };
        self.run(desc, Ptr::of(in_ptr), Ptr::of(out_ptr), |peers| {
            // SAFETY: the descriptors agree, so every peer's input holds `n` elements of `T`
            // (locked by its rank until all departed) and `out` holds `w * n`; a peer's input
            // is its own tensor, which overlaps this rank's output only when it is this
            // rank's chunk of it (in place, skipped); this rank alone writes `out`.
            unsafe { kernels::all_gather::<T>(out_ptr, n, peers) }
        })
    }

    fn reduce_scatter_typed<T: Element>(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let (rank, m) = (self.rank, output.numel());
        let in_place = is_chunk_of(output, input, rank * m);
        let input = unaliased(input, output, in_place)?;
        let input: &Tensor = &input;
        // In place, one write lock covers input and output.
        let mut guards = kernels::InOutGuards::<T>::lock(input, output, in_place)?;
        let (in_ptr, out_ptr) = guards.ptrs(rank * m);
        let stream = !in_place && m * std::mem::size_of::<T>() >= kernels::STREAM_MIN_BYTES;
        let desc = Desc {
            op: "reduce_scatter_tensor",
            dtype: T::DTYPE,
            in_numel: input.numel(),
            out_numel: m,
            arg: Arg::Op(op),
            cuda: false,
            tag: None,
        };
        self.run(desc, Ptr::of(in_ptr), Ptr::of(out_ptr), |peers| {
            let src = |s: usize| peers[s].input.cast::<T>().wrapping_add(rank * m) as *const T;
            // SAFETY: the descriptors agree, so every peer's input holds `w * m` elements
            // and chunk `rank` of it is `m` long; only this rank reads chunk `rank` of the
            // inputs, and only this rank writes `out`, which is either separate memory or
            // chunk `rank` of its own input (read before written, chunk by chunk).
            unsafe { kernels::reduce::<T, _, _>(op, peers.len(), m, src, 1, |_| out_ptr, stream) }
        })
    }

    fn all_reduce_typed<T: Element>(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let (rank, len) = (self.rank, tensor.numel());
        let mut t = tensor.data_mut::<T>()?;
        let ptr = Ptr::of(t.as_mut_ptr());
        let desc = Desc {
            op: "all_reduce",
            dtype: T::DTYPE,
            in_numel: len,
            out_numel: len,
            arg: Arg::Op(op),
            cuda: false,
            tag: None,
        };
        self.run(desc, ptr, ptr, |peers| {
            let w = peers.len();
            // Each rank reduces its 1/w of the elements for everyone.
            let align = (64 / std::mem::size_of::<T>()).max(1);
            let (lo, hi) = kernels::split(len, w, rank, align);
            let src = |s: usize| peers[s].input.cast::<T>().wrapping_add(lo) as *const T;
            let dst = |d: usize| peers[d].output.cast::<T>().wrapping_add(lo);
            // SAFETY: the descriptors agree, so every rank's tensor holds `len` elements,
            // each write-locked by its rank (so all distinct) until all departed; the ranges
            // `lo..hi` of the ranks are disjoint, and each rank reads and writes only its
            // own range, reading each chunk before writing it.
            unsafe { kernels::reduce::<T, _, _>(op, w, hi - lo, src, w, dst, false) }
        })
    }

    fn broadcast_typed<T: Element>(&self, tensor: &Tensor, src: usize) -> Result<()> {
        let (rank, len) = (self.rank, tensor.numel());
        let (ro, mut rw) = if rank == src {
            (Some(tensor.data::<T>()?), None)
        } else {
            (None, Some(tensor.data_mut::<T>()?))
        };
        let (input, output) = match (&ro, &mut rw) {
            (Some(r), _) => (Ptr::of(r.as_ptr()), Ptr::NULL),
            (_, Some(w)) => (Ptr::NULL, Ptr::of(w.as_mut_ptr())),
            _ => return Err(crate::Error::Fsdp("internal: broadcast guards".into())),
        };
        let desc = Desc {
            op: "broadcast",
            dtype: T::DTYPE,
            in_numel: len,
            out_numel: len,
            arg: Arg::Src(src),
            cuda: false,
            tag: None,
        };
        self.run(desc, input, output, |peers| {
            if rank != src {
                let from = peers[src].input.cast::<T>() as *const T;
                // SAFETY: the descriptors agree, so the source's tensor (read-locked by it)
                // and this rank's (write-locked, hence distinct) hold `len` elements each.
                unsafe { std::ptr::copy_nonoverlapping(from, output.cast::<T>(), len) }
            }
        })
    }
}

impl ProcessGroup for ThreadsGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size()
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn world_rank(&self) -> usize {
        ThreadsGroup::world_rank(self)
    }

    fn ranks(&self) -> Vec<usize> {
        self.members().to_vec()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<super::Group>> {
        let world_size = self.world.groups.lock().all[0].size();
        let (members, nth) = self.created.next(ranks, world_size)?;
        let me = self.world_rank();
        let Some(local) = members.iter().position(|&r| r == me) else {
            return Ok(None);
        };
        let shared = {
            let mut g = self.world.groups.lock();
            let WorldGroups { all, by_key } = &mut *g;
            by_key
                .entry((members.clone(), nth))
                .or_insert_with(|| {
                    let s = Shared::new(members.clone(), self.shared.timeout());
                    all.push(s.clone());
                    s
                })
                .clone()
        };
        Ok(Some(Arc::new(ThreadsGroup::handle(
            local,
            shared,
            self.world.clone(),
        ))))
    }

    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        crate::distributed::desc::check_all_gather(self.rank, self.size(), output, input)?;
        match place("all_gather_into_tensor", &[output, input])? {
            Place::Host => dispatch!(input.dtype(), self.all_gather_typed(output, input)),
            Place::Cuda(i) => self.all_gather_cuda(output, input, i),
        }
    }

    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        crate::distributed::desc::check_reduce_scatter(self.rank, self.size(), output, input, op)?;
        match place("reduce_scatter_tensor", &[output, input])? {
            Place::Host => dispatch!(input.dtype(), self.reduce_scatter_typed(output, input, op)),
            Place::Cuda(i) => self.reduce_scatter_cuda(output, input, op, i),
        }
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        match place("all_reduce", &[tensor])? {
            Place::Host => dispatch!(tensor.dtype(), self.all_reduce_typed(tensor, op)),
            Place::Cuda(i) => self.all_reduce_cuda(tensor, op, i),
        }
    }

    fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()> {
        if src >= self.size() {
            crate::error::bail_arg!(
                "broadcast: src rank {src} is not in a group of {} ranks",
                self.size()
            );
        }
        match place("broadcast", &[tensor])? {
            Place::Host => dispatch!(tensor.dtype(), self.broadcast_typed(tensor, src)),
            Place::Cuda(i) => self.broadcast_cuda(tensor, src, i),
        }
    }

    fn abort(&self, reason: &str) {
        self.mark_failed(reason);
    }

    fn barrier(&self) -> Result<()> {
        let desc = Desc {
            op: "barrier",
            dtype: DType::F32,
            in_numel: 0,
            out_numel: 0,
            arg: Arg::None,
            cuda: false,
            tag: None,
        };
        self.run(desc, Ptr::NULL, Ptr::NULL, |_| {})
    }
}
