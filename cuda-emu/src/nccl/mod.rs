//! The NCCL subset fsdp calls, for communicators of any size: ranks are threads of one
//! process or separate processes (`fsdp launch`), meeting in a directory named by the
//! communicator's unique id (`comm.rs`). A collective waits in its stream's queue like any
//! other work and finishes once every rank has posted its part; reductions are exact in
//! rank order (`reduce.rs`). Issued on a capturing stream, a collective becomes a node of
//! the graph (`capture.rs`), run anew at each launch, as NCCL 2.9 and later permit.
//! Failures reach the caller as NCCL reports them: a peer that aborted or exited, and
//! (beyond NCCL) ranks that called different collectives, through `ncclCommGetAsyncError`
//! and `ncclGetLastError`.

mod comm;
mod reduce;

use crate::driver;
use crate::memory;
use comm::{Collective, Op, Shared};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Arc;

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;

/// `ncclUniqueId`: 128 opaque bytes; here the name of the communicator's directory.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

struct Comm {
    shared: Arc<Shared>,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(code: NcclResult, why: &str) -> NcclResult {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(why).unwrap_or_default());
    code
}

/// The communicator behind a handle.
///
/// # Safety
/// `comm` is null or a live handle made by `ncclCommInitRank`.
unsafe fn shared_of(comm: *mut c_void) -> Option<Arc<Shared>> {
    // SAFETY: forwarded.
    (!comm.is_null()).then(|| unsafe { (*(comm as *const Comm)).shared.clone() })
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
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let name = format!(
        "{:x}-{:x}-{:x}",
        std::process::id(),
        nanos,
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let mut internal = [0 as c_char; 128];
    for (i, b) in name.bytes().enumerate().take(127) {
        internal[i] = b as c_char;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { id.write(UniqueId { internal }) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> NcclResult {
    if comm.is_null() {
        return fail(INVALID_ARGUMENT, "ncclCommInitRank: null comm");
    }
    if nranks < 1 || rank < 0 || rank >= nranks {
        return fail(
            INVALID_ARGUMENT,
            &format!("ncclCommInitRank: rank {rank} of a communicator of {nranks}"),
        );
    }
    let name: String = id
        .internal
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
        return fail(
            INVALID_ARGUMENT,
            "ncclCommInitRank: not a unique id of ncclGetUniqueId",
        );
    }
    let Some(device) = driver::current_device() else {
        return fail(INVALID_USAGE, "ncclCommInitRank: no current CUDA context");
    };
    let shared = match Shared::join(&name, rank as usize, nranks as usize, device) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            return fail(
                comm::REMOTE_ERROR,
                &format!("ncclCommInitRank: the communicator's directory: {e}"),
            )
        }
    };
    // SAFETY: the caller's out-pointer.
    unsafe { comm.write(Box::into_raw(Box::new(Comm { shared })) as *mut c_void) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> NcclResult {
    // SAFETY: made by ncclCommInitRank, destroyed once.
    let Some(shared) = (unsafe { shared_of(comm) }) else {
        return INVALID_ARGUMENT;
    };
    shared.leave();
    // SAFETY: as above.
    unsafe { driver::free_handle::<Comm>(comm) };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut c_void) -> NcclResult {
    // SAFETY: made by ncclCommInitRank.
    if let Some(shared) = unsafe { shared_of(comm) } {
        shared.abort();
    }
    unsafe { ncclCommDestroy(comm) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: *mut c_void,
    r: *mut NcclResult,
) -> NcclResult {
    if r.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: made by ncclCommInitRank.
    let Some(shared) = (unsafe { shared_of(comm) }) else {
        return INVALID_ARGUMENT;
    };
    let (code, why) = shared.error();
    if code != SUCCESS {
        fail(code, &why);
    }
    // SAFETY: the caller's out-pointer.
    unsafe { r.write(code) };
    SUCCESS
}

/// Writes `f` of the communicator to `out`: the two integer queries below.
///
/// # Safety
/// `comm` is null or made by `ncclCommInitRank`; `out` is null or writable.
unsafe fn answer(comm: *mut c_void, out: *mut c_int, f: fn(&Shared) -> usize) -> NcclResult {
    // SAFETY: forwarded.
    match unsafe { shared_of(comm) } {
        Some(s) if !out.is_null() => unsafe { out.write(f(&s) as c_int) },
        _ => return INVALID_ARGUMENT,
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommCount(comm: *mut c_void, n: *mut c_int) -> NcclResult {
    unsafe { answer(comm, n, |s| s.nranks) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommUserRank(comm: *mut c_void, r: *mut c_int) -> NcclResult {
    unsafe { answer(comm, r, |s| s.rank) }
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
pub extern "C" fn ncclGetLastError(comm: *mut c_void) -> *const c_char {
    // SAFETY: made by ncclCommInitRank (or null).
    if let Some(s) = unsafe { shared_of(comm) } {
        let (code, why) = s.error();
        if code != SUCCESS {
            fail(code, &why);
        }
    }
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

/// Checks one rank's call and queues its part of the collective on `stream`.
unsafe fn collective(
    comm: *mut c_void,
    mut op: Op,
    send: *const c_void,
    recv: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let name = op.name();
    // SAFETY: made by ncclCommInitRank.
    let Some(shared) = (unsafe { shared_of(comm) }) else {
        return fail(INVALID_ARGUMENT, &format!("{name}: null communicator"));
    };
    let device = shared.device;
    let Some(size) = dtype_size(op.dtype) else {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: unknown datatype {}", op.dtype),
        );
    };
    if op.kind != 0 && op.kind != 3 && !(0..=4).contains(&op.redop) {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: unknown reduction {}", op.redop),
        );
    }
    let n = shared.nranks;
    if op.kind == 3 && !(0..n as c_int).contains(&op.root) {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: root {} outside a communicator of {n}", op.root),
        );
    }
    if op.kind == 0 || op.kind == 3 {
        op.redop = 0;
    }
    if op.kind != 3 {
        op.root = 0;
    }
    // SAFETY: a stream handle of the emulated driver.
    if unsafe { driver::device_of_stream(stream) } != Some(device) {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: stream of another device than the communicator's"),
        );
    }
    let bytes = op.count as usize * size;
    let (send_bytes, recv_bytes) = match op.kind {
        0 => (bytes, bytes * n),
        1 => (bytes * n, bytes),
        _ => (bytes, bytes),
    };
    if bytes == 0 {
        return SUCCESS;
    }
    // A broadcast reads the send buffer on the root only.
    let reads = op.kind != 3 || op.root as usize == shared.rank;
    if (reads && memory::device_of(send as usize, send_bytes) != Some(device))
        || memory::device_of(recv as usize, recv_bytes) != Some(device)
    {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: a buffer is not device memory of cuda:{device} of the size the call implies"),
        );
    }
    let (s, r) = (send as usize, recv as usize);
    // NCCL's in place: the same buffer (all-reduce, broadcast), or this rank's chunk of the
    // larger one (all-gather: send = recv + rank * count; reduce-scatter: the reverse). Any
    // other overlap is undefined there: refused here, so fsdp's copies around it are tested.
    let in_place = match op.kind {
        0 => s == r + shared.rank * send_bytes,
        1 => r == s + shared.rank * recv_bytes,
        _ => s == r,
    };
    if reads && !in_place && s < r + recv_bytes && r < s + send_bytes {
        return fail(
            INVALID_ARGUMENT,
            &format!("{name}: send and receive buffers overlap without being in place"),
        );
    }
    let (send_bytes, shared_rank) = (if reads { send_bytes } else { 0 }, shared.rank);
    let make = crate::capture::MakePoll::new(move || {
        let mut c = Collective::new(shared.clone(), op, s, send_bytes, r, recv_bytes);
        crate::queue::Poll::new(move || c.poll())
    });
    if let Err(e) = crate::queue::issue_poll(stream as usize, device, make) {
        return fail(
            INVALID_USAGE,
            &format!("{name} on rank {shared_rank}: its capture was invalidated (CUDA error {e})"),
        );
    }
    SUCCESS
}

fn op(kind: u32, dtype: c_int, redop: c_int, root: c_int, count: usize) -> Op {
    Op {
        kind,
        dtype,
        redop,
        root,
        count: count as u64,
    }
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
    unsafe { collective(comm, op(0, dtype, 0, 0, count), send, recv, stream) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    redop: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(comm, op(1, dtype, redop, 0, count), send, recv, stream) }
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    redop: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    unsafe { collective(comm, op(2, dtype, redop, 0, count), send, recv, stream) }
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
    unsafe { collective(comm, op(3, dtype, 0, root, count), send, recv, stream) }
}
