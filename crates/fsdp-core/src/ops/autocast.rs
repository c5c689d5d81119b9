//! Low-precision matrix products inside a scope: while an [`autocast`] guard for bf16 or f16
//! is alive on a thread, every [`super::matmul`], [`super::matmul_batched`] and
//! [`super::linear`] on that thread reads its two operands as that dtype and accumulates
//! in f32 (the output stays f32).
//!
//! `torch.autocast` for GEMMs on f32 tensors. `fsdp::fsdp::MixedPrecision` does not use
//! it: there the unsharded parameters and activations are real `param_dtype` tensors, as
//! in PyTorch FSDP, and every op rounds its own output (the low-precision paths of
//! [`crate::ops`]); inside those paths the scope is closed, since their operands already
//! hold low-precision values.
//!
//! | device | what a GEMM does under `autocast(bf16)` |
//! |---|---|
//! | CUDA | casts both f32 operands to bf16 (cast kernel) and runs cuBLAS bf16 x bf16 -> f32 (tensor cores) |
//! | CPU | rounds copies of both operands to bf16 values and runs the f32 GEMM on them |
//!
//! Both compute the same exact products of the same rounded operands with f32 sums, so the
//! two agree to summation order, like f32 GEMMs. The scope is thread-local, as
//! `torch.autocast` is: every rank thread opens its own.

use crate::tensor::DType;
use std::cell::Cell;

thread_local! {
    static GEMM_DTYPE: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Restores the previous scope when dropped (scopes nest, as `with torch.autocast(...)`).
#[derive(Debug)]
#[must_use = "the scope ends when the guard is dropped"]
pub struct AutocastGuard {
    previous: Option<DType>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        GEMM_DTYPE.with(|c| c.set(self.previous));
    }
}

/// Opens a scope on this thread in which GEMM operands are read as `dtype` (bf16 or f16).
/// `None`, `Some(F32)` and `Some(I32)` open a full-precision scope (they also end an
/// enclosing low-precision one until the guard drops).
pub fn autocast(dtype: Option<DType>) -> AutocastGuard {
    let lp = dtype.filter(|d| matches!(d, DType::BF16 | DType::F16));
    AutocastGuard {
        previous: GEMM_DTYPE.with(|c| c.replace(lp)),
    }
}

/// The dtype GEMM operands are read as on this thread: `Some(BF16 | F16)` inside an
/// [`autocast`] scope, `None` (f32) otherwise.
pub fn gemm_dtype() -> Option<DType> {
    GEMM_DTYPE.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(gemm_dtype(), None);
        {
            let _a = autocast(Some(DType::BF16));
            assert_eq!(gemm_dtype(), Some(DType::BF16));
            {
                let _b = autocast(Some(DType::F32));
                assert_eq!(gemm_dtype(), None);
                let _c = autocast(Some(DType::F16));
                assert_eq!(gemm_dtype(), Some(DType::F16));
            }
            assert_eq!(gemm_dtype(), Some(DType::BF16));
            // Another thread has its own scope.
            std::thread::spawn(|| assert_eq!(gemm_dtype(), None))
                .join()
                .unwrap();
        }
        assert_eq!(gemm_dtype(), None);
    }
}
