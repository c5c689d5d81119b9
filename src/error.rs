//! The crate's one error type. Every variant carries the context a user needs to find the
//! problem (which op, which parameter, which ranks) without a backtrace.

use crate::tensor::DType;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in fsdp. Library code never panics on bad input; it returns
/// one of these.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two shapes (or element counts) that had to agree did not.
    #[error("{op}: shape mismatch: expected {expected:?}, got {got:?}")]
    ShapeMismatch {
        op: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// An op received a tensor of a dtype it does not take.
    #[error("{op}: expected dtype {expected:?}, got {got:?}")]
    DTypeMismatch {
        op: &'static str,
        expected: DType,
        got: DType,
    },
    /// A parameter was used while its storage is not materialized (sharded and not gathered,
    /// or built on the meta device).
    #[error("parameter '{name}' is not materialized (state: {state}); it is only valid while its FSDP unit is unsharded")]
    NotMaterialized { name: String, state: &'static str },
    /// backward was called without the matching forward.
    #[error(
        "{module}: backward called without a saved forward (call forward with grad enabled first)"
    )]
    NoSavedForward { module: &'static str },
    /// An argument is out of its allowed range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The ranks of a group called different collectives, or the same one with different
    /// sizes or dtypes.
    #[error("collective mismatch in group of {group_size} ranks: {detail}")]
    CollectiveMismatch { group_size: usize, detail: String },
    /// A collective did not complete in time.
    #[error("{op} timed out after {timeout_s:.1} s on rank {rank}: ranks {missing_ranks:?} never arrived")]
    Timeout {
        op: String,
        rank: usize,
        timeout_s: f64,
        missing_ranks: Vec<usize>,
    },
    /// Another rank of the group failed; this rank stops instead of waiting for it.
    #[error("rank {failed_rank} failed: {reason}")]
    PeerFailed { failed_rank: usize, reason: String },
    /// FSDP was configured or used in a way it does not support.
    #[error("fsdp: {0}")]
    Fsdp(String),
    /// The training data could not be used.
    #[error("data: {0}")]
    Data(String),
    /// A feature that is reserved but not built yet in this version.
    #[error("not supported yet: {0}")]
    Unsupported(String),
    /// Operating-system I/O.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Shorthand for `Err(Error::InvalidArgument(..))`.
macro_rules! bail_arg {
    ($($t:tt)*) => { return Err($crate::error::Error::InvalidArgument(format!($($t)*))) };
}
pub(crate) use bail_arg;
