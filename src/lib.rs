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
//! rows, never to a later row's. `tests/layering.rs` reads this table and fails on any
//! reference that runs up it (`crate::x`, `use crate::{..}`, a `super::` chain), so the
//! table stays true.
//!
//! | layer | modules | owns |
//! |---|---|---|
//! | shared | [`device`], [`dtype`], [`init`], [`reduce`], [`error`], [`choice`], `hash`, [`kernels`] | leaves every layer names: `Device`, `DType`, parameter initializers (`ParamInit`), `ReduceOp`, the error enum, the named option enums' `Choice`, FNV-1a, the embedded CUDA fat binaries |
//! | tensor | [`tensor`] | storage (host, device behind a trait, meta), views, host access, the buffer pool |
//! | backend | [`backend`] | CPU reference ops and scalar math, GEMM, the CUDA backend; `Tensor`'s device methods (`to_device`, `copy_from`, `to_dtype`) |
//! | ops | [`ops`] | device-dispatching tensor ops (CPU reference or CUDA kernel) |
//! | distributed | [`distributed`] | process groups, collectives, stores, launchers |
//! | nn / optim | [`nn`], [`optim`] | modules with explicit backward, GPT, SGD/Adam/AdamW |
//! | fsdp | [`fsdp`] | FlatParameter, units, strategies, wrap policies, state dicts |
//! | checkpoint | [`checkpoint`] | safetensors checkpoint files, crash-safe saves, resharding loads |
//! | embed | [`embed`] | units declared by their parameters, for a host that computes itself (drives the FSDP hooks): the Rust embedding API |
//! | train | [`train`] | the main job behind `fsdp train` and `fsdp bench` |
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
//! | `cuda` | off | the CUDA backend: `kernels/*.cu` compiled by nvcc, loaded through cudarc (no CUDA library needed to build) |
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

pub mod backend;
pub mod checkpoint;
pub mod choice;
pub mod device;
pub mod distributed;
pub mod dtype;
pub mod embed;
pub mod error;
pub mod fsdp;
mod hash;
pub mod init;
pub mod kernels;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod reduce;
pub mod tensor;
pub mod train;

pub use error::{exit_code, Error, Result};
