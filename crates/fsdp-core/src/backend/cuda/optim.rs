//! Fused multi-tensor optimizer steps (`optim.cu`): one launch updates every tensor of a
//! list, with exactly the arithmetic of `fsdp::optim::SGD` and
//! `fsdp::optim::Adam`/`fsdp::optim::AdamW` (bitwise equal, see `optim.cu`): f32
//! tensors with the f32 update (`sgd_f32`, `adam_f32`), f64 ones with the f64 update of
//! f64 parameters (`sgd_f64`, `adam_f64`), by the tensors' dtype (one per call). The
//! caller owns the state tensors (momentum buffers, moments) and the step counts, as the
//! CPU optimizers do per list position.

use super::launch::{self, Arg, Grid};
use super::ops::{check_device, check_dtype, check_numel, kname, upload_table};
use super::{widen_hyper, AdamHyper, AdamSlot, DeviceTensor, SgdHyper, SgdSlot, Stream};
use crate::error::Result;
use crate::tensor::DType;

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

/// `struct AdamTensor64` of optim.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamTensor64 {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    n: i64,
    step_size: f64,
    bc2_sqrt: f64,
}

/// The dtype of a step's tensors: the first parameter's (f32 when there is none).
fn step_dtype(mut params: impl Iterator<Item = DType>) -> DType {
    params.next().unwrap_or(DType::F32)
}

fn check_slot(
    op: &'static str,
    s: &Stream,
    dtype: DType,
    p: &DeviceTensor,
    others: &[&DeviceTensor],
) -> Result<()> {
    check_device(op, s, &[p])?;
    check_device(op, s, others)?;
    if dtype != DType::F64 {
        check_dtype(op, p, DType::F32)?;
    }
    check_dtype(op, p, dtype)?;
    for t in others {
        check_dtype(op, t, dtype)?;
        check_numel(op, p.numel(), t)?;
    }
    Ok(())
}

/// One SGD step over every slot, in one launch (`sgd_f32`, or `sgd_f64` for f64 slots).
///
/// # Errors
/// `DTypeMismatch` (neither f32 nor f64, or dtypes differ), `ShapeMismatch` (sizes differ
/// within a slot), `InvalidArgument` (device), [`crate::Error::Cuda`].
pub fn sgd_step(s: &Stream, slots: &[SgdSlot<'_>], h: &SgdHyper) -> Result<()> {
    let dt = step_dtype(slots.iter().map(|sl| sl.param.dtype()));
    let mut table = Vec::with_capacity(slots.len());
    let mut longest = 0;
    for sl in slots {
        let mut others = vec![sl.grad];
        others.extend(sl.momentum_buf);
        check_slot("sgd_step", s, dt, sl.param, &others)?;
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
    let f = |v: f64| Arg::float_of(dt, v);
    // SAFETY: every descriptor points at tensors of n elements of `dt` on this device
    // (checked above; SgdTensor's layout is the same for both); the table lives until the
    // kernel ran.
    unsafe {
        launch::sgd(
            s,
            kname!("sgd", dt),
            Grid::segments(s, slots.len(), longest),
            t.ptr(),
            slots.len() as i64,
            f(h.lr),
            f(h.momentum),
            f(h.dampening),
            f(h.weight_decay),
            h.nesterov as i32,
        )
    }
}

/// One Adam/AdamW step over every slot, in one launch (`adam_f32`, or `adam_f64` for f64
/// slots). Bias corrections are computed per slot on the host in f64, as the CPU optimizer
/// does (f32: `powi` of the f32 betas; f64: `powf` of the given betas, Python's `**`).
///
/// # Errors
/// As [`sgd_step`]; `InvalidArgument` for a step count of 0.
pub fn adam_step(s: &Stream, slots: &[AdamSlot<'_>], h: &AdamHyper) -> Result<()> {
    let dt = step_dtype(slots.iter().map(|sl| sl.param.dtype()));
    let (b1, b2) = h.betas;
    let (mut t32, mut t64) = (Vec::new(), Vec::new());
    let mut longest = 0;
    for sl in slots {
        check_slot("adam_step", s, dt, sl.param, &[sl.grad, sl.m, sl.v])?;
        if sl.step == 0 {
            crate::error::bail_arg!("adam_step: step counts start at 1");
        }
        longest = longest.max(sl.param.numel());
        let (p, g, m, v, n) = (
            sl.param.ptr(),
            sl.grad.ptr(),
            sl.m.ptr(),
            sl.v.ptr(),
            sl.param.numel() as i64,
        );
        if dt == DType::F64 {
            let bc1 = 1.0 - b1.powf(sl.step as f64);
            let bc2_sqrt = (1.0 - b2.powf(sl.step as f64)).sqrt();
            t64.push(AdamTensor64 {
                p,
                g,
                m,
                v,
                n,
                step_size: h.lr / bc1,
                bc2_sqrt,
            });
        } else {
            // The f32 optimizer's: its f32 betas, widened.
            let (b1, b2) = (f64::from(b1 as f32), f64::from(b2 as f32));
            let bc1 = 1.0 - b1.powi(sl.step as i32);
            let bc2 = 1.0 - b2.powi(sl.step as i32);
            t32.push(AdamTensor {
                p,
                g,
                m,
                v,
                n,
                step_size: (f64::from(h.lr as f32) / bc1) as f32,
                bc2_sqrt: bc2.sqrt() as f32,
            });
        }
    }
    if longest == 0 {
        return Ok(());
    }
    let t = match dt {
        DType::F64 => upload_table(s, &t64)?,
        _ => upload_table(s, &t32)?,
    };
    // In a graph region, the device scalar the step's rate is read from (kept by the graph).
    let lr_at = match super::graph::recording() {
        true => Some(graph_bias(s, dt, &t, slots, h)?),
        false => None,
    };
    let f = |v: f64| Arg::float_of(dt, v);
    // SAFETY: as in `sgd_step`, with the descriptor type of `dt`.
    unsafe {
        launch::adam(
            s,
            kname!("adam", dt),
            Grid::segments(s, slots.len(), longest),
            t.ptr(),
            slots.len() as i64,
            f(h.lr),
            f(b1),
            f(b2),
            f(h.eps),
            f(h.weight_decay),
            h.decoupled as i32,
            lr_at.as_ref().map_or(0, |b| b.ptr()),
        )
    }
}

/// In a CUDA graph region (`graph.rs`): the step count moves to device memory and the bias
/// corrections of `table` are computed on the device from it (`adam_bias_{f32,f64}`,
/// PyTorch's `capturable=True`), so that each replay of the graph is the next step, not
/// the captured one again. The count starts at the slots' common count before this
/// update; its block is kept for the graph. With the region's learning-rate table
/// ([Note: lr table] in `graph.rs`), the rate of each replay is read from it; the returned
/// scalar (of `dt`, a graph constant) holds the replay's rate for `adam_{f32,f64}`.
///
/// # Errors
/// `InvalidArgument` when the slots' step counts differ or the table's rate for this step
/// is not `h.lr`; [`crate::Error::Cuda`].
fn graph_bias(
    s: &Stream,
    dt: DType,
    table: &super::DeviceBuffer,
    slots: &[AdamSlot<'_>],
    h: &AdamHyper,
) -> Result<super::DeviceBuffer> {
    let step = slots.first().map_or(1, |sl| sl.step);
    if let Some(other) = slots.iter().find(|sl| sl.step != step) {
        crate::error::bail_arg!(
            "adam_step: a CUDA graph keeps one step count for every tensor (got {step} and {})",
            other.step
        );
    }
    let count = s.alloc_graph_constant(8)?;
    super::graph::write_once(s, count.ptr(), &(step as i64 - 1).to_le_bytes())?;
    let lr_out = s.alloc_graph_constant(dt.size_in_bytes())?;
    // The rates as the eager step of `dt` widens them; `base` is the count whose rate is
    // the table's first entry (the warm-up step's).
    let lrs = match super::graph::lr_table() {
        Some((lrs, at)) => {
            let wide: Vec<f64> = lrs.iter().map(|&l| widen_hyper(dt, l)).collect();
            if wide[at].to_bits() != h.lr.to_bits() {
                crate::error::bail_arg!(
                    "adam_step: a CUDA graph's learning-rate table gives {} for step {step}, the optimizer {} (the table must be the schedule's for this optimizer)",
                    wide[at],
                    h.lr
                );
            }
            let bytes: Vec<u8> = wide.iter().flat_map(|l| l.to_le_bytes()).collect();
            let buf = s.alloc_graph_constant(bytes.len())?;
            super::graph::write_once(s, buf.ptr(), &bytes)?;
            Some((buf, wide.len(), step as i64 - at as i64))
        }
        None => None,
    };
    let (lr, b1, b2) = match dt {
        DType::F64 => (h.lr, h.betas.0, h.betas.1),
        // The f32 optimizer's settings, widened (as `adam_step` computes them).
        _ => (
            f64::from(h.lr as f32),
            f64::from(h.betas.0 as f32),
            f64::from(h.betas.1 as f32),
        ),
    };
    let one = launch::Grid {
        grid: (1, 1, 1),
        block: 1,
    };
    // SAFETY: `table` holds `slots.len()` descriptors of `dt`'s layout (written by
    // `adam_step`), `count` one i64, `lrs` its length of f64, `lr_out` one element of `dt`;
    // all stay allocated (held) while the graph lives.
    unsafe {
        launch::adam_bias(
            s,
            kname!("adam_bias", dt),
            one,
            table.ptr(),
            slots.len() as i64,
            count.ptr(),
            lrs.as_ref().map_or(0, |(b, _, _)| b.ptr()),
            lrs.as_ref().map_or(0, |(_, n, _)| *n as i64),
            lrs.as_ref().map_or(0, |(_, _, base)| *base),
            lr_out.ptr(),
            lr,
            b1,
            b2,
        )
    }?;
    Ok(lr_out)
}
