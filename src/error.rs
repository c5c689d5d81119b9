//! The crate's one error type. Every variant carries the context a user needs to find the
//! problem (which op, which parameter, which ranks) without a backtrace.

use crate::dtype::DType;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in fsdp. Library code never panics on bad input; it returns
/// one of these.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two shapes (or element counts) that had to agree did not.
    #[error("{op}: shape mismatch: expected {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// The op or method that checked, e.g. `"Linear.forward"`, `"SGD.step"`.
        op: &'static str,
        /// The shape (or element count, as a one-element vec) the op required; a `0` stands
        /// for a dimension of any size (e.g. `[0, 0, C]` for `(B, T, C)`).
        expected: Vec<usize>,
        /// The shape (or element count) it was given.
        got: Vec<usize>,
    },
    /// An op received a tensor of a dtype it does not take.
    #[error("{op}: expected dtype {expected:?}, got {got:?}")]
    DTypeMismatch {
        /// The op or method that checked, e.g. `"SGD.step"`.
        op: &'static str,
        /// The dtype the op takes (f32 for every optimizer and nn op).
        expected: DType,
        /// The dtype of the tensor it was given.
        got: DType,
    },
    /// A parameter was used while its storage is not materialized (sharded and not gathered,
    /// or built on the meta device).
    #[error("parameter '{name}' is not materialized (state: {state}); it is only valid while its FSDP unit is unsharded")]
    NotMaterialized {
        /// The parameter's name (fully qualified once FSDP renamed it, e.g.
        /// `blocks.0.attn.c_attn.weight`), or a meta tensor's `Debug` text.
        name: String,
        /// Why it has no data: `"sharded"`, `"meta"`, or `"not materialized at wrap time"`.
        state: &'static str,
    },
    /// backward was called without the matching forward.
    #[error(
        "{module}: backward called without a saved forward (call forward with grad enabled first)"
    )]
    NoSavedForward {
        /// [`Module::type_name`](crate::nn::Module::type_name) of the module whose backward
        /// was called, e.g. `"Linear"`, `"LayerNorm"`.
        module: &'static str,
    },
    /// An argument is out of its allowed range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The ranks of a group called different collectives, or the same one with different
    /// sizes or dtypes.
    #[error("collective mismatch in group of {group_size} ranks: {detail}")]
    CollectiveMismatch {
        /// Number of ranks in the process group.
        group_size: usize,
        /// Rank 0's call and every rank whose call differs from it: op, dtype, input and
        /// output element counts, and the reduce op or broadcast `src`.
        detail: String,
    },
    /// A collective did not complete in time.
    #[error("{op} timed out after {timeout_s:.1} s on rank {rank}{}", never_arrived(.missing_ranks))]
    Timeout {
        /// The collective (`torch.distributed` name): `"all_gather_into_tensor"`,
        /// `"reduce_scatter_tensor"`, `"all_reduce"`, `"broadcast"` or `"barrier"`.
        op: String,
        /// The rank that gave up waiting (the one reporting this error).
        rank: usize,
        /// The group's collective timeout, seconds (default 300; `torch.distributed`'s is 1800).
        timeout_s: f64,
        /// Ranks of the group that never called the collective; empty when every rank
        /// arrived but some did not finish reading this rank's input in time, or when no
        /// rank is to blame (a store key nobody set; the message then names the key).
        missing_ranks: Vec<usize>,
    },
    /// Another rank of the group failed; this rank stops instead of waiting for it.
    #[error("rank {failed_rank} failed: {reason}")]
    PeerFailed {
        /// The first rank recorded as failed: it returned an error, panicked, or exited
        /// without joining a collective (after a timeout, the first rank that never arrived).
        failed_rank: usize,
        /// That rank's own error or panic message, as text.
        reason: String,
    },
    /// A `torch.distributed` call that needs this thread's default process group ran before
    /// `init_process_group` (or after `destroy_process_group`, or outside `launch`).
    #[error("{call}: the default process group is not initialized on this thread; call init_process_group first (or run inside distributed::launch)")]
    NotInitialized {
        /// The function called, e.g. `"get_rank"`, `"destroy_process_group"`.
        call: &'static str,
    },
    /// FSDP was configured or used in a way it does not support.
    #[error("fsdp: {0}")]
    Fsdp(String),
    /// The training data could not be used.
    #[error("data: {0}")]
    Data(String),
    /// Tensors of one op are on different devices, or host data was asked of a device
    /// tensor (`Tensor::data` on `cuda:0`): copy it with `Tensor::to_device` first.
    #[error("{op}: expected a tensor on {expected}, got one on {got}")]
    DeviceMismatch {
        /// The operation, e.g. `"Tensor::data"`, `"matmul"`.
        op: &'static str,
        /// The device the op needed (`"cpu"`, `"cuda:0"`).
        expected: String,
        /// The device the tensor is on.
        got: String,
    },
    /// A feature that is reserved but not built yet in this version.
    #[error("not supported yet: {0}")]
    Unsupported(String),
    /// The CUDA backend failed: no driver or device, a driver/cuBLAS call returned an error,
    /// a kernel missing from the embedded modules, or the build has no CUDA support.
    #[error("{context}: {message}")]
    Cuda {
        /// What was being done, e.g. `"no CUDA driver found (libcuda.so)"`,
        /// `"launching cast_f32_bf16 on cuda:0"`, `"cuMemAlloc of 64 MiB on cuda:0"`.
        context: String,
        /// The driver's or library's message, or why the backend is unavailable.
        message: String,
    },
    /// A state dict (model or optimizer) does not fit the model it is loaded into: missing
    /// or unexpected keys, wrong shapes or dtypes, a LOCAL state dict of another world size.
    /// Raised before anything is modified.
    #[error("load_state_dict: {0}")]
    StateDict(String),
    /// A checkpoint file or directory cannot be used: missing, truncated, corrupted, or not
    /// written by this crate.
    #[error("checkpoint '{path}': {detail}")]
    Checkpoint {
        /// The file or directory concerned.
        path: String,
        /// What is wrong with it and what was expected.
        detail: String,
    },
    /// A connection of the rendezvous was refused, by either side: the store or peer
    /// belongs to another job (its job id differs), or one side could not prove the job
    /// secret (see `distributed::JobAuth`). Never carries the secret.
    #[error("{context}: {reason}")]
    Refused {
        /// Who refused whom, e.g. `"TCPStore at 127.0.0.1:29500 (rank 1)"`.
        context: String,
        /// Why, e.g. `"it belongs to job 'a', not to this rank's job 'b': another job holds
        /// this port"`.
        reason: String,
    },
    /// Operating-system I/O.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, e.g. `"creating metrics file 'm.jsonl'"`, `"writing metrics"`.
        context: String,
        /// The underlying OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// A copy of this error (same variant and fields; an I/O source keeps its kind and
    /// message). `Error` is not `Clone` because `std::io::Error` is not.
    pub fn duplicate(&self) -> Error {
        match self {
            Error::ShapeMismatch { op, expected, got } => Error::ShapeMismatch {
                op,
                expected: expected.clone(),
                got: got.clone(),
            },
            Error::DTypeMismatch { op, expected, got } => Error::DTypeMismatch {
                op,
                expected: *expected,
                got: *got,
            },
            Error::NotMaterialized { name, state } => Error::NotMaterialized {
                name: name.clone(),
                state,
            },
            Error::NoSavedForward { module } => Error::NoSavedForward { module },
            Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
            Error::CollectiveMismatch { group_size, detail } => Error::CollectiveMismatch {
                group_size: *group_size,
                detail: detail.clone(),
            },
            Error::Timeout {
                op,
                rank,
                timeout_s,
                missing_ranks,
            } => Error::Timeout {
                op: op.clone(),
                rank: *rank,
                timeout_s: *timeout_s,
                missing_ranks: missing_ranks.clone(),
            },
            Error::PeerFailed {
                failed_rank,
                reason,
            } => Error::PeerFailed {
                failed_rank: *failed_rank,
                reason: reason.clone(),
            },
            Error::NotInitialized { call } => Error::NotInitialized { call },
            Error::Fsdp(m) => Error::Fsdp(m.clone()),
            Error::Data(m) => Error::Data(m.clone()),
            Error::DeviceMismatch { op, expected, got } => Error::DeviceMismatch {
                op,
                expected: expected.clone(),
                got: got.clone(),
            },
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::Cuda { context, message } => Error::Cuda {
                context: context.clone(),
                message: message.clone(),
            },
            Error::StateDict(m) => Error::StateDict(m.clone()),
            Error::Checkpoint { path, detail } => Error::Checkpoint {
                path: path.clone(),
                detail: detail.clone(),
            },
            Error::Refused { context, reason } => Error::Refused {
                context: context.clone(),
                reason: reason.clone(),
            },
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }

    /// A [`Error::Cuda`] from what was being done and the driver's message.
    pub fn cuda(context: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Error::Cuda {
            context: context.into(),
            message: message.to_string(),
        }
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// `": ranks [..] never arrived"` for a [`Error::Timeout`] that blames ranks, else nothing.
fn never_arrived(missing: &[usize]) -> String {
    if missing.is_empty() {
        String::new()
    } else {
        format!(": ranks {missing:?} never arrived")
    }
}

/// The exit status of a program whose `main` ran `result`: success, or `error: <message>`
/// on one stderr line and exit code 1 (what the examples and `fsdp` print, rather than
/// `main`'s `Debug` form).
pub fn exit_code(result: Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Shorthand for `Err(Error::InvalidArgument(..))`.
macro_rules! bail_arg {
    ($($t:tt)*) => { return Err($crate::error::Error::InvalidArgument(format!($($t)*))) };
}
pub(crate) use bail_arg;
