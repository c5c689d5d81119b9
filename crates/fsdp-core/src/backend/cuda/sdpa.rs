//! Typed ops for `sdpa.cu`: causal attention of bf16/f16 heads with PyTorch's CPU
//! flash-attention rounding, the same steps in the same order as
//! [`crate::backend::cpu::sdpa`] (bit for bit on cuda-emu). Everything is queued on the
//! given stream: no host read, no allocation (the caller passes every buffer).

use super::launch::{self, Grid};
use super::ops::{check_device, check_dtype, check_numel};
use super::{DeviceTensor, Stream};
use crate::backend::cpu::kernels::HeadDims;
use crate::backend::cpu::sdpa_math::{kv_split, q_split, scale};
use crate::error::{Error, Result};
use crate::tensor::DType;

pub use crate::backend::cpu::sdpa_math::CUDA_MAX_HD as SDPA_MAX_HD;

/// The kernel of family `stem` (`fwd`, `bwd_dq`, `bwd_dkv`) for dtype `d`.
fn name(stem: &'static str, d: DType) -> Result<&'static str> {
    Ok(match (stem, d) {
        ("fwd", DType::BF16) => "sdpa_fwd_bf16",
        ("fwd", DType::F16) => "sdpa_fwd_f16",
        ("bwd_dq", DType::BF16) => "sdpa_bwd_dq_bf16",
        ("bwd_dq", DType::F16) => "sdpa_bwd_dq_f16",
        ("bwd_dkv", DType::BF16) => "sdpa_bwd_dkv_bf16",
        ("bwd_dkv", DType::F16) => "sdpa_bwd_dkv_f16",
        (_, got) => {
            return Err(Error::DTypeMismatch {
                op: "sdpa",
                expected: DType::BF16,
                got,
            })
        }
    })
}

/// Checks devices, the 16-bit dtype of `lp`, f32 for `f`, the sizes, and the head width.
fn check(
    op: &'static str,
    s: &Stream,
    lp: &[&DeviceTensor],
    f: &[&DeviceTensor],
    d: HeadDims,
) -> Result<DType> {
    let dt = lp[0].dtype();
    check_device(op, s, lp)?;
    check_device(op, s, f)?;
    for t in lp {
        check_dtype(op, t, dt)?;
        check_numel(op, d.numel(), t)?;
    }
    for t in f {
        check_dtype(op, t, DType::F32)?;
        check_numel(op, d.b * d.h * d.t, t)?;
    }
    if d.hd > SDPA_MAX_HD {
        return Err(Error::Unsupported(format!(
            "{op} on CUDA: head width {} (at most {SDPA_MAX_HD})",
            d.hd
        )));
    }
    Ok(dt)
}

/// The sizes every kernel takes after its pointers: `BH, T, hd, qs, kvs` and the scale.
fn dims(d: HeadDims) -> (i64, i64, i64, i64, i64, f32) {
    (
        (d.b * d.h) as i64,
        d.t as i64,
        d.hd as i64,
        q_split(d.t) as i64,
        kv_split(d.t) as i64,
        scale(d.hd),
    )
}

/// Forward: `q, k, v (B, H, T, hd)` -> `out` (same dtype) and `lse (B, H, T)` f32 (=),
/// `sdpa_fwd_{dtype}`, one thread per query row.
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`, `Unsupported` (head wider than [`SDPA_MAX_HD`]);
/// [`Error::Cuda`].
pub fn sdpa_forward(
    s: &Stream,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    let dt = check("sdpa_forward", s, &[q, k, v, out], &[lse], d)?;
    if d.numel() == 0 {
        return Ok(());
    }
    let (bh, t, hd, qs, kvs, sc) = dims(d);
    // SAFETY: devices, dtypes and sizes checked above.
    unsafe {
        launch::sdpa_fwd(
            s,
            name("fwd", dt)?,
            Grid::elementwise(s, d.b * d.h * d.t),
            q.ptr(),
            k.ptr(),
            v.ptr(),
            out.ptr(),
            lse.ptr(),
            bh,
            t,
            hd,
            qs,
            kvs,
            sc,
        )
    }
}

/// Backward: from `q, k, v`, the forward's `out` and `lse`, and `dout`, the gradients
/// `dq, dk, dv` (=); `dsum (B, H, T)` f32 is scratch (`dout . out` per row, written by
/// `sdpa_bwd_dq_{dtype}` and read by `sdpa_bwd_dkv_{dtype}`, queued in that order).
///
/// # Errors
/// As [`sdpa_forward`].
#[allow(clippy::too_many_arguments)]
pub fn sdpa_backward(
    s: &Stream,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    dout: &DeviceTensor,
    (dq, dk, dv): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    dsum: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    let dt = check(
        "sdpa_backward",
        s,
        &[q, k, v, out, dout, dq, dk, dv],
        &[lse, dsum],
        d,
    )?;
    if d.numel() == 0 {
        return Ok(());
    }
    let (bh, t, hd, qs, kvs, sc) = dims(d);
    let g = Grid::elementwise(s, d.b * d.h * d.t);
    // SAFETY: devices, dtypes and sizes checked above; both kernels run on `s` in order.
    unsafe {
        launch::sdpa_bwd_dq(
            s,
            name("bwd_dq", dt)?,
            g,
            q.ptr(),
            k.ptr(),
            v.ptr(),
            out.ptr(),
            lse.ptr(),
            dout.ptr(),
            dq.ptr(),
            dsum.ptr(),
            bh,
            t,
            hd,
            qs,
            kvs,
            sc,
        )?;
        launch::sdpa_bwd_dkv(
            s,
            name("bwd_dkv", dt)?,
            g,
            q.ptr(),
            k.ptr(),
            v.ptr(),
            lse.ptr(),
            dout.ptr(),
            dsum.ptr(),
            dk.ptr(),
            dv.ptr(),
            bh,
            t,
            hd,
            qs,
            kvs,
            sc,
        )
    }
}
