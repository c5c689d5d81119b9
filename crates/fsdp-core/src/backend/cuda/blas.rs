//! GEMMs through cuBLAS (`cublasGemmEx`, `cublasGemmStridedBatchedEx`), row-major like
//! [`crate::backend::cpu::gemm::matmul`]: `C (m, n) = op(A) op(B) (+ C)`, with
//! `A (m, k)` or, transposed, stored `(k, m)`; `B (k, n)` or stored `(n, k)`.
//!
//! Dtypes: f32 in and out (plain f32 compute: no TF32, so results match the CPU to f32
//! rounding), or bf16/f16 inputs with f32 accumulation and an f32 output or one of the
//! inputs' type (cuBLAS supports no other mix under `CUBLAS_COMPUTE_32F`); or f64 in and out
//! with f64 compute (`CUBLAS_COMPUTE_64F`, the `cublasDgemm` of float64 tensors).
//!
//! Row-major to cuBLAS's column-major: a row-major `C` is the column-major `C^T`, and
//! `C^T = op(B)^T op(A)^T`, so B goes first, `m` and `n` swap, and each leading dimension
//! is the row length of the matrix as stored.

use super::ops::check_device;
use super::{DeviceTensor, GemmShape, Stream};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use std::ffi::c_void;

fn data_type(op: &'static str, d: DType) -> Result<cudaDataType> {
    match d {
        DType::F32 => Ok(cudaDataType::CUDA_R_32F),
        DType::BF16 => Ok(cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(cudaDataType::CUDA_R_16F),
        DType::F64 => Ok(cudaDataType::CUDA_R_64F),
        DType::I32 | DType::I64 => Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            got: d,
        }),
    }
}

struct Plan {
    op_a: cublasOperation_t,
    op_b: cublasOperation_t,
    lda: i32,
    ldb: i32,
    types: (cudaDataType, cudaDataType, cudaDataType),
}

fn plan(
    op: &'static str,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &DeviceTensor,
    g: GemmShape,
    batch: usize,
) -> Result<Plan> {
    let GemmShape { m, k, n, trans } = g;
    let (ta, tb) = (trans.a, trans.b);
    for (t, want) in [(a, m * k), (b, k * n), (c, m * n)] {
        if t.numel() != want * batch {
            return Err(Error::ShapeMismatch {
                op,
                expected: vec![batch, want],
                got: t.shape().to_vec(),
            });
        }
    }
    // cuBLAS's table for CUBLAS_COMPUTE_32F: f32 x f32 -> f32, and bf16 x bf16 or f16 x f16
    // -> the same type or f32; any other mix is CUBLAS_STATUS_NOT_SUPPORTED.
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            got: b.dtype(),
        });
    }
    let f64_mix = (a.dtype() == DType::F64) != (c.dtype() == DType::F64);
    if f64_mix || (c.dtype() != a.dtype() && c.dtype() != DType::F32) {
        return Err(Error::DTypeMismatch {
            op,
            expected: a.dtype(),
            got: c.dtype(),
        });
    }
    let big = [m, k, n].into_iter().any(|d| d > i32::MAX as usize);
    if big {
        crate::error::bail_arg!("{op}: dimensions {m}x{k}x{n} exceed cuBLAS's 32-bit sizes");
    }
    let opn = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    Ok(Plan {
        // cuBLAS's first operand is our B, its second our A (see the module docs).
        op_a: opn(tb),
        op_b: opn(ta),
        lda: (if tb { k } else { n }).max(1) as i32,
        ldb: (if ta { m } else { k }).max(1) as i32,
        types: (
            data_type(op, b.dtype())?,
            data_type(op, a.dtype())?,
            data_type(op, c.dtype())?,
        ),
    })
}

/// `c = op(a) op(b) + beta c` (beta 0 overwrites, 1 accumulates) on `s`'s stream.
///
/// # Errors
/// `ShapeMismatch` when element counts disagree with `g`; `DTypeMismatch` for mixed or
/// i32 inputs, or an f32 GEMM with a low-precision output; [`Error::Cuda`] when cuBLAS is
/// missing or fails.
pub fn gemm(
    s: &Stream,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &DeviceTensor,
    g: GemmShape,
    beta: f32,
) -> Result<()> {
    gemm_strided_batched(s, a, b, c, g, 1, beta)
}

/// `batch` independent GEMMs over consecutive `(m, k)`, `(k, n)`, `(m, n)` blocks of `a`,
/// `b`, `c` (attention's per-head products).
///
/// # Errors
/// As [`gemm()`], with each tensor holding `batch` blocks.
pub fn gemm_strided_batched(
    s: &Stream,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &DeviceTensor,
    g: GemmShape,
    batch: usize,
    beta: f32,
) -> Result<()> {
    check_device("gemm", s, &[a, b, c])?;
    let p = plan("gemm", a, b, c, g, batch)?;
    if g.m == 0 || g.n == 0 || batch == 0 {
        return Ok(());
    }
    if g.k == 0 && beta == 0.0 {
        // cuBLAS would read nothing and write beta * C; zero C ourselves for clarity.
        return super::ops::fill(s, c, 0.0);
    }
    let handle = s.blas()?;
    let f64_compute = a.dtype() == DType::F64;
    let (alpha, beta) = (1.0f32, beta);
    let (alpha64, beta64) = (1.0f64, f64::from(beta));
    let (alpha_ptr, beta_ptr, compute) = if f64_compute {
        (
            &alpha64 as *const f64 as *const c_void,
            &beta64 as *const f64 as *const c_void,
            cublasComputeType_t::CUBLAS_COMPUTE_64F,
        )
    } else {
        (
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    };
    s.dev
        .ctx
        .bind_to_thread()
        .map_err(|e| Error::cuda("binding the context for cuBLAS", e))?;
    crate::backend::counters::count_kernel_launch("gemm");
    // SAFETY: the handle is bound to `s`'s stream; every pointer addresses `batch` blocks of
    // the sizes checked in `plan`; alpha/beta are f32 as CUBLAS_COMPUTE_32F requires, f64
    // for CUBLAS_COMPUTE_64F (f64 operands, checked in `plan`), and outlive the call.
    unsafe {
        blas::gemm_strided_batched_ex(
            *handle.handle(),
            p.op_a,
            p.op_b,
            g.n as i32,
            g.m as i32,
            g.k as i32,
            alpha_ptr,
            b.ptr() as *const c_void,
            p.types.0,
            p.lda,
            (g.k * g.n) as i64,
            a.ptr() as *const c_void,
            p.types.1,
            p.ldb,
            (g.m * g.k) as i64,
            beta_ptr,
            c.ptr() as *mut c_void,
            p.types.2,
            g.n as i32,
            (g.m * g.n) as i64,
            batch as i32,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| {
        Error::cuda(
            format!(
                "cublasGemmStridedBatchedEx {}x{}x{} x{batch}",
                g.m, g.k, g.n
            ),
            e,
        )
    })
}
