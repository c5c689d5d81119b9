//! `fsdp`: the command line. `fsdp train` runs the main job; `fsdp bench` measures FSDP
//! against plain training side by side; `fsdp launch` starts one process per rank, as
//! torchrun; `fsdp plot` draws metrics files. Only parsing, printing and drawing live
//! here; the work is the library's.

use clap::{Args, Parser, Subcommand};
use fsdp::fsdp::{BackwardPrefetch, ShardingStrategy};
use fsdp::optim::OptimizerKind;
use fsdp::train::RankEnv;
use fsdp::train::{self, CheckpointType, LrSchedule, Precision, TrainConfig, WrapMode};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

// Training allocates and frees activation buffers of the same sizes every step; mimalloc
// keeps them instead of returning them to the OS (page faults were ~5% of a CPU step).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `println!` that ignores a closed pipe or a full disk instead of panicking
/// (`fsdp train | head` must not end in a backtrace).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

mod bench;
mod choice;
mod launch;
mod overhead;
mod plot;
mod progress;

use bench::{run_bench, BenchArgs};
use choice::choice;
use launch::{run_launch, LaunchArgs};
use plot::{run_plot, PlotArgs};
use progress::Progress;

/// The defaults of every option are the library's (`TrainConfig::default()`).
pub(crate) static D: std::sync::LazyLock<TrainConfig> =
    std::sync::LazyLock::new(TrainConfig::default);

#[derive(Parser)]
#[command(
    name = "fsdp",
    version,
    about = "Fully sharded data-parallel training (PyTorch FSDP semantics) in Rust"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a byte-level GPT on a text file across in-process ranks (or as one rank of a
    /// job started by `fsdp launch` or torchrun).
    Train(TrainArgs),
    /// Step time and per-rank memory: plain training vs FSDP at world sizes 1, 2, 4.
    Bench(BenchArgs),
    /// Start one process per rank with torchrun's environment (`fsdp launch
    /// --nproc-per-node 2 -- fsdp train ...`).
    Launch(LaunchArgs),
    /// Draw loss, eval loss and tokens/s against step for one or several runs' `--metrics`
    /// files into an SVG (`fsdp plot a.jsonl b.jsonl --out runs.svg`).
    Plot(PlotArgs),
}

#[derive(Args, Clone)]
pub(crate) struct ModelArgs {
    /// A named model shape instead of --n-layer, --n-embd, --n-head and --seq-len.
    #[arg(
        long,
        value_parser = choice::<train::Preset>(),
        conflicts_with_all = ["seq_len", "n_layer", "n_head", "n_embd"]
    )]
    preset: Option<train::Preset>,
    /// Sequence length T (tokens per row).
    #[arg(long, allow_hyphen_values = true, default_value_t = D.seq_len)]
    seq_len: usize,
    #[arg(long, allow_hyphen_values = true, default_value_t = D.n_layer)]
    n_layer: usize,
    #[arg(long, allow_hyphen_values = true, default_value_t = D.n_head)]
    n_head: usize,
    #[arg(long, allow_hyphen_values = true, default_value_t = D.n_embd)]
    n_embd: usize,
    /// Rows per step over all ranks (split evenly, contiguous rows per rank).
    #[arg(long, allow_hyphen_values = true, default_value_t = D.global_batch)]
    global_batch: usize,
    #[arg(long, default_value_t = D.lr, allow_hyphen_values = true)]
    lr: f32,
    /// Adam/AdamW beta1.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.betas.0)]
    beta1: f32,
    /// Adam/AdamW beta2.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.betas.1)]
    beta2: f32,
    /// Learning-rate schedule after the warm-up.
    #[arg(long, value_parser = choice::<LrSchedule>(), default_value_t = D.lr_schedule)]
    lr_schedule: LrSchedule,
    /// Linear learning-rate warm-up steps (capped at --steps).
    #[arg(long, allow_hyphen_values = true, default_value_t = D.warmup_steps)]
    warmup_steps: usize,
    #[arg(long, value_parser = choice::<OptimizerKind>(), default_value_t = D.optimizer)]
    optimizer: OptimizerKind,
    #[arg(long, allow_hyphen_values = true, default_value_t = D.seed)]
    seed: u64,
}

/// `--backward-prefetch` values.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackwardPrefetchArg {
    /// BACKWARD_PRE: gather the next unit before computing the current one's gradients.
    Pre,
    /// BACKWARD_POST: gather the next unit after computing the current one's gradients.
    Post,
    /// Gather each unit when its backward starts.
    None,
}

impl BackwardPrefetchArg {
    fn policy(self) -> Option<BackwardPrefetch> {
        match self {
            BackwardPrefetchArg::Pre => Some(BackwardPrefetch::BackwardPre),
            BackwardPrefetchArg::Post => Some(BackwardPrefetch::BackwardPost),
            BackwardPrefetchArg::None => None,
        }
    }
}

/// FSDP options of `fsdp train` (the constructor's, as PyTorch names them).
#[derive(Args, Clone)]
struct FsdpArgs {
    /// Compute in bf16 or f16 over f32 master shards (MixedPrecision with param, reduce and
    /// buffer dtype all set), f32 throughout, or f64 throughout (an exact reference; CPU).
    #[arg(long, value_parser = choice::<Precision>(), default_value_t = D.mixed_precision)]
    mixed_precision: Precision,
    /// Train f16 without loss scaling. Under --mixed-precision f16 a grad scaler
    /// (ShardedGradScaler) scales the loss so that small gradients do not underflow, and
    /// skips the steps whose gradients overflow.
    #[arg(long, conflicts_with = "grad_scaler")]
    no_grad_scaler: bool,
    /// Ask for the grad scaler (the default under f16); with bf16, f32 or f64 it is a
    /// warning and the run trains unscaled.
    #[arg(long)]
    grad_scaler: bool,
    /// The grad scaler's first loss scale (a resumed run goes on with its checkpoint's).
    #[arg(long, allow_hyphen_values = true, default_value_t = D.init_scale)]
    init_scale: f32,
    /// Steps without inf/NaN gradients before the grad scaler doubles the loss scale.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.growth_interval)]
    growth_interval: u32,
    /// When backward all-gathers the next unit.
    #[arg(long, value_enum, default_value_t = BackwardPrefetchArg::Pre)]
    backward_prefetch: BackwardPrefetchArg,
    /// All-gather the next unit (previous iteration's order) during the current forward.
    #[arg(long)]
    forward_prefetch: bool,
    /// Prefetch only while fewer than two units besides the root are unsharded
    /// (`--limit-all-gathers false` to turn off).
    #[arg(long, default_value_t = D.limit_all_gathers, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    limit_all_gathers: bool,
    /// Keep parameter and gradient shards in host memory; the optimizer steps there
    /// (CpuOffload(offload_params=True)).
    #[arg(long)]
    cpu_offload: bool,
    /// ZeRO-1 with --strategy no-shard: each rank keeps and steps the optimizer state of
    /// its 1/W of the parameters, gradients are reduce-scattered into that chunk and the
    /// parameters all-gathered after each step (ZeroRedundancyOptimizer). Same numbers as
    /// no-shard.
    #[arg(long)]
    zero_redundancy_optimizer: bool,
    /// Checkpoint every transformer Block: keep only its input through the forward and
    /// recompute its forward in backward (apply_activation_checkpointing with
    /// checkpoint_wrapper). Same numbers, fewer saved activations, one more forward.
    #[arg(long)]
    activation_checkpointing: bool,
}

#[derive(Args)]
struct TrainArgs {
    /// Where to compute: `cpu`, or `cuda` (needs a build with `--features cuda`, a driver
    /// and a GPU).
    #[arg(long, value_parser = choice::<fsdp::train::TrainDevice>(), default_value_t = D.device)]
    device: fsdp::train::TrainDevice,
    /// UTF-8 text file; tokens are its bytes, the last 10% held out for eval.
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: PathBuf,
    /// Number of ranks: threads of this process (default 4), or, when a launcher set
    /// RANK, WORLD_SIZE and MASTER_ADDR (fsdp launch, torchrun), the job's processes, this
    /// process being one of them (default WORLD_SIZE; a different value is an error).
    #[arg(long, allow_hyphen_values = true)]
    world_size: Option<usize>,
    #[arg(long, value_parser = choice::<ShardingStrategy>(), default_value_t = D.strategy)]
    strategy: ShardingStrategy,
    /// FSDP units: `transformer` (one per Block, plus the root), `size:N` (size-based
    /// policy, min N parameters per unit) or `none` (one unit for the whole model).
    #[arg(long, default_value_t = D.wrap)]
    wrap: WrapMode,
    #[arg(long, allow_hyphen_values = true, default_value_t = D.steps)]
    steps: usize,
    /// Evaluate every E steps (and at the end); 0: only at the end.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.eval_every)]
    eval_every: usize,
    /// Print the loss every K steps (0: never). On CUDA the loss is read from the device
    /// only on these steps (and at evaluations, checkpoints, the first and last step): the
    /// steps between are read, and written to --metrics, together then.
    #[arg(long, allow_hyphen_values = true, default_value_t = 25)]
    log_every: usize,
    /// Write one JSON object per step (loss, tokens/s, per-rank bytes) to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// At the end, draw loss, eval loss and tokens/s against step into this SVG file (the
    /// whole --metrics file when given, so a resumed run shows its earlier steps too).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Hybrid strategies: ranks per node (shard group size); default the world size.
    #[arg(long, allow_hyphen_values = true)]
    ranks_per_node: Option<usize>,
    /// Micro-batches per step; their gradients add up before the optimizer step.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.grad_accum)]
    grad_accum: usize,
    /// Accumulate micro-batches under no_sync: one gradient reduction per step.
    #[arg(long)]
    no_sync: bool,
    /// Capture the training step as a CUDA graph after two eager steps and replay it
    /// (--device cuda; world size 1, or one process per rank under `fsdp launch`; an lr
    /// schedule with adam/adamw only; no grad scaler, no --cpu-offload, no --save-dir).
    #[arg(long)]
    cuda_graphs: bool,
    /// Clip the global gradient 2-norm to this value before each step; 0 turns clipping
    /// off.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.clip_grad_norm.unwrap_or(0.0))]
    clip_grad_norm: f32,
    /// Bytes of text to generate from the trained model at the end.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.sample_len)]
    sample_len: usize,
    /// Save checkpoints (model, optimizer, step) to DIR/step-N/ and point DIR/latest at
    /// the newest; a crash during a save leaves the previous one intact.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Save every N steps (and after the last step); 0: only after the last step.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.save_every)]
    save_every: usize,
    /// Save in the background (torch.distributed.checkpoint.async_save): training goes on
    /// once the shards are copied to host memory; a checkpoint becomes latest at the next
    /// save or at the end. Needs --save-dir.
    #[arg(long)]
    async_save: bool,
    /// Checkpoints to keep in --save-dir.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.keep_last)]
    keep_last: usize,
    /// Checkpoint layout: one file per rank (sharded) or one file by rank 0 (full).
    #[arg(long, value_parser = choice::<CheckpointType>(), default_value_t = D.checkpoint_type)]
    checkpoint_type: CheckpointType,
    /// Continue from a checkpoint directory or a --save-dir (its latest), at any
    /// --world-size and --strategy; pass the run's other options unchanged.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Resume from --save-dir's latest checkpoint when it holds one, else start at step 1:
    /// one command line for the first start and every restart of `fsdp launch
    /// --max-restarts`. --metrics then keeps the steps up to the checkpoint's.
    #[arg(long, conflicts_with = "resume")]
    resume_if_present: bool,
    /// Start over in a --save-dir that holds another run's checkpoints: delete the
    /// checkpoints fsdp wrote there first (other files are kept).
    #[arg(long)]
    overwrite: bool,
    #[command(flatten)]
    waits: WaitArgs,
    #[command(flatten)]
    fsdp: FsdpArgs,
    #[command(flatten)]
    model: ModelArgs,
}

/// How long ranks wait for each other: options of `fsdp train` and `fsdp launch`.
#[derive(Args, Clone, Default)]
pub(crate) struct WaitArgs {
    /// Seconds the ranks wait for each other at the rendezvous and in each collective
    /// before failing with an error naming the missing ranks (init_process_group's timeout;
    /// default 300, or FSDP_TIMEOUT; PyTorch's default is 1800, 600 for NCCL).
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true, value_parser = seconds)]
    pub(crate) timeout: Option<std::time::Duration>,
    /// Seconds a rank process may send no heartbeat before the other ranks name it failed
    /// (stopped with SIGSTOP, or hung); default 60, or FSDP_HEARTBEAT_TIMEOUT; at least 0.5.
    /// Ranks that are threads of one process have none.
    #[arg(long, value_name = "SECONDS", allow_hyphen_values = true, value_parser = heartbeat_seconds)]
    pub(crate) heartbeat_timeout: Option<std::time::Duration>,
}

/// A positive number of seconds (`--timeout 2.5`), as the library parses `FSDP_TIMEOUT`.
fn seconds(text: &str) -> Result<std::time::Duration, String> {
    fsdp::distributed::parse_seconds(text)
}

/// `--heartbeat-timeout`: [`seconds`], at least the library's least.
fn heartbeat_seconds(text: &str) -> Result<std::time::Duration, String> {
    let least = fsdp::distributed::MIN_HEARTBEAT_TIMEOUT;
    match seconds(text)? {
        d if d < least => Err(format!(
            "is below the least, {} seconds (a beat goes out every fifth of it)",
            least.as_secs_f64()
        )),
        d => Ok(d),
    }
}

pub(crate) fn base_config(m: &ModelArgs, data: PathBuf) -> TrainConfig {
    let (n_layer, n_embd, n_head, seq_len) = m.preset.map_or(
        (m.n_layer, m.n_embd, m.n_head, m.seq_len),
        train::Preset::shape,
    );
    TrainConfig {
        data,
        seq_len,
        n_layer,
        n_head,
        n_embd,
        global_batch: m.global_batch,
        lr: m.lr,
        betas: (m.beta1, m.beta2),
        lr_schedule: m.lr_schedule,
        warmup_steps: m.warmup_steps,
        optimizer: m.optimizer,
        seed: m.seed,
        ..TrainConfig::default()
    }
}

/// What `--resume` or `--resume-if-present` resumes from: `--save-dir` itself (its
/// `latest`) when it names a checkpoint, else nothing.
///
/// # Errors
/// `InvalidArgument` for `--resume-if-present` without `--save-dir`.
fn resume_from(a: &TrainArgs) -> fsdp::Result<Option<PathBuf>> {
    if !a.resume_if_present {
        return Ok(a.resume.clone());
    }
    let Some(dir) = &a.save_dir else {
        return Err(fsdp::Error::InvalidArgument(
            "--resume-if-present needs --save-dir (where to look for the checkpoint to resume)"
                .into(),
        ));
    };
    Ok(dir
        .join(fsdp::checkpoint::LATEST_FILE)
        .exists()
        .then(|| dir.clone()))
}

fn run_train(a: TrainArgs) -> fsdp::Result<()> {
    // Under a launcher this process is one rank of the job.
    let env = RankEnv::from_env()?;
    let world_size = match (a.world_size, env) {
        (Some(w), Some(e)) if w != e.world_size => {
            return Err(fsdp::Error::InvalidArgument(format!(
                "--world-size {w} differs from WORLD_SIZE={} set by the launcher; drop --world-size or make them agree",
                e.world_size
            )))
        }
        (Some(w), _) => w,
        (None, Some(e)) => e.world_size,
        (None, None) => D.world_size,
    };
    let resume = resume_from(&a)?;
    let cfg = TrainConfig {
        world_size,
        strategy: a.strategy,
        wrap: a.wrap,
        steps: a.steps,
        eval_every: a.eval_every,
        log_every: a.log_every,
        metrics: a.metrics.clone(),
        sample_len: a.sample_len,
        ranks_per_node: a.ranks_per_node,
        grad_accum: a.grad_accum,
        no_sync: a.no_sync,
        cuda_graphs: a.cuda_graphs,
        clip_grad_norm: (a.clip_grad_norm != 0.0).then_some(a.clip_grad_norm),
        mixed_precision: a.fsdp.mixed_precision,
        grad_scaler: match (a.fsdp.grad_scaler, a.fsdp.no_grad_scaler) {
            (_, true) => Some(false),
            (true, _) => Some(true),
            _ => None,
        },
        init_scale: a.fsdp.init_scale,
        growth_interval: a.fsdp.growth_interval,
        backward_prefetch: a.fsdp.backward_prefetch.policy(),
        forward_prefetch: a.fsdp.forward_prefetch,
        limit_all_gathers: a.fsdp.limit_all_gathers,
        cpu_offload: a.fsdp.cpu_offload,
        zero_redundancy_optimizer: a.fsdp.zero_redundancy_optimizer,
        activation_checkpointing: a.fsdp.activation_checkpointing,
        device: a.device,
        save_dir: a.save_dir.clone(),
        save_every: a.save_every,
        async_save: a.async_save,
        keep_last: a.keep_last,
        checkpoint_type: a.checkpoint_type,
        resume,
        overwrite: a.overwrite,
        timeout: a.waits.timeout,
        heartbeat_timeout: a.waits.heartbeat_timeout,
        ..base_config(&a.model, a.data.clone())
    };
    cfg.validate()?;
    if let Some(p) = &a.plot {
        // Refused before training, not after it.
        plot::check_out(p)?;
        if a.metrics.as_deref() == Some(p.as_path()) {
            return Err(fsdp::Error::InvalidArgument(format!(
                "--plot '{}' is also the --metrics file; give them different names",
                p.display()
            )));
        }
    }
    let fresh = a.resume_if_present && cfg.resume.is_none();
    if let Some(e) = env.filter(|e| e.rank != 0) {
        // Rank 0 prints and logs for the job; the other ranks train silently.
        return train::train_rank(&cfg, &e, &train::Silent).map(drop);
    }
    out!(
        "fsdp train: {} ranks ({}) on {}, strategy {:?}{}, wrap {}, precision {:?}{}, {} steps of {} x {} tokens, data {}",
        cfg.world_size,
        match (env.is_some(), cfg.device) {
            (true, train::TrainDevice::Cuda) => "processes, nccl backend",
            (true, _) => "processes, tcp backend",
            _ => "threads backend",
        },
        cfg.device,
        cfg.strategy,
        if cfg.strategy.is_hybrid() {
            let n = cfg.ranks_per_node.unwrap_or(cfg.world_size);
            format!(" ({n} rank{} per node)", if n == 1 { "" } else { "s" })
        } else if cfg.zero_redundancy_optimizer {
            " + ZeroRedundancyOptimizer (ZeRO-1)".to_string()
        } else {
            String::new()
        },
        cfg.wrap,
        cfg.mixed_precision,
        if cfg.uses_grad_scaler() {
            " with a grad scaler"
        } else {
            ""
        },
        cfg.steps,
        cfg.global_batch,
        cfg.seq_len,
        cfg.data.display()
    );
    if let (true, Some(d)) = (fresh, &cfg.save_dir) {
        out!(
            "--resume-if-present: no checkpoint in {} yet, starting at step 1",
            d.display()
        );
    }
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new(cfg.steps as u64);
        b.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    });
    let progress = Progress {
        bar,
        log_every: a.log_every,
        steps: cfg.steps,
    };
    let report = match &env {
        Some(e) => match train::train_rank(&cfg, e, &progress)? {
            Some(r) => r,
            None => return Ok(()),
        },
        None => train::train(&cfg, &progress)?,
    };
    if let Some(b) = &progress.bar {
        b.finish_and_clear();
    }
    let losses = report.losses();
    let last = report.records.last();
    let mean_tps = report.records.iter().map(|r| r.tokens_per_s).sum::<f64>()
        / report.records.len().max(1) as f64;
    out!(
        "done in {:.1} s: loss {:.4} -> {:.4}, eval loss {}, {:.0} tokens/s",
        report.elapsed_s,
        losses.first().copied().unwrap_or(f32::NAN),
        losses.last().copied().unwrap_or(f32::NAN),
        report
            .eval_losses()
            .last()
            .map_or("-".into(), |(_, l)| format!("{l:.4}")),
        mean_tps
    );
    if let (Some(first), Some(last)) = (
        report.records.first().and_then(|r| r.loss_scale),
        report.records.last().and_then(|r| r.loss_scale),
    ) {
        let skipped = report.records.iter().filter(|r| r.skipped).count();
        out!(
            "grad scaler: {skipped} of {} steps skipped (inf/NaN gradients), loss scale {} at the first step, {} at the last",
            report.records.len(),
            progress::scale_text(first),
            progress::scale_text(last)
        );
    }
    out!(
        "init ({}): peak parameter bytes per rank {:?}",
        cfg.init_description(),
        report.init_peak_bytes
    );
    if let Some(r) = last {
        out!("last step, per rank: params + grads + optimizer state bytes | peak unsharded param bytes (units) | saved activation bytes | comm wait ms:");
        for m in &r.ranks {
            out!(
                "  rank {}: {} + {} + {} = {} | {} ({}) | {} | {:.1}",
                m.rank,
                m.param_shard_bytes,
                m.grad_shard_bytes,
                m.optim_state_bytes,
                m.sharded_total(),
                m.peak_unsharded_param_bytes,
                m.peak_unsharded_units,
                m.activation_bytes,
                m.comm_wait_us as f64 / 1e3
            );
        }
    }
    for line in train::gpu_summary(&cfg, &report) {
        out!("{line}");
    }
    if !report.sample.is_empty() {
        out!("--- sample ---\n{}\n--------------", report.sample);
    }
    if let Some(p) = &a.plot {
        let run = match &cfg.metrics {
            Some(m) => plot::read_run(m, "train".into())?,
            None => plot::Run {
                label: "train".into(),
                points: report
                    .records
                    .iter()
                    .map(|r| plot::Point {
                        step: r.step as u64,
                        loss: r.loss as f64,
                        tokens_per_s: r.tokens_per_s,
                        eval_loss: r.eval_loss.map(f64::from),
                    })
                    .collect(),
            },
        };
        plot::write_svg(p, &[run])?;
        out!("plot: {}", p.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                // `fsdp` alone: the usage page, but as the error it is.
                let _ = e.print();
                return ExitCode::from(2);
            }
            // One line naming the problem (clap's first line), not a usage page.
            let text = e.to_string();
            let mut lines = text.lines();
            let mut first = lines.next().unwrap_or("invalid arguments").to_string();
            if first.ends_with(':') {
                // "the following required arguments were not provided:" lists them below.
                let listed: Vec<&str> = lines
                    .take_while(|l| !l.trim().is_empty())
                    .map(str::trim)
                    .collect();
                first = format!("{first} {}", listed.join(", "));
            }
            let values = match e.get(clap::error::ContextKind::ValidValue) {
                Some(clap::error::ContextValue::Strings(v)) if !v.is_empty() => {
                    format!(" (possible values: {})", v.join(", "))
                }
                _ => String::new(),
            };
            // Under fsdp launch the launcher reports it (one line for ranks failing alike).
            let line = format!("{first}{values}");
            let recorded = fsdp::distributed::record_message(
                line.strip_prefix("error: ").unwrap_or(&line),
                None,
            );
            report(&line, recorded);
            return ExitCode::from(2);
        }
    };
    let (res, who) = match cli.cmd {
        Cmd::Train(a) => (run_train(a), ""),
        Cmd::Bench(a) => (run_bench(a), ""),
        Cmd::Launch(a) => (run_launch(a), LAUNCHER),
        Cmd::Plot(a) => (run_plot(a), ""),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = e.to_string();
            if who == LAUNCHER {
                // Library errors that already say where they come from keep one prefix.
                let who = if msg.starts_with(who) { "" } else { who };
                write_line(&format!("error: {who}{msg}"));
                return ExitCode::FAILURE;
            }
            // Under fsdp launch or torchrun, the launcher reads it (torch's @record).
            let recorded = fsdp::distributed::record_error(&e);
            report(&format!("error: {msg}"), recorded);
            ExitCode::FAILURE
        }
    }
}

/// What `fsdp launch` prefixes its errors with.
const LAUNCHER: &str = "fsdp launch: ";

/// Prints a rank's failure `line` on stderr, prefixed with its rank under a launcher
/// (`[rank 1] error: ...`); nothing when `fsdp launch` reports the `recorded` error itself
/// (one line for ranks that fail alike).
fn report(line: &str, recorded: bool) {
    if recorded && fsdp::distributed::launcher_reports_errors() {
        return;
    }
    let rank = std::env::var("RANK").ok().filter(|r| !r.trim().is_empty());
    match rank {
        Some(r) if std::env::var_os("WORLD_SIZE").is_some() => {
            write_line(&format!("[rank {}] {line}", r.trim()))
        }
        _ => write_line(line),
    }
}

/// `line` and a newline on stderr in one write, so that the lines of processes sharing
/// stderr (the ranks of a launch) never interleave; write errors are ignored, as `err!`.
fn write_line(line: &str) {
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}
