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
        /// `Module::type_name` (`fsdp::nn::Module::type_name`) of the module whose backward
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
    /// A host allocation whose size came from the caller (a declared parameter's shard, a
    /// gather or gradient buffer, optimizer state, a copy of a host's tensor) failed: the
    /// memory is not there. Nothing was changed; the process goes on (device memory that
    /// runs out is [`Error::Cuda`]).
    #[error("out of memory: {what} needs {bytes} bytes ({}), which could not be allocated", human_bytes(*.bytes))]
    OutOfMemory {
        /// Bytes the allocation asked for.
        bytes: usize,
        /// What the memory was for, e.g. `"the local shard of the flat parameter holding
        /// 'big.weight'"`.
        what: String,
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
            Error::OutOfMemory { bytes, what } => Error::OutOfMemory {
                bytes: *bytes,
                what: what.clone(),
            },
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }

    /// This error with `what` as the purpose of a failed allocation
    /// ([`Error::OutOfMemory`]); any other error unchanged. For a caller that knows more
    /// than the allocator did: `.map_err(|e| e.allocating(|| format!("the shard of
    /// '{name}'")))`.
    pub fn allocating(self, what: impl FnOnce() -> String) -> Error {
        match self {
            Error::OutOfMemory { bytes, .. } => Error::OutOfMemory {
                bytes,
                what: what(),
            },
            e => e,
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

/// `"4.0 TiB"`: bytes in the largest binary unit that keeps the figure at least 1.
fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{bytes} bytes"),
        _ => format!("{v:.1} {}", UNITS[u]),
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

/// Shorthand for `Err(Error::InvalidArgument(..))`. Crate-internal, public only for the
/// layers above (`#[macro_export]` puts it at the crate root too; name it as
/// `error::bail_arg`).
#[doc(hidden)]
#[macro_export]
macro_rules! bail_arg {
    ($($t:tt)*) => { return Err($crate::error::Error::InvalidArgument(format!($($t)*))) };
}
#[doc(hidden)] // crate-internal, public only for the layers above
pub use bail_arg;

/// The API a caller reaches fsdp through, so that an error message advising a call or an
/// option names it as that caller writes it: `finish_backward` and
/// `FsdpConfig::ranks_per_node` in Rust, `fsdp_model_finish_backward` and
/// `fsdp_config.ranks_per_node` through the C ABI (`include/fsdp.h`). Per thread: the C
/// ABI's entry points run under [`Api::C`] ([`Api::enter`]), everything else under
/// [`Api::Rust`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// The Rust API (the default).
    Rust,
    /// The C ABI.
    C,
}

thread_local! {
    static API: std::cell::Cell<Api> = const { std::cell::Cell::new(Api::Rust) };
}

impl Api {
    /// The API of the call running on this thread.
    pub fn current() -> Api {
        API.with(std::cell::Cell::get)
    }

    /// Until the guard drops, the messages of errors made on this thread name the items
    /// of `self` ([`Term`]).
    pub fn enter(self) -> ApiGuard {
        ApiGuard {
            before: API.with(|a| a.replace(self)),
        }
    }
}

/// Restores the thread's previous [`Api`] when dropped.
#[must_use = "the API applies only while the guard lives"]
pub struct ApiGuard {
    before: Api,
}

impl Drop for ApiGuard {
    fn drop(&mut self) {
        API.with(|a| a.set(self.before));
    }
}

/// An item of fsdp's API that error messages name, printed as the calling thread's
/// [`Api`] spells it (the one table of both spellings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Term {
    /// A unit's hook before its forward.
    PreForward,
    /// A unit's hook after its forward.
    PostForward,
    /// A unit's hook before its backward.
    PreBackward,
    /// A unit's hook after its backward.
    PostBackward,
    /// The gradient views of a unit in its backward.
    GradViews,
    /// The end of a backward, on the root.
    FinishBackward,
    /// Dropping the gradients.
    ZeroGrad,
    /// The optimizer's update of the shards.
    OptimizerStep,
    /// Gradient clipping over every unit.
    ClipGradNorm,
    /// Turning gradient synchronization off (`no_sync`).
    SyncOff,
    /// Turning gradient synchronization back on.
    SyncOn,
    /// A forward without grad (evaluation).
    NoGradForward,
    /// The option that says how many ranks share a node (hybrid sharding).
    RanksPerNode,
    /// Every way to say which ranks share a node.
    NodeChoices,
    /// The hybrid strategies.
    HybridStrategies,
    /// What a non-hybrid strategy takes instead of the hybrid options.
    NotHybrid,
    /// Declaring a parameter.
    AddParam,
    /// Declaring a parameter computed by an initializer.
    AddParamInit,
    /// Declaring a parameter without values on this rank.
    EmptyParam,
    /// The option that gives every rank rank 0's values.
    SyncModuleStates,
    /// Building the sharded model from a declaration.
    BuildModel,
    /// Why a parameter on the meta device without an initializer has no values, and what
    /// gives it some.
    MetaWithoutValues,
}

impl Term {
    /// The spelling of the calling thread's [`Api`].
    pub fn as_str(self) -> &'static str {
        let (rust, c) = match self {
            Term::PreForward => ("pre_forward", "fsdp_unit_pre_forward"),
            Term::PostForward => ("post_forward", "fsdp_unit_post_forward"),
            Term::PreBackward => ("pre_backward", "fsdp_unit_pre_backward"),
            Term::PostBackward => ("post_backward", "fsdp_unit_post_backward"),
            Term::GradViews => ("grad_views", "the grads of fsdp_unit_pre_backward"),
            Term::FinishBackward => ("finish_backward", "fsdp_model_finish_backward"),
            Term::ZeroGrad => ("zero_grad", "fsdp_model_zero_grad"),
            Term::OptimizerStep => ("the optimizer's step", "fsdp_optimizer_step"),
            Term::ClipGradNorm => ("clip_grad_norm_", "fsdp_model_clip_grad_norm"),
            Term::SyncOff => (
                "set_requires_gradient_sync(false) (or no_sync)",
                "fsdp_model_set_no_sync(model, 1)",
            ),
            Term::SyncOn => (
                "set_requires_gradient_sync(true)",
                "fsdp_model_set_no_sync(model, 0)",
            ),
            Term::NoGradForward => (
                "a forward without grad (Context::eval(), pre_forward(false))",
                "a forward with grad_enabled 0 (fsdp_unit_pre_forward)",
            ),
            Term::RanksPerNode => ("FsdpConfig::ranks_per_node", "fsdp_config.ranks_per_node"),
            Term::NodeChoices => (
                "set FsdpConfig::ranks_per_node, pass (shard, replicate) groups in hybrid_groups, or a 2-D device_mesh (replicate, shard)",
                "set fsdp_config.ranks_per_node",
            ),
            Term::HybridStrategies => (
                "HybridShard and HybridShardZero2",
                "FSDP_HYBRID_SHARD and FSDP_HYBRID_SHARD_ZERO2",
            ),
            Term::NotHybrid => (
                "pass the group as pg",
                "leave fsdp_config.ranks_per_node 0",
            ),
            Term::AddParam => ("ParamSpec::values", "fsdp_spec_add_param"),
            Term::AddParamInit => ("ParamSpec::init", "fsdp_spec_add_param_init"),
            Term::EmptyParam => (
                "ParamSpec::empty",
                "values NULL in fsdp_spec_add_param",
            ),
            Term::SyncModuleStates => (
                "FsdpConfig::sync_module_states",
                "fsdp_config.sync_module_states",
            ),
            Term::BuildModel => ("fully_shard", "fsdp_model_new"),
            Term::MetaWithoutValues => (
                "meta without an initializer; give FSDP a param_init_fn",
                "declared without values on every rank (values NULL in fsdp_spec_add_param); give rank 0 values with fsdp_config.sync_module_states, or use fsdp_spec_add_param_init",
            ),
        };
        match Api::current() {
            Api::Rust => rust,
            Api::C => c,
        }
    }
}

impl std::fmt::Display for Term {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_follow_the_api_of_the_thread_and_out_of_memory_names_the_bytes() {
        assert_eq!(Term::FinishBackward.to_string(), "finish_backward");
        {
            let _c = Api::C.enter();
            assert_eq!(
                Term::FinishBackward.to_string(),
                "fsdp_model_finish_backward"
            );
            assert_eq!(Term::RanksPerNode.to_string(), "fsdp_config.ranks_per_node");
        }
        assert_eq!(Api::current(), Api::Rust);
        let e = Error::OutOfMemory {
            bytes: 1 << 42,
            what: "x".into(),
        };
        assert_eq!(
            e.to_string(),
            "out of memory: x needs 4398046511104 bytes (4.0 TiB), which could not be allocated"
        );
        let e = e.allocating(|| "the shard of 'w'".into());
        assert!(e
            .to_string()
            .contains("the shard of 'w' needs 4398046511104 bytes"));
        assert_eq!(human_bytes(1000), "1000 bytes");
    }
}
