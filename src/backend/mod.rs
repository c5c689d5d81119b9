//! Devices and the per-device implementations of tensor ops.
//!
//! | concept | CPU | CUDA |
//! |---|---|---|
//! | GEMM | [`cpu::gemm`] (the `gemm` crate) | lands with the CUDA runtime issue |
//! | elementwise, reductions, casts | [`cpu::ops`] | `kernels/*.cu` (CUDA runtime issue) |
//! | streams | worker threads (`Work` handles) | CUDA streams + events |

pub mod cpu;

/// Where a tensor lives. Mirrors `torch.device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory; the reference backend.
    #[default]
    Cpu,
    /// CUDA device by ordinal. Requires the `cuda` feature and a driver.
    Cuda(usize),
    /// Shapes only, no memory (deferred initialization).
    Meta,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Meta => f.write_str("meta"),
        }
    }
}
