//! Optimizers with PyTorch's update rules and defaults, stepping on whatever tensors they are
//! given: under FSDP those are each unit's local shard of the FlatParameter and of its
//! gradient, so optimizer state is sharded exactly like the parameters (ZeRO stage 3).
//!
//! Devices: each tensor is updated where it lives. Host tensors run the plain loops below;
//! CUDA tensors are updated by the fused multi-tensor kernels of `optim.cu` (one launch per
//! device and step, on the calling thread's current stream; bitwise equal to the loops).
//! Optimizer state (momentum buffers, Adam moments) is allocated on the tensor's device and
//! follows it: state loaded by [`Optimizer::load_state_dict`] (host values) or left on
//! another device moves to the tensor's device at its next step. [`Optimizer::state_dict`]
//! always returns host vectors (copying device state to the host waits for the stream).
//!
//! | optimizer | PyTorch | file |
//! |---|---|---|
//! | [`SGD`] | `torch.optim.SGD` (momentum, dampening, nesterov, weight_decay) | `sgd.rs` |
//! | [`Adam`], [`AdamW`] | `torch.optim.Adam`, `torch.optim.AdamW` | `adam.rs` |
//! | [`StateSnapshot`] | the staging copy of `torch.distributed.checkpoint.async_save` | `snapshot.rs` |
//! | [`ParamGroup`], [`no_decay_groups`] | `optimizer.param_groups`, nanoGPT's `configure_optimizers` | `param_groups.rs` |
//! | [`LrScheduler`], [`LinearLR`], [`CosineAnnealingLR`], [`StepLR`], [`SequentialLR`], [`Scheduler`] | `torch.optim.lr_scheduler` | `lr_scheduler.rs` |
//!
//! Hyperparameters are checked as PyTorch's constructors check them (lr, eps, weight decay,
//! momentum `>= 0`, betas in `[0, 1)`, nesterov with momentum and no dampening), and none
//! may be NaN or infinite: [`Optimizer::set_lr`], [`Optimizer::set_param_groups`] and
//! [`Optimizer::load_state_dict`] refuse such values, and [`Optimizer::step`] refuses a
//! config that holds one.

mod adam;
mod fused;
mod lr_scheduler;
mod param_groups;
mod sgd;
mod snapshot;

pub use adam::{Adam, AdamConfig, AdamW};
pub use lr_scheduler::{CosineAnnealingLR, LinearLR, LrScheduler, Scheduler, SequentialLR, StepLR};
pub use param_groups::{no_decay_groups, ParamGroup};
pub use sgd::{SgdConfig, SGD};
pub use snapshot::{StateSnapshot, TensorSnapshot};

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// One tensor to update and its gradient (f32, same element count). `grad: None` skips the
/// tensor, as PyTorch skips parameters whose `.grad` is `None`.
#[derive(Clone, Debug)]
pub struct ParamGrad {
    /// The f32 tensor updated in place (under FSDP, a unit's local FlatParameter shard).
    pub param: Tensor,
    /// Its f32 gradient with the same element count (`param.grad`); `None` skips `param`.
    pub grad: Option<Tensor>,
}

/// A first-order optimizer over a fixed list of tensors. State is kept per position in the
/// list, so the caller passes the same tensors in the same order at every step.
pub trait Optimizer: Send {
    /// Applies one update to every `param` from its `grad`.
    ///
    /// # Errors
    /// `ShapeMismatch` when a grad's size differs from its param's or the list changed
    /// length since the first step; `DTypeMismatch` for non-f32 tensors.
    fn step(&mut self, params: &[ParamGrad]) -> Result<()>;

    /// Creates now the per-tensor state that the first [`step`](Self::step) would create
    /// (Adam's moments, zeros), so that the results are the same: a trainer on CUDA calls
    /// it before its first step, and the blocks the first step frees are where the second
    /// step looks for them (the state would take some of them). A no-op for state that
    /// exists already and for state made from the first gradient (SGD's momentum).
    ///
    /// # Errors
    /// As [`step`](Self::step) when the list differs from the state's; allocation errors.
    fn init_state(&mut self, params: &[ParamGrad]) -> Result<()> {
        let _ = params;
        Ok(())
    }

    /// Bytes of optimizer state held (momentum buffers, Adam moments).
    fn state_bytes(&self) -> usize;

    /// The learning rate of the optimizer's defaults (`defaults["lr"]`): every tensor's,
    /// unless [parameter groups](Self::set_param_groups) give their own.
    fn lr(&self) -> f32;

    /// Sets the learning rate of the defaults and of every parameter group.
    ///
    /// # Errors
    /// `InvalidArgument` for a NaN, infinite or negative `lr` (nothing changes).
    fn set_lr(&mut self, lr: f32) -> Result<()>;

    /// The parameter groups (`optimizer.param_groups`), `None` when every tensor is in one
    /// group with the optimizer's own lr and weight decay (the default).
    fn param_groups(&self) -> Option<&[ParamGroup]> {
        None
    }

    /// Splits the step list into parameter groups with their own lr and weight decay
    /// (`torch.optim.X([{"params": ..., "lr": ...}, ...])`). Every position of the list
    /// `step` gets must be in exactly one group (checked at each step). Kept by
    /// [`state_dict`](Self::state_dict).
    ///
    /// # Errors
    /// `InvalidArgument` for a NaN, infinite or negative option, or a position in two
    /// groups; `Unsupported` for an optimizer without groups (the default).
    fn set_param_groups(&mut self, groups: Vec<ParamGroup>) -> Result<()> {
        let _ = groups;
        Err(Error::Unsupported(
            "this optimizer does not support parameter groups".into(),
        ))
    }

    /// Each group's learning rate (one entry, [`lr`](Self::lr), without groups): what an
    /// [`lr_scheduler`](Scheduler) reads and sets.
    fn group_lrs(&self) -> Vec<f32> {
        match self.param_groups() {
            Some(g) => g.iter().map(|g| g.lr).collect(),
            None => vec![self.lr()],
        }
    }

    /// Sets each group's learning rate, in the order of [`group_lrs`](Self::group_lrs).
    ///
    /// # Errors
    /// `InvalidArgument` for a count that is not the group count or a non-finite or
    /// negative value (nothing changes).
    fn set_group_lrs(&mut self, lrs: &[f32]) -> Result<()> {
        match (self.param_groups(), lrs) {
            (None, [lr]) => self.set_lr(*lr),
            _ => Err(Error::InvalidArgument(format!(
                "{} learning rates for {} parameter groups",
                lrs.len(),
                self.param_groups().map_or(1, <[ParamGroup]>::len)
            ))),
        }
    }

    /// A copy of the hyperparameters and of every tensor's state
    /// (`torch.optim.Optimizer.state_dict()`), by position in the list given to `step`, as
    /// host vectors wherever the state lives (device state is copied to the host: this waits
    /// for the calling thread's current stream).
    ///
    /// # Errors
    /// `Unsupported` for an optimizer that cannot export its state (the default).
    fn state_dict(&self) -> Result<OptimizerState> {
        Err(Error::Unsupported(
            "this optimizer does not implement state_dict".into(),
        ))
    }

    /// The state as it stands, taken quickly: like [`state_dict`](Self::state_dict), but
    /// each state tensor is passed to `copy` (which returns a host copy of its own) and
    /// converted later, on any thread, by [`StateSnapshot::into_state`], to what
    /// `state_dict` returns now. A background checkpoint takes it on the training thread.
    /// The default converts at once (`state_dict`).
    ///
    /// # Errors
    /// As [`state_dict`](Self::state_dict); `copy`'s error.
    fn snapshot(&self, copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<StateSnapshot> {
        let _ = copy;
        self.state_dict().map(StateSnapshot::State)
    }

    /// Replaces the hyperparameters and every tensor's state with `state`
    /// (`torch.optim.Optimizer.load_state_dict`); the next `step` must get a list of the
    /// same length with the same element counts. An empty `state.tensors` resets the state
    /// (as before the first step). Nothing changes on error.
    ///
    /// # Errors
    /// `StateDict` when `state` comes from another optimizer kind, lacks a buffer or a
    /// step, or has buffers of different lengths; `Unsupported` by default.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        let _ = state;
        Err(Error::Unsupported(
            "this optimizer does not implement load_state_dict".into(),
        ))
    }
}

/// What an optimizer keeps for one tensor of its list (`optimizer.state[p]`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TensorState {
    /// Updates applied to this tensor (`state["step"]`); `None` for SGD, which counts none.
    pub step: Option<u64>,
    /// Named f32 buffers, each with the tensor's element count: `exp_avg` and `exp_avg_sq`
    /// (Adam, AdamW), `momentum_buffer` (SGD with momentum).
    pub buffers: Vec<(String, Vec<f32>)>,
    /// The exact values of an f64 parameter's buffers (PyTorch keeps the state of a
    /// float64 parameter in float64), by the same names; `buffers` then holds them rounded
    /// to f32 for readers of f32 state. Empty for other parameters.
    pub buffers_f64: Vec<(String, Vec<f64>)>,
}

impl TensorState {
    /// The buffer called `name`, if present (f32; an f64 buffer rounded).
    pub fn buffer(&self, name: &str) -> Option<&[f32]> {
        self.buffers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The f64 values of the buffer called `name`, if it was kept in f64.
    pub fn buffer_f64(&self, name: &str) -> Option<&[f64]> {
        self.buffers_f64
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Buffer `name` as a host tensor `(n)`: f64 when it was kept in f64, else f32.
    ///
    /// # Errors
    /// `StateDict` naming `kind`, tensor `i` and `name` when the buffer is missing.
    pub(crate) fn buffer_tensor(&self, kind: &str, i: usize, name: &str) -> Result<Tensor> {
        if let Some(v) = self.buffer_f64(name) {
            return Tensor::from_vec(v.to_vec(), &[v.len()]);
        }
        let v = self.buffer(name).ok_or_else(|| {
            Error::StateDict(format!("{kind} state of tensor {i} has no '{name}'"))
        })?;
        Tensor::from_vec(v.to_vec(), &[v.len()])
    }

    /// A state whose buffers are `bufs` (host values): f32 ones as they are, f64 ones both
    /// exactly (`buffers_f64`) and rounded (`buffers`).
    ///
    /// # Errors
    /// A failed read of a tensor (CUDA copy).
    pub(crate) fn from_tensors(step: Option<u64>, bufs: &[(&str, &Tensor)]) -> Result<Self> {
        let mut st = TensorState {
            step,
            ..TensorState::default()
        };
        for (name, t) in bufs {
            st.buffers.push((name.to_string(), t.to_vec_f32()?));
            if t.dtype() == DType::F64 {
                st.buffers_f64.push((name.to_string(), t.to_vec_f64()?));
            }
        }
        Ok(st)
    }
}

/// A snapshot of an optimizer (`torch.optim.Optimizer.state_dict()`): its kind, its
/// hyperparameters (`param_groups[0]`) and the state of each tensor by position in the list
/// it steps on.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    /// `"SGD"`, `"Adam"` or `"AdamW"`; loading into another kind is an error.
    pub kind: String,
    /// Hyperparameters by PyTorch name (`lr`, `beta1`, `beta2`, `eps`, `weight_decay`,
    /// `momentum`, `dampening`, `nesterov` as 0/1), restored by `load_state_dict`.
    pub hyperparams: Vec<(String, f64)>,
    /// One entry per tensor of the list, `None` where the tensor has no state (SGD without
    /// momentum, a tensor never stepped); empty before the first step.
    pub tensors: Vec<Option<TensorState>>,
    /// The parameter groups by position in the list (`param_groups`); empty when every
    /// tensor is in one group with `hyperparams`' lr and weight decay.
    pub param_groups: Vec<ParamGroup>,
}

impl OptimizerState {
    /// The hyperparameter called `name`.
    pub fn hyperparam(&self, name: &str) -> Option<f64> {
        self.hyperparams
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, v)| v)
    }

    /// Checks that this state is for an optimizer of `kind`.
    pub(crate) fn check_kind(&self, kind: &str) -> Result<()> {
        if self.kind != kind {
            return Err(Error::StateDict(format!(
                "optimizer state of {} cannot be loaded into {kind}",
                self.kind
            )));
        }
        Ok(())
    }

    /// Hyperparameter `name`, or an error naming it; NaN and infinite values are refused.
    pub(crate) fn require(&self, name: &str) -> Result<f64> {
        let v = self.hyperparam(name).ok_or_else(|| {
            Error::StateDict(format!(
                "{} optimizer state lacks the hyperparameter '{name}'",
                self.kind
            ))
        })?;
        if !v.is_finite() {
            return Err(Error::StateDict(format!(
                "{} optimizer state has hyperparameter '{name}' = {v}; it must be finite",
                self.kind
            )));
        }
        Ok(v)
    }

    /// The parameter groups to restore: `None` for the single default group.
    ///
    /// # Errors
    /// `StateDict` for a group option that is NaN, infinite or negative.
    pub(crate) fn groups(&self) -> Result<Option<Vec<ParamGroup>>> {
        if self.param_groups.is_empty() {
            return Ok(None);
        }
        param_groups::check_groups(&self.kind, &self.param_groups)
            .map_err(|e| Error::StateDict(e.to_string()))?;
        Ok(Some(self.param_groups.clone()))
    }
}

/// The buffer names each optimizer kind keeps per tensor.
pub fn buffer_names(kind: &str) -> &'static [&'static str] {
    match kind {
        "Adam" | "AdamW" => &["exp_avg", "exp_avg_sq"],
        "SGD" => &["momentum_buffer"],
        _ => &[],
    }
}

/// The list an optimizer steps on for a module trained without FSDP, as
/// `torch.optim.X(model.parameters())`: every materialized parameter that requires grad,
/// with its current gradient, in `named_parameters()` order.
pub fn parameters(m: &mut dyn crate::nn::Module) -> Vec<ParamGrad> {
    let mut out = Vec::new();
    crate::nn::visit_all(m, |_, p| {
        if let (true, Ok(d)) = (p.requires_grad, p.data()) {
            out.push(ParamGrad {
                param: d.clone(),
                grad: p.grad().cloned(),
            });
        }
    });
    out
}

/// `(name, shape)` of each tensor of [`parameters`] for the same module, in the same order:
/// what [`no_decay_groups`] and named groups are built from.
pub fn parameter_names(m: &mut dyn crate::nn::Module) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    crate::nn::visit_all(m, |name, p| {
        if let (true, Ok(d)) = (p.requires_grad, p.data()) {
            out.push((name.to_string(), d.shape().to_vec()));
        }
    });
    out
}

crate::choice::choice_enum! {
    /// Which optimizer `fsdp train` builds (`--optimizer`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
    pub enum OptimizerKind: "optimizer" {
        /// [`SGD`] (`torch.optim.SGD`) with no momentum and no weight decay (`--optimizer sgd`).
        Sgd = "sgd",
        /// [`Adam`] (`torch.optim.Adam`), weight_decay 0 (`--optimizer adam`).
        Adam = "adam",
        /// [`AdamW`] (`torch.optim.AdamW`), weight_decay 0.01 (`--optimizer adamw`, the default
        /// of `fsdp train`).
        Adamw = "adamw",
    }
}

/// Builds an optimizer of `kind` with learning rate `lr`, Adam `betas` (ignored by SGD),
/// and PyTorch's defaults for everything else.
pub fn build(kind: OptimizerKind, lr: f32, betas: (f32, f32)) -> Box<dyn Optimizer> {
    match kind {
        OptimizerKind::Sgd => Box::new(SGD::new(SgdConfig {
            lr,
            ..SgdConfig::default()
        })),
        OptimizerKind::Adam => Box::new(Adam::new(AdamConfig {
            lr,
            betas,
            ..AdamConfig::adam()
        })),
        OptimizerKind::Adamw => Box::new(AdamW::new(AdamConfig {
            lr,
            betas,
            ..AdamConfig::adamw()
        })),
    }
}

/// Checks the list against the state sizes, and one pair's sizes and dtypes.
fn check_pair(op: &'static str, p: &ParamGrad) -> Result<()> {
    // f32, or f64 (SGD steps f64 parameters on the host), the gradient as the parameter.
    let want = match p.param.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    for t in std::iter::once(&p.param).chain(p.grad.as_ref()) {
        if t.dtype() != want {
            return Err(Error::DTypeMismatch {
                op,
                expected: want,
                got: t.dtype(),
            });
        }
    }
    if let Some(g) = &p.grad {
        if g.numel() != p.param.numel() {
            return Err(Error::ShapeMismatch {
                op,
                expected: p.param.shape().to_vec(),
                got: g.shape().to_vec(),
            });
        }
    }
    Ok(())
}

/// Grows per-parameter state on the first step; errors if the list changed afterwards.
fn ensure_state<S>(
    op: &'static str,
    state: &mut Vec<S>,
    params: &[ParamGrad],
    init: impl Fn(&ParamGrad) -> Result<S>,
) -> Result<()> {
    if state.is_empty() {
        *state = params.iter().map(init).collect::<Result<_>>()?;
    }
    if state.len() != params.len() {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![state.len()],
            got: vec![params.len()],
        });
    }
    Ok(())
}
