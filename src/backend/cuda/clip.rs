//! `clip_grad_norm_` on the device, with no host read (as `torch.nn.utils.clip_grad_norm_`
//! on CUDA tensors): the squared 2-norm accumulates in an f64 on the device, the clip
//! coefficient is computed there, and each gradient is scaled by a device scalar. The
//! arithmetic is the host path's, in the same order (`fsdp::grad`), so the results are
//! bit for bit those of the version that read the norm back.

use super::launch::{self, Grid};
use super::memory::DeviceBuffer;
use super::ops::{check_device, check_dtype};
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

    /// Adds `sum_i f64(x[i])^2` of an f32 tensor (per-block partials, then folded in
    /// block order, as the host adds them).
    ///
    /// # Errors
    /// `DTypeMismatch` for a non-f32 tensor; [`Error::Cuda`].
    pub fn add_squares(&self, s: &Stream, x: &DeviceTensor) -> Result<()> {
        check_device("clip_grad_norm_", s, &[x])?;
        check_dtype("clip_grad_norm_", x, DType::F32)?;
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        let g = Grid {
            grid: (BLOCKS, 1, 1),
            block: 256,
        };
        // SAFETY: x holds n f32; `partial` one f64 per block; `acc` one f64.
        unsafe {
            launch::sumsq_partial(
                s,
                "sumsq_partial_f32",
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

    /// Writes the sum, rounded to f32, into `out` (one f32): what the ranks all-reduce.
    ///
    /// # Errors
    /// `DTypeMismatch`/`ShapeMismatch` for anything but one f32; [`Error::Cuda`].
    pub fn store_f32(&self, s: &Stream, out: &DeviceTensor) -> Result<()> {
        scalar_f32("clip_grad_norm_", s, out)?;
        // SAFETY: one f64 in, one f32 out.
        unsafe { launch::convert1(s, "narrow_f64_f32", one(s), self.acc.ptr(), out.ptr()) }
    }

    /// Replaces the sum by the f32 `x` (one element), widened: the all-reduced total.
    ///
    /// # Errors
    /// As [`store_f32`](Self::store_f32).
    pub fn load_f32(&self, s: &Stream, x: &DeviceTensor) -> Result<()> {
        scalar_f32("clip_grad_norm_", s, x)?;
        // SAFETY: one f32 in, one f64 out.
        unsafe { launch::convert1(s, "widen_f32_f64", one(s), x.ptr(), self.acc.ptr()) }
    }

    /// `norm = f32(sqrt(sum))` and `coef = min(max_norm / (norm + 1e-6), 1)` into two
    /// one-element f32 tensors.
    ///
    /// # Errors
    /// As [`store_f32`](Self::store_f32).
    pub fn clip_coef(
        &self,
        s: &Stream,
        max_norm: f32,
        norm: &DeviceTensor,
        coef: &DeviceTensor,
    ) -> Result<()> {
        scalar_f32("clip_grad_norm_", s, norm)?;
        scalar_f32("clip_grad_norm_", s, coef)?;
        // SAFETY: one f64 in, two f32 out.
        unsafe {
            launch::clip_coef(
                s,
                "clip_coef_f32",
                one(s),
                self.acc.ptr(),
                max_norm,
                norm.ptr(),
                coef.ptr(),
            )
        }
    }
}

fn scalar_f32(op: &'static str, s: &Stream, t: &DeviceTensor) -> Result<()> {
    check_device(op, s, &[t])?;
    check_dtype(op, t, DType::F32)?;
    if t.numel() != 1 {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![1],
            got: t.shape().to_vec(),
        });
    }
    Ok(())
}

/// `x[i] *= alpha[0]` for an f32 tensor and a one-element f32 device scalar.
///
/// # Errors
/// `DTypeMismatch`/`ShapeMismatch`; [`Error::Cuda`].
pub fn scale_by(s: &Stream, x: &DeviceTensor, alpha: &DeviceTensor) -> Result<()> {
    check_device("scale_by", s, &[x])?;
    check_dtype("scale_by", x, DType::F32)?;
    scalar_f32("scale_by", s, alpha)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x holds n f32; alpha one f32.
    unsafe {
        launch::scale_by(
            s,
            "scale_by_f32",
            Grid::elementwise(s, n),
            x.ptr(),
            alpha.ptr(),
            n as i64,
        )
    }
}
