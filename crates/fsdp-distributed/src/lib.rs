//! # fsdp-distributed
//!
//! The distributed layer of the `fsdp` library (its `src/lib.rs`, "Layers", has the table
//! of every layer and its crate): process groups, collectives, stores, rendezvous
//! authentication, launchers and NCCL, all in [`distributed`]. `fsdp` re-exports it as
//! `fsdp::distributed`; this crate exists so that the compiler checks that nothing here
//! reaches up to the nn, optim or FSDP layers, and so that a change above it does not
//! recompile it.
//!
//! The modules of `fsdp-core` below it are imported at this crate's root, so that a path
//! reads the same in every crate of the library (`crate::tensor::Tensor`,
//! `crate::Error`) and `tests/layering.rs` checks one table.
//!
//! Items marked `#[doc(hidden)]` are crate-internal, public only for the layers above
//! (`fsdp`): not part of the API.
//!
//! ## Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `cuda` | off | NCCL process groups and the collectives' CUDA paths (and `fsdp-core`'s CUDA backend) |

#![warn(missing_docs)]

pub mod distributed;

use fsdp_core::{backend, error, hash, reduce, tensor, Error};
