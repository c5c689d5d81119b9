//! Neural-network layers with explicit backward passes, and the GPT model. Every layer
//! computes through [`crate::ops`], so it runs on the device of its parameters and input
//! (CPU or CUDA; move a model with [`module_to_device`]); outputs, saved activations and
//! parameter gradients are allocated there.
//!
//! | item | file | PyTorch |
//! |---|---|---|
//! | [`Module`], [`Context`] | `module.rs` | `nn.Module`, `torch.no_grad`, `model.train(mode)` |
//! | [`ModuleBuffer`], [`visit_buffers`], [`named_buffers`] | `buffer.rs` | `register_buffer`, `named_buffers()` |
//! | [`BatchNorm1d`] | `batchnorm.rs` | `nn.BatchNorm1d` |
//! | [`module_to_device`], [`module_to_dtype`] | `device.rs` | `nn.Module.to(device)`, `.to(dtype)` / `.double()` |
//! | [`Parameter`] | `parameter.rs` | `nn.Parameter` |
//! | [`Linear`] | `linear.rs` | `nn.Linear` |
//! | [`CheckpointWrapper`], [`apply_activation_checkpointing`], [`CheckpointPolicy`] | `checkpoint_wrapper.rs` | `checkpoint_wrapper`, `apply_activation_checkpointing(model, check_fn=...)` |
//! | [`saved_activation_bytes`], [`track_saved_activations`], [`saved_activation_peak`] | `saved.rs` | saved tensors' bytes (`torch.cuda.memory_allocated` at the end of forward; the recompute's peak) |
//! | [`ReLU`], [`GELU`] | `activation.rs` | `nn.ReLU`, `nn.GELU()` |
//! | [`LayerNorm`] | `layernorm.rs` | `nn.LayerNorm` |
//! | [`Embedding`] | `embedding.rs` | `nn.Embedding` |
//! | [`CausalSelfAttention`] | `attention.rs` | `F.scaled_dot_product_attention(is_causal=True)` |
//! | [`MLP`], [`Block`] | `transformer.rs` | GPT-2 block |
//! | [`Sequential`], [`ModuleList`], [`ModuleDict`] (named children, settable type name) | `container.rs` | `nn.Sequential`, `nn.ModuleList`, `nn.ModuleDict` |
//! | [`state_dict()`], [`load_state_dict`], [`FullStateDict`], [`IncompatibleKeys`] | `state_dict.rs` | `nn.Module.state_dict`, `load_state_dict(strict)`, `_IncompatibleKeys` |
//! | [`GPT`] | `gpt.rs` | nanoGPT's `GPT` |
//! | a custom layer ([`Module`]'s example) | [`crate::ops`]: [`mm`](crate::ops::mm) with transposes, [`sub`](crate::ops::sub) / [`mul`](crate::ops::mul) / [`div`](crate::ops::div) with broadcasting, [`sum_dim`](crate::ops::sum_dim) / [`mean_dim`](crate::ops::mean_dim), [`cat`](crate::ops::cat) / [`split`](crate::ops::split), each with a backward helper (CPU) | `torch.matmul`, `sub`, `mul`, `div`, `sum`, `mean`, `cat`, `split` |
//! | [`loss`] | `loss.rs` | `F.cross_entropy`, `F.mse_loss`, `.sum()` |
//! | [`InitKey`] | `init.rs` | counter-based init (the default; any shard alone) |
//! | [`TorchGenerator`], [`torch_rng`] | `torch_rng.rs` | `torch.manual_seed`, CPU `uniform_`/`normal_`/`randn`/`randperm`, default inits |

mod activation;
mod attention;
mod batchnorm;
mod buffer;
mod checkpoint_wrapper;
mod container;
mod device;
mod embedding;
mod gpt;
mod init;
mod layernorm;
mod linear;
pub mod loss;
mod module;
mod parameter;
mod saved;
pub(crate) mod state_dict;
pub mod torch_rng;
mod transformer;

pub use activation::{gelu, gelu_grad, relu, relu_grad, ReLU, GELU};
pub use attention::CausalSelfAttention;
pub use batchnorm::BatchNorm1d;
pub(crate) use buffer::{buffers_to_device, round_buffers};
pub use buffer::{named_buffers, visit_buffers, BufferVisitor, ModuleBuffer};
pub use checkpoint_wrapper::{
    apply_activation_checkpointing, CheckpointFn, CheckpointPolicy, CheckpointWrapper,
};
pub use container::{ModuleDict, ModuleList, Sequential};
pub use device::{module_to_device, module_to_dtype};
pub use embedding::{embedding_backward, embedding_lookup, Embedding};
pub use gpt::{GptConfig, GPT};
pub use init::{materialize, on_meta_device, InitKey, ParamInit, ParamInitExt};
pub use layernorm::LayerNorm;
pub use linear::Linear;
pub use module::{
    check_names, join_name, no_children, no_params, num_parameters, parameter_shapes,
    visit_parameters, zero_grad, ChildVisitor, Context, Module, ParamVisitor,
};
pub(crate) use module::{first_fsdp_unit, visit_all, visit_parameters_in};
pub use parameter::Parameter;
pub use saved::{saved_activation_bytes, saved_activation_peak, track_saved_activations};
pub use state_dict::{load_state_dict, state_dict, FullStateDict, IncompatibleKeys};
pub use torch_rng::TorchGenerator;
pub use transformer::{Block, MLP};
