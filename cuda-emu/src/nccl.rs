//! The NCCL subset fsdp calls, for communicators of one rank (the emulator has one process
//! and no transport): every collective is a copy from the send to the receive buffer. A
//! communicator of more ranks is refused with `ncclInvalidUsage` and a message saying so.

use crate::driver;
use crate::memory;
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

struct Comm {
    device: c_int,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(code: NcclResult, why: &str) -> NcclResult {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(why).unwrap_or_default());
    code
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    if v.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { v.write(22_703) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    if id.is_null() {
        return INVALID_ARGUMENT;
    }
    let mut internal = [0 as c_char; 128];
    for (i, b) in b"cuda-emu".iter().enumerate() {
        internal[i] = *b as c_char;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { id.write(UniqueId { internal }) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    _id: UniqueId,
    rank: c_int,
) -> NcclResult {
    if comm.is_null() {
        return fail(INVALID_ARGUMENT, "ncclCommInitRank: null comm");
    }
    if nranks != 1 || rank != 0 {
        return fail(
            INVALID_USAGE,
            "cuda-emu runs NCCL communicators of one rank only (it has no transport between processes)",
        );
    }
    let Some(device) = driver::current_device() else {
        return fail(INVALID_USAGE, "ncclCommInitRank: no current CUDA context");
    };
    // SAFETY: the caller's out-pointer.
    unsafe { comm.write(Box::into_raw(Box::new(Comm { device })) as *mut c_void) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> NcclResult {
    // SAFETY: made by ncclCommInitRank, destroyed once.
    match unsafe { driver::free_handle::<Comm>(comm) } {
        true => SUCCESS,
        false => INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> NcclResult {
    unsafe { ncclCommDestroy(comm) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: *mut c_void,
    r: *mut NcclResult,
) -> NcclResult {
    if comm.is_null() || r.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { r.write(SUCCESS) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *mut c_void, n: *mut c_int) -> NcclResult {
    if comm.is_null() || n.is_null() {
        return INVALID_ARGUMENT;
    }
    unsafe { n.write(1) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *mut c_void, r: *mut c_int) -> NcclResult {
    if comm.is_null() || r.is_null() {
        return INVALID_ARGUMENT;
    }
    unsafe { r.write(0) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    match r {
        0 => c"no error",
        1 => c"unhandled cuda error",
        2 => c"unhandled system error",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote process exited or there was a network error",
        _ => c"unknown result code",
    }
    .as_ptr()
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

fn dtype_size(t: c_int) -> Option<usize> {
    match t {
        0 | 1 => Some(1),     // int8, uint8
        2 | 3 | 7 => Some(4), // int32, uint32, float32
        4 | 5 | 8 => Some(8), // int64, uint64, float64
        6 | 9 => Some(2),     // float16, bfloat16
        _ => None,
    }
}

/// One rank's collective: checks, then copies `count` elements from `send` to `recv`.
unsafe fn one_rank(
    comm: *mut c_void,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    stream: *mut c_void,
    op: &str,
) -> NcclResult {
    if comm.is_null() {
        return fail(INVALID_ARGUMENT, &format!("{op}: null communicator"));
    }
    // SAFETY: made by ncclCommInitRank.
    let device = unsafe { (*(comm as *const Comm)).device };
    let Some(size) = dtype_size(dtype) else {
        return fail(INVALID_ARGUMENT, &format!("{op}: unknown datatype {dtype}"));
    };
    // SAFETY: a stream handle of the emulated driver.
    if unsafe { driver::device_of_stream(stream) } != Some(device) {
        return fail(
            INVALID_ARGUMENT,
            &format!("{op}: stream of another device than the communicator's"),
        );
    }
    let bytes = count * size;
    if bytes == 0 {
        return SUCCESS;
    }
    if memory::device_of(send as usize, bytes) != Some(device)
        || memory::device_of(recv as usize, bytes) != Some(device)
    {
        return fail(
            INVALID_ARGUMENT,
            &format!("{op}: a buffer is not {bytes} bytes of device memory of cuda:{device}"),
        );
    }
    let (send, recv) = (send as usize, recv as usize);
    // NCCL defines in place only as send == recv (the rank's chunk, rank 0 here); any other
    // overlap is undefined there: refused here, so fsdp's copies around it are tested.
    if send != recv && send < recv + bytes && recv < send + bytes {
        return fail(
            INVALID_ARGUMENT,
            &format!("{op}: send and receive buffers overlap without being in place"),
        );
    }
    // SAFETY: both ranges checked at issue; a free drains the device first.
    let copy = move || unsafe { std::ptr::copy(send as *const u8, recv as *mut u8, bytes) };
    crate::queue::issue(stream as usize, device, crate::queue::Work::new(copy));
    SUCCESS
}

/// A reduction of one rank: the identity for sum, prod, max, min and avg (0..=4).
#[allow(clippy::too_many_arguments)]
unsafe fn reduction(
    op: c_int,
    comm: *mut c_void,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    stream: *mut c_void,
    name: &str,
) -> NcclResult {
    if !(0..=4).contains(&op) {
        return fail(INVALID_ARGUMENT, &format!("{name}: unknown reduction {op}"));
    }
    unsafe { one_rank(comm, send, recv, count, dtype, stream, name) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { one_rank(comm, send, recv, count, dtype, stream, "ncclAllGather") }
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe {
        reduction(
            op,
            comm,
            send,
            recv,
            count,
            dtype,
            stream,
            "ncclReduceScatter",
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { reduction(op, comm, send, recv, count, dtype, stream, "ncclAllReduce") }
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    if root != 0 {
        return fail(
            INVALID_ARGUMENT,
            "ncclBroadcast: root outside the communicator",
        );
    }
    unsafe { one_rank(comm, send, recv, count, dtype, stream, "ncclBroadcast") }
}
