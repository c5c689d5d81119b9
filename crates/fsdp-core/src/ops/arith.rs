//! Elementwise arithmetic with PyTorch broadcasting (`torch.add`, `sub`, `mul`, `div`;
//! `aten/src/ATen/native/BinaryOps.cpp`, broadcasting as `torch.broadcast_shapes`) and the
//! helpers their backward passes need ([`sum_to_shape`], `Tensor.sum_to_size`).
//!
//! Shapes broadcast as in PyTorch: aligned at the last dimension, each pair equal or one
//! of them 1 (or missing). f32 tensors; CPU reference loops (the CUDA backend has no
//! kernels for these yet: a clear `Unsupported` error there).
//!
//! ```
//! use fsdp_core::ops::{mul, mul_backward, sum_to_shape};
//! use fsdp_core::tensor::Tensor;
//! let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! let g = Tensor::from_vec(vec![10.0f32, 20.0, 30.0], &[3])?; // broadcast over rows
//! let y = mul(&x, &g)?;
//! assert_eq!(y.to_vec_f32()?, [10.0, 40.0, 90.0, 40.0, 100.0, 180.0]);
//! let dy = Tensor::from_vec(vec![1.0f32; 6], &[2, 3])?;
//! let (dx, dg) = mul_backward(&dy, &x, &g)?;
//! assert_eq!(dg.shape(), [3]); // summed over the broadcast rows
//! assert_eq!(dg.to_vec_f32()?, [5.0, 7.0, 9.0]);
//! assert_eq!(dx.to_vec_f32()?, g.to_vec_f32()?.repeat(2));
//! assert_eq!(sum_to_shape(&dy, &[1, 3])?.to_vec_f32()?, [2.0, 2.0, 2.0]);
//! # Ok::<(), fsdp_core::Error>(())
//! ```

use super::{check_f32, same_device};
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// An elementwise binary operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b` (`torch.add`).
    Add,
    /// `a - b` (`torch.sub`).
    Sub,
    /// `a * b` (`torch.mul`).
    Mul,
    /// `a / b` (`torch.div`, true division: `x / 0` is `inf` or `NaN`, as IEEE says).
    Div,
}

impl BinaryOp {
    fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
        }
    }

    #[inline]
    fn apply(self, x: f32, y: f32) -> f32 {
        match self {
            BinaryOp::Add => x + y,
            BinaryOp::Sub => x - y,
            BinaryOp::Mul => x * y,
            BinaryOp::Div => x / y,
        }
    }
}

/// The device of `ts` when it is the CPU: the ops of this file and `axis.rs` have CPU
/// loops only.
///
/// # Errors
/// `DeviceMismatch`, `NotMaterialized` (meta), `Unsupported` on CUDA; `DTypeMismatch` when
/// one is not f32.
pub(crate) fn cpu_f32(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    let d = same_device(op, ts)?;
    if d != Device::Cpu {
        return Err(Error::Unsupported(format!(
            "ops::{op} on {d}: only the CPU reference exists so far; move the tensors with Tensor::to_device(Device::Cpu) or use the fused layer ops"
        )));
    }
    check_f32(op, ts)
}

/// `t = -t` for a CPU f32 tensor (the results of this file): the host loop of
/// [`scale_`](super::scale_) by -1, the same bits, without a dependency on `elementwise.rs`
/// (whose `add` broadcasts through [`binary`]).
fn neg_(t: &Tensor) -> Result<()> {
    par::chunks_mut(&mut t.f32_mut()?, par::ELEMENTWISE_GRAIN, |_, d| {
        crate::backend::cpu::ops::scale_(d, -1.0);
        Ok(())
    })
}

/// The shape `a` and `b` broadcast to (`torch.broadcast_shapes`).
///
/// # Errors
/// `ShapeMismatch` naming `op` when a dimension pair is neither equal nor has a 1.
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| (i + s.len()).checked_sub(n).map_or(1, |j| s[j]);
    (0..n)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Ok(x),
            (1, y) => Ok(y),
            _ => Err(Error::ShapeMismatch {
                op,
                expected: a.to_vec(),
                got: b.to_vec(),
            }),
        })
        .collect()
}

/// Strides of `shape` (row-major) aligned to `out` (which it broadcasts to): 0 where
/// `shape` has a 1 or no dimension.
fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for (i, &d) in shape.iter().enumerate().rev() {
        let j = out.len() - shape.len() + i;
        strides[j] = if d == 1 { 0 } else { s };
        s *= d;
    }
    strides
}

/// Calls `f(out_row, offsets)` for every row of `out` (its last dimension), with each
/// input's element offset at the row's start; the inputs' strides along the row are
/// `strides[k][last]`. Rows run in order.
fn for_each_row(out: &[usize], strides: &[Vec<usize>], mut f: impl FnMut(usize, &[usize])) {
    let nd = out.len();
    let (rows, width) = match out.split_last() {
        Some((&w, lead)) => (lead.iter().product::<usize>(), w),
        None => (1, 1),
    };
    if width == 0 || rows == 0 {
        return;
    }
    let mut idx = vec![0usize; nd.saturating_sub(1)];
    let mut offs = vec![0usize; strides.len()];
    for r in 0..rows {
        f(r, &offs);
        // Next row: increment the multi-index of the leading dimensions.
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            for (o, s) in offs.iter_mut().zip(strides) {
                *o += s[d];
            }
            if idx[d] < out[d] {
                break;
            }
            for (o, s) in offs.iter_mut().zip(strides) {
                *o -= s[d] * out[d];
            }
            idx[d] = 0;
        }
    }
}

/// `a op b` with broadcasting, a new f32 tensor of the broadcast shape.
///
/// # Errors
/// `ShapeMismatch` for shapes that do not broadcast; `DTypeMismatch` (not f32);
/// `DeviceMismatch`; `Unsupported` on CUDA.
pub fn binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let name = op.name();
    cpu_f32(name, &[a, b])?;
    let shape = broadcast_shape(name, a.shape(), b.shape())?;
    let out = super::output(&shape, Device::Cpu)?;
    {
        let (av, bv, mut ov) = (a.f32()?, b.f32()?, out.f32_mut()?);
        if a.shape() == b.shape() {
            for ((o, &x), &y) in ov.iter_mut().zip(av.iter()).zip(bv.iter()) {
                *o = op.apply(x, y);
            }
        } else {
            let st = [
                broadcast_strides(a.shape(), &shape),
                broadcast_strides(b.shape(), &shape),
            ];
            let w = shape.last().copied().unwrap_or(1);
            let (sa, sb) = (
                st[0].last().copied().unwrap_or(0),
                st[1].last().copied().unwrap_or(0),
            );
            for_each_row(&shape, &st, |r, offs| {
                for (j, o) in ov[r * w..(r + 1) * w].iter_mut().enumerate() {
                    *o = op.apply(av[offs[0] + j * sa], bv[offs[1] + j * sb]);
                }
            });
        }
    }
    Ok(out)
}

/// `a - b` with broadcasting (`torch.sub`).
///
/// # Errors
/// As [`binary`].
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(BinaryOp::Sub, a, b)
}

/// `a * b` with broadcasting (`torch.mul`).
///
/// # Errors
/// As [`binary`].
pub fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(BinaryOp::Mul, a, b)
}

/// `a / b` with broadcasting (`torch.div`, true division).
///
/// # Errors
/// As [`binary`].
pub fn div(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    binary(BinaryOp::Div, a, b)
}

/// `g` summed over the dimensions that `shape` broadcasts along, with `shape` as its shape
/// (`Tensor.sum_to_size(shape)`): the gradient of an input that was broadcast. Sums in
/// element order (deterministic).
///
/// # Errors
/// `ShapeMismatch` when `shape` does not broadcast to `g`'s shape; as [`binary`].
pub fn sum_to_shape(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    cpu_f32("sum_to_shape", &[g])?;
    if broadcast_shape("sum_to_shape", g.shape(), shape)? != g.shape() {
        return Err(Error::ShapeMismatch {
            op: "sum_to_shape",
            expected: g.shape().to_vec(),
            got: shape.to_vec(),
        });
    }
    if shape == g.shape() {
        return g.deep_clone();
    }
    let out = Tensor::zeros_on(shape, crate::tensor::DType::F32, Device::Cpu)?;
    {
        let (gv, mut ov) = (g.f32()?, out.f32_mut()?);
        let st = [broadcast_strides(shape, g.shape())];
        let w = g.shape().last().copied().unwrap_or(1);
        let s = st[0].last().copied().unwrap_or(0);
        for_each_row(g.shape(), &st, |r, offs| {
            for (j, &x) in gv[r * w..(r + 1) * w].iter().enumerate() {
                ov[offs[0] + j * s] += x;
            }
        });
    }
    Ok(out)
}

/// Gradients of `y = a * b` (broadcast): `(sum_to(dy * b, a), sum_to(dy * a, b))`.
///
/// # Errors
/// As [`binary`] and [`sum_to_shape`].
pub fn mul_backward(dy: &Tensor, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((
        sum_to_shape(&mul(dy, b)?, a.shape())?,
        sum_to_shape(&mul(dy, a)?, b.shape())?,
    ))
}

/// Gradients of `y = a / b` (broadcast): `(sum_to(dy / b, a), sum_to(-dy * a / b^2, b))`.
///
/// # Errors
/// As [`binary`] and [`sum_to_shape`].
pub fn div_backward(dy: &Tensor, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let da = div(dy, b)?;
    // -dy a / b^2 = -(dy / b) * (a / b)
    let db = mul(&da, &div(a, b)?)?;
    neg_(&db)?;
    Ok((sum_to_shape(&da, a.shape())?, sum_to_shape(&db, b.shape())?))
}

/// Gradients of `y = a - b` (broadcast) for inputs of shapes `a` and `b`:
/// `(sum_to(dy, a), -sum_to(dy, b))`. (`y = a + b`: negate nothing, [`sum_to_shape`] twice.)
///
/// # Errors
/// As [`sum_to_shape`].
pub fn sub_backward(dy: &Tensor, a: &[usize], b: &[usize]) -> Result<(Tensor, Tensor)> {
    let db = sum_to_shape(dy, b)?;
    neg_(&db)?;
    Ok((sum_to_shape(dy, a)?, db))
}
