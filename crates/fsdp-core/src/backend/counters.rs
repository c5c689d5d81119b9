//! Process-wide counters of the calls that decide whether a GPU step runs ahead of the host:
//! host-blocking synchronizations, device allocations and frees (the driver's, not the
//! caching allocator's reuse), page-locked host allocations, requests to the caching allocator (every tensor, and apart
//! those of FSDP's own buffers), kernel launches (cuBLAS calls
//! included), event queries (`cuEventQuery`: the NCCL watchdog's polls, the caching
//! allocator's look at a cached block's pending uses, the stream-stall fold) and key-value
//! store operations. The CUDA backend and the store bump them; `fsdp train --metrics` and
//! `fsdp bench` report their per-step difference.
//!
//! PyTorch's counterparts are scattered: `torch.cuda.memory_stats()["num_device_alloc"]`,
//! `torch.cuda.set_sync_debug_mode` (which warns on each synchronizing call) and the
//! profiler's launch counts. Here they are plain atomics (relaxed: a count, not an order),
//! summed over every thread of the process — with several threads ranks in one process,
//! over all of them.

use std::sync::atomic::{AtomicU64, Ordering};

static HOST_SYNCS: AtomicU64 = AtomicU64::new(0);
static DEVICE_ALLOCS: AtomicU64 = AtomicU64::new(0);
static DEVICE_FREES: AtomicU64 = AtomicU64::new(0);
static ALLOCATOR_REQUESTS: AtomicU64 = AtomicU64::new(0);
static PINNED_ALLOCS: AtomicU64 = AtomicU64::new(0);
static FSDP_BUFFER_ALLOCS: AtomicU64 = AtomicU64::new(0);
static KERNEL_LAUNCHES: AtomicU64 = AtomicU64::new(0);
static STORE_OPS: AtomicU64 = AtomicU64::new(0);
static EVENT_QUERIES: AtomicU64 = AtomicU64::new(0);
static GRAPH_LAUNCHES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Host-blocking synchronizations made by the calling thread so far (the process-wide
/// [`Counters::host_syncs`] counts every thread's): what a test or a rank's loop reads to
/// see that its own calls did not wait for the device.
pub fn host_syncs_on_this_thread() -> u64 {
    THREAD_SYNCS.with(std::cell::Cell::get)
}

/// A reading of the counters (or the difference of two readings, with [`Counters::since`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Calls that blocked the host until device work finished: stream, event and device
    /// synchronizations, synchronous copies to or from the host, and NCCL's wait for a
    /// collective (one per wait, however often it polls).
    pub host_syncs: u64,
    /// `cuMemAlloc` calls (blocks the caching allocator took from the driver).
    pub device_allocs: u64,
    /// `cuMemFree` calls.
    pub device_frees: u64,
    /// `cuMemHostAlloc` calls: page-locked host buffers (CPU offload's parameter and
    /// gradient shards). 0 in a steady step, where FSDP reuses them.
    pub pinned_allocs: u64,
    /// Requests to the CUDA caching allocator, whether a cached block served them or the
    /// driver was asked (`device_allocs`): one per device tensor made (activations,
    /// gradients, scratch). Not 0 in a steady step; compare it with
    /// `fsdp_buffer_allocs`.
    pub allocator_requests: u64,
    /// FSDP's own buffers (unsharded parameters, flat gradients, reduction and offload
    /// staging buffers, on any device) that FSDP's buffer pool (`fsdp::fsdp::BufferPool`) had to
    /// ask the allocator for because it held no free one of that size: 0 in a steady
    /// step, where every unit reuses the buffers of the step before.
    pub fsdp_buffer_allocs: u64,
    /// Kernel launches, one per `cuLaunchKernel` and one per cuBLAS call.
    pub kernel_launches: u64,
    /// Requests sent to the rendezvous key-value store (`TcpStore`).
    pub store_ops: u64,
    /// `cuEventQuery` calls (each a driver call on a GPU, contending for the host): the
    /// NCCL watchdog's polls of collectives in flight, the caching allocator's looks at a
    /// cached block's pending stream uses, the fold of stream-stall timings.
    pub event_queries: u64,
    /// CUDA graph launches (`cuGraphLaunch`): 1 per step replayed under
    /// `fsdp train --cuda-graphs`, whose kernels are then not counted in `kernel_launches`.
    pub graph_launches: u64,
}

impl Counters {
    /// The counters now.
    pub fn now() -> Counters {
        Counters {
            host_syncs: HOST_SYNCS.load(Ordering::Relaxed),
            device_allocs: DEVICE_ALLOCS.load(Ordering::Relaxed),
            device_frees: DEVICE_FREES.load(Ordering::Relaxed),
            pinned_allocs: PINNED_ALLOCS.load(Ordering::Relaxed),
            allocator_requests: ALLOCATOR_REQUESTS.load(Ordering::Relaxed),
            fsdp_buffer_allocs: FSDP_BUFFER_ALLOCS.load(Ordering::Relaxed),
            kernel_launches: KERNEL_LAUNCHES.load(Ordering::Relaxed),
            store_ops: STORE_OPS.load(Ordering::Relaxed),
            event_queries: EVENT_QUERIES.load(Ordering::Relaxed),
            graph_launches: GRAPH_LAUNCHES.load(Ordering::Relaxed),
        }
    }

    /// What happened between `earlier` and `self` (each field `self - earlier`).
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            host_syncs: self.host_syncs.saturating_sub(earlier.host_syncs),
            device_allocs: self.device_allocs.saturating_sub(earlier.device_allocs),
            device_frees: self.device_frees.saturating_sub(earlier.device_frees),
            pinned_allocs: self.pinned_allocs.saturating_sub(earlier.pinned_allocs),
            allocator_requests: self
                .allocator_requests
                .saturating_sub(earlier.allocator_requests),
            fsdp_buffer_allocs: self
                .fsdp_buffer_allocs
                .saturating_sub(earlier.fsdp_buffer_allocs),
            kernel_launches: self.kernel_launches.saturating_sub(earlier.kernel_launches),
            store_ops: self.store_ops.saturating_sub(earlier.store_ops),
            event_queries: self.event_queries.saturating_sub(earlier.event_queries),
            graph_launches: self.graph_launches.saturating_sub(earlier.graph_launches),
        }
    }
}

/// Counts one host-blocking synchronization. With `FSDP_SYNC_DEBUG=warn` in the
/// environment each one also prints a backtrace to stderr (PyTorch's
/// `torch.cuda.set_sync_debug_mode("warn")`), to find the call that made a step wait.
pub fn count_host_sync() {
    HOST_SYNCS.fetch_add(1, Ordering::Relaxed);
    THREAD_SYNCS.with(|c| c.set(c.get() + 1));
    static WARN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *WARN.get_or_init(|| std::env::var("FSDP_SYNC_DEBUG").is_ok_and(|v| v == "warn")) {
        eprintln!(
            "fsdp: host-blocking synchronization (FSDP_SYNC_DEBUG=warn)\n{}",
            std::backtrace::Backtrace::force_capture()
        );
    }
}

/// Counts one driver allocation. With `FSDP_ALLOC_DEBUG=warn` in the environment each one
/// also prints a backtrace to stderr, to find the buffer that made a steady step ask the
/// driver.
pub fn count_device_alloc() {
    DEVICE_ALLOCS.fetch_add(1, Ordering::Relaxed);
    if alloc_debug() {
        eprintln!(
            "fsdp: device allocation (FSDP_ALLOC_DEBUG=warn)\n{}",
            std::backtrace::Backtrace::force_capture()
        );
    }
}

/// Whether `FSDP_ALLOC_DEBUG=warn` is set (see [`count_device_alloc`]).
pub fn alloc_debug() -> bool {
    static WARN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WARN.get_or_init(|| std::env::var("FSDP_ALLOC_DEBUG").is_ok_and(|v| v == "warn"))
}

/// Counts one page-locked host allocation (with `FSDP_ALLOC_DEBUG=warn`, with a
/// backtrace on stderr).
pub fn count_pinned_alloc() {
    PINNED_ALLOCS.fetch_add(1, Ordering::Relaxed);
    if alloc_debug() {
        eprintln!(
            "fsdp: pinned host allocation (FSDP_ALLOC_DEBUG=warn)\n{}",
            std::backtrace::Backtrace::force_capture()
        );
    }
}

/// Counts one CUDA graph launch.
pub fn count_graph_launch() {
    GRAPH_LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// Counts one request to the caching allocator.
pub fn count_allocator_request() {
    ALLOCATOR_REQUESTS.fetch_add(1, Ordering::Relaxed);
}

/// Counts one FSDP buffer the buffer pool had to allocate.
pub fn count_fsdp_buffer_alloc() {
    FSDP_BUFFER_ALLOCS.fetch_add(1, Ordering::Relaxed);
}

/// Counts one driver free.
pub fn count_device_free() {
    DEVICE_FREES.fetch_add(1, Ordering::Relaxed);
}

/// Counts one kernel launch of the kernel `name` (`gelu_fwd_f32`, `gemm` for a cuBLAS
/// call). `FSDP_LAUNCH_DEBUG` in the environment traces them to stderr: `trace` prints
/// `fsdp: launch NAME` for each (a per-kernel breakdown of a step: count the lines of two
/// runs that differ by one step), a kernel's name prints a backtrace at each of its launches.
pub fn count_kernel_launch(name: &str) {
    KERNEL_LAUNCHES.fetch_add(1, Ordering::Relaxed);
    static TRACE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    match TRACE.get_or_init(|| std::env::var("FSDP_LAUNCH_DEBUG").ok()) {
        None => {}
        Some(t) if t == "trace" => eprintln!("fsdp: launch {name}"),
        Some(t) if t == name => eprintln!(
            "fsdp: launch {name}\n{}",
            std::backtrace::Backtrace::force_capture()
        ),
        Some(_) => {}
    }
}

/// Counts one store request.
pub fn count_store_op() {
    STORE_OPS.fetch_add(1, Ordering::Relaxed);
}

/// Counts one event query (`cuEventQuery`).
pub fn count_event_query() {
    EVENT_QUERIES.fetch_add(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_is_the_difference_of_two_readings() {
        let a = Counters::now();
        count_host_sync();
        count_kernel_launch("test");
        count_kernel_launch("test");
        count_store_op();
        count_event_query();
        let d = Counters::now().since(&a);
        // Other tests of this binary may count too, concurrently: at least ours.
        assert!(
            d.host_syncs >= 1 && d.kernel_launches >= 2 && d.store_ops >= 1 && d.event_queries >= 1,
            "{d:?}"
        );
        assert_eq!(a.since(&Counters::now()), Counters::default());
    }
}
