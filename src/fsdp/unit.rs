//! The FSDP unit: a `Module` that owns one FlatParameter; construction, wrapping and
//! accessors. The hooks around forward and backward are in `runtime.rs`.

use super::collectives::PendingGrad;
use super::flat_param::FlatParameter;
use super::phase::UnitPhase;
use super::scheduler::{RuntimeStats, Scheduler};
use super::{MemoryStats, MixedPrecision, ShardingStrategy};
use crate::backend::Device;
use crate::distributed::fingerprint::Phase;
use crate::distributed::Group;
use crate::error::{Error, Result};
use crate::nn::{visit_parameters, Module, ParamVisitor, Parameter};
use crate::optim::ParamGrad;
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;

/// State every unit of one rank shares.
#[derive(Clone)]
pub(super) struct RankState {
    /// The whole data-parallel world (gradient averaging is over all of it).
    pub(super) pg: Group,
    /// Ranks that split each FlatParameter: `pg` itself, or one node's ranks under hybrid
    /// sharding.
    pub(super) shard_pg: Group,
    /// Under hybrid sharding, the ranks holding the same shard on the other nodes.
    pub(super) replicate_pg: Option<Group>,
    pub(super) strategy: ShardingStrategy,
    pub(super) mem: Arc<Mutex<MemoryStats>>,
    pub(super) mp: MixedPrecision,
    /// Prefetch decisions and the unshard / post-backward / pre-unshard streams, shared by
    /// the rank's units.
    pub(super) sched: Arc<Mutex<Scheduler>>,
    /// Fully qualified names of the ignored modules.
    pub(super) ignored: Arc<Vec<String>>,
    /// Materializes a unit's meta parameters before it is flattened.
    pub(super) param_init_fn: Option<super::ParamInitFn>,
    /// Broadcast rank 0's values of each unit's parameters before flattening.
    pub(super) sync_module_states: bool,
    /// Where units compute (`device_id`): unsharded parameters, gradients and, unless
    /// offloaded, the shards live there.
    pub(super) device: Device,
}

impl RankState {
    /// Whether units never free their full parameters: NoShard in f32 without offload,
    /// where the parameters view the whole flat parameter (the "shard") for good.
    pub(super) fn keeps_unsharded(&self) -> bool {
        !self.strategy.is_sharded() && !self.mp.is_low_precision() && !self.sched.lock().offload()
    }

    /// Whether the parameter or module `fqn` lies inside an ignored module.
    pub(super) fn is_ignored(&self, fqn: &str) -> bool {
        self.ignored.iter().any(|m| {
            fqn == m
                || (fqn.len() > m.len()
                    && fqn.starts_with(m.as_str())
                    && fqn.as_bytes()[m.len()] == b'.')
        })
    }
}

/// `FullyShardedDataParallel`: wraps a module so its parameters are sharded across the
/// ranks of a process group and gathered only while it computes.
///
/// The outermost instance (built with [`FullyShardedDataParallel::new`]) is the root; the
/// `auto_wrap_policy` turns submodules into nested units first. Semantics follow PyTorch
/// FSDP1 (`torch/distributed/fsdp/fully_sharded_data_parallel.py`).
pub struct FullyShardedDataParallel {
    pub(super) module: Box<dyn Module>,
    pub(super) flat: FlatParameter,
    pub(super) prefix: String,
    pub(super) is_root: bool,
    pub(super) rs: RankState,
    /// This unit's index in the rank's scheduler.
    pub(super) id: usize,
    /// The gradient reduction issued by the last backward, until the root's backward ends.
    pub(super) pending_grad: Option<PendingGrad>,
    /// The unit's parameters in visit order (tied ones under each name) and the index of
    /// the flattened parameter each one is.
    pub(super) slots: Vec<(String, usize)>,
    /// False inside [`FullyShardedDataParallel::no_sync`]: backward accumulates the
    /// unsharded gradient locally instead of reducing it.
    pub(super) sync_grads: bool,
    /// Which of the unit's hooks are open, with what they hold (`phase.rs`).
    pub(super) phase: UnitPhase,
    /// The last training forward cast its f32 input to `param_dtype`: the backward casts
    /// the input gradient back to f32.
    pub(super) input_cast: bool,
    /// Keeps the CPU buffer pool's lengths while the unit lives; the last unit or process
    /// group to drop empties the pool (declared last: the unit's own buffers are back in
    /// the pool by then).
    pub(super) _pool_user: crate::tensor::PoolUser,
}

/// FSDP1's gradient divide factors for a data-parallel world of `dp` ranks
/// (`_get_gradient_predivide_factor`): `pre` is the largest power of two with
/// `pre * pre < dp` dividing `dp` (roughly `sqrt(dp)`); `post = dp / pre`. Dividing in two
/// steps keeps fp16 sums from overflowing and from underflowing.
pub fn gradient_divide_factors(dp: usize) -> (f32, f32) {
    let mut pre = 1usize;
    while dp % pre == 0 && dp / pre > pre {
        pre *= 2;
    }
    (pre as f32, dp as f32 / pre as f32)
}

/// What [`FullyShardedDataParallel::point`] does to each parameter's data or grad.
#[derive(Clone, Copy)]
pub(super) enum Point<'a> {
    /// Leaves it as it is.
    Keep,
    /// Frees it (`None`).
    Clear,
    /// Points it at its view of this buffer (padded flat layout).
    View(&'a Tensor),
}

/// Runs `f` with a buffer holding `prefix`, kept per thread from call to call, so that the
/// hooks' walks over a unit's parameters (every unit, several times a step) allocate no
/// name (`nn::visit_parameters_in`). A nested call gets a buffer of its own.
fn with_name_buffer<R>(prefix: &str, f: impl FnOnce(&mut String) -> R) -> R {
    thread_local! {
        static NAME: std::cell::Cell<String> = const { std::cell::Cell::new(String::new()) };
    }
    let mut name = NAME.with(std::cell::Cell::take);
    name.clear();
    name.push_str(prefix);
    let r = f(&mut name);
    NAME.with(|c| c.set(name));
    r
}

impl FullyShardedDataParallel {
    /// Points every original parameter's data (or grad) at its view of `buf`, or frees it.
    pub(super) fn point_params(&mut self, buf: Option<&Tensor>, grads: bool) -> Result<()> {
        let to = buf.map_or(Point::Clear, Point::View);
        if grads {
            self.point(Point::Keep, to)
        } else {
            self.point(to, Point::Keep)
        }
    }

    /// [`point_params`](Self::point_params) for the data and the grads in one walk over
    /// the unit's parameters (the hooks walk every unit several times a step).
    pub(super) fn point(&mut self, data: Point<'_>, grad: Point<'_>) -> Result<()> {
        let (slots, rs, flat) = (&self.slots, &self.rs, &self.flat);
        let mut i = 0;
        let walked = with_name_buffer(&self.prefix, |name| {
            crate::nn::visit_parameters_in(
                self.module.as_mut(),
                name,
                true,
                &mut |name, p: &mut Parameter| {
                    if rs.is_ignored(name) {
                        return Ok(());
                    }
                    let Some(&(_, k)) = slots.get(i).filter(|(n, _)| n == name) else {
                        return Err(Error::Fsdp(format!("parameter '{name}' was not flattened into this unit (module changed after wrapping)")));
                    };
                    if p.name() != name {
                        p.set_name(name);
                    }
                    match data {
                        Point::Keep => {}
                        Point::Clear => p.set_data(None)?,
                        Point::View(b) => p.set_data(Some(flat.view(b, k)?))?,
                    }
                    match grad {
                        Point::Keep => {}
                        Point::Clear => p.set_grad(None),
                        Point::View(b) => p.set_grad(Some(flat.view(b, k)?)),
                    }
                    i += 1;
                    Ok(())
                },
            )
        });
        walked?;
        if i != self.slots.len() {
            return Err(Error::Fsdp(format!(
                "unit '{}' flattened {} parameters but its module now has {i}",
                self.prefix,
                self.slots.len()
            )));
        }
        Ok(())
    }

    /// Until the guard drops, this thread's collectives say they are `phase` of this unit
    /// (see `distributed::fingerprint`).
    pub(super) fn fingerprint(&self, phase: Phase) -> crate::distributed::fingerprint::Entered {
        super::progress::enter(self.rs.sched.lock().progress.other(self.id, phase))
    }

    /// Runs `f` on the unit of module `name` (`""` for the root) among this unit and the
    /// units nested in it: how a host that drives the hooks reaches a nested unit.
    ///
    /// # Errors
    /// `Fsdp` naming `name` when no unit wraps that module.
    pub fn with_unit<R>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> R) -> Result<R> {
        let mut f = Some(f);
        let mut out = None;
        self.each_unit(|u| {
            if u.prefix == name {
                if let Some(f) = f.take() {
                    out = Some(f(u));
                }
            }
        });
        out.ok_or_else(|| Error::Fsdp(format!("no FSDP unit wraps module '{name}'")))
    }

    /// Visits every unit of this rank (self first, then nested units in pre-order).
    ///
    /// # Errors
    /// The first error `f` returns; the units after it are not visited.
    pub fn for_each_unit(&mut self, f: &mut UnitVisitor<'_>) -> Result<()> {
        f(self)?;
        walk_units(self.module.as_mut(), f)
    }

    /// [`for_each_unit`](Self::for_each_unit) with a closure that cannot fail (flags,
    /// figures, lists). A module's walk only passes its visitor's errors on, so none can
    /// arise (checked in debug builds).
    pub(super) fn each_unit(&mut self, mut f: impl FnMut(&mut FullyShardedDataParallel)) {
        let walked = self.for_each_unit(&mut |u| {
            f(u);
            Ok(())
        });
        debug_assert!(walked.is_ok(), "a module's walk failed: {walked:?}");
    }

    /// Runs `f` on every unit, even after one fails (nothing is left half done), and
    /// returns the first error.
    pub(super) fn each_unit_all(
        &mut self,
        mut f: impl FnMut(&mut FullyShardedDataParallel) -> Result<()>,
    ) -> Result<()> {
        let mut first = Ok(());
        self.each_unit(|u| {
            let r = f(u);
            if first.is_ok() {
                first = r;
            }
        });
        first
    }

    /// What an optimizer steps on: views of every unit's local shard and gradient shard,
    /// one per trainable parameter with elements on this rank (frozen parameters and
    /// padding excluded, so they are never updated, not even by weight decay); under
    /// NoShard with a [`ZeroRedundancyOptimizer`](super::ZeroRedundancyOptimizer), views of
    /// this rank's optimizer chunk of each whole flat parameter and its gradient; then the
    /// trainable parameters of the ignored modules, whole. The same list at every step;
    /// [`optimizer_param_names`](Self::optimizer_param_names) names its entries.
    pub fn optimizer_params(&mut self) -> Vec<ParamGrad> {
        let mut out = Vec::new();
        self.each_unit(|u| {
            // The optimizer chunk in the local shard (at 0 but under ZeRO-1).
            let at = u.flat.optim_offset();
            for &(start, len) in &u.flat.trainable_runs {
                // Views inside the chunk: in bounds by construction.
                if let Ok(param) = u.flat.local_shard.view(at + start, &[len]) {
                    let grad = u
                        .flat
                        .grad_shard
                        .as_ref()
                        .and_then(|g| g.view(start, &[len]).ok());
                    out.push(ParamGrad { param, grad });
                }
            }
        });
        self.each_ignored(|_, p| {
            if let (true, Ok(param)) = (p.requires_grad, p.data()) {
                out.push(ParamGrad {
                    param: param.clone(),
                    grad: p.grad().cloned(),
                });
            }
        });
        out
    }

    /// The original parameter of each entry of [`optimizer_params`](Self::optimizer_params),
    /// in the same order: its name (as in the state dict) and its whole shape (the entry
    /// holds this rank's elements of it). What parameter groups are built from on each
    /// rank, e.g. [`no_decay_groups`](crate::optim::no_decay_groups) on the shapes.
    ///
    /// ```
    /// use fsdp::distributed::{launch, LaunchOptions};
    /// use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel};
    /// use fsdp::nn::{InitKey, Linear};
    /// use fsdp::optim::{no_decay_groups, AdamConfig, AdamW, Optimizer};
    /// launch(&LaunchOptions::new(2), |pg| {
    ///     let lin = Linear::new(4, 3, true, &InitKey::new(0))?;
    ///     let mut m = FullyShardedDataParallel::new(Box::new(lin), pg, FsdpConfig::default())?;
    ///     let names = m.optimizer_param_names(); // this rank's pieces of weight and bias
    ///     assert_eq!(names.len(), m.optimizer_params().len());
    ///     let shapes: Vec<Vec<usize>> = names.iter().map(|(_, s)| s.clone()).collect();
    ///     let mut opt = AdamW::new(AdamConfig::adamw());
    ///     opt.set_param_groups(no_decay_groups(&shapes, 1e-3, 0.1))
    /// })
    /// .unwrap();
    /// ```
    pub fn optimizer_param_names(&mut self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        self.each_unit(|u| {
            let (lo, _) = u.flat.optim_range();
            for &(start, _) in &u.flat.trainable_runs {
                // The parameter whose elements start this run (runs are per parameter).
                let at = lo + start;
                let idx = u
                    .flat
                    .infos
                    .iter()
                    .position(|i| i.offset <= at && at < i.offset + i.numel);
                let name = idx.and_then(|k| u.slots.iter().find(|(_, j)| *j == k));
                match (idx, name) {
                    (Some(k), Some((n, _))) => out.push((n.clone(), u.flat.infos[k].shape.clone())),
                    _ => out.push((String::new(), Vec::new())),
                }
            }
        });
        self.each_ignored(|name, p| {
            if let (true, Ok(d)) = (p.requires_grad, p.data()) {
                out.push((name.to_string(), d.shape().to_vec()));
            }
        });
        out
    }

    /// Visits the parameters of the ignored modules (whole on every rank, FSDP does not
    /// manage them; their gradients are local).
    ///
    /// # Errors
    /// The first error `f` returns; the walk stops there.
    pub fn visit_ignored(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        if self.rs.ignored.is_empty() {
            return Ok(());
        }
        let rs = self.rs.clone();
        let prefix = self.prefix.clone();
        visit_parameters(self.module.as_mut(), &prefix, false, &mut |name, p| {
            if rs.is_ignored(name) {
                f(name, p)
            } else {
                Ok(())
            }
        })
    }

    /// [`visit_ignored`](Self::visit_ignored) with a closure that cannot fail.
    pub(super) fn each_ignored(&mut self, mut f: impl FnMut(&str, &mut Parameter)) {
        let walked = self.visit_ignored(&mut |n, p| {
            f(n, p);
            Ok(())
        });
        debug_assert!(walked.is_ok(), "a module's walk failed: {walked:?}");
    }

    /// Drops every sharded gradient, the unsharded gradients kept under `no_sync`, and the
    /// ignored modules' gradients (`zero_grad(set_to_none=True)`, PyTorch's default, which
    /// drops FSDP1's `no_sync` accumulation in `flat_param.grad` too). Also ends the step
    /// for the fingerprints of FSDP's collectives: the first call after a backward starts
    /// the next step (see `distributed::fingerprint`), so every rank calls it alike (once
    /// per optimizer step, as a training loop does). A host driving the hooks checks
    /// [`ready_for_zero_grad`](Self::ready_for_zero_grad) first: inside an unfinished
    /// backward the reductions still to come would survive this.
    pub fn zero_grad(&mut self) {
        self.rs.sched.lock().progress.step_boundary();
        let mem = self.rs.mem.clone();
        let sched = self.rs.sched.clone();
        self.each_unit(|u| {
            if let Some(g) = u.flat.grad_shard.take() {
                let mut m = mem.lock();
                m.grad_shard_bytes = m.grad_shard_bytes.saturating_sub(g.nbytes());
                // Its readers (clipping, the optimizer) ran on the compute stream: the
                // next backward's reduction can fill it again.
                sched.lock().buffers.give(g);
            }
            if let Some(g) = u.flat.unsynced_grad.take() {
                sched.lock().buffers.give(g);
            }
        });
        self.each_ignored(|_, p| p.set_grad(None));
    }

    /// This rank's FSDP memory figures.
    pub fn memory_stats(&self) -> MemoryStats {
        *self.rs.mem.lock()
    }

    /// Starts a new peak window for [`MemoryStats`].
    pub fn reset_peak_memory_stats(&self) {
        self.rs.mem.lock().reset_peak();
    }

    /// This rank's communication counters (time waited on collectives, gathers issued and
    /// prefetched) since the last [`reset_runtime_stats`](Self::reset_runtime_stats).
    pub fn runtime_stats(&self) -> RuntimeStats {
        self.rs.sched.lock().stats
    }

    /// Zeroes the [`RuntimeStats`] counters.
    pub fn reset_runtime_stats(&self) {
        self.rs.sched.lock().stats = RuntimeStats::default();
    }

    /// The mixed-precision policy in use (all `None`: f32 throughout).
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.rs.mp
    }

    /// `(name, index into the FlatParameter's params)` of every parameter name of this
    /// unit, in visit order: a tied parameter appears under each of its names.
    pub(super) fn slots(&self) -> &[(String, usize)] {
        &self.slots
    }

    /// This unit's FlatParameter.
    pub fn flat_param(&self) -> &FlatParameter {
        &self.flat
    }

    /// The wrapped module.
    pub fn module_mut(&mut self) -> &mut dyn Module {
        self.module.as_mut()
    }

    /// The device the units compute on (`device_id`; the CPU by default).
    pub fn compute_device(&self) -> Device {
        self.rs.device
    }

    /// The strategy in use.
    pub fn sharding_strategy(&self) -> ShardingStrategy {
        self.rs.strategy
    }

    /// Whether a [`ZeroRedundancyOptimizer`](super::ZeroRedundancyOptimizer) partitions this
    /// NoShard model's optimizer state (ZeRO-1): gradients are reduce-scattered over the
    /// world into each rank's optimizer chunk instead of all-reduced, and optimizer state
    /// dicts and checkpoints hold each rank's chunk.
    pub fn zero_redundancy(&self) -> bool {
        self.flat.optimizer_partitioned()
    }

    /// Whether backward reduce-scatters gradients into shards (sharded strategies, and
    /// ZeRO-1 over NoShard) rather than all-reducing them whole.
    pub(super) fn grads_scattered(&self) -> bool {
        self.rs.strategy.is_sharded() || self.zero_redundancy()
    }

    /// The process group.
    pub fn process_group(&self) -> &Group {
        &self.rs.pg
    }

    /// The group each FlatParameter is sharded over (the world, or a node under hybrid
    /// sharding).
    pub fn shard_group(&self) -> &Group {
        &self.rs.shard_pg
    }

    /// Whether this is the root unit.
    pub fn is_root(&self) -> bool {
        self.is_root
    }

    /// Fully qualified name of the wrapped module (`""` for the root).
    pub fn module_name(&self) -> &str {
        &self.prefix
    }

    /// Gathers every unit's full parameters and returns `(name, values)` in
    /// `named_parameters()` order; every rank must call it (it runs collectives).
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Vec<f32>)>> {
        let mut infos = Vec::new();
        self.for_each_unit(&mut |u| {
            let shard = &u.flat.local_shard;
            let full = Tensor::zeros_on(&[u.flat.padded_numel()], DType::F32, shard.device())?;
            if u.rs.strategy.is_sharded() {
                let _tag = u.fingerprint(Phase::StateDict);
                u.rs.shard_pg.all_gather_into_tensor(&full, shard)?;
            } else {
                full.copy_from(shard)?;
            }
            // On the host (a copy when the shards are on a GPU).
            let v = full.to_vec_f32()?;
            for i in &u.flat.infos {
                infos.push((i.fqn.clone(), v[i.offset..i.offset + i.numel].to_vec()));
            }
            Ok(())
        })?;
        self.each_ignored(|name, p| {
            if let Ok(v) = p.data().and_then(|d| d.to_vec_f32()) {
                infos.push((name.to_string(), v));
            }
        });
        // Units are visited root-first; named_parameters() order is module pre-order.
        let order: Vec<String> = crate::nn::parameter_shapes(self)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        infos.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        Ok(infos)
    }
}

/// The callback of [`FullyShardedDataParallel::for_each_unit`]; an error stops the walk.
pub type UnitVisitor<'a> = dyn FnMut(&mut FullyShardedDataParallel) -> Result<()> + 'a;

fn walk_units(m: &mut dyn Module, f: &mut UnitVisitor<'_>) -> Result<()> {
    m.for_each_child(&mut |_, child| match child
        .as_any_mut()
        .and_then(|a| a.downcast_mut::<FullyShardedDataParallel>())
    {
        Some(u) => {
            f(u)?;
            walk_units(u.module.as_mut(), f)
        }
        None => walk_units(child.as_mut(), f),
    })
}

#[cfg(test)]
mod tests {
    use super::gradient_divide_factors;

    #[test]
    fn divide_factors_match_fsdp1() {
        assert_eq!(gradient_divide_factors(1), (1.0, 1.0));
        assert_eq!(gradient_divide_factors(2), (2.0, 1.0));
        assert_eq!(gradient_divide_factors(3), (2.0, 1.5));
        assert_eq!(gradient_divide_factors(4), (2.0, 2.0));
        assert_eq!(gradient_divide_factors(8), (4.0, 2.0));
        assert_eq!(gradient_divide_factors(16), (4.0, 4.0));
    }
}
