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

use super::{down, round, up};
use crate::backend::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

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
    let x32 = up(&logits.to_device(Device::Cpu)?)?;
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
    let grad32 = super::super::output(logits.shape(), Device::Cpu)?;
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
    let grad = down(&grad32, dtype)?;
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
    let s = super::super::stream(ordinal)?;
    let n = targets.numel();
    let dev = logits.device();
    let w = row_weight(n, grad_output, dtype);
    let losses = super::super::output(&[n], dev)?;
    let grad = Tensor::zeros_on(logits.shape(), dtype, dev)?;
    cuda::cross_entropy_lp(
        &s,
        &logits.as_device_tensor()?,
        &targets.as_device_tensor()?,
        w,
        &losses.as_device_tensor()?,
        &grad.as_device_tensor()?,
    )?;
    let loss = super::super::output(&[1], dev)?;
    cuda::mean_rows(&s, &losses.as_device_tensor()?, &loss.as_device_tensor()?)?;
    // Rounded in place: two casts on the stream, through a `dtype` temporary.
    loss.copy_from(&down(&loss, dtype)?)?;
    Ok((loss, grad))
}

/// `sum(x)` of a bf16/f16 tensor: f32 accumulation (of f64 steps, as the f32 loss), rounded
/// to `dtype` (`ops::sum_loss` gives the gradient, ones of `dtype`).
pub(crate) fn sum(x: &Tensor, dtype: DType) -> Result<f32> {
    let s = x
        .to_vec_f32()?
        .iter()
        .fold(0.0f64, |s, &v| s + f64::from(v));
    Ok(round(s as f32, dtype))
}
