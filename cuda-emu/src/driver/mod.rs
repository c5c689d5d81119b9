//! The driver API subset fsdp (through cudarc) calls, with the driver's checks (see the
//! crate docs). Handles are addresses of boxed objects; contexts are one primary context per
//! emulated device; stream-ordered work goes through `crate::queue`.
//!
//! | file | entry points |
//! |---|---|
//! | `mod.rs` | init, devices, contexts, error strings; the checks the others share |
//! | `copies.rs` | allocation, copies, memsets |
//! | `streams.rs` | streams and events |
//! | `launch.rs` | modules and kernel launches |
//! | `graph.rs` | stream capture, graphs and their launches (`crate::capture`) |

use crate::memory;
use crate::queue::{self, Point, Work};
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub type CUresult = c_uint;
pub const SUCCESS: CUresult = 0;
pub const INVALID_VALUE: CUresult = 1;
pub const OUT_OF_MEMORY: CUresult = 2;
pub const NOT_INITIALIZED: CUresult = 3;
pub const INVALID_DEVICE: CUresult = 101;
pub const INVALID_CONTEXT: CUresult = 201;
pub const INVALID_HANDLE: CUresult = 400;
pub const NOT_FOUND: CUresult = 500;
pub const NOT_READY: CUresult = 600;

/// Emulated devices: `CUDA_EMU_DEVICES` (default 2, at most 8; 0: no GPU), see `crate::env`.
fn device_count() -> c_int {
    crate::env::devices()
}

/// Memory each emulated device reports, bytes.
const TOTAL_MEM: usize = 16 << 30;
/// Multiprocessors each reports: few, so grid-stride loops take several turns.
const SMS: c_int = 2;

#[repr(C)]
struct Ctx {
    device: c_int,
}
static CONTEXTS: [Ctx; crate::env::MAX_DEVICES as usize] = [
    Ctx { device: 0 },
    Ctx { device: 1 },
    Ctx { device: 2 },
    Ctx { device: 3 },
    Ctx { device: 4 },
    Ctx { device: 5 },
    Ctx { device: 6 },
    Ctx { device: 7 },
];

thread_local! {
    static CURRENT: Cell<*const Ctx> = const { Cell::new(std::ptr::null()) };
}
static INITIALIZED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn current() -> Result<c_int, CUresult> {
    if !INITIALIZED.load(std::sync::atomic::Ordering::Acquire) {
        return Err(NOT_INITIALIZED);
    }
    let c = CURRENT.with(|c| c.get());
    if c.is_null() {
        return Err(INVALID_CONTEXT);
    }
    // SAFETY: CURRENT only ever holds addresses of CONTEXTS.
    Ok(unsafe { (*c).device })
}

fn ctx_device(ctx: *mut c_void) -> Option<c_int> {
    let base = CONTEXTS.as_ptr() as usize;
    let p = ctx as usize;
    let i = p.checked_sub(base)? / std::mem::size_of::<Ctx>();
    (i < device_count() as usize && p == base + i * std::mem::size_of::<Ctx>())
        .then_some(i as c_int)
}

macro_rules! try_cu {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

struct StreamObj {
    device: c_int,
}
struct EventObj {
    device: c_int,
    /// The stream work (or captured node) the last record marked (None: nothing was
    /// pending, or never recorded).
    mark: Option<Point>,
    recorded: bool,
    /// Created without CU_EVENT_DISABLE_TIMING.
    timing: bool,
    /// When the recorded point ran (for cuEventElapsedTime).
    at: Arc<Mutex<Option<Instant>>>,
}
struct ModuleObj {
    device: c_int,
}
struct FunctionObj {
    device: c_int,
    kernel: *const c_void,
}

/// The device of a stream handle (null: the current context's legacy stream).
unsafe fn stream_device(stream: *mut c_void) -> Result<c_int, CUresult> {
    if stream.is_null() {
        return current();
    }
    // SAFETY: non-null stream handles are `StreamObj`s made by cuStreamCreate.
    Ok(unsafe { (*(stream as *const StreamObj)).device })
}

/// Frees a handle made with `Box::into_raw`; false for a null one.
///
/// # Safety
/// `h` is null or a live handle of type `T`, freed once.
pub(crate) unsafe fn free_handle<T>(h: *mut c_void) -> bool {
    if h.is_null() {
        return false;
    }
    // SAFETY: forwarded from the caller.
    drop(unsafe { Box::from_raw(h as *mut T) });
    true
}

/// Checks a stream-ordered operation: a current context, and a stream of its device.
unsafe fn on_stream(stream: *mut c_void) -> Result<c_int, CUresult> {
    let dev = current()?;
    // SAFETY: forwarded.
    if unsafe { stream_device(stream)? } != dev {
        return Err(INVALID_HANDLE);
    }
    Ok(dev)
}

unsafe fn out<T>(p: *mut T, v: T) -> CUresult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { p.write(v) };
    SUCCESS
}

/// Checks a host synchronization of `stream` and/or `point` against the captures in
/// progress (see `crate::capture`); `unsafe_call`: an allocation, free, event query or
/// synchronization, refused during a capture that is not relaxed.
fn capture_check(
    stream: Option<usize>,
    point: Option<Point>,
    unsafe_call: bool,
) -> Result<(), CUresult> {
    queue::check_capture(stream, point, unsafe_call)
}

mod copies;
mod graph;
mod launch;
mod streams;

// ---- init, devices, contexts -------------------------------------------------------------

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    INITIALIZED.store(true, std::sync::atomic::Ordering::Release);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    unsafe { out(v, 13000) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    if !INITIALIZED.load(std::sync::atomic::Ordering::Acquire) {
        return NOT_INITIALIZED;
    }
    unsafe { out(n, device_count()) }
}

fn check_device(d: c_int) -> Result<(), CUresult> {
    if !INITIALIZED.load(std::sync::atomic::Ordering::Acquire) {
        return Err(NOT_INITIALIZED);
    }
    if d < 0 || d >= device_count() {
        return Err(INVALID_DEVICE);
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> CUresult {
    try_cu!(check_device(ordinal));
    unsafe { out(d, ordinal) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, d: c_int) -> CUresult {
    try_cu!(check_device(d));
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let s = format!("cuda-emu CPU device {d}\0");
    let n = s.len().min(len as usize);
    // SAFETY: the caller's buffer holds `len` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr() as *const c_char, name, n);
        *name.add(n - 1) = 0;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, d: c_int) -> CUresult {
    try_cu!(check_device(d));
    unsafe { out(bytes, TOTAL_MEM) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attrib: c_int, d: c_int) -> CUresult {
    try_cu!(check_device(d));
    let value = match attrib {
        1 => 1024,      // MAX_THREADS_PER_BLOCK
        2 => 1024,      // MAX_BLOCK_DIM_X
        3 | 4 => 64,    // MAX_BLOCK_DIM_Y/Z
        5 => i32::MAX,  // MAX_GRID_DIM_X
        6 | 7 => 65535, // MAX_GRID_DIM_Y/Z
        8 => 48 * 1024, // MAX_SHARED_MEMORY_PER_BLOCK
        10 => 32,       // WARP_SIZE
        16 => SMS,      // MULTIPROCESSOR_COUNT
        41 => 1,        // UNIFIED_ADDRESSING
        75 => 9,        // COMPUTE_CAPABILITY_MAJOR
        76 => 0,        // COMPUTE_CAPABILITY_MINOR
        _ => 0,         // everything else (memory pools, managed memory...): absent
    };
    unsafe { out(v, value) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, d: c_int, peer: c_int) -> CUresult {
    try_cu!(check_device(d));
    try_cu!(check_device(peer));
    unsafe { out(can, 1) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, d: c_int) -> CUresult {
    try_cu!(check_device(d));
    unsafe { out(ctx, &CONTEXTS[d as usize] as *const Ctx as *mut c_void) }
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(d: c_int) -> CUresult {
    try_cu!(check_device(d));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CUresult {
    if ctx.is_null() {
        CURRENT.with(|c| c.set(std::ptr::null()));
        return SUCCESS;
    }
    let Some(d) = ctx_device(ctx) else {
        return INVALID_CONTEXT;
    };
    CURRENT.with(|c| c.set(&CONTEXTS[d as usize]));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CUresult {
    unsafe { out(ctx, CURRENT.with(|c| c.get()) as *mut c_void) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: *mut c_void) -> CUresult {
    cuCtxSetCurrent(ctx)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut *mut c_void) -> CUresult {
    let c = CURRENT.with(|c| c.replace(std::ptr::null()));
    if !ctx.is_null() {
        unsafe { ctx.write(c as *mut c_void) };
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(d: *mut c_int) -> CUresult {
    let dev = try_cu!(current());
    unsafe { out(d, dev) }
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    let dev = try_cu!(current());
    try_cu!(capture_check(Some(0), None, true));
    queue::synchronize_device(dev);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxEnablePeerAccess(peer: *mut c_void, _flags: c_uint) -> CUresult {
    try_cu!(current());
    if ctx_device(peer).is_none() {
        return INVALID_CONTEXT;
    }
    SUCCESS
}

// ---- errors ------------------------------------------------------------------------------

fn error_text(e: CUresult) -> (&'static CStr, &'static CStr) {
    match e {
        SUCCESS => (c"CUDA_SUCCESS", c"no error"),
        INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        OUT_OF_MEMORY => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        INVALID_DEVICE => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        INVALID_CONTEXT => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        INVALID_HANDLE => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        NOT_FOUND => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        NOT_READY => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        crate::capture::ILLEGAL_STATE => (
            c"CUDA_ERROR_ILLEGAL_STATE",
            c"the operation is not permitted in the stream's capture state",
        ),
        crate::capture::UNSUPPORTED => (
            c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            c"operation not permitted when stream is capturing",
        ),
        crate::capture::INVALIDATED => (
            c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            c"operation failed due to a previous error during capture",
        ),
        crate::capture::MERGE => (
            c"CUDA_ERROR_STREAM_CAPTURE_MERGE",
            c"operation would result in a merge of separate capture sequences",
        ),
        crate::capture::UNMATCHED => (
            c"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
            c"capture was not ended in the same stream as it began",
        ),
        crate::capture::UNJOINED => (
            c"CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
            c"capturing stream has unjoined work",
        ),
        crate::capture::ISOLATION => (
            c"CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
            c"dependency created on uncaptured work in another stream",
        ),
        crate::capture::IMPLICIT => (
            c"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
            c"operation would make the legacy stream depend on a capturing blocking stream",
        ),
        _ => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(e: CUresult, s: *mut *const c_char) -> CUresult {
    unsafe { out(s, error_text(e).0.as_ptr()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(e: CUresult, s: *mut *const c_char) -> CUresult {
    unsafe { out(s, error_text(e).1.as_ptr()) }
}

/// The device of the current context, for cuBLAS and NCCL's checks.
pub(crate) fn current_device() -> Option<c_int> {
    current().ok()
}

/// The device of a stream handle, for cuBLAS and NCCL's checks.
pub(crate) unsafe fn device_of_stream(stream: *mut c_void) -> Option<c_int> {
    unsafe { stream_device(stream).ok() }
}
