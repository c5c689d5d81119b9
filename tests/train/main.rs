//! The train layer: the main job end to end, resume, the golden losses, the examples
//! against PyTorch, the distributed sampler.
//!
//! One test binary per layer (see docs/layout.md, "Tests"): each file of this folder is a
//! module, its tests named `<file>::<test>`; the helpers of `tests/common/` are modules of
//! the crate root, as they were in each file's own binary.

#[path = "../common/mod.rs"]
mod common;

mod golden_losses;
mod resume;
mod sampler;
mod torch_examples;
mod train_job;
