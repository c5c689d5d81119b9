//! Tests that read process-wide state another test would change, so this binary runs them
//! one at a time (each takes [`serial`]): the device allocation and synchronization
//! counters (`backend::counters`, summed over every thread of the process) that
//! `batchnorm_device` and `f64_device` check, and the `FSDP_TEST_OFFLOAD_NO_SYNC` variable
//! that `offload_pinned` sets (read by every CPU-offload backward of the process) and its
//! counters. They were binaries of their own; merged into the layer binaries, another
//! test's device work or offload would change what they count or run.
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

mod batchnorm_device;
mod f64_device;
#[cfg(feature = "test-hooks")]
mod offload_pinned;

/// Holds this binary's lock: the calling test runs alone among this binary's tests.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
