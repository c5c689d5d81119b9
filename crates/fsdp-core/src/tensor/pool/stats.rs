//! The pool's figures ([`memory_stats`](super::memory_stats)).

/// The CPU pool's figures, as `torch.cuda.memory_stats()` reports its caching allocator's
/// (the keys named below); bytes of host tensor buffers (`Vec`s of a host dtype; pinned
/// memory and device memory are not the pool's). From
/// [`memory_stats`](super::memory_stats).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemoryStats {
    /// Bytes in live tensors' buffers, wherever the buffer came from
    /// (`"active_bytes.all.current"`).
    pub active_bytes: usize,
    /// The most [`active_bytes`](Self::active_bytes) since the process started or
    /// [`reset_peak_memory_stats`](super::reset_peak_memory_stats)
    /// (`"active_bytes.all.peak"`).
    pub active_bytes_peak: usize,
    /// Bytes the pool holds free for the next tensor of the same dtype and length: what
    /// [`empty_cache`](super::empty_cache) gives back (`"reserved_bytes.all.current"` minus
    /// `"active_bytes.all.current"`, the caching allocator's inactive blocks).
    pub pooled_bytes: usize,
    /// Bytes in live tensors and held free together: what the tensor layer holds
    /// (`"reserved_bytes.all.current"`).
    pub reserved_bytes: usize,
    /// The most [`reserved_bytes`](Self::reserved_bytes) since the process started or
    /// [`reset_peak_memory_stats`](super::reset_peak_memory_stats)
    /// (`"reserved_bytes.all.peak"`).
    pub reserved_bytes_peak: usize,
    /// Live tensor buffers (`"active.all.current"`).
    pub active_buffers: usize,
    /// Free buffers the pool holds (`"inactive_split.all.current"`).
    pub pooled_buffers: usize,
    /// Tensor buffers that came from the heap since the process started: the pool's misses
    /// and the vectors handed in (`Tensor::from_vec`); as
    /// [`allocations`](super::allocations) (`"num_device_alloc"`, the driver allocations).
    pub heap_allocations: u64,
    /// Tensor buffers the pool served since the process started; as
    /// [`reuses`](super::reuses).
    pub pool_hits: u64,
    /// Requests the pool could not serve (a new buffer was allocated) since the process
    /// started.
    pub pool_misses: u64,
    /// Bytes of the buffers allocated for [`pool_misses`](Self::pool_misses).
    pub pool_miss_bytes: u64,
    /// Buffers the pool gave back to the allocator (beyond its bound, or by
    /// [`empty_cache`](super::empty_cache), the last [`PoolUser`](super::PoolUser) or an
    /// exiting thread) since the process started (`"num_device_free"`).
    pub pool_releases: u64,
    /// Live [`PoolUser`](super::PoolUser)s (FSDP units and process-group worlds).
    pub users: usize,
    /// Threads the pool keeps buffers (or counts live ones) for: each thread that took a
    /// buffer or made a tensor has its own buckets ([Note: pool bound]), until it exits.
    pub owners: usize,
}
