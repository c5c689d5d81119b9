//! # fsdp
//!
//! A Rust runtime for fully sharded data-parallel training, following PyTorch's
//! `torch.distributed.fsdp.FullyShardedDataParallel`: wrap a model, pick a
//! [`ShardingStrategy`](fsdp::ShardingStrategy), and train it across ranks with parameters,
//! gradients and optimizer state split between them and gathered only while a unit computes.
//!
//! | layer | module | owns |
//! |---|---|---|
//! | tensor | [`tensor`] | dtypes, storage, views |
//! | backend | [`backend`] | devices, CPU reference ops, GEMM, the CUDA backend |
//! | ops | [`ops`] | device-dispatching tensor ops (CPU reference or CUDA kernel) |
//! | distributed | [`distributed`] | process groups, collectives, the in-process launcher |
//! | nn / optim | [`nn`], [`optim`] | modules with explicit backward, GPT, SGD/Adam/AdamW |
//! | fsdp | [`fsdp`] | FlatParameter, units, strategies, wrap policies, state dicts |
//! | checkpoint | [`checkpoint`] | safetensors checkpoint files, crash-safe saves, resharding loads |
//! | embed | [`embed`] | units declared by their parameters, for a host that computes itself (drives the FSDP hooks) |
//! | train | [`train`] | the main job behind `fsdp train` and `fsdp bench` |
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
pub mod distributed;
pub mod embed;
pub mod error;
pub mod fsdp;
mod hash;
pub mod kernels;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod tensor;
pub mod train;

pub use error::{exit_code, Error, Result};
