//! `MixedPrecision`: low-precision compute and communication over f32 master shards
//! (`torch.distributed.fsdp.MixedPrecision`, FSDP1 `_runtime_utils.py` casts).
//!
//! What each dtype does, per step of one unit:
//!
//! | step | dtype |
//! |---|---|
//! | sharded parameters (what the optimizer steps on) | f32, always |
//! | all-gather of parameters (bytes on the wire) | `param_dtype` |
//! | unsharded flat parameter and the parameters' views of it | `param_dtype` tensors (no f32 copy) |
//! | the root's floating-point input | cast to `param_dtype` (`cast_root_forward_inputs`; every unit's with `cast_forward_inputs`); its gradient cast back |
//! | every layer's output, saved activations, activation gradients | `param_dtype` tensors: each op computes in f32 and rounds its output once (`ops/lowp`) |
//! | unsharded flat gradient (what backward writes parameter gradients into) | `param_dtype` tensor |
//! | reduce-scatter / all-reduce of gradients, pre/post-division | `reduce_dtype` (default `param_dtype`); the cast from `param_dtype` fused with the predivide (`pack_grad`) |
//! | sharded gradient the optimizer reads | f32, or `param_dtype` values with `keep_low_precision_grads` (f32 storage) |
//! | module buffers (never sharded) during forward | `buffer_dtype` values (f32 storage) |
//!
//! So a unit's forward and backward run in `param_dtype` as a `param_dtype` module does in
//! PyTorch FSDP1: the ops of a bf16/f16 tensor read their inputs as f32, accumulate in f32
//! and round each output once to the dtype (`crate::ops` documents the rounding points of
//! each), on the CPU and on CUDA alike. The unsharded parameters and the saved activations
//! take half the bytes of f32. The f32 path is untouched.

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// FSDP's mixed-precision policy. `None` fields keep f32. Only floating dtypes (f32, bf16,
/// f16) are accepted. The default is FSDP1's: nothing low precision,
/// `cast_root_forward_inputs` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Every unit casts its floating-point (f32) input to `param_dtype` before its forward
    /// (`cast_forward_inputs`, default false).
    pub cast_forward_inputs: bool,
    /// The root unit casts its floating-point (f32) input to `param_dtype`
    /// (`cast_root_forward_inputs`, default true); the input gradient it returns is f32.
    pub cast_root_forward_inputs: bool,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        MixedPrecision {
            param_dtype: None,
            reduce_dtype: None,
            buffer_dtype: None,
            keep_low_precision_grads: false,
            cast_forward_inputs: false,
            cast_root_forward_inputs: true,
        }
    }
}

impl MixedPrecision {
    /// `param_dtype = reduce_dtype = buffer_dtype = dtype` (the usual "bf16 everything").
    pub fn uniform(dtype: DType) -> MixedPrecision {
        MixedPrecision {
            param_dtype: Some(dtype),
            reduce_dtype: Some(dtype),
            buffer_dtype: Some(dtype),
            ..MixedPrecision::default()
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
