//! # fsdp
//!
//! A Rust runtime for fully sharded data-parallel training, following PyTorch's
//! `torch.distributed.fsdp.FullyShardedDataParallel`: wrap a model, pick a
//! [`ShardingStrategy`](fsdp::ShardingStrategy), and train it across ranks with parameters,
//! gradients and optimizer state split between them and gathered only while a unit computes.
//!
//! ## Layers
//!
//! Lowest layer first: a module may refer to the modules of its own row and of earlier
//! rows, never to a later row's. The layers live in three crates, and the compiler keeps
//! each crate from naming one above it: `fsdp-core` (`crates/fsdp-core/`) holds the first
//! four rows, `fsdp-distributed` (`crates/fsdp-distributed/`) the fifth, this crate the
//! rest, and it re-exports the lower crates' modules at their old paths
//! (`fsdp::tensor::Tensor`, `fsdp::distributed::launch`). Inside a crate,
//! `tests/layering.rs` reads this table and fails on any reference that runs up it
//! (`crate::x`, `use crate::{..}`, a `super::` chain, `fsdp_core::x`), so the table stays
//! true. A crate imports the modules of the crates below it at its root, so `crate::tensor`
//! reads the same in all three.
//!
//! | layer | crate | modules | owns |
//! |---|---|---|---|
//! | shared | `fsdp-core` | [`device`], [`dtype`], [`init`], [`reduce`], [`error`], [`choice`], `hash`, [`kernels`] | leaves every layer names: `Device`, `DType`, parameter initializers (`ParamInit`), `ReduceOp`, the error enum, the named option enums' `Choice`, FNV-1a, the embedded CUDA fat binaries |
//! | tensor | `fsdp-core` | [`tensor`] | storage (host, device behind a trait, meta), views, host access, the buffer pool |
//! | backend | `fsdp-core` | [`backend`] | CPU reference ops and scalar math, GEMM, the CUDA backend; `Tensor`'s device methods (`to_device`, `copy_from`, `to_dtype`) |
//! | ops | `fsdp-core` | [`ops`] | device-dispatching tensor ops (CPU reference or CUDA kernel) |
//! | distributed | `fsdp-distributed` | [`distributed`] | process groups, collectives, stores, launchers |
//! | nn / optim | `fsdp` | [`nn`], [`optim`] | modules with explicit backward, GPT, SGD/Adam/AdamW |
//! | fsdp | `fsdp` | [`fsdp`] | FlatParameter, units, strategies, wrap policies, state dicts |
//! | checkpoint | `fsdp` | [`checkpoint`] | safetensors checkpoint files, crash-safe saves, resharding loads |
//! | embed | `fsdp` | [`embed`] | units declared by their parameters, for a host that computes itself (drives the FSDP hooks): the Rust embedding API |
//! | train | `fsdp` | [`train`] | the main job behind `fsdp train` and `fsdp bench` |
//!
//! Items of the lower crates marked `#[doc(hidden)]` are crate-internal, public only for
//! the layers above: not part of the API.
//!
//! Two crates of the workspace sit above them all, each using only this crate's public
//! API: `fsdp-capi` (`crates/fsdp-capi/`), the C ABI over [`embed`] and [`distributed`]
//! (`libfsdp_capi.so`, `libfsdp_capi.a`, `crates/fsdp-capi/include/fsdp.h`), and `fsdp-cli`
//! (`crates/fsdp-cli/`), the `fsdp` command line over [`train`] (it alone depends on clap,
//! indicatif and mimalloc; it parses the option enums by their [`choice::Choice`] names).
//! This crate is a plain rlib: a crate that depends on it builds no C library.
//!
//! ## Features
//!
//! | feature | default | adds |
//! |---|---|---|
//! | `cuda` | off | the CUDA backend: `kernels/*.cu` compiled by nvcc (`crates/fsdp-core/build.rs`), loaded through cudarc (no CUDA library needed to build); turns on the lower crates' `cuda` |
//! | `test-hooks` | off | the hidden fault hooks the tests drive (`FSDP_FAIL_RANK`, `FSDP_KILL_ONCE`, `FSDP_CKPT_STALL`); without it the variables are never read |
//!
//! ```
//! use fsdp::distributed::{launch, LaunchOptions};
//! use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel};
//! use fsdp::nn::{loss, Context, InitKey, Linear, Module};
//! use fsdp::optim::{Optimizer, SgdConfig, SGD};
//! use fsdp::tensor::Tensor;
//!
//! let losses = launch(&LaunchOptions::new(2), |pg| {
//!     let model = Linear::new(4, 3, true, &InitKey::new(0))?;
//!     let mut model = FullyShardedDataParallel::new(Box::new(model), pg, FsdpConfig::default())?;
//!     let mut opt = SGD::new(SgdConfig { lr: 0.1, ..Default::default() });
//!     let x = Tensor::from_vec(vec![1.0f32; 8], &[2, 4])?;
//!     let y = model.forward(&x, &Context::train())?;
//!     let (l, dy) = loss::sum_loss(&y)?;
//!     model.backward(&dy, &Context::train())?;
//!     opt.step(&model.optimizer_params())?;
//!     Ok(l)
//! })
//! .unwrap();
//! assert_eq!(losses.len(), 2);
//! ```

#![warn(missing_docs)]

// The lower layers, from their crates, at their old paths.
use fsdp_core::hash;
pub use fsdp_core::{backend, choice, device, dtype, error, init, kernels, ops, reduce, tensor};
pub use fsdp_distributed::distributed;

pub mod checkpoint;
pub mod embed;
pub mod fsdp;
pub mod nn;
pub mod optim;
pub mod train;

pub use error::{exit_code, Error, Result};
