//! Embedding lookup and its gradient on any device (`F.embedding`). CPU:
//! [`crate::backend::cpu::kernels::embedding_fwd`] / `embedding_bwd` (row copies, rows
//! added in order); CUDA: `embedding_*_f32` of `nn.cu` (the backward adds repeated ids with
//! atomics, in any order); f64 tables: `embedding_*_f64` on CUDA, the host loops of
//! `double/` on the CPU.

use super::{lowp, same_device};
use crate::backend::cpu::kernels as cpu;
use crate::backend::cpu::parallel as par;
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

fn table_dims(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match t.shape() {
        [v, c] => Ok((*v, *c)),
        s => Err(Error::ShapeMismatch {
            op,
            expected: vec![0, 0],
            got: s.to_vec(),
        }),
    }
}

fn check_ids(op: &'static str, ids: &Tensor) -> Result<()> {
    if ids.dtype() != DType::I32 {
        return Err(Error::DTypeMismatch {
            op,
            expected: DType::I32,
            got: ids.dtype(),
        });
    }
    Ok(())
}

/// `out[.., :] = table (V, C)[ids[..], :]` for i32 `ids` of any shape `S`; `out (S.., C)`
/// is a new f32 tensor on their device. A table of width `C = 0` gives `(S.., 0)` (ids
/// still checked against `V`). On CUDA nothing waits for the device: the ids are checked
/// there, and a bad one is reported by the calling thread's next read to the host (as
/// PyTorch's device-side assert, but naming the position).
///
/// # Errors
/// `InvalidArgument` naming the first id outside `0..V` (on CUDA, from the next host
/// read); `DTypeMismatch` (ids not i32, table not f32); `ShapeMismatch` (table not 2-D);
/// device and CUDA errors.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let device = same_device("embedding", &[table, ids])?;
    if let Some(lp) = lowp::lp_of(&[table]) {
        // The table's rows, exactly, in its dtype.
        return lowp::map(table, lp, |t32| embedding_native(t32, ids, device));
    }
    if super::double::any_f64(&[table]) && !device.is_cuda() {
        let (v, shape) = out_shape(table, ids)?;
        super::double::check("embedding", &[table])?;
        let iv = ids.data::<i32>()?;
        if let Some(i) = iv.iter().position(|&id| id < 0 || id as usize >= v) {
            let id = iv[i];
            crate::error::bail_arg!(
                "embedding: token id {id} at position {i} is outside the vocabulary 0..{v}"
            );
        }
        return super::double::embedding(table, &iv, &shape);
    }
    embedding_native(table, ids, device)
}

/// The vocabulary size `V` and the output shape `(ids.., C)` of [`embedding`], checked.
fn out_shape(table: &Tensor, ids: &Tensor) -> Result<(usize, Vec<usize>)> {
    check_ids("embedding", ids)?;
    let (v, c) = table_dims("embedding", table)?;
    let mut shape = ids.shape().to_vec();
    shape.push(c);
    Ok((v, shape))
}

/// [`embedding`] of an f32 table (or an f64 one on CUDA), checked: the kernel on CUDA,
/// else the host loop.
fn embedding_native(table: &Tensor, ids: &Tensor, device: Device) -> Result<Tensor> {
    let dt = super::compute_dtype("embedding", &[table], device)?;
    let (v, shape) = out_shape(table, ids)?;
    let c = shape.last().copied().unwrap_or(0);
    let out = super::output_as(&shape, device, dt)?;
    if c == 0 {
        // Nothing to copy, but a bad id is still an error (as `F.embedding` on a (V, 0)
        // table): check the ids on the host, where the kernels cannot (they find V as
        // the table's size over C).
        let host = ids.to_device(crate::backend::Device::Cpu)?;
        let bad = host
            .data::<i32>()?
            .iter()
            .position(|&id| id < 0 || id as usize >= v);
        if let Some(i) = bad {
            let id = host.data::<i32>()?[i];
            crate::error::bail_arg!(
                "embedding: token id {id} at position {i} is outside the vocabulary 0..{v}"
            );
        }
        return Ok(out);
    }
    if let Device::Cuda(i) = device {
        crate::backend::cuda::embedding_fwd(
            &*super::stream(i)?,
            &ids.as_device_tensor()?,
            &table.as_device_tensor()?,
            &out.as_device_tensor()?,
        )?;
        return Ok(out);
    }
    let (iv, tv) = (ids.data::<i32>()?, table.f32()?);
    if let Some(i) = iv.iter().position(|&id| id < 0 || id as usize >= v) {
        let id = iv[i];
        crate::error::bail_arg!(
            "embedding: token id {id} at position {i} is outside the vocabulary 0..{v}"
        );
    }
    let (is, ts): (&[i32], &[f32]) = (&iv, &tv);
    par::rows_mut(
        &mut out.f32_mut()?,
        is.len(),
        c,
        par::ELEMENTWISE_GRAIN / c,
        |r, o| cpu::embedding_fwd(&is[r], ts, c, o),
    )?;
    Ok(out)
}

/// `grad (V, C)[ids[i], :] += dout[i, :]` (`+=`; repeated ids add up; ids outside `0..V`
/// are skipped, the forward reported them).
///
/// # Errors
/// `ShapeMismatch` when `dout` does not hold `ids.numel() * C` elements; as [`embedding`].
pub fn embedding_backward(ids: &Tensor, dout: &Tensor, grad: &Tensor) -> Result<()> {
    let device = same_device("embedding_backward", &[ids, dout, grad])?;
    if lowp::lp_of(&[dout, grad]).is_some() {
        // grad = round(grad + scatter-add of dout), the scatter summed in f32.
        let d32 = lowp::up(dout)?;
        return lowp::into(grad, true, |g32| {
            embedding_backward_native(ids, &d32, g32, device)
        });
    }
    if super::double::any_f64(&[dout, grad]) && !device.is_cuda() {
        backward_cols(ids, dout, grad)?;
        return super::double::embedding_backward(ids, dout, grad);
    }
    embedding_backward_native(ids, dout, grad, device)
}

/// The row length `C` of [`embedding_backward`]'s gradient, checked against `ids`, `dout`.
fn backward_cols(ids: &Tensor, dout: &Tensor, grad: &Tensor) -> Result<usize> {
    check_ids("embedding_backward", ids)?;
    let (_, c) = table_dims("embedding_backward", grad)?;
    if dout.numel() != ids.numel() * c {
        return Err(Error::ShapeMismatch {
            op: "embedding_backward",
            expected: vec![ids.numel(), c],
            got: dout.shape().to_vec(),
        });
    }
    Ok(c)
}

/// [`embedding_backward`] of f32 tensors (or f64 ones on CUDA), checked: the kernel on
/// CUDA, else the host loop.
fn embedding_backward_native(
    ids: &Tensor,
    dout: &Tensor,
    grad: &Tensor,
    device: Device,
) -> Result<()> {
    super::compute_dtype("embedding_backward", &[dout, grad], device)?;
    let c = backward_cols(ids, dout, grad)?;
    if let Device::Cuda(i) = device {
        return crate::backend::cuda::embedding_bwd(
            &*super::stream(i)?,
            &ids.as_device_tensor()?,
            &dout.as_device_tensor()?,
            &grad.as_device_tensor()?,
        );
    }
    cpu::embedding_bwd(&ids.data::<i32>()?, &dout.f32()?, c, &mut grad.f32_mut()?)
}
