//! Tensors on CUDA devices: allocation, moves between devices (`Tensor.to(device)`), and
//! the device side of copies, casts and fills. Ops on CUDA tensors run on the calling
//! thread's current stream ([`crate::backend::cuda::current_stream`]); moves to the host
//! wait for it.
//!
//! Without the `cuda` feature every CUDA request is [`crate::backend::cuda::no_cuda_build`].

use super::{DType, Tensor};
use crate::backend::Device;
use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
use crate::backend::cuda::{self, DeviceTensor};

impl Tensor {
    /// Zero-filled tensor on `device` (`torch.zeros(shape, dtype=, device=)`); on `Meta`,
    /// shapes only.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is unavailable or out of memory.
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        match device {
            Device::Cpu => Ok(Tensor::zeros(shape, dtype)),
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

    /// The error for asking host data of a device tensor.
    pub(super) fn not_on_host(&self, op: &'static str) -> Error {
        Error::DeviceMismatch {
            op,
            expected: Device::Cpu.to_string(),
            got: self.device().to_string(),
        }
    }

    /// `self = src` when either is on a CUDA device: the same device casts with the
    /// `cast`/`copy` kernels on the current stream; across the host boundary the data is
    /// cast on the host side. Element counts were checked by the caller.
    pub(super) fn copy_from_device(&self, src: &Tensor) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            match (self.device(), src.device()) {
                (Device::Cuda(a), Device::Cuda(b))
                    if a == b
                        && (src.dtype() == self.dtype()
                            || (src.dtype() != DType::I32 && self.dtype() != DType::I32)) =>
                {
                    let s = cuda::current_stream(a)?;
                    cuda::cast(&s, &src.as_device_tensor()?, &self.as_device_tensor()?)
                }
                (Device::Cuda(a), Device::Cuda(_)) => {
                    // Across devices, or an integer <-> float cast (no kernel): through the
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
        #[cfg(not(feature = "cuda"))]
        {
            let _ = src;
            Err(crate::backend::cuda::no_cuda_build())
        }
    }

    /// Sets a CUDA tensor's elements to zero (a memset on the current stream).
    pub(super) fn zero_device(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let Device::Cuda(i) = self.device() else {
                return Err(self.not_on_host("Tensor::zero_"));
            };
            cuda::fill(&*cuda::current_stream(i)?, &self.as_device_tensor()?, 0.0)
        }
        #[cfg(not(feature = "cuda"))]
        Err(crate::backend::cuda::no_cuda_build())
    }

    /// The CUDA view of this tensor: same allocation, offset, shape and dtype.
    ///
    /// # Errors
    /// `DeviceMismatch` when the tensor is not on a CUDA device.
    #[cfg(feature = "cuda")]
    pub fn as_device_tensor(&self) -> Result<DeviceTensor> {
        match &*self.storage.buf.read() {
            super::Buffer::Cuda { buf, .. } => Ok(DeviceTensor::from_parts(
                buf.clone(),
                self.offset,
                self.shape(),
                self.dtype,
            )),
            _ => Err(Error::DeviceMismatch {
                op: "Tensor::as_device_tensor",
                expected: "cuda".into(),
                got: self.device().to_string(),
            }),
        }
    }

    /// A tensor viewing a [`DeviceTensor`]'s memory (no copy).
    #[cfg(feature = "cuda")]
    pub fn from_device_tensor(t: DeviceTensor) -> Tensor {
        let (buf, offset, shape, dtype) = t.into_parts();
        let len = buf.len_bytes() / dtype.size_in_bytes().max(1);
        Tensor {
            storage: std::sync::Arc::new(super::Storage::new(super::Buffer::Cuda {
                buf,
                dtype,
                len,
            })),
            offset,
            shape,
            dtype,
        }
    }
}

fn cuda_zeros(shape: &[usize], dtype: DType, ordinal: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let s = cuda::current_stream(ordinal)?;
        let t = DeviceTensor::zeros(&s, shape, dtype)?;
        Ok(Tensor::from_device_tensor(t))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (shape, dtype, ordinal);
        Err(crate::backend::cuda::no_cuda_build())
    }
}
