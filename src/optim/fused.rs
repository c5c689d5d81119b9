//! The CUDA side of the optimizers: the tensors of one step that live on CUDA devices,
//! updated by the fused multi-tensor kernels of `optim.cu` (`sgd_f32`, `adam_f32`; for f64
//! parameters `sgd_f64`, `adam_f64`) with one launch per device and dtype, on the calling
//! thread's current stream. Same arithmetic in the same order as the CPU loops of `sgd.rs`
//! / `adam.rs` (bitwise equal, see `optim.cu`; f64 with the hyperparameters as the f64
//! their decimal spelling names, as the CPU's f64 updates); the callers check sizes,
//! dtypes and devices and own the state tensors and step counts.

use super::{AdamConfig, SgdConfig};
use crate::backend::cuda::{adam_step, sgd_step, AdamHyper, AdamSlot, SgdHyper, SgdSlot};
use crate::error::Result;
use crate::tensor::DType;
use crate::tensor::Tensor;

/// One CUDA tensor of an SGD step.
pub(super) struct SgdItem {
    /// f32 or f64 parameter, updated in place.
    pub param: Tensor,
    /// Its gradient (same dtype, element count and device).
    pub grad: Tensor,
    /// The momentum buffer on the same device, when momentum is on.
    pub buf: Option<Tensor>,
    /// True on the buffer's first step (it is set to the gradient, undamped).
    pub first: bool,
}

/// One CUDA tensor of an Adam/AdamW step.
pub(super) struct AdamItem {
    /// f32 or f64 parameter, updated in place.
    pub param: Tensor,
    /// Its gradient (same dtype).
    pub grad: Tensor,
    /// First moment, updated in place.
    pub m: Tensor,
    /// Second moment, updated in place.
    pub v: Tensor,
    /// The tensor's step count including this update (>= 1).
    pub step: u64,
}

/// The distinct (device ordinal, dtype) pairs of `items`' parameters, in order of first
/// appearance: one launch each.
fn launches<T>(items: &[T], param: impl Fn(&T) -> &Tensor) -> Vec<(usize, DType)> {
    let mut out = Vec::new();
    for it in items {
        let p = param(it);
        if let crate::backend::Device::Cuda(i) = p.device() {
            if !out.contains(&(i, p.dtype())) {
                out.push((i, p.dtype()));
            }
        }
    }
    out
}

/// An f32 hyperparameter for the kernel of `dtype`: exactly itself for f32, the decimal it
/// spells for f64 (as the CPU's f64 updates take it).
fn hyper(dtype: DType, v: f32) -> f64 {
    crate::backend::cuda::widen_hyper(dtype, v)
}

/// One SGD step over `items` (all on CUDA devices).
///
/// # Errors
/// [`crate::Error::Cuda`]; shape and dtype errors from the typed op.
pub(super) fn sgd(items: &[SgdItem], c: &SgdConfig) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    for (ordinal, dt) in launches(items, |it| &it.param) {
        let h = SgdHyper {
            lr: hyper(dt, c.lr),
            momentum: hyper(dt, c.momentum),
            dampening: hyper(dt, c.dampening),
            weight_decay: hyper(dt, c.weight_decay),
            nesterov: c.nesterov,
        };
        let group: Vec<&SgdItem> = items
            .iter()
            .filter(|it| {
                it.param.device() == crate::backend::Device::Cuda(ordinal) && it.param.dtype() == dt
            })
            .collect();
        let views = group
            .iter()
            .map(|it| {
                Ok((
                    it.param.as_device_tensor()?,
                    it.grad.as_device_tensor()?,
                    it.buf.as_ref().map(|b| b.as_device_tensor()).transpose()?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let slots: Vec<SgdSlot<'_>> = views
            .iter()
            .zip(&group)
            .map(|((p, g, b), it)| SgdSlot {
                param: p,
                grad: g,
                momentum_buf: b.as_ref(),
                first: it.first,
            })
            .collect();
        sgd_step(&*crate::ops::stream(ordinal)?, &slots, &h)?;
    }
    Ok(())
}

/// One Adam (`decoupled` false) or AdamW step over `items` (all on CUDA devices).
///
/// # Errors
/// As [`sgd`].
pub(super) fn adam(items: &[AdamItem], c: &AdamConfig, decoupled: bool) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    for (ordinal, dt) in launches(items, |it| &it.param) {
        let h = AdamHyper {
            lr: hyper(dt, c.lr),
            betas: (hyper(dt, c.betas.0), hyper(dt, c.betas.1)),
            eps: hyper(dt, c.eps),
            weight_decay: hyper(dt, c.weight_decay),
            decoupled,
        };
        let group: Vec<&AdamItem> = items
            .iter()
            .filter(|it| {
                it.param.device() == crate::backend::Device::Cuda(ordinal) && it.param.dtype() == dt
            })
            .collect();
        let views = group
            .iter()
            .map(|it| {
                Ok([
                    it.param.as_device_tensor()?,
                    it.grad.as_device_tensor()?,
                    it.m.as_device_tensor()?,
                    it.v.as_device_tensor()?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let slots: Vec<AdamSlot<'_>> = views
            .iter()
            .zip(&group)
            .map(|([p, g, m, v], it)| AdamSlot {
                param: p,
                grad: g,
                m,
                v,
                step: it.step,
            })
            .collect();
        adam_step(&*crate::ops::stream(ordinal)?, &slots, &h)?;
    }
    Ok(())
}
