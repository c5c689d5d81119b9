//! The FSDP constructor's options, named as `torch.distributed.fsdp.FullyShardedDataParallel`.

use super::AutoWrapPolicy;
use crate::distributed::{DeviceMesh, Group};

/// How parameters, gradients and optimizer state are split across ranks
/// (`torch.distributed.fsdp.ShardingStrategy`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
pub enum ShardingStrategy {
    /// ZeRO-3: parameters freed after forward and gathered again in backward; gradients
    /// reduce-scattered; optimizer state sharded.
    #[default]
    FullShard,
    /// ZeRO-2: parameters kept from forward until after backward; gradients reduce-scattered.
    ShardGradOp,
    /// DDP: nothing sharded; gradients all-reduced.
    NoShard,
    /// FullShard within a node (the shard group), replicated across nodes (the replicate
    /// group): gradients reduce-scattered in the node, then all-reduced across nodes.
    HybridShard,
    /// ShardGradOp within a node, replicated across nodes (FSDP1 `_HYBRID_SHARD_ZERO2`).
    #[value(name = "hybrid-shard-zero2")]
    HybridShardZero2,
}

impl ShardingStrategy {
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
/// `Default` is FSDP's: `FullShard`, no auto-wrap (one unit for the whole model).
#[derive(Clone, Default)]
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
    /// (`sync_module_states=True`), so ranks may build the model with different values.
    pub sync_module_states: bool,
    /// Hybrid strategies only, without `hybrid_groups`: ranks per node (`--ranks-per-node`);
    /// default the whole world (one node). See [`hybrid_groups`](super::hybrid_groups).
    pub ranks_per_node: Option<usize>,
    /// Hybrid strategies only: a 2-D mesh `(replicate, shard)` of the world
    /// (`FullyShardedDataParallel(device_mesh=...)`): dim 1 is the shard group, dim 0 the
    /// replicate group. Excludes `hybrid_groups` and `ranks_per_node`.
    pub device_mesh: Option<DeviceMesh>,
}
