//! `fsdp train` as one rank of a multi-process job: when torchrun's variables are set
//! (`fsdp launch`, torchrun, Slurm-style wrappers), this process joins the world with
//! `init_process_group` (backend `tcp` on the CPU) and runs the same per-rank loop as the
//! thread ranks of [`train`](super::train), so the losses are the same bit for bit.

use super::config::TrainConfig;
use super::data::TextDataset;
use super::job::{run_rank, Observer, TrainReport};
use super::TrainDevice;
use crate::distributed::{
    abort_process_group, destroy_process_group, init_process_group, InitOptions,
};
use crate::error::Result;

/// This process's place in a multi-process job, from torchrun's variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankEnv {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_RANK` (default the rank).
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE` (default the world size).
    pub local_world_size: usize,
}

impl RankEnv {
    /// `Some` when `RANK`, `WORLD_SIZE` and `MASTER_ADDR` are all set: this process is one
    /// rank of a job a launcher started. `None` when any is missing (ranks are threads).
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable when one is set to a bad value or
    /// `MASTER_PORT` is missing (as `init_process_group` would report).
    pub fn from_env() -> Result<Option<RankEnv>> {
        let set = |v: &str| std::env::var_os(v).is_some_and(|x| !x.is_empty());
        if !(set("RANK") && set("WORLD_SIZE") && set("MASTER_ADDR")) {
            return Ok(None);
        }
        let rv = InitOptions::new("tcp").resolve()?;
        Ok(Some(RankEnv {
            rank: rv.rank,
            world_size: rv.world_size,
            local_rank: rv.local_rank.unwrap_or(rv.rank),
            local_world_size: rv.local_world_size.unwrap_or(rv.world_size),
        }))
    }
}

/// Trains as `cfg` says as rank `env.rank` of a job of `env.world_size` processes: joins
/// the world through `MASTER_ADDR:MASTER_PORT` (backend `tcp` for `--device cpu`), runs
/// the per-rank loop of [`train`](super::train), and returns the report on rank 0 (`None`
/// on the others). Only rank 0 calls `observer` and writes `--metrics`; checkpoints are
/// written as by thread ranks (each rank its shard files, rank 0 the index).
///
/// # Errors
/// `InvalidArgument` when `cfg.world_size` differs from `WORLD_SIZE`; bad options or data
/// before joining; the rendezvous' errors; this rank's failure, or a peer's (named). On an
/// error this rank aborts its group first, so its peers fail at once naming it.
pub fn train_rank(
    cfg: &TrainConfig,
    env: &RankEnv,
    observer: &dyn Observer,
) -> Result<Option<TrainReport>> {
    if cfg.world_size != env.world_size {
        crate::error::bail_arg!(
            "--world-size {} differs from WORLD_SIZE={} set by the launcher; drop --world-size or make them agree",
            cfg.world_size,
            env.world_size
        );
    }
    cfg.validate()?;
    let fail = super::fault::FailAt::from_env(cfg.world_size, cfg.steps)?;
    let data = TextDataset::load(&cfg.data, cfg.seq_len)?;
    if env.rank == 0 {
        super::job::start_outputs(cfg)?;
    }
    let backend = match cfg.device {
        TrainDevice::Cpu => "tcp",
        TrainDevice::Cuda => "nccl",
    };
    // A failure while joining is recorded as such: `fsdp launch` then blames rank 0's
    // (the store's host) before the other ranks' rendezvous errors that follow from it.
    crate::distributed::elastic::note_rendezvous(true);
    let pg = init_process_group(InitOptions {
        timeout: cfg.timeout,
        heartbeat_timeout: cfg.heartbeat_timeout,
        ..InitOptions::new(backend)
    })?;
    crate::distributed::elastic::note_rendezvous(false);
    let res = (|| {
        // As the thread launcher does: ranks on one machine share its cores.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        crate::backend::cpu::gemm::set_num_threads((cores / env.local_world_size).max(1));
        let metrics = match (&cfg.metrics, pg.rank()) {
            (Some(p), 0) => Some(super::metrics::open_metrics(
                p,
                super::resume::resumed_step(cfg)?,
            )?),
            _ => None,
        };
        let metrics = parking_lot::Mutex::new(metrics);
        run_rank(cfg, &data, pg.clone(), observer, &metrics, fail)
    })();
    match res {
        Ok(report) => {
            destroy_process_group()?;
            Ok((pg.rank() == 0).then_some(report))
        }
        Err(e) => {
            abort_process_group(&e.to_string());
            Err(e)
        }
    }
}
