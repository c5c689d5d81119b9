//! Checkpoints of the main job: `--save-dir DIR --save-every N` saves `DIR/step-<N>/`
//! (model and optimizer, sharded or full) and then points `DIR/latest` at it; `--resume`
//! loads one at any world size and strategy and continues at the next step.
//!
//! What a resumed run needs to continue the uninterrupted loss curve: the parameters, the
//! optimizer state (Adam moments and step counts; SGD momentum), the step number, and the
//! random state. This job draws every batch from a counter-based generator keyed by
//! `(seed, split, step, row)` and samples text keyed by the seed, so the random state is the
//! seed and the next step, both in the checkpoint's index (`extra.rng`). The learning rate
//! is a function of the step and the config.

use super::config::TrainConfig;
use super::data::TextDataset;
use super::engine::Engine;
use super::options::CheckpointType;
use super::save_dir::{self, run_id_of};
use crate::checkpoint::{
    insert_grad_scaler_state, load_checkpoint, read_checkpoint_info, read_index,
    resolve_checkpoint, write_atomic, LATEST_FILE,
};
use crate::error::{Error, Result};
use crate::fsdp::{ShardedGradScaler, StateDictType};
use crate::optim::Optimizer;
use std::path::{Path, PathBuf};

/// What every checkpoint of a run records about the run beyond the config: its id (kept
/// across resumes; rotation deletes only this run's checkpoints) and its data file.
#[derive(Debug, Clone)]
pub(super) struct RunRecord {
    /// See [`save_dir`](super::save_dir).
    pub run_id: String,
    /// `extra.data`: the data file's path, size and checksum ([`data_record`]).
    pub data: serde_json::Value,
}

/// The checksum recorded for the data file: name of the algorithm, as stored in
/// `extra.data.checksum_algorithm`.
const DATA_CHECKSUM: &str = "crc32 (IEEE 802.3, crc32fast)";

/// `extra.data` of a run on `data` read from `path`: path, bytes and [`DATA_CHECKSUM`] of
/// the content (the tokens are the file's bytes), so a resumed run can tell a copy of the
/// same data from another file.
pub(super) fn data_record(path: &Path, data: &TextDataset) -> serde_json::Value {
    let mut h = crc32fast::Hasher::new();
    let mut buf = Vec::with_capacity(1 << 16);
    for chunk in data.train.chunks(1 << 16).chain(data.val.chunks(1 << 16)) {
        buf.clear();
        buf.extend(chunk.iter().map(|&t| t as u8));
        h.update(&buf);
    }
    serde_json::json!({
        "path": path.to_string_lossy(),
        "bytes": data.train.len() + data.val.len(),
        "checksum": format!("{:08x}", h.finalize()),
        "checksum_algorithm": DATA_CHECKSUM,
    })
}

/// Name of the checkpoint directory of `step` inside a save directory.
pub(super) fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Checks that `--resume` names a checkpoint (a `step-<N>/` folder, or a save directory
/// with `latest`), before the other options: a path that does not exist is the problem to
/// report, whatever else the options say.
///
/// # Errors
/// `Checkpoint` naming the path and what is there instead (see [`resolve_checkpoint`]).
pub(super) fn validate_path(cfg: &TrainConfig) -> Result<()> {
    match &cfg.resume {
        Some(r) => resolve_checkpoint(r).map(drop),
        None => Ok(()),
    }
}

/// Checks the checkpoint options (and the checkpoint to resume from) before any thread
/// starts.
///
/// # Errors
/// `InvalidArgument` naming the option; `Checkpoint` when `--resume` names no checkpoint.
pub(super) fn validate(cfg: &TrainConfig) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    if cfg.save_dir.is_some() {
        // The checkpoint index records the run's options as JSON, which needs UTF-8.
        let paths = [
            ("--data", Some(&cfg.data)),
            ("--metrics", cfg.metrics.as_ref()),
            ("--save-dir", cfg.save_dir.as_ref()),
            ("--resume", cfg.resume.as_ref()),
        ];
        for (flag, p) in paths {
            if let Some(p) = p.filter(|p| p.to_str().is_none()) {
                return bad(format!(
                    "{flag} {} is not valid UTF-8; checkpoints record their paths as UTF-8 text",
                    p.display()
                ));
            }
        }
    }
    if cfg.save_every > 0 && cfg.save_dir.is_none() {
        return bad(format!(
            "--save-every {} needs --save-dir (where to save)",
            cfg.save_every
        ));
    }
    if cfg.async_save && cfg.save_dir.is_none() {
        return bad("--async-save needs --save-dir (where to save)".into());
    }
    if cfg.keep_last == 0 {
        return bad("--keep-last must be at least 1".into());
    }
    if cfg.no_fsdp && (cfg.save_dir.is_some() || cfg.resume.is_some()) {
        return bad("--save-dir and --resume save and load FSDP state; drop --no-fsdp".into());
    }
    save_dir::validate(cfg)?;
    if let Some(d) = &cfg.save_dir {
        if d.exists() && !d.is_dir() {
            return bad(format!(
                "--save-dir {} exists and is not a directory",
                d.display()
            ));
        }
        // Found now, not after the first `--save-every` steps of training: the directory
        // can be created and written.
        let probe = d.join(format!("{}{}", save_dir::PROBE_PREFIX, std::process::id()));
        let written = std::fs::create_dir_all(d).and_then(|()| std::fs::write(&probe, b""));
        let _ = std::fs::remove_file(&probe);
        if let Err(e) = written {
            return bad(format!(
                "--save-dir {}: cannot create or write checkpoints there: {e}",
                d.display()
            ));
        }
    }
    if let Some(r) = &cfg.resume {
        let info = read_checkpoint_info(r)?;
        let step = checkpoint_step(&info.extra, &info.dir)?;
        if step >= cfg.steps {
            return bad(format!(
                "--resume {}: the checkpoint is at step {step}; --steps {} leaves nothing to train",
                r.display(),
                cfg.steps
            ));
        }
        // The data order is a function of (seed, step): a different seed is one more
        // difference to name, listed with the others.
        let mut diffs = Vec::new();
        let seed = info.extra.get("seed").and_then(|s| s.as_u64());
        if seed != Some(cfg.seed) {
            diffs.push(format!(
                "--seed {} (this run: {}; it fixes the data order)",
                seed.map_or("?".into(), |s| s.to_string()),
                cfg.seed
            ));
        }
        if let Some(old) = info.extra.get("config") {
            diffs.extend(trajectory_differences(old, cfg));
        }
        diffs.extend(data_difference(&info.extra, cfg));
        diffs.extend(grad_scaler_difference(info.grad_scaler_state()?, cfg));
        if !diffs.is_empty() {
            return bad(format!(
                "--resume {}: options differ from the checkpoint's run, so training would not continue it; pass the checkpoint's values: {}",
                r.display(),
                diffs.join(", ")
            ));
        }
        if !info.has_optim {
            return Err(Error::Checkpoint {
                path: info.dir.display().to_string(),
                detail: "has no optimizer state; fsdp train resumes from checkpoints it saved"
                    .into(),
            });
        }
        super::recorded::check(&info.dir, &read_index(&info.dir)?, step, cfg)?;
    }
    Ok(())
}

/// The step the run resumes after (`--resume`'s checkpoint's), `None` for a fresh run.
///
/// # Errors
/// As [`read_checkpoint_info`]; `Checkpoint` when the index has no step.
pub(super) fn resumed_step(cfg: &TrainConfig) -> Result<Option<usize>> {
    let Some(r) = &cfg.resume else {
        return Ok(None);
    };
    let info = read_checkpoint_info(r)?;
    checkpoint_step(&info.extra, &info.dir).map(Some)
}

/// `--data` as a difference from the checkpoint's run, when its content differs from the
/// data file recorded there (same checksum: the same data, wherever it lies now).
/// Checkpoints without a checksum compare the paths.
fn data_difference(extra: &serde_json::Value, cfg: &TrainConfig) -> Option<String> {
    let old = extra.get("data");
    let old_path = old
        .and_then(|d| d.get("path"))
        .or_else(|| extra.get("config").and_then(|c| c.get("data")))
        .and_then(|p| p.as_str())?;
    let recorded = old
        .filter(|d| d.get("checksum_algorithm").and_then(|a| a.as_str()) == Some(DATA_CHECKSUM))
        .and_then(|d| d.get("checksum"))
        .and_then(|c| c.as_str());
    let new_path = cfg.data.to_string_lossy();
    match recorded {
        Some(want) => {
            // Unreadable: the data loader reports it, naming the file.
            let bytes = std::fs::read(&cfg.data).ok()?;
            let got = format!("{:08x}", crc32fast::hash(&bytes));
            (got != want).then(|| {
                format!(
                    "--data {old_path} (this run: {new_path}; the contents differ: crc32 {want}, this run's {got})"
                )
            })
        }
        None => (new_path != old_path).then(|| {
            format!("--data {old_path} (this run: {new_path}; the checkpoint recorded no checksum to recognize a copy)")
        }),
    }
}

/// The grad scaler as a difference from the checkpoint's run: a run that scales its loss
/// resumed without a scaler, or the other way round (the scaler's state continues only a
/// run that had one).
fn grad_scaler_difference(
    saved: Option<crate::fsdp::GradScalerState>,
    cfg: &TrainConfig,
) -> Option<String> {
    match (saved, cfg.uses_grad_scaler()) {
        (Some(s), false) => Some(format!(
            "the grad scaler, at scale {} (this run: none; it is on under --mixed-precision f16 without --no-grad-scaler)",
            s.scale
        )),
        (None, true) => Some(
            "--no-grad-scaler (this run: the grad scaler, on under --mixed-precision f16; the checkpoint's run trained unscaled)".into(),
        ),
        _ => None,
    }
}

/// The options that shape the model or the training trajectory on which `cfg` differs
/// from the run recorded in a checkpoint (`old`, the saved `TrainConfig` as JSON), as
/// `--flag old (this run: new)`: the value to pass first. World size, strategy (and ZeRO-1), wrapping, prefetch, offload and
/// the step count may change (the step count only where the lr schedule does not depend
/// on it).
fn trajectory_differences(old: &serde_json::Value, cfg: &TrainConfig) -> Vec<String> {
    let new = match serde_json::to_value(cfg) {
        Ok(v) => v,
        Err(_) => return Vec::new(),
    };
    let mut out = Vec::new();
    for (key, flag) in [
        ("n_layer", "--n-layer"),
        ("n_head", "--n-head"),
        ("n_embd", "--n-embd"),
        ("seq_len", "--seq-len"),
        ("global_batch", "--global-batch"),
        ("lr", "--lr"),
        ("betas", "--beta1/--beta2"),
        ("lr_schedule", "--lr-schedule"),
        ("optimizer", "--optimizer"),
        ("grad_accum", "--grad-accum"),
        ("clip_grad_norm", "--clip-grad-norm"),
        ("mixed_precision", "--mixed-precision"),
    ] {
        if let (Some(a), Some(b)) = (old.get(key), new.get(key)) {
            if a != b {
                out.push(format!("{flag} {} (this run: {})", shown(a), shown(b)));
            }
        }
    }
    // The warm-up actually used is capped at --steps; a cosine schedule spans --steps.
    let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_u64());
    if let (Some(w), Some(s)) = (num(old, "warmup_steps"), num(old, "steps")) {
        if w.min(s) != cfg.effective_warmup() as u64 {
            out.push(format!(
                "an lr warm-up of {} steps (this run: {}; from --warmup-steps and --steps)",
                w.min(s),
                cfg.effective_warmup()
            ));
        }
        if cfg.lr_schedule == super::LrSchedule::Cosine && s != cfg.steps as u64 {
            out.push(format!(
                "--steps {s} (this run: {}; the cosine schedule spans --steps)",
                cfg.steps
            ));
        }
    }
    out
}

/// An option's value as a user writes it: f32 values without f64 noise (`0.001`, not
/// `0.0010000000474974513`), enum names lowercase (`adamw`), no value as `none`.
fn shown(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "none".into(),
        serde_json::Value::Number(n) if n.is_f64() => n
            .as_f64()
            .map_or_else(|| n.to_string(), |x| (x as f32).to_string()),
        serde_json::Value::String(s) => s.to_ascii_lowercase(),
        serde_json::Value::Array(a) => a.iter().map(shown).collect::<Vec<_>>().join("/"),
        other => other.to_string(),
    }
}

/// The step a checkpoint of this job was saved after.
fn checkpoint_step(extra: &serde_json::Value, dir: &Path) -> Result<usize> {
    extra
        .get("step")
        .and_then(|s| s.as_u64())
        .map(|s| s as usize)
        .ok_or_else(|| Error::Checkpoint {
            path: dir.display().to_string(),
            detail: "its index has no training step: not saved by fsdp train".into(),
        })
}

/// Loads the checkpoint `path` stands for into the model, the optimizer and, when it
/// scales, the grad scaler (its scale, factors, interval and growth tracker); returns its
/// step, directory and run id (`None` in checkpoints saved before runs had ids). A
/// collective.
pub(super) fn resume(
    path: &Path,
    engine: &mut Engine,
    opt: &mut dyn Optimizer,
    scaler: &mut ShardedGradScaler,
) -> Result<(usize, PathBuf, Option<String>)> {
    let Engine::Fsdp(m) = engine else {
        return Err(Error::InvalidArgument(
            "--resume needs FSDP; drop --no-fsdp".into(),
        ));
    };
    let info = load_checkpoint(path, m, Some(opt))?;
    // A no-op without a scaler (resume::validate refused a mismatch before).
    scaler.load_state_dict(info.grad_scaler_state()?.as_ref())?;
    let step = checkpoint_step(&info.extra, &info.dir)?;
    Ok((step, info.dir, run_id_of(&info.extra)))
}

/// Whether `step` saves a checkpoint (`--save-every`, and the last step) when a save
/// directory is set.
pub(super) fn save_due(cfg: &TrainConfig, step: usize) -> bool {
    cfg.save_dir.is_some()
        && ((cfg.save_every > 0 && step % cfg.save_every == 0) || step == cfg.steps)
}

/// The index's `extra` of a checkpoint saved after `step`: the step, the random state, the
/// run's id, data file and options, and the grad scaler's state when it scales.
///
/// # Errors
/// `InvalidArgument` when the options cannot be written as JSON (non-UTF-8 paths).
pub(super) fn checkpoint_extra(
    cfg: &TrainConfig,
    step: usize,
    run: &RunRecord,
    scaler: &ShardedGradScaler,
) -> Result<serde_json::Value> {
    let config = serde_json::to_value(cfg).map_err(|e| {
        Error::InvalidArgument(format!(
            "cannot record the run's options in the checkpoint index: {e} (checkpoints need UTF-8 paths)"
        ))
    })?;
    let mut extra = serde_json::json!({
        "step": step,
        "seed": cfg.seed,
        "rng": {
            "generator": "counter-based splitmix64 keyed by (seed, split, step, row)",
            "seed": cfg.seed,
            "next_step": step + 1,
        },
        "world_size": cfg.world_size,
        "strategy": cfg.strategy,
        "run_id": run.run_id,
        "data": run.data,
        "config": config,
    });
    if let Some(state) = scaler.state_dict() {
        insert_grad_scaler_state(&mut extra, &state)?;
    }
    Ok(extra)
}

/// The layout `--checkpoint-type` asks for.
pub(super) fn state_dict_type(cfg: &TrainConfig) -> StateDictType {
    match cfg.checkpoint_type {
        CheckpointType::Sharded => StateDictType::Sharded,
        CheckpointType::Full => StateDictType::Full,
    }
}

/// After every rank's files and the index of `root/name` are durable (rank 0): points
/// `latest` at it, then keeps the newest `keep_last` checkpoints of run `run_id`.
///
/// # Errors
/// `Io` naming `latest` when it cannot be replaced.
pub(super) fn publish(root: &Path, name: &str, keep_last: usize, run_id: &str) -> Result<()> {
    write_atomic(&root.join(LATEST_FILE), format!("{name}\n").as_bytes())?;
    save_dir::prune(root, keep_last, name, run_id);
    Ok(())
}
