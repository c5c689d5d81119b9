//! `fsdp bench`: plain training against FSDP at several world sizes, side by side.

use crate::choice::{choice, help};
use crate::{base_config, ModelArgs, D};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::Args;
use fsdp::choice::Choice;
use fsdp::fsdp::{BackwardPrefetch, ShardingStrategy};
use fsdp::train::{self, Precision, TrainConfig};
use std::path::PathBuf;

/// Options of `fsdp bench`.
#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Where to compute: `cpu`, or `cuda` (rank r on cuda:(r % GPUs)).
    #[arg(long, value_parser = choice::<train::TrainDevice>(), default_value_t = D.device)]
    device: train::TrainDevice,
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
    /// even, else one rank per node; `no-shard-zero1` is no-shard with
    /// --zero-redundancy-optimizer).
    #[arg(
        long,
        value_parser = strategy_parser(),
        value_delimiter = ',',
        default_value = "full-shard"
    )]
    strategies: Vec<BenchStrategy>,
    /// Prefetch settings to run every FSDP configuration with: `on` (BackwardPre and
    /// forward prefetch), `off` (gather each unit on demand).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "on,off")]
    prefetch: Vec<PrefetchMode>,
    /// Compute precision of the FSDP runs.
    #[arg(long, value_parser = choice::<Precision>(), default_value_t = D.mixed_precision)]
    mixed_precision: Precision,
    /// Measure FSDP's host overhead instead: train the compute-free model (width 8, one
    /// head, 4 tokens, one row; --n-layer, --n-embd, --n-head, --seq-len, --global-batch
    /// and --preset are ignored) at world size 1, plainly and under FSDP FullShard (one unit
    /// per block), at each of --overhead-blocks, --repeats times, and print the cost per
    /// unit and the fixed cost per step (least squares of the median step time over the
    /// block counts; also of the 10th-percentile step, less disturbed by other processes)
    /// with their spread over the repeats.
    #[arg(long)]
    overhead: bool,
    /// Block counts of `--overhead`.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32")]
    overhead_blocks: Vec<usize>,
    /// Repeats of `--overhead` (each runs every block count plainly and under FSDP).
    #[arg(long, default_value_t = 7)]
    repeats: usize,
    #[command(flatten)]
    model: ModelArgs,
}

/// `fsdp bench --strategies` values: a sharding strategy, or no-shard with ZeRO-1.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BenchStrategy {
    /// FSDP with this strategy (`--strategy`).
    Fsdp(ShardingStrategy),
    /// `--strategy no-shard --zero-redundancy-optimizer`.
    NoShardZero1,
}

/// The `--strategies` name of [`BenchStrategy::NoShardZero1`].
const NO_SHARD_ZERO1: &str = "no-shard-zero1";

impl BenchStrategy {
    /// The name `--strategies` takes.
    fn name(self) -> &'static str {
        match self {
            BenchStrategy::Fsdp(s) => s.flag_name(),
            BenchStrategy::NoShardZero1 => NO_SHARD_ZERO1,
        }
    }
}

/// Parses `--strategies` values: every [`ShardingStrategy`] name (with its help line), and
/// `no-shard-zero1`.
fn strategy_parser() -> impl TypedValueParser<Value = BenchStrategy> {
    let mut values: Vec<PossibleValue> = ShardingStrategy::ALL
        .iter()
        .map(|s| PossibleValue::new(s.name()).help(help(s.doc())))
        .collect();
    values.push(PossibleValue::new(NO_SHARD_ZERO1).help(
        "no-shard with --zero-redundancy-optimizer (ZeRO-1): optimizer state sharded, parameters whole",
    ));
    PossibleValuesParser::new(values).try_map(|name: String| {
        if name == NO_SHARD_ZERO1 {
            Ok(BenchStrategy::NoShardZero1)
        } else {
            fsdp::choice::parse::<ShardingStrategy>(&name).map(BenchStrategy::Fsdp)
        }
    })
}

/// `fsdp bench --prefetch` values.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PrefetchMode {
    /// backward_prefetch BackwardPre, forward_prefetch on.
    On,
    /// No prefetch: every unit is gathered when it is needed.
    Off,
}

/// The median of `v` (the upper one of an even count; NaN when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Runs `fsdp bench`.
pub(crate) fn run_bench(a: BenchArgs) -> fsdp::Result<()> {
    if a.steps == 0 {
        return Err(fsdp::Error::InvalidArgument(
            "--steps must be at least 1".into(),
        ));
    }
    let mut runs: Vec<(String, TrainConfig)> = Vec::new();
    let base = TrainConfig {
        steps: a.warmup + a.steps,
        eval_every: 0,
        // Every step read at once, so each step's time is its own (see train::pending).
        log_every: 1,
        eval_batches: 1,
        sample_len: 0,
        world_size: 1,
        device: a.device,
        ..base_config(&a.model, a.data.clone())
    };
    if a.overhead {
        let (n_embd, n_head, seq_len, global_batch) = crate::overhead::SHAPE;
        let cfg = TrainConfig {
            mixed_precision: a.mixed_precision,
            n_embd,
            n_head,
            seq_len,
            global_batch,
            ..base
        };
        return crate::overhead::run_overhead(&cfg, &a.overhead_blocks, a.repeats, a.warmup);
    }
    runs.push((
        "plain (no FSDP)".into(),
        TrainConfig {
            no_fsdp: true,
            ..base.clone()
        },
    ));
    for &bench_strategy in &a.strategies {
        let name = bench_strategy.name();
        let (strategy, zero_redundancy_optimizer) = match bench_strategy {
            BenchStrategy::Fsdp(s) => (s, false),
            BenchStrategy::NoShardZero1 => (ShardingStrategy::NoShard, true),
        };
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
                        zero_redundancy_optimizer,
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
        "{:<36} {:>14} {:>10} {:>9} {:>20} {:>17} {:>20} {:>6} {:>16} {:>13}",
        "configuration",
        "median step ms",
        "tokens/s",
        "vs plain",
        "rank-0 p+g+opt bytes",
        "rank-0 opt bytes",
        "peak unsharded bytes",
        "units",
        "activation bytes",
        "comm wait ms"
    );
    let mut plain_ms = f64::NAN;
    let mut counters = Vec::new();
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
            "{:<36} {:>14.1} {:>10.0} {:>9.3} {:>20} {:>17} {:>20} {:>6} {:>16} {:>13.1}",
            name,
            ms,
            (cfg.global_batch * cfg.seq_len) as f64 / (ms / 1e3),
            ms / plain_ms,
            mem.sharded_total(),
            mem.optim_state_bytes,
            mem.peak_unsharded_param_bytes,
            mem.peak_unsharded_units,
            mem.activation_bytes,
            wait_ms
        );
        if cfg.device.is_cuda() {
            let per_step: Vec<_> = report
                .records
                .iter()
                .skip(a.warmup)
                .map(|r| r.counters)
                .collect();
            let med = |f: fn(&fsdp::backend::counters::Counters) -> u64| {
                median(per_step.iter().map(|c| f(c) as f64).collect())
            };
            counters.push(format!(
                "{:<36} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                name,
                med(|c| c.host_syncs),
                med(|c| c.device_allocs),
                med(|c| c.pinned_allocs),
                med(|c| c.allocator_requests),
                med(|c| c.fsdp_buffer_allocs),
                med(|c| c.kernel_launches),
                med(|c| c.store_ops),
                med(|c| c.event_queries)
            ));
        }
    }
    if !counters.is_empty() {
        out!("\nper step after warm-up (median, whole process): what each step asks of the host");
        out!(
            "{:<36} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "configuration",
            "host syncs",
            "dev allocs",
            "pinned",
            "alloc reqs",
            "fsdp bufs",
            "launches",
            "store ops",
            "ev queries"
        );
        for line in counters {
            out!("{line}");
        }
    }
    Ok(())
}
