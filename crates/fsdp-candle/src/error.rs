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
