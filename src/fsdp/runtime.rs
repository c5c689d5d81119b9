//! What the hooks run (FSDP1 `_runtime_utils.py`): a unit's unshard and reshard, and the
//! end of the root's backward (the ranks' agreement, waiting for every unit's reduction
//! and adding it into the sharded gradient, draining the streams). The hooks themselves
//! are in `hooks.rs`; the collectives they issue in `collectives.rs`.

use super::collectives::Gather;
use super::walk::Point;
use super::FullyShardedDataParallel;
use crate::distributed::ReduceOp;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

impl FullyShardedDataParallel {
    /// All-gathers the FlatParameter (or takes the prefetched gather) and points the
    /// parameters at it; a no-op when already unsharded. FSDP1 `_unshard`.
    ///
    /// # Errors
    /// The all-gather's error (mismatch, timeout, failed peer).
    pub fn unshard(&mut self) -> Result<()> {
        let g = self.begin_unshard();
        self.finish_unshard(g)
    }

    /// Issues (or takes) this unit's gather; `Ok(None)` when already unsharded.
    pub(super) fn begin_unshard(&mut self) -> Result<Option<Gather>> {
        self.rs.sched.lock().take_or_issue(self.id)
    }

    /// Waits for the gather [`begin_unshard`](Self::begin_unshard) returned and points the
    /// parameters at it.
    pub(super) fn finish_unshard(&mut self, g: Result<Option<Gather>>) -> Result<()> {
        match self.wait_unshard(g)? {
            Some(full) => self.point_params(Some(&full), false),
            None => Ok(()),
        }
    }

    /// Waits for the gather [`begin_unshard`](Self::begin_unshard) returned and records
    /// the unit as unsharded; returns the buffer the parameters are to view, `None` when
    /// they already do.
    pub(super) fn wait_unshard(&mut self, g: Result<Option<Gather>>) -> Result<Option<Tensor>> {
        let Some(g) = g? else { return Ok(None) };
        let (r, dt) = g.work.wait_timed();
        let mut s = self.rs.sched.lock();
        s.add_wait(dt);
        match r {
            Ok(()) => {
                s.set_unsharded(self.id, g.full.clone());
                Ok(Some(g.full))
            }
            Err(e) => {
                s.gather_failed(self.id, g.full.nbytes());
                Err(e)
            }
        }
    }

    /// Frees the unsharded buffer; parameters become unmaterialized. FSDP1 `_reshard`.
    /// A no-op for a unit that never frees its parameters (NoShard in f32 without
    /// offload: they view the whole flat parameter for good).
    ///
    /// # Errors
    /// `Fsdp` when the module's parameters changed since wrapping.
    pub fn reshard(&mut self) -> Result<()> {
        self.reshard_and(Point::Keep)
    }

    /// [`reshard`](Self::reshard), doing `grad` to the parameters' grads in the same walk.
    pub(super) fn reshard_and(&mut self, grad: Point<'_>) -> Result<()> {
        let freed = if self.rs.keeps_unsharded() {
            None
        } else {
            self.rs.sched.lock().reshard(self.id)
        };
        let data = if freed.is_some() {
            Point::Clear
        } else {
            Point::Keep
        };
        if !matches!((data, grad), (Point::Keep, Point::Keep)) {
            self.point(data, grad)?;
        }
        if let Some(full) = freed {
            // The compute stream waited for the gather and queued every read of the
            // parameters: the buffer is free for the next gather (of any unit this size).
            self.rs.sched.lock().buffers.give(full);
        }
        Ok(())
    }

    /// End of the root's backward (FSDP1 `_post_backward_final_callback`): every unit's
    /// reduction is waited for and accumulated, unused prefetches dropped. Under CPU
    /// offload on a GPU the host then synchronizes with the compute stream once, which
    /// waited for every reduction and gather: the gradient shards' device-to-host copies
    /// have landed for the host's readers (accumulation, clipping, the CPU optimizer), and
    /// the parameter shards' host-to-device copies have read the shards the optimizer is
    /// about to write. FSDP1 `_post_backward_final_callback`'s
    /// `current_stream().synchronize()` under `offload_params`.
    pub(super) fn finalize_backward(&mut self) -> Result<()> {
        // Every unit's reduction is finished even after one fails (nothing is left in
        // flight); the first error is the one to report.
        let mut first = self.each_unit_all(|u| u.wait_reduce());
        let r = self.drain_stream();
        first = first.and(r);
        let r = self.sync_offloaded_grads();
        first = first.and(r);
        let r = self.each_unit_all(|u| u.accumulate_reduced());
        first.and(r)
    }

    /// Under CPU offload on a GPU: blocks the host until the compute stream's work so far
    /// has run (one host synchronization; see
    /// [`finalize_backward`](Self::finalize_backward)). A no-op otherwise.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) with the stream's first asynchronous error.
    pub(super) fn sync_offloaded_grads(&self) -> Result<()> {
        let device = self.rs.device;
        if !device.is_cuda() || !self.rs.sched.lock().offload() || skip_offload_sync() {
            return Ok(());
        }
        if let crate::backend::Device::Cuda(i) = device {
            return crate::backend::cuda::current_stream(i)?.synchronize();
        }
        Ok(())
    }

    /// Waits until the stream is idle and drops unused prefetches; every FSDP buffer a
    /// stream job used is then free for the compute stream.
    pub(super) fn drain_stream(&mut self) -> Result<()> {
        let mut s = self.rs.sched.lock();
        let r = s.drain_prefetches();
        let dt = s.streams.synchronize();
        s.add_wait(dt);
        // A failed job's buffer is left out; its error is the job's, reported by its own
        // wait.
        let _ = s.buffers.settle();
        let dt = s.buffers.take_waited();
        s.add_wait(dt);
        r
    }

    /// The ranks meet on the unshard stream before waiting for the gradient reductions,
    /// comparing how many each issued: a rank that kept its gradients under `no_sync`
    /// while another reduced them would otherwise wait on the gathers' communicator for
    /// the next forward while the other waits on the reductions' communicator, each for
    /// the other, until the group timeout. See [Note: end-of-backward agreement] in
    /// `progress.rs`.
    pub(super) fn agree_end_of_backward(&mut self) -> Result<()> {
        let mut one = None;
        let work = {
            let mut s = self.rs.sched.lock();
            if !s.streams.reduces_apart() {
                return Ok(());
            }
            let _tag = super::progress::enter(s.progress.end_of_backward(self.id));
            match s.shard_pg.collective_device() {
                // NCCL: a one-element all-reduce ordered on the device is the meeting (its
                // watchdog names a rank that never comes); a barrier would block the host.
                Some(d) if d.is_cuda() && s.shard_pg.backend() == "nccl" => {
                    let t = s.take_buffer(1, DType::F32, d, true)?;
                    let w = s.streams.unshard.all_reduce(&s.shard_pg, &t, ReduceOp::Sum);
                    one = Some(t);
                    w
                }
                _ => s.streams.unshard.barrier(&s.shard_pg),
            }
        };
        let (r, dt) = work.wait_timed();
        let mut s = self.rs.sched.lock();
        s.add_wait(dt);
        // The compute stream waits for the all-reduce now: the element is free again.
        if let (Ok(()), Some(t)) = (&r, one) {
            s.buffers.give(t);
        }
        r
    }

    /// After a collective mismatch (ranks that took different code paths) this rank
    /// cannot go on: its world is aborted, so that no collective in flight here or on a
    /// peer waits for a call that will never come.
    pub(super) fn abort_on_desync(&self, e: &crate::error::Error) {
        if matches!(e, crate::error::Error::CollectiveMismatch { .. }) {
            self.rs.pg.abort(&e.to_string());
        }
    }
}

/// Test hook (builds with `test-hooks`): `FSDP_TEST_OFFLOAD_NO_SYNC=1` skips the end of
/// backward's synchronization under CPU offload, so that a test sees the host read
/// gradient shards whose device-to-host copies have not run (and fail).
fn skip_offload_sync() -> bool {
    #[cfg(feature = "test-hooks")]
    {
        std::env::var("FSDP_TEST_OFFLOAD_NO_SYNC").is_ok_and(|v| v == "1")
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        false
    }
}
