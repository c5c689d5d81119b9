//! A TCP key-value store for rendezvous, with the semantics of c10d's `TCPStore`
//! (`torch/csrc/distributed/c10d/TCPStore.hpp`, `Store.hpp`, `PrefixStore.hpp`).
//!
//! One server (hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`) holds a map from UTF-8 keys to
//! byte values; every rank is a client. Ranks publish what the others need (their listening
//! addresses for the `tcp` backend, an NCCL unique id) with [`Store::set`] and read it with
//! [`Store::get`], which waits until the key exists. [`Store::add`] is an atomic counter
//! (its value is stored as decimal text, as c10d's), [`Store::wait`] blocks until keys exist.
//!
//! | piece | file |
//! |---|---|
//! | the [`Store`] trait, [`PrefixStore`] | `mod.rs` |
//! | [`TcpStore`] (client; hosts a server with `is_master`) | `client.rs` |
//! | [`TcpStoreServer`] | `server.rs` |
//! | the length-prefixed binary protocol | `protocol.rs` |
//!
//! Every connection starts with the job handshake of [`auth`](crate::distributed::auth)
//! ([Note: job auth]): a store made with a [`JobAuth`](crate::distributed::JobAuth) serves
//! only clients of that job id that prove its secret, and its clients check the server the
//! same way; [`TcpStore::new`] and [`TcpStoreServer::bind`] are the open store of a job
//! without id or secret, as c10d's.
//!
//! Errors: a `get` or `wait` that outlives the store's timeout is [`Error::Timeout`] naming
//! the keys and the waiting rank; a client retries connecting while the server is not up
//! yet (connection refused, or no answer), until the timeout, and fails at once when there
//! is no route to the address; bad bytes on the wire (either side) are errors, never panics:
//! the server drops such a client and serves the others.
//!
//! [`Error::Timeout`]: crate::Error::Timeout

mod client;
mod protocol;
mod server;

pub use client::TcpStore;
pub use server::{TcpStoreServer, MAX_HANDSHAKES};

use crate::error::Result;
use std::sync::Arc;
use std::time::Duration;

/// A key-value store shared by the ranks of a job (c10d's `Store`). Keys are UTF-8 text,
/// values bytes. Every method may block on the network; none panics.
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any value; wakes every rank waiting for it.
    ///
    /// # Errors
    /// `Io` when the server is unreachable; `InvalidArgument` for a key over 64 KiB.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting until some rank sets it, for at most the store's
    /// [`timeout`](Self::timeout).
    ///
    /// # Errors
    /// `Timeout` naming the key and this rank when it was not set in time; `Io` as
    /// [`set`](Self::set).
    fn get(&self, key: &str) -> Result<Vec<u8>>;

    /// Adds `delta` to the integer under `key` (0 when absent) and returns the new value,
    /// atomically across clients. The value is stored as decimal text.
    ///
    /// # Errors
    /// `Io` when `key` holds a value that is not an integer, or on overflow, or as
    /// [`set`](Self::set).
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Waits until every key of `keys` exists, for at most the store's timeout.
    ///
    /// # Errors
    /// `Timeout` naming the keys still missing and this rank.
    fn wait(&self, keys: &[&str]) -> Result<()> {
        self.wait_timeout(keys, self.timeout())
    }

    /// Waits until every key of `keys` exists, for at most `timeout`.
    ///
    /// # Errors
    /// As [`wait`](Self::wait).
    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Whether every key of `keys` exists, without waiting.
    ///
    /// # Errors
    /// `Io` as [`set`](Self::set).
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Removes `key`; true when it existed.
    ///
    /// # Errors
    /// `Io` as [`set`](Self::set).
    fn delete_key(&self, key: &str) -> Result<bool>;

    /// Number of keys in the whole store (a [`PrefixStore`] counts every prefix, as c10d's).
    ///
    /// # Errors
    /// `Io` as [`set`](Self::set).
    fn num_keys(&self) -> Result<usize>;

    /// How long [`get`](Self::get) and [`wait`](Self::wait) wait.
    fn timeout(&self) -> Duration;
}

/// A view of a store in which every key is `"{prefix}/{key}"` (c10d's `PrefixStore`), so that
/// independent users (the world group, each subgroup, NCCL) share one store without
/// colliding.
///
/// ```
/// use fsdp_distributed::distributed::{PrefixStore, Store, TcpStore};
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// let store = Arc::new(TcpStore::new("127.0.0.1", 0, 0, true, Duration::from_secs(5))?);
/// let nccl = PrefixStore::new("nccl/world", store.clone());
/// nccl.set("unique_id", b"0123")?;
/// assert_eq!(store.get("nccl/world/unique_id")?, b"0123");
/// # Ok::<(), fsdp_core::Error>(())
/// ```
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl PrefixStore {
    /// Keys of this view are `"{prefix}/{key}"` in `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store underneath.
    pub fn underlying_store(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait_timeout(&refs, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.key(key))
    }
    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        (**self).set(key, value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        (**self).get(key)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        (**self).add(key, delta)
    }
    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        (**self).wait_timeout(keys, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        (**self).check(keys)
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        (**self).delete_key(key)
    }
    fn num_keys(&self) -> Result<usize> {
        (**self).num_keys()
    }
    fn timeout(&self) -> Duration {
        (**self).timeout()
    }
}

/// The store of a rendezvous `HOST:PORT` (from `MASTER_ADDR`/`MASTER_PORT` or
/// `tcp://HOST:PORT`): rank 0 hosts it, every rank connects (what both the `tcp` and the
/// `nccl` backends meet through). `what` names the call in errors.
///
/// The ranks must belong to one job (`rv.job`: the same job id, and secret when secured).
///
/// # Errors
/// `InvalidArgument` when the key is not `HOST:PORT`; `Timeout` naming rank 0 when its
/// store cannot be reached in time; `Io` when rank 0 cannot host it (its port is in use, or
/// the address is not this machine's) or the address cannot be reached; `Refused` when the
/// store belongs to another job or a side cannot prove the job secret.
pub(crate) fn connect_for(
    rv: &crate::distributed::Rendezvous,
    what: &str,
) -> crate::error::Result<Arc<TcpStore>> {
    use crate::error::Error;
    let (host, port) = match host_port(&rv.key) {
        Some(hp) => hp,
        None => crate::error::bail_arg!(
            "{what}: backend {} needs MASTER_ADDR:MASTER_PORT or tcp://HOST:PORT, got '{}'",
            rv.backend,
            rv.key
        ),
    };
    let is_master = rv.rank == 0;
    let store = TcpStore::with_auth(host, port, rv.rank, is_master, rv.timeout, rv.job.clone())
        .map_err(|e| match e {
            Error::Timeout { op, timeout_s, .. } => Error::Timeout {
                op: format!("{what}: {op}"),
                rank: rv.rank,
                timeout_s,
                missing_ranks: vec![0],
            },
            Error::Io { context, source } => Error::Io {
                context: format!("{what}: {context}"),
                source,
            },
            Error::Refused { context, reason } => Error::Refused {
                context: format!("{what}: {context}"),
                reason,
            },
            e => e,
        })?;
    Ok(Arc::new(store))
}

/// `HOST` (without IPv6 brackets) and `PORT` of a rendezvous key `HOST:PORT`.
pub(crate) fn host_port(key: &str) -> Option<(&str, u16)> {
    match key.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>())) {
        Some((h, Ok(p))) if !h.is_empty() => Some((h.trim_matches(['[', ']']), p)),
        _ => None,
    }
}
