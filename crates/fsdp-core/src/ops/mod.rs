//! Device-dispatching tensor ops: what layers, optimizers and FSDP call so that one piece of
//! code runs on the CPU and on CUDA (as `torch.*` functions dispatch on `tensor.device`).
//!
//! Each op takes [`Tensor`]s, checks they are on one device ([`same_device`]), and runs
//! either the CPU reference ([`crate::backend::cpu`]) or the CUDA kernel / cuBLAS call
//! ([`crate::backend::cuda`]) on the calling thread's current stream. The choice is one
//! `if let Device::Cuda(i)` per op, in every build: without the `cuda` feature
//! `backend::cuda` is its stand-in, whose entry points return the "no CUDA support" error
//! (no `Device::Cuda` tensor can be made there), so no op names the feature. CUDA ops are
//! asynchronous: results are ordered for later work on that stream, and a move to the host
//! ([`Tensor::to_device`], [`Tensor::to_vec_f32`]) waits for them.
//!
//! How an op dispatches: first the device ([`same_device`]), then the dtype path, then the
//! op's native path.
//! - bf16/f16 (`lowp/`): an operand of 16 bits takes the op's low-precision arm, in the
//!   op's own file: its native path on widened f32 copies, each output rounded once
//!   (`lowp::map` for a new output, `lowp::into` for one written or accumulated into;
//!   GEMMs under `autocast(None)`, as the operands already hold their rounded values).
//!   Where PyTorch rounds inside the computation, the arm calls what reproduces it:
//!   `lowp/layernorm.rs` (LayerNorm backward), `lowp/loss.rs` (cross-entropy, sum), GELU's
//!   host kernel in `lowp/mod.rs`, `batchnorm/reduced.rs`.
//! - f64 on the host (`double/`): the op's f64 loop there.
//! - native: a private `*_native` function of the op's file: `compute_dtype` (f32, or f64
//!   on a CUDA device: the `_f64` kernels), the CUDA arm, the CPU loop.
//!
//! Each op keeps its order of the two dtype checks (some test bf16/f16 first, others f64:
//! the order decides which error a mix of dtypes gets). Neither `lowp/` nor `double/`
//! imports an op module, and the plain types they share with the ops live in the leaf
//! `types.rs`, so the op modules import each other without a cycle.
//!
//! Outputs are allocated on the inputs' device. The CPU branch of every op runs exactly the
//! loops the layers of `fsdp::nn` ran before they dispatched (so CPU results are
//! bit-for-bit those of earlier versions); CUDA branches agree with them to f32 rounding
//! (GEMMs and row reductions sum in another order), bitwise where the kernel header says so.
//!
//! | file | ops | PyTorch |
//! |---|---|---|
//! | `elementwise.rs` | [`add_`], [`add`], [`scale_`], [`fill_`], [`sum_squares`] | `Tensor.add_`, `+`, `mul_`, `fill_` |
//! | `linalg.rs` | [`matmul`], [`matmul_batched`], [`mm`] (a new product, transposes as flags) and [`mm_backward`], [`linear`], [`bias_add_`], [`bias_grad`] | `addmm`, `bmm`, `a @ b.T`, `F.linear` |
//! | `arith.rs` (CPU) | [`sub`], [`mul`], [`div`], [`binary`] with broadcasting; backward: [`sum_to_shape`], [`mul_backward`], [`div_backward`], [`sub_backward`] | `torch.sub`, `mul`, `div`, `sum_to_size` |
//! | `axis.rs` (CPU) | [`sum_dim`], [`mean_dim`], [`cat`], [`split`]; backward: [`sum_dim_backward`], [`cat_backward`], [`split_backward`] | `torch.sum(x, dim)`, `mean`, `cat`, `split` |
//! | `autocast.rs` | [`autocast()`], [`gemm_dtype`]: bf16/f16 GEMM operands in a scope | `torch.autocast` (for GEMMs) |
//! | `activation.rs` | [`pointwise`], [`pointwise_backward`] ([`Pointwise::Relu`], [`Pointwise::Gelu`]), [`gelu_backward_bias_grad`] (GELU backward with the preceding bias's gradient in one pass) | `F.relu`, `F.gelu` |
//! | `layernorm.rs` | [`layer_norm`], [`layer_norm_backward`], and with the residual add fused in: [`add_layer_norm`], [`layer_norm_backward_add`] | `F.layer_norm` |
//! | `batchnorm/` | [`batch_norm`], [`batch_norm_backward`] (host loops in f64, `batchnorm.cu` on CUDA, bf16/f16 as PyTorch's CPU kernel in `reduced.rs`), [`batch_norm_count_`] | `F.batch_norm` |
//! | `causal.rs` | [`causal_matmul`] | attention's per-head products, without the masked half on the CPU |
//! | `attention.rs` | [`split_qkv`], [`merge_qkv`], [`split_heads`], [`merge_heads`], [`softmax_causal`], [`softmax_causal_backward_`] | the permutes and masked softmax of `scaled_dot_product_attention` |
//! | `sdpa.rs` | [`sdpa_causal`], [`sdpa_causal_backward`]: causal attention of bf16/f16 heads in one op, rounded as PyTorch's CPU flash attention | `F.scaled_dot_product_attention(is_causal=True)` in bf16/f16 |
//! | `embedding.rs` | [`embedding()`], [`embedding_backward`] | `F.embedding` |
//! | `flat.rs` | [`flat::pack_grad`], [`flat::unpack_grad`], [`flat::round_to_`], [`flat::rounded`] (FSDP's flat buffers, autocast's operands) | the `_reduce_grad` pre/post-divide and casts |
//! | `loss.rs` | [`cross_entropy`] ([`cross_entropy_f64`]: the f64 loss of f64 logits), [`mse_loss`], [`sum_loss`]; [`cross_entropy_tensor_scaled`], [`mse_loss_scaled`]: the gradient of a scaled loss | `F.cross_entropy`, `F.mse_loss`, `.sum()`, `scaler.scale(loss).backward()` |
//! | `amp.rs` | [`non_finite_check_and_unscale_`] (loss scaling's unscale and inf/NaN check) | `torch._amp_foreach_non_finite_check_and_unscale_` |
//! | `lowp/` | what the bf16/f16 arms of the ops above share (widening, rounding once to the inputs' dtype, the combinators `map` and `into`), and the computations that round as PyTorch does inside: LayerNorm's backward, the losses, GELU on the host | `param_dtype` modules under FSDP mixed precision |
//! | `types.rs` | [`MatmulDims`], [`Pointwise`], [`LayerNormSaved`]: plain types the ops share with `lowp/` and `double/` (also named `linalg::MatmulDims`, `activation::Pointwise`, `layernorm::LayerNormSaved`) | |
//! | `double/` | the f64 host paths of [`matmul`], [`linear`], [`bias_add_`], [`bias_grad`], ReLU, GELU, [`layer_norm`], [`softmax_causal`], attention's permutes, [`embedding()`], [`cross_entropy`], [`mse_loss`], [`sum_loss`], [`sum_squares`] (taken when an operand is an f64 host tensor; f64 CUDA tensors run the `_f64` kernels of these ops, and cuBLAS in f64 for the products, see `compute_dtype`) | float64 tensors |
//!
//! The ops marked (CPU) have CPU loops only: on CUDA they return `Unsupported`. They are what
//! a custom layer composes its forward and backward from (see `tests/ops/custom_layer.rs`).
//!
//! Host synchronizations: [`sum_squares`], [`non_finite_check_and_unscale_`] (its answer),
//! the losses (their value is a host `f32`), and
//! [`embedding()`] and [`cross_entropy`] on CUDA, which read back the kernel's out-of-range
//! flag to report a bad id or target as an error. Everything else only queues work.

pub mod activation;
pub mod amp;
pub mod arith;
pub mod attention;
pub mod autocast;
pub mod axis;
pub mod batchnorm;
pub mod causal;
#[doc(hidden)] // crate-internal, public only for the layers above
pub mod double;
pub mod elementwise;
pub mod embedding;
pub mod flat;
pub mod layernorm;
pub mod linalg;
pub mod loss;
pub(crate) mod lowp;
pub mod sdpa;
mod types;

pub use activation::{
    bias_gelu_, bias_gelu_fusable, gelu_backward_bias_grad, pointwise, pointwise_backward,
};
pub use amp::non_finite_check_and_unscale_;
pub use arith::{
    binary, broadcast_shape, div, div_backward, mul, mul_backward, sub, sub_backward, sum_to_shape,
    BinaryOp,
};
pub use attention::{
    merge_heads, merge_qkv, softmax_causal, softmax_causal_backward_, split_heads, split_qkv,
    HeadDims,
};
pub use autocast::{autocast, gemm_dtype, AutocastGuard};
pub use axis::{
    cat, cat_backward, mean_dim, normalize_dim, split, split_backward, sum_dim, sum_dim_backward,
};
pub use batchnorm::{
    batch_norm, batch_norm_backward, batch_norm_count_, BatchNormSaved, RunningStats, UpdateFactor,
};
pub use causal::{causal_matmul, CausalProduct};
pub use elementwise::{add, add_, add_promoted_, fill_, scale_, sum_squares};
pub use embedding::{embedding, embedding_backward};
pub use layernorm::{add_layer_norm, layer_norm, layer_norm_backward, layer_norm_backward_add};
pub use linalg::{
    bias_add_, bias_grad, linear, matmul, matmul_batched, mm, mm_backward, Transpose,
};
pub use loss::{
    add_div_, cross_entropy, cross_entropy_f64, cross_entropy_tensor, cross_entropy_tensor_scaled,
    mse_loss, mse_loss_scaled, sum_loss,
};
pub use sdpa::{sdpa_causal, sdpa_causal_backward, sdpa_supported};
pub use types::{LayerNormSaved, MatmulDims, Pointwise};

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The device of `ts`, all on one device.
///
/// # Errors
/// `DeviceMismatch` naming `op` and the first tensor on another device than `ts[0]`;
/// `NotMaterialized` when they are on the meta device.
pub fn same_device(op: &'static str, ts: &[&Tensor]) -> Result<Device> {
    let Some(first) = ts.first() else {
        return Ok(Device::Cpu);
    };
    let d = first.device();
    for t in &ts[1..] {
        if t.device() != d {
            return Err(Error::DeviceMismatch {
                op,
                expected: d.to_string(),
                got: t.device().to_string(),
            });
        }
    }
    if d == Device::Meta {
        return Err(Error::NotMaterialized {
            name: format!("{op} input {first:?}"),
            state: "meta",
        });
    }
    Ok(d)
}

/// Every tensor of `ts` is f32 (the dtype of every nn op).
///
/// # Errors
/// `DTypeMismatch` naming `op` and the first other dtype.
pub(crate) fn check_f32(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    match ts.iter().find(|t| t.dtype() != DType::F32) {
        Some(t) => Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            got: t.dtype(),
        }),
        None => Ok(()),
    }
}

/// The dtype an op computes `ts` in on `device`: f32, or f64 on a CUDA device when any of
/// `ts` is f64 (the `_f64` kernels; every tensor must then be f64). f64 host tensors take
/// the loops of `double/` before this check.
///
/// # Errors
/// `DTypeMismatch` naming `op` and the first tensor of another dtype.
pub(crate) fn compute_dtype(op: &'static str, ts: &[&Tensor], device: Device) -> Result<DType> {
    if device.is_cuda() && double::any_f64(ts) {
        return match ts.iter().find(|t| t.dtype() != DType::F64) {
            Some(t) => Err(Error::DTypeMismatch {
                op,
                expected: DType::F64,
                got: t.dtype(),
            }),
            None => Ok(DType::F64),
        };
    }
    check_f32(op, ts)?;
    Ok(DType::F32)
}

/// [`output`] of `dtype`: f32 exactly [`output`]; another dtype uninitialized on CUDA, zeros
/// elsewhere.
///
/// # Errors
/// As [`output`].
pub(crate) fn output_as(shape: &[usize], device: Device, dtype: DType) -> Result<Tensor> {
    if dtype == DType::F32 {
        return output(shape, device);
    }
    if let Device::Cuda(i) = device {
        let t = crate::backend::cuda::DeviceTensor::empty(&*stream(i)?, shape, dtype)?;
        return Ok(Tensor::from_device_tensor(t));
    }
    Tensor::zeros_on(shape, dtype, device)
}

/// A new f32 tensor of `shape` on `device` that the calling op overwrites entirely: on the
/// CPU a buffer from the [pool](crate::tensor::pool) (stale values, no zero fill), on CUDA
/// uninitialized memory (no memset to wait for).
///
/// # Errors
/// [`Error::Cuda`] when the device is unavailable or out of memory.
#[doc(hidden)] // crate-internal, public only for the layers above
pub fn output(shape: &[usize], device: Device) -> Result<Tensor> {
    if let Device::Cuda(i) = device {
        let t = crate::backend::cuda::DeviceTensor::empty(&*stream(i)?, shape, DType::F32)?;
        return Ok(Tensor::from_device_tensor(t));
    }
    if device == Device::Cpu {
        return Ok(Tensor::scratch_f32(shape));
    }
    Tensor::zeros_on(shape, DType::F32, device)
}

/// [`output`] in the dtype of `like` when it is bf16/f16 (an nn op's output or scratch
/// for a low-precision module) or f64 (zeros, for a float64 module), else f32 (the f32
/// path's [`output`] exactly).
///
/// # Errors
/// As [`output`].
#[doc(hidden)] // crate-internal, public only for the layers above
pub fn output_like(shape: &[usize], like: &Tensor) -> Result<Tensor> {
    match like.dtype() {
        d @ (DType::BF16 | DType::F16 | DType::F64) => Tensor::zeros_on(shape, d, like.device()),
        _ => output(shape, like.device()),
    }
}

/// The calling thread's current stream on `cuda:ordinal` (see
/// [`crate::backend::cuda::current_stream`]).
#[doc(hidden)] // crate-internal, public only for the layers above
pub fn stream(ordinal: usize) -> Result<std::sync::Arc<crate::backend::cuda::Stream>> {
    crate::backend::cuda::current_stream(ordinal)
}
