//! The CPU backend: the reference implementation of every op, and the default device.
//!
//! Plain loops with shapes in comments; GEMMs through the `gemm` crate (measured faster
//! than `matrixmultiply` on the 2-core target, see the README's notes).

pub mod fast;
pub mod gemm;
pub mod kernels;
pub mod ops;
pub mod parallel;
pub mod rows;
pub mod simd;
