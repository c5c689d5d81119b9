//! `fsdp`: the command line. `fsdp train` runs the main job; `fsdp bench` measures FSDP
//! against plain training side by side.

use clap::{Args, Parser, Subcommand};
use fsdp::fsdp::{BackwardPrefetch, ShardingStrategy};
use fsdp::optim::OptimizerKind;
use fsdp::train::{
    self, CheckpointType, LrSchedule, Observer, Precision, StepRecord, TrainConfig, WrapMode,
};
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

/// `eprintln!` that ignores write errors, like `out!`.
macro_rules! err {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// The defaults of every option are the library's (`TrainConfig::default()`).
static D: std::sync::LazyLock<TrainConfig> = std::sync::LazyLock::new(TrainConfig::default);

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
    /// Train a byte-level GPT on a text file across in-process ranks.
    Train(TrainArgs),
    /// Step time and per-rank memory: plain training vs FSDP at world sizes 1, 2, 4.
    Bench(BenchArgs),
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A named model shape instead of --n-layer, --n-embd, --n-head and --seq-len.
    #[arg(long, value_enum, conflicts_with_all = ["seq_len", "n_layer", "n_head", "n_embd"])]
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
    #[arg(long, value_enum, default_value_t = D.lr_schedule)]
    lr_schedule: LrSchedule,
    /// Linear learning-rate warm-up steps (capped at --steps).
    #[arg(long, allow_hyphen_values = true, default_value_t = D.warmup_steps)]
    warmup_steps: usize,
    #[arg(long, value_enum, default_value_t = D.optimizer)]
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
    /// buffer dtype all set), or f32 throughout.
    #[arg(long, value_enum, default_value_t = D.mixed_precision)]
    mixed_precision: Precision,
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
}

#[derive(Args)]
struct TrainArgs {
    /// Where to compute: `cpu`, or `cuda` (needs a build with `--features cuda`, a driver
    /// and a GPU).
    #[arg(long, value_enum, default_value_t = D.device)]
    device: fsdp::train::TrainDevice,
    /// UTF-8 text file; tokens are its bytes, the last 10% held out for eval.
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: PathBuf,
    /// Number of ranks (threads of this process).
    #[arg(long, allow_hyphen_values = true, default_value_t = D.world_size)]
    world_size: usize,
    #[arg(long, value_enum, default_value_t = D.strategy)]
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
    /// Print the loss every K steps.
    #[arg(long, allow_hyphen_values = true, default_value_t = 25)]
    log_every: usize,
    /// Write one JSON object per step (loss, tokens/s, per-rank bytes) to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Hybrid strategies: ranks per node (shard group size); default the world size.
    #[arg(long, allow_hyphen_values = true)]
    ranks_per_node: Option<usize>,
    /// Micro-batches per step; their gradients add up before the optimizer step.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.grad_accum)]
    grad_accum: usize,
    /// Accumulate micro-batches under no_sync: one gradient reduction per step.
    #[arg(long)]
    no_sync: bool,
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
    /// Checkpoints to keep in --save-dir.
    #[arg(long, allow_hyphen_values = true, default_value_t = D.keep_last)]
    keep_last: usize,
    /// Checkpoint layout: one file per rank (sharded) or one file by rank 0 (full).
    #[arg(long, value_enum, default_value_t = D.checkpoint_type)]
    checkpoint_type: CheckpointType,
    /// Continue from a checkpoint directory or a --save-dir (its latest), at any
    /// --world-size and --strategy; pass the run's other options unchanged.
    #[arg(long)]
    resume: Option<PathBuf>,
    #[command(flatten)]
    fsdp: FsdpArgs,
    #[command(flatten)]
    model: ModelArgs,
}

#[derive(Args)]
struct BenchArgs {
    /// Where to compute: `cpu`, or `cuda` (rank r on cuda:(r % GPUs)).
    #[arg(long, value_enum, default_value_t = D.device)]
    device: fsdp::train::TrainDevice,
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: PathBuf,
    /// Timed steps per configuration (after the warm-up).
    #[arg(long, allow_hyphen_values = true, default_value_t = 20)]
    steps: usize,
    /// Untimed warm-up steps per configuration.
    #[arg(long, allow_hyphen_values = true, default_value_t = 3)]
    warmup: usize,
    /// World sizes to run FSDP at.
    #[arg(
        long,
        allow_hyphen_values = true,
        value_delimiter = ',',
        default_value = "1,2,4"
    )]
    world_sizes: Vec<usize>,
    /// Strategies to run at each world size (hybrid ones as 2 nodes when the world size is
    /// even, else one rank per node).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "full-shard")]
    strategies: Vec<ShardingStrategy>,
    /// Prefetch settings to run every FSDP configuration with: `on` (BackwardPre and
    /// forward prefetch), `off` (gather each unit on demand).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "on,off")]
    prefetch: Vec<PrefetchMode>,
    /// Compute precision of the FSDP runs.
    #[arg(long, value_enum, default_value_t = D.mixed_precision)]
    mixed_precision: Precision,
    #[command(flatten)]
    model: ModelArgs,
}

/// `fsdp bench --prefetch` values.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PrefetchMode {
    /// backward_prefetch BackwardPre, forward_prefetch on.
    On,
    /// No prefetch: every unit is gathered when it is needed.
    Off,
}

fn base_config(m: &ModelArgs, data: PathBuf) -> TrainConfig {
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

/// Progress bar on a terminal, plain log lines otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    log_every: usize,
    steps: usize,
}

impl Progress {
    fn say(&self, line: String) {
        match &self.bar {
            Some(b) => b.println(line),
            None => out!("{line}"),
        }
    }
}

impl Observer for Progress {
    fn on_start(&self, num_params: usize) {
        self.say(format!("model: {num_params} parameters"));
    }
    fn on_resume(&self, step: usize, dir: &std::path::Path) {
        self.say(format!(
            "resumed from {} (after step {step})",
            dir.display()
        ));
    }
    fn on_checkpoint(&self, step: usize, dir: &std::path::Path) {
        self.say(format!(
            "step {step:>5} | saved checkpoint {}",
            dir.display()
        ));
    }
    fn on_step(&self, r: &StepRecord) {
        if let Some(b) = &self.bar {
            b.set_position(r.step as u64);
            b.set_message(format!("loss {:.4} | {:.0} tok/s", r.loss, r.tokens_per_s));
        }
        if self.log_every > 0
            && (r.step % self.log_every == 0 || r.step == 1 || r.step == self.steps)
        {
            self.say(format!(
                "step {:>5} | loss {:.4} | {:.0} tok/s",
                r.step, r.loss, r.tokens_per_s
            ));
        }
        if let Some(e) = r.eval_loss {
            self.say(format!("step {:>5} | eval loss {e:.4}", r.step));
        }
    }
}

fn run_train(a: TrainArgs) -> fsdp::Result<()> {
    let cfg = TrainConfig {
        world_size: a.world_size,
        strategy: a.strategy,
        wrap: a.wrap,
        steps: a.steps,
        eval_every: a.eval_every,
        metrics: a.metrics.clone(),
        sample_len: a.sample_len,
        ranks_per_node: a.ranks_per_node,
        grad_accum: a.grad_accum,
        no_sync: a.no_sync,
        clip_grad_norm: (a.clip_grad_norm != 0.0).then_some(a.clip_grad_norm),
        mixed_precision: a.fsdp.mixed_precision,
        backward_prefetch: a.fsdp.backward_prefetch.policy(),
        forward_prefetch: a.fsdp.forward_prefetch,
        limit_all_gathers: a.fsdp.limit_all_gathers,
        cpu_offload: a.fsdp.cpu_offload,
        device: a.device,
        save_dir: a.save_dir.clone(),
        save_every: a.save_every,
        keep_last: a.keep_last,
        checkpoint_type: a.checkpoint_type,
        resume: a.resume.clone(),
        ..base_config(&a.model, a.data.clone())
    };
    cfg.validate()?;
    out!(
        "fsdp train: {} ranks (threads backend) on {}, strategy {:?}{}, wrap {}, precision {:?}, {} steps of {} x {} tokens, data {}",
        cfg.world_size,
        cfg.device,
        cfg.strategy,
        if cfg.strategy.is_hybrid() {
            let n = cfg.ranks_per_node.unwrap_or(cfg.world_size);
            format!(" ({n} rank{} per node)", if n == 1 { "" } else { "s" })
        } else {
            String::new()
        },
        cfg.wrap,
        cfg.mixed_precision,
        cfg.steps,
        cfg.global_batch,
        cfg.seq_len,
        cfg.data.display()
    );
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
    let report = train::train(&cfg, &progress)?;
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
    out!(
        "init (deferred, on the meta device): peak parameter bytes per rank {:?}",
        report.init_peak_bytes
    );
    if let Some(r) = last {
        out!("last step, per rank: params + grads + optimizer state bytes | peak unsharded param bytes (units) | comm wait ms:");
        for m in &r.ranks {
            out!(
                "  rank {}: {} + {} + {} = {} | {} ({}) | {:.1}",
                m.rank,
                m.param_shard_bytes,
                m.grad_shard_bytes,
                m.optim_state_bytes,
                m.sharded_total(),
                m.peak_unsharded_param_bytes,
                m.peak_unsharded_units,
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
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn run_bench(a: BenchArgs) -> fsdp::Result<()> {
    let mut runs: Vec<(String, TrainConfig)> = Vec::new();
    let base = TrainConfig {
        steps: a.warmup + a.steps,
        eval_every: 0,
        eval_batches: 1,
        sample_len: 0,
        world_size: 1,
        device: a.device,
        ..base_config(&a.model, a.data.clone())
    };
    runs.push((
        "plain (no FSDP)".into(),
        TrainConfig {
            no_fsdp: true,
            ..base.clone()
        },
    ));
    for &strategy in &a.strategies {
        let name = clap::ValueEnum::to_possible_value(&strategy)
            .map_or(String::new(), |v| v.get_name().to_string());
        for &w in &a.world_sizes {
            let ranks_per_node = strategy
                .is_hybrid()
                .then_some(if w % 2 == 0 { w / 2 } else { 1 });
            for &p in &a.prefetch {
                let on = p == PrefetchMode::On;
                runs.push((
                    format!("{name} ws={w} prefetch {}", if on { "on" } else { "off" }),
                    TrainConfig {
                        world_size: w,
                        strategy,
                        ranks_per_node,
                        mixed_precision: a.mixed_precision,
                        backward_prefetch: on.then_some(BackwardPrefetch::BackwardPre),
                        forward_prefetch: on,
                        ..base.clone()
                    },
                ));
            }
        }
    }
    if a.steps == 0 {
        return Err(fsdp::Error::InvalidArgument(
            "--steps must be at least 1".into(),
        ));
    }
    if a.world_sizes.is_empty() || a.world_sizes.contains(&0) {
        return Err(fsdp::Error::InvalidArgument(format!(
            "--world-sizes must list positive world sizes, got {:?}",
            a.world_sizes
        )));
    }
    for (_, cfg) in &runs {
        cfg.validate().map_err(|e| match e {
            fsdp::Error::InvalidArgument(m) => fsdp::Error::InvalidArgument(format!(
                "{m} (fsdp bench runs --world-sizes {:?})",
                a.world_sizes
            )),
            e => e,
        })?;
    }
    out!(
        "{:<36} {:>14} {:>10} {:>9} {:>20} {:>20} {:>6} {:>13}",
        "configuration",
        "median step ms",
        "tokens/s",
        "vs plain",
        "rank-0 p+g+opt bytes",
        "peak unsharded bytes",
        "units",
        "comm wait ms"
    );
    let mut plain_ms = f64::NAN;
    for (name, cfg) in runs {
        let report = train::train(&cfg, &train::Silent)?;
        let ms = median(
            report
                .records
                .iter()
                .skip(a.warmup)
                .map(|r| r.step_time_s * 1e3)
                .collect(),
        );
        if cfg.no_fsdp {
            plain_ms = ms;
        }
        let mem = report
            .records
            .last()
            .map(|r| r.ranks[0])
            .unwrap_or_default();
        let wait_ms = median(
            report
                .records
                .iter()
                .skip(a.warmup)
                .map(|r| r.ranks[0].comm_wait_us as f64 / 1e3)
                .collect(),
        );
        out!(
            "{:<36} {:>14.1} {:>10.0} {:>9.3} {:>20} {:>20} {:>6} {:>13.1}",
            name,
            ms,
            (cfg.global_batch * cfg.seq_len) as f64 / (ms / 1e3),
            ms / plain_ms,
            mem.sharded_total(),
            mem.peak_unsharded_param_bytes,
            mem.peak_unsharded_units,
            wait_ms
        );
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
            let first = text.lines().next().unwrap_or("invalid arguments");
            let values = match e.get(clap::error::ContextKind::ValidValue) {
                Some(clap::error::ContextValue::Strings(v)) => {
                    format!(" (possible values: {})", v.join(", "))
                }
                _ => String::new(),
            };
            err!("{first}{values}");
            return ExitCode::from(2);
        }
    };
    let res = match cli.cmd {
        Cmd::Train(a) => run_train(a),
        Cmd::Bench(a) => run_bench(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            err!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
