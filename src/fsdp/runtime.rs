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
use super::phase::{Hook, InBackward};
use super::progress::Pass;
use super::unit::Point;
use super::FullyShardedDataParallel;
use crate::distributed::ReduceOp;
use crate::error::{Result, Term};
use crate::nn::{ChildVisitor, Context, Module};
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
        match self.wait_unshard(g)? {
            Some(full) => self.point_params(Some(&full), false),
            None => Ok(()),
        }
    }

    /// Waits for the gather [`begin_unshard`](Self::begin_unshard) returned and records
    /// the unit as unsharded; returns the buffer the parameters are to view, `None` when
    /// they already do.
    fn wait_unshard(&mut self, g: Result<Option<Gather>>) -> Result<Option<Tensor>> {
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
    fn reshard_and(&mut self, grad: Point<'_>) -> Result<()> {
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
    fn finalize_backward(&mut self) -> Result<()> {
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
        #[cfg(feature = "cuda")]
        if let crate::backend::Device::Cuda(i) = device {
            return crate::backend::cuda::current_stream(i)?.synchronize();
        }
        Ok(())
    }

    /// Waits until the stream is idle and drops unused prefetches; every FSDP buffer a
    /// stream job used is then free for the compute stream.
    fn drain_stream(&mut self) -> Result<()> {
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

    /// `Fsdp` error when called inside `summon_full_params` (FSDP1 refuses forward and
    /// backward there too).
    fn check_not_summoning(&self, what: &str) -> Result<()> {
        if matches!(self.rs.sched.lock().progress.pass(), Pass::Summoning(_)) {
            return Err(crate::error::Error::Fsdp(format!(
                "{what} called inside summon_full_params on unit '{}': full parameters are gathered for reading/writing only; run {what} after the closure returns",
                self.module_name()
            )));
        }
        Ok(())
    }

    /// Rounds the f32 buffers of the modules this unit owns (ignored modules' excepted) to
    /// `buffer_dtype` before its forward (FSDP1 `_cast_buffers_to_dtype_and_device` in the
    /// root's pre-forward; here each unit its own, which covers the same buffers). Values
    /// stay in f32 storage, as every low-precision value of this crate; a state dict then
    /// returns them in f32, as FSDP1 restores the original dtype. Idempotent, so a running
    /// stat updated in f32 by the forward is rounded again at the next one.
    fn cast_buffers(&mut self) -> Result<()> {
        let Some(dtype) = self.rs.mp.buffer_dtype.filter(|d| *d != DType::F32) else {
            return Ok(());
        };
        let rs = self.rs.clone();
        crate::nn::round_buffers(self.module.as_mut(), &self.prefix, dtype, &|name| {
            rs.is_ignored(name)
        })
    }

    /// Casts an f32 input to `param_dtype` (FSDP1 `_cast_forward_inputs`): on the root
    /// with `cast_root_forward_inputs` (the default) or `cast_forward_inputs`, on a nested
    /// unit with `cast_forward_inputs` only (its input is normally the output of
    /// `param_dtype` layers already).
    fn cast_input(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let mp = self.rs.mp;
        let wanted = mp.cast_forward_inputs || (self.is_root && mp.cast_root_forward_inputs);
        if !mp.is_low_precision() || x.dtype() != DType::F32 || !wanted {
            return Ok(None);
        }
        x.to_dtype(mp.compute_dtype()).map(Some)
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

/// The hooks, for a host that runs a unit's compute itself (FSDP2's `fully_shard` hooks;
/// FSDP1's `_pre_forward`, `_post_forward`, `_pre_backward_hook`, `_post_backward_hook`
/// and `_post_backward_final_callback`). The `Module` implementation below is these hooks
/// around the wrapped module's forward and backward; a host that brings its own tensors
/// and autograd calls them in the same order:
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

    /// The ranks meet on the unshard stream before waiting for the gradient reductions,
    /// comparing how many each issued: a rank that kept its gradients under `no_sync`
    /// while another reduced them would otherwise wait on the gathers' communicator for
    /// the next forward while the other waits on the reductions' communicator, each for
    /// the other, until the group timeout. See [Note: end-of-backward agreement] in
    /// `progress.rs`.
    fn agree_end_of_backward(&mut self) -> Result<()> {
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
    fn abort_on_desync(&self, e: &crate::error::Error) {
        if matches!(e, crate::error::Error::CollectiveMismatch { .. }) {
            self.rs.pg.abort(&e.to_string());
        }
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
}

impl Module for FullyShardedDataParallel {
    fn type_name(&self) -> &str {
        "FullyShardedDataParallel"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.cast_buffers()?;
        self.pre_forward(cx.grad_enabled)?;
        let y = self.cast_input(x).and_then(|cast| {
            // The cast is undone in backward (the gradient of `x.to(param_dtype)`).
            self.input_cast = cast.is_some() && cx.grad_enabled;
            self.module.forward(cast.as_ref().unwrap_or(x), cx)
        });
        self.post_forward(y.is_ok())?;
        if self.is_root && cx.grad_enabled && y.is_ok() {
            // Saved activations peak now, before backward consumes them, unless a
            // checkpointed module's recompute holds more ([Note: the recompute peak] in
            // `nn/saved.rs`; counted at the end of the backward).
            let bytes = crate::nn::track_saved_activations(self.module.as_mut())?;
            self.rs.mem.lock().on_activations(bytes);
        }
        y
    }

    fn backward(&mut self, grad_out: &Tensor, cx: &Context) -> Result<Tensor> {
        self.check_not_summoning("backward")?;
        let result = self.pre_backward().and_then(|()| {
            let dx = self.module.backward(grad_out, cx);
            self.post_backward(dx.is_ok())?;
            // The gradient of the input cast back to f32 (autograd's `ToCopyBackward`).
            match dx {
                Ok(d) if std::mem::take(&mut self.input_cast) && d.dtype() != DType::F32 => {
                    d.to_dtype(DType::F32)
                }
                other => other,
            }
        });
        if self.is_root {
            let peak = crate::nn::saved_activation_peak();
            self.rs.mem.lock().on_recompute_peak(peak);
            let fin = match &result {
                Ok(_) => self.finish_backward(),
                Err(e) => {
                    // Nothing may stay in flight after an error either.
                    self.abort_on_desync(e);
                    let fin = self.finalize_backward();
                    self.rs
                        .sched
                        .lock()
                        .progress
                        .end_backward(Some(format!("the backward failed: {e}")));
                    fin
                }
            };
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
    fn for_each_param(&mut self, f: &mut crate::nn::ParamVisitor<'_>) -> Result<()> {
        crate::nn::no_params(f)
    }

    /// FULL_STATE_DICT on every rank (a collective), on the device of the shards.
    fn state_dict_override(&mut self) -> Option<Result<crate::nn::FullStateDict>> {
        Some(self.full_state_dict(super::FullStateDictConfig::default()))
    }

    /// A full state dict, given whole on every rank; each keeps its shard.
    fn load_state_dict_override(
        &mut self,
        sd: &crate::nn::FullStateDict,
        strict: bool,
    ) -> Option<Result<crate::nn::IncompatibleKeys>> {
        Some(self.load_state_dict(&super::StateDict::Full(sd.clone()), strict))
    }
}
