//! `clip_grad_norm_` on the device, with no host read (as `torch.nn.utils.clip_grad_norm_`
//! on CUDA tensors): the squared 2-norm accumulates in an f64 on the device, the clip
//! coefficient is computed there, and each gradient is scaled by a device scalar. The
//! arithmetic is the host path's, in the same order (`fsdp::grad`), so the results are
//! bit for bit those of the version that read the norm back. f32 or f64 gradients (f64:
//! the coefficient in f64, as the host path for f64 gradients).

use super::launch::{self, Arg, Grid};
use super::memory::DeviceBuffer;
use super::ops::{check_device, check_dtype, kname};
use super::{DeviceTensor, Stream};
use crate::error::{Error, Result};
use crate::tensor::DType;

/// Blocks of the first pass (as `ops::sum_squares`): fixed, so the sum is deterministic.
const BLOCKS: u32 = 256;

fn one(_s: &Stream) -> Grid {
    Grid {
        grid: (1, 1, 1),
        block: 1,
    }
}

/// One f64 on the device: a running sum of squares.
pub struct NormAccumulator {
    acc: DeviceBuffer,
    partial: DeviceBuffer,
}

impl NormAccumulator {
    /// A zero sum on `s`'s device.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the buffers cannot be had.
    pub fn zeros(s: &Stream) -> Result<NormAccumulator> {
        let acc = s.alloc_bytes(8)?;
        let partial = s.alloc_bytes(BLOCKS as usize * 8)?;
        // SAFETY: `acc` holds 8 bytes: two f32 zeros are the f64 0.0.
        unsafe {
            launch::fill32(s, "fill_f32", Grid::elementwise(s, 2), acc.ptr(), 0, 2)?;
        }
        Ok(NormAccumulator { acc, partial })
    }

    /// Adds `sum_i f64(x[i])^2` of an f32 or f64 tensor (per-block partials, then folded
    /// in block order, as the host adds them).
    ///
    /// # Errors
    /// `DTypeMismatch` for a tensor neither f32 nor f64; [`Error::Cuda`].
    pub fn add_squares(&self, s: &Stream, x: &DeviceTensor) -> Result<()> {
        check_device("clip_grad_norm_", s, &[x])?;
        if x.dtype() != DType::F64 {
            check_dtype("clip_grad_norm_", x, DType::F32)?;
        }
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        let g = Grid {
            grid: (BLOCKS, 1, 1),
            block: 256,
        };
        // SAFETY: x holds n elements of its dtype; `partial` one f64 per block; `acc` one f64.
        unsafe {
            launch::sumsq_partial(
                s,
                kname!("sumsq_partial", x.dtype()),
                g,
                x.ptr(),
                self.partial.ptr(),
                n as i64,
            )?;
            launch::sumsq_fold(
                s,
                "sumsq_fold_f64",
                one(s),
                self.partial.ptr(),
                BLOCKS as i64,
                self.acc.ptr(),
            )
        }
    }

    /// Writes the sum into `out` (one element), rounded when `out` is f32 (the f32 path's
    /// all-reduced value), as it is when f64 (the f64 path's).
    ///
    /// # Errors
    /// `DTypeMismatch`/`ShapeMismatch` for anything but one f32 or f64; [`Error::Cuda`].
    pub fn store(&self, s: &Stream, out: &DeviceTensor) -> Result<()> {
        scalar("clip_grad_norm_", s, out)?;
        // SAFETY: one f64 in, one element of out's dtype out.
        unsafe {
            match out.dtype() {
                DType::F64 => launch::copy(s, "copy_f64", one(s), self.acc.ptr(), out.ptr(), 1),
                _ => launch::convert1(s, "narrow_f64_f32", one(s), self.acc.ptr(), out.ptr()),
            }
        }
    }

    /// Replaces the sum by `x` (one f32, widened, or one f64): the all-reduced total.
    ///
    /// # Errors
    /// As [`store`](Self::store).
    pub fn load(&self, s: &Stream, x: &DeviceTensor) -> Result<()> {
        scalar("clip_grad_norm_", s, x)?;
        // SAFETY: one element of x's dtype in, one f64 out.
        unsafe {
            match x.dtype() {
                DType::F64 => launch::copy(s, "copy_f64", one(s), x.ptr(), self.acc.ptr(), 1),
                _ => launch::convert1(s, "widen_f32_f64", one(s), x.ptr(), self.acc.ptr()),
            }
        }
    }

    /// `norm = f32(sqrt(sum))` into one f32 and `coef = min(max_norm / (norm + 1e-6), 1)`
    /// into one element of `coef`'s dtype: f32 arithmetic from the rounded norm
    /// (`clip_coef_f32`), or f64 from the f64 root with `max_norm` as given
    /// (`clip_coef_f64`, the f64 gradients' host path).
    ///
    /// # Errors
    /// As [`store`](Self::store); `norm` must be f32.
    pub fn clip_coef(
        &self,
        s: &Stream,
        max_norm: f64,
        norm: &DeviceTensor,
        coef: &DeviceTensor,
    ) -> Result<()> {
        scalar("clip_grad_norm_", s, norm)?;
        check_dtype("clip_grad_norm_", norm, DType::F32)?;
        scalar("clip_grad_norm_", s, coef)?;
        // SAFETY: one f64 in, one f32 and one element of coef's dtype out.
        unsafe {
            launch::clip_coef(
                s,
                kname!("clip_coef", coef.dtype()),
                one(s),
                self.acc.ptr(),
                Arg::float_of(coef.dtype(), max_norm),
                norm.ptr(),
                coef.ptr(),
            )
        }
    }
}

/// One element, f32 or f64, on `s`'s device.
fn scalar(op: &'static str, s: &Stream, t: &DeviceTensor) -> Result<()> {
    check_device(op, s, &[t])?;
    if t.dtype() != DType::F64 {
        check_dtype(op, t, DType::F32)?;
    }
    if t.numel() != 1 {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![1],
            got: t.shape().to_vec(),
        });
    }
    Ok(())
}

/// `x[i] *= alpha[0]` for an f32 or f64 tensor and a one-element device scalar of its dtype
/// (`scale_by_{f32,f64}`).
///
/// # Errors
/// `DTypeMismatch`/`ShapeMismatch`; [`Error::Cuda`].
pub fn scale_by(s: &Stream, x: &DeviceTensor, alpha: &DeviceTensor) -> Result<()> {
    check_device("scale_by", s, &[x])?;
    scalar("scale_by", s, alpha)?;
    check_dtype("scale_by", x, alpha.dtype())?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x holds n elements of its dtype; alpha one of the same.
    unsafe {
        launch::scale_by(
            s,
            kname!("scale_by", x.dtype()),
            Grid::elementwise(s, n),
            x.ptr(),
            alpha.ptr(),
            n as i64,
        )
    }
}
