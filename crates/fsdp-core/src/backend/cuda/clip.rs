//! `clip_grad_norm_` on the device, with no host read (as `torch.nn.utils.clip_grad_norm_`
//! on CUDA tensors): the squared 2-norm accumulates in an f64 on the device, the clip
//! coefficient is computed there, and each gradient is scaled by a device scalar. The
//! arithmetic is the host path's, in the same order (`fsdp::grad`), so the results are
//! bit for bit those of the version that read the norm back. f32 or f64 gradients (f64:
//! the coefficient in f64, as the host path for f64 gradients).

use super::launch::{self, Arg, Grid};
use super::memory::DeviceBuffer;
use super::ops::{check_device, check_dtype, kname, upload_table};
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

/// `struct Segment` of reduce_scatter.cu: one tensor of a multi-tensor launch.
#[repr(C)]
#[derive(Clone, Copy)]
struct Segment {
    p: u64,
    n: i64,
}

/// A list of f32 (or f64) tensors on one device, its table of pointers and lengths
/// uploaded once, for the multi-tensor launches of `clip_grad_norm_`
/// ([`NormAccumulator::set_squares`], [`scale_all_by`]): one launch for every unit's
/// gradient shard instead of one per shard.
pub struct TensorList {
    table: DeviceBuffer,
    k: usize,
    longest: usize,
    dtype: DType,
}

impl TensorList {
    /// The list of `xs` (all f32 or all f64, on `s`'s device; may be empty).
    ///
    /// # Errors
    /// `DTypeMismatch` for a tensor of another dtype; device errors; [`Error::Cuda`].
    pub fn new(s: &Stream, xs: &[DeviceTensor]) -> Result<TensorList> {
        let refs: Vec<&DeviceTensor> = xs.iter().collect();
        check_device("clip_grad_norm_", s, &refs)?;
        let dtype = match xs.first().map(DeviceTensor::dtype) {
            Some(DType::F64) => DType::F64,
            _ => DType::F32,
        };
        for x in xs {
            check_dtype("clip_grad_norm_", x, dtype)?;
        }
        let table: Vec<Segment> = xs
            .iter()
            .map(|x| Segment {
                p: x.ptr(),
                n: x.numel() as i64,
            })
            .collect();
        Ok(TensorList {
            // At least one entry: a buffer is never empty.
            table: upload_table(s, &table)?,
            k: xs.len(),
            longest: xs.iter().map(DeviceTensor::numel).max().unwrap_or(0),
            dtype,
        })
    }

    /// Segments along y for `k` tensors: at most 65535, the kernels stride over the rest.
    fn ys(&self) -> u32 {
        self.k.clamp(1, 65535) as u32
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

    /// An accumulator whose sum is unset until [`set_squares`](Self::set_squares) sets it
    /// (no launch: a zeroed one is [`zeros`](Self::zeros)).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the buffers cannot be had.
    pub fn unset(s: &Stream) -> Result<NormAccumulator> {
        Ok(NormAccumulator {
            acc: s.alloc_bytes(8)?,
            partial: s.alloc_bytes(BLOCKS as usize * 8)?,
        })
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

    /// Replaces the sum by `sum_i f64(x[i])^2` over every tensor of `list`, in list order
    /// (bit for bit a zeroed accumulator given [`add_squares`](Self::add_squares) of each),
    /// in two launches for the whole list; and writes it, rounded, into `narrow` (one f32)
    /// when given (as [`store`](Self::store)).
    ///
    /// # Errors
    /// `DTypeMismatch`/`ShapeMismatch` for a `narrow` other than one f32; [`Error::Cuda`].
    pub fn set_squares(
        &self,
        s: &Stream,
        list: &TensorList,
        narrow: Option<&DeviceTensor>,
    ) -> Result<()> {
        if let Some(out) = narrow {
            scalar("clip_grad_norm_", s, out)?;
            check_dtype("clip_grad_norm_", out, DType::F32)?;
        }
        let partial = s.alloc_bytes(BLOCKS as usize * list.k.max(1) * 8)?;
        // SAFETY: the table holds `k` segments of `list.dtype` on this device (kept alive by
        // their owners until the stream ran this); `partial` one f64 per block and segment;
        // `acc` one f64; `narrow` null or one f32.
        unsafe {
            if list.k > 0 {
                let g = Grid {
                    grid: (BLOCKS, list.ys(), 1),
                    block: 256,
                };
                launch::sumsq_partial_multi(
                    s,
                    kname!("sumsq_partial_multi", list.dtype),
                    g,
                    list.table.ptr(),
                    list.k as i64,
                    partial.ptr(),
                )?;
            }
            launch::sumsq_fold_multi(
                s,
                "sumsq_fold_multi_f64",
                one(s),
                partial.ptr(),
                list.k as i64,
                BLOCKS as i64,
                self.acc.ptr(),
                narrow.map_or(0, DeviceTensor::ptr),
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
        self.coef(s, None, max_norm, norm, coef)
    }

    /// [`load`](Self::load) of the f32 `total` then [`clip_coef`](Self::clip_coef), in one
    /// launch (the sum is left as it was).
    ///
    /// # Errors
    /// As [`clip_coef`](Self::clip_coef); `total` must be one f32.
    pub fn clip_coef_of(
        &self,
        s: &Stream,
        total: &DeviceTensor,
        max_norm: f64,
        norm: &DeviceTensor,
        coef: &DeviceTensor,
    ) -> Result<()> {
        scalar("clip_grad_norm_", s, total)?;
        check_dtype("clip_grad_norm_", total, DType::F32)?;
        self.coef(s, Some(total), max_norm, norm, coef)
    }

    fn coef(
        &self,
        s: &Stream,
        total: Option<&DeviceTensor>,
        max_norm: f64,
        norm: &DeviceTensor,
        coef: &DeviceTensor,
    ) -> Result<()> {
        scalar("clip_grad_norm_", s, norm)?;
        check_dtype("clip_grad_norm_", norm, DType::F32)?;
        scalar("clip_grad_norm_", s, coef)?;
        // SAFETY: one f64 (and one f32 or null) in, one f32 and one element of coef's
        // dtype out.
        unsafe {
            launch::clip_coef(
                s,
                kname!("clip_coef", coef.dtype()),
                one(s),
                self.acc.ptr(),
                total.map_or(0, DeviceTensor::ptr),
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

/// `x[i] *= alpha[0]` for every tensor of `list` and a one-element device scalar of their
/// dtype, in one launch (`scale_by_multi_{f32,f64}`): [`scale_by`] of each.
///
/// # Errors
/// `DTypeMismatch`/`ShapeMismatch`; [`Error::Cuda`].
pub fn scale_all_by(s: &Stream, list: &TensorList, alpha: &DeviceTensor) -> Result<()> {
    scalar("scale_by", s, alpha)?;
    if alpha.dtype() != list.dtype {
        return Err(Error::DTypeMismatch {
            op: "scale_by",
            expected: list.dtype,
            got: alpha.dtype(),
        });
    }
    if list.k == 0 || list.longest == 0 {
        return Ok(());
    }
    // SAFETY: the table holds `k` segments of the dtype on this device; alpha one element.
    unsafe {
        launch::scale_by_multi(
            s,
            kname!("scale_by_multi", list.dtype),
            Grid::segments(s, list.k, list.longest),
            list.table.ptr(),
            list.k as i64,
            alpha.ptr(),
        )
    }
}
