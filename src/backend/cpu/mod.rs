//! The CPU backend: the reference implementation of every op, and the default device.
//!
//! | file | what |
//! |---|---|
//! | `kernels.rs`, `ops.rs` | the references: plain loops with shapes in comments |
//! | `scalar.rs` | the one-value functions they apply (`exp`, `erf`, `gelu`, `relu` and derivatives) |
//! | `fast.rs`, `rows.rs` | faster row kernels beside them (8 rows summed side by side), the same bits |
//! | `parallel.rs` | the per-rank thread budget and the row/column/elementwise splits (the same bits for any thread count) |
//! | `simd.rs` | `multiversion!`: AVX-512 / AVX2 / baseline copies of a loop, chosen at run time |
//! | `gemm.rs` | GEMMs through the `gemm` crate (faster than `matrixmultiply` on every shape of the main job, `benches/gemm.rs`) |

pub mod fast;
pub mod gemm;
pub mod kernels;
pub mod ops;
pub mod parallel;
pub mod rows;
pub mod scalar;
pub mod simd;
