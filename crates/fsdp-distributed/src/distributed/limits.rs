//! How many thread ranks this machine can hold: the one check [`launch`](super::launch)'s
//! callers share (`fsdp train --world-size`, `WORLD_SIZE` of the examples through
//! [`LaunchOptions::from_env_or`](super::LaunchOptions::from_env_or)), so a typo such as
//! `WORLD_SIZE=1000000` is refused with a message instead of exhausting memory or the
//! kernel's thread limit.

use crate::error::{Error, Result};

/// Threads one FSDP thread rank runs: the rank itself and the two stream threads of its
/// FSDP state (`fsdp-unshard-rank*` and `fsdp-post-backward*`), counted in
/// `/proc/<pid>/task` of an 8-rank `fsdp train`.
pub const THREADS_PER_RANK: usize = 3;

/// Host bytes one thread rank costs before any tensor (its threads' stacks and allocator
/// heaps, its group's state): peak RSS of `fsdp train` on a 1-layer 16-wide model grows
/// by 4.4 MiB per rank at 2 to 16 ranks, 5.5 MiB at 256 and 6.1 MiB at 512 (per-peer state
/// grows with the world size), so 8 MiB bounds a rank up to 256 ranks and
/// [`thread_rank_bytes`] adds 8 KiB per peer beyond.
pub const RANK_BASE_BYTES: u64 = 8 << 20;

/// Bytes of per-peer state per rank (see [`RANK_BASE_BYTES`]).
const PER_PEER_BYTES: u64 = 8 << 10;

/// Host bytes each of `world_size` thread ranks costs before any tensor: [`RANK_BASE_BYTES`]
/// plus 8 KiB per peer.
pub fn thread_rank_bytes(world_size: usize) -> u64 {
    RANK_BASE_BYTES + PER_PEER_BYTES * world_size as u64
}

/// `MemAvailable` of /proc/meminfo in bytes, where there is one (Linux).
pub fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The most threads this process may start: the smaller of the soft `RLIMIT_NPROC`
/// (`ulimit -u`, counted per user) and `/proc/sys/kernel/threads-max`; `None` when neither
/// is known or both are unlimited.
pub fn thread_limit() -> Option<u64> {
    let max = std::fs::read_to_string("/proc/sys/kernel/threads-max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer to a local.
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every target
    let nproc = (unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut rl) } == 0
        && rl.rlim_cur != libc::RLIM_INFINITY)
        .then_some(rl.rlim_cur as u64);
    match (max, nproc) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Checks that `world_size` thread ranks fit this machine: their threads
/// ([`THREADS_PER_RANK`] each, plus the caller's) within [`thread_limit`], and their fixed
/// cost ([`thread_rank_bytes`] each) within [`available_memory_bytes`]. `source` names
/// where the number came from in the message (`"--world-size"`, `"WORLD_SIZE"`).
///
/// # Errors
/// `InvalidArgument` naming `source`, its value and the limit it exceeds.
pub fn check_thread_ranks(world_size: usize, source: &str) -> Result<()> {
    let shown = if source.starts_with("--") {
        format!("{source} {world_size}")
    } else {
        format!("{source}={world_size}")
    };
    let threads = (world_size as u64)
        .saturating_mul(THREADS_PER_RANK as u64)
        .saturating_add(1);
    let thread_cap = thread_limit();
    let per_rank = thread_rank_bytes(world_size);
    let need = (world_size as u64).saturating_mul(per_rank);
    let avail = available_memory_bytes();
    // The most ranks both limits allow, for the message.
    let fit = [
        thread_cap.map(|l| l.saturating_sub(1) / THREADS_PER_RANK as u64),
        avail.map(max_ranks_in),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(u64::MAX);
    if let Some(limit) = thread_cap.filter(|&l| threads > l) {
        return Err(Error::InvalidArgument(format!(
            "{shown}: {world_size} thread ranks need {threads} threads ({THREADS_PER_RANK} per rank) and this machine allows {limit} (ulimit -u, /proc/sys/kernel/threads-max); at most {fit} thread ranks fit"
        )));
    }
    if let Some(avail) = avail.filter(|&a| need > a) {
        let gib = (1u64 << 30) as f64;
        return Err(Error::InvalidArgument(format!(
            "{shown}: {world_size} thread ranks need about {:.1} GiB before any tensor ({:.1} MiB each: thread stacks, allocator heaps, group state) and {:.1} GiB are available; at most {fit} thread ranks fit",
            need as f64 / gib,
            per_rank as f64 / (1u64 << 20) as f64,
            avail as f64 / gib,
        )));
    }
    Ok(())
}

/// The most thread ranks whose fixed cost fits `bytes`.
fn max_ranks_in(bytes: u64) -> u64 {
    // n (BASE + PEER n) <= bytes, solved by bisection (monotone in n).
    let (mut lo, mut hi) = (0u64, bytes / RANK_BASE_BYTES + 1);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if mid.saturating_mul(thread_rank_bytes(mid as usize)) <= bytes {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_ranks_inverts_the_cost() {
        let n = max_ranks_in(1 << 30);
        assert!(n * thread_rank_bytes(n as usize) <= 1 << 30);
        assert!((n + 1) * thread_rank_bytes(n as usize + 1) > 1 << 30);
        assert_eq!(max_ranks_in(0), 0);
    }
}
