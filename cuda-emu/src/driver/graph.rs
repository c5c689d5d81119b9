//! Stream capture and graphs (`crate::capture`): begin and end a capture, instantiate a
//! captured graph, launch it on a stream.

use super::*;
use crate::capture::Graph;

/// An instantiated graph: its nodes and the queue keys its forked streams replay on.
struct ExecObj {
    device: c_int,
    graph: Graph,
    /// One byte per captured stream: their addresses are the queue keys of its replays (no
    /// real stream handle can have them while the exec lives). The origin's lane is used
    /// only by a launch on the legacy stream; the others are the forked streams'.
    lanes: Box<[u8]>,
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: *mut c_void, mode: c_uint) -> CUresult {
    try_cu!(unsafe { on_stream(stream) });
    if mode > crate::capture::MODE_RELAXED {
        return INVALID_VALUE;
    }
    match queue::captures(|c| c.begin(stream as usize, mode)) {
        Ok(()) => SUCCESS,
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture(stream: *mut c_void) -> CUresult {
    unsafe { cuStreamBeginCapture_v2(stream, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: *mut c_void,
    graph: *mut *mut c_void,
) -> CUresult {
    try_cu!(unsafe { on_stream(stream) });
    if graph.is_null() {
        return INVALID_VALUE;
    }
    match queue::captures(|c| c.end(stream as usize)) {
        Ok(g) => unsafe { out(graph, Box::into_raw(Box::new(g)) as *mut c_void) },
        Err(e) => {
            // SAFETY: the caller's out-pointer (no graph on failure, as the driver's).
            unsafe { graph.write(std::ptr::null_mut()) };
            e
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: *mut c_void, status: *mut c_uint) -> CUresult {
    try_cu!(unsafe { stream_device(stream) });
    let s = queue::captures(|c| {
        if stream.is_null() {
            // The legacy stream reports "invalidated" while any capture is in progress
            // (the driver's answer for an implicitly synchronizing stream).
            return if c.any() { 2 } else { 0 };
        }
        c.status(stream as usize)
    });
    unsafe { out(status, s) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    exec: *mut *mut c_void,
    graph: *mut c_void,
    _flags: u64,
) -> CUresult {
    let device = try_cu!(current());
    if graph.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuStreamEndCapture.
    let g = unsafe { &*(graph as *const Graph) }.clone();
    let lanes = vec![0u8; g.streams.len()].into_boxed_slice();
    let e = ExecObj {
        device,
        graph: g,
        lanes,
    };
    unsafe { out(exec, Box::into_raw(Box::new(e)) as *mut c_void) }
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(exec: *mut c_void, stream: *mut c_void) -> CUresult {
    let dev = try_cu!(unsafe { on_stream(stream) });
    if exec.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuGraphInstantiateWithFlags.
    let e = unsafe { &*(exec as *const ExecObj) };
    if e.device != dev {
        return INVALID_HANDLE;
    }
    if stream.is_null() {
        // The legacy stream: the graph runs after the device's other work, at once.
        try_cu!(capture_check(Some(0), None, false));
        queue::synchronize_device(dev);
    } else if queue::captures(|c| c.of(stream as usize)).is_some() {
        // A graph launched into a capture would become a child graph: not emulated.
        let id = queue::captures(|c| c.of(stream as usize)).unwrap_or(0);
        return queue::captures(|c| c.invalidate(id, crate::capture::UNSUPPORTED));
    }
    let lanes: Vec<usize> = e.lanes.iter().map(|b| b as *const u8 as usize).collect();
    // The legacy stream's handle is 0, which the queue runs at once: replay on a lane.
    let origin = if stream.is_null() {
        lanes[0]
    } else {
        stream as usize
    };
    queue::launch(&e.graph, origin, dev, &lanes[1..]);
    if stream.is_null() {
        queue::synchronize_device(dev);
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuGraphUpload(exec: *mut c_void, stream: *mut c_void) -> CUresult {
    if exec.is_null() {
        return INVALID_HANDLE;
    }
    try_cu!(unsafe { on_stream(stream) });
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(exec: *mut c_void) -> CUresult {
    if exec.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: made by cuGraphInstantiateWithFlags, destroyed once. Replays still queued on
    // its lanes run first (their keys die with it).
    let e = unsafe { Box::from_raw(exec as *mut ExecObj) };
    for b in e.lanes.iter() {
        queue::destroy(b as *const u8 as usize);
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(graph: *mut c_void) -> CUresult {
    // SAFETY: made by cuStreamEndCapture, destroyed once.
    match unsafe { free_handle::<Graph>(graph) } {
        true => SUCCESS,
        false => INVALID_HANDLE,
    }
}

#[cfg(test)]
mod tests {
    //! Capture and replay through the driver's entry points, as cudarc calls them.
    use super::super::copies::*;
    use super::super::streams::*;
    use super::*;
    use crate::capture::{IMPLICIT, INVALIDATED, UNJOINED, UNSUPPORTED};

    fn read(d: u64) -> [u32; 4] {
        let mut h = [0u32; 4];
        // SAFETY: 16 bytes each side.
        assert_eq!(
            unsafe { cuMemcpyDtoH_v2(h.as_mut_ptr().cast(), d, 16) },
            SUCCESS
        );
        h
    }

    /// Device 0's context made current on this thread, and a new stream of it.
    fn context_and_stream() -> *mut c_void {
        assert_eq!(cuInit(0), SUCCESS);
        let (mut ctx, mut s) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: out-pointers to locals; the context made by the call before.
        unsafe {
            assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), SUCCESS);
            assert_eq!(cuCtxSetCurrent(ctx), SUCCESS);
            assert_eq!(cuStreamCreate(&mut s, 0), SUCCESS);
        }
        s
    }

    #[test]
    fn a_captured_graph_runs_at_each_launch_only() {
        let s1 = context_and_stream();
        // SAFETY: out-pointers to locals; handles made by the calls before them.
        unsafe {
            let mut s2 = std::ptr::null_mut();
            assert_eq!(cuStreamCreate(&mut s2, 0), SUCCESS);
            let (mut e1, mut e2) = (std::ptr::null_mut(), std::ptr::null_mut());
            assert_eq!(cuEventCreate(&mut e1, 2), SUCCESS);
            assert_eq!(cuEventCreate(&mut e2, 2), SUCCESS);
            let (mut d, mut d2) = (0u64, 0u64);
            assert_eq!(cuMemAlloc_v2(&mut d, 16), SUCCESS);
            assert_eq!(cuMemAlloc_v2(&mut d2, 16), SUCCESS);
            let mut h = Box::new([1u32; 4]);
            // Fork s2 from s1 and join it back: HtoD on s1, DtoD on s2.
            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            assert_eq!(cuMemcpyHtoDAsync_v2(d, h.as_ptr().cast(), 16, s1), SUCCESS);
            assert_eq!(cuEventRecord(e1, s1), SUCCESS);
            assert_eq!(cuStreamWaitEvent(s2, e1, 0), SUCCESS);
            let mut st = 9;
            assert_eq!(cuStreamIsCapturing(s2, &mut st), SUCCESS);
            assert_eq!(st, 1, "s2 joined the capture");
            assert_eq!(cuMemcpyDtoDAsync_v2(d2, d, 16, s2), SUCCESS);
            assert_eq!(cuEventRecord(e2, s2), SUCCESS);
            assert_eq!(cuEventQuery(e2), UNSUPPORTED, "a captured event's query");
            let mut g = std::ptr::null_mut();
            assert_eq!(cuStreamEndCapture(s1, &mut g), UNSUPPORTED, "invalidated");
            assert!(g.is_null());
            assert_eq!(cuStreamIsCapturing(s2, &mut st), SUCCESS);
            assert_eq!(st, 0, "the capture ended for every stream");

            // Again, cleanly; a fork that does not rejoin fails at the end.
            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            assert_eq!(cuEventRecord(e1, s1), SUCCESS);
            assert_eq!(cuStreamWaitEvent(s2, e1, 0), SUCCESS);
            assert_eq!(cuMemsetD8Async(d2, 0, 16, s2), SUCCESS);
            assert_eq!(cuStreamEndCapture(s1, &mut g), UNJOINED);

            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            assert_eq!(cuMemcpyHtoDAsync_v2(d, h.as_ptr().cast(), 16, s1), SUCCESS);
            assert_eq!(cuEventRecord(e1, s1), SUCCESS);
            assert_eq!(cuStreamWaitEvent(s2, e1, 0), SUCCESS);
            assert_eq!(cuMemcpyDtoDAsync_v2(d2, d, 16, s2), SUCCESS);
            assert_eq!(cuEventRecord(e2, s2), SUCCESS);
            assert_eq!(cuStreamWaitEvent(s1, e2, 0), SUCCESS);
            assert_eq!(cuStreamEndCapture(s1, &mut g), SUCCESS);
            assert_eq!(read(d2), [u32::MAX; 4], "nothing ran at capture");
            let mut exec = std::ptr::null_mut();
            assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), SUCCESS);
            assert_eq!(cuGraphLaunch(exec, s1), SUCCESS);
            assert_eq!(cuStreamSynchronize(s1), SUCCESS);
            assert_eq!(read(d2), [1; 4]);
            // The memcpy node reads its host source at each launch.
            *h = [7; 4];
            assert_eq!(cuGraphLaunch(exec, s1), SUCCESS);
            assert_eq!(cuEventRecord(e1, s1), SUCCESS);
            assert_eq!(cuEventSynchronize(e1), SUCCESS);
            assert_eq!(read(d2), [7; 4]);

            // What a capture refuses: allocation, host syncs, the legacy stream.
            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            let mut d3 = 0u64;
            assert_eq!(cuMemAlloc_v2(&mut d3, 16), UNSUPPORTED);
            assert_eq!(cuMemsetD8Async(d, 0, 16, s1), INVALIDATED);
            assert_eq!(cuStreamEndCapture(s1, &mut g), UNSUPPORTED);
            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            assert_eq!(cuStreamSynchronize(s1), UNSUPPORTED);
            assert_eq!(cuStreamEndCapture(s1, &mut g), UNSUPPORTED);
            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            assert_eq!(cuCtxSynchronize(), IMPLICIT);
            assert_eq!(cuStreamEndCapture(s1, &mut g), IMPLICIT);
            assert_eq!(cuStreamBeginCapture_v2(s1, 0), SUCCESS);
            let mut x = [0u32; 4];
            assert_eq!(
                cuMemcpyDtoHAsync_v2(x.as_mut_ptr().cast(), d, 16, s1),
                UNSUPPORTED
            );
            assert_eq!(cuStreamEndCapture(s1, &mut g), UNSUPPORTED);
            // The replays still run after all that.
            *h = [3; 4];
            assert_eq!(cuGraphLaunch(exec, s1), SUCCESS);
            assert_eq!(cuStreamSynchronize(s1), SUCCESS);
            assert_eq!(read(d2), [3; 4]);
            assert_eq!(cuGraphExecDestroy(exec), SUCCESS);
            assert_eq!(cuMemFree_v2(d), SUCCESS);
            assert_eq!(cuMemFree_v2(d2), SUCCESS);
        }
    }

    #[test]
    fn a_captured_collective_runs_anew_at_each_launch() {
        use crate::nccl::{ncclAllReduce, ncclCommDestroy, ncclCommInitRank, ncclGetUniqueId};
        let s = context_and_stream();
        // SAFETY: out-pointers to locals; handles made by the calls before them.
        unsafe {
            let mut id = std::mem::zeroed();
            assert_eq!(ncclGetUniqueId(&mut id), 0);
            let mut comm = std::ptr::null_mut();
            assert_eq!(ncclCommInitRank(&mut comm, 1, id, 0), 0);
            let (mut d, mut d2) = (0u64, 0u64);
            assert_eq!(cuMemAlloc_v2(&mut d, 16), SUCCESS);
            assert_eq!(cuMemAlloc_v2(&mut d2, 16), SUCCESS);
            // An all-reduce (sum, f32) of a world of one: a copy, captured.
            assert_eq!(cuStreamBeginCapture_v2(s, 0), SUCCESS);
            let (src, dst) = (d as *const c_void, d2 as *mut c_void);
            assert_eq!(ncclAllReduce(src, dst, 4, 7, 0, comm, s), 0);
            let mut g = std::ptr::null_mut();
            assert_eq!(cuStreamEndCapture(s, &mut g), SUCCESS);
            assert_eq!(read(d2), [u32::MAX; 4], "nothing ran at capture");
            let mut exec = std::ptr::null_mut();
            assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), SUCCESS);
            for v in [1.5f32, -2.0] {
                let h = [v.to_bits(); 4];
                assert_eq!(cuMemcpyHtoD_v2(d, h.as_ptr().cast(), 16), SUCCESS);
                assert_eq!(cuGraphLaunch(exec, s), SUCCESS);
                assert_eq!(cuStreamSynchronize(s), SUCCESS);
                assert_eq!(read(d2), h, "launch with {v}");
            }
            assert_eq!(cuGraphExecDestroy(exec), SUCCESS);
            assert_eq!(ncclCommDestroy(comm), 0);
            assert_eq!(cuMemFree_v2(d), SUCCESS);
            assert_eq!(cuMemFree_v2(d2), SUCCESS);
        }
    }
}
