//! [`TrainConfig`]: everything `fsdp train` takes, its defaults, and what follows from it
//! alone (the GPT shape, the learning rate of a step). The leaf of this module's files:
//! the job, checkpoints, the memory estimate and validation read it, and it reads only the
//! option enums. Beside the methods here, `validate.rs` adds [`TrainConfig::validate`] and
//! `memory.rs` [`TrainConfig::estimate_memory`], each a concern of its own that imports
//! this file (never the other way).

use super::data::VOCAB_SIZE;
use super::options::{CheckpointType, LrSchedule, Precision, WrapMode};
use crate::fsdp::{BackwardPrefetch, GradScalerConfig, ShardingStrategy};
use crate::nn::GptConfig;
use crate::optim::{CosineAnnealingLR, LinearLR, LrScheduler, OptimizerKind, SequentialLR};
use std::path::PathBuf;

/// Everything `fsdp train` takes. `Default` is the CLI's defaults, sized for a 2-core CPU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrainConfig {
    /// UTF-8 text file to train on (`--data`); tokens are its bytes, the last 10% held out.
    /// Default `data/tinyshakespeare.txt`.
    pub data: PathBuf,
    /// Number of ranks (`--world-size`), default 4: threads of this process for
    /// [`train`](super::train); the job's processes (`WORLD_SIZE`) for
    /// [`train_rank`](super::train_rank).
    pub world_size: usize,
    /// FSDP sharding strategy (`--strategy`), default `FullShard`; the hybrid ones are
    /// rejected by [`validate`](Self::validate).
    pub strategy: ShardingStrategy,
    /// How the model is split into FSDP units (`--wrap`), default `Transformer`.
    pub wrap: WrapMode,
    /// Train plainly, without FSDP (world size 1 only): the reference for benches.
    pub no_fsdp: bool,
    /// Shard the optimizer state of a `no-shard` model over the ranks, with the gradients
    /// reduce-scattered into each rank's chunk and the parameters all-gathered after each
    /// step (`--zero-redundancy-optimizer`: ZeRO-1,
    /// [`ZeroRedundancyOptimizer`](crate::fsdp::ZeroRedundancyOptimizer)); default off.
    /// Needs `strategy` `NoShard`.
    pub zero_redundancy_optimizer: bool,
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
    /// Dynamic loss scaling ([`ShardedGradScaler`](crate::fsdp::ShardedGradScaler)):
    /// `None` (the default) scales under `--mixed-precision f16` and nowhere else;
    /// `Some(false)` (`--no-grad-scaler`) never; `Some(true)` (`--grad-scaler`) asks for
    /// it, which under another precision is a warning and trains unscaled
    /// ([`uses_grad_scaler`](Self::uses_grad_scaler), [`grad_scaler_warning`](Self::grad_scaler_warning)).
    pub grad_scaler: Option<bool>,
    /// The grad scaler's first scale (`--init-scale`), default 65536 (PyTorch's 2^16). A
    /// resumed run takes the checkpoint's scale instead.
    pub init_scale: f32,
    /// Clean steps before the grad scaler doubles its scale (`--growth-interval`), default
    /// 2000 (PyTorch's). A resumed run takes the checkpoint's.
    pub growth_interval: u32,
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
    /// Checkpoint every transformer block's activations (`--activation-checkpointing`,
    /// `apply_activation_checkpointing` with `check_fn` matching `Block`): each block
    /// keeps only its input through the forward and recomputes its forward in backward.
    /// The same numbers bit for bit; fewer saved activations, about one more forward of
    /// the blocks. Default off.
    pub activation_checkpointing: bool,
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
    /// JSON-lines file that receives one [`StepRecord`](super::StepRecord) per step (`--metrics`); `None`
    /// (the default) writes none.
    pub metrics: Option<PathBuf>,
    /// Where to compute (`--device`), default the CPU.
    pub device: super::TrainDevice,
    /// Capture the training step as a CUDA graph after two eager steps and replay it
    /// (`--cuda-graphs`; `--device cuda`, world size 1 or one process per rank under
    /// `fsdp launch` (backend nccl), a learning-rate schedule only with
    /// Adam or AdamW, no grad scaler, no CPU offload, no checkpoint saving). Default off.
    pub cuda_graphs: bool,
    /// Save directory (`--save-dir`): checkpoints go to `step-<N>/` inside, and `latest`
    /// names the newest; `None` saves nothing.
    pub save_dir: Option<PathBuf>,
    /// Save every this many steps (`--save-every`), and after the last step; 0: only after
    /// the last step. Needs `save_dir` when nonzero.
    pub save_every: usize,
    /// Save in the background (`--async-save`; PyTorch's
    /// `torch.distributed.checkpoint.async_save`): a save returns once the shards are
    /// copied into host memory, a thread writes the files, and the checkpoint becomes
    /// `latest` at the next save or at the end of training. Needs `save_dir`.
    pub async_save: bool,
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
    /// How long the ranks wait for each other at the rendezvous and in each collective
    /// (`--timeout`, `init_process_group(timeout=)`); `None`: `FSDP_TIMEOUT`, else 300 s.
    /// Not part of a run's identity: not serialized.
    #[serde(skip)]
    pub timeout: Option<std::time::Duration>,
    /// How long a rank process may send no heartbeat before its peers name it failed
    /// (`--heartbeat-timeout`, ranks that are processes only); `None`:
    /// `FSDP_HEARTBEAT_TIMEOUT`, else 60 s.
    #[serde(skip)]
    pub heartbeat_timeout: Option<std::time::Duration>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            data: PathBuf::from("data/tinyshakespeare.txt"),
            world_size: 4,
            strategy: ShardingStrategy::FullShard,
            wrap: WrapMode::Transformer,
            no_fsdp: false,
            zero_redundancy_optimizer: false,
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
            grad_scaler: None,
            init_scale: 65536.0,
            growth_interval: 2000,
            backward_prefetch: Some(BackwardPrefetch::BackwardPre),
            forward_prefetch: false,
            limit_all_gathers: true,
            cpu_offload: false,
            activation_checkpointing: false,
            optimizer: OptimizerKind::Adamw,
            seed: 1337,
            eval_every: 100,
            log_every: 25,
            eval_batches: 4,
            sample_len: 200,
            metrics: None,
            device: super::TrainDevice::Cpu,
            cuda_graphs: false,
            save_dir: None,
            save_every: 0,
            async_save: false,
            keep_last: 2,
            checkpoint_type: CheckpointType::Sharded,
            resume: None,
            overwrite: false,
            timeout: None,
            heartbeat_timeout: None,
        }
    }
}

impl TrainConfig {
    /// The warm-up actually used: `warmup_steps`, capped at `steps` (a longer warm-up
    /// ramps over the whole run).
    pub fn effective_warmup(&self) -> usize {
        self.warmup_steps.min(self.steps)
    }

    /// The run's schedule as `torch.optim.lr_scheduler` builds it, epoch `e` being step
    /// `e + 1`: with a warm-up of `W` steps, `SequentialLR([LinearLR(1/W, 1, W - 1), after],
    /// milestones=[W])`, where `after` is a constant factor 1 (`LinearLR(1, 1, 0)`) or
    /// `CosineAnnealingLR(T_max = steps - W - 1, eta_min = lr / 10)` (nanoGPT's: full lr at
    /// the first step after the warm-up, lr / 10 at the last).
    pub fn lr_scheduler(&self) -> Box<dyn LrScheduler> {
        let warmup = self.effective_warmup();
        let after: Box<dyn LrScheduler> = match self.lr_schedule {
            LrSchedule::Constant => Box::new(LinearLR {
                start_factor: 1.0,
                end_factor: 1.0,
                total_iters: 0,
            }),
            LrSchedule::Cosine => Box::new(CosineAnnealingLR {
                t_max: self.steps.saturating_sub(warmup + 1),
                eta_min: self.lr as f64 / 10.0,
            }),
        };
        if warmup == 0 {
            return after;
        }
        let warm = Box::new(LinearLR {
            start_factor: 1.0 / warmup as f64,
            end_factor: 1.0,
            total_iters: warmup - 1,
        });
        Box::new(SequentialLR::pair(warm, warmup, after))
    }

    /// The learning rate of 1-based step `step` ([`lr_scheduler`](Self::lr_scheduler) at
    /// epoch `step - 1`, rounded to f32).
    pub fn lr_at(&self, step: usize) -> f32 {
        self.lr_scheduler()
            .lr(self.lr as f64, step.saturating_sub(1)) as f32
    }

    /// Whether [`build_engine`](super::build_engine) builds the model on the meta device and
    /// computes only each rank's shards (FSDP's deferred init, `param_init_fn`). It does
    /// under FSDP in every precision but f64, whose model is built whole in f32 and
    /// converted on every rank (`model.double()`), as is the `--no-fsdp` model.
    pub fn init_is_deferred(&self) -> bool {
        !self.no_fsdp && self.mixed_precision != super::Precision::F64
    }

    /// How this configuration initializes the model, for the summary line of `fsdp train`.
    pub fn init_description(&self) -> &'static str {
        if self.init_is_deferred() {
            "deferred, on the meta device"
        } else if self.no_fsdp {
            "the whole model on every rank, no FSDP"
        } else {
            "the whole model on every rank, converted to f64 before wrapping"
        }
    }

    /// Whether the run scales its loss ([`ShardedGradScaler`](crate::fsdp::ShardedGradScaler)):
    /// under f16 mixed precision unless `grad_scaler` is `Some(false)`. bf16 has f32's
    /// exponent range (its gradients do not underflow as f16's do), and f32 and f64 need no
    /// scaling: those runs train unscaled even when `grad_scaler` asks for a scaler.
    pub fn uses_grad_scaler(&self) -> bool {
        self.mixed_precision == Precision::F16 && self.grad_scaler != Some(false)
    }

    /// The warning for a grad scaler asked for (`--grad-scaler`) under a precision that
    /// trains unscaled; `None` otherwise. (PyTorch's `GradScaler` itself would scale a bf16
    /// loss without a word; its one warning is for a scaler that cannot work, "GradScaler
    /// is enabled, but CUDA is not available. Disabling.", which this follows: a warning,
    /// and no scaling.)
    pub fn grad_scaler_warning(&self) -> Option<String> {
        (self.grad_scaler == Some(true) && !self.uses_grad_scaler()).then(|| {
            format!(
                "--grad-scaler is for --mixed-precision f16, whose gradients underflow without loss scaling; this run computes in {} (f32's exponent range or more), so it trains unscaled",
                match self.mixed_precision {
                    Precision::Bf16 => "bf16",
                    Precision::F64 => "f64",
                    _ => "f32",
                }
            )
        })
    }

    /// The grad scaler this config trains with: `--init-scale`, `--growth-interval`,
    /// PyTorch's factors (2.0, 0.5), enabled when [`uses_grad_scaler`](Self::uses_grad_scaler).
    pub fn grad_scaler_config(&self) -> GradScalerConfig {
        GradScalerConfig {
            init_scale: self.init_scale,
            growth_interval: self.growth_interval,
            enabled: self.uses_grad_scaler(),
            ..GradScalerConfig::default()
        }
    }

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
