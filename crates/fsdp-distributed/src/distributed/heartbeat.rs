//! Heartbeats between the rank processes of one world, so that a rank that stops entirely
//! (`SIGSTOP`, a frozen VM, a host cut off with its connections open) is named within the
//! heartbeat timeout instead of the collective timeout.
//!
//! # [Note: heartbeat]
//! PyTorch's NCCL heartbeat monitor (`ProcessGroupNCCL.cpp`, `HeartbeatMonitor`,
//! `TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`, 8 min) watches its own process's watchdog thread and
//! aborts that process when it stops beating; peers learn of it only when their collective
//! times out. Here the beat goes through the rendezvous store, so every peer learns it:
//!
//! - each rank process runs one thread with its own store connection (not the rendezvous
//!   client: its requests never count in `backend::counters`' `store_ops`, and no request
//!   is made per training step) that sends `HEARTBEAT(rank, T)` every `T / 5`;
//! - the server stamps the beat with its own clock (no clock skew between hosts) and
//!   answers the ranks whose last beat is older than `T`; a rank whose heartbeat
//!   connection closed (it exited, or was killed: its mesh streams end too and say so) is
//!   forgotten, not stale;
//! - a rank told that peer `r` is stale records `r`'s failure in its world: every waiting
//!   and later collective fails with `PeerFailed` naming `r`. On the `tcp` backend the
//!   streams to `r` are shut so that a send blocked on `r`'s full socket returns
//!   (`tcp/mod.rs`); on the `nccl` backend every group of the world aborts its
//!   communicator, so that the collective waiting for `r` ends and the streams drain
//!   (`nccl/heartbeat.rs`);
//! - rank 0's process hosts the store: when it stops, the store stops answering, and a
//!   heartbeat without an answer within `T` names rank 0.
//!
//! It finds a process that stops as a whole. A rank whose main thread hangs while its
//! process runs still beats; the collective timeout covers that case, and the progress
//! lines of `waiting.rs` name the ranks it waits for meanwhile.

use super::auth::JobAuth;
use super::store::TcpStore;
use crate::error::{Error, Result};
use std::sync::mpsc;
use std::time::Duration;

/// A running heartbeat; dropping it stops the thread and closes its store connection (the
/// server then forgets this rank: gone, not stale).
pub(crate) struct Heartbeat {
    _stop: mpsc::Sender<()>,
}

/// Where and how a rank beats.
pub(crate) struct BeatSpec {
    /// The store's host and port.
    pub(crate) host: String,
    pub(crate) port: u16,
    /// This rank (world rank).
    pub(crate) rank: usize,
    /// The heartbeat timeout `T`.
    pub(crate) timeout: Duration,
    /// How long connecting to the store may take (the world's timeout).
    pub(crate) connect_timeout: Duration,
    /// The job whose store it is.
    pub(crate) job: JobAuth,
}

impl BeatSpec {
    /// The beat of rank `rv.rank` through the rendezvous store at `rv.key` (`HOST:PORT`),
    /// with `rv`'s heartbeat timeout, collective timeout and job; None for a world of one
    /// rank or a key that is not `HOST:PORT`.
    pub(crate) fn of(rv: &super::Rendezvous) -> Option<BeatSpec> {
        let (host, port) = super::store::host_port(&rv.key)?;
        (rv.world_size > 1).then(|| BeatSpec {
            host: host.to_string(),
            port,
            rank: rv.rank,
            timeout: rv.heartbeat_timeout,
            connect_timeout: rv.timeout,
            job: rv.job.clone(),
        })
    }
}

/// Seconds in a message.
fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Starts the heartbeat of `spec.rank`: a thread that connects its own store client, then
/// beats. When a peer is stale, `on_stale(rank, reason)` is called once and the thread
/// ends. When the store cannot be reached (rank 0 left right after the rendezvous), the
/// thread ends without a word: the mesh streams tell of a departed rank.
///
/// # Errors
/// `Io` when the thread cannot start.
pub(crate) fn start(
    spec: BeatSpec,
    on_stale: impl Fn(usize, String) + Send + 'static,
) -> Result<Heartbeat> {
    let period = spec.timeout / 5;
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name(format!("fsdp-heartbeat-{}", spec.rank))
        .spawn(move || {
            let Ok(store) = TcpStore::connect_with_auth(
                &spec.host,
                spec.port,
                spec.rank,
                spec.connect_timeout,
                spec.job.clone(),
            ) else {
                return;
            };
            beat(&spec, &store.uncounted(), period, &rx, on_stale);
        })
        .map_err(|e| Error::io("starting the heartbeat thread", e))?;
    Ok(Heartbeat { _stop: tx })
}

/// Beats every `period` until a peer is stale, the store is gone, or `stop` closes.
fn beat(
    spec: &BeatSpec,
    store: &TcpStore,
    period: Duration,
    stop: &mpsc::Receiver<()>,
    on_stale: impl Fn(usize, String),
) {
    loop {
        match store.heartbeat(spec.rank, spec.timeout) {
            Ok(stale) => {
                if let Some(&r) = stale.first() {
                    on_stale(
                        r,
                        format!(
                            "rank {r} sent no heartbeat for over {} (heartbeat timeout): its process is stopped (SIGSTOP), hung as a whole, or cut off from the network",
                            secs(spec.timeout)
                        ),
                    );
                    return;
                }
            }
            Err(Error::Timeout { .. }) => {
                on_stale(
                    0,
                    format!(
                        "rank 0 did not answer a heartbeat within {} (heartbeat timeout; its process hosts the store at {}:{}): it is stopped (SIGSTOP), hung as a whole, or cut off from the network",
                        secs(spec.timeout),
                        spec.host,
                        spec.port
                    ),
                );
                return;
            }
            // The store is gone (rank 0 exited or was killed): the mesh streams end too and
            // name it; nothing more to watch.
            Err(_) => return,
        }
        if !matches!(
            stop.recv_timeout(period),
            Err(mpsc::RecvTimeoutError::Timeout)
        ) {
            return;
        }
    }
}
