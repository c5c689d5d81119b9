//! The ops layer and those below it (shared, tensor, backend and ops in the table of
//! `src/lib.rs`): every CUDA kernel against its CPU reference, the device-dispatching ops,
//! attention, the ops of a custom layer, the CPU thread budget, zero-size shapes.
//!
//! One test binary per layer (see docs/layout.md, "Tests"): each file of this folder is a
//! module, its tests named `<file>::<test>`; the helpers of `tests/common/` are modules of
//! the crate root, as they were in each file's own binary.

#[path = "../common/backend.rs"]
mod backend;
#[path = "../common/backend_optim.rs"]
mod backend_optim;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/device.rs"]
mod device;
#[path = "../common/zero_models.rs"]
mod zero_models;

mod attention_fused;
mod attention_sdpa_torch;
mod cpu_threads;
mod custom_layer;
mod kernels;
mod kernels_nn;
mod ops_device;
mod zero_size;
