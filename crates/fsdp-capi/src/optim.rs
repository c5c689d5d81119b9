//! Optimizers over a model's shards (`torch.optim.SGD`, `Adam`, `AdamW` on
//! `model.parameters()` of an FSDP model: each rank steps its own shard, so optimizer
//! state is sharded like the parameters).

use super::device::on_stream;
use super::handles::{self, fsdp_model_t, fsdp_optimizer_t, Kind, Object};
use super::hooks::device;
use super::model::with_model;
use super::{fsdp_status, guard, write_out, Fail, Res};
use fsdp::optim::{Adam, AdamConfig, AdamW, Optimizer, SgdConfig, SGD};
use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::Arc;

/// `torch.optim.SGD`.
pub const FSDP_OPTIM_SGD: i32 = 0;
/// `torch.optim.Adam`.
pub const FSDP_OPTIM_ADAM: i32 = 1;
/// `torch.optim.AdamW`.
pub const FSDP_OPTIM_ADAMW: i32 = 2;

/// Hyperparameters, PyTorch's names; each optimizer reads its own (`beta1`, `beta2`,
/// `eps` for Adam/AdamW; `momentum`, `dampening`, `nesterov` for SGD; `lr` and
/// `weight_decay` for all).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct fsdp_optimizer_config {
    /// An `FSDP_OPTIM_*`.
    pub kind: i32,
    /// Learning rate.
    pub lr: f32,
    /// Adam's `betas[0]`.
    pub beta1: f32,
    /// Adam's `betas[1]`.
    pub beta2: f32,
    /// Adam's `eps`.
    pub eps: f32,
    /// L2 penalty (SGD, Adam) or decoupled decay (AdamW).
    pub weight_decay: f32,
    /// SGD momentum (default 0: plain SGD).
    pub momentum: f32,
    /// SGD dampening of the momentum buffer's update (default 0, PyTorch's).
    pub dampening: f32,
    /// SGD Nesterov momentum (default false); true needs `momentum` > 0 and `dampening` 0.
    pub nesterov: bool,
}

/// What an optimizer handle holds: the optimizer and the model handle it steps.
pub(crate) struct OptimizerObj {
    pub(crate) opt: Box<dyn Optimizer>,
    pub(crate) model: u64,
}

/// Fills `*out` with PyTorch's defaults for `kind`: SGD lr 1e-3, momentum 0, dampening
/// 0, nesterov false, weight_decay 0; Adam lr 1e-3, betas (0.9, 0.999), eps 1e-8,
/// weight_decay 0; AdamW the same with weight_decay 0.01. Every field is filled, the
/// other optimizers' too.
///
/// Errors: `FSDP_ERR_INVALID_ARGUMENT` for an unknown kind or `out` NULL.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_optimizer_config_default(
    kind: i32,
    out: *mut fsdp_optimizer_config,
) -> fsdp_status {
    guard("fsdp_optimizer_config_default", || {
        let (s, a) = (SgdConfig::default(), AdamConfig::adam());
        let wd = match kind {
            FSDP_OPTIM_SGD => s.weight_decay,
            FSDP_OPTIM_ADAM => a.weight_decay,
            FSDP_OPTIM_ADAMW => AdamConfig::adamw().weight_decay,
            k => return Err(Fail::arg(format!("kind {k} is not an FSDP_OPTIM_* value"))),
        };
        let v = fsdp_optimizer_config {
            kind,
            lr: if kind == FSDP_OPTIM_SGD { s.lr } else { a.lr },
            beta1: a.betas.0,
            beta2: a.betas.1,
            eps: a.eps,
            weight_decay: wd,
            momentum: s.momentum,
            dampening: s.dampening,
            nesterov: s.nesterov,
        };
        // SAFETY: the caller's promise.
        unsafe { write_out(out, "out", v) }
    })
}

fn build(c: &fsdp_optimizer_config) -> Res<Box<dyn Optimizer>> {
    let fields = [
        ("lr", c.lr),
        ("beta1", c.beta1),
        ("beta2", c.beta2),
        ("eps", c.eps),
        ("weight_decay", c.weight_decay),
        ("momentum", c.momentum),
        ("dampening", c.dampening),
    ];
    if let Some((name, v)) = fields.iter().find(|(_, v)| !v.is_finite()) {
        return Err(Fail::arg(format!(
            "config.{name} {v} is not a finite number"
        )));
    }
    let adam = AdamConfig {
        lr: c.lr,
        betas: (c.beta1, c.beta2),
        eps: c.eps,
        weight_decay: c.weight_decay,
    };
    // PyTorch's constructor checks, here rather than at the first step.
    Ok(match c.kind {
        FSDP_OPTIM_SGD => {
            let sgd = SgdConfig {
                lr: c.lr,
                momentum: c.momentum,
                dampening: c.dampening,
                weight_decay: c.weight_decay,
                nesterov: c.nesterov,
            };
            sgd.check()?;
            Box::new(SGD::new(sgd))
        }
        FSDP_OPTIM_ADAM => {
            adam.check_as("Adam")?;
            Box::new(Adam::new(adam))
        }
        FSDP_OPTIM_ADAMW => {
            adam.check_as("AdamW")?;
            Box::new(AdamW::new(adam))
        }
        k => {
            return Err(Fail::arg(format!(
                "config.kind {k} is not an FSDP_OPTIM_* value"
            )))
        }
    })
}

/// An optimizer of `config` over `model`'s shards in `*out` (state is created at the
/// first step).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for an unknown kind, a
/// NULL pointer, or a hyperparameter `torch.optim`'s constructor refuses (naming the
/// field): a non-finite value, a negative `lr`, `eps`, `weight_decay` or `momentum`, a
/// beta outside `[0, 1)`, `nesterov` without momentum or with dampening.
///
/// # Safety
/// `config` is a valid `fsdp_optimizer_config`; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_optimizer_new(
    model: fsdp_model_t,
    config: *const fsdp_optimizer_config,
    out: *mut fsdp_optimizer_t,
) -> fsdp_status {
    guard("fsdp_optimizer_new", || {
        if config.is_null() || out.is_null() {
            return Err(Fail::arg("config or out is NULL"));
        }
        with_model(model.id, "model", "fsdp_optimizer_new", |_| Ok(()))?;
        // SAFETY: non-null, valid (the caller's promise).
        let opt = build(unsafe { &*config })?;
        let id = handles::insert(Object::Optimizer(Arc::new(Mutex::new(OptimizerObj {
            opt,
            model: model.id,
        }))));
        // SAFETY: checked non-null; valid for a write (the caller's promise).
        unsafe { write_out(out, "out", fsdp_optimizer_t { id }) }
    })
}

/// Runs `f` on the optimizer of `h` and its model (the optimizer is locked first, then
/// the model, everywhere).
pub(crate) fn with_optimizer<R>(
    h: u64,
    call: &'static str,
    f: impl FnOnce(&mut OptimizerObj, &mut super::model::ModelObj) -> Res<R>,
) -> Res<R> {
    let o = handles::optimizer(h, "optimizer")?;
    let mut o = o.lock();
    let model = o.model;
    with_model(model, "the optimizer's model", call, |m| f(&mut o, m))
}

/// One step on every shard from its gradient (`optimizer.step()`), after a finished
/// backward: the gradients of every backward (each ended by `fsdp_model_finish_backward`)
/// since `fsdp_model_zero_grad`, summed. A step at any other time is refused and changes
/// nothing: before any backward or right after `fsdp_model_zero_grad` (no gradient),
/// between a forward and its backward, inside a forward or a backward, after the root's
/// `fsdp_unit_post_backward` without `fsdp_model_finish_backward`, while
/// `fsdp_model_set_no_sync(model, 1)` keeps gradients unreduced, or after a backward that
/// failed (until `fsdp_model_zero_grad`: its gradients are incomplete). Stepping twice on the
/// same gradients (no `fsdp_model_zero_grad` between) applies them twice, as PyTorch
/// does.
///
/// `stream`: NULL on the CPU; on a CUDA device the host's stream (the update runs on
/// fsdp's stream, ordered after it; the next gather is ordered after the update).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE` (also when the model was freed);
/// `FSDP_ERR_USAGE` naming what was expected (`fsdp_model_finish_backward`, a backward,
/// `fsdp_model_set_no_sync(model, 0)`, `fsdp_model_zero_grad` after a failed backward); `FSDP_ERR_INVALID_ARGUMENT` (`stream` not NULL on
/// the CPU); `FSDP_ERR_OUT_OF_MEMORY` when the optimizer state (created at the first
/// step) does not fit.
#[no_mangle]
pub extern "C" fn fsdp_optimizer_step(
    optimizer: fsdp_optimizer_t,
    stream: *mut c_void,
) -> fsdp_status {
    guard("fsdp_optimizer_step", || {
        with_optimizer(optimizer.id, "fsdp_optimizer_step", |o, m| {
            m.fsdp.ready_for_step()?;
            on_stream(device(m), stream, || {
                Ok(o.opt.step(&m.fsdp.optimizer_params())?)
            })
        })
    })
}

/// Sets the learning rate (for a schedule).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for a negative or
/// non-finite `lr`.
#[no_mangle]
pub extern "C" fn fsdp_optimizer_set_lr(optimizer: fsdp_optimizer_t, lr: f32) -> fsdp_status {
    guard("fsdp_optimizer_set_lr", || {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Fail::arg(format!("lr {lr} must be finite and >= 0")));
        }
        handles::optimizer(optimizer.id, "optimizer")?
            .lock()
            .opt
            .set_lr(lr)?;
        Ok(())
    })
}

/// Frees an optimizer.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE` (NULL, freed, another kind).
#[no_mangle]
pub extern "C" fn fsdp_optimizer_free(optimizer: fsdp_optimizer_t) -> fsdp_status {
    guard("fsdp_optimizer_free", || {
        handles::remove(optimizer.id, Kind::Optimizer, "optimizer").map(drop)
    })
}
