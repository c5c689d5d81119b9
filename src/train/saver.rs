//! When and how the main job saves: `--save-every` checkpoints, synchronous or, with
//! `--async-save`, in the background ([`AsyncCheckpointer`], PyTorch's
//! `torch.distributed.checkpoint.async_save`). A background save becomes the `latest`
//! checkpoint once every rank's files are durable (known at the next save) and rank 0 has
//! written its index (in the background after that save, or at the end of training). A
//! failed background write stops the run at the next save or at the end, naming the file;
//! `latest` then still names the previous checkpoint.

use super::config::TrainConfig;
use super::engine::Engine;
use super::resume::{
    checkpoint_extra, publish, save_due, state_dict_type, step_dir_name, RunRecord,
};
use super::save_dir::step_of;
use crate::checkpoint::{save_checkpoint, AsyncCheckpointer};
use crate::error::Result;
use crate::fsdp::ShardedGradScaler;
use crate::optim::Optimizer;
use std::path::PathBuf;
use std::time::Instant;

/// What a call of [`Saver::save_if_due`] or [`Saver::finish`] did.
#[derive(Debug, Default)]
pub(super) struct Saved {
    /// Checkpoints that became `latest` during the call: `(step, directory)`.
    pub committed: Vec<(usize, PathBuf)>,
    /// Seconds the training thread spent in the save call, when a save was due: the whole
    /// save, or with `--async-save` the commit of the previous save plus the staging of
    /// this one.
    pub stall_s: Option<f64>,
}

/// One rank's saving state across the run.
pub(super) struct Saver {
    background: Option<AsyncCheckpointer>,
}

/// `(step, dir)` of checkpoint directories `step-<N>`.
fn with_steps(dirs: Vec<PathBuf>) -> Vec<(usize, PathBuf)> {
    dirs.into_iter()
        .filter_map(|d| {
            let step = step_of(&d.file_name()?.to_string_lossy())?;
            Some((step as usize, d))
        })
        .collect()
}

impl Saver {
    /// A saver for `cfg` (`--async-save` or not) of the run `run`.
    pub(super) fn new(cfg: &TrainConfig, run: &RunRecord) -> Self {
        let background = match &cfg.save_dir {
            Some(root) if cfg.async_save => {
                let (root, keep, run_id) = (root.clone(), cfg.keep_last, run.run_id.clone());
                // Rank 0, once a checkpoint's index is durable: `latest`, then rotation.
                Some(AsyncCheckpointer::new().on_commit(move |dir| {
                    let name = dir
                        .file_name()
                        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
                    publish(&root, &name, keep, &run_id)
                }))
            }
            _ => None,
        };
        Saver { background }
    }

    /// Saves a checkpoint of `step` when one is due (every `save_every` steps and after the
    /// last), with the grad scaler's state after the step's update. A collective.
    ///
    /// # Errors
    /// As [`save_checkpoint`]; with `--async-save`, the failure of the previous save's
    /// background write too, naming the file.
    pub(super) fn save_if_due(
        &mut self,
        cfg: &TrainConfig,
        step: usize,
        engine: &mut Engine,
        opt: &dyn Optimizer,
        scaler: &ShardedGradScaler,
        run: &RunRecord,
    ) -> Result<Saved> {
        let (Some(root), Engine::Fsdp(m)) = (&cfg.save_dir, engine) else {
            return Ok(Saved::default());
        };
        if !save_due(cfg, step) {
            return Ok(Saved::default());
        }
        let name = step_dir_name(step);
        let dir = root.join(&name);
        let extra = checkpoint_extra(cfg, step, run, scaler)?;
        let ty = state_dict_type(cfg);
        let rank0 = m.process_group().rank() == 0;
        let t0 = Instant::now();
        let mut saved = Saved::default();
        match &mut self.background {
            None => {
                save_checkpoint(&dir, m, Some(opt), ty, extra)?;
                if rank0 {
                    publish(root, &name, cfg.keep_last, &run.run_id)?;
                }
                saved.committed.push((step, dir));
            }
            Some(bg) => {
                let visible = bg.save_checkpoint_async(&dir, m, Some(opt), ty, extra)?;
                saved.committed = with_steps(visible);
            }
        }
        saved.stall_s = Some(t0.elapsed().as_secs_f64());
        Ok(saved)
    }

    /// The end of training: waits for the background save in flight and commits it. A
    /// collective.
    ///
    /// # Errors
    /// The failure of a background write or index, naming the file.
    pub(super) fn finish(&mut self) -> Result<Saved> {
        let committed = match &mut self.background {
            Some(bg) => with_steps(bg.wait()?),
            None => Vec::new(),
        };
        Ok(Saved {
            committed,
            stall_s: None,
        })
    }
}
