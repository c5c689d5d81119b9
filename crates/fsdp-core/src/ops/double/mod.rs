//! The f64 host paths of the ops the nn layers use (PyTorch computes float64 tensors in
//! float64): here matrix products, `linear`, the bias row ops, ReLU and GELU, the MSE and
//! sum losses; in `nn.rs` LayerNorm, the causal softmax and attention's permutes,
//! embedding, cross-entropy and the sum of squares. f64 accumulation throughout: the
//! products through the `gemm` crate's f64 kernels (as f32 products run, fused
//! multiply-adds in `k` order per element), the rest plain loops in the natural order,
//! split over the thread budget by rows or columns as the f32 ops are ([Note: determinism
//! across thread counts] in `backend::cpu::parallel`).
//! f64 tensors on a CUDA device take the `_f64` kernels instead (the dispatching ops check
//! the device first; products run through cuBLAS in f64); these loops refuse them
//! ([`Error::Unsupported`] naming the op); `ops::mse_loss` and `ops::sum_loss` run theirs on host
//! copies of CUDA tensors.
//!
//! The dispatching ops call in here; nothing here calls an op back: the shared types come
//! from `ops/types.rs`, the products from [`crate::backend::cpu::gemm`] (the batched loop
//! the f32 host products run too).

mod nn;
#[doc(hidden)] // crate-internal, public only for the layers above
pub use nn::widen;
pub(crate) use nn::*;

use super::types::{MatmulDims, Pointwise};
use crate::backend::cpu::gemm::{self, Transpose};
use crate::backend::cpu::parallel as par;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Whether any of `ts` is f64: the op takes the f64 path (which checks the rest).
pub(crate) fn any_f64(ts: &[&Tensor]) -> bool {
    ts.iter().any(|t| t.dtype() == DType::F64)
}

/// Every tensor is an f64 host tensor.
///
/// # Errors
/// `DTypeMismatch` naming `op` for another dtype; `Unsupported` naming `op` for a CUDA
/// tensor.
pub(crate) fn check(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    for t in ts {
        if t.dtype() != DType::F64 {
            return Err(Error::DTypeMismatch {
                op,
                expected: DType::F64,
                got: t.dtype(),
            });
        }
        if t.device().is_cuda() {
            return Err(Error::Unsupported(format!(
                "{op} on f64 CUDA tensors (f64 computes on the host)"
            )));
        }
    }
    Ok(())
}

/// `out (m, n) (=|+=) op(a) @ op(b)`, `batch` independent products, f64 accumulation
/// through the `gemm` crate's f64 kernels, on the calling thread's budget as f32 products
/// (the same per-element sum whatever the thread count). Shapes were checked by the caller
/// ([`super::matmul_batched`]).
pub(crate) fn matmul_batched(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    d: MatmulDims,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    check("matmul", &[out, a, b])?;
    let (av, bv) = (a.data::<f64>()?, b.data::<f64>()?);
    let mut o = out.data_mut::<f64>()?;
    let MatmulDims { m, k, n, trans } = d;
    gemm::matmul_batched(&mut o, &av, &bv, [m, k, n], trans, batch, accumulate)
}

/// `y (.., o) = x (.., i) @ W^T + b` in f64 (`F.linear`); shapes checked by the caller.
pub(crate) fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, o: usize) -> Result<Tensor> {
    let mut ts = vec![x, w];
    ts.extend(bias);
    check("linear", &ts)?;
    let i = w.numel().checked_div(o).unwrap_or(0);
    let rows: usize = x.shape()[..x.shape().len() - 1].iter().product();
    let mut shape = x.shape().to_vec();
    if let Some(l) = shape.last_mut() {
        *l = o;
    }
    let y = Tensor::zeros(&shape, DType::F64);
    if let Some(b) = bias {
        let bv = b.data::<f64>()?;
        for row in y.data_mut::<f64>()?.chunks_exact_mut(o.max(1)) {
            row.copy_from_slice(&bv);
        }
    }
    matmul_batched(
        &y,
        x,
        w,
        MatmulDims::new(rows, i, o, Transpose::NT),
        1,
        true,
    )?;
    Ok(y)
}

/// `y[r, :] += b` for every row (f64).
pub(crate) fn bias_add_(y: &Tensor, b: &Tensor) -> Result<()> {
    check("bias_add_", &[y, b])?;
    let bv = b.data::<f64>()?;
    for row in y.data_mut::<f64>()?.chunks_exact_mut(bv.len().max(1)) {
        row.iter_mut().zip(bv.iter()).for_each(|(a, b)| *a += b);
    }
    Ok(())
}

/// `db += sum over rows of dy` (f64).
pub(crate) fn bias_grad(dy: &Tensor, db: &Tensor) -> Result<()> {
    check("bias_grad", &[dy, db])?;
    let dyv = dy.data::<f64>()?;
    let mut g = db.data_mut::<f64>()?;
    let c = g.len().max(1);
    for row in dyv.chunks_exact(c) {
        g.iter_mut().zip(row).for_each(|(a, b)| *a += b);
    }
    Ok(())
}

/// `f(x)`: ReLU, or exact GELU `x Phi(x)` with erf from `libm` in f64.
fn act(f: Pointwise, x: f64) -> f64 {
    match f {
        Pointwise::Relu if x > 0.0 => x,
        Pointwise::Relu => 0.0,
        Pointwise::Gelu => x * cdf(x),
    }
}

/// `Phi(x) = (1 + erf(x / sqrt 2)) / 2` in f64.
fn cdf(x: f64) -> f64 {
    0.5 * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))
}

/// `f'(x)`: ReLU's derivative is 0 at 0 (PyTorch's `threshold_backward`); exact GELU's is
/// `Phi(x) + x phi(x)` (as `GeluBackward` with `approximate='none'`).
fn act_grad(f: Pointwise, x: f64) -> f64 {
    match f {
        Pointwise::Relu if x > 0.0 => 1.0,
        Pointwise::Relu => 0.0,
        Pointwise::Gelu => {
            // 1 / sqrt(2 pi)
            let k = std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2 * 0.5;
            let pdf = (-0.5 * x * x).exp() * k;
            cdf(x) + x * pdf
        }
    }
}

/// A new f64 host tensor of `shape` whose every element the caller writes (pooled).
pub(crate) fn scratch(shape: &[usize]) -> Tensor {
    Tensor::scratch(shape, DType::F64)
}

/// `y = f(x)` elementwise (f64), split over the thread budget (any split: same bits).
pub(crate) fn pointwise(f: Pointwise, x: &Tensor) -> Result<Tensor> {
    check(f.name(), &[x])?;
    let y = scratch(x.shape());
    {
        let (xv, mut yv) = (x.data::<f64>()?, y.data_mut::<f64>()?);
        par::chunks_mut(&mut yv, par::HEAVY_GRAIN, |r, out| {
            out.iter_mut()
                .zip(&xv[r])
                .for_each(|(o, &v)| *o = act(f, v));
            Ok(())
        })?;
    }
    Ok(y)
}

/// `dx = dy * f'(x)` elementwise (f64), split as [`pointwise`].
pub(crate) fn pointwise_backward(f: Pointwise, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    check(f.name(), &[x, dy])?;
    let dx = scratch(x.shape());
    {
        let (xv, gv, mut dv) = (x.data::<f64>()?, dy.data::<f64>()?, dx.data_mut::<f64>()?);
        par::chunks_mut(&mut dv, par::HEAVY_GRAIN, |r, out| {
            out.iter_mut()
                .zip(&xv[r.clone()])
                .zip(&gv[r])
                .for_each(|((o, &x), &g)| *o = g * act_grad(f, x));
            Ok(())
        })?;
    }
    Ok(dx)
}

/// `mean((pred - target)^2)` and its gradient `2 (pred - target) / N` (f64; the loss
/// returned as the f32 the API gives, the gradient exact).
pub(crate) fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<(f32, Tensor)> {
    check("mse_loss", &[pred, target])?;
    let (p, t) = (pred.data::<f64>()?, target.data::<f64>()?);
    let n = p.len() as f64;
    let loss = p
        .iter()
        .zip(t.iter())
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        / n;
    let grad: Vec<f64> = p
        .iter()
        .zip(t.iter())
        .map(|(a, b)| 2.0 * (a - b) / n)
        .collect();
    Ok((loss as f32, Tensor::from_vec(grad, pred.shape())?))
}

/// `sum(x)` and its gradient, ones (f64).
pub(crate) fn sum_loss(x: &Tensor) -> Result<(f32, Tensor)> {
    check("sum_loss", &[x])?;
    let s = x.data::<f64>()?.iter().fold(0.0f64, |s, &v| s + v);
    Ok((
        s as f32,
        Tensor::from_vec(vec![1.0f64; x.numel()], x.shape())?,
    ))
}
