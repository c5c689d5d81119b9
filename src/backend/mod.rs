//! Devices and the per-device implementations of tensor ops.
//!
//! | concept | CPU | CUDA |
//! |---|---|---|
//! | GEMM | [`cpu::gemm`] (the `gemm` crate) | cuBLAS (`cuda::gemm`, f32; bf16/f16 with f32 accumulation) |
//! | elementwise, reductions, casts | [`cpu::ops`], [`cpu::kernels`] (the references), [`cpu::fast`], split over the rank's threads by [`cpu::parallel`] | `kernels/*.cu` through `cuda::{ops, nn_ops, optim}` |
//! | memory | `Vec`s behind `Storage`, reused through `tensor::pool` | a caching allocator with per-rank accounting (`cuda::MemAccount`) |
//! | streams | worker threads (`Work` handles) | CUDA streams + events (`cuda::Stream`, `cuda::Event`) |
//!
//! [`cuda`] needs the `cuda` feature for everything but [`cuda::detect`].

pub mod counters;
pub mod cpu;
pub mod cuda;

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

impl Device {
    /// True for `Device::Cuda(_)`.
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
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
