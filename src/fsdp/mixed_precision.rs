//! `MixedPrecision`: low-precision compute and communication over f32 master shards
//! (`torch.distributed.fsdp.MixedPrecision`, FSDP1 `_runtime_utils.py` casts).
//!
//! What each dtype does, per step of one unit:
//!
//! | step | dtype |
//! |---|---|
//! | sharded parameters (what the optimizer steps on) | f32, always |
//! | all-gather of parameters (bytes on the wire) | `param_dtype` |
//! | parameters and floating-point unit inputs during forward/backward | `param_dtype` values |
//! | GEMM operands (linear layers, attention products), forward and backward | `param_dtype`, f32 accumulation |
//! | gradients as computed | `param_dtype` values |
//! | reduce-scatter / all-reduce of gradients, pre/post-division | `reduce_dtype` (default `param_dtype`) |
//! | sharded gradient the optimizer reads | f32, or `param_dtype` values with `keep_low_precision_grads` |
//! | module buffers (never sharded) during forward | `buffer_dtype` values (f32 storage) |
//!
//! The layers compute in f32 on values rounded to `param_dtype`: parameters after the
//! all-gather, unit inputs at the unit boundary, and the unsharded gradient before it is
//! reduced, on the CPU and on CUDA alike (the rounding runs on the tensor's device). Every
//! GEMM of a unit reads both operands as `param_dtype` with f32 accumulation, as a
//! `param_dtype` module's `F.linear`/`bmm` does: each unit's forward and backward run in an
//! [`crate::ops::autocast`] scope (on CUDA a cuBLAS bf16/f16 tensor-core GEMM, on the CPU
//! the f32 GEMM of rounded copies). Elementwise ops, LayerNorm, softmax and the loss stay
//! f32, as they would under `torch.autocast`. The collectives move real `param_dtype` /
//! `reduce_dtype` tensors.

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// FSDP's mixed-precision policy. `None` fields keep f32. Only floating dtypes (f32, bf16,
/// f16) are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MixedPrecision {
    /// Dtype of the unsharded parameters used in forward/backward and of the parameter
    /// all-gather (`param_dtype`).
    pub param_dtype: Option<DType>,
    /// Dtype gradients are reduced in (`reduce_dtype`); `None` means `param_dtype`.
    pub reduce_dtype: Option<DType>,
    /// Dtype of module buffers (`buffer_dtype`): before each unit's forward, the f32
    /// buffers of its modules (BatchNorm's running stats) are rounded to it in place, as
    /// FSDP1 casts buffers at the first forward; integer buffers are left alone. State
    /// dicts return buffers in their f32 storage (FSDP1 restores the original dtype).
    pub buffer_dtype: Option<DType>,
    /// Keep the sharded gradient in `param_dtype` precision instead of upcasting it to f32
    /// after the reduction (`keep_low_precision_grads`).
    pub keep_low_precision_grads: bool,
}

impl MixedPrecision {
    /// `param_dtype = reduce_dtype = buffer_dtype = dtype` (the usual "bf16 everything").
    pub fn uniform(dtype: DType) -> MixedPrecision {
        MixedPrecision {
            param_dtype: Some(dtype),
            reduce_dtype: Some(dtype),
            buffer_dtype: Some(dtype),
            keep_low_precision_grads: false,
        }
    }

    /// Checks that every given dtype is a floating dtype.
    ///
    /// # Errors
    /// `Fsdp` naming the field with an integer dtype.
    pub fn validate(&self) -> Result<()> {
        for (field, d) in [
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
            ("buffer_dtype", self.buffer_dtype),
        ] {
            if let Some(d) = d {
                if !d.is_float() {
                    return Err(Error::Fsdp(format!(
                        "MixedPrecision {field} must be f32, bf16 or f16, got {d}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Dtype of the parameter all-gather and of compute values.
    pub fn compute_dtype(&self) -> DType {
        self.param_dtype.unwrap_or(DType::F32)
    }

    /// Dtype of the gradient reduction.
    pub fn reduce_dtype(&self) -> DType {
        self.reduce_dtype.unwrap_or(self.compute_dtype())
    }

    /// Whether parameters are low precision at all.
    pub fn is_low_precision(&self) -> bool {
        self.compute_dtype() != DType::F32
    }
}

/// Rounds every element of an f32 tensor to the nearest `dtype` value, in place (no-op for
/// f32), on the tensor's device ([`crate::ops::flat::round_to_`]).
///
/// # Errors
/// `DTypeMismatch` when `t` is not f32.
pub(crate) fn round_(t: &Tensor, dtype: DType) -> Result<()> {
    crate::ops::flat::round_to_(t, dtype)
}
