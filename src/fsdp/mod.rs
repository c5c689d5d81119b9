//! Fully sharded data parallelism with PyTorch FSDP1's semantics.
//!
//! | concept | file | PyTorch |
//! |---|---|---|
//! | [`FullyShardedDataParallel`] (unit and root, hooks) | `unit.rs` | `fully_sharded_data_parallel.py`, `_runtime_utils.py` |
//! | [`FlatParameter`] | `flat_param.rs` | `_flat_param.py` |
//! | [`ShardingStrategy`], [`FsdpConfig`] | `config.rs` | `api.py` |
//! | [`AutoWrapPolicy`] | `wrap.rs` | `wrap.py` |
//! | [`MemoryStats`] | `memory.rs` | `torch.cuda.memory_stats` (FSDP's share) |
//! | [`StateDict`], [`OptimStateDict`], `summon_full_params` | `state_dict/` | `state_dict_type`, `optim_state_dict`, `summon_full_params` |
//!
//! Built: every strategy (hybrid ones over [`hybrid_groups`], explicit groups or a
//! [`DeviceMesh`](crate::distributed::DeviceMesh)), nested
//! units through auto-wrap policies, FSDP1's gradient pre/post-division, `no_sync`,
//! `clip_grad_norm_` (`grad.rs`), mixed precision, prefetch/overlap, CPU offload, FULL /
//! SHARDED / LOCAL state dicts, optimizer state dicts by parameter name and
//! `summon_full_params` (`state_dict/`; the files are in [`crate::checkpoint`]).

mod config;
mod flat_param;
mod grad;
mod memory;
mod mixed_precision;
mod runtime;
mod scheduler;
mod state_dict;
mod unit;
mod wrap;

pub use config::{CpuOffload, FsdpConfig, ShardingStrategy};
pub use flat_param::{FlatParameter, ParamInfo};
pub use memory::MemoryStats;
pub use mixed_precision::MixedPrecision;
pub use scheduler::{BackwardPrefetch, RuntimeStats};
pub use state_dict::{
    FullStateDict, FullStateDictConfig, IncompatibleKeys, LocalFlatShard, LocalRange,
    LocalStateDict, OptimStateDict, ShardPiece, ShardedStateDict, ShardedTensor, StateDict,
    StateDictConfig, StateDictType,
};
pub use unit::{gradient_divide_factors, hybrid_groups, FullyShardedDataParallel};
pub use wrap::{
    nonwrapped_numel, size_based_auto_wrap_policy, transformer_auto_wrap_policy, AutoWrapPolicy,
    WrapFn,
};
