//! Losses as functions returning `(loss, d loss / d input)`: the start of every backward.

use crate::backend::cpu::ops::exp;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Mean cross-entropy of `logits (.., V)` f32 against i32 `targets (..)` with the same
/// leading shape (`F.cross_entropy(logits.view(-1, V), targets.view(-1))`, mean reduction).
/// Returns the loss and `d loss / d logits = (softmax - onehot) / N`, shape of `logits`.
///
/// # Errors
/// `ShapeMismatch` when the leading shapes differ; `InvalidArgument` for a target outside
/// `0..V`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<(f32, Tensor)> {
    let v = logits.shape().last().copied().unwrap_or(0);
    let n = targets.numel();
    if targets.dtype() != DType::I32 || n * v != logits.numel() || v == 0 {
        return Err(Error::ShapeMismatch {
            op: "cross_entropy",
            expected: logits.shape()[..logits.shape().len().saturating_sub(1)].to_vec(),
            got: targets.shape().to_vec(),
        });
    }
    let lv = logits.f32()?;
    let tv = targets.data::<i32>()?;
    let mut grad = vec![0.0f32; lv.len()];
    let mut total = 0.0f64;
    let inv_n = 1.0 / n.max(1) as f32;
    for (i, (row, g)) in lv.chunks_exact(v).zip(grad.chunks_exact_mut(v)).enumerate() {
        let y = tv[i];
        if y < 0 || y as usize >= v {
            crate::error::bail_arg!("cross_entropy: target {y} at position {i} is outside 0..{v}");
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0.0f32;
        for (gj, &x) in g.iter_mut().zip(row) {
            *gj = exp(x - max);
            sum += *gj;
        }
        total += (sum.ln() + max - row[y as usize]) as f64;
        let inv = inv_n / sum;
        g.iter_mut().for_each(|gj| *gj *= inv);
        g[y as usize] -= inv_n;
    }
    Ok((
        (total / n.max(1) as f64) as f32,
        Tensor::from_vec(grad, logits.shape())?,
    ))
}

/// Mean squared error `mean((pred - target)^2)` (`F.mse_loss`), and its gradient
/// `2 (pred - target) / N`.
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<(f32, Tensor)> {
    if pred.numel() != target.numel() {
        return Err(Error::ShapeMismatch {
            op: "mse_loss",
            expected: pred.shape().to_vec(),
            got: target.shape().to_vec(),
        });
    }
    let (p, t) = (pred.f32()?, target.f32()?);
    let n = p.len().max(1) as f32;
    let loss = p
        .iter()
        .zip(t.iter())
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        / n as f64;
    let grad = p
        .iter()
        .zip(t.iter())
        .map(|(a, b)| 2.0 * (a - b) / n)
        .collect();
    Ok((loss as f32, Tensor::from_vec(grad, pred.shape())?))
}

/// `sum(x)` (the loss of the FSDP docs' `model(input).sum()` example) and its gradient, ones.
pub fn sum_loss(x: &Tensor) -> Result<(f32, Tensor)> {
    let s = x.f32()?.iter().map(|&v| v as f64).sum::<f64>();
    Ok((
        s as f32,
        Tensor::from_vec(vec![1.0f32; x.numel()], x.shape())?,
    ))
}
