//! `fsdp launch`: starts one process per rank with torchrun's environment and watches them
//! (`torch/distributed/run.py`, `torch/distributed/launcher/api.py`,
//! `torch/distributed/elastic/multiprocessing/`; static rendezvous, no restarts).
//!
//! Each child gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`
//! (the node rank), `ROLE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_ERROR_FILE`,
//! the job id (`FSDP_JOB_ID`, also as torchrun's `TORCHELASTIC_RUN_ID`) and the job secret
//! (`FSDP_JOB_SECRET`, see [Note: job auth] in [`auth`](super::auth)), and shares the
//! launcher's stdout and stderr (nothing is prefixed). When a child exits non-zero the others
//! get a short grace period to exit on their own (they usually fail too, naming the first),
//! then are killed, and [`elastic_launch`] returns an error naming the root cause: the failed
//! rank, its exit status and its error, and the ranks that failed with the same error, as
//! torchrun's `ChildFailedError` summary does; other ranks' own errors are printed before it,
//! one line each (`[rank 2] error: ...`).
//!
//! Only the direct children are stopped (`SIGKILL`), not processes they started in turn;
//! they stay in the launcher's process group, so a Ctrl-C in the terminal reaches them all.
//!
//! A child that is a Rust program using this crate reports its error with [`record_error`]
//! (torch's `@record`): the launcher reads it from `TORCHELASTIC_ERROR_FILE`, and prefers a
//! rank's own error over peers that only echo its failure (`PeerFailed`). Children see
//! `FSDP_LAUNCHER_REPORTS_ERRORS=1` ([`launcher_reports_errors`]): `fsdp` ranks then leave
//! the printing of a recorded error to the launcher, so that N ranks failing alike give one
//! line, not N interleaved ones.

use super::auth::{JobSecret, JOB_ID_VAR, JOB_SECRET_VAR, RUN_ID_VAR};
use crate::error::{Error, Result};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The variable naming the file where a child records its error (torchrun's name).
pub const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// Set to `1` by `fsdp launch` for its children: the launcher prints the errors they
/// record (see [`launcher_reports_errors`]).
pub const REPORTS_ERRORS_VAR: &str = "FSDP_LAUNCHER_REPORTS_ERRORS";

/// How long the other children may take to exit on their own after one failed, before they
/// are killed: long enough for peers to notice the failure in their next collective.
const GRACE: Duration = Duration::from_secs(2);

/// How often the launcher looks at its children.
const POLL: Duration = Duration::from_millis(10);

/// What [`elastic_launch`] runs: torchrun's static-rendezvous options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticLaunchConfig {
    /// Processes (ranks) on this node (`--nproc-per-node`), at least 1.
    pub nproc_per_node: usize,
    /// Nodes in the job (`--nnodes`), at least 1; every node runs `fsdp launch`.
    pub nnodes: usize,
    /// This node's index (`--node-rank`), `0..nnodes`; its ranks are
    /// `node_rank * nproc_per_node ..`.
    pub node_rank: usize,
    /// Where rank 0 hosts the rendezvous store (`--master-addr`), default `127.0.0.1`.
    pub master_addr: String,
    /// The store's port (`--master-port`); `None` or 0 picks a free one (one node only).
    pub master_port: Option<u16>,
    /// The job id (`--rdzv-id`), checked at rendezvous: a rank never joins another job's
    /// world. `None`: derived from the job secret (so random on one node, and the same on
    /// every node that shares the secret).
    pub job_id: Option<String>,
    /// The job secret every connection of the rendezvous proves (`FSDP_JOB_SECRET` or
    /// `--job-secret-file`). `None`: a fresh random one, on one node; several nodes must
    /// share one, so there it is required.
    pub job_secret: Option<JobSecret>,
}

impl Default for ElasticLaunchConfig {
    fn default() -> Self {
        ElasticLaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            job_id: None,
            job_secret: None,
        }
    }
}

impl ElasticLaunchConfig {
    /// Checks the options.
    ///
    /// # Errors
    /// `InvalidArgument` naming the option.
    pub fn validate(&self) -> Result<()> {
        if self.nproc_per_node == 0 {
            crate::error::bail_arg!("--nproc-per-node must be at least 1");
        }
        if self.nnodes == 0 {
            crate::error::bail_arg!("--nnodes must be at least 1");
        }
        if self.node_rank >= self.nnodes {
            crate::error::bail_arg!(
                "--node-rank {} must be below --nnodes {}",
                self.node_rank,
                self.nnodes
            );
        }
        if self.master_addr.trim().is_empty() {
            crate::error::bail_arg!("--master-addr must not be empty");
        }
        if self.nnodes > 1 && self.master_port.unwrap_or(0) == 0 {
            crate::error::bail_arg!(
                "--nnodes {} needs --master-port (and --master-addr, node 0's address): every node must name the same store",
                self.nnodes
            );
        }
        if self.nnodes > 1 && self.job_secret.is_none() {
            crate::error::bail_arg!(
                "--nnodes {} needs a job secret shared by every node: set {JOB_SECRET_VAR} to the same random text (at least {} characters) on each node, or pass --job-secret-file",
                self.nnodes,
                super::auth::MIN_SECRET_LEN
            );
        }
        if let Some(id) = &self.job_id {
            if id.is_empty() {
                crate::error::bail_arg!("--rdzv-id must not be empty");
            }
            super::auth::check_job_id(id)?;
        }
        Ok(())
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }
}

/// A port free on `addr` right now (the OS picks it).
///
/// # Errors
/// `Io` when nothing can be bound on `addr`.
pub fn free_port(addr: &str) -> Result<u16> {
    let l = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| Error::io(format!("fsdp launch: finding a free port on {addr}"), e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("fsdp launch: reading a port", e))
}

/// `program` as the command to spawn: `fsdp` itself is this executable, so that
/// `fsdp launch -- fsdp train ...` works without `fsdp` on `PATH`.
fn resolve_program(program: &OsStr) -> OsString {
    if program == "fsdp" {
        if let Ok(me) = std::env::current_exe() {
            return me.into_os_string();
        }
    }
    program.to_os_string()
}

/// One started child.
struct Proc {
    rank: usize,
    local_rank: usize,
    child: Child,
    error_file: PathBuf,
    /// Its exit status and when it was seen, once it exited.
    exit: Option<(ExitStatus, Instant)>,
    killed: bool,
}

/// What a failed child recorded with [`record_error`].
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
    /// reaching the store), see [`note_rendezvous`].
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
const RENDEZVOUS_STAGE: &str = "rendezvous";

/// Whether this process is joining its world now (see [`note_rendezvous`]).
static IN_RENDEZVOUS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks the start (`true`) and the successful end (`false`) of this process's rendezvous
/// (`init_process_group`): an error recorded in between ([`record_error`]) says that the
/// rank failed while joining, and the launcher then takes rank 0's failure (it hosts the
/// store every rank meets through: a port in use, an address not of its machine) as the
/// root cause of the other ranks' rendezvous errors (refused by another job's store,
/// timed out), whichever was seen first.
pub fn note_rendezvous(in_progress: bool) {
    IN_RENDEZVOUS.store(in_progress, std::sync::atomic::Ordering::Relaxed);
}

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

/// Starts `nproc_per_node` processes running `program args` with torchrun's environment
/// and waits for all of them (torch's `elastic_launch`).
///
/// # Errors
/// `InvalidArgument` for bad options; `Io` when a child cannot be started (the others are
/// killed); `PeerFailed` naming the root-cause rank, its exit status and its recorded error
/// when a child exits non-zero (the others are then stopped).
pub fn elastic_launch(cfg: &ElasticLaunchConfig, program: &OsStr, args: &[OsString]) -> Result<()> {
    cfg.validate()?;
    // Before any child exists, so no signal can end the launcher and leave ranks behind.
    super::signals::catch_int_term();
    // Port 0 means "any free port", as when none is given (validate refused it for
    // several nodes, which must agree on one).
    let port = match cfg.master_port {
        Some(p) if p != 0 => p,
        _ => free_port(&cfg.master_addr)?,
    };
    let dir = std::env::temp_dir().join(format!(
        "fsdp-launch-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("fsdp launch: creating '{}'", dir.display()), e))?;
    let secret = match &cfg.job_secret {
        Some(k) => k.clone(),
        None => JobSecret::generate()?,
    };
    let job_id = cfg
        .job_id
        .clone()
        .unwrap_or_else(|| secret.derived_job_id());
    let job = (job_id.as_str(), &secret);
    let res = run(cfg, port, job, &dir, &resolve_program(program), args);
    let _ = std::fs::remove_dir_all(&dir);
    res
}

fn run(
    cfg: &ElasticLaunchConfig,
    port: u16,
    (job_id, secret): (&str, &JobSecret),
    dir: &Path,
    program: &OsStr,
    args: &[OsString],
) -> Result<()> {
    let world = cfg.world_size();
    let mut procs: Vec<Proc> = Vec::with_capacity(cfg.nproc_per_node);
    for local_rank in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local_rank;
        let error_file = dir.join(format!("error-rank-{rank}.json"));
        let spawned = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(ERROR_FILE_VAR, &error_file)
            .env(REPORTS_ERRORS_VAR, "1")
            .env(JOB_ID_VAR, job_id)
            .env(RUN_ID_VAR, job_id)
            .env(JOB_SECRET_VAR, secret.expose())
            .stdin(Stdio::null())
            .spawn();
        match spawned {
            Ok(child) => procs.push(Proc {
                rank,
                local_rank,
                child,
                error_file,
                exit: None,
                killed: false,
            }),
            Err(e) => {
                stop(&mut procs);
                return Err(Error::io(
                    format!(
                        "fsdp launch: starting '{}' for rank {rank}",
                        Path::new(program).display()
                    ),
                    e,
                ));
            }
        }
    }
    let mut grace_end: Option<Instant> = None;
    let mut forwarded: Option<i32> = None;
    loop {
        if let (Some(sig), None) = (super::signals::caught(), forwarded) {
            // Pass SIGINT/SIGTERM on to every rank still running, then give them the grace
            // period before they are killed (torchrun does the same).
            for p in procs.iter().filter(|p| p.exit.is_none()) {
                super::signals::send(p.child.id(), sig);
            }
            forwarded = Some(sig);
            grace_end = Some(Instant::now() + GRACE);
        }
        for p in procs.iter_mut().filter(|p| p.exit.is_none()) {
            if let Ok(Some(st)) = p.child.try_wait() {
                p.exit = Some((st, Instant::now()));
                if !st.success() && grace_end.is_none() {
                    grace_end = Some(Instant::now() + GRACE);
                }
            }
        }
        if procs.iter().all(|p| p.exit.is_some()) {
            break;
        }
        if grace_end.is_some_and(|g| Instant::now() >= g) {
            stop(&mut procs);
            break;
        }
        std::thread::sleep(POLL);
    }
    if let Some(sig) = forwarded {
        return Err(Error::io(
            "fsdp launch",
            std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                format!(
                    "received {}: passed it on to every rank and stopped the job",
                    super::signals::name(sig)
                ),
            ),
        ));
    }
    match root_cause(&procs) {
        None => Ok(()),
        Some(p) => Err(summarize(&procs, p)),
    }
}

/// The error naming the root cause `p`; first prints, one line each, the own errors of
/// other ranks that differ from it (`[rank 2] error: ...`). Ranks that recorded `p`'s very
/// error are named once; echoes of a peer's failure, silent and killed ranks are counted
/// as stopped.
fn summarize(procs: &[Proc], p: &Proc) -> Error {
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
fn stop(procs: &mut [Proc]) {
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
fn root_cause(procs: &[Proc]) -> Option<&Proc> {
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

/// Whether this process was started by `fsdp launch`, which prints the errors its
/// children record with [`record_error`] (one line for ranks that fail alike): a child whose
/// error was recorded need not print it.
pub fn launcher_reports_errors() -> bool {
    std::env::var_os(ERROR_FILE_VAR).is_some()
        && std::env::var(REPORTS_ERRORS_VAR).is_ok_and(|v| v == "1")
}

/// Records `err` where the launcher reads it (`TORCHELASTIC_ERROR_FILE`), if this process
/// was started by one (torch's `@record`); does nothing otherwise. Best effort: whether it
/// was recorded.
pub fn record_error(err: &Error) -> bool {
    let peer_failed = match err {
        Error::PeerFailed { failed_rank, .. } => Some(*failed_rank),
        _ => None,
    };
    record_message(&err.to_string(), peer_failed)
}

/// Records `message` as [`record_error`] does, for a failure that is not an [`Error`]
/// (arguments that do not parse); `peer_failed` names the rank it only echoes, if any.
pub fn record_message(message: &str, peer_failed: Option<usize>) -> bool {
    let Some(path) = std::env::var_os(ERROR_FILE_VAR) else {
        return false;
    };
    let rank = std::env::var("RANK").ok();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let stage = IN_RENDEZVOUS
        .load(std::sync::atomic::Ordering::Relaxed)
        .then_some(RENDEZVOUS_STAGE);
    // torchrun reads `message` (a string) and `timestamp` (seconds) from this file too.
    let body = serde_json::json!({
        "message": message,
        "timestamp": now.as_secs(),
        "timestamp_us": u64::try_from(now.as_micros()).unwrap_or(u64::MAX),
        "peer_failed": peer_failed,
        "rank": rank,
        "stage": stage,
    });
    std::fs::write(path, body.to_string()).is_ok()
}
