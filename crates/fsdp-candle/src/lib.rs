//! Train a [candle](https://github.com/huggingface/candle) `candle-nn` model with its
//! parameters, gradients and optimizer state sharded by fsdp (PyTorch FSDP's semantics):
//! the model keeps its own forward and candle's autograd; fsdp owns the shards, gathers
//! each unit's parameters before the step and reduce-scatters the gradients candle's
//! backward produced; fsdp's sharded optimizers step on the shards.
//!
//! ```
//! use candle_nn::{linear, Linear, Module, VarBuilder};
//! use fsdp::distributed::{launch, LaunchOptions};
//! use fsdp::fsdp::FsdpConfig;
//! use fsdp::optim::{SgdConfig, SGD};
//! use fsdp_candle::{CandleFsdp, Wrap};
//!
//! struct Mlp { l0: Linear, l1: Linear }
//! fn build(vb: VarBuilder) -> candle::Result<Mlp> {
//!     Ok(Mlp { l0: linear(4, 8, vb.pp("l0"))?, l1: linear(8, 1, vb.pp("l1"))? })
//! }
//! launch(&LaunchOptions::new(2), |pg| {
//!     let wrap = Wrap::prefixes(["l0", "l1"]);
//!     let mut model = CandleFsdp::new(build, &wrap, pg, FsdpConfig::default())?;
//!     let mut opt = SGD::new(SgdConfig { lr: 0.1, ..Default::default() });
//!     // This rank's part of the batch.
//!     let x = candle::Tensor::ones((2, 4), candle::DType::F32, &candle::Device::Cpu)
//!         .map_err(|e| fsdp::Error::Data(e.to_string()))?;
//!     let loss = model
//!         .forward_backward(|m| m.l1.forward(&m.l0.forward(&x)?.relu()?)?.sqr()?.mean_all())?;
//!     model.step(&mut opt)?;
//!     Ok(loss)
//! })
//! .unwrap();
//! ```
//!
//! | concept | file |
//! |---|---|
//! | [`CandleFsdp`]: construction, the training step, eval, optimizer step, checkpoints | `model.rs` |
//! | [`Wrap`]: which vars form which unit (an auto-wrap policy over var names); the parameter-only module tree fsdp shards | `wrap.rs` |
//! | the vars as the builder asks for them; fsdp views to candle tensors and candle gradients into fsdp views (one copy each) | `vars.rs` |
//! | every rank declared the same model (one all-gather of fingerprints) | `agree.rs` |
//! | every rank's forward/loss and candle backward succeeded, before the backward's collectives (one all-gather of a status word) | `status.rs` |
//! | [`Error`] | `error.rs` |
//!
//! CPU only, f32 master parameters. The section "candle through fsdp" of docs/embedding.md has the
//! measured memory, what candle makes awkward and what CUDA would need.

#![warn(missing_docs)]

mod agree;
mod error;
mod model;
mod status;
mod vars;
mod wrap;

pub use error::{Error, Result};
pub use model::{Builder, CandleFsdp};
pub use wrap::Wrap;
