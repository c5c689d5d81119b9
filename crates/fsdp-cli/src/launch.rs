//! `fsdp launch`: torchrun's command line; the work is `fsdp::distributed::elastic_launch`.

use clap::Args;
use fsdp::distributed::auth::JOB_SECRET_VAR;
use fsdp::distributed::{elastic_launch, ElasticLaunchConfig, JobSecret};
use std::ffi::OsString;
use std::path::PathBuf;

/// Options of `fsdp launch` (torchrun's names; the underscore spellings work too).
#[derive(Args)]
pub(crate) struct LaunchArgs {
    /// Processes (ranks) to start on this node.
    #[arg(
        long,
        alias = "nproc_per_node",
        allow_hyphen_values = true,
        default_value_t = 1
    )]
    nproc_per_node: usize,
    /// Nodes in the job; run `fsdp launch` on each with its --node-rank.
    #[arg(long, allow_hyphen_values = true, default_value_t = 1)]
    nnodes: usize,
    /// This node's index in 0..nnodes.
    #[arg(
        long,
        alias = "node_rank",
        allow_hyphen_values = true,
        default_value_t = 0
    )]
    node_rank: usize,
    /// Address of node 0, where rank 0 hosts the rendezvous store.
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (default: a free port; required with --nnodes > 1).
    #[arg(long, alias = "master_port")]
    master_port: Option<u16>,
    /// The job id, checked at rendezvous: a rank never joins another job's world (default:
    /// derived from the job secret; give every node the same).
    #[arg(long, alias = "rdzv_id", visible_alias = "job-id", value_name = "ID")]
    rdzv_id: Option<String>,
    /// A file holding the job secret every connection of the job proves (default: the
    /// FSDP_JOB_SECRET variable, else a fresh random one; several nodes must share one).
    #[arg(long, value_name = "FILE")]
    job_secret_file: Option<PathBuf>,
    /// Restart the group of local ranks up to N times after a rank fails, each time at a
    /// fresh rendezvous round (ranks see TORCHELASTIC_RESTART_COUNT); pair with `fsdp
    /// train --resume-if-present` to go on from the last checkpoint.
    #[arg(
        long,
        alias = "max_restarts",
        allow_hyphen_values = true,
        default_value_t = 0,
        value_name = "N"
    )]
    max_restarts: usize,
    /// --timeout and --heartbeat-timeout, handed to every rank as FSDP_TIMEOUT and
    /// FSDP_HEARTBEAT_TIMEOUT.
    #[command(flatten)]
    waits: crate::WaitArgs,
    /// The program to run on every rank and its arguments, after `--` (`fsdp` is this
    /// executable).
    #[arg(last = true, required = true, value_name = "PROGRAM [ARGS]")]
    command: Vec<OsString>,
}

/// Runs `fsdp launch`.
pub(crate) fn run_launch(a: LaunchArgs) -> fsdp::Result<()> {
    let cfg = ElasticLaunchConfig {
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        job_id: a.rdzv_id,
        job_secret: job_secret(a.job_secret_file.as_deref())?,
        max_restarts: a.max_restarts,
        timeout: a.waits.timeout,
        heartbeat_timeout: a.waits.heartbeat_timeout,
    };
    let Some((program, args)) = a.command.split_first() else {
        return Err(fsdp::Error::InvalidArgument(
            "fsdp launch needs a program after `--`".into(),
        ));
    };
    elastic_launch(&cfg, program, args)
}

/// The job secret from `--job-secret-file` (its text, less surrounding white space), else
/// from `FSDP_JOB_SECRET`; never printed.
fn job_secret(file: Option<&std::path::Path>) -> fsdp::Result<Option<JobSecret>> {
    if let Some(f) = file {
        let text = std::fs::read_to_string(f).map_err(|e| {
            fsdp::Error::io(format!("reading --job-secret-file '{}'", f.display()), e)
        })?;
        return JobSecret::new(text.trim()).map(Some);
    }
    match std::env::var(JOB_SECRET_VAR) {
        Ok(k) if !k.is_empty() => JobSecret::new(k).map(Some),
        _ => Ok(None),
    }
}
