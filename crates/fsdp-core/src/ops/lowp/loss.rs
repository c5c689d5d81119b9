//! The losses of a bf16/f16 input, as PyTorch computes them for a reduced-precision tensor
//! (the loss is then a tensor of that dtype, and so is the gradient). Host loops: the
//! values come to the host (where the loss is read anyway) and the gradient goes back to
//! the input's device.
//!
//! | loss | rounding points |
//! |---|---|
//! | cross-entropy | `log_softmax` output (`ls = round(x - lse)`), the loss (f32 mean of `-ls[y]`, rounded); gradient: `w = round(1 / N)`, `dx = round(exp(ls) w - [j = y] w)` (`nll_loss_backward`, then `_log_softmax_backward_data` in f32) |
//! | MSE | the loss: f32 mean of `(p - t)^2` (rounded when the target is low precision too); gradient `round(2 (p - t) / N)` |
//! | sum | the loss (f32 sum, rounded); gradient ones (exact) |

use crate::backend::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// `v` rounded to `dtype` (round to nearest even), back in f32.
#[inline]
pub(crate) fn round(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => crate::backend::cpu::bf16::round(v),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// `w`, the weight of each row's gradient: `nll_loss_backward`'s `grad_output / total_weight`
/// in `dtype` (`grad_output` rounded to `dtype` first, as the gradient of a `dtype` loss;
/// `N` the total weight of `n` rows), rounded.
fn row_weight(n: usize, grad_output: f32, dtype: DType) -> f32 {
    round(round(grad_output, dtype) / round(n as f32, dtype), dtype)
}

/// Mean cross-entropy of bf16/f16 `logits (n, v)` against `targets (n)`; `n, v > 0`. The
/// gradient is that of `grad_output * loss` (see [`row_weight`]).
pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    v: usize,
    dtype: DType,
    grad_output: f32,
) -> Result<(f32, Tensor)> {
    let x32 = super::up(&logits.to_device(Device::Cpu)?)?;
    let x = x32.f32()?;
    let ys = targets.to_device(Device::Cpu)?;
    let ys = ys.data::<i32>()?;
    let n = ys.len();
    if let Some(i) = ys.iter().position(|&y| y < 0 || y as usize >= v) {
        let y = ys[i];
        crate::error::bail_arg!("cross_entropy: target {y} at position {i} is outside 0..{v}");
    }
    // nll_loss_backward: grad_output / total_weight (N as a `dtype` value), rounded.
    let w = row_weight(n, grad_output, dtype);
    let grad32 = crate::ops::output(logits.shape(), Device::Cpu)?;
    let mut grad = grad32.f32_mut()?;
    let mut total = 0.0f64;
    for (r, &y) in ys.iter().enumerate() {
        let row = &x[r * v..(r + 1) * v];
        let m = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
        let s: f32 = row.iter().map(|&a| (a - m).exp()).sum();
        let lse = m + s.ln();
        let g = &mut grad[r * v..(r + 1) * v];
        for (j, (&a, o)) in row.iter().zip(g.iter_mut()).enumerate() {
            let ls = round(a - lse, dtype);
            if j == y as usize {
                total -= f64::from(ls);
            }
            let onehot = if j == y as usize { w } else { 0.0 };
            *o = round(ls.exp() * w - onehot, dtype);
        }
    }
    let loss = round((total / n as f64) as f32, dtype);
    drop(grad);
    let grad = super::down(&grad32, dtype)?;
    Ok((loss, grad.to_device(logits.device())?))
}

/// [`cross_entropy`] on `cuda:ordinal` (`cross_entropy_lp_{dtype}`, then the f64 mean of
/// the row losses in row order and its rounding to `dtype`, all on the device): the loss as
/// a one-element f32 tensor there, and the gradient.
pub(crate) fn cross_entropy_cuda(
    ordinal: usize,
    logits: &Tensor,
    targets: &Tensor,
    dtype: DType,
    grad_output: f32,
) -> Result<(Tensor, Tensor)> {
    use crate::backend::cuda;
    let s = crate::ops::stream(ordinal)?;
    let n = targets.numel();
    let dev = logits.device();
    let w = row_weight(n, grad_output, dtype);
    let losses = crate::ops::output(&[n], dev)?;
    let grad = Tensor::zeros_on(logits.shape(), dtype, dev)?;
    cuda::cross_entropy_lp(
        &s,
        &logits.as_device_tensor()?,
        &targets.as_device_tensor()?,
        w,
        &losses.as_device_tensor()?,
        &grad.as_device_tensor()?,
    )?;
    let loss = crate::ops::output(&[1], dev)?;
    cuda::mean_rows(&s, &losses.as_device_tensor()?, &loss.as_device_tensor()?)?;
    crate::ops::flat::round_to_(&loss, dtype)?;
    Ok((loss, grad))
}

/// `mean((p - t)^2)` with a bf16/f16 prediction, non-empty: the loss and the gradient
/// `2 (p - t) / N` computed in f32 from the widened values (the f32 op of
/// [`crate::ops::mse_loss`]), the gradient rounded once to `dtype` (what the backward of
/// PyTorch's `F.mse_loss(out.float(), t)` gives a low-precision `out`; with a target of the
/// prediction's dtype too, the loss is rounded as well, as `F.mse_loss(out, t_lp)`). The
/// gradient is that of `grad_output * loss`, multiplied in f32 before the rounding.
pub(crate) fn mse_loss(
    pred: &Tensor,
    target: &Tensor,
    dtype: DType,
    grad_output: f32,
) -> Result<(f32, Tensor)> {
    let (loss, grad) =
        crate::ops::mse_loss_scaled(&super::up(pred)?, &super::up(target)?, grad_output)?;
    let loss = if target.dtype() == dtype {
        round(loss, dtype)
    } else {
        loss
    };
    Ok((loss, super::down(&grad, dtype)?))
}

/// `sum(x)` of a bf16/f16 tensor (f32 accumulation, rounded) and its gradient, ones.
pub(crate) fn sum_loss(x: &Tensor, dtype: DType) -> Result<(f32, Tensor)> {
    let s = x
        .to_vec_f32()?
        .iter()
        .fold(0.0f64, |s, &v| s + f64::from(v));
    let ones = Tensor::zeros_on(x.shape(), dtype, x.device())?;
    crate::ops::fill_(&ones, 1.0)?;
    Ok((round(s as f32, dtype), ones))
}
