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

pub mod cpu;
pub mod cuda;
mod tensor;

/// Where a tensor lives; defined in the leaf module [`crate::device`] so every layer can
/// name it.
pub use crate::device::Device;
