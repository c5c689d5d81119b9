//! The cuBLAS subset fsdp calls: handles bound to a stream, and `cublasGemmStridedBatchedEx`
//! / `cublasGemmEx` for f32, f16 and bf16 storage with f32 compute, and f64 storage with f64
//! compute (`CUBLAS_COMPUTE_64F`, what `cublasDgemm` runs), column-major as cuBLAS
//! (`C = alpha op(A) op(B) + beta C`, C not read when beta is 0). The sums run in the
//! compute type over k in order: not cuBLAS's order, so fsdp's tests compare GEMM results
//! with a tolerance.

use crate::driver;
use crate::memory;
use half::{bf16, f16};
use std::ffi::{c_int, c_void};

type Status = c_int;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1;
const INVALID_VALUE: Status = 7;
const EXECUTION_FAILED: Status = 13;
const NOT_SUPPORTED: Status = 15;

struct Handle {
    stream: *mut c_void,
}

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(h: *mut *mut c_void) -> Status {
    if h.is_null() {
        return INVALID_VALUE;
    }
    if driver::current_device().is_none() {
        return NOT_INITIALIZED;
    }
    // SAFETY: the caller's out-pointer.
    unsafe {
        h.write(Box::into_raw(Box::new(Handle {
            stream: std::ptr::null_mut(),
        })) as *mut c_void)
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasDestroy_v2(h: *mut c_void) -> Status {
    // SAFETY: made by cublasCreate_v2, destroyed once.
    match unsafe { driver::free_handle::<Handle>(h) } {
        true => SUCCESS,
        false => NOT_INITIALIZED,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetStream_v2(h: *mut c_void, stream: *mut c_void) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    // SAFETY: made by cublasCreate_v2.
    unsafe { (*(h as *mut Handle)).stream = stream };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(h: *mut c_void, stream: *mut *mut c_void) -> Status {
    if h.is_null() || stream.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: made by cublasCreate_v2; the caller's out-pointer.
    unsafe { stream.write((*(h as *mut Handle)).stream) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasSetMathMode(h: *mut c_void, _mode: c_int) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasSetWorkspace_v2(h: *mut c_void, _w: *mut c_void, _bytes: usize) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    SUCCESS
}

#[derive(Clone, Copy, PartialEq)]
enum Ty {
    F32,
    F16,
    Bf16,
    F64,
}

fn ty(t: c_int) -> Option<Ty> {
    match t {
        0 => Some(Ty::F32),   // CUDA_R_32F
        1 => Some(Ty::F64),   // CUDA_R_64F
        2 => Some(Ty::F16),   // CUDA_R_16F
        14 => Some(Ty::Bf16), // CUDA_R_16BF
        _ => None,
    }
}

impl Ty {
    fn size(self) -> usize {
        match self {
            Ty::F64 => 8,
            Ty::F32 => 4,
            Ty::F16 | Ty::Bf16 => 2,
        }
    }
    /// Element `i` of the matrix at `p` (f32 storage and below widen exactly).
    unsafe fn load(self, p: *const c_void, i: usize) -> f64 {
        // SAFETY: the caller checked the range.
        unsafe {
            match self {
                Ty::F32 => f64::from(*(p as *const f32).add(i)),
                Ty::F16 => f64::from(f16::from_bits(*(p as *const u16).add(i)).to_f32()),
                Ty::Bf16 => f64::from(bf16::from_bits(*(p as *const u16).add(i)).to_f32()),
                Ty::F64 => *(p as *const f64).add(i),
            }
        }
    }
    /// Stores `v`, computed in the compute type (an f32 value for 32F compute: its
    /// narrowing to f32 is exact).
    unsafe fn store(self, p: *mut c_void, i: usize, v: f64) {
        // SAFETY: the caller checked the range.
        unsafe {
            match self {
                Ty::F32 => *(p as *mut f32).add(i) = v as f32,
                Ty::F16 => *(p as *mut u16).add(i) = f16::from_f32(v as f32).to_bits(),
                Ty::Bf16 => *(p as *mut u16).add(i) = bf16::from_f32(v as f32).to_bits(),
                Ty::F64 => *(p as *mut f64).add(i) = v,
            }
        }
    }
}

/// Whether a `rows x cols` column-major matrix with leading dimension `ld`, `batch` of them
/// `stride` elements apart, lies in one device allocation of `dev`.
#[allow(clippy::too_many_arguments)]
fn covered(
    p: *const c_void,
    t: Ty,
    rows: usize,
    cols: usize,
    ld: usize,
    stride: usize,
    batch: usize,
    dev: c_int,
) -> bool {
    if rows == 0 || cols == 0 || batch == 0 {
        return true;
    }
    let last = (batch - 1) * stride + (cols - 1) * ld + rows; // elements up to the last one
    memory::device_of(p as usize, last * t.size()) == Some(dev)
}

/// Reads `out.len() / k` vectors of `k` elements of a column-major matrix at `p + base` into
/// `out` (vector `o`, element `q` at `out[o * k + q]`), as f32: element `(o, q)` is stored at
/// `o + q * ld` when `o_fastest`, else at `q + o * ld`.
///
/// # Safety
/// Every element read lies in device memory the caller checked.
unsafe fn pack(
    t: Ty,
    p: *const c_void,
    base: usize,
    ld: usize,
    o_fastest: bool,
    out: &mut [f32],
    k: usize,
) {
    for (o, v) in out.chunks_exact_mut(k.max(1)).enumerate() {
        for (q, x) in v.iter_mut().enumerate() {
            let at = if o_fastest { o + q * ld } else { q + o * ld };
            // SAFETY: forwarded from the caller; values of f32 storage or narrower.
            *x = unsafe { t.load(p, base + at) } as f32;
        }
    }
}

/// [`pack`] for f64 storage and compute.
///
/// # Safety
/// As [`pack`].
unsafe fn pack64(
    p: *const c_void,
    base: usize,
    ld: usize,
    o_fastest: bool,
    out: &mut [f64],
    k: usize,
) {
    for (o, v) in out.chunks_exact_mut(k.max(1)).enumerate() {
        for (q, x) in v.iter_mut().enumerate() {
            let at = if o_fastest { o + q * ld } else { q + o * ld };
            // SAFETY: forwarded from the caller.
            *x = unsafe { Ty::F64.load(p, base + at) };
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    stride_a: i64,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    stride_b: i64,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    stride_c: i64,
    batch: c_int,
    compute: c_int,
    _algo: c_int,
) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    // SAFETY: made by cublasCreate_v2.
    let stream = unsafe { (*(h as *const Handle)).stream };
    let Some(dev) = (unsafe { driver::device_of_stream(stream) }) else {
        return EXECUTION_FAILED;
    };
    if driver::current_device() != Some(dev) {
        return EXECUTION_FAILED;
    }
    // 68 CUBLAS_COMPUTE_32F, 69 32F_PEDANTIC, 74..77 32F_FAST_* (all f32 sums here);
    // 70 CUBLAS_COMPUTE_64F, 71 64F_PEDANTIC (f64 sums, f64 storage only).
    let f64_compute = matches!(compute, 70 | 71);
    if !f64_compute && !matches!(compute, 68 | 69 | 74 | 75 | 76 | 77) {
        return NOT_SUPPORTED;
    }
    let (Some(ta), Some(tb), Some(tc)) = (ty(a_type), ty(b_type), ty(c_type)) else {
        return NOT_SUPPORTED;
    };
    // The 32F-compute rows of cuBLAS's table: equal input types; output of that type or f32.
    // The 64F row: f64 everywhere.
    let f64_types = ta == Ty::F64 && tb == Ty::F64 && tc == Ty::F64;
    if f64_compute != f64_types
        || (!f64_compute && (ta == Ty::F64 || ta != tb || (tc != ta && tc != Ty::F32)))
    {
        return NOT_SUPPORTED;
    }
    if m < 0 || n < 0 || k < 0 || batch < 0 || stride_a < 0 || stride_b < 0 || stride_c < 0 {
        return INVALID_VALUE;
    }
    if !(0..=1).contains(&transa) || !(0..=1).contains(&transb) {
        return NOT_SUPPORTED;
    }
    let (m, n, k, batch) = (m as usize, n as usize, k as usize, batch as usize);
    let (lda, ldb, ldc) = (
        lda.max(0) as usize,
        ldb.max(0) as usize,
        ldc.max(0) as usize,
    );
    let (sa, sb, sc) = (stride_a as usize, stride_b as usize, stride_c as usize);
    // Stored shapes: A is m x k (N) or k x m (T); B is k x n (N) or n x k (T).
    let (ar, ac) = if transa == 0 { (m, k) } else { (k, m) };
    let (br, bc) = if transb == 0 { (k, n) } else { (n, k) };
    if lda < ar.max(1) || ldb < br.max(1) || ldc < m.max(1) {
        return INVALID_VALUE;
    }
    if alpha.is_null() || beta.is_null() {
        return INVALID_VALUE;
    }
    if !covered(a, ta, ar, ac, lda, sa, batch, dev)
        || !covered(b, tb, br, bc, ldb, sb, batch, dev)
        || !covered(c, tc, m, n, ldc, sc, batch, dev)
    {
        return INVALID_VALUE;
    }
    let (a, b, c) = (a as usize, b as usize, c as usize);
    if f64_compute {
        // SAFETY: host scalars (the default pointer mode), f64 for the f64 compute type.
        let (alpha, beta) = unsafe { (*(alpha as *const f64), *(beta as *const f64)) };
        let run = move || {
            let (a, b, c) = (a as *const c_void, b as *const c_void, c as *mut c_void);
            let mut ra = vec![0.0f64; m * k];
            let mut rb = vec![0.0f64; n * k];
            for bi in 0..batch {
                // SAFETY: inside the ranges checked by `covered`.
                unsafe {
                    pack64(a, bi * sa, lda, transa == 0, &mut ra, k);
                    pack64(b, bi * sb, ldb, transb != 0, &mut rb, k);
                }
                for j in 0..n {
                    let col = &rb[j * k..(j + 1) * k];
                    for i in 0..m {
                        let row = &ra[i * k..(i + 1) * k];
                        let acc = row.iter().zip(col).fold(0.0f64, |s, (x, y)| s + x * y);
                        let ci = bi * sc + i + j * ldc;
                        let v = if beta == 0.0 {
                            alpha * acc
                        } else {
                            // SAFETY: inside the range checked by `covered`.
                            alpha * acc + beta * unsafe { Ty::F64.load(c, ci) }
                        };
                        // SAFETY: as above.
                        unsafe { Ty::F64.store(c, ci, v) };
                    }
                }
            }
        };
        return match crate::queue::issue(stream as usize, dev, crate::queue::Work::new(run)) {
            Ok(()) => SUCCESS,
            Err(_) => EXECUTION_FAILED, // refused by a capture (see crate::capture)
        };
    }
    // SAFETY: host scalars (the default pointer mode), f32 for an f32 compute type.
    let (alpha, beta) = unsafe { (*(alpha as *const f32), *(beta as *const f32)) };
    // Deferred to the handle's stream like any device work; the matrices are read when it runs.
    let run = move || {
        let (a, b, c) = (a as *const c_void, b as *const c_void, c as *mut c_void);
        // op(A) as m rows of k and op(B)^T as n rows of k, in f32: each C element is then one
        // contiguous dot product (summed over k in order).
        let mut ra = vec![0.0f32; m * k];
        let mut rb = vec![0.0f32; n * k];
        for bi in 0..batch {
            // SAFETY: inside the ranges checked by `covered`.
            unsafe {
                pack(ta, a, bi * sa, lda, transa == 0, &mut ra, k);
                pack(tb, b, bi * sb, ldb, transb != 0, &mut rb, k);
            }
            for j in 0..n {
                let col = &rb[j * k..(j + 1) * k];
                for i in 0..m {
                    let row = &ra[i * k..(i + 1) * k];
                    let mut acc = 0.0f32;
                    for p in 0..k {
                        acc += row[p] * col[p];
                    }
                    let ci = bi * sc + i + j * ldc;
                    let v = if beta == 0.0 {
                        alpha * acc
                    } else {
                        // SAFETY: inside the range checked by `covered`.
                        alpha * acc + beta * unsafe { tc.load(c, ci) } as f32
                    };
                    // SAFETY: as above.
                    unsafe { tc.store(c, ci, f64::from(v)) };
                }
            }
        }
    };
    match crate::queue::issue(stream as usize, dev, crate::queue::Work::new(run)) {
        Ok(()) => SUCCESS,
        Err(_) => EXECUTION_FAILED, // refused by a capture (see crate::capture)
    }
}

#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub unsafe extern "C" fn cublasGemmEx(
    h: *mut c_void,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    compute: c_int,
    algo: c_int,
) -> Status {
    unsafe {
        cublasGemmStridedBatchedEx(
            h, transa, transb, m, n, k, alpha, a, a_type, lda, 0, b, b_type, ldb, 0, beta, c,
            c_type, ldc, 0, 1, compute, algo,
        )
    }
}

#[no_mangle]
pub extern "C" fn cublasGetStatusString(s: Status) -> *const std::ffi::c_char {
    match s {
        SUCCESS => c"CUBLAS_STATUS_SUCCESS",
        NOT_INITIALIZED => c"CUBLAS_STATUS_NOT_INITIALIZED",
        INVALID_VALUE => c"CUBLAS_STATUS_INVALID_VALUE",
        EXECUTION_FAILED => c"CUBLAS_STATUS_EXECUTION_FAILED",
        NOT_SUPPORTED => c"CUBLAS_STATUS_NOT_SUPPORTED",
        _ => c"CUBLAS_STATUS_UNKNOWN",
    }
    .as_ptr()
}
