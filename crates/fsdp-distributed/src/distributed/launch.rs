//! Running a closure on N in-process ranks (the `threads` backend's `torchrun`).

use super::{Group, ProcessGroup, ThreadsGroup};
use crate::error::{Error, Result};
use std::sync::Arc;
use std::time::Duration;

/// Options of [`launch`].
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Number of ranks (threads).
    pub world_size: usize,
    /// Collective timeout of the world group.
    pub timeout: Duration,
    /// Cores the ranks share; each rank's GEMMs get `max(1, cores / world_size)` threads.
    pub cores: usize,
}

impl LaunchOptions {
    /// `WORLD_SIZE` ranks when that variable is set (torchrun's name), else `default`.
    ///
    /// # Errors
    /// `InvalidArgument` when `WORLD_SIZE` is not a positive integer, or names more thread
    /// ranks than this machine holds ([`check_thread_ranks`](super::check_thread_ranks), the
    /// limit `fsdp train --world-size` has too).
    pub fn from_env_or(default: usize) -> Result<Self> {
        match std::env::var("WORLD_SIZE") {
            Err(_) => Ok(Self::new(default)),
            Ok(v) if v.trim().is_empty() => Ok(Self::new(default)),
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => {
                    super::check_thread_ranks(n, "WORLD_SIZE")?;
                    Ok(Self::new(n))
                }
                _ => Err(Error::InvalidArgument(format!(
                    "WORLD_SIZE must be a positive integer, got '{v}'"
                ))),
            },
        }
    }

    /// `world_size` ranks with the default timeout, sharing this machine's cores.
    pub fn new(world_size: usize) -> Self {
        LaunchOptions {
            world_size,
            timeout: super::threads::DEFAULT_TIMEOUT,
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        }
    }
}

/// Runs `f(group)` on `world_size` threads, one per rank, and returns every rank's result in
/// rank order. Inside `f`, `group` is also the thread's default group, so
/// [`get_rank`](super::get_rank), [`get_world_size`](super::get_world_size) and
/// [`default_group`](super::default_group) answer as after `init_process_group`.
///
/// A rank that returns an error or panics marks the group failed, so its peers' pending
/// collectives end at once with [`Error::PeerFailed`]; `launch` then returns the first
/// rank's own error (not the peers' echoes of it), prefixed with its rank.
///
/// # Errors
/// The failing rank's error as `PeerFailed { failed_rank, reason }`.
pub fn launch<T, F>(opts: &LaunchOptions, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Group) -> Result<T> + Sync,
{
    let groups = ThreadsGroup::new_world(opts.world_size, opts.timeout)?;
    let gemm_threads = (opts.cores / opts.world_size).max(1);
    let results: Vec<std::thread::Result<Result<T>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let f = &f;
                let g = Arc::new(g);
                std::thread::Builder::new()
                    .name(format!("rank{}", g.rank()))
                    .spawn_scoped(scope, move || {
                        crate::backend::cpu::gemm::set_num_threads(gemm_threads);
                        // get_rank() and default_group() work inside `f`.
                        let default = super::init::set_default_for_launch(g.clone());
                        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            f(g.clone() as Group)
                        }));
                        drop(default);
                        match &res {
                            Ok(Ok(_)) => g.mark_exited(),
                            Ok(Err(e)) => g.mark_failed(e.to_string()),
                            Err(p) => g.mark_failed(format!("panicked: {}", panic_message(p))),
                        }
                        res
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().and_then(|r| r),
                Err(e) => Ok(Err(Error::io("spawning a rank thread", e))),
            })
            .collect()
    });
    let mut out = Vec::with_capacity(results.len());
    let mut errors: Vec<(usize, Error)> = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => errors.push((rank, e)),
            Err(p) => errors.push((
                rank,
                Error::PeerFailed {
                    failed_rank: rank,
                    reason: format!("panicked: {}", panic_message(&p)),
                },
            )),
        }
    }
    // Report the root cause: a rank's own error rather than peers echoing that it failed.
    let own = errors
        .iter()
        .position(|(_, e)| !matches!(e, Error::PeerFailed { .. }));
    match own.or(if errors.is_empty() { None } else { Some(0) }) {
        None => Ok(out),
        Some(i) => {
            let (rank, e) = errors.swap_remove(i);
            Err(match e {
                e @ Error::PeerFailed { .. } => e,
                e => Error::PeerFailed {
                    failed_rank: rank,
                    reason: e.to_string(),
                },
            })
        }
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}
