//! [`TrainConfig::validate`]: every option of `fsdp train` checked before any thread
//! starts, the most specific problem first (a missing file before the options that use
//! it).

use super::config::TrainConfig;
use super::data::TextDataset;
use super::options::Precision;
use crate::error::{Error, Result};
use crate::fsdp::ShardingStrategy;

impl TrainConfig {
    /// Checks every option before any thread starts.
    ///
    /// The order: the device, then the files (`--data` readable and long enough for
    /// `--seq-len`, the `--resume` checkpoint present), then each option alone and the
    /// options together, then the memory estimate, then the checkpoint against the run.
    ///
    /// # Errors
    /// The device's error when `--device` is unusable ([`super::TrainDevice::check`]);
    /// `Data` naming the data file when it is missing or unusable; `Checkpoint` naming the
    /// `--resume` path when it holds no checkpoint; `InvalidArgument` naming the first bad
    /// option.
    pub fn validate(&self) -> Result<()> {
        self.device.check()?;
        // The files first: a missing data file or checkpoint is the problem to fix before
        // any option that depends on them (a batch that does not divide is moot without
        // data).
        TextDataset::check_file(&self.data, self.seq_len)?;
        super::resume::validate_path(self)?;
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.steps == 0 {
            return bad("--steps must be at least 1".into());
        }
        if self.sample_len > MAX_SAMPLE_LEN {
            return bad(format!(
                "--sample-len {} is more than {MAX_SAMPLE_LEN} bytes (one forward pass per byte)",
                self.sample_len
            ));
        }
        if self.world_size == 0 {
            return bad("--world-size must be at least 1".into());
        }
        if self.global_batch == 0 || self.global_batch % self.world_size != 0 {
            return bad(format!(
                "--global-batch {} must be a positive multiple of --world-size {} (rows are split evenly across ranks)",
                self.global_batch, self.world_size
            ));
        }
        super::graph_step::check(self)?;
        if self.grad_accum == 0 {
            return bad("--grad-accum must be at least 1".into());
        }
        if self.global_batch % (self.world_size * self.grad_accum) != 0 {
            return bad(format!(
                "--global-batch {} must be a multiple of --world-size {} x --grad-accum {} (every micro-batch splits evenly across ranks)",
                self.global_batch, self.world_size, self.grad_accum
            ));
        }
        if let Some(c) = self.clip_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return bad(format!(
                    "--clip-grad-norm must be a finite positive number (0: no clipping), got {c}"
                ));
            }
        }
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(format!(
                "--init-scale must be a finite positive number, got {}",
                self.init_scale
            ));
        }
        if self.growth_interval == 0 {
            return bad("--growth-interval must be at least 1".into());
        }
        if self.seq_len == 0 || self.n_layer == 0 || self.n_embd == 0 || self.n_head == 0 {
            return bad("--seq-len, --n-layer, --n-embd and --n-head must be at least 1".into());
        }
        if self.n_embd % self.n_head != 0 {
            return bad(format!(
                "--n-embd {} must be divisible by --n-head {}",
                self.n_embd, self.n_head
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "--lr must be a finite positive number, got {}",
                self.lr
            ));
        }
        let (b1, b2) = self.betas;
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return bad(format!(
                "--beta1 and --beta2 must be in [0, 1), got {b1} and {b2}"
            ));
        }
        if self.no_fsdp && self.world_size != 1 {
            return bad("--no-fsdp trains without sharding and needs --world-size 1".into());
        }
        if self.zero_redundancy_optimizer && self.no_fsdp {
            return bad(
                "--zero-redundancy-optimizer shards the optimizer state of an FSDP --strategy no-shard model; drop --no-fsdp".into(),
            );
        }
        if self.zero_redundancy_optimizer && self.strategy != ShardingStrategy::NoShard {
            return bad(format!(
                "--zero-redundancy-optimizer needs --strategy no-shard (ZeRO-1: parameters whole on every rank, optimizer state sharded); --strategy {} shards the optimizer state already",
                self.strategy.flag_name()
            ));
        }
        let lp = matches!(self.mixed_precision, Precision::Bf16 | Precision::F16);
        if self.no_fsdp && (lp || self.cpu_offload) {
            return bad(
                "--mixed-precision and --cpu-offload are FSDP options; drop --no-fsdp".into(),
            );
        }
        if let Some(m) = self.metrics.as_deref().filter(|m| is_fifo(m)) {
            // Opening a FIFO for writing blocks until someone reads it.
            return bad(format!(
                "--metrics {} is a named pipe; give a file path",
                m.display()
            ));
        }
        if let (Some(m), Some(d)) = (&self.metrics, std::fs::canonicalize(&self.data).ok()) {
            if std::fs::canonicalize(m).ok().as_ref() == Some(&d) || same_file(m, &self.data) {
                return bad(format!(
                    "--metrics {} is the data file; give another path",
                    m.display()
                ));
            }
        }
        self.check_memory()?;
        super::resume::validate(self)?;
        if let Some(n) = self.ranks_per_node {
            if !self.strategy.is_hybrid() {
                return bad(format!(
                    "--ranks-per-node applies to hybrid-shard and hybrid-shard-zero2, not {}",
                    self.strategy.flag_name()
                ));
            }
            if n == 0 {
                return bad("--ranks-per-node must be at least 1".into());
            }
            if self.world_size % n != 0 {
                return bad(format!(
                    "--ranks-per-node {n} must divide --world-size {}",
                    self.world_size
                ));
            }
        }
        Ok(())
    }
}

/// Longest `--sample-len`: generation runs one forward pass per byte.
const MAX_SAMPLE_LEN: usize = 100_000;

/// Whether two existing paths are the same file (hard links included).
#[cfg(unix)]
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

#[cfg(not(unix))]
fn same_file(_: &std::path::Path, _: &std::path::Path) -> bool {
    false
}

/// Whether `p` is a named pipe.
#[cfg(unix)]
fn is_fifo(p: &std::path::Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_fifo())
}

#[cfg(not(unix))]
fn is_fifo(_: &std::path::Path) -> bool {
    false
}
