//! `fsdp launch`: starts one process per rank with torchrun's environment and watches them
//! (`torch/distributed/run.py`, `torch/distributed/launcher/api.py`,
//! `torch/distributed/elastic/multiprocessing/`; static rendezvous, restarts of the whole
//! group).
//!
//! Each child gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`
//! (the node rank), `ROLE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_ERROR_FILE`,
//! `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS`, the job id (torchrun's
//! `TORCHELASTIC_RUN_ID`; `FSDP_JOB_ID` is the id of the rendezvous round, see below) and
//! the job secret (`FSDP_JOB_SECRET`, see [Note: job auth] in [`auth`](super::auth)), and
//! shares the launcher's stdout and stderr (nothing is prefixed). When a child exits non-zero
//! the others get a short grace period to exit on their own (they usually fail too, naming
//! the first), then are killed, and [`elastic_launch`] returns an error naming the root
//! cause: the failed rank, its exit status and its error, and the ranks that failed with the
//! same error, as torchrun's `ChildFailedError` summary does; other ranks' own errors are
//! printed before it, one line each (`[rank 2] error: ...`).
//!
//! Restarts (`--max-restarts N`, torchrun's): after a failure the group of local ranks is
//! stopped as above and started again, up to N times, with `TORCHELASTIC_RESTART_COUNT`
//! counting the restarts. Every round meets at a fresh rendezvous: the ranks of round `n > 0`
//! prove the job id `<id>:restart-<n>` (same secret), so a rank left from an earlier round
//! is refused by this round's store. With several nodes every node's launcher restarts on
//! its own ranks' failure (the ranks of the other nodes fail too, their peers gone), and the
//! nodes meet again at the store of the new round's rank 0, as long as every node counts the
//! same rounds.
//!
//! Only the direct children are stopped (`SIGKILL`), not processes they started in turn;
//! they stay in the launcher's process group, so a Ctrl-C in the terminal reaches them all.
//! A launcher killed outright (`SIGKILL`) takes its children with it on Linux
//! (`PR_SET_PDEATHSIG`, set in each child before exec): no rank outlives it.
//!
//! A child that is a Rust program using this crate reports its error with [`record_error`]
//! (torch's `@record`): the launcher reads it from `TORCHELASTIC_ERROR_FILE`, and prefers a
//! rank's own error over peers that only echo its failure (`PeerFailed`). Children see
//! `FSDP_LAUNCHER_REPORTS_ERRORS=1` ([`launcher_reports_errors`]): `fsdp` ranks then leave
//! the printing of a recorded error to the launcher, so that N ranks failing alike give one
//! line, not N interleaved ones.

use super::auth::{JobSecret, JOB_ID_VAR, JOB_SECRET_VAR, RUN_ID_VAR};
use super::failures::{root_cause, stop, summarize, Proc};
use crate::error::{Error, Result};
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The variable naming the file where a child records its error (torchrun's name).
pub const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// How many times `fsdp launch` restarted the group before this round (torchrun's name);
/// 0 in the first.
pub const RESTART_COUNT_VAR: &str = "TORCHELASTIC_RESTART_COUNT";

/// `--max-restarts` (torchrun's name).
pub const MAX_RESTARTS_VAR: &str = "TORCHELASTIC_MAX_RESTARTS";

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
    /// How many times the group of local ranks may be restarted after a rank failed
    /// (`--max-restarts`, torchrun's name); 0: a failure ends the job.
    pub max_restarts: usize,
    /// The collective and rendezvous timeout every rank gets (`--timeout`), handed over as
    /// [`TIMEOUT_VAR`](super::TIMEOUT_VAR); `None`: the ranks' own default.
    pub timeout: Option<Duration>,
    /// The heartbeat timeout every rank gets (`--heartbeat-timeout`), handed over as
    /// [`HEARTBEAT_TIMEOUT_VAR`](super::HEARTBEAT_TIMEOUT_VAR); `None`: the ranks' default.
    pub heartbeat_timeout: Option<Duration>,
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
            max_restarts: 0,
            timeout: None,
            heartbeat_timeout: None,
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
            // The id of the last round must be a valid id too.
            super::auth::check_job_id(&round_id(id, self.max_restarts)).map_err(|_| {
                Error::InvalidArgument(format!(
                    "--rdzv-id '{id}' is too long for --max-restarts {}: the ranks of a restart prove '{}'; use a shorter id",
                    self.max_restarts,
                    round_id(id, self.max_restarts)
                ))
            })?;
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

/// Starts `nproc_per_node` processes running `program args` with torchrun's environment
/// and waits for all of them (torch's `elastic_launch`). When one fails, the others are
/// stopped and, while `cfg.max_restarts` allows, the whole group starts again at a fresh
/// rendezvous round (see the module doc), one line on stderr saying so.
///
/// # Errors
/// `InvalidArgument` for bad options; `Io` when a child cannot be started (the others are
/// killed); `PeerFailed` naming the root-cause rank, its exit status and its recorded error
/// when a child exits non-zero (the others are then stopped) and no restart is left: the
/// last round's failure; `Io` (`Interrupted`) when SIGINT or SIGTERM stopped the job.
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
    let program = resolve_program(program);
    let mut restart = 0;
    let res = loop {
        let job = Job {
            id: &job_id,
            secret: &secret,
            port,
            restart,
        };
        match run(cfg, &job, &dir, &program, args) {
            Err(Ended::Failed(e)) if restart < cfg.max_restarts => {
                restart += 1;
                let line = format!(
                    "fsdp launch: {e}; restarting the {} local rank{} (restart {restart} of {}, rendezvous round {restart})\n",
                    cfg.nproc_per_node,
                    if cfg.nproc_per_node == 1 { "" } else { "s" },
                    cfg.max_restarts
                );
                // One write: the line cannot interleave with a child's output.
                eprint!("{line}");
            }
            Err(Ended::Failed(e)) if restart > 0 => {
                break Err(after_restarts(e, restart));
            }
            Err(Ended::Failed(e) | Ended::Stopped(e)) => break Err(e),
            Ok(()) => break Ok(()),
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    res
}

/// What every round of one launch shares, and the round.
struct Job<'a> {
    /// The job id (`--rdzv-id` or derived from the secret), the same in every round.
    id: &'a str,
    secret: &'a JobSecret,
    port: u16,
    /// How many times the group was restarted before this round (`TORCHELASTIC_RESTART_COUNT`).
    restart: usize,
}

impl Job<'_> {
    /// The id the ranks of this round prove at rendezvous: the job id, then `:restart-<n>`
    /// from the first restart on, so that a rank of an earlier round (on a node that has
    /// not restarted yet) never joins this round's world.
    fn round_id(&self) -> String {
        round_id(self.id, self.restart)
    }
}

/// The rendezvous id of round `restart` of job `id` (see [`Job::round_id`]).
fn round_id(id: &str, restart: usize) -> String {
    match restart {
        0 => id.to_string(),
        n => format!("{id}:restart-{n}"),
    }
}

/// The last failure, saying how many restarts came before it.
fn after_restarts(e: Error, restarts: usize) -> Error {
    match e {
        Error::PeerFailed {
            failed_rank,
            reason,
        } => Error::PeerFailed {
            failed_rank,
            reason: format!(
                "{reason} (after {restarts} restart{}, --max-restarts {restarts})",
                if restarts == 1 { "" } else { "s" }
            ),
        },
        e => e,
    }
}

/// Why a round did not end well.
enum Ended {
    /// A rank failed (or could not be started): a restart may follow.
    Failed(Error),
    /// SIGINT or SIGTERM stopped the job: no restart.
    Stopped(Error),
}

/// One round: starts the local ranks and waits for them (see [`elastic_launch`]).
fn run(
    cfg: &ElasticLaunchConfig,
    job: &Job,
    dir: &Path,
    program: &OsStr,
    args: &[OsString],
) -> std::result::Result<(), Ended> {
    let world = cfg.world_size();
    let round_id = job.round_id();
    let mut procs: Vec<Proc> = Vec::with_capacity(cfg.nproc_per_node);
    for local_rank in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local_rank;
        let error_file = dir.join(format!("error-rank-{rank}.json"));
        // A failure recorded in an earlier round is not this round's.
        let _ = std::fs::remove_file(&error_file);
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", job.port.to_string())
            .env(RESTART_COUNT_VAR, job.restart.to_string())
            .env(MAX_RESTARTS_VAR, cfg.max_restarts.to_string())
            .env(ERROR_FILE_VAR, &error_file)
            .env(REPORTS_ERRORS_VAR, "1")
            .env(JOB_ID_VAR, &round_id)
            .env(RUN_ID_VAR, job.id)
            .env(JOB_SECRET_VAR, job.secret.expose())
            .stdin(Stdio::null());
        // A rank's own command line (`fsdp train --timeout`) still wins over these.
        for (var, value) in [
            (super::TIMEOUT_VAR, cfg.timeout),
            (super::HEARTBEAT_TIMEOUT_VAR, cfg.heartbeat_timeout),
        ] {
            if let Some(d) = value {
                cmd.env(var, d.as_secs_f64().to_string());
            }
        }
        super::signals::die_with_launcher(&mut cmd);
        match cmd.spawn() {
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
                return Err(Ended::Failed(Error::io(
                    format!(
                        "fsdp launch: starting '{}' for rank {rank}",
                        Path::new(program).display()
                    ),
                    e,
                )));
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
        return Err(Ended::Stopped(Error::io(
            "fsdp launch",
            std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                format!(
                    "received {}: passed it on to every rank and stopped the job",
                    super::signals::name(sig)
                ),
            ),
        )));
    }
    match root_cause(&procs) {
        None => Ok(()),
        Some(p) => Err(Ended::Failed(summarize(&procs, p))),
    }
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
        .then_some(super::failures::RENDEZVOUS_STAGE);
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
