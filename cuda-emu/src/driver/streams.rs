//! Streams and events: creation, synchronization, waits, queries, timing.

use super::*;

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
    // Pending work still completes; a capturing stream's capture is invalidated.
    let _ = capture_check(Some(stream as usize), None, false);
    queue::destroy(stream as usize);
    // SAFETY: made by cuStreamCreate, destroyed once.
    drop(unsafe { Box::from_raw(stream as *mut StreamObj) });
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    let dev = try_cu!(unsafe { stream_device(stream) });
    try_cu!(capture_check(Some(stream as usize), None, true));
    queue::synchronize(stream as usize, dev);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> CUresult {
    // As cuEventQuery: NOT_READY while work is pending, which the poll then runs.
    let dev = try_cu!(unsafe { stream_device(stream) });
    try_cu!(capture_check(Some(stream as usize), None, true));
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
    match unsafe { (*(event as *const EventObj)).mark } {
        Some(m) => match queue::wait(stream as usize, dev, m) {
            Ok(()) => SUCCESS,
            Err(e) => e,
        },
        // Recorded outside any capture with nothing pending: a capturing stream may not
        // depend on it either (isolation), any other stream need not wait.
        None => match queue::captures(|c| c.of(stream as usize)) {
            Some(id) => queue::captures(|c| c.invalidate(id, crate::capture::ISOLATION)),
            None => SUCCESS,
        },
    }
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
    // On a capturing stream the event marks the stream's last node and adds none (the
    // driver's event holds the capture's current dependencies): work issued after it is
    // not a node the end of the capture must find joined. Only an origin without a node yet
    // gets an empty one to mark. (Such an event has no time: as the driver's, it cannot be
    // timed.)
    if let Some(p) = queue::captured_mark(stream as usize) {
        e.mark = Some(p);
        e.recorded = true;
        return SUCCESS;
    }
    try_cu!(queue::issue(
        stream as usize,
        sd,
        Work::new(move || *lock(&at) = Some(Instant::now())),
    ));
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
    let mark = unsafe { (*(event as *const EventObj)).mark };
    try_cu!(capture_check(None, mark, true));
    if let Some(Point::Queued(m)) = mark {
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
    let mark = unsafe { (*(event as *const EventObj)).mark };
    try_cu!(capture_check(None, mark, true));
    match mark {
        Some(Point::Queued(m)) if !queue::is_complete(m) => {
            queue::try_complete(m);
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
    try_cu!(capture_check(None, start.mark, true));
    try_cu!(capture_check(None, end.mark, true));
    let time = |e: &EventObj| {
        if let Some(Point::Queued(m)) = e.mark {
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
