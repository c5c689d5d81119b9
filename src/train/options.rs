//! Options of the main job that are not plain numbers: wrap mode, precision, learning-rate
//! schedule, checkpoint layout, model presets. Plain enums:
//! [`TrainConfig`](super::TrainConfig) holds them, and nothing here knows the config.

use crate::choice::choice_enum;
use crate::fsdp::MixedPrecision;
use crate::tensor::DType;

/// How the model is split into FSDP units (`--wrap transformer|size:N|none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum WrapMode {
    /// One unit per transformer `Block`, plus the root (`transformer_auto_wrap_policy`).
    Transformer,
    /// `size_based_auto_wrap_policy(min_num_params = N)`.
    Size(usize),
    /// One unit for the whole model.
    None,
}

impl std::str::FromStr for WrapMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "transformer" => Ok(WrapMode::Transformer),
            "none" => Ok(WrapMode::None),
            _ => match s.strip_prefix("size:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(WrapMode::Size(n)),
                _ => Err(format!(
                    "expected transformer, size:N (N > 0 parameters) or none, got '{s}'"
                )),
            },
        }
    }
}

impl std::fmt::Display for WrapMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WrapMode::Transformer => f.write_str("transformer"),
            WrapMode::Size(n) => write!(f, "size:{n}"),
            WrapMode::None => f.write_str("none"),
        }
    }
}

choice_enum! {
    /// Layout of the checkpoints `fsdp train` saves (`--checkpoint-type`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
    pub enum CheckpointType: "checkpoint type" {
        /// One file per rank holding distinct shards, plus the index (SHARDED_STATE_DICT).
        #[default]
        Sharded = "sharded",
        /// One model file and one optimizer file written by rank 0 (FULL_STATE_DICT).
        Full = "full",
    }
}

choice_enum! {
    /// Compute precision of `fsdp train` (`--mixed-precision`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
    pub enum Precision: "precision" {
        /// f32 throughout.
        #[default]
        None = "none",
        /// `MixedPrecision::uniform(bf16)`: bf16 parameters, gradients and reduction.
        Bf16 = "bf16",
        /// `MixedPrecision::uniform(f16)`.
        F16 = "f16",
        /// No mixed precision: the model in f64 throughout (`model.double()`: parameters,
        /// gradients, reductions and optimizer state in f64), an exact reference, on the CPU
        /// or a CUDA device (the `_f64` kernels).
        F64 = "f64",
    }
}

impl Precision {
    /// The FSDP policy, `None` for f32 and f64.
    pub fn policy(self) -> Option<MixedPrecision> {
        match self {
            Precision::None | Precision::F64 => None,
            Precision::Bf16 => Some(MixedPrecision::uniform(DType::BF16)),
            Precision::F16 => Some(MixedPrecision::uniform(DType::F16)),
        }
    }
}

choice_enum! {
    /// How the learning rate moves over a run (built from `torch.optim.lr_scheduler`'s
    /// schedules by [`TrainConfig::lr_scheduler`](super::TrainConfig::lr_scheduler)).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
    pub enum LrSchedule: "learning-rate schedule" {
        /// `lr` at every step after the warm-up.
        Constant = "constant",
        /// After the warm-up, half a cosine from `lr` down to `lr / 10` at the last step
        /// (nanoGPT's schedule).
        Cosine = "cosine",
    }
}

choice_enum! {
    /// Named model shapes (`--preset`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
    pub enum Preset: "preset" {
        /// GPT-2 small's shape (12 layers, width 768, 12 heads, 1024 tokens) with the byte
        /// vocabulary of 256: about 86M parameters (124M with GPT-2's 50257-token vocabulary).
        /// The numbers of `GptConfig::gpt2_124m`.
        Gpt2_124m = "gpt2-124m",
    }
}

impl Preset {
    /// `(n_layer, n_embd, n_head, seq_len)`.
    pub fn shape(self) -> (usize, usize, usize, usize) {
        match self {
            Preset::Gpt2_124m => (12, 768, 12, 1024),
        }
    }
}
