//! The main job behind `fsdp train` and `fsdp bench`: a byte-level GPT on a text file.
//!
//! | piece | file |
//! |---|---|
//! | data loading, splits, world-size-independent batches | `data.rs` |
//! | FSDP or plain engine, memory figures | `engine.rs` |
//! | `TrainConfig`: every option, its default, the lr of a step | `config.rs` |
//! | the training loop, step records, the observer | `job.rs` |
//! | `TrainConfig::validate`: every option, the most specific problem first | `validate.rs` |
//! | the memory estimate and the check against available memory | `memory.rs` |
//! | one rank of a multi-process job (`fsdp launch`, torchrun) | `process.rs` |
//! | `--device`, its availability check, each rank's GPU, the peak-FLOP/s table for MFU | `device.rs` |
//! | wrap mode, precision, lr schedule, checkpoint layout | `options.rs` |
//! | the hidden test-only fault hooks `FSDP_FAIL_RANK`, `FSDP_KILL_ONCE` (feature `test-hooks`) | `fault.rs` |
//! | checkpoints: `--save-dir`, `--save-every`, `--resume` | `resume.rs` |
//! | when to save, synchronously or in the background (`--async-save`) | `saver.rs` |
//! | the save directory: one run per directory, `--overwrite`, rotation by run id | `save_dir.rs` |
//! | cross-checks of a checkpoint's step and world size against its other records | `recorded.rs` |
//! | the `--metrics` file, kept up to the resumed step | `metrics.rs` |
//! | generation | `sample.rs` |
//! | `DistributedSampler`: each rank's indices of an epoch | `sampler.rs` |

mod config;
pub mod data;
mod device;
pub mod engine;
mod fault;
mod graph_step;
mod job;
mod memory;
mod metrics;
mod options;
mod pending;
mod process;
mod recorded;
mod resume;
pub mod sample;
mod sampler;
mod save_dir;
mod saver;
mod validate;

pub use config::TrainConfig;
pub use device::{exposed_comm_summary, gpu_summary, mfu, peak_flops, TrainDevice};
pub use engine::{global_mean_loss, mean_over_ranks};
pub use job::{build_engine, train, Observer, Silent, StepRecord, TrainReport};
pub use memory::MemoryEstimate;
pub use options::{CheckpointType, LrSchedule, Precision, Preset, WrapMode};
pub use process::{train_rank, RankEnv};
pub use sampler::DistributedSampler;
