//! FSDP's runtime hooks around a unit's forward and backward (FSDP1 `_runtime_utils.py`).
//!
//! ```text
//! forward:  [root: new iteration] issue/take the all-gather -> prefetch the next unit
//!           (forward_prefetch) -> wait -> inner.forward -> reshard if the strategy frees
//!           after forward and this is not the root (or always, without grad)
//!           [root: wait for the stream, drop unused prefetches]
//! backward: issue/take the all-gather if freed -> prefetch the next unit (BackwardPre)
//!           -> wait -> point grads at a zeroed flat grad buffer -> inner.backward -> reshard
//!           -> prefetch the next unit (BackwardPost) -> issue predivide + reduce-scatter
//!           (NoShard: all-reduce) + postdivide on the stream
//!           [root: wait for every unit's reduction and accumulate it into the sharded grad]
//! ```
//!
//! Gathers go on the rank's unshard stream and reductions on its post-backward stream
//! (`streams.rs`), each in issue order, so every rank issues the same sequence on each and
//! the compute thread overlaps both.

use super::mixed_precision::round_;
use super::unit::gradient_divide_factors;
use super::FullyShardedDataParallel;
use crate::backend::Device;
use crate::distributed::{ReduceOp, Work};
use crate::error::Result;
use crate::nn::{ChildVisitor, Context, Module};
use crate::ops::flat;
use crate::tensor::{DType, Tensor};

/// A gradient reduction in flight: its handle and the f32 shard it fills (complete once
/// the handle is).
pub(super) struct PendingGrad {
    work: Work,
    out: Tensor,
}

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
    fn begin_unshard(&mut self) -> Result<Option<super::scheduler::Gather>> {
        if self.flat.unsharded.is_some() {
            return Ok(None);
        }
        self.rs.sched.lock().take_or_issue(self.id).map(Some)
    }

    fn finish_unshard(&mut self, g: Result<Option<super::scheduler::Gather>>) -> Result<()> {
        let Some(g) = g? else { return Ok(()) };
        let (r, dt) = g.work.wait_timed();
        self.rs.sched.lock().add_wait(dt);
        if let Err(e) = r {
            self.rs.mem.lock().on_reshard(g.full.nbytes());
            self.rs.sched.lock().set_unsharded(self.id, false);
            return Err(e);
        }
        self.point_params(Some(&g.full), false)?;
        self.flat.unsharded = Some(g.full);
        Ok(())
    }

    /// Frees the unsharded buffer; parameters become unmaterialized. FSDP1 `_reshard`.
    /// A no-op under `NoShard` in f32 (parameters view the whole flat parameter for good).
    ///
    /// # Errors
    /// `Fsdp` when the module's parameters changed since wrapping.
    pub fn reshard(&mut self) -> Result<()> {
        if !self.rs.strategy.is_sharded()
            && !self.rs.mp.is_low_precision()
            && !self.rs.sched.lock().offload()
        {
            return Ok(());
        }
        if let Some(full) = self.flat.unsharded.take() {
            self.point_params(None, false)?;
            self.rs.mem.lock().on_reshard(full.nbytes());
            self.rs.sched.lock().set_unsharded(self.id, false);
        }
        Ok(())
    }

    /// Issues the reduction of the flat gradient on the stream: predivide, reduce-scatter
    /// over the shard group (then all-reduce over the replicate group under hybrid
    /// sharding; all-reduce over the world under NoShard), postdivide, all in
    /// `reduce_dtype`. FSDP1 `_post_backward_hook` / `_reduce_grad`. The f32 shard it
    /// produces is allocated here, on the compute thread (on the host under CPU offload:
    /// the device-to-host copy ends the job), so its memory belongs to the compute stream.
    fn issue_reduce(&mut self, flat_grad: Tensor) -> Result<()> {
        // A unit that ran backward twice in one pass: fold the first result in first.
        self.finish_reduce()?;
        let mp = self.rs.mp;
        if mp.is_low_precision() {
            // The gradient of low-precision compute is a low-precision tensor.
            round_(&flat_grad, mp.compute_dtype())?;
        }
        let rd = mp.reduce_dtype();
        // Averaging is over the whole data-parallel world, hybrid or not.
        let (pre, post) = gradient_divide_factors(self.rs.pg.size());
        let shard_numel = self.flat.shard_numel();
        let sharded = self.rs.strategy.is_sharded();
        // The reduce-scatter's communicator: not the one the unshard stream gathers on.
        let (shard_pg, offload) = {
            let s = self.rs.sched.lock();
            (s.streams.reduce_pg.clone(), s.offload())
        };
        let (pg, rep) = (self.rs.pg.clone(), self.rs.replicate_pg.clone());
        let keep_lp = mp.keep_low_precision_grads.then(|| mp.compute_dtype());
        let device = self.rs.device;
        let out = Tensor::zeros_on(
            &[shard_numel],
            DType::F32,
            if offload { Device::Cpu } else { device },
        )?;
        let dst = out.clone();
        let keep = vec![flat_grad.clone(), out.clone()];
        let job = move || -> Result<()> {
            // Predivide fused with the cast to reduce_dtype (in place in f32).
            let input = if rd == DType::F32 {
                flat_grad.clone()
            } else {
                Tensor::zeros_on(flat_grad.shape(), rd, device)?
            };
            flat::pack_grad(&flat_grad, &input, 1.0 / pre)?;
            let reduced = if sharded {
                let out = Tensor::zeros_on(&[shard_numel], rd, device)?;
                shard_pg.reduce_scatter_tensor(&out, &input, ReduceOp::Sum)?;
                if let Some(rep) = &rep {
                    rep.all_reduce(&out, ReduceOp::Sum)?;
                }
                out
            } else {
                pg.all_reduce(&input, ReduceOp::Sum)?;
                input
            };
            // The postdivide happens in reduce_dtype, then the result is upcast (FSDP1):
            // straight into the shard, or (offload) into a device buffer copied to it.
            let shard = if dst.device() == device {
                dst.clone()
            } else if rd == DType::F32 {
                reduced.clone()
            } else {
                Tensor::zeros_on(&[shard_numel], DType::F32, device)?
            };
            flat::unpack_grad(&reduced, &shard, 1.0 / post)?;
            if let Some(d) = keep_lp {
                round_(&shard, d)?;
            }
            // CpuOffload: the device-to-host copy of the gradient shard.
            if !shard.same_view(&dst) {
                dst.copy_from(&shard)?;
            }
            Ok(())
        };
        let work = {
            let mut s = self.rs.sched.lock();
            // The reduction's collectives name the unit and the forward calls it covers.
            let _tag = super::progress::enter(s.progress.reduce(self.id));
            s.stats.reductions += 1;
            s.streams.post_backward().submit_keeping(keep, job)
        };
        self.pending_grad = Some(PendingGrad { work, out });
        Ok(())
    }

    /// Waits for this unit's reduction in flight, if any, and accumulates its shard into
    /// the sharded gradient.
    pub(super) fn finish_reduce(&mut self) -> Result<()> {
        let Some(p) = self.pending_grad.take() else {
            return Ok(());
        };
        let (r, dt) = p.work.wait_timed();
        self.rs.sched.lock().add_wait(dt);
        r?;
        let shard = p.out;
        match &self.flat.grad_shard {
            Some(acc) => crate::ops::add_(acc, &shard)?,
            None => {
                self.rs.mem.lock().grad_shard_bytes += shard.nbytes();
                self.flat.grad_shard = Some(shard);
            }
        }
        Ok(())
    }

    /// End of the root's backward (FSDP1 `_post_backward_final_callback`): every unit's
    /// reduction is waited for and accumulated, unused prefetches dropped.
    fn finalize_backward(&mut self) -> Result<()> {
        let mut first: Result<()> = Ok(());
        self.for_each_unit(&mut |u| {
            let r = u.finish_reduce();
            if first.is_ok() {
                first = r;
            }
        });
        let r = self.drain_stream();
        first.and(r)
    }

    /// Waits until the stream is idle and drops unused prefetches.
    fn drain_stream(&mut self) -> Result<()> {
        let mut s = self.rs.sched.lock();
        let r = s.drain_prefetches();
        let dt = s.streams.synchronize();
        s.add_wait(dt);
        r
    }

    /// `Fsdp` error when called inside `summon_full_params` (FSDP1 refuses forward and
    /// backward there too).
    fn check_not_summoning(&self, what: &str) -> Result<()> {
        if self.rs.sched.lock().summoning {
            return Err(crate::error::Error::Fsdp(format!(
                "{what} called inside summon_full_params on unit '{}': full parameters are gathered for reading/writing only; run {what} after the closure returns",
                self.module_name()
            )));
        }
        Ok(())
    }

    /// Rounds a floating-point input to `param_dtype` (FSDP's `cast_forward_inputs`).
    fn cast_input(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let mp = self.rs.mp;
        if !mp.is_low_precision() || x.dtype() != DType::F32 {
            return Ok(None);
        }
        flat::rounded(x, mp.compute_dtype()).map(Some)
    }
}

impl Module for FullyShardedDataParallel {
    fn type_name(&self) -> &'static str {
        "FullyShardedDataParallel"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.check_not_summoning("forward")?;
        if self.is_root {
            self.rs.sched.lock().progress.begin_forward(cx.grad_enabled);
        }
        let g = self.begin_unshard();
        self.rs.sched.lock().on_pre_forward(self.id, self.is_root);
        let y = self.finish_unshard(g).and_then(|()| {
            let cast = self.cast_input(x)?;
            // The unit's GEMMs read param_dtype operands (see `ops::autocast`).
            let _lp = crate::ops::autocast(self.rs.mp.param_dtype);
            self.module.forward(cast.as_ref().unwrap_or(x), cx)
        });
        self.rs.sched.lock().on_post_forward(self.id);
        let free = !cx.grad_enabled || (!self.is_root && self.rs.strategy.reshard_after_forward());
        if free || y.is_err() {
            self.reshard()?;
        }
        if self.is_root {
            self.rs.sched.lock().progress.end_pass(false);
            self.drain_stream()?;
            if cx.grad_enabled && y.is_ok() {
                self.rs.sched.lock().pending_backward = true;
            }
        }
        y
    }

    fn backward(&mut self, grad_out: &Tensor, cx: &Context) -> Result<Tensor> {
        self.check_not_summoning("backward")?;
        if self.is_root {
            self.rs.sched.lock().progress.begin_backward();
        }
        let g = self.begin_unshard();
        let next = self.rs.sched.lock().on_pre_backward(self.id, self.is_root);
        let result = self.finish_unshard(g).and_then(|()| {
            // Layers accumulate (+=) into their grad views, so a gradient kept from
            // backwards under no_sync simply keeps growing.
            let flat_grad = match self.flat.unsynced_grad.take() {
                Some(g) => g,
                None => Tensor::zeros_on(&[self.flat.padded_numel()], DType::F32, self.rs.device)?,
            };
            self.point_params(Some(&flat_grad), true)?;
            let dx = {
                let _lp = crate::ops::autocast(self.rs.mp.param_dtype);
                self.module.backward(grad_out, cx)
            };
            self.point_params(None, true)?;
            self.reshard()?;
            let dx = dx?;
            self.rs.sched.lock().on_post_backward(next);
            if self.sync_grads {
                self.issue_reduce(flat_grad)?;
            } else {
                self.flat.unsynced_grad = Some(flat_grad);
            }
            Ok(dx)
        });
        if self.is_root {
            // Even after an error: nothing may stay in flight on the stream.
            let fin = self.finalize_backward();
            {
                let mut s = self.rs.sched.lock();
                s.pending_backward = false;
                s.progress.end_pass(true);
            }
            let dx = result?;
            fin?;
            return Ok(dx);
        }
        result
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("", &mut self.module)
    }

    fn is_fsdp_unit(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}
