//! The main job: a byte-level GPT trained on a text file by N in-process ranks under FSDP.

use super::data::{Split, TextDataset, VOCAB_SIZE};
use super::engine::{gather_counts, mean_over_ranks, Engine, RankMemory};
use crate::backend::Device;
use crate::distributed::{launch, Group, LaunchOptions};
use crate::error::{Error, Result};
use crate::fsdp::{
    size_based_auto_wrap_policy, transformer_auto_wrap_policy, BackwardPrefetch, CpuOffload,
    FsdpConfig, FullyShardedDataParallel, ShardingStrategy,
};
use crate::nn::{loss, num_parameters, Context, GptConfig, Module, GPT};
use crate::optim::{self, OptimizerKind};
use crate::tensor::Tensor;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

pub use super::options::{CheckpointType, LrSchedule, Precision, Preset, WrapMode};

/// Everything `fsdp train` takes. `Default` is the CLI's defaults, sized for a 2-core CPU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainConfig {
    /// UTF-8 text file to train on (`--data`); tokens are its bytes, the last 10% held out.
    /// Default `data/tinyshakespeare.txt`.
    pub data: PathBuf,
    /// Number of ranks (`--world-size`), default 4: threads of this process for [`train`];
    /// the job's processes (`WORLD_SIZE`) for [`train_rank`](super::train_rank).
    pub world_size: usize,
    /// FSDP sharding strategy (`--strategy`), default `FullShard`; the hybrid ones are
    /// rejected by [`validate`](Self::validate).
    pub strategy: ShardingStrategy,
    /// How the model is split into FSDP units (`--wrap`), default `Transformer`.
    pub wrap: WrapMode,
    /// Train plainly, without FSDP (world size 1 only): the reference for benches.
    pub no_fsdp: bool,
    /// Optimizer steps to train (`--steps`), at least 1, default 300.
    pub steps: usize,
    /// Rows per step over all ranks; each rank takes `global_batch / world_size` contiguous
    /// rows.
    pub global_batch: usize,
    /// Tokens per row `T` (`--seq-len`), also the GPT's `block_size`; default 64.
    pub seq_len: usize,
    /// Transformer blocks (`--n-layer`), default 4.
    pub n_layer: usize,
    /// Attention heads per block (`--n-head`), must divide `n_embd`; default 4.
    pub n_head: usize,
    /// Model width `C` (`--n-embd`), default 128.
    pub n_embd: usize,
    /// Learning rate, constant over the run (`--lr`), positive; default 2e-3.
    pub lr: f32,
    /// Adam/AdamW `(beta1, beta2)`; default (0.9, 0.95), PyTorch's is (0.9, 0.999).
    pub betas: (f32, f32),
    /// Hybrid strategies: ranks per node (`--ranks-per-node`, default the world size).
    pub ranks_per_node: Option<usize>,
    /// Micro-batches per step (`--grad-accum`): each step's global batch is processed in
    /// this many forward/backward passes whose gradients add up (loss scaled by 1/K).
    pub grad_accum: usize,
    /// Accumulate the micro-batches under `no_sync` (one gradient reduction per step
    /// instead of one per micro-batch).
    pub no_sync: bool,
    /// Clip the global gradient 2-norm to this before each optimizer step
    /// (`--clip-grad-norm`, default 1.0; `None` does not clip).
    pub clip_grad_norm: Option<f32>,
    /// Low-precision compute (`--mixed-precision`), default f32.
    pub mixed_precision: Precision,
    /// Backward prefetch (`--backward-prefetch pre|post|none`), default `BackwardPre`
    /// (PyTorch's default).
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// Forward prefetch (`--forward-prefetch`), default off.
    pub forward_prefetch: bool,
    /// At most two units besides the root unsharded by prefetching
    /// (`--limit-all-gathers`), default on (PyTorch's default).
    pub limit_all_gathers: bool,
    /// Keep parameter and gradient shards in host memory (`--cpu-offload`,
    /// `CpuOffload { offload_params: true }`).
    pub cpu_offload: bool,
    /// Learning-rate schedule over the run.
    pub lr_schedule: LrSchedule,
    /// Linear warm-up steps from `lr / warmup_steps` to `lr` (0: none), capped at `steps`.
    pub warmup_steps: usize,
    /// Optimizer, built with PyTorch's defaults and `lr` (`--optimizer`), default AdamW.
    pub optimizer: OptimizerKind,
    /// Seeds the model init, the batch sampling and the text sample (`--seed`); default
    /// 1337. The same seed gives the same model and batches at every world size.
    pub seed: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Read the loss (and grad norm) to the host every this many steps (`--log-every`),
    /// besides evaluations, checkpoints, the first and the last step; 0: only there. On
    /// CUDA the steps between are read together then (one synchronization; see
    /// `train::pending`), so the host runs ahead of the device; on the CPU every step is
    /// read at once. Default 25.
    pub log_every: usize,
    /// Global batches per evaluation.
    pub eval_batches: usize,
    /// Bytes to generate at the end (0: none).
    pub sample_len: usize,
    /// JSON-lines file that receives one [`StepRecord`] per step (`--metrics`); `None`
    /// (the default) writes none.
    pub metrics: Option<PathBuf>,
    /// Where to compute (`--device`), default the CPU.
    pub device: super::TrainDevice,
    /// Save directory (`--save-dir`): checkpoints go to `step-<N>/` inside, and `latest`
    /// names the newest; `None` saves nothing.
    pub save_dir: Option<PathBuf>,
    /// Save every this many steps (`--save-every`), and after the last step; 0: only after
    /// the last step. Needs `save_dir` when nonzero.
    pub save_every: usize,
    /// Checkpoints kept in `save_dir` (`--keep-last`), at least 1, default 2.
    pub keep_last: usize,
    /// Layout of saved checkpoints (`--checkpoint-type`), default sharded.
    pub checkpoint_type: CheckpointType,
    /// Resume from this checkpoint or save directory (`--resume`): model, optimizer state
    /// and the step, so training continues at the next step with that step's batch, at any
    /// world size and strategy.
    pub resume: Option<PathBuf>,
    /// Start over in a `save_dir` that holds files (`--overwrite`): the checkpoints `fsdp
    /// train` wrote there are deleted before training (other files stay). Without it a
    /// non-empty `save_dir` is refused unless `resume` continues the run saved there.
    pub overwrite: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: PathBuf::from("data/tinyshakespeare.txt"),
            world_size: 4,
            strategy: ShardingStrategy::FullShard,
            wrap: WrapMode::Transformer,
            no_fsdp: false,
            steps: 300,
            global_batch: 64,
            seq_len: 64,
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            lr: 3e-3,
            // beta2 0.95 (nanoGPT's) rather than PyTorch's 0.999, and a 100-step linear
            // warm-up: with the tied output projection the model sits on the unigram plateau
            // (loss ~3.3) for ~100 steps. Chosen by 300-step runs of the default job at seeds
            // 1337, 1, 2: final loss 2.04, 1.98, 2.22 (no warm-up: 2.38, 2.42, 2.37; beta2
            // 0.999 at lr 2e-3: 2.36, 2.55, 2.51; cosine decay without warm-up: 2.61).
            // Gradient clipping at 1.0 (nanoGPT's grad_clip) then gives 1.92, 1.94, 1.92 and
            // removes the loss spikes of the plateau (a 20-step run's last step: 10.99 ->
            // 3.37).
            betas: (0.9, 0.95),
            lr_schedule: LrSchedule::Constant,
            warmup_steps: 100,
            ranks_per_node: None,
            grad_accum: 1,
            no_sync: false,
            clip_grad_norm: Some(1.0),
            mixed_precision: Precision::None,
            backward_prefetch: Some(BackwardPrefetch::BackwardPre),
            forward_prefetch: false,
            limit_all_gathers: true,
            cpu_offload: false,
            optimizer: OptimizerKind::Adamw,
            seed: 1337,
            eval_every: 100,
            log_every: 25,
            eval_batches: 4,
            sample_len: 200,
            metrics: None,
            device: super::TrainDevice::Cpu,
            save_dir: None,
            save_every: 0,
            keep_last: 2,
            checkpoint_type: CheckpointType::Sharded,
            resume: None,
            overwrite: false,
        }
    }
}

/// One training step as seen by rank 0.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepRecord {
    /// Step number, counting from 1.
    pub step: usize,
    /// Mean cross-entropy over the global batch (nats per byte).
    pub loss: f32,
    /// Global tokens processed per second of wall clock in this step.
    pub tokens_per_s: f64,
    /// Step wall time, seconds.
    pub step_time_s: f64,
    /// Global gradient 2-norm before clipping, when `--clip-grad-norm` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f32>,
    /// Eval loss when this step evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f32>,
    /// Every rank's memory figures.
    pub ranks: Vec<RankMemory>,
    /// Host-blocking synchronizations, device allocations, kernel launches and store
    /// requests made by rank 0's process from the start of the step to the global loss
    /// (evaluation and checkpoints excluded); with threads ranks, by all ranks of the
    /// process. All zero on the CPU but for store requests.
    pub counters: crate::backend::counters::Counters,
}

/// What a run produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainReport {
    /// Parameter count of the whole (unsharded) model, elements not bytes.
    pub num_params: usize,
    /// Rank 0's record of every step, in order.
    pub records: Vec<StepRecord>,
    /// Text generated by the trained model.
    pub sample: String,
    /// Rank 0's wall time from the first step to the end of sampling (evaluations
    /// included; data loading and model build excluded), seconds.
    pub elapsed_s: f64,
    /// Every rank's peak parameter bytes while the model was built and wrapped
    /// ([`MemoryStats::init_peak_bytes`](crate::fsdp::MemoryStats::init_peak_bytes); the
    /// whole model's f32 bytes without FSDP).
    pub init_peak_bytes: Vec<usize>,
}

impl TrainReport {
    /// Per-step training losses.
    pub fn losses(&self) -> Vec<f32> {
        self.records.iter().map(|r| r.loss).collect()
    }
    /// `(step, eval loss)` pairs.
    pub fn eval_losses(&self) -> Vec<(usize, f32)> {
        self.records
            .iter()
            .filter_map(|r| r.eval_loss.map(|l| (r.step, l)))
            .collect()
    }
}

/// Receives rank 0's progress (a progress bar, a log).
pub trait Observer: Sync {
    /// Called after every step.
    fn on_step(&self, record: &StepRecord);
    /// Called once before the first step with the model size.
    fn on_start(&self, _num_params: usize) {}
    /// Called after a checkpoint of `step` was saved to `dir`.
    fn on_checkpoint(&self, _step: usize, _dir: &std::path::Path) {}
    /// Called once before the first step when resuming from the checkpoint in `dir`, saved
    /// after `step`.
    fn on_resume(&self, _step: usize, _dir: &std::path::Path) {}
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {
    fn on_step(&self, _: &StepRecord) {}
}

impl TrainConfig {
    /// The GPT shape this config trains.
    pub fn gpt_config(&self) -> GptConfig {
        GptConfig {
            vocab_size: VOCAB_SIZE,
            block_size: self.seq_len,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
        }
    }
}

/// Builds the model of `cfg` and wraps it as `cfg` says, on this rank: under FSDP the model
/// is built on the meta device and only this rank's shards are computed.
pub fn build_engine(cfg: &TrainConfig, pg: Group) -> Result<Engine> {
    let device = cfg.device.for_rank(pg.rank())?;
    if cfg.no_fsdp {
        let mut model: Box<dyn Module> = Box::new(GPT::new(cfg.gpt_config(), cfg.seed)?);
        super::engine::module_to_device(model.as_mut(), device)?;
        return Ok(Engine::Plain(model));
    }
    // Deferred init: the model is built on the meta device (shapes and initializers only)
    // and FSDP computes each rank's shard; no rank ever holds the whole model.
    let model: Box<dyn Module> = Box::new(crate::nn::on_meta_device(|| {
        GPT::new(cfg.gpt_config(), cfg.seed)
    })?);
    let fsdp_cfg = FsdpConfig {
        sharding_strategy: cfg.strategy,
        auto_wrap_policy: match cfg.wrap {
            WrapMode::Transformer => Some(transformer_auto_wrap_policy(["Block"])),
            WrapMode::Size(n) => Some(size_based_auto_wrap_policy(n)),
            WrapMode::None => None,
        },
        // Hybrid without --ranks-per-node: the ranks of this node (LOCAL_WORLD_SIZE under
        // `fsdp launch`; the whole world for thread ranks).
        ranks_per_node: cfg.ranks_per_node.or_else(|| {
            cfg.strategy
                .is_hybrid()
                .then(|| crate::distributed::get_local_world_size().unwrap_or(pg.size()))
        }),
        mixed_precision: cfg.mixed_precision.policy(),
        backward_prefetch: cfg.backward_prefetch,
        forward_prefetch: cfg.forward_prefetch,
        limit_all_gathers: cfg.limit_all_gathers,
        cpu_offload: CpuOffload {
            offload_params: cfg.cpu_offload,
        },
        device_id: Some(device),
        ..FsdpConfig::default()
    };
    Ok(Engine::Fsdp(Box::new(FullyShardedDataParallel::new(
        model, pg, fsdp_cfg,
    )?)))
}

/// Trains as `cfg` says on `cfg.world_size` thread ranks and returns rank 0's report.
///
/// # Errors
/// Bad options or data before any compute; a rank's failure (named) during training.
pub fn train(cfg: &TrainConfig, observer: &dyn Observer) -> Result<TrainReport> {
    cfg.validate()?;
    crate::distributed::check_thread_ranks(cfg.world_size, "--world-size")?;
    let fail = super::fault::FailAt::from_env(cfg.world_size, cfg.steps)?;
    let data = TextDataset::load(&cfg.data, cfg.seq_len)?;
    start_outputs(cfg)?;
    let metrics = match &cfg.metrics {
        Some(p) => Some(super::metrics::open_metrics(
            p,
            super::resume::resumed_step(cfg)?,
        )?),
        None => None,
    };
    let metrics_lock = parking_lot::Mutex::new(metrics);
    let reports = launch(&LaunchOptions::new(cfg.world_size), |pg| {
        let report = run_rank(cfg, &data, pg.clone(), observer, &metrics_lock, fail)?;
        Ok((pg.rank() == 0).then_some(report))
    })?;
    reports
        .into_iter()
        .flatten()
        .next()
        .ok_or_else(|| Error::Fsdp("rank 0 produced no report".into()))
}

/// Once per job, before training (rank 0 of a multi-process job): `--overwrite` clears
/// the save directory's checkpoints.
///
/// # Errors
/// `Io` naming a checkpoint file that could not be removed.
pub(super) fn start_outputs(cfg: &TrainConfig) -> Result<()> {
    match &cfg.save_dir {
        Some(d) if cfg.overwrite => super::save_dir::clear_checkpoints(d),
        _ => Ok(()),
    }
}

/// Token ids `(rows, t)` i32 on `device` (the batch goes to the rank's GPU once).
fn ids_tensor(v: Vec<i32>, rows: usize, t: usize, device: Device) -> Result<Tensor> {
    Tensor::from_vec(v, &[rows, t])?.to_device(device)
}

/// Mean loss over `cfg.eval_batches` global validation batches.
fn evaluate(cfg: &TrainConfig, data: &TextDataset, engine: &mut Engine, pg: &Group) -> Result<f32> {
    let rows = cfg.global_batch / cfg.world_size;
    let r0 = pg.rank() * rows;
    let device = engine.device();
    let mut total = 0.0f32;
    for i in 0..cfg.eval_batches.max(1) {
        let (x, y) = data.batch(Split::Val, cfg.seed, i as u64, r0..r0 + rows, cfg.seq_len);
        let logits = engine
            .module()
            .forward(&ids_tensor(x, rows, cfg.seq_len, device)?, &Context::eval())?;
        let (l, _) = loss::cross_entropy(&logits, &ids_tensor(y, rows, cfg.seq_len, device)?)?;
        total += mean_over_ranks(pg, l)?;
    }
    Ok(total / cfg.eval_batches.max(1) as f32)
}

/// One rank's whole run on `pg`: build, resume, train, evaluate, save, sample. What every
/// rank runs, whether ranks are threads ([`train`]) or processes
/// ([`train_rank`](super::train_rank)); only rank 0 reports to `observer` and `metrics`.
pub(super) fn run_rank(
    cfg: &TrainConfig,
    data: &TextDataset,
    pg: Group,
    observer: &dyn Observer,
    metrics: &parking_lot::Mutex<Option<std::fs::File>>,
    fail: Option<super::fault::FailAt>,
) -> Result<TrainReport> {
    let rank = pg.rank();
    let mut engine = build_engine(cfg, pg.clone())?;
    let device = engine.device();
    let num_params = num_parameters(engine.module());
    let init_peak = match &engine {
        Engine::Fsdp(m) => m.memory_stats().init_peak_bytes,
        Engine::Plain(_) => num_params * 4,
    };
    let init_peak_bytes = gather_counts(&pg, init_peak)?;
    if rank == 0 {
        observer.on_start(num_params);
    }
    let mut opt = optim::build(cfg.optimizer, cfg.lr, cfg.betas);
    // Built before a resume loads the optimizer: its base lr is the run's --lr.
    let mut sched = optim::Scheduler::new(cfg.lr_scheduler(), opt.as_mut())?;
    let (first_step, run_id) = match &cfg.resume {
        Some(dir) => {
            let (step, dir, id) = super::resume::resume(dir, &mut engine, opt.as_mut())?;
            if rank == 0 {
                observer.on_resume(step, &dir);
            }
            (step + 1, id)
        }
        None => (1, None),
    };
    // A resumed run keeps its id, so rotation goes on deleting its older checkpoints.
    let run = super::resume::RunRecord {
        run_id: run_id.unwrap_or_else(super::save_dir::new_run_id),
        data: super::resume::data_record(&cfg.data, data),
    };
    let t = cfg.seq_len;
    let start = Instant::now();
    let mut records = Vec::with_capacity(cfg.steps.min(1 << 16));
    let mut pending = super::pending::Pending::new(device)?;
    for step in first_step..=cfg.steps {
        let (c0, l) = pending.begin()?;
        sched.set_epoch(opt.as_mut(), step - 1)?;
        engine.reset_peak();
        // Micro-batch k is rows [k B/K, (k+1) B/K) of the global batch; each rank takes its
        // contiguous share of every micro-batch.
        let k_total = cfg.grad_accum;
        let micro = cfg.global_batch / k_total;
        let micro_rows = micro / cfg.world_size;
        for k in 0..k_total {
            let lo = k * micro + rank * micro_rows;
            let (x, y) = data.batch(Split::Train, cfg.seed, step as u64, lo..lo + micro_rows, t);
            let cx = Context::train();
            let logits = engine
                .module()
                .forward(&ids_tensor(x, micro_rows, t, device)?, &cx)?;
            // The loss stays where it was computed; `pending` reads it when it flushes.
            let (lk, dlogits) =
                loss::cross_entropy_tensor(&logits, &ids_tensor(y, micro_rows, t, device)?)?;
            drop(logits);
            if let Some(f) = fail {
                f.check(rank, step)?; // test-only (FSDP_FAIL_RANK)
            }
            crate::ops::add_div_(&l, &lk, k_total as f32)?;
            if k_total > 1 {
                crate::ops::scale_(&dlogits, 1.0 / k_total as f32)?;
            }
            engine.backward(&dlogits, cfg.no_sync && k + 1 < k_total)?;
        }
        if let Some(c) = cfg.clip_grad_norm {
            pending.set_grad_norm(&engine.clip_grad_norm_tensor(c)?)?;
        }
        opt.step(&engine.optimizer_params())?;
        let mem = engine.memory(rank, opt.as_ref());
        engine.zero_grad();
        let evaluates = (cfg.eval_every > 0 && step % cfg.eval_every == 0) || step == cfg.steps;
        let logged = cfg.log_every > 0 && step % cfg.log_every == 0;
        let due = logged || evaluates || step == first_step || super::resume::save_due(cfg, step);
        if pending.end(step, mem, c0, cfg.clip_grad_norm.is_some(), due) {
            for f in pending.flush(&pg)? {
                let eval_loss = if f.step == step && evaluates {
                    Some(evaluate(cfg, data, &mut engine, &pg)?)
                } else {
                    None
                };
                if rank == 0 {
                    let rec = StepRecord {
                        step: f.step,
                        loss: f.loss,
                        tokens_per_s: (cfg.global_batch * t) as f64 / f.step_time_s,
                        grad_norm: f.grad_norm,
                        step_time_s: f.step_time_s,
                        eval_loss,
                        ranks: f.ranks,
                        counters: f.counters,
                    };
                    if let Some(file) = metrics.lock().as_mut() {
                        let line =
                            serde_json::to_string(&rec).map_err(|e| Error::Data(e.to_string()))?;
                        writeln!(file, "{line}").map_err(|e| Error::io("writing metrics", e))?;
                    }
                    observer.on_step(&rec);
                    records.push(rec);
                }
            }
        }
        if let Some(dir) = super::resume::save_if_due(cfg, step, &mut engine, opt.as_ref(), &run)? {
            if rank == 0 {
                observer.on_checkpoint(step, &dir);
            }
        }
    }
    let sample = if cfg.sample_len > 0 {
        super::sample::generate(&mut engine, b"\n", cfg.sample_len, t, cfg.seed, 0.8)?
    } else {
        String::new()
    };
    Ok(TrainReport {
        num_params,
        records,
        sample,
        elapsed_s: start.elapsed().as_secs_f64(),
        init_peak_bytes,
    })
}
