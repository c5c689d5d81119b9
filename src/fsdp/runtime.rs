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

use super::collectives::Gather;
use super::progress::Pass;
use super::FullyShardedDataParallel;
use crate::error::Result;
use crate::nn::{ChildVisitor, Context, Module};
use crate::ops::flat;
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
    fn begin_unshard(&mut self) -> Result<Option<Gather>> {
        self.rs.sched.lock().take_or_issue(self.id)
    }

    fn finish_unshard(&mut self, g: Result<Option<Gather>>) -> Result<()> {
        let Some(g) = g? else { return Ok(()) };
        let (r, dt) = g.work.wait_timed();
        {
            let mut s = self.rs.sched.lock();
            s.add_wait(dt);
            match r {
                Ok(()) => s.set_unsharded(self.id, g.full.clone()),
                Err(e) => {
                    s.gather_failed(self.id, g.full.nbytes());
                    return Err(e);
                }
            }
        }
        self.point_params(Some(&g.full), false)
    }

    /// Frees the unsharded buffer; parameters become unmaterialized. FSDP1 `_reshard`.
    /// A no-op for a unit that never frees its parameters (NoShard in f32 without
    /// offload: they view the whole flat parameter for good).
    ///
    /// # Errors
    /// `Fsdp` when the module's parameters changed since wrapping.
    pub fn reshard(&mut self) -> Result<()> {
        if self.rs.keeps_unsharded() {
            return Ok(());
        }
        let freed = self.rs.sched.lock().reshard(self.id);
        if freed.is_some() {
            self.point_params(None, false)?;
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
        if self.rs.sched.lock().progress.pass() == Pass::Summoning {
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
            self.rs.sched.lock().progress.end_forward(y.is_ok());
            self.drain_stream()?;
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
            self.rs.sched.lock().progress.end_backward();
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
