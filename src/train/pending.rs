//! Steps whose loss and gradient norm are still on the device. On a GPU, reading a step's
//! loss to the host makes the host wait for the whole step, and then the device waits for
//! the host to queue the next one: the CPU can no longer run ahead (PyTorch's training
//! loops read the loss only on the steps they log, `loss.item()` every `log_interval`).
//!
//! So on CUDA each step writes its loss (and grad norm) into a slot of one small device
//! buffer, and the steps are *flushed* together: one copy of the buffer to the host (one
//! synchronization), then the host-side work every record needs (the mean over ranks, the
//! ranks' memory figures), then the records in step order. A flush happens on the steps
//! `--log-every` names, at evaluations, checkpoints and the last step, and when the buffer
//! is full. Each step's wall time is then its window's average (the host ran ahead, so a
//! step's own host time would measure nothing). On the CPU every step flushes at once:
//! reading costs nothing there, and the records are as they always were.

use super::engine::{RankMemory, MEMORY_WORDS};
use crate::backend::counters::Counters;
use crate::backend::Device;
use crate::distributed::{staged, Group};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use std::time::Instant;

/// Steps a flush can hold (loss and grad norm slots for each).
const CAP: usize = 64;

/// One finished step whose device values are not read yet.
struct Step {
    step: usize,
    mem: RankMemory,
    c0: Counters,
    counters: Counters,
    has_norm: bool,
    scaled: Option<Scaled>,
}

/// What the grad scaler did in a step (host values, the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Scaled {
    /// The scale the step's backward used.
    pub loss_scale: f32,
    /// Whether the optimizer step was skipped (inf/NaN gradients on some rank).
    pub skipped: bool,
}

/// What a flush gives for each step, in step order.
pub(super) struct Flushed {
    /// The step number.
    pub step: usize,
    /// Mean loss over the ranks.
    pub loss: f32,
    /// Global gradient norm, when clipping.
    pub grad_norm: Option<f32>,
    /// The grad scaler's record of the step, when it scales.
    pub scaled: Option<Scaled>,
    /// Every rank's memory figures.
    pub ranks: Vec<RankMemory>,
    /// Wall seconds: the step's own on the CPU, its window's average on CUDA.
    pub step_time_s: f64,
    /// What the step asked of the host (see `StepRecord::counters`).
    pub counters: Counters,
}

/// The steps since the last flush and their slots.
pub(super) struct Pending {
    device: Device,
    /// `[2 * CAP]` f32 on the device: losses, then grad norms.
    slots: Tensor,
    steps: Vec<Step>,
    window_start: Instant,
}

impl Pending {
    /// An empty window on `device`.
    ///
    /// # Errors
    /// The device's allocation errors.
    pub fn new(device: Device) -> Result<Pending> {
        Ok(Pending {
            device,
            slots: Tensor::zeros_on(&[2 * CAP], DType::F32, device)?,
            steps: Vec::with_capacity(CAP),
            window_start: Instant::now(),
        })
    }

    /// Starts a step: its counter reading, and its zeroed loss slot (one f32 on the
    /// device) for the micro-batches to accumulate into.
    ///
    /// # Errors
    /// The device's errors.
    pub fn begin(&mut self) -> Result<(Counters, Tensor)> {
        if self.steps.is_empty() {
            self.window_start = Instant::now();
        }
        let c0 = Counters::now();
        let slot = self.slots.view(self.steps.len(), &[1])?;
        crate::ops::fill_(&slot, 0.0)?;
        Ok((c0, slot))
    }

    /// Starts a step whose loss and grad norm a CUDA graph computes (`graph_step.rs`): its
    /// counter reading and its two slots, not zeroed (the graph's values are copied in).
    ///
    /// # Errors
    /// A slot view's errors.
    pub fn begin_graph(&mut self) -> Result<(Counters, Tensor, Tensor)> {
        if self.steps.is_empty() {
            self.window_start = Instant::now();
        }
        let i = self.steps.len();
        Ok((
            Counters::now(),
            self.slots.view(i, &[1])?,
            self.slots.view(CAP + i, &[1])?,
        ))
    }

    /// Copies the step's grad norm (one f32, on any device: under CPU offload the
    /// gradients and their norm are on the host) into its slot.
    ///
    /// # Errors
    /// The device's errors.
    pub fn set_grad_norm(&self, norm: &Tensor) -> Result<()> {
        let slot = self.slots.view(CAP + self.steps.len(), &[1])?;
        // A copy (one launch on a GPU): the norm is never -0, so 0 + norm would be the same.
        slot.copy_from(&norm.to_device(self.device)?)
    }

    /// Ends the step begun with `c0` (`scaled`: the grad scaler's record of it); true when
    /// it must flush now: always on the CPU, else when `due` (a logged, evaluated, saved or
    /// last step) or the slots are full.
    pub fn end(
        &mut self,
        step: usize,
        mem: RankMemory,
        c0: Counters,
        has_norm: bool,
        scaled: Option<Scaled>,
        due: bool,
    ) -> bool {
        self.steps.push(Step {
            step,
            mem,
            c0,
            counters: Counters::now().since(&c0),
            has_norm,
            scaled,
        });
        !self.device.is_cuda() || due || self.steps.len() == CAP
    }

    /// Reads every pending step's values (one synchronization on CUDA), averages the
    /// losses over the ranks and gathers the ranks' memory figures (collectives every
    /// rank runs at the same steps: the flush points depend only on the configuration).
    ///
    /// # Errors
    /// `Fsdp` when a loss is not finite, naming the step; device and collective errors
    /// (among them an index check of an earlier kernel, see `backend::cuda`).
    pub fn flush(&mut self, pg: &Group) -> Result<Vec<Flushed>> {
        let n = self.steps.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let values = self.slots.to_vec_f32()?;
        // One collective for the whole window: every rank's losses (f32 bits) and memory
        // figures, per step. On NCCL each collective of host values costs a copy back, so
        // a logged step reads the device twice (the slots, this gather), not once per step.
        let per_step = 1 + MEMORY_WORDS;
        let mut words = Vec::with_capacity(n * per_step);
        for (i, s) in self.steps.iter().enumerate() {
            words.push(values[i].to_bits() as i32);
            words.extend(s.mem.to_words());
        }
        let local = Tensor::from_vec(words, &[n * per_step])?;
        let all = Tensor::zeros(&[n * per_step * pg.size()], DType::I32);
        staged::all_gather_into_tensor(pg.as_ref(), &all, &local)?;
        let all = all.data::<i32>()?;
        let rank_words = |r: usize, i: usize| &all[(r * n + i) * per_step..][..per_step];
        let mut out = Vec::with_capacity(n);
        for (i, s) in self.steps.iter().enumerate() {
            // The mean as the collectives' Avg computes it: f64 sum in rank order, divided
            // by the group size, rounded once to f32.
            let sum: f64 = (0..pg.size())
                .map(|r| f64::from(f32::from_bits(rank_words(r, i)[0] as u32)))
                .sum();
            let loss = (sum / pg.size() as f64) as f32;
            if !loss.is_finite() {
                return Err(Error::Fsdp(format!(
                    "loss became {loss} at step {}; lower --lr",
                    s.step
                )));
            }
            out.push(Flushed {
                step: s.step,
                loss,
                grad_norm: s.has_norm.then_some(values[CAP + i]),
                scaled: s.scaled,
                ranks: (0..pg.size())
                    .map(|r| RankMemory::from_words(r, &rank_words(r, i)[1..]))
                    .collect(),
                step_time_s: 0.0,
                counters: s.counters,
            });
        }
        // The flushing step's counters include the flush; the window's time is shared.
        if let (Some(last), Some(s)) = (out.last_mut(), self.steps.last()) {
            last.counters = Counters::now().since(&s.c0);
        }
        let per_step = self.window_start.elapsed().as_secs_f64() / n as f64;
        for f in &mut out {
            f.step_time_s = per_step;
        }
        self.steps.clear();
        Ok(out)
    }
}
