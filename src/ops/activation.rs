//! Pointwise activations on any device: `y = f(x)` and `dx = dy * f'(x)` for ReLU and
//! exact (erf) GELU. CPU: the scalar functions of [`crate::nn`] in a loop; CUDA:
//! `relu_*_f32` / `gelu_*_f32` of `nn.cu`, which use the same polynomials and round alike
//! (bitwise equal).

#[cfg(feature = "cuda")]
use super::output;
use super::{check_f32, same_device};
#[cfg(feature = "cuda")]
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::nn::{gelu, gelu_grad, relu, relu_grad};
use crate::tensor::Tensor;

/// Which pointwise function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pointwise {
    /// `max(x, 0)` (`F.relu`).
    Relu,
    /// `x Phi(x)`, exact erf (`F.gelu(approximate='none')`).
    Gelu,
}

impl Pointwise {
    /// `"ReLU"` or `"GELU"`.
    pub fn name(self) -> &'static str {
        match self {
            Pointwise::Relu => "ReLU",
            Pointwise::Gelu => "GELU",
        }
    }
}

/// `y = f(x)`, a new f32 tensor of `x`'s shape on its device.
///
/// # Errors
/// `DTypeMismatch` for a non-f32 input; `NotMaterialized` on meta; [`Error::Cuda`].
pub fn pointwise(f: Pointwise, x: &Tensor) -> Result<Tensor> {
    let _device = same_device(f.name(), &[x])?;
    check_f32(f.name(), &[x])?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(i) = _device {
        use crate::backend::cuda;
        let y = output(x.shape(), _device)?;
        let (s, xd, yd) = (
            super::stream(i)?,
            x.as_device_tensor()?,
            y.as_device_tensor()?,
        );
        match f {
            Pointwise::Relu => cuda::relu_fwd(&s, &xd, &yd)?,
            Pointwise::Gelu => cuda::gelu_fwd(&s, &xd, &yd)?,
        }
        return Ok(y);
    }
    let xv = x.f32()?;
    // One monomorphic loop per function, so each inlines and vectorizes.
    let y: Vec<f32> = match f {
        Pointwise::Relu => xv.iter().map(|&v| relu(v)).collect(),
        Pointwise::Gelu => xv.iter().map(|&v| gelu(v)).collect(),
    };
    Tensor::from_vec(y, x.shape())
}

/// `dx = dy * f'(x)`, a new f32 tensor of `x`'s shape on its device.
///
/// # Errors
/// `ShapeMismatch` when `dy` and `x` differ in element count; as [`pointwise`].
pub fn pointwise_backward(f: Pointwise, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let _device = same_device(f.name(), &[x, dy])?;
    check_f32(f.name(), &[x, dy])?;
    if x.numel() != dy.numel() {
        return Err(Error::ShapeMismatch {
            op: "pointwise_backward",
            expected: x.shape().to_vec(),
            got: dy.shape().to_vec(),
        });
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(i) = _device {
        use crate::backend::cuda;
        let dx = output(x.shape(), _device)?;
        let s = super::stream(i)?;
        let (xd, gd, dxd) = (
            x.as_device_tensor()?,
            dy.as_device_tensor()?,
            dx.as_device_tensor()?,
        );
        match f {
            Pointwise::Relu => cuda::relu_bwd(&s, &xd, &gd, &dxd)?,
            Pointwise::Gelu => cuda::gelu_bwd(&s, &xd, &gd, &dxd)?,
        }
        return Ok(dx);
    }
    let (xv, gv) = (x.f32()?, dy.f32()?);
    let pairs = xv.iter().zip(gv.iter());
    let dx: Vec<f32> = match f {
        Pointwise::Relu => pairs.map(|(&x, &g)| g * relu_grad(x)).collect(),
        Pointwise::Gelu => pairs.map(|(&x, &g)| g * gelu_grad(x)).collect(),
    };
    Tensor::from_vec(dx, x.shape())
}
