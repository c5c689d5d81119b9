//! The per-rank scheduler: which unit to all-gather ahead of use (prefetch), on the rank's
//! unshard stream (`streams.rs`), so that gathers overlap compute (FSDP1
//! `_exec_order_utils.py`, `_runtime_utils._prefetch_handle`, `limit_all_gathers`).
//!
//! Execution order is learned as FSDP1 does: every forward records the order in which units
//! finish their forward (post-forward order). Forward prefetch follows the previous
//! iteration's pre-forward order; backward prefetch follows this iteration's post-forward
//! order reversed, which is the order in which units start their backward. A unit that a
//! step does not use is simply not prefetched; a prefetch that goes unused is waited for and
//! dropped at the end of the pass. Every rank runs the same program, so every rank makes the
//! same prefetch decisions and issues the same collectives in the same order.

use super::buffers::BufferPool;
use super::collectives::Gather;
use super::flat_param::FlatParameter;
use super::progress::Progress;
use super::streams::Streams;
use super::{MemoryStats, MixedPrecision};
use crate::backend::Device;
use crate::distributed::Group;
use crate::error::Result;
use crate::tensor::Tensor;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// When backward all-gathers the next unit's parameters
/// (`torch.distributed.fsdp.BackwardPrefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum BackwardPrefetch {
    /// Before the current unit's gradient computation (`BACKWARD_PRE`): most overlap, one
    /// more unsharded unit alive.
    BackwardPre,
    /// After the current unit's gradient computation, before its reduce-scatter
    /// (`BACKWARD_POST`).
    BackwardPost,
}

/// Counters of one rank's FSDP communication, for metrics and benches.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct RuntimeStats {
    /// Seconds the compute thread spent blocked waiting for collectives (all-gathers it
    /// needed, reductions at the end of backward).
    pub comm_wait_s: f64,
    /// Parameter all-gathers issued.
    pub all_gathers: u64,
    /// Of those, issued ahead of use by forward or backward prefetch.
    pub prefetched_all_gathers: u64,
    /// Prefetched all-gathers that were never used (wasted; the order changed).
    pub unused_prefetches: u64,
    /// Gradient reductions issued (reduce-scatter, or all-reduce under `NoShard`).
    pub reductions: u64,
}

/// Everything needed to all-gather one unit without touching the unit.
pub(super) struct UnitComm {
    pub shard: Tensor,
    pub padded: usize,
    is_root: bool,
}

/// Where one unit's full parameters are: the one record of it, kept by the rank's
/// scheduler so that prefetching can move a unit it does not own (FSDP2's `ShardedState`,
/// with the gather in flight made explicit).
///
/// ```text
/// Sharded --prefetch--> Prefetched --take--> Gathering --wait ok--> Unsharded
///    |                      |                    |                      |
///    +--------take----------+-----> Gathering    +--wait failed--> Sharded
/// Unsharded --reshard--> Sharded;  Prefetched --unused at the end of a pass--> Sharded
/// ```
/// A unit that never frees its parameters (NoShard in f32 without offload) is `Unsharded`
/// from construction on, viewing its FlatParameter's whole "shard".
pub(super) enum ParamState {
    /// Only the local shard exists.
    Sharded,
    /// A prefetched all-gather, in flight or done, that no unit has taken yet.
    Prefetched(Gather),
    /// The unit took its gather and waits for it (its buffer already counts as unsharded).
    Gathering,
    /// The parameters view this gathered buffer, `(c W)`.
    Unsharded(Tensor),
}

/// One rank's scheduling state, shared by all its units.
pub(super) struct Scheduler {
    /// The rank's unshard, post-backward and pre-unshard streams.
    pub streams: Streams,
    pub shard_pg: Group,
    pub sharded: bool,
    pub mp: MixedPrecision,
    pub backward_prefetch: Option<BackwardPrefetch>,
    pub forward_prefetch: bool,
    pub limit_all_gathers: bool,
    /// The compute device: gathered buffers are allocated there.
    pub device: Device,
    /// The rank's memory figures: a gather's buffer counts from the moment it is issued.
    pub(super) mem: Arc<Mutex<MemoryStats>>,
    pub(super) units: Vec<UnitComm>,
    /// The rank's FSDP buffers, reused from step to step on CUDA (`buffers.rs`): taken
    /// and returned on the compute thread.
    pub buffers: BufferPool,
    /// Each unit's full parameters (see [`ParamState`]).
    states: Vec<ParamState>,
    /// This iteration's pre-forward order so far, and the previous iteration's.
    pre_fwd: Vec<usize>,
    prev_pre_fwd: Vec<usize>,
    /// This iteration's post-forward order (reversed: the backward order).
    post_fwd: Vec<usize>,
    bwd_cursor: usize,
    pub stats: RuntimeStats,
    /// The step, micro-batch and pass the rank is in: what its collectives say they are
    /// for.
    pub progress: Progress,
}

impl Scheduler {
    pub fn new(
        streams: Streams,
        shard_pg: Group,
        sharded: bool,
        mp: MixedPrecision,
        mem: Arc<Mutex<MemoryStats>>,
        device: Device,
    ) -> Self {
        // On the host too (see the module docs of `buffers.rs`), unless the CPU tensor pool
        // was told to keep nothing (`tensor::pool::set_pool_limit(0)`, stored as 1 byte):
        // then FSDP keeps no host buffer between uses either.
        let keep = device.is_cuda() || crate::tensor::pool::pool_limit() > 1;
        let mut buffers = BufferPool::new(keep, 1);
        if let (Device::Cuda(i), true) = (device, streams.pre_unshard.is_some()) {
            // CPU offload on a GPU: the host gradient shards are pinned.
            buffers.pin_host(i);
        }
        Scheduler {
            mem,
            device,
            streams,
            shard_pg,
            sharded,
            mp,
            backward_prefetch: None,
            forward_prefetch: false,
            limit_all_gathers: false,
            units: Vec::new(),
            // Double buffering for buffers a stream still uses: one stays in flight.
            buffers,
            states: Vec::new(),
            pre_fwd: Vec::new(),
            prev_pre_fwd: Vec::new(),
            post_fwd: Vec::new(),
            bwd_cursor: 0,
            stats: RuntimeStats::default(),
            progress: Progress::default(),
        }
    }

    /// Shards live in host memory (`CpuOffload`): the pre-unshard stream exists for them.
    pub fn offload(&self) -> bool {
        self.streams.pre_unshard.is_some()
    }

    /// Registers the unit of module `name`; returns its id.
    pub fn register(&mut self, flat: &FlatParameter, name: &str) -> usize {
        self.progress.register(self.units.len(), name);
        self.units.push(UnitComm {
            shard: flat.local_shard.clone(),
            padded: flat.padded_numel(),
            is_root: false,
        });
        self.states.push(ParamState::Sharded);
        self.units.len() - 1
    }

    pub fn set_root(&mut self, id: usize) {
        if let Some(u) = self.units.get_mut(id) {
            u.is_root = true;
        }
    }

    /// The buffer unit `id`'s parameters view, while it is unsharded.
    pub fn full(&self, id: usize) -> Option<Tensor> {
        match self.states.get(id) {
            Some(ParamState::Unsharded(t)) => Some(t.clone()),
            _ => None,
        }
    }

    /// Unit `id` views `full` from now on (its gather completed, or it never shards).
    pub fn set_unsharded(&mut self, id: usize, full: Tensor) {
        if let Some(s) = self.states.get_mut(id) {
            *s = ParamState::Unsharded(full);
        }
    }

    /// Unit `id`'s gather failed: sharded again, its buffer no longer counted.
    pub fn gather_failed(&mut self, id: usize, bytes: usize) {
        if let Some(s) = self.states.get_mut(id) {
            *s = ParamState::Sharded;
            self.mem.lock().on_reshard(bytes);
        }
    }

    /// Frees unit `id`'s gathered buffer: returns it when the unit was unsharded.
    pub fn reshard(&mut self, id: usize) -> Option<Tensor> {
        let s = self.states.get_mut(id)?;
        match std::mem::replace(s, ParamState::Sharded) {
            ParamState::Unsharded(full) => {
                self.mem.lock().on_reshard(full.nbytes());
                Some(full)
            }
            other => {
                *s = other;
                None
            }
        }
    }

    /// The gather unit `id` waits for next: the prefetched one, or one issued now; `None`
    /// when the unit is unsharded already. The unit is `Gathering` until it reports the
    /// wait's outcome ([`set_unsharded`](Self::set_unsharded) or
    /// [`gather_failed`](Self::gather_failed)).
    ///
    /// # Errors
    /// As [`issue_gather`](Self::issue_gather); `Fsdp` for a unit already waiting.
    pub fn take_or_issue(&mut self, id: usize) -> Result<Option<Gather>> {
        let Some(s) = self.states.get_mut(id) else {
            return Err(crate::Error::Fsdp(format!("internal: no FSDP unit {id}")));
        };
        let g = match std::mem::replace(s, ParamState::Gathering) {
            ParamState::Prefetched(g) => g,
            ParamState::Sharded => match self.issue_gather(id) {
                Ok(g) => g,
                Err(e) => {
                    self.states[id] = ParamState::Sharded;
                    return Err(e);
                }
            },
            ParamState::Unsharded(t) => {
                self.states[id] = ParamState::Unsharded(t);
                return Ok(None);
            }
            ParamState::Gathering => {
                return Err(crate::Error::Fsdp(format!(
                    "internal: FSDP unit {id} gathered twice at once"
                )))
            }
        };
        Ok(Some(g))
    }

    /// Units besides the root whose full parameters exist or are on their way.
    fn unsharded_nonroot(&self) -> usize {
        (0..self.units.len())
            .filter(|&i| !self.units[i].is_root && !matches!(self.states[i], ParamState::Sharded))
            .count()
    }

    /// Prefetches unit `id` unless it is unsharded, already prefetched, or the limit on
    /// unsharded units (two, besides the root) is reached.
    fn prefetch(&mut self, id: usize) {
        if !self.sharded
            || !matches!(self.states.get(id), Some(ParamState::Sharded))
            || (self.limit_all_gathers && self.unsharded_nonroot() >= 2)
        {
            return;
        }
        // A prefetch that cannot even allocate is skipped: the unit gathers on demand
        // and reports the error then.
        if let Ok(g) = self.issue_gather(id) {
            self.stats.prefetched_all_gathers += 1;
            self.states[id] = ParamState::Prefetched(g);
        }
    }

    /// Pre-forward of unit `id` (after its own gather was issued): records the order and,
    /// with `forward_prefetch`, prefetches the unit that came next last iteration.
    pub fn on_pre_forward(&mut self, id: usize, is_root: bool) {
        self.progress.entered(id);
        if is_root {
            // The two orders swap their vectors: no step allocates one anew.
            std::mem::swap(&mut self.prev_pre_fwd, &mut self.pre_fwd);
            self.pre_fwd.clear();
            self.post_fwd.clear();
        }
        let pos = self.pre_fwd.len();
        self.pre_fwd.push(id);
        if self.forward_prefetch && self.prev_pre_fwd.get(pos) == Some(&id) {
            if let Some(&next) = self.prev_pre_fwd.get(pos + 1) {
                self.prefetch(next);
            }
        }
    }

    /// Post-forward of unit `id`.
    pub fn on_post_forward(&mut self, id: usize) {
        self.post_fwd.push(id);
    }

    /// Pre-backward of unit `id`: advances the backward cursor; returns the unit that
    /// backward reaches next and its place in the backward order (if known), and prefetches
    /// it under `BackwardPre`.
    pub fn on_pre_backward(&mut self, id: usize, is_root: bool) -> Option<(usize, usize)> {
        self.progress.entered(id);
        if is_root {
            self.bwd_cursor = 0;
        }
        // The backward order is the post-forward order reversed: its entry i is
        // `post_fwd[len - 1 - i]`.
        let n = self.post_fwd.len();
        let post = &self.post_fwd;
        let order = |i: usize| post[n - 1 - i];
        let pos = (self.bwd_cursor.min(n)..n).find(|&i| order(i) == id);
        let next = pos.and_then(|p| (p + 1 < n).then(|| (order(p + 1), p + 1)));
        if let Some(p) = pos {
            self.bwd_cursor = p + 1;
        }
        if let (Some((n, _)), Some(BackwardPrefetch::BackwardPre)) = (next, self.backward_prefetch)
        {
            self.prefetch(n);
        }
        next
    }

    /// Post-backward of a unit whose successor in backward order is `next`: prefetches it
    /// under `BackwardPost`, unless its backward has already begun (a unit enclosing
    /// others, such as the root, finishes its backward after theirs).
    pub fn on_post_backward(&mut self, next: Option<(usize, usize)>) {
        if let (Some((n, pos)), Some(BackwardPrefetch::BackwardPost)) =
            (next, self.backward_prefetch)
        {
            if pos >= self.bwd_cursor {
                self.prefetch(n);
            }
        }
    }

    /// Waits for and drops every prefetch nobody used; returns the first error among them.
    pub fn drain_prefetches(&mut self) -> Result<()> {
        let mut first = Ok(());
        for state in self.states.iter_mut() {
            if !matches!(state, ParamState::Prefetched(_)) {
                continue;
            }
            if let ParamState::Prefetched(g) = std::mem::replace(state, ParamState::Sharded) {
                self.stats.unused_prefetches += 1;
                self.mem.lock().on_reshard(g.full.nbytes());
                let (r, dt) = g.work.wait_timed();
                self.stats.comm_wait_s += dt.as_secs_f64();
                // The compute stream now waits for the gather: the buffer is free for it.
                if r.is_ok() {
                    self.buffers.give(g.full);
                }
                if first.is_ok() {
                    first = r;
                }
            }
        }
        first
    }

    /// Records time the compute thread spent blocked on communication.
    pub fn add_wait(&mut self, dt: Duration) {
        self.stats.comm_wait_s += dt.as_secs_f64();
    }

    /// A buffer from the rank's [`BufferPool`] ([`BufferPool::take`]; zeroed with `zero`),
    /// the time it waited for a stream counted as communication wait.
    ///
    /// # Errors
    /// As [`BufferPool::take`].
    pub fn take_buffer(
        &mut self,
        numel: usize,
        dtype: crate::tensor::DType,
        device: Device,
        zero: bool,
    ) -> Result<Tensor> {
        let t = if zero {
            self.buffers.take_zeroed(numel, dtype, device)
        } else {
            self.buffers.take(numel, dtype, device)
        };
        let dt = self.buffers.take_waited();
        self.add_wait(dt);
        t
    }
}
