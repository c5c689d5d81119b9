//! The methods of [`Tensor`] that choose a backend by device: allocation on a device,
//! moves between devices (`Tensor.to(device)`), copies, casts and fills. They live in the
//! backend layer, not beside `Tensor` in `crate::tensor`, because they call the backends:
//! the tensor layer below holds storage and views and imports no backend. Ops on CUDA
//! tensors run on the calling thread's current stream ([`cuda::current_stream`]); moves
//! to the host wait for it.
//!
//! Without the `cuda` feature, [`cuda`] is its stand-in: every CUDA request is
//! [`cuda::no_cuda_build`].

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::alloc::vec_with_capacity;
use crate::tensor::{DType, Element, Tensor};

use super::cuda;
use super::cuda::DeviceTensor;
use crate::tensor::Buffer;

/// Whether a CUDA `cast` kernel converts `from` to `to`: between f32, bf16 and f16, and
/// between f32 and f64; other pairs (f64 with bf16/f16, the integer types) go through the
/// host instead.
fn cuda_castable(from: DType, to: DType) -> bool {
    let lp = |d| matches!(d, DType::F32 | DType::BF16 | DType::F16);
    let wide = |d| matches!(d, DType::F32 | DType::F64);
    (lp(from) && lp(to)) || (wide(from) && wide(to))
}

impl Tensor {
    /// Zero-filled tensor on `device` (`torch.zeros(shape, dtype=, device=)`); on `Meta`,
    /// shapes only.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is unavailable or out of memory;
    /// [`Error::OutOfMemory`] when host memory is; `InvalidArgument` for a shape whose size
    /// overflows.
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Tensor::try_zeros(shape, dtype),
            Device::Meta => Ok(Tensor::meta(shape, dtype)),
            Device::Cuda(i) => cuda_zeros(shape, dtype, i),
        }
    }

    /// This tensor on `device` (`Tensor.to(device)`): itself when already there, else a
    /// copy with the same shape and dtype. A meta tensor with an initializer is
    /// materialized first. Moving to `Meta` keeps shape and dtype only.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is unavailable; `NotMaterialized` for a meta tensor
    /// without an initializer.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        let src = self.materialize()?;
        if device == Device::Meta {
            return Ok(Tensor::meta(self.shape(), self.dtype()));
        }
        if src.device() == device {
            return Ok(src);
        }
        let out = Tensor::zeros_on(self.shape(), self.dtype(), device)?;
        out.copy_from(&src)?;
        Ok(out)
    }

    /// Copies the elements out as f32 (widening bf16/f16/i32); a CUDA tensor is copied to
    /// the host first (after its stream's queued work).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        if self.device().is_cuda() {
            return self.to_device(Device::Cpu)?.to_vec_f32();
        }
        // Fallible: a host copy of a tensor whose size came from outside (a host's
        // declared parameter, a state dict) is an `OutOfMemory` error, never an abort.
        let mut out = vec_with_capacity::<f32>(self.numel())?;
        match self.dtype() {
            DType::F32 => out.extend_from_slice(&self.data::<f32>()?),
            DType::BF16 => out.extend(self.data::<half::bf16>()?.iter().map(|v| v.to_f32())),
            DType::F16 => out.extend(self.data::<half::f16>()?.iter().map(|v| v.to_f32())),
            DType::I32 => out.extend(self.data::<i32>()?.iter().map(|&v| v as f32)),
            DType::F64 => out.extend(self.data::<f64>()?.iter().map(|&v| v as f32)),
            DType::I64 => out.extend(self.data::<i64>()?.iter().map(|&v| v as f32)),
        }
        Ok(out)
    }

    /// Copies the elements out as f64 (exact for every dtype but i64 beyond 2^53); a CUDA
    /// tensor is copied to the host first.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        if self.device().is_cuda() {
            return self.to_device(Device::Cpu)?.to_vec_f64();
        }
        let mut out = vec_with_capacity::<f64>(self.numel())?;
        match self.dtype() {
            DType::F64 => out.extend_from_slice(&self.data::<f64>()?),
            DType::I64 => out.extend(self.data::<i64>()?.iter().map(|&v| v as f64)),
            DType::F32 => out.extend(self.data::<f32>()?.iter().map(|&v| f64::from(v))),
            DType::BF16 => out.extend(self.data::<half::bf16>()?.iter().map(|v| v.to_f64())),
            DType::F16 => out.extend(self.data::<half::f16>()?.iter().map(|v| v.to_f64())),
            DType::I32 => out.extend(self.data::<i32>()?.iter().map(|&v| f64::from(v as f32))),
        }
        Ok(out)
    }

    /// A new tensor of `dtype` on the same device with these values
    /// (round-to-nearest-even when narrowing).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let out = if self.device() == Device::Cpu {
            Tensor::try_scratch(self.shape(), dtype)? // copy_from overwrites every element
        } else {
            Tensor::zeros_on(self.shape(), dtype, self.device())?
        };
        out.copy_from(self)?;
        Ok(out)
    }

    /// A copy with its own storage.
    pub fn deep_clone(&self) -> Result<Tensor> {
        self.to_dtype(self.dtype())
    }

    /// `self = src`, casting dtype as needed. Shapes need only agree in element count.
    ///
    /// # Errors
    /// `ShapeMismatch` when element counts differ.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.numel() != self.numel() {
            return Err(Error::ShapeMismatch {
                op: "copy_from",
                expected: self.shape().to_vec(),
                got: src.shape().to_vec(),
            });
        }
        if self.device().is_cuda() || src.device().is_cuda() {
            return self.copy_from_device(src);
        }
        if self.shares_storage(src) {
            // Same lock: read into a temporary first instead of deadlocking.
            let tmp = src.deep_clone()?;
            return self.copy_from(&tmp);
        }
        macro_rules! cast_into {
            ($t:ty) => {{
                let mut dst = self.data_mut::<$t>()?;
                crate::backend::cpu::ops::cast_into(src, &mut dst)
            }};
        }
        match self.dtype() {
            DType::F32 => cast_into!(f32),
            DType::BF16 => cast_into!(half::bf16),
            DType::F16 => cast_into!(half::f16),
            DType::I32 => cast_into!(i32),
            DType::F64 => cast_into!(f64),
            DType::I64 => cast_into!(i64),
        }
    }

    /// A zeroed CPU tensor in page-locked host memory (`torch.zeros(..).pin_memory()`),
    /// pinned through `cuda:ordinal`'s driver (`cuMemHostAlloc`): a host tensor to every
    /// op, that [`copy_from_non_blocking`](Self::copy_from_non_blocking) copies to and
    /// from CUDA tensors without a host wait. Counted in
    /// [`pinned_allocs`](crate::backend::counters::Counters::pinned_allocs).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is unavailable or the allocation fails (and without
    /// the `cuda` feature).
    pub fn pinned_zeros(shape: &[usize], dtype: DType, ordinal: usize) -> Result<Tensor> {
        cuda::pinned_zeros(shape, dtype, ordinal)
    }

    /// `self = src` as [`copy_from`](Self::copy_from), but between a CUDA tensor and a
    /// pinned CPU tensor of the same dtype the copy is only queued on the calling thread's
    /// current stream (`Tensor.copy_(src, non_blocking=True)`): the host must not read a
    /// pinned destination, nor write a pinned source, before that stream's work up to here
    /// has run (a stream synchronization, or an event wait the host does), and both must
    /// live until then. Any other pair copies as `copy_from` does.
    ///
    /// # Errors
    /// As [`copy_from`](Self::copy_from).
    pub fn copy_from_non_blocking(&self, src: &Tensor) -> Result<()> {
        if src.numel() == self.numel() && cuda::copy_async(self, src)? {
            return Ok(());
        }
        self.copy_from(src)
    }

    /// Sets every element to zero.
    pub fn zero_(&self) -> Result<()> {
        if self.device().is_cuda() {
            return self.zero_device();
        }
        macro_rules! fill {
            ($t:ty) => {{
                self.data_mut::<$t>()?.fill(<$t as Element>::zero());
            }};
        }
        match self.dtype() {
            DType::F32 => fill!(f32),
            DType::BF16 => fill!(half::bf16),
            DType::F16 => fill!(half::f16),
            DType::I32 => fill!(i32),
            DType::F64 => fill!(f64),
            DType::I64 => fill!(i64),
        }
        Ok(())
    }

    /// `self = src` when either is on a CUDA device: the same device casts with the
    /// `cast`/`copy` kernels on the current stream; across the host boundary the data is
    /// cast on the host side. Element counts were checked by the caller.
    fn copy_from_device(&self, src: &Tensor) -> Result<()> {
        match (self.device(), src.device()) {
            (Device::Cuda(a), Device::Cuda(b))
                if a == b
                    && (src.dtype() == self.dtype()
                        || cuda_castable(src.dtype(), self.dtype())) =>
            {
                let s = cuda::current_stream(a)?;
                cuda::cast(&s, &src.as_device_tensor()?, &self.as_device_tensor()?)
            }
            (Device::Cuda(a), Device::Cuda(_)) => {
                // Across devices, or a cast without a kernel (integers, f64): through the
                // host (the collectives of ranks on
                // several GPUs use device-to-device copies of their own).
                let host = src.to_device(Device::Cpu)?;
                let _ = a;
                self.copy_from(&host)
            }
            (Device::Cuda(a), _) => {
                let s = cuda::current_stream(a)?;
                let host = if src.dtype() == self.dtype() {
                    src.clone()
                } else {
                    src.to_dtype(self.dtype())?
                };
                let dst = self.as_device_tensor()?;
                match host.dtype() {
                    DType::F32 => dst.copy_from_slice(&s, &host.data::<f32>()?),
                    DType::BF16 => dst.copy_from_slice(&s, &host.data::<half::bf16>()?),
                    DType::F16 => dst.copy_from_slice(&s, &host.data::<half::f16>()?),
                    DType::I32 => dst.copy_from_slice(&s, &host.data::<i32>()?),
                    DType::F64 => dst.copy_from_slice(&s, &host.data::<f64>()?),
                    DType::I64 => dst.copy_from_slice(&s, &host.data::<i64>()?),
                }
            }
            (_, Device::Cuda(b)) => {
                let s = cuda::current_stream(b)?;
                let host = src.as_device_tensor()?.to_host(&s)?;
                self.copy_from(&host)
            }
            _ => unreachable!("copy_from_device with no CUDA tensor"),
        }
    }

    /// Sets a CUDA tensor's elements to zero (a memset on the current stream).
    fn zero_device(&self) -> Result<()> {
        let Device::Cuda(i) = self.device() else {
            return Err(self.not_on_host("Tensor::zero_"));
        };
        cuda::fill(&*cuda::current_stream(i)?, &self.as_device_tensor()?, 0.0)
    }

    /// The CUDA view of this tensor: same allocation, offset, shape and dtype.
    ///
    /// # Errors
    /// `DeviceMismatch` when the tensor is not on a CUDA device.
    pub fn as_device_tensor(&self) -> Result<DeviceTensor> {
        let not_cuda = || Error::DeviceMismatch {
            op: "Tensor::as_device_tensor",
            expected: "cuda".into(),
            got: self.device().to_string(),
        };
        let buf = match &*self.buffer() {
            Buffer::Cuda { buf, .. } => buf.clone(),
            _ => return Err(not_cuda()),
        };
        // Every `Buffer::Cuda` is made by `from_device_tensor` from a `DeviceBuffer`.
        let buf = buf
            .into_any()
            .downcast::<cuda::DeviceBuffer>()
            .map_err(|_| not_cuda())?;
        Ok(DeviceTensor::from_parts(
            buf,
            self.offset(),
            self.shape(),
            self.dtype(),
        ))
    }

    /// A tensor viewing a [`DeviceTensor`]'s memory (no copy).
    pub fn from_device_tensor(t: DeviceTensor) -> Tensor {
        let (buf, offset, shape, dtype) = t.into_parts();
        let len = buf.len_bytes() / dtype.size_in_bytes().max(1);
        Tensor::from_buffer_at(Buffer::Cuda { buf, dtype, len }, offset, &shape)
    }
}

fn cuda_zeros(shape: &[usize], dtype: DType, ordinal: usize) -> Result<Tensor> {
    let s = cuda::current_stream(ordinal)?;
    let t = DeviceTensor::zeros(&s, shape, dtype)?;
    Ok(Tensor::from_device_tensor(t))
}
