//! Ops over one dimension: [`sum_dim`] and [`mean_dim`] (`torch.sum(x, dim, keepdim)`,
//! `torch.mean`), [`cat`] and [`split`] (`torch.cat`, `torch.split` with a list of sizes),
//! and their backward helpers (`aten/src/ATen/native/ReduceOps.cpp`, `TensorShape.cpp`).
//!
//! A dimension is an `isize` as in PyTorch: `-1` is the last. Every op views its input as
//! `(outer, n, inner)` around the dimension, so all run as plain row loops. f32, CPU
//! reference (`Unsupported` on CUDA, as in `arith.rs`).
//!
//! ```
//! use fsdp_core::ops::{cat, mean_dim, split, sum_dim};
//! use fsdp_core::tensor::Tensor;
//! let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! assert_eq!(sum_dim(&x, 0, false)?.to_vec_f32()?, [5.0, 7.0, 9.0]);
//! let m = mean_dim(&x, -1, true)?;
//! assert_eq!((m.shape(), m.to_vec_f32()?), (&[2, 1][..], vec![2.0, 5.0]));
//! let parts = split(&x, &[1, 2], 1)?;
//! assert_eq!(parts[1].to_vec_f32()?, [2.0, 3.0, 5.0, 6.0]);
//! assert_eq!(cat(&[&parts[0], &parts[1]], 1)?.to_vec_f32()?, x.to_vec_f32()?);
//! # Ok::<(), fsdp_core::Error>(())
//! ```

use super::arith::cpu_f32;
use crate::backend::Device;
use crate::error::{bail_arg, Result};
use crate::tensor::{DType, Tensor};

/// `dim` (negative counts from the end) as an index into a shape of `ndim` dimensions.
///
/// # Errors
/// `InvalidArgument` naming `op` when it is out of range (PyTorch's `IndexError`).
pub fn normalize_dim(op: &str, dim: isize, ndim: usize) -> Result<usize> {
    let d = if dim < 0 { dim + ndim as isize } else { dim };
    if d < 0 || d as usize >= ndim {
        bail_arg!(
            "{op}: dimension {dim} out of range for a tensor of {ndim} dimension(s) (expected -{ndim}..{ndim})"
        );
    }
    Ok(d as usize)
}

/// `(outer, n, inner)`: the products of the dimensions before `d`, `shape[d]`, after `d`.
fn around(shape: &[usize], d: usize) -> (usize, usize, usize) {
    (
        shape[..d].iter().product(),
        shape[d],
        shape[d + 1..].iter().product(),
    )
}

/// The shape of a reduction of `shape` over `d`: `d` kept as 1 or dropped.
fn reduced(shape: &[usize], d: usize, keepdim: bool) -> Vec<usize> {
    let mut s = shape.to_vec();
    if keepdim {
        s[d] = 1;
    } else {
        s.remove(d);
    }
    s
}

/// `out (outer, inner) = sum_j x (outer, j, inner)`, scaled by `scale`.
fn reduce(x: &Tensor, op: &'static str, dim: isize, keepdim: bool, mean: bool) -> Result<Tensor> {
    cpu_f32(op, &[x])?;
    let d = normalize_dim(op, dim, x.shape().len())?;
    let (outer, n, inner) = around(x.shape(), d);
    let out = Tensor::zeros_on(&reduced(x.shape(), d, keepdim), DType::F32, Device::Cpu)?;
    {
        let (xv, mut ov) = (x.f32()?, out.f32_mut()?);
        for o in 0..outer {
            let dst = &mut ov[o * inner..(o + 1) * inner];
            for j in 0..n {
                let row = &xv[(o * n + j) * inner..(o * n + j + 1) * inner];
                dst.iter_mut().zip(row).for_each(|(a, &b)| *a += b);
            }
            if mean {
                // PyTorch: the mean of no elements is NaN (0 / 0).
                dst.iter_mut().for_each(|a| *a /= n as f32);
            }
        }
    }
    Ok(out)
}

/// `x` summed over `dim` (`torch.sum(x, dim, keepdim)`), f32, summing in index order.
///
/// # Errors
/// `InvalidArgument` for a dimension out of range; `DTypeMismatch`; `Unsupported` on CUDA.
pub fn sum_dim(x: &Tensor, dim: isize, keepdim: bool) -> Result<Tensor> {
    reduce(x, "sum_dim", dim, keepdim, false)
}

/// The mean of `x` over `dim` (`torch.mean(x, dim, keepdim)`); NaN where `dim` has size 0.
///
/// # Errors
/// As [`sum_dim`].
pub fn mean_dim(x: &Tensor, dim: isize, keepdim: bool) -> Result<Tensor> {
    reduce(x, "mean_dim", dim, keepdim, true)
}

/// The gradient of [`sum_dim`] (with `mean`, of [`mean_dim`]): `dy` (with or without the
/// kept dimension) repeated along `dim` to `input_shape` (and divided by its size).
///
/// # Errors
/// `ShapeMismatch` when `dy` has not the reduced shape; as [`sum_dim`].
pub fn sum_dim_backward(
    dy: &Tensor,
    input_shape: &[usize],
    dim: isize,
    mean: bool,
) -> Result<Tensor> {
    cpu_f32("sum_dim_backward", &[dy])?;
    let d = normalize_dim("sum_dim_backward", dim, input_shape.len())?;
    if dy.shape() != reduced(input_shape, d, true) && dy.shape() != reduced(input_shape, d, false) {
        return Err(crate::error::Error::ShapeMismatch {
            op: "sum_dim_backward",
            expected: reduced(input_shape, d, false),
            got: dy.shape().to_vec(),
        });
    }
    let (outer, n, inner) = around(input_shape, d);
    let out = super::output(input_shape, Device::Cpu)?;
    {
        let (gv, mut ov) = (dy.f32()?, out.f32_mut()?);
        let scale = if mean { 1.0 / n as f32 } else { 1.0 };
        for o in 0..outer {
            let src = &gv[o * inner..(o + 1) * inner];
            for j in 0..n {
                let dst = &mut ov[(o * n + j) * inner..(o * n + j + 1) * inner];
                dst.iter_mut().zip(src).for_each(|(a, &b)| *a = b * scale);
            }
        }
    }
    Ok(out)
}

/// `ts` joined along `dim` (`torch.cat(ts, dim)`): every tensor has the same number of
/// dimensions and the same sizes except along `dim`.
///
/// # Errors
/// `InvalidArgument` for no tensors, a dimension out of range, or shapes that differ
/// elsewhere than `dim`; as [`sum_dim`].
pub fn cat(ts: &[&Tensor], dim: isize) -> Result<Tensor> {
    let Some(first) = ts.first() else {
        bail_arg!("cat: expected a non-empty list of tensors");
    };
    cpu_f32("cat", ts)?;
    let d = normalize_dim("cat", dim, first.shape().len())?;
    let mut shape = first.shape().to_vec();
    shape[d] = 0;
    for (i, t) in ts.iter().enumerate() {
        let s = t.shape();
        let same = s.len() == shape.len()
            && s.iter()
                .zip(first.shape())
                .enumerate()
                .all(|(k, (a, b))| k == d || a == b);
        if !same {
            bail_arg!(
                "cat: tensor {i} has shape {s:?}; expected {:?} except along dimension {d}",
                first.shape()
            );
        }
        shape[d] += s[d];
    }
    let (outer, n, inner) = around(&shape, d);
    let out = super::output(&shape, Device::Cpu)?;
    {
        let mut ov = out.f32_mut()?;
        let mut at = 0;
        for t in ts {
            let k = t.shape()[d] * inner;
            let tv = t.f32()?;
            for o in 0..outer {
                let dst = o * n * inner + at;
                ov[dst..dst + k].copy_from_slice(&tv[o * k..(o + 1) * k]);
            }
            at += k;
        }
    }
    Ok(out)
}

/// `x` cut along `dim` into pieces of `sizes` (`torch.split(x, sizes, dim)`), each a new
/// tensor; the sizes add up to `x.shape()[dim]`.
///
/// # Errors
/// `InvalidArgument` when the sizes do not add up or the dimension is out of range; as
/// [`sum_dim`].
pub fn split(x: &Tensor, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
    cpu_f32("split", &[x])?;
    let d = normalize_dim("split", dim, x.shape().len())?;
    // Checked: sizes that overflow must not wrap around to the right total.
    let total = sizes
        .iter()
        .try_fold(0usize, |acc, &s| acc.checked_add(s))
        .unwrap_or(usize::MAX);
    if total != x.shape()[d] {
        bail_arg!(
            "split: sizes {sizes:?} add up to {total}, but dimension {d} of {:?} has {}",
            x.shape(),
            x.shape()[d]
        );
    }
    let (outer, n, inner) = around(x.shape(), d);
    let xv = x.f32()?;
    let mut at = 0;
    let mut out = Vec::with_capacity(sizes.len());
    for &s in sizes {
        let mut shape = x.shape().to_vec();
        shape[d] = s;
        let t = super::output(&shape, Device::Cpu)?;
        {
            let mut tv = t.f32_mut()?;
            let k = s * inner;
            for o in 0..outer {
                let src = o * n * inner + at;
                tv[o * k..(o + 1) * k].copy_from_slice(&xv[src..src + k]);
            }
            at += s * inner;
        }
        out.push(t);
    }
    Ok(out)
}

/// The gradient of [`cat`]: `dy` split back into the inputs' sizes along `dim`.
///
/// # Errors
/// As [`split`].
pub fn cat_backward(dy: &Tensor, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
    split(dy, sizes, dim)
}

/// The gradient of [`split`]: the pieces' gradients joined along `dim`.
///
/// # Errors
/// As [`cat`].
pub fn split_backward(grads: &[&Tensor], dim: isize) -> Result<Tensor> {
    cat(grads, dim)
}
