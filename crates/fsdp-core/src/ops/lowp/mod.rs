//! The bf16/f16 paths of the nn ops: what a `param_dtype` module computes under
//! `fsdp::fsdp::MixedPrecision` (its parameters, activations and activation gradients are
//! bf16 or f16 tensors, as in PyTorch FSDP, where the unsharded parameters are
//! `param_dtype` tensors and every op of the module then runs in that dtype).
//!
//! Each op that receives a bf16/f16 tensor does what PyTorch's CPU and CUDA kernels do for
//! reduced-precision floats: it reads its inputs as f32 (a widening copy: pool buffers on
//! the CPU, the `cast` kernels on CUDA), computes in f32 with f32 accumulation (the op's
//! native f32 path, unchanged), and rounds each output once into a tensor of the input's
//! dtype (round to nearest even). An output that is accumulated into (`+=`, a parameter's
//! gradient view) is widened, added to in f32 and rounded once.
//!
//! This module knows no op and imports none: each op's low-precision arm sits in the op's
//! file and calls its private native function through the pieces here ([`up`], [`down`],
//! [`work_out`], [`store`], and the combinators [`map`] for a new output and [`into`] for
//! one written or accumulated into). What rounds inside the computation, as PyTorch does,
//! is here too: LayerNorm's backward (`layernorm.rs`; its forward is the native one plus
//! rounded statistics, in `ops/layernorm.rs`), the losses (`loss.rs`; MSE's arm in
//! `ops/loss.rs`), GELU on the host ([`gelu_host`], [`erf_as`]). BatchNorm's kernel is
//! `ops/batchnorm/reduced.rs`, beside its f32/f64 loops.
//!
//! | op | rounding points (one per output unless said) |
//! |---|---|
//! | `matmul`, `matmul_batched`, `causal_matmul` | the product (`=`), or `out + product` (`+=`) |
//! | `linear` | `x @ W^T + b`: one rounding (PyTorch's `addmm` / cuBLASLt bias epilogue) |
//! | `bias_add_` (and `add`, `add_` of two tensors of one dtype, in `elementwise.rs`) | the sum |
//! | `bias_grad` | `db + sum_rows(dy)` |
//! | `pointwise` (ReLU, GELU), `pointwise_backward` | the output; the input gradient |
//! | `softmax_causal`, `softmax_causal_backward_` | the probabilities; the score gradient (scale folded in) |
//! | permutes (`split_qkv`, `merge_qkv`, `split_heads`, `merge_heads`), `embedding` | none (exact copies) |
//! | `embedding_backward` | the table gradient (`grad + sum over positions`, f32 sum) |
//! | `layer_norm`, backward | `y`; the saved mean and rstd; `dx`; `dw`, `db` row by row (`layernorm.rs`) |
//! | losses | see `loss.rs` |
//! | `batch_norm`, backward | `y`; saved mean and invstd; running stats in `param_t` arithmetic; `dx`, `dw`, `db` (`ops/batchnorm/reduced.rs`) |
//!
//! The native paths themselves are untouched: an f32 call never reaches a low-precision
//! arm, so the f32 path keeps its bits.

pub(crate) mod layernorm;
pub(crate) mod loss;

use crate::backend::cpu::parallel as par;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// The low-precision dtype of the first bf16/f16 tensor of `ts`: the op then takes its
/// low-precision path and rounds its outputs to it. `None` when all are f32 (or f64, i32).
pub(crate) fn lp_of(ts: &[&Tensor]) -> Option<DType> {
    ts.iter()
        .map(|t| t.dtype())
        .find(|d| matches!(d, DType::BF16 | DType::F16))
}

/// `t` read as f32: a widening copy of a bf16/f16 tensor (exact) on its device, or `t`
/// itself when it is already f32.
///
/// # Errors
/// [`crate::Error::Cuda`] when the copy cannot be allocated.
pub(crate) fn up(t: &Tensor) -> Result<Tensor> {
    if t.dtype() == DType::F32 {
        return Ok(t.clone());
    }
    t.to_dtype(DType::F32)
}

/// A new `dtype` tensor holding the f32 values of `t` rounded to nearest even; `t` itself
/// when `dtype` is f32.
///
/// # Errors
/// [`crate::Error::Cuda`] when the tensor cannot be allocated.
pub(crate) fn down(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    t.to_dtype(dtype)
}

/// `dst = round(src)`: the f32 result `src` written into `dst` in `dst`'s dtype (nothing
/// to do when `dst` is `src`).
///
/// # Errors
/// `ShapeMismatch` when the element counts differ; [`crate::Error::Cuda`].
pub(crate) fn store(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.same_view(src) {
        return Ok(());
    }
    dst.copy_from(src)
}

/// An f32 working copy of an output: widened from `out` when the op reads it (`+=`), else
/// `out` itself when f32 or a new f32 tensor the op overwrites.
///
/// # Errors
/// [`crate::Error::Cuda`] when the copy cannot be allocated.
pub(crate) fn work_out(out: &Tensor, reads: bool) -> Result<Tensor> {
    if out.dtype() == DType::F32 {
        Ok(out.clone())
    } else if reads {
        up(out)
    } else {
        super::output(out.shape(), out.device())
    }
}

/// `down(f(up(x)), dtype)`: an op of one input and one new output (`native`, the op's f32
/// path) on the widened input, its output rounded once.
///
/// # Errors
/// As `native`; [`crate::Error::Cuda`].
pub(crate) fn map(
    x: &Tensor,
    dtype: DType,
    native: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    down(&native(&up(x)?)?, dtype)
}

/// An op that writes (`reads`: accumulates into) `out`: `native` (the op's f32 path, which
/// widens its other inputs itself, after this working copy is made) on the f32 working
/// copy of `out` ([`work_out`]), then the result rounded once into `out` ([`store`]).
///
/// # Errors
/// As `native`; [`crate::Error::Cuda`].
pub(crate) fn into(
    out: &Tensor,
    reads: bool,
    native: impl FnOnce(&Tensor) -> Result<()>,
) -> Result<()> {
    let o32 = work_out(out, reads)?;
    native(&o32)?;
    store(out, &o32)
}

/// `v` rounded to `dtype` (round to nearest even), back in f32.
#[inline]
pub(crate) fn round(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => crate::backend::cpu::bf16::round(v),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// GELU of a bf16/f16 host tensor `x` as PyTorch's vectorized CPU kernel for
/// reduced-precision floats computes it: `(x 0.5) (1 + erf(x / sqrt 2))` in f32 with its
/// Abramowitz-Stegun erf ([`erf_as`]), each output rounded once to `dtype`, so the rounded
/// outputs are PyTorch's (on CUDA, and for ReLU, exact anyway, `ops::pointwise` runs the
/// f32 kernel on the widened input instead).
///
/// # Errors
/// [`crate::Error::Cuda`] / a failed borrow of the storage.
pub(crate) fn gelu_host(x: &Tensor, dtype: DType) -> Result<Tensor> {
    let x32 = up(x)?;
    let y32 = super::output(x.shape(), x.device())?;
    {
        let (xv, mut yv) = (x32.f32()?, y32.f32_mut()?);
        // Elementwise: any split gives the same bits.
        par::chunks_mut(&mut yv, par::HEAVY_GRAIN, |r, y| {
            for (o, &v) in y.iter_mut().zip(&xv[r]) {
                *o = v * 0.5 * (1.0 + erf_as(v * std::f32::consts::FRAC_1_SQRT_2));
            }
            Ok(())
        })?;
    }
    down(&y32, dtype)
}

/// `erf(z)` as PyTorch's CPU `Vectorized<float>::erf` computes it (Abramowitz and Stegun
/// 7.1.26: `t = 1 / (1 + p |z|)`, a degree-5 polynomial in `t` by Horner's rule,
/// `sign(z) (1 - t poly exp(-z^2))`), in plain f32 multiplies and adds: absolute error
/// below 1.5e-7, well under a bf16/f16 ulp of GELU's output except where it rounds near a
/// tie.
pub(crate) fn erf_as(z: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A1: f32 = 0.254_829_6;
    const A2: f32 = -0.284_496_74;
    const A3: f32 = 1.421_413_8;
    const A4: f32 = -1.453_152;
    const A5: f32 = 1.061_405_4;
    let a = z.abs();
    let t = 1.0 / (P * a + 1.0);
    let mut r = A5 * t + A4;
    r = r * t + A3;
    r = r * t + A2;
    r = r * t + A1;
    let e = -(-(a * a)).exp();
    let v = (t * e) * r + 1.0;
    v.copysign(z)
}
