//! The per-device implementations of tensor ops, and [`Tensor`](crate::tensor::Tensor)'s
//! methods that pick one by device (`tensor.rs`: `zeros_on`, `to_device`, `copy_from`,
//! `to_dtype`, `zero_`, `to_vec_f32`). The tensor layer below holds storage and views and
//! never calls a backend; [`Device`] itself is a leaf ([`crate::device`]).
//!
//! | concept | CPU | CUDA |
//! |---|---|---|
//! | GEMM | [`cpu::gemm`] (the `gemm` crate) | cuBLAS (`cuda::gemm`, f32; bf16/f16 with f32 accumulation) |
//! | elementwise, reductions, casts | [`cpu::ops`], [`cpu::kernels`] (the references, over the scalar functions of [`cpu::scalar`]), [`cpu::fast`], split over the rank's threads by [`cpu::parallel`] | `kernels/*.cu` through `cuda::{ops, nn_ops, optim}` |
//! | memory | `Vec`s behind `Storage`, reused through `tensor::pool` | a caching allocator with per-rank accounting (`cuda::MemAccount`); a block sits in a tensor's `Storage` behind [`tensor::DeviceAllocation`](crate::tensor::DeviceAllocation) |
//! | streams | worker threads (`Work` handles) | CUDA streams + events (`cuda::Stream`, `cuda::Event`) |
//!
//! [`cuda`] has the same names in every build: the real backend with the `cuda` feature, a
//! stand-in without it (`cuda/standin/`: handles that cannot exist, entry points that
//! return [`cuda::no_cuda_build`]'s error). So the ops, process groups and FSDP above have
//! one code path per op and never name the feature; the compiler checks their CUDA arms in
//! both builds.

pub mod counters;
pub mod cpu;
pub mod cuda;
mod tensor;

/// Where a tensor lives; defined in the leaf module [`crate::device`] so every layer can
/// name it.
pub use crate::device::Device;
