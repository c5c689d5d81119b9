//! Fully sharded data parallelism with PyTorch FSDP1's semantics.
//!
//! [`FullyShardedDataParallel`]'s methods, one concern per file:
//!
//! | concern | methods | file | PyTorch |
//! |---|---|---|---|
//! | the unit, the state its rank's units share, accessors and statistics | `is_root`, `module_name`, `flat_param`, `module_mut`, `compute_device`, `sharding_strategy`, `zero_redundancy`, `process_group`, `shard_group`, `mixed_precision`, `memory_stats`, `runtime_stats` | `unit.rs` | `fully_sharded_data_parallel.py` |
//! | construction: auto-wrap, tied parameters, `ignored_modules` | `new` | `wrapping.rs` | `_init_utils.py`, `wrap.py` |
//! | reaching units and parameters: nested units, ignored modules' parameters, pointing parameters at a buffer | `with_unit`, `for_each_unit`, `visit_ignored` | `walk.rs` | `_traversal_utils.py` |
//! | the hooks around a unit's forward and backward | `pre_forward`, `post_forward`, `pre_backward`, `post_backward`, `finish_backward`, `param_views`, `grad_views` | `hooks.rs` | `_runtime_utils.py` |
//! | the unit's hook phase: idle, forward (with or without grad), backward with its flat gradient; its transitions and refusals | (used by the hooks) | `phase.rs` | `HandleTrainingState` in `_common_utils.py` |
//! | the order of a host's hooks, steps and `zero_grad` across units (refused out of order, in the caller's API's names) | `ready_for_step`, `ready_for_zero_grad` | `order.rs` | FSDP2's `TrainingState` checks |
//! | what the hooks run: unshard, reshard, the end of the root's backward | `unshard`, `reshard` | `runtime.rs` | `_runtime_utils.py` |
//! | the [`Module`](crate::nn::Module) path: hooks around the wrapped module, buffer and input casts | `forward`, `backward` | `module.rs` | `_root_pre_forward`, `_cast_forward_inputs` |
//! | a unit's all-gather and gradient reduction (predivide, reduce-scatter, all-reduce, postdivide, offload copies) | (used by the hooks) | `collectives.rs` | `_runtime_utils.py`, FSDP2 `_fsdp_collectives.py` |
//! | gradients: synchronization on/off, dropping, clipping | `no_sync`, `set_requires_gradient_sync`, `zero_grad`, `clip_grad_norm_` | `grad.rs` | `fully_sharded_data_parallel.py` |
//! | the optimizer's view of the parameters, the full parameters | `optimizer_params`, `optimizer_param_names`, `full_parameters` | `params.rs` | `fully_sharded_data_parallel.py` |
//! | model state dicts | `state_dict`, `full_state_dict`, `sharded_state_dict`, `local_state_dict`, `load_state_dict`, `check_state_dict`, `state_dict_ranges` | `state_dict/model.rs` | `state_dict_type`, `_state_dict_utils.py` |
//! | optimizer state dicts | `optim_state_dict`, `optim_state_dict_to_load`, `load_optim_state_dict` | `state_dict/optim.rs` | `_optim_utils.py` |
//! | whole parameters inside a closure | `summon_full_params` | `state_dict/summon.rs` | `_unshard_param_utils.py` |
//!
//! The rest of FSDP:
//!
//! | concept | file | PyTorch |
//! |---|---|---|
//! | a unit's parameters before flattening: `param_init_fn` (nested units out of reach), `sync_module_states` | `materialize.rs` | `_init_utils.py` |
//! | each unit's sharded / gathering / unsharded state (`ParamState`), prefetch order, [`BackwardPrefetch`], `limit_all_gathers`, [`RuntimeStats`] | `scheduler.rs` | `_exec_order_utils.py`, `_limiter_utils.py`, FSDP2 `ShardedState` |
//! | the per-rank unshard, post-backward and pre-unshard streams | `streams.rs` | `_init_streams` in `_runtime_utils.py` |
//! | [`BufferPool`]: unsharded parameter, flat gradient and reduction buffers kept from step to step, reused behind their last stream use | `buffers.rs` | YaFSDP's persistent buffers, FSDP2's free-after-event |
//! | the rank's stage in the step (`Pass`), the step, micro-batch and pass each collective is for (its fingerprint, checked across ranks) | `progress.rs` | `TrainingState`, `TORCH_DISTRIBUTED_DEBUG=DETAIL` |
//! | [`MixedPrecision`] | `mixed_precision.rs` | `api.MixedPrecision` |
//! | [`FlatParameter`] | `flat_param.rs` | `_flat_param.py` |
//! | [`ShardingStrategy`], [`FsdpConfig`], [`CpuOffload`] | `config.rs` | `api.py` |
//! | [`AutoWrapPolicy`] | `wrap.rs` | `wrap.py` |
//! | [`ShardedGradScaler`]: dynamic loss scaling for f16, the inf/NaN check all-reduced over the ranks | `grad_scaler.rs` | `sharded_grad_scaler.py`, `torch/amp/grad_scaler.py` |
//! | [`MemoryStats`] | `memory.rs` | `torch.cuda.memory_stats` (FSDP's share) |
//! | [`StateDict`], [`OptimStateDict`] and their layouts | `state_dict/` | `state_dict_type`, `optim_state_dict` |
//! | [`ZeroRedundancyOptimizer`]: ZeRO-1 over NoShard (optimizer state and reduced gradient in per-rank chunks, parameters whole) | `zero_redundancy.rs` | `torch.distributed.optim.ZeroRedundancyOptimizer`, DeepSpeed ZeRO stage 1 |
//!
//! Every strategy (hybrid ones over [`hybrid_groups`], explicit groups or a
//! [`DeviceMesh`](crate::distributed::DeviceMesh)), nested units through auto-wrap policies,
//! FSDP1's gradient pre/post-division, mixed precision, backward/forward prefetch with
//! collectives overlapping compute on the unshard and post-backward streams, CPU offload,
//! deferred init,
//! FULL / SHARDED / LOCAL state dicts, optimizer state dicts by parameter name and
//! `summon_full_params` (`state_dict/`; the files are in [`crate::checkpoint`]).
//!
//! | state | CPU (`device_id` none or cpu) | CUDA (`device_id = cuda:i`) |
//! |---|---|---|
//! | parameter shard (f32 master) | host | `cuda:i` (pinned host memory under CPU offload) |
//! | unsharded parameters, flat gradient, low-precision copies | host | `cuda:i` |
//! | reduced gradient shard | host | `cuda:i` (pinned host memory under CPU offload) |
//! | unshard / post-backward / pre-unshard streams | a worker thread each | a worker thread each, with its own CUDA stream, ordered by events |
//! | gradient pack/unpack, rounding | [`crate::ops::flat`] CPU loops | `pack_grad_*`, `unpack_grad_*`, `cast_*` kernels |
//! | state dicts | host tensors | host tensors (full state dict: on the GPU without `offload_to_cpu`) |

mod buffers;
mod collectives;
mod config;
mod flat_param;
mod grad;
mod grad_scaler;
mod hooks;
mod materialize;
mod memory;
mod mixed_precision;
mod module;
mod order;
mod params;
mod phase;
mod progress;
mod runtime;
mod scheduler;
mod state_dict;
mod streams;
mod unit;
mod walk;
mod wrap;
mod wrapping;
mod zero_redundancy;

pub use buffers::BufferPool;
pub use config::{CpuOffload, FsdpConfig, ParamInitFn, ShardingStrategy};
pub use flat_param::{FlatParameter, ParamInfo};
pub use grad_scaler::{GradScalerConfig, GradScalerState, ShardedGradScaler};
pub use memory::MemoryStats;
pub use mixed_precision::MixedPrecision;
pub use scheduler::{BackwardPrefetch, RuntimeStats};
pub use state_dict::{
    FullStateDict, FullStateDictConfig, IncompatibleKeys, LocalFlatShard, LocalRange,
    LocalStateDict, NamedParamGroup, OptimStateDict, ShardPiece, ShardedStateDict, ShardedTensor,
    StateDict, StateDictConfig, StateDictType,
};
pub(crate) use state_dict::{OptimSnapshot, ShardedSnapshot};
pub use unit::{gradient_divide_factors, FullyShardedDataParallel};
pub use walk::UnitVisitor;
pub use wrap::{
    module_wrap_policy, nonwrapped_numel, size_based_auto_wrap_policy,
    transformer_auto_wrap_policy, AutoWrapPolicy, WrapFn,
};
pub use wrapping::hybrid_groups;
pub use zero_redundancy::ZeroRedundancyOptimizer;
