//! The checkpoint layer: crash-safe checkpoint files, asynchronous saves, the format across
//! builds, per-rank extra state.
//!
//! One test binary per layer (see docs/layout.md, "Tests"): each file of this folder is a
//! module, its tests named `<file>::<test>`; the helpers of `tests/common/` are modules of
//! the crate root, as they were in each file's own binary.

#[path = "../common/mod.rs"]
mod common;

mod checkpoint;
mod checkpoint_async;
mod checkpoint_compat;
mod checkpoint_rank_extra;
