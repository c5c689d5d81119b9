//! The bf16/f16 paths of the nn ops: what a `param_dtype` module computes under
//! `fsdp::fsdp::MixedPrecision` (its parameters, activations and activation gradients are
//! bf16 or f16 tensors, as in PyTorch FSDP, where the unsharded parameters are
//! `param_dtype` tensors and every op of the module then runs in that dtype).
//!
//! Each op that receives a bf16/f16 tensor does what PyTorch's CPU and CUDA kernels do for
//! reduced-precision floats: it reads its inputs as f32 (a widening copy: pool buffers on
//! the CPU, the `cast` kernels on CUDA), computes in f32 with f32 accumulation (the f32
//! op of this crate, unchanged), and rounds each output once into a tensor of the input's
//! dtype (round to nearest even). An output that is accumulated into (`+=`, a parameter's
//! gradient view) is widened, added to in f32 and rounded once.
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
//! | `batch_norm`, backward | `y`; saved mean and invstd; running stats in `param_t` arithmetic; `dx`, `dw`, `db` (`batchnorm.rs`) |
//!
//! The f32 ops themselves are untouched: an f32 call never reaches this module, so the f32
//! path keeps its bits.

pub(crate) mod batchnorm;
pub(crate) mod layernorm;
pub(crate) mod loss;

use super::attention::HeadDims;
use super::causal::CausalProduct;
use super::linalg::MatmulDims;
use super::Pointwise;
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
fn work_out(out: &Tensor, reads: bool) -> Result<Tensor> {
    if out.dtype() == DType::F32 {
        Ok(out.clone())
    } else if reads {
        up(out)
    } else {
        super::output(out.shape(), out.device())
    }
}

/// [`super::matmul_batched`] with a bf16/f16 operand or output: f32 products of the
/// widened operands, rounded once into `out`.
pub(crate) fn matmul_batched(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    d: MatmulDims,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let (a32, b32) = (up(a)?, up(b)?);
    let o32 = work_out(out, accumulate)?;
    {
        // The operands already hold their low-precision values: no second rounding.
        let _f32 = super::autocast(None);
        super::matmul_batched(&o32, &a32, &b32, d, batch, accumulate)?;
    }
    store(out, &o32)
}

/// [`super::causal_matmul`] with a bf16/f16 tensor.
pub(crate) fn causal_matmul(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    which: CausalProduct,
    d: HeadDims,
) -> Result<()> {
    let (a32, b32) = (up(a)?, up(b)?);
    let o32 = work_out(out, false)?;
    {
        let _f32 = super::autocast(None);
        super::causal_matmul(&o32, &a32, &b32, which, d)?;
    }
    store(out, &o32)
}

/// [`super::linear`] in `dtype`: `x @ W^T + b` in f32, one rounding.
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    dtype: DType,
) -> Result<Tensor> {
    let (x32, w32) = (up(x)?, up(weight)?);
    let b32 = bias.map(up).transpose()?;
    let y = {
        let _f32 = super::autocast(None);
        super::linear(&x32, &w32, b32.as_ref())?
    };
    down(&y, dtype)
}

/// [`super::bias_add_`] with a bf16/f16 tensor: `y = round(y + b)`.
pub(crate) fn bias_add_(y: &Tensor, b: &Tensor) -> Result<()> {
    let (y32, b32) = (work_out(y, true)?, up(b)?);
    super::bias_add_(&y32, &b32)?;
    store(y, &y32)
}

/// [`super::bias_grad`] with a bf16/f16 tensor: `db = round(db + sum_rows(dy))`.
pub(crate) fn bias_grad(dy: &Tensor, db: &Tensor) -> Result<()> {
    let (dy32, db32) = (up(dy)?, work_out(db, true)?);
    super::bias_grad(&dy32, &db32)?;
    store(db, &db32)
}

/// `dst = round(dst + src)` for tensors of different dtypes (an f32 gradient of a
/// low-precision computation): the sum in f32, rounded to `dst`'s dtype.
pub(crate) fn add_(dst: &Tensor, src: &Tensor) -> Result<()> {
    let (d32, s32) = (work_out(dst, true)?, up(src)?);
    super::add_(&d32, &s32)?;
    store(dst, &d32)
}

/// [`super::scale_`] of a bf16/f16 tensor: `t = round(t * alpha)`.
pub(crate) fn scale_(t: &Tensor, alpha: f32) -> Result<()> {
    let t32 = up(t)?;
    super::scale_(&t32, alpha)?;
    store(t, &t32)
}

/// [`super::pointwise`] in `dtype`. GELU on the CPU is PyTorch's vectorized CPU kernel for
/// reduced-precision floats, `(x 0.5) (1 + erf(x / sqrt 2))` in f32 with its
/// Abramowitz-Stegun erf ([`erf_as`]), so the rounded outputs are PyTorch's; on CUDA (and
/// for ReLU, exact anyway) the f32 kernel.
pub(crate) fn pointwise(f: Pointwise, x: &Tensor, dtype: DType) -> Result<Tensor> {
    if f == Pointwise::Gelu && x.device() == crate::backend::Device::Cpu {
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
        return down(&y32, dtype);
    }
    down(&super::pointwise(f, &up(x)?)?, dtype)
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

/// [`super::pointwise_backward`] in `dtype`: the input gradient from the widened input and
/// output gradient, one rounding.
pub(crate) fn pointwise_backward(
    f: Pointwise,
    x: &Tensor,
    dy: &Tensor,
    dtype: DType,
) -> Result<Tensor> {
    down(&super::pointwise_backward(f, &up(x)?, &up(dy)?)?, dtype)
}

/// [`super::softmax_causal`] in `dtype`.
pub(crate) fn softmax_causal(s: &Tensor, t: usize, scale: f32, dtype: DType) -> Result<Tensor> {
    down(&super::softmax_causal(&up(s)?, t, scale)?, dtype)
}

/// [`super::softmax_causal_backward_`] with a bf16/f16 tensor: `dp` becomes the rounded
/// score gradient.
pub(crate) fn softmax_causal_backward_(
    p: &Tensor,
    dp: &Tensor,
    t: usize,
    scale: f32,
) -> Result<()> {
    let (p32, dp32) = (up(p)?, work_out(dp, true)?);
    super::softmax_causal_backward_(&p32, &dp32, t, scale)?;
    store(dp, &dp32)
}

/// An exact permute (`split_heads`, `merge_heads`) of a bf16/f16 tensor through f32.
pub(crate) fn permute(
    x: &Tensor,
    d: HeadDims,
    dtype: DType,
    f: fn(&Tensor, HeadDims) -> Result<Tensor>,
) -> Result<Tensor> {
    down(&f(&up(x)?, d)?, dtype)
}

/// [`super::split_qkv`] of a bf16/f16 tensor (exact).
pub(crate) fn split_qkv(qkv: &Tensor, d: HeadDims, dtype: DType) -> Result<[Tensor; 3]> {
    let [q, k, v] = super::split_qkv(&up(qkv)?, d)?;
    Ok([down(&q, dtype)?, down(&k, dtype)?, down(&v, dtype)?])
}

/// [`super::merge_qkv`] of bf16/f16 tensors (exact).
pub(crate) fn merge_qkv(
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    d: HeadDims,
    dtype: DType,
) -> Result<Tensor> {
    down(&super::merge_qkv(&up(dq)?, &up(dk)?, &up(dv)?, d)?, dtype)
}

/// [`super::embedding()`] of a bf16/f16 table: its rows, exactly, in its dtype.
pub(crate) fn embedding(table: &Tensor, ids: &Tensor, dtype: DType) -> Result<Tensor> {
    down(&super::embedding(&up(table)?, ids)?, dtype)
}

/// [`super::embedding_backward`] with a bf16/f16 tensor: `grad = round(grad + scatter-add
/// of dout)`, the scatter summed in f32.
pub(crate) fn embedding_backward(ids: &Tensor, dout: &Tensor, grad: &Tensor) -> Result<()> {
    let (d32, g32) = (up(dout)?, work_out(grad, true)?);
    super::embedding_backward(ids, &d32, &g32)?;
    store(grad, &g32)
}
