//! [`ShardedGradScaler`]: dynamic loss scaling for f16 mixed precision, with PyTorch's
//! semantics (`torch/distributed/fsdp/sharded_grad_scaler.py` over
//! `torch/amp/grad_scaler.py`).
//!
//! f16 holds magnitudes from 6e-8 (subnormal) to 65504: small gradients of a real model
//! underflow to zero in an f16 backward. The scaler multiplies the loss (here: the loss
//! gradient that starts backward, see [`ShardedGradScaler::loss_grad_output`]) by a large
//! scale `S`, so every gradient of the backward is `S` times larger; before the optimizer
//! step it divides the gradients by `S` again ([`ShardedGradScaler::unscale_`]) and checks
//! them for inf/NaN. A step whose gradients overflowed is skipped
//! ([`ShardedGradScaler::step`]) and the scale backs off; after `growth_interval` clean
//! steps it grows ([`ShardedGradScaler::update`]). Each rank checks only its own gradient
//! shards, so the found-inf flag is all-reduced (max) over the scaler's process group
//! (PyTorch's default: the WORLD group, which holds every rank of every shard and
//! replicate group of hybrid sharding): every rank skips the same steps and backs off
//! alike.
//!
//! The loop, as PyTorch's (clipping sees the true gradients, so it comes after `unscale_`):
//!
//! ```text
//! let g = scaler.loss_grad_output()?;            // scaler.scale(loss)
//! let (loss, dy) = loss::cross_entropy_tensor_scaled(&logits, &y, g)?;
//! model.backward(&dy, &cx)?;                      // .backward()
//! let params = model.optimizer_params();
//! scaler.unscale_(&*opt, &params)?;               // scaler.unscale_(opt)
//! model.clip_grad_norm_(1.0, 2.0)?;               // clip_grad_norm_(...)
//! scaler.step(&mut *opt, &params)?;               // scaler.step(opt)
//! scaler.update()?;                               // scaler.update()
//! ```
//!
//! The scale and its growth tracker are host values (PyTorch keeps them in one-element
//! device tensors): `step` must know on the host whether to call the optimizer, as
//! PyTorch's `_maybe_opt_step` reads `found_inf.item()`, so the update costs nothing more
//! there. On CUDA that read is one synchronization per step.

use crate::distributed::{staged, Group, ReduceOp};
use crate::error::{Error, Result};
use crate::optim::{Optimizer, ParamGrad};
use crate::tensor::Tensor;

/// The constructor arguments of [`ShardedGradScaler`], PyTorch's defaults by `Default`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale, default 2^16 = 65536 (`init_scale`). Finite and positive.
    pub init_scale: f32,
    /// Factor applied after `growth_interval` steps without inf/NaN, default 2.0; above 1.
    pub growth_factor: f64,
    /// Factor applied after a step with inf/NaN gradients, default 0.5; in (0, 1).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows, default 2000; at least 1.
    pub growth_interval: u32,
    /// `false`: every method is a no-op but [`step`](ShardedGradScaler::step), which calls
    /// the optimizer; the scale reads 1. Default `true`.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// A scaler's state (`GradScaler.state_dict()`): what a checkpoint keeps so that a resumed
/// run goes on with the same scale. The JSON names are PyTorch's keys.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GradScalerState {
    /// The current scale (`"scale"`).
    pub scale: f32,
    /// `"growth_factor"`.
    pub growth_factor: f64,
    /// `"backoff_factor"`.
    pub backoff_factor: f64,
    /// `"growth_interval"`.
    pub growth_interval: u32,
    /// Clean steps since the scale last changed (`"_growth_tracker"`), below
    /// `growth_interval`.
    #[serde(rename = "_growth_tracker")]
    pub growth_tracker: u32,
}

impl GradScalerState {
    /// Checks what a scaler could hold: a finite positive scale, `growth_factor > 1`,
    /// `0 < backoff_factor < 1`, `growth_interval >= 1`, `growth_tracker <
    /// growth_interval`.
    ///
    /// # Errors
    /// `StateDict` naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::StateDict(format!("grad scaler state: {m}")));
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return bad(format!(
                "scale {} is not a finite positive number",
                self.scale
            ));
        }
        check_factors(
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )
        .or_else(bad)?;
        if self.growth_tracker >= self.growth_interval {
            return bad(format!(
                "_growth_tracker {} is not below growth_interval {}",
                self.growth_tracker, self.growth_interval
            ));
        }
        Ok(())
    }
}

/// The factors' rules (PyTorch asserts the first two); the problem as text.
fn check_factors(growth: f64, backoff: f64, interval: u32) -> std::result::Result<(), String> {
    if !(growth.is_finite() && growth > 1.0) {
        return Err(format!(
            "growth_factor must be a finite number > 1.0, got {growth}"
        ));
    }
    if !(backoff > 0.0 && backoff < 1.0) {
        return Err(format!("backoff_factor must be in (0, 1), got {backoff}"));
    }
    if interval == 0 {
        return Err("growth_interval must be at least 1".into());
    }
    Ok(())
}

/// Where one optimizer is in the current iteration (`OptState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Its gradients are still scaled.
    Ready,
    /// `unscale_` ran (and checked them).
    Unscaled,
    /// `step` ran.
    Stepped,
}

/// One optimizer's record of the iteration: PyTorch's `_per_optimizer_states[id(opt)]`.
#[derive(Debug, Clone, Copy)]
struct PerOptimizer {
    /// The optimizer's address: the same optimizer object is the same id.
    id: usize,
    stage: Stage,
    /// The all-reduced found-inf flag of its gradients, once `unscale_` ran.
    found_inf: bool,
}

/// Dynamic loss scaling across the ranks of a process group
/// (`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`); see the module docs
/// for the loop. Works on any list of gradients (FSDP's local shards, whole parameters,
/// on the host or a GPU, f32, f64, bf16 or f16); meant for f16 mixed precision, where
/// gradients underflow without it (bf16 has f32's range and needs none, though scaling it
/// is harmless, and PyTorch neither warns nor refuses).
pub struct ShardedGradScaler {
    enabled: bool,
    scale: f32,
    growth_tracker: u32,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u32,
    /// Whether the loss was ever scaled (PyTorch creates `_scale` lazily in `scale()`, and
    /// `unscale_`/`step`/`update` before that are errors).
    scaled: bool,
    process_group: Option<Group>,
    optimizers: Vec<PerOptimizer>,
}

impl std::fmt::Debug for ShardedGradScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedGradScaler")
            .field("enabled", &self.enabled)
            .field("scale", &self.scale)
            .field("growth_tracker", &self.growth_tracker)
            .field("group_size", &self.process_group.as_ref().map(|g| g.size()))
            .finish()
    }
}

/// The identity of an optimizer object (its address), as PyTorch's `id(optimizer)`.
fn optimizer_id(o: &dyn Optimizer) -> usize {
    (o as *const dyn Optimizer).cast::<()>() as usize
}

/// `torch._amp_update_scale_`: the next `(scale, growth_tracker)` after a step that found
/// inf/NaN (`found_inf`) or not. Backoff multiplies by `backoff` and resets the tracker;
/// a clean step counts, and the `interval`-th in a row multiplies by `growth` (in f64,
/// rounded to f32; kept only when finite, as the CUDA kernel does) and resets it.
fn next_scale(
    (scale, tracker): (f32, u32),
    found_inf: bool,
    growth: f64,
    backoff: f64,
    interval: u32,
) -> (f32, u32) {
    if found_inf {
        return ((f64::from(scale) * backoff) as f32, 0);
    }
    let successful = tracker + 1;
    if successful < interval {
        return (scale, successful);
    }
    let grown = (f64::from(scale) * growth) as f32;
    (if grown.is_finite() { grown } else { scale }, 0)
}

impl ShardedGradScaler {
    /// A scaler with `config`, whose found-inf flags are all-reduced over
    /// `process_group` (PyTorch's default is the WORLD group: pass the group every rank
    /// training the model is in, such as the FSDP root's
    /// [`process_group`](super::FullyShardedDataParallel::process_group); `None` for one
    /// process alone).
    ///
    /// # Errors
    /// `InvalidArgument` (only when `enabled`) for an `init_scale` that is not finite and
    /// positive, `growth_factor <= 1`, `backoff_factor` outside (0, 1) or a
    /// `growth_interval` of 0.
    pub fn new(config: GradScalerConfig, process_group: Option<Group>) -> Result<Self> {
        let c = config;
        if c.enabled {
            if !(c.init_scale.is_finite() && c.init_scale > 0.0) {
                crate::error::bail_arg!(
                    "ShardedGradScaler: init_scale must be a finite positive number, got {}",
                    c.init_scale
                );
            }
            check_factors(c.growth_factor, c.backoff_factor, c.growth_interval)
                .map_err(|m| Error::InvalidArgument(format!("ShardedGradScaler: {m}")))?;
        }
        Ok(ShardedGradScaler {
            enabled: c.enabled,
            scale: c.init_scale,
            growth_tracker: 0,
            growth_factor: c.growth_factor,
            backoff_factor: c.backoff_factor,
            growth_interval: c.growth_interval,
            scaled: false,
            process_group,
            optimizers: Vec::new(),
        })
    }

    /// Whether the scaler scales (`is_enabled()`).
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The current scale (`get_scale()`); 1 when disabled.
    pub fn get_scale(&self) -> f32 {
        if self.enabled {
            self.scale
        } else {
            1.0
        }
    }

    /// Clean steps counted toward the next growth (`_get_growth_tracker()`); 0 when
    /// disabled.
    pub fn growth_tracker(&self) -> u32 {
        if self.enabled {
            self.growth_tracker
        } else {
            0
        }
    }

    /// `scaler.scale(loss)` for a backward that starts from the loss gradient: the factor
    /// to start it with, the current scale (1 when disabled). Pass it as the `grad_output`
    /// of a scaled loss ([`crate::nn::loss::cross_entropy_tensor_scaled`],
    /// [`crate::nn::loss::mse_loss_scaled`]), which applies it before a low-precision
    /// gradient is rounded, as PyTorch's backward of the scaled loss does; or scale a loss
    /// gradient you have with [`scale_grad_`](Self::scale_grad_).
    pub fn loss_grad_output(&mut self) -> f32 {
        self.scaled = true;
        self.get_scale()
    }

    /// `scaler.scale(loss)` for a loss gradient `grad` already computed: multiplies it in
    /// place by the scale (nothing when disabled). Exact in f32 and f64 for a power-of-two
    /// scale (every scale with the default factors); a bf16/f16 `grad` is multiplied after
    /// its rounding, so values it rounded to zero stay zero: prefer a scaled loss
    /// ([`loss_grad_output`](Self::loss_grad_output)) there.
    ///
    /// # Errors
    /// As [`crate::ops::scale_`].
    pub fn scale_grad_(&mut self, grad: &Tensor) -> Result<()> {
        let s = self.loss_grad_output();
        if s != 1.0 {
            crate::ops::scale_(grad, s)?;
        }
        Ok(())
    }

    /// Refuses `what` before the loss was ever scaled: its gradients would be divided by a
    /// scale they were never multiplied by.
    fn check_scaled(&self, what: &str) -> Result<()> {
        if self.scaled {
            return Ok(());
        }
        Err(Error::Fsdp(format!(
            "ShardedGradScaler.{what}() before the loss was ever scaled: call loss_grad_output() (or scale_grad_()) for the loss of the iteration first (PyTorch: scaler.scale(loss))"
        )))
    }

    /// The record of optimizer `id` in this iteration, made `Ready` on first sight.
    fn record(&mut self, id: usize) -> &mut PerOptimizer {
        let i = match self.optimizers.iter().position(|o| o.id == id) {
            Some(i) => i,
            None => {
                self.optimizers.push(PerOptimizer {
                    id,
                    stage: Stage::Ready,
                    found_inf: false,
                });
                self.optimizers.len() - 1
            }
        };
        &mut self.optimizers[i]
    }

    /// Divides the gradients of `params` (the list `optimizer` steps on) by the scale, in
    /// place, and records whether any rank's held inf/NaN (`unscale_(optimizer)`): each
    /// rank checks its own gradients ([`crate::ops::non_finite_check_and_unscale_`], the
    /// reciprocal computed in f64 and rounded to f32 as PyTorch does), then the flag is
    /// all-reduced with max over the process group, a collective every rank calls. Call it
    /// before anything that must see the true gradients (`clip_grad_norm_`); else
    /// [`step`](Self::step) calls it. A no-op when disabled.
    ///
    /// # Errors
    /// `Fsdp` when called twice for one optimizer in an iteration (before
    /// [`update`](Self::update)), after its `step`, or before the loss was ever scaled;
    /// the op's and the collective's errors.
    pub fn unscale_(&mut self, optimizer: &dyn Optimizer, params: &[ParamGrad]) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        self.check_scaled("unscale_")?;
        let id = optimizer_id(optimizer);
        match self.record(id).stage {
            Stage::Ready => {}
            Stage::Unscaled => {
                return Err(Error::Fsdp(
                    "ShardedGradScaler.unscale_() has already been called on this optimizer since the last update()".into(),
                ))
            }
            Stage::Stepped => {
                return Err(Error::Fsdp(
                    "ShardedGradScaler.unscale_() is being called after step(); call update() first".into(),
                ))
            }
        }
        let inv_scale = (1.0 / f64::from(self.scale)) as f32;
        let grads: Vec<&Tensor> = params.iter().filter_map(|p| p.grad.as_ref()).collect();
        let local = crate::ops::non_finite_check_and_unscale_(&grads, inv_scale)?;
        let found_inf = match &self.process_group {
            Some(pg) => {
                let t = Tensor::from_vec(vec![f32::from(u8::from(local))], &[1])?;
                staged::all_reduce(pg.as_ref(), &t, ReduceOp::Max)?;
                let any = t.f32()?[0] != 0.0;
                any
            }
            None => local,
        };
        let rec = self.record(id);
        rec.stage = Stage::Unscaled;
        rec.found_inf = found_inf;
        Ok(())
    }

    /// `step(optimizer)`: unscales first when [`unscale_`](Self::unscale_) was not called,
    /// then runs `optimizer.step(params)` unless some rank's gradients held inf/NaN.
    /// Returns whether the optimizer stepped (the same on every rank). Disabled: steps.
    ///
    /// # Errors
    /// `Fsdp` when called twice for one optimizer before [`update`](Self::update) or
    /// before the loss was ever scaled; [`unscale_`](Self::unscale_)'s and the
    /// optimizer's errors.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer, params: &[ParamGrad]) -> Result<bool> {
        if !self.enabled {
            optimizer.step(params)?;
            return Ok(true);
        }
        self.check_scaled("step")?;
        let id = optimizer_id(optimizer);
        match self.record(id).stage {
            Stage::Stepped => {
                return Err(Error::Fsdp(
                    "ShardedGradScaler.step() has already been called since the last update()"
                        .into(),
                ))
            }
            Stage::Ready => self.unscale_(optimizer, params)?,
            Stage::Unscaled => {}
        }
        let rec = self.record(id);
        rec.stage = Stage::Stepped;
        let skip = rec.found_inf;
        if !skip {
            optimizer.step(params)?;
        }
        Ok(!skip)
    }

    /// `update()`: ends the iteration. When some optimizer's gradients held inf/NaN the
    /// scale is multiplied by `backoff_factor` and the tracker reset; otherwise the tracker
    /// counts the clean step, and the `growth_interval`-th in a row multiplies the scale by
    /// `growth_factor` (kept only when finite) and resets it. Every rank computes the same
    /// (the flags were all-reduced). A no-op when disabled.
    ///
    /// # Errors
    /// `Fsdp` when no optimizer was unscaled or stepped in this iteration, or before the
    /// loss was ever scaled.
    pub fn update(&mut self) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        self.check_scaled("update")?;
        if self.optimizers.iter().all(|o| o.stage == Stage::Ready) {
            return Err(Error::Fsdp(
                "ShardedGradScaler.update(): no inf checks were recorded in this iteration (call unscale_() or step() first)".into(),
            ));
        }
        let found_inf = self.optimizers.iter().any(|o| o.found_inf);
        (self.scale, self.growth_tracker) = next_scale(
            (self.scale, self.growth_tracker),
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        );
        self.optimizers.clear();
        Ok(())
    }

    /// The scaler's state (`state_dict()`); `None` when disabled (PyTorch's `{}`). Call it
    /// after [`update`](Self::update) (a checkpoint of a finished iteration).
    pub fn state_dict(&self) -> Option<GradScalerState> {
        self.enabled.then_some(GradScalerState {
            scale: self.scale,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            growth_tracker: self.growth_tracker,
        })
    }

    /// Restores a state from [`state_dict`](Self::state_dict) (`load_state_dict`): the
    /// scale, the factors, the interval and the tracker all come from `state`, whatever
    /// this scaler was built with. A no-op when disabled.
    ///
    /// # Errors
    /// `StateDict` for `None` (the state of a disabled scaler, as PyTorch refuses an empty
    /// state dict) and for a state [`GradScalerState::validate`] refuses; nothing changes
    /// then.
    pub fn load_state_dict(&mut self, state: Option<&GradScalerState>) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let Some(s) = state else {
            return Err(Error::StateDict(
                "the grad scaler state is empty, possibly because it was saved from a disabled scaler".into(),
            ));
        };
        s.validate()?;
        self.scale = s.scale;
        self.growth_factor = s.growth_factor;
        self.backoff_factor = s.backoff_factor;
        self.growth_interval = s.growth_interval;
        self.growth_tracker = s.growth_tracker;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::next_scale;

    #[test]
    fn scale_grows_after_the_interval_and_backs_off_on_inf() {
        let step = |s, inf| next_scale(s, inf, 2.0, 0.5, 3);
        let mut s = (1024.0, 0);
        let mut seen = Vec::new();
        for inf in [false, false, false, false, true, false, false, false] {
            s = step(s, inf);
            seen.push(s);
        }
        assert_eq!(
            seen,
            [
                (1024.0, 1),
                (1024.0, 2),
                (2048.0, 0),
                (2048.0, 1),
                (1024.0, 0),
                (1024.0, 1),
                (1024.0, 2),
                (2048.0, 0)
            ]
        );
        // Growth beyond f32's range keeps the scale (and still resets the tracker).
        assert_eq!(step((f32::MAX, 2), false), (f32::MAX, 0));
        // Interval 1: every clean step grows.
        assert_eq!(next_scale((4.0, 0), false, 2.0, 0.5, 1), (8.0, 0));
    }
}
