//! Process groups and collectives with the names and semantics of `torch.distributed`.
//!
//! | backend | ranks are | tensors | module |
//! |---|---|---|---|
//! | `threads` | threads of one process | CPU, or CUDA (one or several GPUs) | [`threads`] |
//! | `tcp` (alias `gloo`) | processes (or threads), over TCP | CPU | [`tcp`] |
//! | `nccl` | one process per GPU (or any ranks, one communicator each) | CUDA | `nccl` (meets through [`TcpStore`]; `cuda` feature) |
//!
//! | torch.distributed | here | file |
//! |---|---|---|
//! | `init_process_group`, `destroy_process_group`, `get_rank`, `get_world_size`, `is_initialized`, `group.WORLD` | [`init_process_group`], [`destroy_process_group`], [`get_rank`], [`get_world_size`], [`is_initialized`], [`default_group`] | `init.rs`, `init_options.rs`, `rendezvous.rs` |
//! | `torchrun` for in-process ranks | [`launch`] | `launch.rs` |
//! | `torchrun` (processes), `elastic_launch`, `@record` | [`elastic_launch`], [`record_error`], `fsdp launch` | `elastic.rs` |
//! | `TCPStore`, `PrefixStore`, `Store` | [`TcpStore`], [`TcpStoreServer`], [`PrefixStore`], [`Store`] | `store/` |
//! | `--rdzv-id` (and beyond torch: a job secret proved at every connect) | [`JobAuth`], [`JobSecret`] | `auth.rs` |
//! | `ProcessGroup`, collectives | [`ProcessGroup`], [`CollectivesExt`] | `mod.rs`, `composite.rs`, `desc.rs`, `threads/`, `tcp/` |
//! | `ProcessGroupGloo` | [`TcpGroup`] | `tcp/` |
//! | `new_group`, `new_subgroups`, `get_process_group_ranks` | [`ProcessGroup::new_group`], [`new_subgroups`], [`get_process_group_ranks`] | `subgroups.rs` |
//! | `init_device_mesh`, `DeviceMesh` | [`init_device_mesh`], [`DeviceMesh`] | `mesh.rs` |
//! | `async_op=True`, `Work` | [`CommStream`], [`Work`] | `work.rs` |
//!
//! Every collective checks, on all ranks, that they called the same op with the same dtype
//! and element counts, and fails on every rank with [`Error::CollectiveMismatch`] when not.
//! A collective that cannot complete fails with [`Error::Timeout`] naming the missing ranks,
//! or with [`Error::PeerFailed`] as soon as a peer has failed or exited.
//!
//! [`Error::CollectiveMismatch`]: crate::Error::CollectiveMismatch
//! [`Error::Timeout`]: crate::Error::Timeout
//! [`Error::PeerFailed`]: crate::Error::PeerFailed

pub mod auth;
mod backoff;
mod composite;
mod desc;
pub mod elastic;
mod failures;
pub mod fingerprint;
mod heartbeat;
mod init;
mod init_options;
mod launch;
mod limits;
mod mesh;
#[cfg(feature = "cuda")]
pub mod nccl;
mod rendezvous;
mod signals;
pub mod staged;
pub mod store;
mod subgroups;
pub mod tcp;
pub mod threads;
mod waiting;
mod work;

pub use auth::{JobAuth, JobSecret};
pub use composite::CollectivesExt;
pub use elastic::{
    elastic_launch, launcher_reports_errors, record_error, record_message, ElasticLaunchConfig,
};
pub use init::{
    abort_process_group, default_group, destroy_process_group, get_backend, get_local_world_size,
    get_node_local_rank, get_rank, get_world_size, init_process_group, is_initialized,
};
pub use init_options::{
    parse_seconds, InitOptions, Rendezvous, DEFAULT_HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_VAR,
    MIN_HEARTBEAT_TIMEOUT, TIMEOUT_VAR, TORCHRUN_ENV_VARS,
};
pub use launch::{launch, LaunchOptions};
pub use limits::{
    available_memory_bytes, check_thread_ranks, thread_limit, thread_rank_bytes, RANK_BASE_BYTES,
    THREADS_PER_RANK,
};
pub use mesh::{init_device_mesh, DeviceMesh, MeshDim};
pub use store::{PrefixStore, Store, TcpStore, TcpStoreServer};
pub use subgroups::{get_process_group_ranks, new_subgroups};
pub use tcp::TcpGroup;
pub use threads::ThreadsGroup;
pub use waiting::PROGRESS_VAR;
pub use work::{CommStream, Work};

use crate::error::Result;
use crate::tensor::Tensor;
use std::sync::Arc;

/// Reduction applied elementwise across ranks; defined in the leaf module
/// [`crate::reduce`] so the CUDA backend's reduction kernels can name it.
pub use crate::reduce::ReduceOp;

/// A group of ranks that run collectives together (`torch.distributed.ProcessGroup`).
///
/// Collectives are blocking: on host tensors they return when this rank's output is
/// complete and every rank has finished reading this rank's input, so the caller may reuse
/// both at once. On CUDA tensors they are ordered on the calling thread's current stream
/// (as NCCL's are): they return once the work is queued, what the caller queues next on
/// that stream sees the output and may overwrite the input, and a copy to the host sees
/// the output (it synchronizes). Neither the threads backend nor NCCL waits on the host
/// (NCCL's collectives are watched by one thread per process, `nccl/watchdog.rs`, whose
/// findings fail the group's next call).
pub trait ProcessGroup: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Backend name (`"threads"`, `"tcp"`, `"nccl"`).
    fn backend(&self) -> &'static str;

    /// The device every tensor of this group's collectives must be on, or `None` when any
    /// device works (threads, tcp). NCCL takes only its own GPU's tensors, as in PyTorch;
    /// [`staged`] moves host tensors there and back for the small bookkeeping collectives.
    fn collective_device(&self) -> Option<crate::backend::Device> {
        None
    }

    /// This rank's index in the whole world (equal to `rank()` on the world group).
    fn world_rank(&self) -> usize {
        self.rank()
    }

    /// World ranks of the members, in group-rank order
    /// (`torch.distributed.get_process_group_ranks`). The default, `0..size()`, is right for
    /// a world group; backends with subgroups override it.
    fn ranks(&self) -> Vec<usize> {
        (0..self.size()).collect()
    }

    /// A new group of the given world ranks (`torch.distributed.new_group`): `None` on a
    /// rank that is not a member. Members must create their groups in the same order.
    ///
    /// # Errors
    /// `InvalidArgument` for repeated or out-of-range ranks; `Unsupported` on a backend
    /// without subgroups.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Group>> {
        let _ = ranks;
        Err(crate::Error::Unsupported(format!(
            "new_group on the {} backend",
            self.backend()
        )))
    }

    /// `output (size * n) = concat over ranks of input (n)`, rank order.
    /// `torch.distributed.all_gather_into_tensor`. Any dtype; all ranks the same `n`.
    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()>;

    /// `output (n) = reduce over ranks of input[rank * n .. (rank + 1) * n]` where input has
    /// `size * n` elements. `op` is `Sum` or `Avg`. Float dtypes reduce in f32 and round
    /// once. `torch.distributed.reduce_scatter_tensor`.
    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()>;

    /// In place: `tensor = reduce over ranks of tensor`. `torch.distributed.all_reduce`.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;

    /// In place: every rank's `tensor` becomes rank `src`'s. `torch.distributed.broadcast`.
    fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()>;

    /// Returns once every rank has called it. `torch.distributed.barrier`.
    fn barrier(&self) -> Result<()>;

    /// This rank cannot go on (`reason`): every collective of its world in flight or
    /// called later fails, here and on every peer, with [`crate::Error::PeerFailed`]
    /// naming this rank and carrying `reason` (what `TORCH_NCCL_ASYNC_ERROR_HANDLING`'s
    /// abort does to a communicator). FSDP calls it when its ranks took different code
    /// paths, so that no rank waits for a collective a peer will never call. The default
    /// does nothing.
    fn abort(&self, reason: &str) {
        let _ = reason;
    }
}

/// Shared handle to a process group.
pub type Group = Arc<dyn ProcessGroup>;
