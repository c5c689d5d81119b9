//! Typed ops for `lowp.cu`: the bf16/f16 LayerNorm backward and cross-entropy of
//! [`crate::ops`]'s low-precision paths (CPU references: `ops/lowp/layernorm.rs`,
//! `ops/lowp/loss.rs`). One thread per row (per column for the parameter gradients).

use super::launch::{self, Grid};
use super::ops::{check_device, check_dtype, check_numel};
use super::{DeviceTensor, Stream};
use crate::error::{Error, Result};
use crate::tensor::DType;

/// `{stem}_bf16` or `{stem}_f16` for a bf16/f16 tensor.
fn name(stem: &'static str, d: DType) -> Result<&'static str> {
    Ok(match (stem, d) {
        ("layernorm_bwd_lp", DType::BF16) => "layernorm_bwd_lp_bf16",
        ("layernorm_bwd_lp", DType::F16) => "layernorm_bwd_lp_f16",
        ("layernorm_wgrad_lp", DType::BF16) => "layernorm_wgrad_lp_bf16",
        ("layernorm_wgrad_lp", DType::F16) => "layernorm_wgrad_lp_f16",
        ("cross_entropy_lp", DType::BF16) => "cross_entropy_lp_bf16",
        ("cross_entropy_lp", DType::F16) => "cross_entropy_lp_f16",
        (op, got) => {
            return Err(Error::DTypeMismatch {
                op,
                expected: DType::BF16,
                got,
            })
        }
    })
}

/// Every tensor on `s`'s device and of dtype `d`.
fn same(op: &'static str, s: &Stream, d: DType, ts: &[&DeviceTensor]) -> Result<()> {
    check_device(op, s, ts)?;
    ts.iter().try_for_each(|t| check_dtype(op, t, d))
}

/// `dx` of a bf16/f16 LayerNorm from the input `x (n, c)`, `dy (n, c)`, `w (c)` and the
/// rounded saved `mean`, `rstd (n)` (`layernorm_bwd_lp_{dtype}`), all of one dtype.
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`; [`Error::Cuda`].
pub fn layernorm_bwd_lp(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    w: &DeviceTensor,
    mean: &DeviceTensor,
    rstd: &DeviceTensor,
    dx: &DeviceTensor,
) -> Result<()> {
    let d = x.dtype();
    same("layernorm_bwd_lp", s, d, &[x, dy, w, mean, rstd, dx])?;
    let (n, c) = (rstd.numel(), w.numel());
    check_numel("layernorm_bwd_lp", n, mean)?;
    for t in [x, dy, dx] {
        check_numel("layernorm_bwd_lp", n * c, t)?;
    }
    if n == 0 || c == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::layernorm_bwd_lp(
            s,
            name("layernorm_bwd_lp", d)?,
            Grid::elementwise(s, n),
            x.ptr(),
            dy.ptr(),
            w.ptr(),
            mean.ptr(),
            rstd.ptr(),
            dx.ptr(),
            n as i64,
            c as i64,
        )
    }
}

/// The weight and bias gradients of a bf16/f16 LayerNorm, accumulated row after row in the
/// dtype into `dw`, `db (c)` (overwritten; `layernorm_wgrad_lp_{dtype}`).
///
/// # Errors
/// As [`layernorm_bwd_lp`].
pub fn layernorm_wgrad_lp(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    mean: &DeviceTensor,
    rstd: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    let d = x.dtype();
    same("layernorm_wgrad_lp", s, d, &[x, dy, mean, rstd, dw, db])?;
    let (n, c) = (rstd.numel(), dw.numel());
    check_numel("layernorm_wgrad_lp", n, mean)?;
    check_numel("layernorm_wgrad_lp", c, db)?;
    for t in [x, dy] {
        check_numel("layernorm_wgrad_lp", n * c, t)?;
    }
    if c == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::layernorm_wgrad_lp(
            s,
            name("layernorm_wgrad_lp", d)?,
            Grid::elementwise(s, c),
            x.ptr(),
            dy.ptr(),
            mean.ptr(),
            rstd.ptr(),
            dw.ptr(),
            db.ptr(),
            n as i64,
            c as i64,
        )
    }
}

/// Cross-entropy of bf16/f16 `logits (n, V)` against i32 `targets (n)`: per-row f32
/// losses `-round(log_softmax)[y]` into `losses (n)` and `dlogits` of the logits' dtype
/// (`cross_entropy_lp_{dtype}`; `w` is `1 / n` rounded to the dtype). A target outside
/// `0..V` is reported by the calling thread's next host read, as `cross_entropy`'s.
///
/// # Errors
/// Shape and dtype errors; [`Error::Cuda`].
pub fn cross_entropy_lp(
    s: &Stream,
    logits: &DeviceTensor,
    targets: &DeviceTensor,
    w: f32,
    losses: &DeviceTensor,
    dlogits: &DeviceTensor,
) -> Result<()> {
    let d = logits.dtype();
    same("cross_entropy_lp", s, d, &[logits, dlogits])?;
    check_device("cross_entropy_lp", s, &[targets, losses])?;
    check_dtype("cross_entropy_lp", targets, DType::I32)?;
    check_dtype("cross_entropy_lp", losses, DType::F32)?;
    let n = targets.numel();
    check_numel("cross_entropy_lp", n, losses)?;
    check_numel("cross_entropy_lp", logits.numel(), dlogits)?;
    if n == 0 || logits.numel() % n != 0 {
        return Err(Error::ShapeMismatch {
            op: "cross_entropy_lp",
            expected: vec![n],
            got: logits.shape().to_vec(),
        });
    }
    let v = logits.numel() / n;
    let flag = super::nn_ops::invalid_flag(s)?;
    // SAFETY: sizes checked above; the flag holds one u64.
    unsafe {
        launch::cross_entropy_lp(
            s,
            name("cross_entropy_lp", d)?,
            Grid::elementwise(s, n),
            logits.ptr(),
            targets.ptr(),
            losses.ptr(),
            dlogits.ptr(),
            n as i64,
            v as i64,
            w,
            flag,
        )?;
    }
    super::checks::defer(
        s,
        Box::new(move |r| {
            Error::InvalidArgument(format!(
                "cross_entropy: the target at position {r} is outside 0..{v}"
            ))
        }),
    )
}
