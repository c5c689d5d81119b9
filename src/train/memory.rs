//! How much memory a `fsdp train` configuration needs, counted from the buffers the model
//! really allocates, and the check that refuses a configuration the machine cannot hold
//! (a run the kernel would kill without a message).
//!
//! Per rank, with `b` rows per micro-batch (`--global-batch / --world-size / --grad-accum`),
//! `T` tokens per row, width `C`, `H` heads, `L` blocks, vocabulary `V` = 256, f32 (4 bytes):
//!
//! | part | bytes | where |
//! |---|---|---|
//! | attention probabilities saved for backward | `L b H T^2` floats (half under mixed precision: bf16/f16) | `CausalSelfAttention`'s `Saved::p` |
//! | transient attention buffer | `b H T^2` floats (4 under mixed precision) | the scores in forward, their gradient `dp` in backward; under mixed precision the low-precision softmax's f32 widening and f32 result beside the bf16 scores and probabilities (`ops::lowp`) |
//! | other saved activations | `L b T 19 C + b T (3 V + 3 C)` floats | Linear inputs, q/k/v, LayerNorm `xhat`, GELU input; logits, their gradient and the loss's copy |
//! | other transient activations | `b T 12 C` floats (`16 C` mixed) | gradients flowing back through a block, `qkv` before the split |
//! | evaluation (no grad) | `b_e T (12 C + 2 V)` + `2 b_e H T^2` floats (3 mixed) | [`evaluate`](super::job) on `--global-batch / --world-size` rows: larger than a micro-batch under `--grad-accum` |
//! | parameters, gradients, optimizer | `4 P / G` floats (`P` more with shard-grad-op); `P + 3 P / W` with `--zero-redundancy-optimizer` | shards of the flat parameters, `G` ranks per shard group (1 for no-shard); ZeRO-1's whole parameters and its gradient and optimizer chunks |
//! | unsharded units | params + grads of the root and up to 3 blocks (the whole model unwrapped, or with no-shard); all gradients under `--no-sync`; +4 bytes per element mixed | FSDP's all-gather buffers |
//! | allocator slack | without `--grad-accum`: half the activations above (attention included), at least the largest single buffer; with it: the activations of the larger phase, at least 3 x the largest buffer | freed f32 buffers go to the buffer pool (`tensor::pool`, up to 1 GiB per process) and are handed to the next tensor of the same length; the rest stay with mimalloc (v3) for its `purge_delay` (1 s), reused only for blocks of a similar size. When training and evaluation make buffers of the same sizes (no `--grad-accum`) they reuse each other's: measured up to 0.23 of the activations (a (T, T) buffer per rank at seq-len 11000); otherwise the train phase's buffers stay pooled while evaluation allocates its own: measured up to 0.87 |
//! | fixed cost | [`thread_rank_bytes`] | threads, heaps, group state |
//!
//! plus, once per process, 16 MiB (binary, libraries, main thread) and 5 bytes per byte of
//! the data file (read, then one i32 token per byte). Ranks are assumed to peak together.
//!
//! Measured peak RSS (`crates/fsdp-cli/tests/cli/cli.rs`,
//! `memory_estimate_bounds_the_measured_peak`, and `/usr/bin/time -v` runs of 2 to 20
//! steps at seq-len 2000..11000) is between 1/1.7 and 1/1.05 of this estimate over seq-len
//! 16..11000, widths 16..384, 1..4 layers, world sizes 1..16, grad-accum, no-sync, bf16,
//! no-shard and wrap none; e.g. seq-len 11000 on 4 ranks (`--n-layer 1 --n-embd 32
//! --n-head 2 --global-batch 4`): 11.3 GiB estimated, 7.5 to 9.3 GiB measured in seven
//! runs of 2 to 12 steps (the estimate was 18.4 GiB before the slack counted the buffer
//! pool's reuse).

use super::config::TrainConfig;
use super::data::VOCAB_SIZE;
use super::options::{Precision, WrapMode};
use crate::distributed::{available_memory_bytes, thread_rank_bytes};
use crate::error::{Error, Result};
use crate::fsdp::ShardingStrategy;

const MIB: f64 = (1u64 << 20) as f64;
const GIB: f64 = (1u64 << 30) as f64;
const F32: f64 = 4.0;

/// Fixed bytes of the process: the binary, its libraries and the main thread (an `fsdp
/// train` that stops at its first check peaks at 10.3 MiB).
const PROCESS_BASE_BYTES: f64 = 16.0 * MIB;

/// The allocator slack, as a fraction of a phase's activations, when training and
/// evaluation allocate buffers of the same sizes: twice the largest fraction measured
/// (0.23, at seq-len 11000 on 4 ranks).
const SAME_SIZE_SLACK: f64 = 0.5;

/// Blocks unsharded at once under `--wrap transformer`: the one computing, the one
/// prefetched, and one more in flight.
const UNSHARDED_BLOCKS: usize = 3;

/// A configuration's estimated peak host memory, in bytes, by part (all ranks together
/// unless the field says per rank).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MemoryEstimate {
    /// Everything: `process + world_size * (per-rank parts)`.
    pub total: f64,
    /// The process's fixed bytes and the data file's tokens.
    pub process: f64,
    /// Per rank: the attention probabilities, scores and their gradients at the peak of a
    /// training step or an evaluation (whichever is larger), allocator slack excluded.
    pub attention_per_rank: f64,
    /// Per rank: the other activations at the same peak.
    pub activations_per_rank: f64,
    /// Per rank: parameter, gradient and optimizer shards and unsharded units.
    pub parameters_per_rank: f64,
    /// Per rank: freed buffers the pool and the allocator keep (see the table of
    /// `src/train/memory.rs`).
    pub allocator_slack_per_rank: f64,
    /// Per rank: threads, heaps and group state.
    pub fixed_per_rank: f64,
}

impl TrainConfig {
    /// A bound on the process's peak bytes (all ranks together), from the buffers the model
    /// allocates: see [`estimate_memory`](Self::estimate_memory) and the table of
    /// `src/train/memory.rs`.
    pub fn estimated_memory_bytes(&self) -> f64 {
        self.estimate_memory().total
    }

    /// [`estimated_memory_bytes`](Self::estimated_memory_bytes) by part.
    pub fn estimate_memory(&self) -> MemoryEstimate {
        let w = self.world_size.max(1);
        let k = self.grad_accum.max(1);
        let (l, c, h, t) = (
            self.n_layer as f64,
            self.n_embd as f64,
            self.n_head as f64,
            self.seq_len as f64,
        );
        let v = VOCAB_SIZE as f64;
        // bf16/f16 compute. (An f64 job is estimated as the f32 one: its tensors take about
        // twice these bytes.)
        let mixed = matches!(self.mixed_precision, Precision::Bf16 | Precision::F16);
        // Rows per rank: a training micro-batch, and an evaluation batch (not split by K).
        let b = (self.global_batch / w / k).max(1) as f64;
        let b_eval = (self.global_batch / w).max(1) as f64;

        // Attention: one (T, T) matrix per head and row.
        let scores = b * h * t * t * F32;
        let scores_eval = b_eval * h * t * t * F32;
        let extra = if mixed { 1.0 } else { 0.0 };
        // Mixed precision saves bf16 probabilities (half a matrix each), and the softmax
        // of a bf16 matrix holds it, its f32 widening, the f32 result and the rounded
        // result at once (three f32 matrices' bytes); the bf16 buffers freed in between
        // do not go to the f32 buffer pool (one more, measured).
        let attn_train = if mixed { 0.5 * l + 4.0 } else { l + 1.0 } * scores;
        let attn_eval = (2.0 + extra) * scores_eval;

        let tokens = b * t;
        let tokens_eval = b_eval * t;
        let act_train = tokens * (l * 19.0 * c + 3.0 * v + 3.0 * c + (12.0 + 4.0 * extra) * c);
        let act_eval = tokens_eval * (12.0 * c + 2.0 * v);
        let (attention, activations) = if attn_train + act_train >= attn_eval + act_eval {
            (attn_train, act_train * F32)
        } else {
            (attn_eval, act_eval * F32)
        };

        let (parameters, largest_unit) = self.parameter_bytes();
        let largest = [
            scores,
            scores_eval,
            tokens_eval * v * F32,
            tokens_eval * 4.0 * c * F32,
            largest_unit,
        ]
        .into_iter()
        .fold(0.0, f64::max);
        // Freed buffers wait in the buffer pool for a tensor of the same length, or stay
        // committed up to mimalloc's purge delay and are reused only by blocks of a similar
        // size. When evaluation's buffers have the training step's sizes they reuse each
        // other's (measured: up to 0.23 of the activations stay unused); under
        // --grad-accum the train phase's buffers stay pooled while evaluation allocates
        // its own larger ones, and a single large buffer can be left behind thrice.
        let same_sizes = (self.global_batch / w / k).max(1) == (self.global_batch / w).max(1);
        let slack = if same_sizes {
            (SAME_SIZE_SLACK * (attention + activations)).max(largest)
        } else {
            (attention + activations).max(3.0 * largest)
        };
        let fixed = thread_rank_bytes(w) as f64;
        let data = std::fs::metadata(&self.data).map_or(0, |m| m.len()) as f64;
        let process = PROCESS_BASE_BYTES + 5.0 * data;
        MemoryEstimate {
            total: process + w as f64 * (attention + activations + parameters + slack + fixed),
            process,
            attention_per_rank: attention,
            activations_per_rank: activations,
            parameters_per_rank: parameters,
            allocator_slack_per_rank: slack,
            fixed_per_rank: fixed,
        }
    }

    /// `(bytes of parameters, gradients, optimizer state and unsharded units per rank,
    /// bytes of the largest unsharded unit)`.
    fn parameter_bytes(&self) -> (f64, f64) {
        let (l, c, t) = (self.n_layer as f64, self.n_embd as f64, self.seq_len as f64);
        let v = VOCAB_SIZE as f64;
        // wte (V, C), wpe (T, C), ln_f; a block: c_attn, c_proj, c_fc, c_proj, two norms.
        let root = v * c + t * c + 2.0 * c;
        let block = 12.0 * c * c + 13.0 * c;
        let params = root + l * block;
        if self.no_fsdp {
            // The whole model: parameters, gradients, two Adam moments.
            return (4.0 * params * F32, params * F32);
        }
        let w = self.world_size.max(1);
        let group = match self.strategy {
            ShardingStrategy::NoShard => 1,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => {
                self.ranks_per_node.unwrap_or(w).max(1)
            }
            _ => w,
        } as f64;
        // Parameter, gradient and two Adam (or one SGD) moment shards; under ZeRO-1 the
        // parameters are whole and the other three split over the world.
        let mut state = if self.zero_redundancy_optimizer {
            params + 3.0 * params / w as f64
        } else {
            4.0 * params / group
        };
        let whole =
            self.strategy == ShardingStrategy::NoShard || self.wrap != WrapMode::Transformer;
        let units = if whole {
            params
        } else {
            root + (self.n_layer.min(UNSHARDED_BLOCKS) as f64) * block
        };
        // Shard-grad-op keeps every unit's parameters unsharded from forward to backward.
        let keeps_params = matches!(
            self.strategy,
            ShardingStrategy::ShardGradOp | ShardingStrategy::HybridShardZero2
        );
        if keeps_params {
            state += params;
        }
        // Under no_sync every unit's unsharded gradient accumulates until the last
        // micro-batch.
        let grads = if self.no_sync && self.grad_accum > 1 {
            params
        } else {
            units
        };
        let mixed = if !matches!(self.mixed_precision, Precision::Bf16 | Precision::F16) {
            0.0
        } else {
            // Low-precision all-gather and reduce-scatter buffers, 2 bytes each.
            4.0 * units
        };
        let largest_unit = if whole { params } else { root.max(block) };
        ((state + units + grads) * F32 + mixed, largest_unit * F32)
    }

    /// Refuses a configuration whose [`estimate_memory`](Self::estimate_memory) exceeds the
    /// memory it will run in: the GPUs' on `--device cuda`, else the host's `MemAvailable`.
    ///
    /// # Errors
    /// `InvalidArgument` naming the estimate, its largest part and what is available.
    pub(super) fn check_memory(&self) -> Result<()> {
        let est = self.estimate_memory();
        if let Some(m) = self.device.memory_problem(est.total, self.world_size) {
            return Err(Error::InvalidArgument(m));
        }
        if self.device.is_cuda() {
            return Ok(());
        }
        let Some(avail) = available_memory_bytes() else {
            return Ok(());
        };
        if est.total <= avail as f64 {
            return Ok(());
        }
        let w = self.world_size.max(1) as f64;
        let parts = [
            (
                est.attention_per_rank + est.allocator_slack_per_rank,
                "attention scores (rows x --n-head x --seq-len^2 per layer)",
            ),
            (est.activations_per_rank, "activations"),
            (
                est.parameters_per_rank,
                "parameters, gradients and optimizer state",
            ),
            (est.fixed_per_rank, "per-rank threads and heaps"),
        ];
        let (bytes, what) = parts
            .into_iter()
            .fold((0.0, ""), |a, p| if p.0 > a.0 { p } else { a });
        Err(Error::InvalidArgument(format!(
            "this configuration needs about {:.1} GiB of memory ({:.1} GiB of it {what}) and {:.1} GiB are available; lower --seq-len, --global-batch, --n-embd, --n-layer or --world-size",
            est.total / GIB,
            w * bytes / GIB,
            avail as f64 / GIB
        )))
    }
}
