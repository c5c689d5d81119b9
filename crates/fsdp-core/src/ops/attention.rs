//! The pieces of causal self-attention around its GEMMs, on any device: the permutes
//! between the token-major layout of the projections and the head-major layout of the
//! per-head products, and the causal softmax of the scores with its backward.
//!
//! | op | from | to |
//! |---|---|---|
//! | [`split_qkv`] | `qkv (B, T, 3, H, hd)` (= `(B, T, 3C)`) | `q, k, v (B, H, T, hd)` |
//! | [`merge_qkv`] | `dq, dk, dv (B, H, T, hd)` | `dqkv (B, T, 3C)` |
//! | [`merge_heads`] | `yh (B, H, T, hd)` | `y (B, T, C)` |
//! | [`split_heads`] | `y (B, T, C)` | `yh (B, H, T, hd)` |
//!
//! CPU: row copies (the references in [`crate::backend::cpu::kernels`] index element by
//! element; same results); CUDA: `split_qkv_f32`, `merge_qkv_f32`, `merge_heads_f32`,
//! `split_heads_f32`, `softmax_causal_*_f32` of `nn.cu`, and their `_f64` instances for
//! f64 tensors (which on the CPU take the host loops of `double/`).

use super::{check_f32, compute_dtype, lowp, output, output_as, same_device};
use crate::backend::cpu::fast;
pub use crate::backend::cpu::kernels::HeadDims;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

fn check_numel(op: &'static str, t: &Tensor, want: usize) -> Result<()> {
    if t.numel() != want {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![want],
            got: t.shape().to_vec(),
        });
    }
    Ok(())
}

/// `qkv (B, T, 3C)` -> `[q, k, v]`, each `(B, H, T, hd)` (`C = H hd`).
///
/// # Errors
/// `ShapeMismatch` when `qkv` does not hold `3 B T C` elements; device, dtype and CUDA
/// errors.
pub fn split_qkv(qkv: &Tensor, d: HeadDims) -> Result<[Tensor; 3]> {
    let device = same_device("split_qkv", &[qkv])?;
    if let Some(lp) = lowp::lp_of(&[qkv]) {
        // Exact copies of the widened values, rounded back exactly.
        let [q, k, v] = split_qkv_native(&lowp::up(qkv)?, d, device)?;
        return Ok([
            lowp::down(&q, lp)?,
            lowp::down(&k, lp)?,
            lowp::down(&v, lp)?,
        ]);
    }
    if super::double::any_f64(&[qkv]) && !device.is_cuda() {
        check_numel("split_qkv", qkv, 3 * d.numel())?;
        return super::double::split_qkv(qkv, d);
    }
    split_qkv_native(qkv, d, device)
}

/// [`split_qkv`] of an f32 tensor (or an f64 one on CUDA), checked: the kernel on CUDA,
/// else the host loop.
fn split_qkv_native(qkv: &Tensor, d: HeadDims, device: Device) -> Result<[Tensor; 3]> {
    let dt = compute_dtype("split_qkv", &[qkv], device)?;
    check_numel("split_qkv", qkv, 3 * d.numel())?;
    let shape = [d.b, d.h, d.t, d.hd];
    let out = [
        output_as(&shape, device, dt)?,
        output_as(&shape, device, dt)?,
        output_as(&shape, device, dt)?,
    ];
    if let Device::Cuda(i) = device {
        let [q, k, v] = &out;
        crate::backend::cuda::split_qkv(
            &*super::stream(i)?,
            &qkv.as_device_tensor()?,
            &q.as_device_tensor()?,
            &k.as_device_tensor()?,
            &v.as_device_tensor()?,
            d,
        )?;
        return Ok(out);
    }
    {
        let HeadDims { b, t, h, hd } = d;
        let c = h * hd;
        let src = qkv.f32()?;
        let src: &[f32] = &src;
        let (mut q, mut k, mut v) = (out[0].f32_mut()?, out[1].f32_mut()?, out[2].f32_mut()?);
        let per_b = h * t * hd;
        // Parts own whole sequences (copies: any split gives the same result).
        par::rows_mut3(
            (&mut q, per_b),
            (&mut k, per_b),
            (&mut v, per_b),
            b,
            par::ELEMENTWISE_GRAIN / (3 * per_b).max(1),
            |r, q, k, v| {
                for (j, bi) in r.enumerate() {
                    for ti in 0..t {
                        let row = &src[(bi * t + ti) * 3 * c..(bi * t + ti + 1) * 3 * c];
                        for hi in 0..h {
                            let dst = (j * h + hi) * t * hd + ti * hd;
                            q[dst..dst + hd].copy_from_slice(&row[hi * hd..(hi + 1) * hd]);
                            k[dst..dst + hd].copy_from_slice(&row[c + hi * hd..c + (hi + 1) * hd]);
                            v[dst..dst + hd]
                                .copy_from_slice(&row[2 * c + hi * hd..2 * c + (hi + 1) * hd]);
                        }
                    }
                }
                Ok(())
            },
        )?;
    }
    Ok(out)
}

/// `dq, dk, dv (B, H, T, hd)` -> `dqkv (B, T, 3C)`, the inverse of [`split_qkv`].
///
/// # Errors
/// As [`split_qkv`].
pub fn merge_qkv(dq: &Tensor, dk: &Tensor, dv: &Tensor, d: HeadDims) -> Result<Tensor> {
    let device = same_device("merge_qkv", &[dq, dk, dv])?;
    if let Some(lp) = lowp::lp_of(&[dq, dk, dv]) {
        let (q, k, v) = (lowp::up(dq)?, lowp::up(dk)?, lowp::up(dv)?);
        return lowp::down(&merge_qkv_native(&q, &k, &v, d, device)?, lp);
    }
    if super::double::any_f64(&[dq, dk, dv]) && !device.is_cuda() {
        for t in [dq, dk, dv] {
            check_numel("merge_qkv", t, d.numel())?;
        }
        return super::double::merge_qkv(dq, dk, dv, d);
    }
    merge_qkv_native(dq, dk, dv, d, device)
}

/// [`merge_qkv`] of f32 tensors (or f64 ones on CUDA), checked: the kernel on CUDA, else
/// the host loop.
fn merge_qkv_native(
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    d: HeadDims,
    device: Device,
) -> Result<Tensor> {
    let dt = compute_dtype("merge_qkv", &[dq, dk, dv], device)?;
    for t in [dq, dk, dv] {
        check_numel("merge_qkv", t, d.numel())?;
    }
    let c = d.h * d.hd;
    let dqkv = output_as(&[d.b, d.t, 3 * c], device, dt)?;
    if let Device::Cuda(i) = device {
        crate::backend::cuda::merge_qkv(
            &*super::stream(i)?,
            &dq.as_device_tensor()?,
            &dk.as_device_tensor()?,
            &dv.as_device_tensor()?,
            &dqkv.as_device_tensor()?,
            d,
        )?;
        return Ok(dqkv);
    }
    {
        let HeadDims { b, t, h, hd } = d;
        let (q, k, v) = (dq.f32()?, dk.f32()?, dv.f32()?);
        let (q, k, v): (&[f32], &[f32], &[f32]) = (&q, &k, &v);
        let mut out = dqkv.f32_mut()?;
        par::rows_mut(
            &mut out,
            b,
            t * 3 * c,
            par::ELEMENTWISE_GRAIN / (3 * t * c).max(1),
            |r, out| {
                for (j, bi) in r.enumerate() {
                    for hi in 0..h {
                        let bh = bi * h + hi;
                        for ti in 0..t {
                            let src = (bh * t + ti) * hd;
                            let row = &mut out[(j * t + ti) * 3 * c..][..3 * c];
                            row[hi * hd..][..hd].copy_from_slice(&q[src..src + hd]);
                            row[c + hi * hd..][..hd].copy_from_slice(&k[src..src + hd]);
                            row[2 * c + hi * hd..][..hd].copy_from_slice(&v[src..src + hd]);
                        }
                    }
                }
                Ok(())
            },
        )?;
    }
    Ok(dqkv)
}

/// `yh (B, H, T, hd)` -> `y (B, T, C)`: the heads side by side again.
///
/// # Errors
/// As [`split_qkv`].
pub fn merge_heads(yh: &Tensor, d: HeadDims) -> Result<Tensor> {
    if let Some(lp) = lowp::lp_of(&[yh]) {
        // An exact permute through f32.
        return lowp::map(yh, lp, |y| permute_heads("merge_heads", y, d, false));
    }
    permute_heads("merge_heads", yh, d, false)
}

/// `y (B, T, C)` -> `yh (B, H, T, hd)`, the inverse of [`merge_heads`].
///
/// # Errors
/// As [`split_qkv`].
pub fn split_heads(y: &Tensor, d: HeadDims) -> Result<Tensor> {
    if let Some(lp) = lowp::lp_of(&[y]) {
        return lowp::map(y, lp, |y| permute_heads("split_heads", y, d, true));
    }
    permute_heads("split_heads", y, d, true)
}

/// [`merge_heads`] (`split` false) or [`split_heads`] of an f32 or f64 tensor.
fn permute_heads(op: &'static str, src: &Tensor, d: HeadDims, split: bool) -> Result<Tensor> {
    let device = same_device(op, &[src])?;
    if super::double::any_f64(&[src]) && !device.is_cuda() {
        check_numel(op, src, d.numel())?;
        return super::double::permute_heads(src, d, split);
    }
    let dt = compute_dtype(op, &[src], device)?;
    check_numel(op, src, d.numel())?;
    let HeadDims { b, t, h, hd } = d;
    let c = h * hd;
    let dst = if split {
        output_as(&[b, h, t, hd], device, dt)?
    } else {
        output_as(&[b, t, c], device, dt)?
    };
    if let Device::Cuda(i) = device {
        crate::backend::cuda::permute_heads(
            &*super::stream(i)?,
            &src.as_device_tensor()?,
            &dst.as_device_tensor()?,
            d,
            split,
        )?;
        return Ok(dst);
    }
    {
        let (sv, mut dv) = (src.f32()?, dst.f32_mut()?);
        let sv: &[f32] = &sv;
        par::rows_mut(
            &mut dv,
            b,
            t * c,
            par::ELEMENTWISE_GRAIN / (t * c).max(1),
            |r, dv| {
                let base = r.start * t * c;
                for bi in r {
                    for hi in 0..h {
                        for ti in 0..t {
                            let head_major = ((bi * h + hi) * t + ti) * hd;
                            let token_major = (bi * t + ti) * c + hi * hd;
                            let (from, to) = if split {
                                (token_major, head_major)
                            } else {
                                (head_major, token_major)
                            };
                            dv[to - base..to - base + hd].copy_from_slice(&sv[from..from + hd]);
                        }
                    }
                }
                Ok(())
            },
        )?;
    }
    Ok(dst)
}

/// Causal softmax of attention scores `s (rows, T)` whose row `r` is query `r mod T`
/// (rows are `(B, H, T)` flattened): `p[j] = exp(s[j] scale - max) / sum` for `j <= t`,
/// 0 after. Returns `p`, shaped as `s`.
///
/// # Errors
/// `ShapeMismatch` when `s` does not hold a multiple of `T * T` elements; device, dtype and
/// CUDA errors.
pub fn softmax_causal(s: &Tensor, t: usize, scale: f32) -> Result<Tensor> {
    let device = same_device("softmax_causal", &[s])?;
    if let Some(lp) = lowp::lp_of(&[s]) {
        return lowp::map(s, lp, |s32| softmax_causal_native(s32, t, scale, device));
    }
    if super::double::any_f64(&[s]) {
        check_square_rows("softmax_causal", s, t)?;
        return softmax_causal_f64(s, t, f64::from(scale));
    }
    softmax_causal_native(s, t, scale, device)
}

/// [`softmax_causal`] of f32 scores, checked: the kernel on CUDA, else the host loop.
fn softmax_causal_native(s: &Tensor, t: usize, scale: f32, device: Device) -> Result<Tensor> {
    check_f32("softmax_causal", &[s])?;
    check_square_rows("softmax_causal", s, t)?;
    let p = output(s.shape(), device)?;
    if s.numel() == 0 {
        return Ok(p);
    }
    if let Device::Cuda(i) = device {
        crate::backend::cuda::softmax_causal_fwd(
            &*super::stream(i)?,
            &s.as_device_tensor()?,
            &p.as_device_tensor()?,
            t,
            f64::from(scale),
        )?;
        return Ok(p);
    }
    {
        let sv = s.f32()?;
        let sv: &[f32] = &sv;
        // Parts own whole (T, T) score matrices; each row is the reference loop.
        par::rows_mut(&mut p.f32_mut()?, s.numel() / (t * t), t * t, 1, |r, p| {
            fast::softmax_causal_fwd(&sv[r.start * t * t..r.end * t * t], p, t, scale)
        })?;
    }
    Ok(p)
}

/// Backward of [`softmax_causal`] in place: `dp` becomes `ds = p (dp - <p, dp>) scale` per
/// row (0 above the diagonal), the gradient of the scores.
///
/// # Errors
/// `ShapeMismatch` when `p` and `dp` differ; as [`softmax_causal`].
pub fn softmax_causal_backward_(p: &Tensor, dp: &Tensor, t: usize, scale: f32) -> Result<()> {
    let device = same_device("softmax_causal_backward_", &[p, dp])?;
    if lowp::lp_of(&[p, dp]).is_some() {
        // `dp` becomes the rounded score gradient.
        let p32 = lowp::up(p)?;
        return lowp::into(dp, true, |dp32| {
            softmax_causal_backward_native(&p32, dp32, t, scale, device)
        });
    }
    if super::double::any_f64(&[p, dp]) {
        return softmax_causal_backward_f64_(p, dp, t, f64::from(scale));
    }
    softmax_causal_backward_native(p, dp, t, scale, device)
}

/// [`softmax_causal_backward_`] of f32 tensors, checked: the kernel on CUDA, else the host
/// loop.
fn softmax_causal_backward_native(
    p: &Tensor,
    dp: &Tensor,
    t: usize,
    scale: f32,
    device: Device,
) -> Result<()> {
    check_f32("softmax_causal_backward_", &[p, dp])?;
    check_square_rows("softmax_causal_backward_", p, t)?;
    check_numel("softmax_causal_backward_", dp, p.numel())?;
    if p.shares_storage(dp) {
        crate::error::bail_arg!("softmax_causal_backward_: dp shares storage with p");
    }
    if p.numel() == 0 {
        return Ok(());
    }
    if let Device::Cuda(i) = device {
        let g = dp.as_device_tensor()?;
        return crate::backend::cuda::softmax_causal_bwd(
            &*super::stream(i)?,
            &p.as_device_tensor()?,
            &g,
            &g,
            t,
            f64::from(scale),
        );
    }
    let pv = p.f32()?;
    let pv: &[f32] = &pv;
    par::rows_mut(
        &mut dp.f32_mut()?,
        p.numel() / (t * t),
        t * t,
        1,
        |r, dp| fast::softmax_causal_bwd(&pv[r.start * t * t..r.end * t * t], dp, t, scale),
    )
}

/// [`softmax_causal`] of f64 scores with an f64 `scale` (a float64 attention passes
/// `1 / sqrt(hd)` in f64, where the f32 op's `scale` would round it): the host loop of
/// `double/`, or `softmax_causal_fwd_f64` on CUDA.
///
/// # Errors
/// As [`softmax_causal`]; `DTypeMismatch` unless `s` is f64.
#[doc(hidden)] // crate-internal, public only for the layers above
pub fn softmax_causal_f64(s: &Tensor, t: usize, scale: f64) -> Result<Tensor> {
    let device = same_device("softmax_causal", &[s])?;
    check_square_rows("softmax_causal", s, t)?;
    if s.numel() == 0 {
        return s.deep_clone();
    }
    if let Device::Cuda(i) = device {
        compute_dtype("softmax_causal", &[s], device)?;
        let p = output_as(s.shape(), device, DType::F64)?;
        crate::backend::cuda::softmax_causal_fwd(
            &*super::stream(i)?,
            &s.as_device_tensor()?,
            &p.as_device_tensor()?,
            t,
            scale,
        )?;
        return Ok(p);
    }
    super::double::softmax_causal(s, t, scale)
}

/// [`softmax_causal_backward_`] in f64 with an f64 `scale` (`softmax_causal_bwd_f64` on
/// CUDA).
///
/// # Errors
/// As [`softmax_causal_backward_`]; `DTypeMismatch` unless both are f64.
#[doc(hidden)] // crate-internal, public only for the layers above
pub fn softmax_causal_backward_f64_(p: &Tensor, dp: &Tensor, t: usize, scale: f64) -> Result<()> {
    let device = same_device("softmax_causal_backward_", &[p, dp])?;
    check_square_rows("softmax_causal_backward_", p, t)?;
    check_numel("softmax_causal_backward_", dp, p.numel())?;
    if p.shares_storage(dp) {
        crate::error::bail_arg!("softmax_causal_backward_: dp shares storage with p");
    }
    if p.numel() == 0 {
        return Ok(());
    }
    if let Device::Cuda(i) = device {
        compute_dtype("softmax_causal_backward_", &[p, dp], device)?;
        let g = dp.as_device_tensor()?;
        return crate::backend::cuda::softmax_causal_bwd(
            &*super::stream(i)?,
            &p.as_device_tensor()?,
            &g,
            &g,
            t,
            scale,
        );
    }
    super::double::softmax_causal_backward_(p, dp, t, scale)
}

fn check_square_rows(op: &'static str, s: &Tensor, t: usize) -> Result<()> {
    if (t == 0 && s.numel() != 0) || (t != 0 && s.numel() % (t * t) != 0) {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![0, t, t],
            got: s.shape().to_vec(),
        });
    }
    Ok(())
}
