//! Losses on any device, as `(loss, d loss / d input)`: the loss is a host `f32` (so each
//! waits for the device once), the gradient a new tensor on the input's device.
//!
//! | op | CPU | CUDA |
//! |---|---|---|
//! | [`cross_entropy`] | one pass per row | `cross_entropy_f32` (row losses + gradient), `mean_rows_f32` (f64, row order); f64 logits: `cross_entropy_f64`, `mean_rows_f64` |
//! | [`mse_loss`] | one pass | `p - t` with `add_`/`scale_`, `sum_squares` |
//! | [`sum_loss`] | one pass | the values summed on the host, `fill_` for the gradient |

use super::{lowp, same_device};
use crate::backend::cpu::fast;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Mean cross-entropy of `logits (.., V)` f32 against i32 `targets (..)` with the same
/// leading shape (`F.cross_entropy(logits.view(-1, V), targets.view(-1))`, mean reduction).
/// Returns the loss and `d loss / d logits = (softmax - onehot) / N`, shape of `logits`.
///
/// An empty batch (`N = 0`, any `V`) gives a NaN loss, as PyTorch's mean over no elements
/// does, and an empty gradient of `logits`' shape. With `V = 0` classes and `N > 0` rows
/// every target is out of range: an error.
///
/// # Errors
/// `ShapeMismatch` when the leading shapes' sizes differ (or `logits` is 0-d);
/// `InvalidArgument` for a target outside `0..V`; `DeviceMismatch` when the two are on
/// different devices.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<(f32, Tensor)> {
    match cross_entropy_any(logits, targets, 1.0)? {
        (Loss::Host(l), grad) => Ok((l, grad)),
        (Loss::Device(t, _), grad) => Ok((t.to_vec_f32()?[0], grad)),
    }
}

/// [`cross_entropy`] of f64 `logits (.., V)` with the loss as the f64 it is computed in
/// (the f32 op rounds it): the exact reference a float64 run is checked against. The
/// gradient is the same tensor [`cross_entropy`] returns.
///
/// # Errors
/// As [`cross_entropy`]; `DTypeMismatch` unless `logits` is f64.
pub fn cross_entropy_f64(logits: &Tensor, targets: &Tensor) -> Result<(f64, Tensor)> {
    if logits.device().is_cuda() {
        super::compute_dtype("cross_entropy_f64", &[logits], logits.device())?;
        return match cross_entropy_any(logits, targets, 1.0)? {
            (Loss::Device(_, Some(mean)), grad) => Ok((mean.to_vec_f64()?[0], grad)),
            // An empty batch (NaN) or no classes (an error before this).
            (_, grad) => Ok((f64::NAN, grad)),
        };
    }
    super::double::check("cross_entropy_f64", &[logits])?;
    let (_, grad) = cross_entropy_any(logits, targets, 1.0)?;
    if targets.numel() == 0 {
        return Ok((f64::NAN, grad));
    }
    let v = logits.shape().last().copied().unwrap_or(0);
    let (loss, _) = super::double::cross_entropy(logits, &targets.data::<i32>()?, v)?;
    Ok((loss, grad))
}

/// Where [`cross_entropy_any`] left the loss: a host value (no tensor buffer, so a CPU
/// step allocates nothing for it), or one f32 on the device.
enum Loss {
    Host(f32),
    /// The f32 loss, and for f64 logits the f64 mean it rounds.
    Device(Tensor, Option<Tensor>),
}

/// [`cross_entropy`] with the loss as a one-element f32 tensor on the inputs' device, so
/// that on CUDA nothing waits for the device (`mean_rows_f32`: the same f64 sum in row
/// order as the host's, so the same bits); a bad target is then reported by the next host
/// read (see `backend::cuda` index checks).
///
/// # Errors
/// As [`cross_entropy`].
pub fn cross_entropy_tensor(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    cross_entropy_tensor_scaled(logits, targets, 1.0)
}

/// [`cross_entropy_tensor`] whose gradient is that of `grad_output * loss`: the loss is
/// the same, the gradient `grad_output (softmax - onehot) / N`, with `grad_output` entering
/// where PyTorch's backward takes it (`nll_loss_backward`'s `grad_output`), before the
/// gradient is rounded: f32 logits `grad_output / N` in f32; bf16/f16 logits
/// `round(round(grad_output) / round(N))` in the logits' dtype (the loss is a tensor of that
/// dtype in PyTorch, and so is its gradient: a `grad_output` beyond the dtype's range, 2^16
/// in f16, is infinite there); f64 logits the f64 gradient times `grad_output`. This is how
/// a loss scale (`fsdp::fsdp::ShardedGradScaler`) reaches backward here: `scaler.scale(loss)
/// .backward()` in PyTorch is this gradient with `grad_output` the scale (exact for the
/// power-of-two scales a grad scaler uses, where multiplying the rounded gradient afterwards
/// would lose what `1 / N` rounded away in f16). `grad_output = 1` is
/// [`cross_entropy_tensor`], bit for bit.
///
/// # Errors
/// As [`cross_entropy`].
pub fn cross_entropy_tensor_scaled(
    logits: &Tensor,
    targets: &Tensor,
    grad_output: f32,
) -> Result<(Tensor, Tensor)> {
    match cross_entropy_any(logits, targets, grad_output)? {
        (Loss::Host(l), grad) => {
            let device = grad.device();
            Ok((Tensor::from_vec(vec![l], &[1])?.to_device(device)?, grad))
        }
        (Loss::Device(t, _), grad) => Ok((t, grad)),
    }
}

/// The cross-entropy of every public variant; the gradient is that of `g * loss`.
fn cross_entropy_any(logits: &Tensor, targets: &Tensor, g: f32) -> Result<(Loss, Tensor)> {
    let (v, lead) = match logits.shape().split_last() {
        Some((&v, lead)) => (v, lead),
        None => (0, &[][..]),
    };
    let n = targets.numel();
    if targets.dtype() != DType::I32
        || logits.shape().is_empty()
        || lead.iter().product::<usize>() != n
    {
        return Err(Error::ShapeMismatch {
            op: "cross_entropy",
            expected: lead.to_vec(),
            got: targets.shape().to_vec(),
        });
    }
    let device = same_device("cross_entropy", &[logits, targets])?;
    let lp = lowp::lp_of(&[logits]);
    let f64_path = super::double::any_f64(&[logits]);
    if lp.is_none() && !f64_path {
        super::check_f32("cross_entropy", &[logits])?;
    }
    if let (crate::backend::Device::Cuda(i), true, false) = (device, f64_path, n == 0 || v == 0) {
        let (loss, grad, mean) = cross_entropy_cuda(i, logits, targets, g)?;
        return Ok((Loss::Device(loss, Some(mean)), grad));
    }
    if n == 0 {
        // PyTorch: the mean over an empty batch is 0/0 = NaN; nothing to differentiate.
        let grad = match f64_path {
            true => Tensor::zeros_on(logits.shape(), DType::F64, device)?,
            false => super::output(logits.shape(), device)?,
        };
        return Ok((Loss::Host(f32::NAN), grad));
    }
    if v == 0 {
        let y = targets
            .to_device(crate::backend::Device::Cpu)?
            .data::<i32>()?[0];
        crate::error::bail_arg!("cross_entropy: target {y} at position 0 is outside 0..0");
    }
    if f64_path {
        super::double::check("cross_entropy", &[logits])?;
        let tv = targets.data::<i32>()?;
        if let Some(i) = tv.iter().position(|&y| y < 0 || y as usize >= v) {
            let y = tv[i];
            crate::error::bail_arg!("cross_entropy: target {y} at position {i} is outside 0..{v}");
        }
        let (l, grad) = super::double::cross_entropy(logits, &tv, v)?;
        if g != 1.0 {
            super::scale_(&grad, g)?;
        }
        return Ok((Loss::Host(l as f32), grad));
    }
    if let Some(lp) = lp {
        if let crate::backend::Device::Cuda(i) = device {
            let (loss, grad) = lowp::loss::cross_entropy_cuda(i, logits, targets, lp, g)?;
            return Ok((Loss::Device(loss, None), grad));
        }
        let (l, grad) = lowp::loss::cross_entropy(logits, targets, v, lp, g)?;
        return Ok((Loss::Host(l), grad));
    }
    // g / N as PyTorch's nll_loss_backward divides (1 / N when g = 1).
    let inv_n = g / n as f32;
    if let crate::backend::Device::Cuda(i) = device {
        let (loss, grad, _) = cross_entropy_cuda(i, logits, targets, g)?;
        return Ok((Loss::Device(loss, None), grad));
    }
    let lv = logits.f32()?;
    let tv = targets.data::<i32>()?;
    if let Some(i) = tv.iter().position(|&y| y < 0 || y as usize >= v) {
        let y = tv[i];
        crate::error::bail_arg!("cross_entropy: target {y} at position {i} is outside 0..{v}");
    }
    let grad = super::output(logits.shape(), device)?;
    let mut losses = vec![0.0f32; n];
    {
        let (ls, ts): (&[f32], &[i32]) = (&lv, &tv);
        // Whole rows per part, each the reference loop; the row losses are then summed in
        // row order, so the loss has the same bits for any thread count.
        par::rows_mut2(
            (&mut grad.f32_mut()?, v),
            (&mut losses, 1),
            n,
            par::HEAVY_GRAIN / v,
            |r, g, l| fast::cross_entropy(&ls[r.start * v..r.end * v], &ts[r], inv_n, l, g),
        )?;
    }
    let total = losses.iter().fold(0.0f64, |t, &l| t + l as f64);
    Ok((Loss::Host((total / n.max(1) as f64) as f32), grad))
}

/// Cross-entropy of f32 or f64 `logits (N, V)` (`N, V > 0`) on `cuda:ordinal`, nothing
/// read back: `cross_entropy_{f32,f64}` (row losses and the gradient, in the logits'
/// dtype), then `mean_rows_{f32,f64}`. Returns the loss as one f32 (f64 logits: the f64
/// mean rounded, as the host path's), the gradient (of `g * loss`), and the mean in the
/// logits' dtype.
fn cross_entropy_cuda(
    ordinal: usize,
    logits: &Tensor,
    targets: &Tensor,
    g: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    use crate::backend::cuda;
    let device = crate::backend::Device::Cuda(ordinal);
    let dt = logits.dtype();
    let n = targets.numel();
    let s = super::stream(ordinal)?;
    let losses = super::output_as(&[n], device, dt)?;
    let grad = super::output_as(logits.shape(), device, dt)?;
    // g / N as the f32 path rounds it, or in f64 (ops::double: 1 / N, times g).
    let inv_n = match dt {
        DType::F64 => f64::from(g) / n as f64,
        _ => f64::from(g / n as f32),
    };
    cuda::cross_entropy(
        &s,
        &logits.as_device_tensor()?,
        &targets.as_device_tensor()?,
        inv_n,
        &losses.as_device_tensor()?,
        &grad.as_device_tensor()?,
    )?;
    let mean = super::output_as(&[1], device, dt)?;
    cuda::mean_rows(&s, &losses.as_device_tensor()?, &mean.as_device_tensor()?)?;
    let loss = match dt {
        DType::F64 => {
            let l = super::output(&[1], device)?;
            l.copy_from(&mean)?;
            l
        }
        _ => mean.clone(),
    };
    Ok((loss, grad, mean))
}

/// `acc[0] = acc[0] + x[0] / d` for one-element f32 tensors on one device (f32
/// arithmetic): a mean over micro-batches accumulated where the losses are, with no host
/// read on CUDA.
///
/// # Errors
/// `ShapeMismatch` unless both hold one element; `DTypeMismatch`; `DeviceMismatch`.
pub fn add_div_(acc: &Tensor, x: &Tensor, d: f32) -> Result<()> {
    let device = same_device("add_div_", &[acc, x])?;
    super::check_f32("add_div_", &[acc, x])?;
    for t in [acc, x] {
        if t.numel() != 1 {
            return Err(Error::ShapeMismatch {
                op: "add_div_",
                expected: vec![1],
                got: t.shape().to_vec(),
            });
        }
    }
    if let crate::backend::Device::Cuda(i) = device {
        return crate::backend::cuda::add_div(
            &*super::stream(i)?,
            &acc.as_device_tensor()?,
            &x.as_device_tensor()?,
            d,
        );
    }
    let _ = device;
    let v = x.f32()?[0];
    acc.f32_mut()?[0] += v / d;
    Ok(())
}

/// Mean squared error `mean((pred - target)^2)` (`F.mse_loss`), and its gradient
/// `2 (pred - target) / N`. Empty tensors give a NaN loss (PyTorch's mean over no
/// elements) and an empty gradient.
///
/// # Errors
/// `ShapeMismatch` when the element counts differ; `DeviceMismatch`; `DTypeMismatch` for
/// non-f32 tensors.
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<(f32, Tensor)> {
    mse_loss_scaled(pred, target, 1.0)
}

/// [`mse_loss`] whose gradient is that of `grad_output * loss`: `grad_output 2 (pred -
/// target) / N`, multiplied in f32 (f64 for f64 tensors) before a bf16/f16 gradient is
/// rounded, as PyTorch's backward of `F.mse_loss(out.float(), t)` under `scaler.scale(loss)`
/// computes it for the power-of-two scales of a grad
/// scaler (`fsdp::fsdp::ShardedGradScaler`). `grad_output = 1` is [`mse_loss`], bit for bit.
///
/// # Errors
/// As [`mse_loss`].
pub fn mse_loss_scaled(pred: &Tensor, target: &Tensor, grad_output: f32) -> Result<(f32, Tensor)> {
    let g = grad_output;
    if pred.numel() != target.numel() {
        return Err(Error::ShapeMismatch {
            op: "mse_loss",
            expected: pred.shape().to_vec(),
            got: target.shape().to_vec(),
        });
    }
    let device = same_device("mse_loss", &[pred, target])?;
    if super::double::any_f64(&[pred, target]) && pred.numel() > 0 {
        return on_host(device, &[pred, target], |t| {
            let (loss, grad) = super::double::mse_loss(&t[0], &t[1])?;
            if g != 1.0 {
                super::scale_(&grad, g)?;
            }
            Ok((loss, grad))
        });
    }
    if let Some(lp) = lowp::lp_of(&[pred, target]).filter(|_| pred.numel() > 0) {
        // The loss and gradient in f32 from the widened values, the gradient (scaled by
        // `g` in f32) rounded once to `lp`: the backward of PyTorch's
        // `F.mse_loss(out.float(), t)` for a low-precision `out`; with a target of the
        // prediction's dtype too, the loss is rounded as well, as `F.mse_loss(out, t_lp)`.
        let (loss, grad) = mse_native(&lowp::up(pred)?, &lowp::up(target)?, g, device)?;
        let loss = match target.dtype() == lp {
            true => lowp::round(loss, lp),
            false => loss,
        };
        return Ok((loss, lowp::down(&grad, lp)?));
    }
    mse_native(pred, target, g, device)
}

/// [`mse_loss_scaled`] of f32 tensors, checked: elementwise ops on CUDA, else the host loop.
fn mse_native(pred: &Tensor, target: &Tensor, g: f32, device: Device) -> Result<(f32, Tensor)> {
    if pred.numel() == 0 {
        super::check_f32("mse_loss", &[pred, target])?;
        return Ok((f32::NAN, super::output(pred.shape(), device)?));
    }
    let n = pred.numel() as f32;
    if device.is_cuda() {
        super::check_f32("mse_loss", &[pred, target])?;
        // d = pred + (-target) is pred - target exactly; the gradient scales it by 2 / N.
        let d = pred.deep_clone()?;
        let neg = target.deep_clone()?;
        super::scale_(&neg, -1.0)?;
        super::add_(&d, &neg)?;
        let loss = super::sum_squares(&d)? / n as f64;
        super::scale_(&d, 2.0 / n)?;
        if g != 1.0 {
            super::scale_(&d, g)?;
        }
        return Ok((loss as f32, d));
    }
    let (p, t) = (pred.f32()?, target.f32()?);
    let loss = p
        .iter()
        .zip(t.iter())
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        / n as f64;
    let grad = p
        .iter()
        .zip(t.iter())
        .map(|(a, b)| 2.0 * (a - b) / n * g)
        .collect();
    Ok((loss as f32, Tensor::from_vec(grad, pred.shape())?))
}

/// `sum(x)` (the loss of the FSDP docs' `model(input).sum()` example) and its gradient, ones.
/// An empty tensor sums to `+0.0` (as `torch.sum`).
///
/// # Errors
/// `DTypeMismatch` for a non-f32 tensor; `NotMaterialized` on meta; [`Error::Cuda`].
pub fn sum_loss(x: &Tensor) -> Result<(f32, Tensor)> {
    let device = same_device("sum_loss", &[x])?;
    if super::double::any_f64(&[x]) {
        return on_host(device, &[x], |t| super::double::sum_loss(&t[0]));
    }
    if let Some(lp) = lowp::lp_of(&[x]) {
        let loss = lowp::loss::sum(x, lp)?;
        let ones = Tensor::zeros_on(x.shape(), lp, x.device())?;
        super::fill_(&ones, 1.0)?;
        return Ok((loss, ones));
    }
    if device.is_cuda() {
        super::check_f32("sum_loss", &[x])?;
        let s = x.to_vec_f32()?.iter().fold(0.0f64, |s, &v| s + v as f64);
        let ones = super::output(x.shape(), device)?;
        super::fill_(&ones, 1.0)?;
        return Ok((s as f32, ones));
    }
    // A fold from +0.0: `Sum` starts at -0.0, so an empty sum would print as -0.
    let s = x.f32()?.iter().fold(0.0f64, |s, &v| s + v as f64);
    Ok((
        s as f32,
        Tensor::from_vec(vec![1.0f32; x.numel()], x.shape())?,
    ))
}

/// An f64 loss computed by its host loop (`ops::double`), for tensors on `device`: on a CUDA
/// device the inputs are copied to the host and the gradient back (the loss is a host value
/// either way, as the f32 device path waits for its sum too; PyTorch computes f64 losses in
/// f64 on any device).
fn on_host(
    device: crate::backend::Device,
    inputs: &[&Tensor],
    loss: impl FnOnce(&[Tensor]) -> Result<(f32, Tensor)>,
) -> Result<(f32, Tensor)> {
    if !device.is_cuda() {
        let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        return loss(&owned);
    }
    let host = inputs
        .iter()
        .map(|t| t.to_device(crate::backend::Device::Cpu))
        .collect::<Result<Vec<_>>>()?;
    let (l, grad) = loss(&host)?;
    Ok((l, grad.to_device(device)?))
}
