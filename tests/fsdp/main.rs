//! The fsdp layer and embed's hooks: parity with unsharded training under every strategy
//! and option, mixed precision and the grad scaler, overlap and streams, FSDP on CUDA,
//! deferred init, state dicts, ZeRO-1, activation checkpointing, ranks that diverge.
//!
//! One test binary per layer (see docs/layout.md, "Tests"): each file of this folder is a
//! module, its tests named `<file>::<test>`; the helpers of `tests/common/` are modules of
//! the crate root, as they were in each file's own binary.

#[path = "../common/bn_model.rs"]
mod bn_model;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/device.rs"]
mod device;
#[path = "../common/f64_model.rs"]
mod f64_model;
#[path = "../common/mp_mlp.rs"]
mod mp_mlp;
#[path = "../common/zero_models.rs"]
mod zero_models;

mod activation_checkpointing;
mod batchnorm_fsdp;
mod deferred_init;
mod divergence;
mod f64_gpt;
mod fsdp_cuda;
mod fsdp_grad;
mod fsdp_options;
mod fsdp_overlap;
mod fsdp_param_groups;
mod fsdp_parity;
mod fsdp_streams;
mod fsdp_zero_size;
mod grad_scaler;
mod hooks;
mod mixed_precision;
mod mixed_precision_torch;
mod state_dict;
mod zero_redundancy;
