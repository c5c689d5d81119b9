//! [`DType`]: the element type of a tensor (`torch.dtype`). A leaf module: errors, tensors,
//! backends and checkpoints all name dtypes, and it imports nothing. The trait that maps
//! a Rust scalar to its dtype, [`Element`](crate::tensor::Element), belongs to the tensor
//! layer (it builds storage buffers).

/// The element type of a tensor. Names and widths follow `torch.dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8 exponent bits, 7 mantissa bits), as `torch.bfloat16`.
    BF16,
    /// IEEE binary16, as `torch.float16`.
    F16,
    /// 32-bit signed integer (token ids), as `torch.int32`.
    I32,
    /// IEEE binary64, as `torch.float64`: parameters, gradients and collectives work as in
    /// f32, so exact references can run in f64.
    F64,
    /// 64-bit signed integer, as `torch.int64` (e.g. `BatchNorm1d.num_batches_tracked`).
    I64,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::I64)
    }

    /// Relative rounding error of one operation in this type (machine epsilon), used by
    /// dtype-aware tolerances: f32 2^-23, bf16 2^-7 (stored mantissa bits), f16 2^-10,
    /// f64 2^-52 (as an f32: 2.2e-16).
    pub fn epsilon(self) -> f32 {
        match self {
            DType::F32 => f32::EPSILON,
            DType::BF16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            DType::F64 => f64::EPSILON as f32,
            DType::I32 | DType::I64 => 0.0,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::F64 => "f64",
            DType::I64 => "i64",
        };
        f.write_str(s)
    }
}

/// An f32 hyperparameter (LayerNorm's eps, a score scale, a learning rate) as the f64 its
/// decimal spelling names: `1e-5f32` becomes `1e-5f64` (PyTorch passes eps as a Python
/// float), not `9.99999974e-6`. In this leaf layer because the f64 host ops
/// (`ops::double`) and the CUDA backend's f64 updates (`backend::cuda::widen_hyper`) both
/// widen this way.
pub fn widen(x: f32) -> f64 {
    format!("{x}").parse::<f64>().unwrap_or(f64::from(x))
}
