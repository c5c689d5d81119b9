//! The adapter's error: fsdp's errors, candle's errors with what the adapter was doing, and
//! calls that would train wrong.

/// Everything that can go wrong in `fsdp-candle`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error of fsdp: a collective, sharding, a checkpoint file, the optimizer.
    #[error(transparent)]
    Fsdp(#[from] fsdp::Error),
    /// An error of candle, in the user's builder or closure or in a candle call of the
    /// adapter; `context` says which.
    #[error("{context}: {source}")]
    Candle {
        /// What the adapter was doing (`"the model builder"`, `"loss.backward()"`, ...).
        context: String,
        /// candle's error.
        #[source]
        source: candle::Error,
    },
    /// A call in an order that would train wrong (a step without gradients, a second
    /// backward whose gradients would silently add to the first's); nothing was changed.
    #[error("{call}: {reason}")]
    OutOfOrder {
        /// The method called (`"step"`).
        call: &'static str,
        /// What was expected first.
        reason: String,
    },
    /// Bad input: unit prefixes, var names, initial values, a loss that is not a scalar.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The local part of a training pass (the model builder, the forward/loss closure,
    /// reading the loss, candle's backward) failed on the ranks named, before any
    /// collective of the backward. Every rank returns this error, with the same `reason`;
    /// no rank reduced a gradient, so nothing changed: the gradients held are those from
    /// before the call, the parameters are as they were, and the model is usable for the
    /// next pass (the failed micro-batch is simply skipped).
    #[error("the training pass failed on rank(s) {ranks:?} before the backward's collectives, so every rank skipped it (nothing changed; the model stays usable): {reason}")]
    PassFailed {
        /// The ranks whose local part failed, ascending.
        ranks: Vec<usize>,
        /// Each failed rank and its error (`rank 1: ...; rank 3: ...`).
        reason: String,
    },
    /// An earlier call failed in the middle of a step's collectives; this rank aborted its
    /// process group then (so its peers fail at once instead of waiting), and the model
    /// cannot be used any more: rebuild it, e.g. from a checkpoint.
    #[error("the model failed earlier and cannot be used: {0}")]
    Failed(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Wraps candle's error with the adapter's `context`.
pub(crate) fn candle(context: &str) -> impl FnOnce(candle::Error) -> Error + '_ {
    move |source| Error::Candle {
        context: context.to_string(),
        source,
    }
}

/// Into fsdp's error, so that `?` works inside `fsdp::distributed::launch` closures: fsdp's
/// own errors come back as they were (a peer's failure stays `PeerFailed`, which `launch`
/// uses to find the root cause); the others become `fsdp::Error::Fsdp` with this crate's
/// message.
impl From<Error> for fsdp::Error {
    fn from(e: Error) -> fsdp::Error {
        match e {
            Error::Fsdp(e) => e,
            other => fsdp::Error::Fsdp(format!("fsdp-candle: {other}")),
        }
    }
}
