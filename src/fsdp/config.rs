//! The FSDP constructor's options, named as `torch.distributed.fsdp.FullyShardedDataParallel`.

use super::{AutoWrapPolicy, BackwardPrefetch, MixedPrecision};
use crate::backend::Device;
use crate::choice::{choice_enum, Choice};
use crate::distributed::{DeviceMesh, Group};
use crate::error::{Error, Result};

choice_enum! {
    /// How parameters, gradients and optimizer state are split across ranks
    /// (`torch.distributed.fsdp.ShardingStrategy`). Its [`Choice`] names are the ones
    /// `fsdp train --strategy` takes (`full-shard`, ..., `hybrid-shard-zero2`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
    pub enum ShardingStrategy: "sharding strategy" {
        /// ZeRO-3: parameters freed after forward and gathered again in backward; gradients
        /// reduce-scattered; optimizer state sharded.
        #[default]
        FullShard = "full-shard",
        /// ZeRO-2: parameters kept from forward until after backward; gradients
        /// reduce-scattered.
        ShardGradOp = "shard-grad-op",
        /// DDP: nothing sharded; gradients all-reduced.
        NoShard = "no-shard",
        /// FullShard within a node (the shard group), replicated across nodes (the replicate
        /// group): gradients reduce-scattered in the node, then all-reduced across nodes.
        HybridShard = "hybrid-shard",
        /// ShardGradOp within a node, replicated across nodes (FSDP1 `_HYBRID_SHARD_ZERO2`).
        HybridShardZero2 = "hybrid-shard-zero2",
    }
}

impl ShardingStrategy {
    /// The strategy as the calling thread's API spells it in messages: `FullShard` in
    /// Rust, `FSDP_FULL_SHARD` through the C ABI ([`Api`](crate::error::Api)).
    pub fn api_name(self) -> &'static str {
        let (rust, c) = match self {
            ShardingStrategy::FullShard => ("FullShard", "FSDP_FULL_SHARD"),
            ShardingStrategy::ShardGradOp => ("ShardGradOp", "FSDP_SHARD_GRAD_OP"),
            ShardingStrategy::NoShard => ("NoShard", "FSDP_NO_SHARD"),
            ShardingStrategy::HybridShard => ("HybridShard", "FSDP_HYBRID_SHARD"),
            ShardingStrategy::HybridShardZero2 => ("HybridShardZero2", "FSDP_HYBRID_SHARD_ZERO2"),
        };
        match crate::error::Api::current() {
            crate::error::Api::Rust => rust,
            crate::error::Api::C => c,
        }
    }

    /// The name `fsdp train --strategy` takes (`"full-shard"`, ..., `"hybrid-shard-zero2"`):
    /// [`Choice::name`].
    pub fn flag_name(self) -> &'static str {
        self.name()
    }

    /// Whether a non-root unit frees its unsharded parameters after forward.
    pub fn reshard_after_forward(self) -> bool {
        matches!(
            self,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard
        )
    }

    /// Whether the strategy shards within a node and replicates across nodes.
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2
        )
    }

    /// Whether parameters are split across ranks at all.
    pub fn is_sharded(self) -> bool {
        !matches!(self, ShardingStrategy::NoShard)
    }
}

/// Options of [`FullyShardedDataParallel::new`](super::FullyShardedDataParallel::new).
/// `Default` is FSDP1's: `FullShard`, no auto-wrap (one unit for the whole model), f32,
/// `backward_prefetch = BackwardPre`, no forward prefetch, `limit_all_gathers = true`.
#[derive(Clone)]
pub struct FsdpConfig {
    /// How parameters, gradients and optimizer state are split
    /// (`FullyShardedDataParallel(sharding_strategy=...)`), default `FullShard`.
    pub sharding_strategy: ShardingStrategy,
    /// Which submodules become their own units; `None`: one unit for the whole model.
    pub auto_wrap_policy: Option<AutoWrapPolicy>,
    /// Hybrid strategies only: explicit `(shard_group, replicate_group)` of this rank, as
    /// PyTorch's `process_group=(shard_pg, replicate_pg)`. Their sizes must multiply to the
    /// world size.
    pub hybrid_groups: Option<(Group, Group)>,
    /// Broadcast rank 0's parameters to every rank before sharding
    /// (`sync_module_states=True`), so ranks may build the model with different values, or
    /// on the meta device while rank 0 holds real values (load a checkpoint on rank 0 only):
    /// the ranks agree on which parameters any of them holds values of, and those become
    /// rank 0's everywhere, bitwise. Parameters every rank holds on the meta device are
    /// left to deferred init.
    pub sync_module_states: bool,
    /// Hybrid strategies only, without `hybrid_groups` or `device_mesh`: ranks per node
    /// (`--ranks-per-node`). A hybrid strategy needs one of the three (as FSDP1 raises
    /// `ValueError` without a process group or device mesh). See
    /// [`hybrid_groups`](super::hybrid_groups).
    pub ranks_per_node: Option<usize>,
    /// Low-precision compute and communication (`mixed_precision=`); `None`: f32.
    pub mixed_precision: Option<MixedPrecision>,
    /// When backward all-gathers the next unit (`backward_prefetch=`); `None`: on demand.
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// All-gather the next unit of the previous iteration's forward order while the
    /// current one computes (`forward_prefetch=`).
    pub forward_prefetch: bool,
    /// Prefetch only while fewer than two units besides the root are unsharded or being
    /// gathered (`limit_all_gathers=`), bounding memory at the cost of overlap.
    pub limit_all_gathers: bool,
    /// Submodules (fully qualified names, as in `named_modules()`) whose parameters FSDP
    /// leaves alone: not flattened, not sharded, their gradients not reduced
    /// (`ignored_modules=`). Every rank keeps them whole and steps them itself.
    pub ignored_modules: Vec<String>,
    /// The device the unit computes on (`device_id=`): `None` or `Some(Device::Cpu)` for
    /// the CPU backend, `Some(Device::Cuda(i))` to keep the FlatParameter shards, unsharded
    /// parameters, gradients and mixed-precision copies on that GPU (PyTorch moves the
    /// module there at wrap time; parameters built on the meta device are materialized
    /// shard by shard on the host and then moved). The wrapped layers must compute on
    /// tensors of that device.
    pub device_id: Option<Device>,
    /// Keep parameter and gradient shards in host memory (`cpu_offload=`).
    pub cpu_offload: CpuOffload,
    /// Materializes a unit's module whose parameters are on the meta device, before FSDP
    /// flattens it (`param_init_fn=`): called once per unit that has meta parameters, on
    /// that unit's module, with the nested units (already wrapped) taken out of the tree
    /// for the call, so it initializes only what the unit owns and every module is
    /// initialized exactly once under every strategy (PyTorch #104189). Without it, meta parameters
    /// built with an initializer ([`on_meta_device`](crate::nn::on_meta_device)) are
    /// computed shard by shard, so no rank ever holds a whole unit.
    pub param_init_fn: Option<ParamInitFn>,
    /// Hybrid strategies only: a 2-D mesh `(replicate, shard)` of the world
    /// (`FullyShardedDataParallel(device_mesh=...)`): dim 1 is the shard group, dim 0 the
    /// replicate group. Excludes `hybrid_groups` and `ranks_per_node`.
    pub device_mesh: Option<DeviceMesh>,
}

/// `param_init_fn`: materializes (initializes in place) the meta parameters of the module
/// it is given.
pub type ParamInitFn =
    std::sync::Arc<dyn Fn(&mut dyn crate::nn::Module) -> Result<()> + Send + Sync>;

/// `torch.distributed.fsdp.CpuOffload`: where the sharded state lives between uses.
///
/// With `offload_params`, each unit's parameter shard and gradient shard stay in host
/// memory and the optimizer steps there; unshard first copies the shard to the compute
/// device (on the pre-unshard stream, ahead of use when prefetching) and the reduced
/// gradient shard is copied back to the host. On CUDA both shards live in pinned host
/// memory (`cuMemHostAlloc`), so both copies are asynchronous (FSDP1 `_flat_param.py`,
/// `_runtime_utils.py`): the host waits for the device once per backward, at its end,
/// before the optimizer reads the gradients. On the CPU backend the "device" copy is a
/// separate staging buffer, so the data path and its numbers are exercised without a GPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuOffload {
    /// Offload parameter (and with them gradient) shards (`offload_params=True`).
    pub offload_params: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            sharding_strategy: ShardingStrategy::FullShard,
            auto_wrap_policy: None,
            hybrid_groups: None,
            sync_module_states: false,
            ranks_per_node: None,
            mixed_precision: None,
            backward_prefetch: Some(BackwardPrefetch::BackwardPre),
            forward_prefetch: false,
            limit_all_gathers: true,
            ignored_modules: Vec::new(),
            device_id: None,
            cpu_offload: CpuOffload::default(),
            device_mesh: None,
            param_init_fn: None,
        }
    }
}

/// The device a unit computes on for `device_id` (`None` is the CPU), checked against the
/// backends this build has. As PyTorch's `device_id`, a CUDA device receives the unit's
/// FlatParameter shard, its unsharded buffers, gradients and mixed-precision copies
/// (the shard stays on the host under CPU offload).
///
/// # Errors
/// `Fsdp` for the meta device (nothing can compute there); for a CUDA device that is not
/// usable, the CUDA error prefixed with `device_id cuda:<i>` (no `cuda` feature, no
/// driver, no such device).
pub(super) fn check_device(device: Option<Device>) -> Result<Device> {
    match device {
        None | Some(Device::Cpu) => Ok(Device::Cpu),
        Some(Device::Meta) => Err(Error::Fsdp(
            "device_id meta: FSDP units must compute on a real device (cpu or cuda:<i>)".into(),
        )),
        Some(d @ Device::Cuda(i)) => {
            let usable = crate::backend::cuda::CudaDevice::get(i).map(drop);
            usable.map(|()| d).map_err(|e| match e {
                Error::Cuda { context, message } => Error::Cuda {
                    context: format!("device_id {d}: {context}"),
                    message,
                },
                e => e,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ShardingStrategy;

    #[test]
    fn flag_names_parse_back() {
        for s in [
            "full-shard",
            "shard-grad-op",
            "no-shard",
            "hybrid-shard",
            "hybrid-shard-zero2",
        ] {
            let v: ShardingStrategy = s.parse().unwrap();
            assert_eq!((v.flag_name(), v.to_string()), (s, s.to_string()));
        }
        let e = "hybrid_shard"
            .parse::<ShardingStrategy>()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown sharding strategy 'hybrid_shard'"),
            "{e}"
        );
    }
}
