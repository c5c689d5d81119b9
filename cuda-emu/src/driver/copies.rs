//! Device memory entry points: allocation, page-locked host allocation, host/device and
//! peer copies, memsets.
//!
//! A copy between the device and page-locked host memory (`cuMemHostAlloc`) is queued on
//! its stream like a kernel, reading or writing the host memory when it runs: a host that
//! reads a pinned destination before synchronizing sees what was there before (the fresh
//! allocation's `0xff` bytes, or an older value). With pageable host memory the copy to
//! the device stages the source at once and the copy to the host synchronizes, as CUDA's.

use super::*;

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut u64, bytes: usize) -> CUresult {
    let dev = try_cu!(current());
    try_cu!(capture_check(None, None, true));
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
    try_cu!(capture_check(None, None, true));
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
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CUresult {
    try_cu!(current());
    try_cu!(capture_check(None, None, true));
    if pp.is_null() {
        return INVALID_VALUE;
    }
    match memory::host_alloc(bytes) {
        Some(p) => unsafe { out(pp, p as *mut c_void) },
        None => OUT_OF_MEMORY,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    unsafe { cuMemHostAlloc(pp, bytes, 0) }
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    try_cu!(current());
    try_cu!(capture_check(None, None, true));
    // Copies still queued may read or write the memory: every device's work runs first.
    for d in 0..device_count() {
        queue::synchronize_device(d);
    }
    if memory::host_free(p as usize) {
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
    if memory::is_pinned(src as usize, bytes)
        || queue::captures(|c| c.of(stream as usize)).is_some()
    {
        // From page-locked memory the copy engine reads the source when the copy runs; a
        // captured copy (a memcpy node of the graph) reads it at every launch, pageable
        // or not, so its source must outlive the graph.
        return queue_pinned_copy(stream, dev, src as usize, dst as usize, bytes);
    }
    // From pageable host memory the driver stages the source before returning: copy it now.
    // SAFETY: src is the caller's host buffer of `bytes` bytes.
    let data = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec();
    try_cu!(queue::issue(
        stream as usize,
        dev,
        Work::new(move || {
            // SAFETY: dst was checked against the allocation table; a free drains first.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, bytes) }
        }),
    ));
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
    if memory::is_pinned(dst as usize, bytes) {
        // Into page-locked memory: queued, written when the stream runs it.
        return queue_pinned_copy(stream, dev, src as usize, dst as usize, bytes);
    }
    // To pageable host memory the copy is synchronous: the stream's work first, then it
    // (refused on a capturing stream: the host would wait for captured work).
    try_cu!(capture_check(Some(stream as usize), None, true));
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
    try_cu!(queue::issue(
        stream as usize,
        dev,
        copy_work(dst, src, bytes)
    ));
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
    try_cu!(queue::issue(
        stream as usize,
        dev,
        copy_work(dst, src, bytes)
    ));
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
    try_cu!(queue::issue(stream as usize, dev, w));
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
    try_cu!(queue::issue(stream as usize, dev, w));
    SUCCESS
}

/// A deferred device-to-device copy of ranges checked at issue.
fn copy_work(dst: u64, src: u64, bytes: usize) -> Work {
    // SAFETY: both ranges were checked at issue; a free drains the device first.
    Work::new(move || unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) })
}

/// Queues on `stream` of `dev` a copy of `bytes` bytes from `src` to `dst` where the host
/// side is page-locked: the copy engine touches the host memory when the copy runs.
fn queue_pinned_copy(
    stream: *mut c_void,
    dev: i32,
    src: usize,
    dst: usize,
    bytes: usize,
) -> CUresult {
    let r = queue::issue(
        stream as usize,
        dev,
        Work::new(move || {
            // SAFETY: both ranges were checked at issue; a free drains the device first
            // (cuMemFreeHost too).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) }
        }),
    );
    r.err().unwrap_or(SUCCESS)
}
