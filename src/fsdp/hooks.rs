//! The hooks around a unit's forward and backward, for a host that runs the unit's
//! compute itself and for the `Module` implementation (`module.rs`) that runs them around
//! the wrapped module (FSDP1 `_runtime_utils.py`). Each moves the unit's `UnitPhase`
//! (`phase.rs`) and checks the rank's stage first (`order.rs`).
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

use super::phase::{Hook, InBackward};
use super::progress::Pass;
use super::walk::Point;
use super::FullyShardedDataParallel;
use crate::error::{Result, Term};
use crate::tensor::{DType, Tensor};

/// The hooks, for a host that runs a unit's compute itself (FSDP2's `fully_shard` hooks;
/// FSDP1's `_pre_forward`, `_post_forward`, `_pre_backward_hook`, `_post_backward_hook`
/// and `_post_backward_final_callback`). The `Module` implementation (`module.rs`) is
/// these hooks around the wrapped module's forward and backward; a host that brings its
/// own tensors and autograd calls them in the same order:
///
/// ```text
/// forward, units in the host's order (outer before inner):
///     u.pre_forward(grad)  -> compute with u.param_views()  -> u.post_forward(ok)
/// backward, in reverse:
///     u.pre_backward()     -> write or add d loss / d param into u.grad_views()
///                          -> u.post_backward(ok)
/// once, after the root's post_backward:  root.finish_backward()
/// then:  root.ready_for_step()?; optimizer.step(&root.optimizer_params())?;
///        root.ready_for_zero_grad()?; root.zero_grad()   (or more micro-batches first)
/// ```
/// The root's forward encloses every other unit's (its `pre_forward` first, its
/// `post_forward` last), as its backward does. Calls out of this order are refused with
/// an `Fsdp` error naming what was expected (`order.rs`, [Note: the step's stages] in
/// `progress.rs`).
impl FullyShardedDataParallel {
    /// Before this unit's forward: all-gathers its parameters (or takes the prefetched
    /// gather) and prefetches the next unit (`forward_prefetch`); the root first starts a
    /// new iteration. `grad_enabled`: the forward saves activations for a backward (false
    /// is `torch.no_grad()`: the parameters are freed again after it). On error the unit
    /// is sharded again and needs no `post_forward`.
    ///
    /// # Errors
    /// `Fsdp` inside `summon_full_params`, between this unit's `pre_forward` and
    /// `post_forward`, on the root inside an unfinished backward, on a nested unit outside
    /// the root's forward and backward, or on any unit after the root's `post_backward`
    /// and before `finish_backward`; the all-gather's error.
    pub fn pre_forward(&mut self, grad_enabled: bool) -> Result<()> {
        self.check_not_summoning("forward")?;
        self.phase.refuse(Hook::PreForward, &self.prefix)?;
        self.check_order(Term::PreForward)?;
        if self.is_root {
            self.rs.sched.lock().progress.begin_forward(grad_enabled);
        }
        let g = self.begin_unshard();
        self.rs.sched.lock().on_pre_forward(self.id, self.is_root);
        self.phase.pre_forward(grad_enabled, &self.prefix)?;
        if let Err(e) = self.finish_unshard(g) {
            self.post_forward(false)?;
            return Err(e);
        }
        Ok(())
    }

    /// After this unit's forward (`ok`: it succeeded): frees the gathered parameters when
    /// the strategy reshards after forward (FullShard, HybridShard; not the root), without
    /// grad, or after a failure; the root then waits for its streams. A failed root
    /// forward ends every nested unit's forward and frees their gathered parameters too.
    ///
    /// # Errors
    /// `Fsdp` without a `pre_forward` first, or (`ok`) on the root while a nested unit is
    /// still in its forward; a collective's error found at the end of the root's forward.
    pub fn post_forward(&mut self, ok: bool) -> Result<()> {
        if ok && self.is_root && self.phase.in_forward() {
            self.check_nested_done(false)?;
        }
        let grad = self.phase.post_forward(&self.prefix)?;
        self.rs.sched.lock().on_post_forward(self.id);
        let free = !grad || !ok || (!self.is_root && self.rs.strategy.reshard_after_forward());
        if free {
            self.reshard()?;
        }
        if self.is_root && !ok {
            self.end_failed_forward()?;
        }
        if self.is_root {
            self.rs.sched.lock().progress.end_forward(ok);
            self.drain_stream()?;
        }
        Ok(())
    }

    /// Before this unit's backward: gathers its parameters again if the forward freed them
    /// (prefetching the next unit under `BackwardPre`) and points every parameter's grad
    /// at its view of a zeroed flat gradient buffer (under `no_sync`, at the gradient
    /// accumulated so far), into which the backward adds (`+=`) d loss / d param.
    ///
    /// # Errors
    /// `Fsdp` inside `summon_full_params`, twice without `post_backward`, inside the
    /// root's forward, on a nested unit outside the root's backward, or after the root's
    /// `post_backward` and before `finish_backward` (a second backward); `NoSavedForward`
    /// on the root when no forward with grad ran since the last backward; the all-gather's
    /// error; `Cuda` or `OutOfMemory` when the buffer cannot be allocated.
    pub fn pre_backward(&mut self) -> Result<()> {
        self.check_not_summoning("backward")?;
        self.phase.refuse(Hook::PreBackward, &self.prefix)?;
        self.check_order(Term::PreBackward)?;
        if !self.is_root {
            return self.start_backward();
        }
        self.rs.sched.lock().progress.begin_backward();
        let r = self.start_backward();
        if r.is_err() {
            // Nothing of the backward began: the step holds what it held.
            self.rs.sched.lock().progress.abort_backward();
        }
        r
    }

    /// [`pre_backward`](Self::pre_backward) once its order is checked.
    fn start_backward(&mut self) -> Result<()> {
        let g = self.begin_unshard();
        let next = self.rs.sched.lock().on_pre_backward(self.id, self.is_root);
        let full = self.wait_unshard(g)?;
        let data = full.as_ref().map_or(Point::Keep, Point::View);
        // Layers accumulate (+=) into their grad views, so a gradient kept from backwards
        // under no_sync simply keeps growing.
        // Under low-precision mixed precision the gradient is a param_dtype tensor, as
        // autograd's gradient of FSDP1's param_dtype unsharded flat parameter.
        let grad_dtype = match self.flat.dtype() {
            DType::F64 => DType::F64,
            _ => self.rs.mp.compute_dtype(),
        };
        let flat_grad = match self.flat.unsynced_grad.take() {
            Some(g) => g,
            None => {
                let t = self.rs.sched.lock().take_buffer(
                    self.flat.grad_buffer_numel(),
                    grad_dtype,
                    self.rs.device,
                    true,
                );
                match t {
                    Ok(t) => t,
                    Err(e) => {
                        // The gathered parameters are the unit's all the same.
                        self.point(data, Point::Keep)?;
                        return Err(e);
                    }
                }
            }
        };
        // The parameters' data and grads in one walk.
        self.point(data, Point::View(&flat_grad))?;
        self.phase
            .pre_backward(InBackward { next, flat_grad }, &self.prefix)
    }

    /// After this unit's backward (`ok`: it succeeded): frees the gathered parameters,
    /// prefetches the next unit under `BackwardPost`, and issues the reduction of the
    /// flat gradient on the post-backward stream (under `no_sync`, keeps it instead).
    ///
    /// The root's `post_backward` ends the backward: `finish_backward` comes next.
    ///
    /// # Errors
    /// `Fsdp` without a `pre_backward` first, or (`ok`) on the root while a nested unit is
    /// still in its backward; `Cuda` or `OutOfMemory` when the reduction's buffers cannot
    /// be allocated.
    pub fn post_backward(&mut self, ok: bool) -> Result<()> {
        if ok && self.is_root && self.phase.in_backward() {
            self.check_nested_done(true)?;
        }
        let InBackward { next, flat_grad } = self.phase.post_backward(&self.prefix)?;
        let r = self.end_unit_backward(ok, next, flat_grad);
        if !ok || r.is_err() {
            let why = match &r {
                Err(e) => format!("the backward of unit '{}' failed: {e}", self.module_name()),
                Ok(()) => format!(
                    "the backward of unit '{}' failed ({} was told it did not succeed)",
                    self.module_name(),
                    Term::PostBackward
                ),
            };
            self.rs.sched.lock().progress.mark_incomplete(why);
        }
        if self.is_root {
            self.rs.sched.lock().progress.root_backward_done();
        }
        r
    }

    fn end_unit_backward(
        &mut self,
        ok: bool,
        next: Option<(usize, usize)>,
        flat_grad: Tensor,
    ) -> Result<()> {
        // The grads freed and the parameters resharded in one walk.
        self.reshard_and(Point::Clear)?;
        if !ok {
            return Ok(());
        }
        self.rs.sched.lock().on_post_backward(next);
        if self.sync_grads {
            self.issue_reduce(flat_grad)
        } else {
            self.flat.unsynced_grad = Some(flat_grad);
            Ok(())
        }
    }

    /// Once per backward, on the root after its `post_backward` (also after a failed
    /// backward: nothing may stay in flight): waits for every unit's reduction and
    /// accumulates it into the sharded gradients, drops unused prefetches.
    ///
    /// # Errors
    /// `Fsdp` on a nested unit, without a backward, or before the root's
    /// `post_backward`; the first reduction's error.
    pub fn finish_backward(&mut self) -> Result<()> {
        if !self.is_root {
            return Err(crate::error::Error::Fsdp(format!(
                "finish_backward called on unit '{}': it ends the whole backward and belongs to the root",
                self.module_name()
            )));
        }
        self.check_order(Term::FinishBackward)?;
        let agreed = self.agree_end_of_backward();
        if let Err(e) = &agreed {
            self.abort_on_desync(e);
        }
        let fin = self.finalize_backward();
        let r = agreed.and(fin);
        let failed = r
            .as_ref()
            .err()
            .map(|e| format!("{} failed: {e}", Term::FinishBackward));
        self.rs.sched.lock().progress.end_backward(failed);
        r
    }

    /// `(name, full parameter)` of this unit's parameters while it is unsharded (between
    /// `pre_forward` and `post_forward`, `pre_backward` and `post_backward`), in
    /// `named_parameters()` order; tied parameters once per name.
    ///
    /// # Errors
    /// `NotMaterialized` while the unit is sharded.
    pub fn param_views(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.views(false)
    }

    /// `(name, gradient)` of this unit's trainable parameters between `pre_backward` and
    /// `post_backward`: views of the flat gradient buffer of the parameters' shapes (f32;
    /// `param_dtype` tensors under low-precision mixed precision),
    /// into which the host adds d loss / d param (tied parameters share one view).
    ///
    /// # Errors
    /// `Fsdp` outside `pre_backward` .. `post_backward`.
    pub fn grad_views(&mut self) -> Result<Vec<(String, Tensor)>> {
        self.phase.refuse(Hook::GradViews, &self.prefix)?;
        self.views(true)
    }

    fn views(&mut self, grads: bool) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        let (prefix, rs) = (self.prefix.clone(), self.rs.clone());
        crate::nn::visit_parameters(self.module.as_mut(), &prefix, true, &mut |name, p| {
            if rs.is_ignored(name) {
                return Ok(());
            }
            if grads {
                out.extend(p.grad().map(|g| (name.to_string(), g.clone())));
            } else {
                out.push((name.to_string(), p.data()?.clone()));
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// `Fsdp` error when called inside `summon_full_params` (FSDP1 refuses forward and
    /// backward there too).
    pub(super) fn check_not_summoning(&self, what: &str) -> Result<()> {
        if matches!(self.rs.sched.lock().progress.pass(), Pass::Summoning(_)) {
            return Err(crate::error::Error::Fsdp(format!(
                "{what} called inside summon_full_params on unit '{}': full parameters are gathered for reading/writing only; run {what} after the closure returns",
                self.module_name()
            )));
        }
        Ok(())
    }
}
