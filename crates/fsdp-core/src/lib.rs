//! # fsdp-core
//!
//! The lower four layers of the `fsdp` library (its `src/lib.rs`, "Layers", has the table
//! of every layer and its crate): the shared leaves, [`tensor`], [`backend`] (the CPU
//! reference and the CUDA backend) and [`ops`] (device-dispatching tensor ops). `fsdp`
//! re-exports each module at its old path (`fsdp::tensor::Tensor` is
//! [`tensor::Tensor`]), so users name the `fsdp` crate; this one exists so that the
//! compiler checks that nothing here reaches up to the distributed, nn, optim or FSDP
//! layers, and so that a change above it does not recompile it.
//!
//! Items marked `#[doc(hidden)]` are crate-internal, public only for the layers above
//! (`fsdp-distributed` and `fsdp`): not part of the API.
//!
//! ## Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `cuda` | off | the CUDA backend: the workspace's `kernels/*.cu` compiled by nvcc (see `build.rs`), loaded through cudarc (no CUDA library needed to build) |

#![warn(missing_docs)]

pub mod backend;
pub mod choice;
pub mod device;
pub mod dtype;
pub mod error;
#[doc(hidden)] // crate-internal, public only for the layers above (FNV-1a for fingerprints)
pub mod hash;
pub mod init;
pub mod kernels;
pub mod ops;
pub mod reduce;
pub mod tensor;

pub use error::{exit_code, Error, Result};
