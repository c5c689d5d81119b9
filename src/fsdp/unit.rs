//! The FSDP unit: a `Module` that owns one FlatParameter, the state its rank's units
//! share, and its accessors and statistics. Where the rest of its methods are: the table
//! in the module doc (`fsdp/mod.rs`).

use super::collectives::PendingGrad;
use super::flat_param::FlatParameter;
use super::phase::UnitPhase;
use super::scheduler::{RuntimeStats, Scheduler};
use super::{MemoryStats, MixedPrecision, ShardingStrategy};
use crate::backend::Device;
use crate::distributed::fingerprint::Phase;
use crate::distributed::Group;
use crate::nn::Module;
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

impl FullyShardedDataParallel {
    /// Until the guard drops, this thread's collectives say they are `phase` of this unit
    /// (see `distributed::fingerprint`).
    pub(super) fn fingerprint(&self, phase: Phase) -> crate::distributed::fingerprint::Entered {
        super::progress::enter(self.rs.sched.lock().progress.other(self.id, phase))
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
