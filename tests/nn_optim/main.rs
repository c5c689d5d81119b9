//! The nn and optim layers: finite-difference gradients of every layer (f32 and f64),
//! BatchNorm, the module API, every layer on every device, PyTorch's generator, the
//! optimizers and learning-rate schedules against `torch.optim`.
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

mod batchnorm;
mod batchnorm_lowp;
mod f64_gradcheck;
mod f64_optim;
mod gradcheck;
mod lr_scheduler;
mod module_api;
mod nn_device;
mod optim;
mod torch_rng;
