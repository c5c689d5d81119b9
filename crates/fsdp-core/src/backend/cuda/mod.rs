//! The CUDA backend: devices, memory, streams, our kernels and cuBLAS, over cudarc.
//!
//! Three layers at the FFI boundary (as cudarc's sys -> result -> safe):
//!
//! | layer | file | what |
//! |---|---|---|
//! | raw launchers | `launch.rs` | one `unsafe fn` per `extern "C"` kernel, arguments in the C order |
//! | typed ops | `ops.rs`, `nn_ops.rs`, `layernorm.rs`, `lowp.rs`, `batchnorm.rs`, `optim.rs`, `blas.rs` | check lengths, dtypes and devices; return `Result` |
//! | algorithms | `fsdp`, the scheduler | never see a device pointer |
//!
//! Beneath them: `context.rs` (a lazily created `CudaDevice` per ordinal, holding the
//! driver context and the kernel modules, loaded once per device from the fat binaries
//! build.rs embedded), `memory.rs` (a caching allocator with per-rank byte accounting),
//! `stream.rs` (streams and events), `tensor.rs` (`DeviceTensor`, host <-> device copies),
//! `pinned.rs` (page-locked host memory and the asynchronous copies it allows),
//! `graph.rs` (a step captured as a CUDA graph and replayed, buffers from a graph pool).
//!
//! `types.rs` holds the plain-Rust types (argument structs, [`MemAccount`]) that every
//! build compiles. Without the `cuda` feature the rest is `standin/`: the same names and
//! signatures, whose handles cannot exist and whose entry points ([`current_stream`],
//! `CudaDevice::get`, `pinned_zeros`) return [`no_cuda_build`]'s error, so the layers
//! above call this module in one code path whichever build runs (candle's dummy CUDA
//! backend is the model). cudarc loads
//! `libcuda.so` and `libcublas.so` at run time: a build needs no CUDA library, and a run
//! without a driver gets an [`Error::Cuda`] from [`detect`] or `CudaDevice::get`, never a
//! panic or a link error.
//!
//! `collective.rs` holds what the threads process group needs on device buffers (the
//! rank-order reduction kernel of `collective.cu`, copies across devices, waits on peers'
//! events). NCCL (one communicator per rank, through cudarc's `nccl` module) is the
//! `nccl` process group of `distributed/nccl/`.

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
mod batchnorm;
#[cfg(feature = "cuda")]
mod blas;
#[cfg(feature = "cuda")]
mod checks;
#[cfg(feature = "cuda")]
mod clip;
#[cfg(feature = "cuda")]
#[doc(hidden)] // crate-internal, public only for the layers above
pub mod collective;
#[cfg(feature = "cuda")]
mod context;
#[cfg(feature = "cuda")]
mod current;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod layernorm;
#[cfg(feature = "cuda")]
mod lowp;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod nn_ops;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod optim;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod sdpa;
#[cfg(feature = "cuda")]
mod stall;
#[cfg(feature = "cuda")]
mod stream;
#[cfg(feature = "cuda")]
mod tensor;

#[cfg(feature = "cuda")]
pub use batchnorm::{
    batchnorm_bwd_dx, batchnorm_bwd_stats, batchnorm_count, batchnorm_fwd, batchnorm_stats,
};
#[cfg(feature = "cuda")]
pub use blas::{gemm, gemm_strided_batched};
#[cfg(feature = "cuda")]
pub use clip::{scale_all_by, scale_by, NormAccumulator, TensorList};
#[cfg(feature = "cuda")]
pub use context::CudaDevice;
#[cfg(feature = "cuda")]
pub use current::{current_stream, rank_account, set_rank_account, use_stream, StreamGuard};
#[cfg(feature = "cuda")]
pub use graph::{outside_captures, GraphRecorder, StepGraph};
#[cfg(feature = "cuda")]
pub use layernorm::{add_layernorm_fwd, layernorm_bwd, layernorm_bwd_add, layernorm_fwd};
#[cfg(feature = "cuda")]
pub use lowp::{cross_entropy_lp, layernorm_bwd_lp, layernorm_wgrad_lp};
#[cfg(feature = "cuda")]
pub use memory::{with_fresh_blocks, DeviceBuffer};
#[cfg(feature = "cuda")]
pub use nn_ops::*;
#[cfg(feature = "cuda")]
pub use ops::*;
#[cfg(feature = "cuda")]
pub use optim::{adam_step, sgd_step};
#[cfg(feature = "cuda")]
pub(crate) use pinned::copy_async;
#[cfg(feature = "cuda")]
pub use pinned::{pinned_zeros, PinnedBuffer};
#[cfg(feature = "cuda")]
pub use sdpa::{sdpa_backward, sdpa_forward, SDPA_MAX_HD};
#[cfg(feature = "cuda")]
pub use stall::{take_stream_stall_s, time_stream_waits};
#[cfg(feature = "cuda")]
pub use stream::{Event, Stream};
#[cfg(feature = "cuda")]
pub use tensor::DeviceTensor;

#[cfg(not(feature = "cuda"))]
mod standin;
#[cfg(not(feature = "cuda"))]
pub use standin::*;

mod types;
#[doc(hidden)] // crate-internal, public only for the layers above
pub use types::widen_hyper;
pub use types::{
    AdamHyper, AdamSlot, BnDims, BnRunning, BnTypes, GemmShape, MemAccount, MemStats, SgdHyper,
    SgdSlot,
};

/// One CUDA device as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (`cuda:i`).
    pub ordinal: usize,
    /// Marketing name, e.g. `"NVIDIA H200"`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Streaming multiprocessors.
    pub multiprocessors: usize,
}

/// The CUDA devices present, or why there are none.
///
/// # Errors
/// [`Error::Cuda`]: `"no CUDA driver found (libcuda.so): .."` when the driver library
/// cannot be loaded, `"no CUDA device"` when it loads but reports no device, the driver's
/// message when initialization fails, and `"this build has no CUDA support"` without the
/// `cuda` feature. Never panics.
pub fn detect() -> Result<Vec<DeviceInfo>> {
    #[cfg(feature = "cuda")]
    {
        context::detect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(no_cuda_build())
    }
}

/// The error of every CUDA entry point in a build without the `cuda` feature.
pub fn no_cuda_build() -> Error {
    Error::cuda(
        "this build has no CUDA support",
        "rebuild with `--features cuda` (nvcc from scripts/install_nvcc.sh)",
    )
}
