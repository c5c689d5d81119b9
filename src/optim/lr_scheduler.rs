//! Learning-rate schedules with the semantics of `torch.optim.lr_scheduler`
//! (`torch/optim/lr_scheduler.py`): [`LinearLR`], [`CosineAnnealingLR`], [`StepLR`] and
//! [`SequentialLR`] chaining them, each a closed form of the epoch (the count of
//! `scheduler.step()` calls) and a group's initial lr; [`Scheduler`] drives an optimizer's
//! parameter groups with one, as a PyTorch scheduler object does.
//!
//! Learning rates are computed in f64, as PyTorch's Python floats, and rounded to f32 when
//! set on the optimizer. PyTorch's `step()` updates most schedulers recursively from the
//! previous lr (`get_lr`); the closed forms here (`_get_closed_form_lr`) equal it up to f64
//! rounding (checked against PyTorch 2.11's values, `tests/nn_optim/lr_scheduler.rs`).

use super::Optimizer;
use crate::error::{Error, Result};

/// A schedule: the learning rate at `epoch` (0 before the first `step()`) of a parameter
/// group whose initial learning rate is `base_lr`.
pub trait LrScheduler: Send + Sync + std::fmt::Debug {
    /// The learning rate of epoch `epoch` for initial learning rate `base_lr`.
    fn lr(&self, base_lr: f64, epoch: usize) -> f64;

    /// Checks the schedule's own arguments as PyTorch's constructor does ([`Scheduler::new`]
    /// and [`SequentialLR::new`] call it).
    ///
    /// # Errors
    /// `InvalidArgument` naming the schedule and the argument.
    fn validate(&self) -> Result<()> {
        Ok(())
    }
}

/// `LinearLR(start_factor, end_factor, total_iters)`: the factor moves linearly from
/// `start_factor` at epoch 0 to `end_factor` at `total_iters`, and stays there (a linear
/// warm-up with `end_factor` 1). `total_iters = 0` gives `end_factor` from the start.
///
/// ```
/// use fsdp::optim::{LinearLR, LrScheduler};
/// let warm = LinearLR { start_factor: 0.25, end_factor: 1.0, total_iters: 3 };
/// assert_eq!(warm.lr(0.1, 0), 0.025);
/// assert_eq!(warm.lr(0.1, 3), 0.1);
/// assert_eq!(warm.lr(0.1, 100), 0.1);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearLR {
    /// Factor of the base lr at epoch 0, in `(0, 1]` (PyTorch's default 1/3).
    pub start_factor: f64,
    /// Factor from `total_iters` on, in `[0, 1]` (default 1).
    pub end_factor: f64,
    /// Epochs the factor takes to get there (default 5).
    pub total_iters: usize,
}

impl LrScheduler for LinearLR {
    fn validate(&self) -> Result<()> {
        // torch: "Starting multiplicative factor expected to be greater than 0 and less or
        // equal to 1", "Ending multiplicative factor expected to be between 0 and 1."
        if !(self.start_factor > 0.0 && self.start_factor <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "LinearLR: start_factor {} must be in (0, 1]",
                self.start_factor
            )));
        }
        if !(0.0..=1.0).contains(&self.end_factor) {
            return Err(Error::InvalidArgument(format!(
                "LinearLR: end_factor {} must be in [0, 1]",
                self.end_factor
            )));
        }
        Ok(())
    }

    fn lr(&self, base_lr: f64, epoch: usize) -> f64 {
        if self.total_iters == 0 {
            return base_lr * self.end_factor;
        }
        let t = epoch.min(self.total_iters) as f64 / self.total_iters as f64;
        base_lr * (self.start_factor + (self.end_factor - self.start_factor) * t)
    }
}

/// `CosineAnnealingLR(T_max, eta_min)`: `eta_min + (base - eta_min) (1 + cos(pi e /
/// T_max)) / 2`, from the base lr at epoch 0 to `eta_min` at `T_max` (and back up after,
/// as PyTorch's). `t_max = 0` is treated as 1.
///
/// ```
/// use fsdp::optim::{CosineAnnealingLR, LrScheduler};
/// let cos = CosineAnnealingLR { t_max: 10, eta_min: 0.001 };
/// assert_eq!(cos.lr(0.1, 0), 0.1);
/// assert!((cos.lr(0.1, 5) - 0.0505).abs() < 1e-12);
/// assert!((cos.lr(0.1, 10) - 0.001).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineAnnealingLR {
    /// Half-period in epochs (`T_max`).
    pub t_max: usize,
    /// The lowest learning rate (`eta_min`, default 0), absolute, not a factor.
    pub eta_min: f64,
}

impl LrScheduler for CosineAnnealingLR {
    fn validate(&self) -> Result<()> {
        if !(self.eta_min.is_finite() && self.eta_min >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "CosineAnnealingLR: eta_min {} must be finite and >= 0",
                self.eta_min
            )));
        }
        Ok(())
    }

    fn lr(&self, base_lr: f64, epoch: usize) -> f64 {
        let t = epoch as f64 / self.t_max.max(1) as f64;
        self.eta_min + (base_lr - self.eta_min) * (1.0 + (std::f64::consts::PI * t).cos()) / 2.0
    }
}

/// `StepLR(step_size, gamma)`: `base * gamma^(epoch / step_size)` (integer division).
///
/// ```
/// use fsdp::optim::{LrScheduler, StepLR};
/// let s = StepLR { step_size: 3, gamma: 0.5 };
/// assert_eq!([s.lr(0.1, 2), s.lr(0.1, 3), s.lr(0.1, 6)], [0.1, 0.05, 0.025]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLR {
    /// Epochs between decays, at least 1.
    pub step_size: usize,
    /// Multiplicative decay (default 0.1).
    pub gamma: f64,
}

impl LrScheduler for StepLR {
    fn validate(&self) -> Result<()> {
        // torch divides by step_size (ZeroDivisionError at the first step).
        if self.step_size == 0 {
            return Err(Error::InvalidArgument(
                "StepLR: step_size 0; it must be at least 1".into(),
            ));
        }
        if !(self.gamma.is_finite() && self.gamma >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "StepLR: gamma {} must be finite and >= 0",
                self.gamma
            )));
        }
        Ok(())
    }

    fn lr(&self, base_lr: f64, epoch: usize) -> f64 {
        base_lr * self.gamma.powi((epoch / self.step_size.max(1)) as i32)
    }
}

/// `SequentialLR(schedulers, milestones)`: scheduler `i` runs from milestone `i - 1` (0
/// for the first) and sees epochs counted from there, as PyTorch restarts each at its
/// milestone.
///
/// ```
/// use fsdp::optim::{CosineAnnealingLR, LinearLR, LrScheduler, SequentialLR};
/// // nanoGPT-like: 4 warm-up epochs from lr/4, then a cosine down to 0.01 over 9.
/// let s = SequentialLR::new(
///     vec![
///         Box::new(LinearLR { start_factor: 0.25, end_factor: 1.0, total_iters: 3 }),
///         Box::new(CosineAnnealingLR { t_max: 9, eta_min: 0.01 }),
///     ],
///     vec![4],
/// )
/// .unwrap();
/// assert_eq!(s.lr(0.1, 0), 0.025);
/// assert_eq!(s.lr(0.1, 4), 0.1);
/// assert!((s.lr(0.1, 13) - 0.01).abs() < 1e-15);
/// ```
#[derive(Debug)]
pub struct SequentialLR {
    schedulers: Vec<Box<dyn LrScheduler>>,
    milestones: Vec<usize>,
}

impl SequentialLR {
    /// `schedulers` switched at `milestones` (one fewer, increasing).
    ///
    /// # Errors
    /// `InvalidArgument` when the counts do not match, the milestones do not increase, or a
    /// schedule's arguments are out of range ([`LrScheduler::validate`]).
    pub fn new(schedulers: Vec<Box<dyn LrScheduler>>, milestones: Vec<usize>) -> Result<Self> {
        schedulers.iter().try_for_each(|s| s.validate())?;
        if schedulers.is_empty() || milestones.len() + 1 != schedulers.len() {
            return Err(Error::InvalidArgument(format!(
                "SequentialLR: {} schedulers need {} milestones, got {}",
                schedulers.len(),
                schedulers.len().saturating_sub(1),
                milestones.len()
            )));
        }
        if milestones.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::InvalidArgument(format!(
                "SequentialLR: milestones {milestones:?} must increase"
            )));
        }
        Ok(SequentialLR {
            schedulers,
            milestones,
        })
    }
}

impl SequentialLR {
    /// `first` until `milestone`, then `then` (counting epochs from the milestone): the
    /// two-scheduler case, which cannot fail.
    pub fn pair(
        first: Box<dyn LrScheduler>,
        milestone: usize,
        then: Box<dyn LrScheduler>,
    ) -> SequentialLR {
        SequentialLR {
            schedulers: vec![first, then],
            milestones: vec![milestone],
        }
    }
}

impl LrScheduler for SequentialLR {
    fn validate(&self) -> Result<()> {
        self.schedulers.iter().try_for_each(|s| s.validate())
    }

    fn lr(&self, base_lr: f64, epoch: usize) -> f64 {
        let i = self.milestones.partition_point(|&m| m <= epoch);
        let start = if i == 0 { 0 } else { self.milestones[i - 1] };
        self.schedulers[i].lr(base_lr, epoch - start)
    }
}

/// A schedule applied to an optimizer, as a PyTorch scheduler object: built after the
/// optimizer, it records each group's learning rate as its `initial_lr` and sets epoch 0's;
/// every [`step`](Self::step) advances one epoch and sets each group's lr to the schedule's
/// value for its initial lr.
///
/// ```
/// use fsdp::optim::{Optimizer, Scheduler, SgdConfig, StepLR, SGD};
/// let mut opt = SGD::new(SgdConfig { lr: 0.1, ..Default::default() });
/// let mut sched = Scheduler::new(Box::new(StepLR { step_size: 2, gamma: 0.5 }), &mut opt).unwrap();
/// sched.step(&mut opt).unwrap();
/// assert_eq!(opt.lr(), 0.1);
/// sched.step(&mut opt).unwrap(); // epoch 2
/// assert_eq!(opt.lr(), 0.05);
/// assert_eq!(sched.last_epoch(), 2);
/// ```
#[derive(Debug)]
pub struct Scheduler {
    schedule: Box<dyn LrScheduler>,
    base_lrs: Vec<f64>,
    last_epoch: usize,
}

impl Scheduler {
    /// Starts `schedule` on `opt` at epoch 0 (sets each group's lr to epoch 0's value).
    ///
    /// # Errors
    /// `InvalidArgument` when the schedule's arguments are out of range
    /// ([`LrScheduler::validate`]) or it gives a NaN, infinite or negative lr.
    pub fn new(schedule: Box<dyn LrScheduler>, opt: &mut dyn Optimizer) -> Result<Self> {
        schedule.validate()?;
        let base_lrs = opt.group_lrs().into_iter().map(f64::from).collect();
        let s = Scheduler {
            schedule,
            base_lrs,
            last_epoch: 0,
        };
        s.apply(opt)?;
        Ok(s)
    }

    /// Sets the learning rates of epoch [`last_epoch`](Self::last_epoch) on `opt`.
    fn apply(&self, opt: &mut dyn Optimizer) -> Result<()> {
        let lrs: Vec<f32> = self.lrs_at(self.last_epoch);
        opt.set_group_lrs(&lrs)
    }

    /// Each group's learning rate at `epoch`, rounded to f32.
    pub fn lrs_at(&self, epoch: usize) -> Vec<f32> {
        self.base_lrs
            .iter()
            .map(|&b| self.schedule.lr(b, epoch) as f32)
            .collect()
    }

    /// One epoch on (`scheduler.step()`): sets each group's lr on `opt`.
    ///
    /// # Errors
    /// As [`Scheduler::new`]; `InvalidArgument` when `opt` has another group count.
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        self.last_epoch += 1;
        self.apply(opt)
    }

    /// Moves to `epoch` (`scheduler.step(epoch)`, or the restored `last_epoch` of a
    /// resumed run) and sets its learning rates on `opt`.
    ///
    /// # Errors
    /// As [`Scheduler::step`].
    pub fn set_epoch(&mut self, opt: &mut dyn Optimizer, epoch: usize) -> Result<()> {
        self.last_epoch = epoch;
        self.apply(opt)
    }

    /// The epoch the learning rates were last set for (`last_epoch`).
    pub fn last_epoch(&self) -> usize {
        self.last_epoch
    }

    /// The learning rates last set (`get_last_lr()`).
    pub fn last_lr(&self) -> Vec<f32> {
        self.lrs_at(self.last_epoch)
    }

    /// Each group's initial learning rate (`base_lrs`).
    pub fn base_lrs(&self) -> &[f64] {
        &self.base_lrs
    }
}
