//! The CPU backend: the reference implementation of every op, and the default device.
//!
//! | file | what |
//! |---|---|
//! | `kernels.rs`, `ops.rs` | the references: plain loops with shapes in comments |
//! | `bf16.rs` | bf16 <-> f32 conversions without branches (vectorized slice loops), the `half` crate's bits |
//! | `scalar.rs` | the one-value functions they apply (`exp`, `erf`, `gelu`, `relu` and derivatives) |
//! | `fast.rs`, `rows.rs` | faster row kernels beside them (8 rows summed side by side), the same bits |
//! | `parallel.rs` | the per-rank thread budget and the row/column/elementwise splits (the same bits for any thread count) |
//! | `simd.rs` | `multiversion!`: AVX-512 / AVX2 / baseline copies of a loop, chosen at run time |
//! | `wide.rs` | LayerNorm and causal-softmax row sums 16 rows at a time with AVX-512 (columns transposed in registers), the same bits |
//! | `attention.rs` | causal self-attention one head at a time on a scratch in cache, q/k/v read from the projection in place (the op-by-op path's bits) |
//! | `sdpa.rs`, `sdpa_math.rs` | causal attention of bf16/f16 heads as PyTorch's CPU flash-attention kernel rounds it (its exponentials and lane sums emulated in `sdpa_math.rs`) |
//! | `head_gemm.rs` | attention's per-head products with AVX-512, the `gemm` crate's sums without its cost per call |
//! | `gemm.rs` | GEMMs through the `gemm` crate (faster than `matrixmultiply` on every shape of the main job, `benches/gemm.rs`) |

pub mod attention;
pub mod bf16;
pub mod fast;
pub mod gemm;
pub mod head_gemm;
pub mod kernels;
pub mod ops;
pub mod parallel;
pub mod rows;
pub mod scalar;
pub mod sdpa;
pub mod sdpa_math;
pub mod simd;
pub mod wide;
