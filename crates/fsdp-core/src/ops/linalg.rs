//! Matrix products on any device: [`matmul`] (row-major, transposes as flags, `=` or `+=`),
//! its batched form, [`linear`] (`F.linear`), and the bias row ops of a linear layer.
//!
//! CPU: [`crate::backend::cpu::gemm::matmul`] (the `gemm` crate) and plain row loops;
//! CUDA: cuBLAS (`backend::cuda::gemm_strided_batched`, f32 compute, no TF32) and
//! the `bias_*` kernels of `nn.cu`. Row reductions and GEMMs sum in another order on the
//! GPU, so CUDA results agree with the CPU to f32 rounding, not bitwise.

use super::autocast::gemm_dtype;
pub use super::types::MatmulDims;
use super::{check_f32, lowp, same_device};
use crate::backend::cpu::gemm;
pub use crate::backend::cpu::gemm::Transpose;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{bail_arg, Error, Result};
use crate::tensor::Tensor;

/// `out (m, n) = op(a) @ op(b)`, or `+=` when `accumulate` (`torch.matmul` /
/// `torch.addmm(out, a, b)`), f32 with f32 accumulation; inside an
/// [`autocast`](super::autocast::autocast) scope the operands are read as its bf16/f16.
/// f64 tensors multiply in f64 (the `gemm` crate's f64 kernels on the host; on CUDA cuBLAS with
/// `CUBLAS_COMPUTE_64F`).
/// Only element counts are checked against `d`: shapes are the caller's business.
///
/// # Errors
/// `DeviceMismatch`, `DTypeMismatch` (not f32), `ShapeMismatch` (counts disagree with `d`),
/// `InvalidArgument` when `out` shares storage with an input; [`Error::Cuda`].
pub fn matmul(out: &Tensor, a: &Tensor, b: &Tensor, d: MatmulDims, accumulate: bool) -> Result<()> {
    matmul_batched(out, a, b, d, 1, accumulate)
}

/// `batch` independent products over consecutive `(m, k)`, `(k, n)` and `(m, n)` blocks of
/// `a`, `b` and `out` (`torch.bmm`; attention's per-head products).
///
/// # Errors
/// As [`matmul`], with each tensor holding `batch` blocks.
pub fn matmul_batched(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    d: MatmulDims,
    batch: usize,
    accumulate: bool,
) -> Result<()> {
    let device = same_device("matmul", &[out, a, b])?;
    if lowp::lp_of(&[out, a, b]).is_some() {
        // f32 products of the widened operands, rounded once into `out`.
        let (a32, b32) = (lowp::up(a)?, lowp::up(b)?);
        return lowp::into(out, accumulate, |o32| {
            // The operands already hold their low-precision values: no second rounding.
            let _f32 = super::autocast(None);
            matmul_native(o32, &a32, &b32, d, batch, accumulate, device)
        });
    }
    if super::double::any_f64(&[out, a, b]) && !device.is_cuda() {
        check_operands(out, a, b, d, batch)?;
        return super::double::matmul_batched(out, a, b, d, batch, accumulate);
    }
    matmul_native(out, a, b, d, batch, accumulate, device)
}

/// The element counts of [`matmul_batched`]'s tensors against `d` and `batch`, and an
/// output apart from the inputs.
fn check_operands(out: &Tensor, a: &Tensor, b: &Tensor, d: MatmulDims, batch: usize) -> Result<()> {
    let MatmulDims { m, k, n, .. } = d;
    for (t, want) in [(a, m * k), (b, k * n), (out, m * n)] {
        if t.numel() != want * batch {
            return Err(Error::ShapeMismatch {
                op: "matmul",
                expected: vec![batch, want],
                got: t.shape().to_vec(),
            });
        }
    }
    if out.shares_storage(a) || out.shares_storage(b) {
        bail_arg!("matmul: the output {out:?} shares storage with an input");
    }
    Ok(())
}

/// [`matmul_batched`] of f32 tensors (or f64 ones on CUDA), checked: cuBLAS on CUDA, else
/// the `gemm` crate (both reading autocast's dtype).
fn matmul_native(
    out: &Tensor,
    a: &Tensor,
    b: &Tensor,
    d: MatmulDims,
    batch: usize,
    accumulate: bool,
    device: Device,
) -> Result<()> {
    let f64_path = super::double::any_f64(&[out, a, b]);
    if !f64_path {
        check_f32("matmul", &[out, a, b])?;
    }
    check_operands(out, a, b, d, batch)?;
    let MatmulDims { m, k, n, .. } = d;
    if let Device::Cuda(i) = device {
        use crate::backend::cuda;
        let g = cuda::GemmShape {
            m,
            k,
            n,
            trans: d.trans,
        };
        if k == 0 && accumulate {
            return Ok(()); // adds an empty sum
        }
        let beta = if accumulate { 1.0 } else { 0.0 };
        // Under autocast: bf16/f16 copies of both operands, cuBLAS lp x lp -> f32. f64
        // operands stay f64 (autocast leaves float64 ops alone): cuBLAS f64 compute.
        let (a, b) = match gemm_dtype().filter(|_| !f64_path) {
            Some(lp) => (a.to_dtype(lp)?, b.to_dtype(lp)?),
            None => (a.clone(), b.clone()),
        };
        return cuda::gemm_strided_batched(
            &*super::stream(i)?,
            &a.as_device_tensor()?,
            &b.as_device_tensor()?,
            &out.as_device_tensor()?,
            g,
            batch,
            beta,
        );
    }
    let (a, b) = (cpu_operand(a)?, cpu_operand(b)?);
    let (mut o, av, bv) = (out.f32_mut()?, a.f32()?, b.f32()?);
    gemm::matmul_batched(&mut o, &av, &bv, [m, k, n], d.trans, batch, accumulate)
}

/// `y (.., out) = x (.., in) @ weight (out, in)^T + bias (out)` (`F.linear`), a new f32
/// tensor on `x`'s device.
///
/// # Errors
/// `ShapeMismatch` when `x`'s last dimension is not `in` or the bias is not `(out)`; as
/// [`matmul`].
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (o, i) = match weight.shape() {
        [o, i] => (*o, *i),
        s => {
            return Err(Error::ShapeMismatch {
                op: "linear(weight)",
                expected: vec![0, 0],
                got: s.to_vec(),
            })
        }
    };
    if x.shape().last() != Some(&i) {
        return Err(Error::ShapeMismatch {
            op: "linear",
            expected: vec![i],
            got: x.shape().to_vec(),
        });
    }
    if let Some(b) = bias.filter(|b| b.numel() != o) {
        return Err(Error::ShapeMismatch {
            op: "linear(bias)",
            expected: vec![o],
            got: b.shape().to_vec(),
        });
    }
    let mut ts = vec![x, weight];
    ts.extend(bias);
    let device = same_device("linear", &ts)?;
    if let Some(lp) = lowp::lp_of(&ts) {
        // `x @ W^T + b` in f32 from the widened tensors, one rounding (PyTorch's `addmm` /
        // cuBLASLt bias epilogue).
        let (x32, w32) = (lowp::up(x)?, lowp::up(weight)?);
        let b32 = bias.map(lowp::up).transpose()?;
        let y = {
            let _f32 = super::autocast(None);
            linear_native(&x32, &w32, b32.as_ref(), (o, i), device)?
        };
        return lowp::down(&y, lp);
    }
    if super::double::any_f64(&ts) && !device.is_cuda() {
        return super::double::linear(x, weight, bias, o);
    }
    linear_native(x, weight, bias, (o, i), device)
}

/// [`linear`] of f32 tensors (or f64 ones on CUDA) of `weight (o, i)`, shapes checked:
/// the product then the bias on CUDA, the bias rows then the accumulated product on the
/// host.
fn linear_native(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    (o, i): (usize, usize),
    device: Device,
) -> Result<Tensor> {
    let mut ts = vec![x, weight];
    ts.extend(bias);
    let dt = super::compute_dtype("linear", &ts, device)?;
    let n: usize = x.shape()[..x.shape().len() - 1].iter().product();
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap_or(&mut 0) = o;
    let d = MatmulDims::new(n, i, o, Transpose::NT);
    if device.is_cuda() {
        let y = super::output_as(&shape, device, dt)?;
        matmul(&y, x, weight, d, false)?;
        if let Some(b) = bias {
            bias_add_(&y, b)?;
        }
        return Ok(y);
    }
    // y starts as the bias rows (zeros without one) and the product accumulates into it.
    let y = super::output(&shape, device)?;
    {
        let mut yv = y.f32_mut()?;
        let bv = bias.map(|b| b.f32()).transpose()?;
        let bs: Option<&[f32]> = bv.as_deref();
        par::rows_mut(
            &mut yv,
            n,
            o,
            par::ELEMENTWISE_GRAIN / o.max(1),
            |_, rows| {
                match bs {
                    Some(b) => rows
                        .chunks_exact_mut(o.max(1))
                        .for_each(|row| row.copy_from_slice(b)),
                    None => rows.fill(0.0),
                }
                Ok(())
            },
        )?;
        // y (n, o) += x (n, i) @ W^T, W stored (o, i)
        let (x, weight) = (cpu_operand(x)?, cpu_operand(weight)?);
        gemm::matmul(
            &mut yv,
            &x.f32()?,
            &weight.f32()?,
            d.m,
            d.k,
            d.n,
            d.trans,
            true,
        )?;
    }
    Ok(y)
}

/// A CPU GEMM operand as the product reads it: `t` itself, or inside an
/// [`autocast`](super::autocast::autocast) scope a copy rounded to its dtype.
pub(super) fn cpu_operand(t: &Tensor) -> Result<Tensor> {
    match gemm_dtype() {
        None => Ok(t.clone()),
        Some(lp) => super::flat::rounded(t, lp),
    }
}

/// The row count of `t` viewed as `(rows, c)`.
fn rows_of(op: &'static str, t: &Tensor, c: usize) -> Result<usize> {
    if (c == 0 && t.numel() != 0) || (c != 0 && t.numel() % c != 0) {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![0, c],
            got: t.shape().to_vec(),
        });
    }
    Ok(t.numel().checked_div(c).unwrap_or(0))
}

/// `y[r, j] += b[j]` over `y (rows, C)` and `b (C)` (adding a bias, or the position
/// embedding to every sequence of a batch).
///
/// # Errors
/// `ShapeMismatch` when `y`'s size is not a multiple of `C`; `InvalidArgument` when `y`
/// and `b` share storage; device and dtype errors.
pub fn bias_add_(y: &Tensor, b: &Tensor) -> Result<()> {
    let device = same_device("bias_add_", &[y, b])?;
    if lowp::lp_of(&[y, b]).is_some() {
        // y = round(y + b).
        return lowp::into(y, true, |y32| bias_add_native(y32, &lowp::up(b)?, device));
    }
    if super::double::any_f64(&[y, b]) && !device.is_cuda() {
        rows_of("bias_add_", y, b.numel())?;
        return super::double::bias_add_(y, b);
    }
    bias_add_native(y, b, device)
}

/// [`bias_add_`] of f32 tensors (or f64 ones on CUDA), checked: the kernel on CUDA, else
/// the host rows.
fn bias_add_native(y: &Tensor, b: &Tensor, device: Device) -> Result<()> {
    super::compute_dtype("bias_add_", &[y, b], device)?;
    let c = b.numel();
    rows_of("bias_add_", y, c)?;
    if y.shares_storage(b) {
        bail_arg!("bias_add_: {y:?} shares storage with the bias");
    }
    if c == 0 {
        return Ok(());
    }
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::bias_add(
            &*super::stream(i)?,
            &y.as_device_tensor()?,
            &b.as_device_tensor()?,
        );
    }
    let (mut yv, bv) = (y.f32_mut()?, b.f32()?);
    let bs: &[f32] = &bv;
    let rows = yv.len() / c;
    par::rows_mut(&mut yv, rows, c, par::ELEMENTWISE_GRAIN / c, |_, y| {
        for row in y.chunks_exact_mut(c) {
            crate::backend::cpu::ops::add_(row, bs);
        }
        Ok(())
    })
}

/// `db[j] += sum_r dy[r, j]` over `dy (rows, C)` and `db (C)`: a bias gradient. The CPU
/// adds the rows into `db` one after another; CUDA sums each column in order, then adds.
///
/// # Errors
/// As [`bias_add_`].
pub fn bias_grad(dy: &Tensor, db: &Tensor) -> Result<()> {
    let device = same_device("bias_grad", &[dy, db])?;
    if lowp::lp_of(&[dy, db]).is_some() {
        // db = round(db + sum_rows(dy)).
        let dy32 = lowp::up(dy)?;
        return lowp::into(db, true, |db32| bias_grad_native(&dy32, db32, device));
    }
    if super::double::any_f64(&[dy, db]) && !device.is_cuda() {
        rows_of("bias_grad", dy, db.numel())?;
        return super::double::bias_grad(dy, db);
    }
    bias_grad_native(dy, db, device)
}

/// [`bias_grad`] of f32 tensors (or f64 ones on CUDA), checked: the kernel on CUDA, else
/// the host columns.
fn bias_grad_native(dy: &Tensor, db: &Tensor, device: Device) -> Result<()> {
    super::compute_dtype("bias_grad", &[dy, db], device)?;
    let c = db.numel();
    rows_of("bias_grad", dy, c)?;
    if dy.shares_storage(db) {
        bail_arg!("bias_grad: {db:?} shares storage with the gradient it sums");
    }
    if c == 0 {
        return Ok(());
    }
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::bias_grad(
            &*super::stream(i)?,
            &dy.as_device_tensor()?,
            &db.as_device_tensor()?,
        );
    }
    let (dyv, mut g) = (dy.f32()?, db.f32_mut()?);
    let dys: &[f32] = &dyv;
    // Parts own columns and add every row in order ([Note: determinism across thread
    // counts] in `backend::cpu::parallel`).
    par::cols_mut(&mut g, dys.len() / c, |cols, g| {
        for row in dys.chunks_exact(c) {
            crate::backend::cpu::ops::add_(g, &row[cols.clone()]);
        }
        Ok(())
    })
}

/// `op(a) @ op(b)` as a new f32 tensor (`torch.matmul(a, b)`, with `a.T` / `b.T` as the
/// flags of `trans`), on the inputs' device: the GEMM of [`matmul`].
///
/// Shapes: `b` is 2-D, stored `(k, n)`, or `(n, k)` when `trans.b`. Without `trans.a`, `a`
/// is `(.., k)` (leading dimensions are rows, as `x @ W`) and the result `(.., n)`; with
/// `trans.a`, `a` is 2-D stored `(k, m)` and the result `(m, n)`.
///
/// ```
/// use fsdp_core::ops::{mm, Transpose};
/// use fsdp_core::tensor::Tensor;
/// let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// let w = Tensor::from_vec(vec![1.0f32, 0.0, 1.0, 1.0, 2.0, 0.0], &[3, 2])?; // (out, in)
/// let y = mm(&x, &w, Transpose::NT)?; // x @ w.T, as F.linear without bias
/// assert_eq!((y.shape(), y.to_vec_f32()?), (&[2, 3][..], vec![1.0, 3.0, 2.0, 3.0, 7.0, 6.0]));
/// # Ok::<(), fsdp_core::Error>(())
/// ```
///
/// # Errors
/// `ShapeMismatch` when the inner sizes differ or an operand has the wrong rank; as
/// [`matmul`].
pub fn mm(a: &Tensor, b: &Tensor, trans: Transpose) -> Result<Tensor> {
    let (m, k, n, out_shape) = mm_shapes(a, b, trans)?;
    let out = super::output(&out_shape, same_device("mm", &[a, b])?)?;
    matmul(&out, a, b, MatmulDims::new(m, k, n, trans), false)?;
    Ok(out)
}

/// `(m, k, n, output shape)` of [`mm`].
fn mm_shapes(
    a: &Tensor,
    b: &Tensor,
    trans: Transpose,
) -> Result<(usize, usize, usize, Vec<usize>)> {
    let bad = |expected: Vec<usize>, t: &Tensor| Error::ShapeMismatch {
        op: "mm",
        expected,
        got: t.shape().to_vec(),
    };
    let (bk, n) = match (b.shape(), trans.b) {
        ([k, n], false) | ([n, k], true) => (*k, *n),
        _ => return Err(bad(vec![0, 0], b)),
    };
    let (m, k, mut shape) = match (a.shape(), trans.a) {
        ([k, m], true) => (*m, *k, vec![*m]),
        (s, false) if !s.is_empty() => {
            let (k, lead) = s.split_last().unwrap_or((&0, &[]));
            (lead.iter().product(), *k, lead.to_vec())
        }
        _ => return Err(bad(vec![0, 0], a)),
    };
    if k != bk {
        return Err(bad(vec![k], b));
    }
    shape.push(n);
    Ok((m, k, n, shape))
}

/// Gradients of `y = mm(a, b, trans)`: `(da, db)` in the stored shapes of `a` and `b`
/// (`dA = dy @ op(b)^T`, `dB = op(a)^T @ dy`, transposed back where stored transposed).
///
/// # Errors
/// `ShapeMismatch` when `dy` is not the product's shape; as [`mm`].
pub fn mm_backward(
    dy: &Tensor,
    a: &Tensor,
    b: &Tensor,
    trans: Transpose,
) -> Result<(Tensor, Tensor)> {
    let (m, k, n, shape) = mm_shapes(a, b, trans)?;
    if dy.shape() != shape.as_slice() {
        return Err(Error::ShapeMismatch {
            op: "mm_backward",
            expected: shape,
            got: dy.shape().to_vec(),
        });
    }
    let device = same_device("mm_backward", &[dy, a, b])?;
    let (da, db) = (
        super::output(a.shape(), device)?,
        super::output(b.shape(), device)?,
    );
    let t = |a, b| Transpose { a, b };
    if trans.a {
        // da (k, m) = op(b) (k, n) @ dy^T (n, m)
        matmul(
            &da,
            b,
            dy,
            MatmulDims::new(k, n, m, t(trans.b, true)),
            false,
        )?;
    } else {
        // da (m, k) = dy (m, n) @ op(b)^T (n, k)
        matmul(
            &da,
            dy,
            b,
            MatmulDims::new(m, n, k, t(false, !trans.b)),
            false,
        )?;
    }
    if trans.b {
        // db (n, k) = dy^T (n, m) @ op(a) (m, k)
        matmul(
            &db,
            dy,
            a,
            MatmulDims::new(n, m, k, t(true, trans.a)),
            false,
        )?;
    } else {
        // db (k, n) = op(a)^T (k, m) @ dy (m, n)
        matmul(
            &db,
            a,
            dy,
            MatmulDims::new(k, m, n, t(!trans.a, false)),
            false,
        )?;
    }
    Ok((da, db))
}
