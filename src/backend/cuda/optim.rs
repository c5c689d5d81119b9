//! Fused multi-tensor optimizer steps (`optim.cu`): one launch updates every tensor of a
//! list, with exactly the arithmetic of [`crate::optim::SGD`] and
//! [`crate::optim::Adam`]/[`crate::optim::AdamW`] (bitwise equal, see `optim.cu`). The
//! caller owns the state tensors (momentum buffers, moments) and the step counts, as the
//! CPU optimizers do per list position.

use super::launch::{self, Grid};
use super::ops::{check_device, check_dtype, check_numel, upload_table};
use super::{DeviceTensor, Stream};
use crate::error::Result;
use crate::tensor::DType;

/// One tensor of an SGD step: f32 `param` updated in place from f32 `grad` (same element
/// count), with its momentum buffer when momentum is on.
#[derive(Debug, Clone, Copy)]
pub struct SgdSlot<'a> {
    /// Parameter shard, updated in place.
    pub param: &'a DeviceTensor,
    /// Its gradient, read only.
    pub grad: &'a DeviceTensor,
    /// Momentum buffer (same size), `None` without momentum.
    pub momentum_buf: Option<&'a DeviceTensor>,
    /// True on the buffer's first step: it is set to the gradient, undamped (PyTorch).
    pub first: bool,
}

/// SGD hyperparameters, as [`crate::optim::SgdConfig`].
#[derive(Debug, Clone, Copy)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0: no buffer is read or written).
    pub momentum: f32,
    /// Dampening after the first step.
    pub dampening: f32,
    /// L2 penalty `wd * p` added to the gradient.
    pub weight_decay: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// One tensor of an Adam/AdamW step: f32 `param`, `grad`, moments `m`, `v`, all the same
/// element count; `step` is this tensor's step count after the update (1 on the first).
#[derive(Debug, Clone, Copy)]
pub struct AdamSlot<'a> {
    /// Parameter shard, updated in place.
    pub param: &'a DeviceTensor,
    /// Its gradient, read only.
    pub grad: &'a DeviceTensor,
    /// First moment, updated in place (zeros before the first step).
    pub m: &'a DeviceTensor,
    /// Second moment, updated in place (zeros before the first step).
    pub v: &'a DeviceTensor,
    /// Step count including this update (>= 1).
    pub step: u64,
}

/// Adam/AdamW hyperparameters, as [`crate::optim::AdamConfig`].
#[derive(Debug, Clone, Copy)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f32,
    /// `(beta1, beta2)`.
    pub betas: (f32, f32),
    /// Denominator epsilon.
    pub eps: f32,
    /// Weight decay: L2 on the gradient (Adam) or decoupled (AdamW).
    pub weight_decay: f32,
    /// AdamW's decoupled decay `p *= 1 - lr wd` instead of L2.
    pub decoupled: bool,
}

/// `struct SgdTensor` of optim.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct SgdTensor {
    p: u64,
    g: u64,
    buf: u64,
    n: i64,
    first: i32,
    pad: i32,
}

/// `struct AdamTensor` of optim.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamTensor {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    n: i64,
    step_size: f32,
    bc2_sqrt: f32,
}

fn check_slot(
    op: &'static str,
    s: &Stream,
    p: &DeviceTensor,
    others: &[&DeviceTensor],
) -> Result<()> {
    check_device(op, s, &[p])?;
    check_device(op, s, others)?;
    check_dtype(op, p, DType::F32)?;
    for t in others {
        check_dtype(op, t, DType::F32)?;
        check_numel(op, p.numel(), t)?;
    }
    Ok(())
}

/// One SGD step over every slot, in one launch (`sgd_f32`).
///
/// # Errors
/// `DTypeMismatch` (not f32), `ShapeMismatch` (sizes differ within a slot), `InvalidArgument`
/// (device), [`crate::Error::Cuda`].
pub fn sgd_step(s: &Stream, slots: &[SgdSlot<'_>], h: &SgdHyper) -> Result<()> {
    let mut table = Vec::with_capacity(slots.len());
    let mut longest = 0;
    for sl in slots {
        let mut others = vec![sl.grad];
        others.extend(sl.momentum_buf);
        check_slot("sgd_step", s, sl.param, &others)?;
        longest = longest.max(sl.param.numel());
        table.push(SgdTensor {
            p: sl.param.ptr(),
            g: sl.grad.ptr(),
            buf: if h.momentum != 0.0 {
                sl.momentum_buf.map_or(0, |b| b.ptr())
            } else {
                0
            },
            n: sl.param.numel() as i64,
            first: sl.first as i32,
            pad: 0,
        });
    }
    if longest == 0 {
        return Ok(());
    }
    let t = upload_table(s, &table)?;
    // SAFETY: every descriptor points at f32 tensors of n elements on this device (checked
    // above); the table lives until the kernel ran.
    unsafe {
        launch::sgd(
            s,
            "sgd_f32",
            Grid::segments(s, slots.len(), longest),
            t.ptr(),
            slots.len() as i64,
            h.lr,
            h.momentum,
            h.dampening,
            h.weight_decay,
            h.nesterov as i32,
        )
    }
}

/// One Adam/AdamW step over every slot, in one launch (`adam_f32`). Bias corrections are
/// computed per slot on the host in f64, as the CPU optimizer does.
///
/// # Errors
/// As [`sgd_step`]; `InvalidArgument` for a step count of 0.
pub fn adam_step(s: &Stream, slots: &[AdamSlot<'_>], h: &AdamHyper) -> Result<()> {
    let (b1, b2) = h.betas;
    let mut table = Vec::with_capacity(slots.len());
    let mut longest = 0;
    for sl in slots {
        check_slot("adam_step", s, sl.param, &[sl.grad, sl.m, sl.v])?;
        if sl.step == 0 {
            crate::error::bail_arg!("adam_step: step counts start at 1");
        }
        longest = longest.max(sl.param.numel());
        let bc1 = 1.0 - (b1 as f64).powi(sl.step as i32);
        let bc2 = 1.0 - (b2 as f64).powi(sl.step as i32);
        table.push(AdamTensor {
            p: sl.param.ptr(),
            g: sl.grad.ptr(),
            m: sl.m.ptr(),
            v: sl.v.ptr(),
            n: sl.param.numel() as i64,
            step_size: (h.lr as f64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
        });
    }
    if longest == 0 {
        return Ok(());
    }
    let t = upload_table(s, &table)?;
    // SAFETY: as in `sgd_step`.
    unsafe {
        launch::adam(
            s,
            "adam_f32",
            Grid::segments(s, slots.len(), longest),
            t.ptr(),
            slots.len() as i64,
            h.lr,
            b1,
            b2,
            h.eps,
            h.weight_decay,
            h.decoupled as i32,
        )
    }
}
