//! The CUDA side of the optimizers: the tensors of one step that live on CUDA devices,
//! updated by the fused multi-tensor kernels of `optim.cu` (`sgd_f32`, `adam_f32`) with one
//! launch per device, on the calling thread's current stream. Same arithmetic in the same
//! order as the CPU loops of `sgd.rs` / `adam.rs` (bitwise equal, see `optim.cu`); the
//! callers check sizes, dtypes and devices and own the state tensors and step counts.

use super::{AdamConfig, SgdConfig};
use crate::error::Result;
use crate::tensor::Tensor;

/// One CUDA tensor of an SGD step.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only built with CUDA tensors
pub(super) struct SgdItem {
    /// f32 parameter, updated in place.
    pub param: Tensor,
    /// Its f32 gradient (same element count, same device).
    pub grad: Tensor,
    /// The momentum buffer on the same device, when momentum is on.
    pub buf: Option<Tensor>,
    /// True on the buffer's first step (it is set to the gradient, undamped).
    pub first: bool,
}

/// One CUDA tensor of an Adam/AdamW step.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only built with CUDA tensors
pub(super) struct AdamItem {
    /// f32 parameter, updated in place.
    pub param: Tensor,
    /// Its f32 gradient.
    pub grad: Tensor,
    /// First moment, updated in place.
    pub m: Tensor,
    /// Second moment, updated in place.
    pub v: Tensor,
    /// The tensor's step count including this update (>= 1).
    pub step: u64,
}

/// The distinct device ordinals of `items`, in order of first appearance.
#[cfg(feature = "cuda")]
fn ordinals<T>(items: &[T], param: impl Fn(&T) -> &Tensor) -> Vec<usize> {
    let mut out = Vec::new();
    for it in items {
        if let crate::backend::Device::Cuda(i) = param(it).device() {
            if !out.contains(&i) {
                out.push(i);
            }
        }
    }
    out
}

/// One SGD step over `items` (all on CUDA devices).
///
/// # Errors
/// [`crate::Error::Cuda`]; shape and dtype errors from the typed op.
pub(super) fn sgd(items: &[SgdItem], c: &SgdConfig) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        use crate::backend::cuda::{sgd_step, SgdHyper, SgdSlot};
        let h = SgdHyper {
            lr: c.lr,
            momentum: c.momentum,
            dampening: c.dampening,
            weight_decay: c.weight_decay,
            nesterov: c.nesterov,
        };
        for ordinal in ordinals(items, |it| &it.param) {
            let group: Vec<&SgdItem> = items
                .iter()
                .filter(|it| it.param.device() == crate::backend::Device::Cuda(ordinal))
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
    #[cfg(not(feature = "cuda"))]
    {
        let _ = c;
        Err(crate::backend::cuda::no_cuda_build())
    }
}

/// One Adam (`decoupled` false) or AdamW step over `items` (all on CUDA devices).
///
/// # Errors
/// As [`sgd`].
pub(super) fn adam(items: &[AdamItem], c: &AdamConfig, decoupled: bool) -> Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        use crate::backend::cuda::{adam_step, AdamHyper, AdamSlot};
        let h = AdamHyper {
            lr: c.lr,
            betas: c.betas,
            eps: c.eps,
            weight_decay: c.weight_decay,
            decoupled,
        };
        for ordinal in ordinals(items, |it| &it.param) {
            let group: Vec<&AdamItem> = items
                .iter()
                .filter(|it| it.param.device() == crate::backend::Device::Cuda(ordinal))
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
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (c, decoupled);
        Err(crate::backend::cuda::no_cuda_build())
    }
}
