//! Losses as functions returning `(loss, d loss / d input)`: the start of every backward.
//! They run on the input's device ([`crate::ops::loss`]); the loss is a host `f32`, the
//! gradient a tensor on the input's device.

use crate::error::Result;
use crate::tensor::Tensor;

/// Mean cross-entropy of `logits (.., V)` f32 against i32 `targets (..)` with the same
/// leading shape (`F.cross_entropy(logits.view(-1, V), targets.view(-1))`, mean reduction),
/// both on one device. Returns the loss and `d loss / d logits = (softmax - onehot) / N`,
/// shape of `logits`. On CUDA this waits for the device (to check the targets and read the
/// loss).
///
/// # Errors
/// `ShapeMismatch` when the leading shapes differ; `InvalidArgument` for a target outside
/// `0..V`; `DeviceMismatch`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<(f32, Tensor)> {
    crate::ops::cross_entropy(logits, targets)
}

/// [`cross_entropy`] with the loss as a one-element f32 tensor on the inputs' device:
/// on CUDA nothing waits for the device (a bad target is reported by the next read to the
/// host), so a training loop can read its losses only on the steps it logs.
///
/// # Errors
/// As [`cross_entropy`].
pub fn cross_entropy_tensor(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    crate::ops::cross_entropy_tensor(logits, targets)
}

/// [`cross_entropy_tensor`] whose gradient is that of `grad_output * loss`: how a loss
/// scale ([`ShardedGradScaler`](crate::fsdp::ShardedGradScaler)) enters backward, before
/// a low-precision gradient is rounded ([`crate::ops::cross_entropy_tensor_scaled`] says
/// exactly where). `grad_output = 1` is [`cross_entropy_tensor`].
///
/// # Errors
/// As [`cross_entropy`].
pub fn cross_entropy_tensor_scaled(
    logits: &Tensor,
    targets: &Tensor,
    grad_output: f32,
) -> Result<(Tensor, Tensor)> {
    crate::ops::cross_entropy_tensor_scaled(logits, targets, grad_output)
}

/// Mean squared error `mean((pred - target)^2)` (`F.mse_loss`), and its gradient
/// `2 (pred - target) / N`.
///
/// # Errors
/// `ShapeMismatch` when the element counts differ; `DeviceMismatch`; `DTypeMismatch`.
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<(f32, Tensor)> {
    crate::ops::mse_loss(pred, target)
}

/// [`mse_loss`] whose gradient is that of `grad_output * loss`, multiplied before a
/// low-precision gradient is rounded ([`crate::ops::mse_loss_scaled`]): a loss scale
/// enters backward here. `grad_output = 1` is [`mse_loss`].
///
/// # Errors
/// As [`mse_loss`].
pub fn mse_loss_scaled(pred: &Tensor, target: &Tensor, grad_output: f32) -> Result<(f32, Tensor)> {
    crate::ops::mse_loss_scaled(pred, target, grad_output)
}

/// `sum(x)` (the loss of the FSDP docs' `model(input).sum()` example) and its gradient, ones.
///
/// # Errors
/// `DTypeMismatch` for a non-f32 tensor; `NotMaterialized` on meta.
pub fn sum_loss(x: &Tensor) -> Result<(f32, Tensor)> {
    crate::ops::sum_loss(x)
}
