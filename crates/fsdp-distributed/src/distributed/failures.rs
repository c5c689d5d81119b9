//! Why a round of `fsdp launch`'s ranks ended: the children it started, what each recorded
//! with [`record_error`](super::record_error), and the one error naming the root cause
//! (torchrun's `ChildFailedError` summary).

use crate::error::Error;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::Instant;

/// One started child.
pub(super) struct Proc {
    pub(super) rank: usize,
    pub(super) local_rank: usize,
    pub(super) child: Child,
    pub(super) error_file: PathBuf,
    /// Its exit status and when it was seen, once it exited.
    pub(super) exit: Option<(ExitStatus, Instant)>,
    pub(super) killed: bool,
}

/// What a failed child recorded with [`record_error`](super::record_error).
#[derive(Debug, Default, serde::Deserialize)]
struct Recorded {
    message: String,
    /// The rank a `PeerFailed` error blamed: this child only echoed another's failure.
    peer_failed: Option<usize>,
    /// When it was recorded, microseconds since the Unix epoch (absent in files of other
    /// programs, which may give torchrun's `timestamp` in seconds).
    #[serde(default)]
    timestamp_us: Option<u64>,
    /// torchrun's `timestamp`, seconds since the Unix epoch (any JSON: a value that is
    /// not a number is ignored, never a reason to drop the record).
    #[serde(default)]
    timestamp: Option<serde_json::Value>,
    /// [`RENDEZVOUS_STAGE`] when the child failed while joining the world (hosting or
    /// reaching the store), see [`note_rendezvous`](super::elastic::note_rendezvous).
    #[serde(default)]
    stage: Option<String>,
}

impl Recorded {
    /// When the failure was recorded, microseconds since the Unix epoch, if known.
    fn time_us(&self) -> Option<u64> {
        self.timestamp_us.or_else(|| {
            let secs = self.timestamp.as_ref()?.as_f64()?;
            (secs >= 0.0).then_some((secs * 1e6) as u64)
        })
    }
}

/// The `stage` a child records when it failed while joining the world.
pub(super) const RENDEZVOUS_STAGE: &str = "rendezvous";

fn describe(status: &ExitStatus) -> String {
    if let Some(c) = status.code() {
        return format!("exit code {c}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = status.signal() {
            let name = match s {
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            return format!("signal {s}{name}");
        }
    }
    status.to_string()
}

/// The error naming the root cause `p`; first prints, one line each, the own errors of
/// other ranks that differ from it (`[rank 2] error: ...`). Ranks that recorded `p`'s very
/// error are named once; echoes of a peer's failure, silent and killed ranks are counted
/// as stopped.
pub(super) fn summarize(procs: &[Proc], p: &Proc) -> Error {
    let (status, _) = p.exit.unwrap_or((ExitStatus::default(), Instant::now()));
    let msg = read_recorded(&p.error_file).map(|r| r.message.trim().to_string());
    let (mut same, mut stopped) = (Vec::new(), Vec::new());
    let mut distinct: Vec<(String, Vec<usize>)> = Vec::new();
    // The other ranks in the order their failures are blamed (see `failure_order`), so
    // the lines of distinct errors come in the order they happened.
    let mut others: Vec<(&Proc, Option<Recorded>)> = procs
        .iter()
        .filter(|q| q.rank != p.rank)
        .map(|q| (q, read_recorded(&q.error_file).filter(|_| !q.killed)))
        .collect();
    others.sort_by_key(|(q, r)| failure_order(q, r.as_ref()));
    for (q, recorded) in others {
        let failed = q.exit.is_some_and(|(s, _)| !s.success());
        if !q.killed && !failed {
            continue;
        }
        match recorded {
            Some(r) if Some(r.message.trim()) == msg.as_deref() => same.push(q.rank),
            Some(r) if r.peer_failed.is_none() => {
                let m = r.message.trim().to_string();
                match distinct.iter_mut().find(|(d, _)| *d == m) {
                    Some((_, ranks)) => ranks.push(q.rank),
                    None => distinct.push((m, vec![q.rank])),
                }
            }
            _ => stopped.push(q.rank),
        }
    }
    same.sort_unstable();
    for (_, ranks) in distinct.iter_mut() {
        ranks.sort_unstable();
    }
    for (m, ranks) in &distinct {
        let line = format!("{} error: {m}\n", rank_tag(ranks));
        // One write: the line cannot interleave with a child's output.
        eprint!("{line}");
    }
    let mut reason = format!(
        "{} (local rank {}, pid {})",
        describe(&status),
        p.local_rank,
        p.child.id()
    );
    if let Some(m) = msg {
        reason.push_str(": ");
        reason.push_str(&m);
    }
    if !same.is_empty() {
        reason.push_str(&format!("; {} failed with the same error", list(&same)));
    }
    let mut ended: Vec<usize> = distinct.into_iter().flat_map(|(_, r)| r).collect();
    ended.extend(stopped);
    ended.sort_unstable();
    if !ended.is_empty() {
        reason.push_str(&format!(
            "; the job was stopped (ranks {ended:?} also ended)"
        ));
    }
    Error::PeerFailed {
        failed_rank: p.rank,
        reason,
    }
}

/// `[rank 2]` or `[ranks 2, 3]`.
fn rank_tag(ranks: &[usize]) -> String {
    format!("[{}]", list(ranks))
}

/// `rank 2` or `ranks 2, 3`.
fn list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
    let s = if ranks.len() == 1 { "" } else { "s" };
    format!("rank{s} {}", names.join(", "))
}

/// Kills every child still running and reaps it.
pub(super) fn stop(procs: &mut [Proc]) {
    for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
        let _ = p.child.kill();
        p.killed = true;
    }
    for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
        if let Ok(st) = p.child.wait() {
            p.exit = Some((st, Instant::now()));
        }
    }
}

fn read_recorded(path: &Path) -> Option<Recorded> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

/// The failure to report: among children that failed by themselves with an error of
/// their own (not a `PeerFailed` echo), rank 0's if it failed while joining the world (it
/// hosts the store: the other ranks' rendezvous errors follow from its failure), else the
/// earliest recorded; else one that recorded nothing (it crashed); else the first seen.
pub(super) fn root_cause(procs: &[Proc]) -> Option<&Proc> {
    let mut failed: Vec<(&Proc, Option<Recorded>)> = procs
        .iter()
        .filter(|p| !p.killed && p.exit.is_some_and(|(s, _)| !s.success()))
        .map(|p| (p, read_recorded(&p.error_file)))
        .collect();
    failed.sort_by_key(|(p, r)| failure_order(p, r.as_ref()));
    let own = failed
        .iter()
        .find(|(_, r)| r.as_ref().is_some_and(|r| r.peer_failed.is_none()));
    let silent = failed.iter().find(|(_, r)| r.is_none());
    own.or(silent).or(failed.first()).map(|(p, _)| *p)
}

/// The order in which failures are blamed and listed: rank 0's rendezvous failure first,
/// then by the time each was recorded (µs; unknown last), then as the launcher saw the
/// processes exit, then by rank.
fn failure_order(p: &Proc, r: Option<&Recorded>) -> (bool, u64, Option<Instant>, usize) {
    let host_failed =
        p.rank == 0 && r.is_some_and(|r| r.stage.as_deref() == Some(RENDEZVOUS_STAGE));
    (
        !host_failed,
        r.and_then(Recorded::time_us).unwrap_or(u64::MAX),
        p.exit.map(|(_, t)| t),
        p.rank,
    )
}
