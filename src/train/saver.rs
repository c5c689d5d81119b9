//! When and how the main job saves: `--save-every` checkpoints, synchronous or, with
//! `--async-save`, in the background ([`AsyncCheckpointer`], PyTorch's
//! `torch.distributed.checkpoint.async_save`). A background save becomes the `latest`
//! checkpoint when it is committed: at the next save or at the end of training, after
//! every rank's files are durable. A failed background write stops the run at that point,
//! naming the file; `latest` then still names the previous checkpoint.

use super::config::TrainConfig;
use super::engine::Engine;
use super::resume::{
    checkpoint_extra, publish, save_due, state_dict_type, step_dir_name, RunRecord,
};
use crate::checkpoint::{save_checkpoint, AsyncCheckpointer};
use crate::error::Result;
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
    /// The step of the background save in flight.
    in_flight: Option<usize>,
}

impl Saver {
    /// A saver for `cfg` (`--async-save` or not).
    pub(super) fn new(cfg: &TrainConfig) -> Self {
        Saver {
            background: cfg.async_save.then(AsyncCheckpointer::new),
            in_flight: None,
        }
    }

    /// Saves a checkpoint of `step` when one is due (every `save_every` steps and after the
    /// last). A collective.
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
        let extra = checkpoint_extra(cfg, step, run)?;
        let ty = state_dict_type(cfg);
        let rank0 = m.process_group().rank() == 0;
        let t0 = Instant::now();
        let mut saved = Saved::default();
        match &mut self.background {
            None => {
                save_checkpoint(&dir, m, Some(opt), ty, extra)?;
                if rank0 {
                    publish(cfg, root, &name, run)?;
                }
                saved.committed.push((step, dir));
            }
            Some(bg) => {
                let previous = self.in_flight.take();
                if let (Some(prev), Some(_)) = (previous, bg.wait()?) {
                    if rank0 {
                        publish(cfg, root, &step_dir_name(prev), run)?;
                    }
                    saved.committed.push((prev, root.join(step_dir_name(prev))));
                }
                bg.save_checkpoint_async(&dir, m, Some(opt), ty, extra)?;
                self.in_flight = Some(step);
            }
        }
        saved.stall_s = Some(t0.elapsed().as_secs_f64());
        Ok(saved)
    }

    /// The end of training: waits for the background save in flight and commits it. A
    /// collective.
    ///
    /// # Errors
    /// The failure of that save's background write, naming the file.
    pub(super) fn finish(
        &mut self,
        cfg: &TrainConfig,
        rank: usize,
        run: &RunRecord,
    ) -> Result<Saved> {
        let mut saved = Saved::default();
        let (Some(bg), Some(root)) = (&mut self.background, &cfg.save_dir) else {
            return Ok(saved);
        };
        if let (Some(step), Some(dir)) = (self.in_flight.take(), bg.wait()?) {
            if rank == 0 {
                publish(cfg, root, &step_dir_name(step), run)?;
            }
            saved.committed.push((step, dir));
        }
        Ok(saved)
    }
}
