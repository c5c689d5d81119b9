//! Cross-checks of what a checkpoint of `fsdp train` records in more than one place, so an
//! edited `index.json` is refused instead of trusted: the step (the directory name, the
//! data generator's next step, the optimizer's step counts (the steps a grad scaler did not
//! skip), the learning rate the schedule gives at that step) and the world size (the run's
//! options, the rank files the strategy writes). The index's own fields against its file
//! names are checked by the checkpoint loader (`checkpoint::verify`).

use super::config::TrainConfig;
use super::save_dir::step_of;
use crate::checkpoint::{Index, GRAD_SCALER_KEY, INDEX_FILE};
use crate::error::{Error, Result};
use crate::fsdp::{ShardingStrategy, StateDictType};
use std::path::Path;

/// Checks that `step` (the index's `extra.step`) and `index.world_size` agree with the
/// rest of the checkpoint in `dir`. `cfg` is the resuming run's config, whose schedule
/// options already match the checkpoint's.
///
/// # Errors
/// `Checkpoint` naming `dir/index.json`, the field, and both values.
pub(super) fn check(dir: &Path, index: &Index, step: usize, cfg: &TrainConfig) -> Result<()> {
    let bad = |detail: String| {
        Err(Error::Checkpoint {
            path: dir.join(INDEX_FILE).display().to_string(),
            detail,
        })
    };
    let extra = &index.extra;
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    if let Some((name, n)) = name.and_then(|n| step_of(&n).map(|s| (n, s))) {
        if n != step as u64 {
            return bad(format!(
                "step {step} disagrees with the directory name {name} (step {n})"
            ));
        }
    }
    if let Some(next) = extra.pointer("/rng/next_step").and_then(|v| v.as_u64()) {
        if next != step as u64 + 1 {
            return bad(format!(
                "step {step} disagrees with rng.next_step {next}: the data generator continues at the step after the saved one"
            ));
        }
    }
    if let Some(o) = &index.optim {
        // Adam and AdamW count their steps per parameter: one per training step, or under
        // a grad scaler one per step it did not skip (every parameter alike).
        let scaled = extra.get(GRAD_SCALER_KEY).is_some();
        let first = o.steps.values().next().copied().unwrap_or(0);
        let off = |s: u64| match scaled {
            false => s != step as u64,
            true => s > step as u64 || s != first,
        };
        if let Some((param, s)) = o.steps.iter().find(|(_, &s)| off(s)) {
            return bad(match scaled {
                false => format!(
                    "step {step} disagrees with the optimizer's step count {s} (optim.steps of '{param}'); the optimizer steps once per training step"
                ),
                true => format!(
                    "step {step} disagrees with the optimizer's step count {s} (optim.steps of '{param}'; others count {first}); under a grad scaler every parameter counts the steps not skipped, at most {step}"
                ),
            });
        }
        if let Some(&lr) = o.hyperparams.get("lr") {
            let want = cfg.lr_at(step);
            if ((lr as f32) - want).abs() > 1e-6 * want.abs() {
                return bad(format!(
                    "step {step} disagrees with the optimizer's learning rate {} (optim.hyperparams.lr); the schedule gives {want} at step {step}",
                    lr as f32
                ));
            }
        }
    }
    let world = index.world_size;
    for (field, v) in [
        ("extra.world_size", extra.get("world_size")),
        (
            "extra.config.world_size",
            extra.pointer("/config/world_size"),
        ),
    ] {
        if let Some(w) = v.and_then(|v| v.as_u64()).filter(|&w| w != world as u64) {
            return bad(format!(
                "world_size {world} disagrees with {field} {w}, the run's --world-size"
            ));
        }
    }
    let strategy = extra
        .get("strategy")
        .and_then(|s| serde_json::from_value::<ShardingStrategy>(s.clone()).ok());
    if let (StateDictType::Sharded, Some(s)) = (index.state_dict_type, strategy) {
        // Every rank holding distinct shards writes one file: under ZeRO-1 every rank holds
        // its chunk of the optimizer state.
        let zero = extra
            .pointer("/config/zero_redundancy_optimizer")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let writers = match s {
            ShardingStrategy::NoShard if zero && index.optim.is_some() => world,
            ShardingStrategy::NoShard => 1,
            ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2 => extra
                .pointer("/config/ranks_per_node")
                .and_then(|v| v.as_u64())
                .map_or(world, |n| n as usize),
            _ => world,
        };
        let files: Vec<&str> = index.files.iter().map(|f| f.name.as_str()).collect();
        let expected: Vec<String> = (0..writers)
            .map(|r| format!("rank-{r:05}-g{}.safetensors", index.generation))
            .collect();
        let mut sorted = files.clone();
        sorted.sort_unstable();
        if sorted != expected {
            return bad(format!(
                "world_size {world} with strategy {s:?} means {writers} rank file(s) rank-00000..rank-{:05}, and it lists {} ({}): the index was edited or files are missing",
                writers.saturating_sub(1),
                files.len(),
                files.join(", ")
            ));
        }
    }
    Ok(())
}
