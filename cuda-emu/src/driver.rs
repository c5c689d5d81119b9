//! The driver API subset fsdp (through cudarc) calls, with the driver's checks (see the
//! crate docs). Handles are addresses of boxed objects; contexts are one primary context per
//! emulated device; every operation runs synchronously when issued.

use crate::memory;
use crate::queue::{self, Mark, Work};
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

/// Emulated devices: `CUDA_EMU_DEVICES` (default 2, at most 8).
fn device_count() -> c_int {
    std::env::var("CUDA_EMU_DEVICES")
        .ok()
        .and_then(|v| v.parse::<c_int>().ok())
        .unwrap_or(2)
        .clamp(0, 8)
}

/// Memory each emulated device reports, bytes.
const TOTAL_MEM: usize = 16 << 30;
/// Multiprocessors each reports: few, so grid-stride loops take several turns.
const SMS: c_int = 2;

#[repr(C)]
struct Ctx {
    device: c_int,
}
static CONTEXTS: [Ctx; 8] = [
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
    /// The stream work the last record marked (None: nothing was pending, or never recorded).
    mark: Option<Mark>,
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
    queue::synchronize_device(try_cu!(current()));
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

// ---- memory ------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, bytes: usize) -> CUresult {
    let dev = try_cu!(current());
    if bytes == 0 {
        return INVALID_VALUE;
    }
    if memory::used(dev) + bytes > TOTAL_MEM {
        return OUT_OF_MEMORY;
    }
    match memory::alloc(bytes, dev) {
        Some(p) => unsafe { out(ptr, p as u64) },
        None => OUT_OF_MEMORY,
    }
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> CUresult {
    try_cu!(current());
    if ptr == 0 {
        return SUCCESS;
    }
    // cuMemFree waits for the device's work, which may still use the memory.
    if let Some(d) = memory::device_of(ptr as usize, 0) {
        queue::synchronize_device(d);
    }
    if memory::free(ptr as usize) {
        SUCCESS
    } else {
        INVALID_VALUE
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let dev = try_cu!(current());
    let r = unsafe { out(free, TOTAL_MEM.saturating_sub(memory::used(dev))) };
    if r != SUCCESS {
        return r;
    }
    unsafe { out(total, TOTAL_MEM) }
}

fn device_range(ptr: u64, bytes: usize) -> Result<c_int, CUresult> {
    memory::device_of(ptr as usize, bytes).ok_or(INVALID_VALUE)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    try_cu!(unsafe { on_stream(stream) });
    if bytes == 0 {
        return SUCCESS;
    }
    let dev = try_cu!(device_range(dst, bytes));
    if src.is_null() {
        return INVALID_VALUE;
    }
    // From pageable host memory the driver stages the source before returning: copy it now.
    // SAFETY: src is the caller's host buffer of `bytes` bytes.
    let data = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec();
    queue::issue(
        stream as usize,
        dev,
        Work::new(move || {
            // SAFETY: dst was checked against the allocation table; a free drains first.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, bytes) }
        }),
    );
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if bytes == 0 {
        return SUCCESS;
    }
    try_cu!(device_range(src, bytes));
    if dst.is_null() {
        return INVALID_VALUE;
    }
    // To pageable host memory the copy is synchronous: the stream's work first, then it.
    queue::synchronize(stream as usize, dev);
    // SAFETY: src checked; dst is the caller's host buffer.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: u64,
    src: u64,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if bytes == 0 {
        return SUCCESS;
    }
    try_cu!(device_range(dst, bytes));
    try_cu!(device_range(src, bytes));
    queue::issue(stream as usize, dev, copy_work(dst, src, bytes));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, bytes: usize) -> CUresult {
    unsafe { cuMemcpyHtoDAsync_v2(dst, src, bytes, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, bytes: usize) -> CUresult {
    unsafe { cuMemcpyDtoHAsync_v2(dst, src, bytes, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, bytes: usize) -> CUresult {
    unsafe { cuMemcpyDtoDAsync_v2(dst, src, bytes, std::ptr::null_mut()) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: u64,
    dst_ctx: *mut c_void,
    src: u64,
    src_ctx: *mut c_void,
    bytes: usize,
    stream: *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    let (Some(dd), Some(sd)) = (ctx_device(dst_ctx), ctx_device(src_ctx)) else {
        return INVALID_CONTEXT;
    };
    if bytes == 0 {
        return SUCCESS;
    }
    if try_cu!(device_range(dst, bytes)) != dd || try_cu!(device_range(src, bytes)) != sd {
        return INVALID_VALUE;
    }
    queue::issue(stream as usize, dev, copy_work(dst, src, bytes));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dst: u64,
    value: u8,
    n: usize,
    stream: *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if n == 0 {
        return SUCCESS;
    }
    try_cu!(device_range(dst, n));
    // SAFETY: range checked at issue; a free drains the device first.
    let w = Work::new(move || unsafe { std::ptr::write_bytes(dst as *mut u8, value, n) });
    queue::issue(stream as usize, dev, w);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(
    dst: u64,
    value: c_uint,
    n: usize,
    stream: *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if n == 0 {
        return SUCCESS;
    }
    try_cu!(device_range(dst, n * 4));
    if dst % 4 != 0 {
        return INVALID_VALUE;
    }
    let w = Work::new(move || {
        for i in 0..n {
            // SAFETY: range and alignment checked at issue; a free drains the device first.
            unsafe { (dst as *mut u32).add(i).write(value) };
        }
    });
    queue::issue(stream as usize, dev, w);
    SUCCESS
}

// ---- streams and events ------------------------------------------------------------------

/// A deferred device-to-device copy of ranges checked at issue.
fn copy_work(dst: u64, src: u64, bytes: usize) -> Work {
    // SAFETY: both ranges were checked at issue; a free drains the device first.
    Work::new(move || unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) })
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> CUresult {
    let device = try_cu!(current());
    unsafe {
        out(
            stream,
            Box::into_raw(Box::new(StreamObj { device })) as *mut c_void,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut *mut c_void,
    flags: c_uint,
    _p: c_int,
) -> CUresult {
    unsafe { cuStreamCreate(stream, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    if stream.is_null() {
        return INVALID_HANDLE;
    }
    // Pending work still completes.
    queue::destroy(stream as usize);
    // SAFETY: made by cuStreamCreate, destroyed once.
    drop(unsafe { Box::from_raw(stream as *mut StreamObj) });
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    let dev = try_cu!(unsafe { stream_device(stream) });
    queue::synchronize(stream as usize, dev);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> CUresult {
    // As cuEventQuery: NOT_READY while work is pending, which the poll then runs.
    let dev = try_cu!(unsafe { stream_device(stream) });
    if queue::mark(stream as usize).is_none() {
        return SUCCESS;
    }
    queue::synchronize(stream as usize, dev);
    NOT_READY
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuEventCreate. An event with nothing pending at its record: no wait.
    if let Some(m) = unsafe { (*(event as *const EventObj)).mark } {
        queue::wait(stream as usize, dev, m);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut c_void, flags: c_uint) -> CUresult {
    let device = try_cu!(current());
    let e = EventObj {
        device,
        mark: None,
        recorded: false,
        timing: flags & 0x2 == 0, // CU_EVENT_DISABLE_TIMING
        at: Arc::new(Mutex::new(None)),
    };
    unsafe { out(event, Box::into_raw(Box::new(e)) as *mut c_void) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CUresult {
    if event.is_null() {
        return INVALID_HANDLE;
    }
    let sd = try_cu!(unsafe { stream_device(stream) });
    // SAFETY: made by cuEventCreate.
    let e = unsafe { &mut *(event as *mut EventObj) };
    if e.device != sd {
        return INVALID_HANDLE;
    }
    // The time is taken when the stream reaches this point, as on the device.
    let at = e.at.clone();
    *lock(&at) = None;
    queue::issue(
        stream as usize,
        sd,
        Work::new(move || *lock(&at) = Some(Instant::now())),
    );
    e.mark = queue::mark(stream as usize);
    e.recorded = true;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    event: *mut c_void,
    stream: *mut c_void,
    _f: c_uint,
) -> CUresult {
    unsafe { cuEventRecord(event, stream) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(event: *mut c_void) -> CUresult {
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuEventCreate.
    if let Some(m) = unsafe { (*(event as *const EventObj)).mark } {
        queue::complete(m);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(event: *mut c_void) -> CUresult {
    if event.is_null() {
        return INVALID_HANDLE;
    }
    // Work still pending answers NOT_READY, as a busy device would; the poll also lets the
    // "device" make progress (the work runs), so the next poll answers SUCCESS.
    // SAFETY: made by cuEventCreate.
    match unsafe { (*(event as *const EventObj)).mark } {
        Some(m) if !queue::is_complete(m) => {
            queue::complete(m);
            NOT_READY
        }
        _ => SUCCESS,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    // SAFETY: made by cuEventCreate, destroyed once (its recorded work still runs).
    match unsafe { free_handle::<EventObj>(event) } {
        true => SUCCESS,
        false => INVALID_HANDLE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CUresult {
    if start.is_null() || end.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuEventCreate.
    let (start, end) = unsafe { (&*(start as *const EventObj), &*(end as *const EventObj)) };
    if !start.recorded || !end.recorded || !start.timing || !end.timing {
        return INVALID_HANDLE;
    }
    let time = |e: &EventObj| {
        if let Some(m) = e.mark {
            queue::complete(m);
        }
        *lock(&e.at)
    };
    match (time(start), time(end)) {
        (Some(a), Some(b)) => unsafe {
            out(ms, b.saturating_duration_since(a).as_secs_f32() * 1e3)
        },
        _ => INVALID_HANDLE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CUresult {
    unsafe { cuEventElapsedTime_v2(ms, start, end) }
}

// ---- modules and launches ----------------------------------------------------------------

extern "C" {
    fn emu_find_kernel(name: *const c_char) -> *const c_void;
    fn emu_check_pointers(kernel: *const c_void, params: *mut *mut c_void) -> c_int;
    fn emu_param_sizes(kernel: *const c_void, n: *mut usize) -> *const usize;
    fn emu_launch(
        kernel: *const c_void,
        gx: c_uint,
        gy: c_uint,
        gz: c_uint,
        bx: c_uint,
        by: c_uint,
        bz: c_uint,
        params: *mut *mut c_void,
    ) -> c_int;
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(
    module: *mut *mut c_void,
    image: *const c_void,
) -> CUresult {
    let device = try_cu!(current());
    if image.is_null() {
        return INVALID_VALUE;
    }
    // The image (nvcc's fat binary) is not read: every kernel of kernels/*.cu is compiled in.
    unsafe {
        out(
            module,
            Box::into_raw(Box::new(ModuleObj { device })) as *mut c_void,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(module: *mut c_void) -> CUresult {
    // SAFETY: made by cuModuleLoadData, unloaded once. Its functions are leaked on purpose.
    match unsafe { free_handle::<ModuleObj>(module) } {
        true => SUCCESS,
        false => INVALID_HANDLE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut *mut c_void,
    module: *mut c_void,
    name: *const c_char,
) -> CUresult {
    try_cu!(current());
    if module.is_null() || name.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuModuleLoadData; name is a C string.
    let device = unsafe { (*(module as *const ModuleObj)).device };
    let kernel = unsafe { emu_find_kernel(name) };
    if kernel.is_null() {
        return NOT_FOUND;
    }
    unsafe {
        out(
            f,
            Box::into_raw(Box::new(FunctionObj { device, kernel })) as *mut c_void,
        )
    }
}

#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared_bytes: c_uint,
    stream: *mut c_void,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if f.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuModuleGetFunction.
    let func = unsafe { &*(f as *const FunctionObj) };
    if func.device != dev {
        return INVALID_HANDLE;
    }
    if !extra.is_null() || shared_bytes != 0 || params.is_null() {
        return INVALID_VALUE; // fsdp passes parameters by kernelParams, no dynamic shared memory
    }
    // SAFETY: params holds one pointer per kernel parameter (the caller's contract).
    if unsafe { emu_check_pointers(func.kernel, params) } != 0 {
        return INVALID_VALUE;
    }
    // The device's limits (the runtime checks them again when the launch runs).
    let block_ok = (1..=1024).contains(&bx) && by == 1 && bz == 1;
    let grid_ok = gx >= 1
        && gx <= i32::MAX as c_uint
        && (1..=65535).contains(&gy)
        && (1..=65535).contains(&gz);
    if !block_ok || !grid_ok {
        return INVALID_VALUE;
    }
    // The driver copies the argument values at launch: keep them, one 8-byte slot each.
    let mut n = 0usize;
    // SAFETY: a kernel of the table; `sizes` has `n` entries.
    let sizes = unsafe { std::slice::from_raw_parts(emu_param_sizes(func.kernel, &mut n), n) };
    let mut slots = vec![0u64; n];
    for (i, (&size, slot)) in sizes.iter().zip(slots.iter_mut()).enumerate() {
        // SAFETY: params[i] points at a value of the kernel's parameter i (the caller's
        // contract); at most 8 bytes are read, into an 8-byte slot.
        unsafe {
            std::ptr::copy_nonoverlapping(
                *params.add(i) as *const u8,
                slot as *mut u64 as *mut u8,
                size.min(8),
            )
        };
    }
    let kernel = func.kernel as usize;
    let run = move || {
        let mut slots = slots;
        let mut ptrs: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: geometry and pointers were checked at issue, and the memory stays allocated
        // until the device's work has run (a free drains it first).
        let r = unsafe {
            emu_launch(
                kernel as *const c_void,
                gx,
                gy,
                gz,
                bx,
                by,
                bz,
                ptrs.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "cuda-emu: a launch checked at issue was refused");
    };
    queue::issue(stream as usize, dev, Work::new(run));
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
