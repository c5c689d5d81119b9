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

use super::flat_param::FlatParameter;
use super::progress::{self, Progress};
use super::streams::Streams;
use super::{MemoryStats, MixedPrecision};
use crate::backend::Device;
use crate::distributed::{Group, Work};
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

/// When backward all-gathers the next unit's parameters
/// (`torch.distributed.fsdp.BackwardPrefetch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum BackwardPrefetch {
    /// Before the current unit's gradient computation (`BACKWARD_PRE`): most overlap, one
    /// more unsharded unit alive.
    #[value(name = "pre")]
    BackwardPre,
    /// After the current unit's gradient computation, before its reduce-scatter
    /// (`BACKWARD_POST`).
    #[value(name = "post")]
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
struct UnitComm {
    shard: Tensor,
    padded: usize,
    is_root: bool,
}

/// A gather in flight (or done) whose buffer no unit has taken yet.
pub(super) struct Gather {
    pub work: Work,
    /// `(c W)` f32 values (rounded to `param_dtype` under mixed precision).
    pub full: Tensor,
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
    mem: Arc<Mutex<MemoryStats>>,
    units: Vec<UnitComm>,
    prefetched: Vec<Option<Gather>>,
    /// Units currently unsharded (gathered and not yet resharded).
    unsharded: Vec<bool>,
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
    /// A root forward with grad enabled has run and its backward has not finished: the
    /// parameters gathered for that backward (or regathered by it) must not change, so
    /// state-dict loading and `summon_full_params` refuse to run (FSDP1's
    /// `TrainingState.FORWARD_BACKWARD`).
    pub pending_backward: bool,
    /// Inside `summon_full_params`: forward and backward refuse to run
    /// (FSDP1's `TrainingState.SUMMON_FULL_PARAMS`).
    pub summoning: bool,
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
            prefetched: Vec::new(),
            unsharded: Vec::new(),
            pre_fwd: Vec::new(),
            prev_pre_fwd: Vec::new(),
            post_fwd: Vec::new(),
            bwd_cursor: 0,
            stats: RuntimeStats::default(),
            progress: Progress::default(),
            pending_backward: false,
            summoning: false,
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
        self.prefetched.push(None);
        self.unsharded.push(false);
        self.units.len() - 1
    }

    pub fn set_root(&mut self, id: usize) {
        if let Some(u) = self.units.get_mut(id) {
            u.is_root = true;
        }
    }

    pub fn set_unsharded(&mut self, id: usize, on: bool) {
        if let Some(u) = self.unsharded.get_mut(id) {
            *u = on;
        }
    }

    /// Issues the all-gather of unit `id` on the stream: `param_dtype` shard -> `param_dtype`
    /// full buffer -> f32 values in `full` (under `NoShard`, only the rounded copy). `full`
    /// is allocated on the compute device by the calling (compute) thread; the stream's
    /// scratch buffers are its own.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) when the buffer cannot be allocated.
    pub fn issue_gather(&mut self, id: usize) -> Result<Gather> {
        // The gather's collectives name the unit and the pass it is for.
        let _tag = progress::enter(self.progress.gather(id));
        let u = &self.units[id];
        let device = self.device;
        let full = Tensor::zeros_on(&[u.padded], DType::F32, device)?;
        self.mem.lock().on_unshard(full.nbytes());
        self.stats.all_gathers += 1;
        let dtype = self.mp.compute_dtype();
        let keep = vec![full.clone(), u.shard.clone()];
        let unshard = &self.streams.unshard;
        let work = if let Some(pre) = &self.streams.pre_unshard {
            // CpuOffload: the host-to-device copy (and cast to param_dtype) on the
            // pre-unshard stream, then the gather from it on the unshard stream, which
            // waits for the copy: the compute thread does not.
            let on_device = Tensor::zeros_on(u.shard.shape(), dtype, device)?;
            let h2d = {
                let (shard, dst) = (u.shard.clone(), on_device.clone());
                pre.submit_keeping(vec![u.shard.clone(), on_device.clone()], move || {
                    dst.copy_from(&shard)
                })
            };
            let (pg, out, padded, sharded) =
                (self.shard_pg.clone(), full.clone(), u.padded, self.sharded);
            let keep = vec![full.clone(), on_device.clone()];
            unshard.submit_keeping(keep, move || {
                h2d.wait()?;
                if sharded {
                    let lp_full = Tensor::zeros_on(&[padded], dtype, device)?;
                    pg.all_gather_into_tensor(&lp_full, &on_device)?;
                    out.copy_from(&lp_full)
                } else {
                    out.copy_from(&on_device)
                }
            })
        } else if !self.sharded {
            // NoShard: the "shard" is the whole flat parameter; make the compute copy.
            let (shard, out) = (u.shard.clone(), full.clone());
            unshard.submit_keeping(keep, move || {
                out.copy_from(&shard)?;
                super::mixed_precision::round_(&out, dtype)
            })
        } else if dtype == DType::F32 {
            unshard.all_gather_into_tensor(&self.shard_pg, &full, &u.shard)
        } else {
            let (pg, shard, out, padded) = (
                self.shard_pg.clone(),
                u.shard.clone(),
                full.clone(),
                u.padded,
            );
            unshard.submit_keeping(keep, move || {
                // FSDP1 `_use_low_precision_shard`: cast the shard, gather low precision.
                let lp_shard = shard.to_dtype(dtype)?;
                let lp_full = Tensor::zeros_on(&[padded], dtype, device)?;
                pg.all_gather_into_tensor(&lp_full, &lp_shard)?;
                out.copy_from(&lp_full)
            })
        };
        Ok(Gather { work, full })
    }

    /// The gather for unit `id`: the prefetched one, or one issued now.
    ///
    /// # Errors
    /// As [`issue_gather`](Self::issue_gather).
    pub fn take_or_issue(&mut self, id: usize) -> Result<Gather> {
        // Counted as unsharded from now on (the limit sees the gather in flight).
        self.set_unsharded(id, true);
        match self.prefetched.get_mut(id).and_then(Option::take) {
            Some(g) => Ok(g),
            None => self
                .issue_gather(id)
                .inspect_err(|_| self.set_unsharded(id, false)),
        }
    }

    fn unsharded_nonroot(&self) -> usize {
        (0..self.units.len())
            .filter(|&i| {
                !self.units[i].is_root && (self.unsharded[i] || self.prefetched[i].is_some())
            })
            .count()
    }

    /// Prefetches unit `id` unless it is unsharded, already prefetched, or the limit on
    /// unsharded units (two, besides the root) is reached.
    fn prefetch(&mut self, id: usize) {
        if !self.sharded
            || id >= self.units.len()
            || self.unsharded[id]
            || self.prefetched[id].is_some()
            || (self.limit_all_gathers && self.unsharded_nonroot() >= 2)
        {
            return;
        }
        // A prefetch that cannot even allocate is skipped: the unit gathers on demand
        // and reports the error then.
        if let Ok(g) = self.issue_gather(id) {
            self.stats.prefetched_all_gathers += 1;
            self.prefetched[id] = Some(g);
        }
    }

    /// Pre-forward of unit `id` (after its own gather was issued): records the order and,
    /// with `forward_prefetch`, prefetches the unit that came next last iteration.
    pub fn on_pre_forward(&mut self, id: usize, is_root: bool) {
        self.progress.entered_forward(id);
        if is_root {
            self.prev_pre_fwd = std::mem::take(&mut self.pre_fwd);
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
        self.progress.entered_backward(id);
        if is_root {
            self.bwd_cursor = 0;
        }
        let order: Vec<usize> = self.post_fwd.iter().rev().copied().collect();
        let pos = order[self.bwd_cursor.min(order.len())..]
            .iter()
            .position(|&u| u == id)
            .map(|p| p + self.bwd_cursor.min(order.len()));
        let next = pos.and_then(|p| {
            self.bwd_cursor = p + 1;
            order.get(p + 1).map(|&n| (n, p + 1))
        });
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
        for slot in self.prefetched.iter_mut() {
            if let Some(g) = slot.take() {
                self.stats.unused_prefetches += 1;
                self.mem.lock().on_reshard(g.full.nbytes());
                let (r, dt) = g.work.wait_timed();
                self.stats.comm_wait_s += dt.as_secs_f64();
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
}
