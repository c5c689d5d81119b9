//! The distributed layer: the threads backend's collectives, init_process_group, subgroups
//! and meshes, NCCL (`distributed/`), the tcp backend, the key-value store, faults across
//! ranks, f64 collectives.
//!
//! One test binary per layer (see docs/layout.md, "Tests"): each file of this folder is a
//! module, its tests named `<file>::<test>`; the helpers of `tests/common/` are modules of
//! the crate root, as they were in each file's own binary.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/f64_model.rs"]
mod f64_model;

mod distributed;
mod f64;
mod faults;
mod store;
mod tcp_backend;
