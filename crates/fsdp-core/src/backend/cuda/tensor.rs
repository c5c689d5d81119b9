//! [`DeviceTensor`]: a dtype, a shape and a contiguous window into a [`DeviceBuffer`], the
//! device-side counterpart of [`crate::tensor::Tensor`]; host <-> device copies.

use super::memory::DeviceBuffer;
use super::Stream;
use crate::error::{Error, Result};
use crate::tensor::{numel_of, DType, Element, Tensor};
use cudarc::driver::result as cu;
use std::sync::Arc;

/// A contiguous n-dimensional array in device memory. Cloning shares the buffer (views);
/// the buffer returns to its pool when the last view is dropped.
#[derive(Clone, Debug)]
pub struct DeviceTensor {
    buf: Arc<DeviceBuffer>,
    /// Element offset of the view into `buf`.
    offset: usize,
    shape: Vec<usize>,
    dtype: DType,
}

impl DeviceTensor {
    /// A view of `shape` at element `offset` of `buf` (the parts of a CUDA
    /// [`Tensor`]'s storage).
    pub(crate) fn from_parts(
        buf: Arc<DeviceBuffer>,
        offset: usize,
        shape: &[usize],
        dtype: DType,
    ) -> DeviceTensor {
        DeviceTensor {
            buf,
            offset,
            shape: shape.to_vec(),
            dtype,
        }
    }

    /// The shared allocation and this view's element offset into it.
    pub(crate) fn into_parts(self) -> (Arc<DeviceBuffer>, usize, Vec<usize>, DType) {
        (self.buf, self.offset, self.shape, self.dtype)
    }

    /// Uninitialized tensor on `stream`'s device (contents undefined until written).
    ///
    /// # Errors
    /// [`Error::Cuda`] when out of device memory.
    pub fn empty(stream: &Stream, shape: &[usize], dtype: DType) -> Result<DeviceTensor> {
        let bytes = numel_of(shape) * dtype.size_in_bytes();
        Ok(DeviceTensor {
            buf: Arc::new(stream.alloc_bytes(bytes)?),
            offset: 0,
            shape: shape.to_vec(),
            dtype,
        })
    }

    /// Zero-filled tensor (a `cuMemsetD8Async` on `stream`).
    ///
    /// # Errors
    /// [`Error::Cuda`] when out of device memory or the memset fails.
    pub fn zeros(stream: &Stream, shape: &[usize], dtype: DType) -> Result<DeviceTensor> {
        let t = Self::empty(stream, shape, dtype)?;
        if t.nbytes() > 0 {
            // SAFETY: the range lies inside the freshly allocated buffer, which outlives the
            // memset because the buffer is only reused by work queued after it on `stream`.
            stream.bind()?;
            unsafe { cu::memset_d8_async(t.ptr(), 0, t.nbytes(), stream.inner.cu_stream()) }
                .map_err(|e| Error::cuda("cuMemsetD8Async", e))?;
        }
        Ok(t)
    }

    /// Copies `data` to a new device tensor of shape `shape`; returns once the host data
    /// may be reused.
    ///
    /// # Errors
    /// `ShapeMismatch` when `data.len()` differs from the shape's element count;
    /// [`Error::Cuda`] on allocation or copy failure.
    pub fn from_slice<T: Element>(
        stream: &Stream,
        data: &[T],
        shape: &[usize],
    ) -> Result<DeviceTensor> {
        if data.len() != numel_of(shape) {
            return Err(Error::ShapeMismatch {
                op: "DeviceTensor::from_slice",
                expected: shape.to_vec(),
                got: vec![data.len()],
            });
        }
        let t = Self::empty(stream, shape, T::DTYPE)?;
        if !data.is_empty() {
            // SAFETY: dst holds data.len() elements of T. From pageable memory the driver
            // reads (stages) the source before it returns, so `data` may go at once; the
            // copy itself is ordered on the stream (no host wait).
            stream.bind()?;
            unsafe { cu::memcpy_htod_async(t.ptr(), data, stream.inner.cu_stream()) }
                .map_err(|e| Error::cuda("cuMemcpyHtoDAsync", e))?;
        }
        Ok(t)
    }

    /// Overwrites this view with `data` (same element count and dtype), ordered on
    /// `stream`; returns once the source has been read, so `data` may be reused (the host
    /// does not wait for the device: CUDA stages pageable memory before it returns).
    ///
    /// # Errors
    /// `DTypeMismatch`, `ShapeMismatch`; [`Error::Cuda`] on failure.
    pub fn copy_from_slice<T: Element>(&self, stream: &Stream, data: &[T]) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "DeviceTensor::copy_from_slice",
                expected: self.dtype,
                got: T::DTYPE,
            });
        }
        if data.len() != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "DeviceTensor::copy_from_slice",
                expected: self.shape.clone(),
                got: vec![data.len()],
            });
        }
        if !data.is_empty() {
            // SAFETY: the view holds data.len() elements of T; the driver stages pageable
            // memory before it returns, so `data` may be reused at once.
            stream.bind()?;
            unsafe { cu::memcpy_htod_async(self.ptr(), data, stream.inner.cu_stream()) }
                .map_err(|e| Error::cuda("cuMemcpyHtoDAsync", e))?;
        }
        Ok(())
    }

    /// Overwrites this view with `src`, a view of the same dtype and element count on the
    /// same device, ordered on `stream` (`cuMemcpyDtoDAsync`: a copy, not a kernel launch).
    ///
    /// # Errors
    /// `DTypeMismatch`, `ShapeMismatch`; [`Error::Cuda`] for views on two devices or a
    /// failed copy.
    pub fn copy_from_device(&self, stream: &Stream, src: &DeviceTensor) -> Result<()> {
        if src.dtype != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "DeviceTensor::copy_from_device",
                expected: self.dtype,
                got: src.dtype,
            });
        }
        if src.numel() != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "DeviceTensor::copy_from_device",
                expected: self.shape.clone(),
                got: src.shape.clone(),
            });
        }
        if src.ordinal() != self.ordinal() {
            return Err(Error::cuda(
                "DeviceTensor::copy_from_device",
                format!("cuda:{} to cuda:{}", src.ordinal(), self.ordinal()),
            ));
        }
        if self.numel() > 0 {
            stream.bind()?;
            // SAFETY: both views hold `nbytes` bytes of device memory on the stream's
            // device, alive while the views are; the copy is ordered on `stream`.
            unsafe {
                cu::memcpy_dtod_async(
                    self.ptr(),
                    src.ptr(),
                    self.nbytes(),
                    stream.inner.cu_stream(),
                )
            }
            .map_err(|e| Error::cuda("cuMemcpyDtoDAsync", e))?;
        }
        Ok(())
    }

    /// Copies a host tensor to the device (same shape and dtype).
    ///
    /// # Errors
    /// As [`DeviceTensor::from_slice`]; `NotMaterialized` for a meta tensor.
    pub fn from_host(stream: &Stream, t: &Tensor) -> Result<DeviceTensor> {
        match t.dtype() {
            DType::F32 => Self::from_slice(stream, &t.data::<f32>()?, t.shape()),
            DType::BF16 => Self::from_slice(stream, &t.data::<half::bf16>()?, t.shape()),
            DType::F16 => Self::from_slice(stream, &t.data::<half::f16>()?, t.shape()),
            DType::I32 => Self::from_slice(stream, &t.data::<i32>()?, t.shape()),
            DType::F64 => Self::from_slice(stream, &t.data::<f64>()?, t.shape()),
            DType::I64 => Self::from_slice(stream, &t.data::<i64>()?, t.shape()),
        }
    }

    /// Copies the tensor to a host vector after `stream`'s queued work (blocks).
    ///
    /// # Errors
    /// `DTypeMismatch` when `T` is not the tensor's dtype; [`Error::Cuda`] on failure,
    /// including an earlier asynchronous kernel error; the `InvalidArgument` of an earlier
    /// index check on this thread that failed (an embedding's token id, a cross-entropy
    /// target out of range: see `checks`).
    pub fn to_vec<T: Element>(&self, stream: &Stream) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "DeviceTensor::to_vec",
                expected: self.dtype,
                got: T::DTYPE,
            });
        }
        // Index checks of earlier kernels on this thread ride on this synchronization.
        let checks = super::checks::queue_reads()?;
        let mut out = vec![T::zero(); self.numel()];
        if !out.is_empty() {
            // SAFETY: the source range lies in the buffer; the stream is synchronized
            // before `out` is read or dropped.
            stream.bind()?;
            unsafe { cu::memcpy_dtoh_async(&mut out, self.ptr(), stream.inner.cu_stream()) }
                .map_err(|e| Error::cuda("cuMemcpyDtoHAsync", e))?;
        }
        stream.synchronize()?;
        super::checks::finish(checks, Some(stream))?;
        Ok(out)
    }

    /// Copies the tensor to a host [`Tensor`] (blocks).
    ///
    /// # Errors
    /// As [`DeviceTensor::to_vec`].
    pub fn to_host(&self, stream: &Stream) -> Result<Tensor> {
        match self.dtype {
            DType::F32 => Tensor::from_vec(self.to_vec::<f32>(stream)?, &self.shape),
            DType::BF16 => Tensor::from_vec(self.to_vec::<half::bf16>(stream)?, &self.shape),
            DType::F16 => Tensor::from_vec(self.to_vec::<half::f16>(stream)?, &self.shape),
            DType::I32 => Tensor::from_vec(self.to_vec::<i32>(stream)?, &self.shape),
            DType::F64 => Tensor::from_vec(self.to_vec::<f64>(stream)?, &self.shape),
            DType::I64 => Tensor::from_vec(self.to_vec::<i64>(stream)?, &self.shape),
        }
    }

    /// A view of `numel_of(shape)` elements starting `offset` elements into this one.
    ///
    /// # Errors
    /// `ShapeMismatch` when the view does not fit.
    pub fn view(&self, offset: usize, shape: &[usize]) -> Result<DeviceTensor> {
        if offset + numel_of(shape) > self.numel() {
            return Err(Error::ShapeMismatch {
                op: "DeviceTensor::view",
                expected: vec![self.numel()],
                got: vec![offset + numel_of(shape)],
            });
        }
        Ok(DeviceTensor {
            buf: self.buf.clone(),
            offset: self.offset + offset,
            shape: shape.to_vec(),
            dtype: self.dtype,
        })
    }

    /// The device address of the first element of the view.
    pub fn ptr(&self) -> u64 {
        self.buf.ptr() + (self.offset * self.dtype.size_in_bytes()) as u64
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        numel_of(&self.shape)
    }

    /// Bytes the view covers.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Ordinal of the device holding the data.
    pub fn ordinal(&self) -> usize {
        self.buf.ordinal()
    }

    /// The underlying buffer (for [`Stream::record_use`]).
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }
}
