//! Adam and AdamW (`torch.optim.Adam`, `torch.optim.AdamW`), single-tensor update order.

use super::fused::{self, AdamItem};
use super::param_groups::{
    check_groups, check_non_negative, resolve, resolve_positions, set_group_lrs,
};
use super::{
    check_pair, ensure_state, Optimizer, OptimizerState, ParamGrad, ParamGroup, StateSnapshot,
    TensorSnapshot,
};
use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

/// Arguments of Adam/AdamW with PyTorch's defaults.
#[derive(Debug, Clone, Copy)]
pub struct AdamConfig {
    /// Learning rate (`lr=`), default 1e-3.
    pub lr: f32,
    /// Decay rates `(beta1, beta2)` of the first and second moment averages (`betas=`),
    /// default (0.9, 0.999).
    pub betas: (f32, f32),
    /// Term added to the denominator for numerical stability (`eps=`), default 1e-8.
    pub eps: f32,
    /// Weight decay (`weight_decay=`): an L2 term added to the gradient in [`Adam`]
    /// (default 0), decoupled `p *= 1 - lr * wd` in [`AdamW`] (default 0.01).
    pub weight_decay: f32,
}

impl AdamConfig {
    /// PyTorch's checks of `torch.optim.Adam(...)` / `AdamW(...)`: lr, eps and
    /// weight_decay finite and `>= 0`, each beta in `[0, 1)`.
    ///
    /// # Errors
    /// `InvalidArgument` naming the first bad value, as `Adam` ([`check_as`](Self::check_as)).
    pub fn check(&self) -> Result<()> {
        self.check_as("Adam")
    }

    /// [`check`](Self::check), naming the optimizer `optimizer` (`"Adam"`, `"AdamW"`) in
    /// the message.
    ///
    /// # Errors
    /// `InvalidArgument` naming the optimizer and the first bad value.
    pub fn check_as(&self, optimizer: &str) -> Result<()> {
        check_non_negative(optimizer, "lr", self.lr)?;
        check_non_negative(optimizer, "eps", self.eps)?;
        check_non_negative(optimizer, "weight_decay", self.weight_decay)?;
        for (i, b) in [self.betas.0, self.betas.1].into_iter().enumerate() {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::InvalidArgument(format!(
                    "{optimizer}: beta{} {b} must be in [0, 1)",
                    i + 1
                )));
            }
        }
        Ok(())
    }

    /// `torch.optim.Adam` defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.
    pub fn adam() -> Self {
        AdamConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
    /// `torch.optim.AdamW` defaults: as Adam but weight_decay 0.01 (decoupled).
    pub fn adamw() -> Self {
        AdamConfig {
            weight_decay: 0.01,
            ..Self::adam()
        }
    }
}

/// First and second moments and the step count of one tensor: 1-D f32 on the tensor's
/// device (empty until its first step).
struct Moments {
    step: u64,
    m: Tensor,
    v: Tensor,
}

fn zeros(n: usize, device: Device) -> Result<Tensor> {
    Tensor::zeros_on(&[n], DType::F32, device)
}

/// The dtype of a parameter's moments: f64 for an f64 parameter (PyTorch keeps state in
/// the parameter's dtype), else f32.
fn state_dtype(param: &Tensor) -> DType {
    match param.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Zero moments for every tensor, unless they exist.
fn init_moments(op: &'static str, state: &mut Vec<Moments>, params: &[ParamGrad]) -> Result<()> {
    ensure_state(op, state, params, |pg| {
        let (n, device, dt) = (pg.param.numel(), pg.param.device(), state_dtype(&pg.param));
        Ok(Moments {
            step: 0,
            m: Tensor::zeros_on(&[n], dt, device)?,
            v: Tensor::zeros_on(&[n], dt, device)?,
        })
    })
}

fn adam_step(
    config: &AdamConfig,
    groups: Option<&[ParamGroup]>,
    decoupled: bool,
    params: &[ParamGrad],
    state: &mut Vec<Moments>,
    op: &'static str,
) -> Result<()> {
    config.check_as(op.trim_end_matches(".step"))?;
    let hyper = resolve(groups, params.len(), config.lr, config.weight_decay)?;
    init_moments(op, state, params)?;
    let (b1, b2) = config.betas;
    // The CUDA tensors of each group, stepped by one fused launch per group.
    let mut on_device: BTreeMap<usize, (AdamConfig, Vec<AdamItem>)> = BTreeMap::new();
    for ((pg, st), hp) in params.iter().zip(state.iter_mut()).zip(&hyper) {
        let c = &AdamConfig {
            lr: hp.lr,
            weight_decay: hp.weight_decay,
            ..*config
        };
        check_pair(op, pg)?;
        let Some(grad) = &pg.grad else { continue };
        let device = crate::ops::same_device(op, &[&pg.param, grad])?;
        let n = pg.param.numel();
        let dt = state_dtype(&pg.param);
        if st.m.numel() == 0 && st.step == 0 {
            // A tensor that had no state when a state dict was loaded.
            st.m = Tensor::zeros_on(&[n], dt, device)?;
            st.v = Tensor::zeros_on(&[n], dt, device)?;
        }
        if st.m.numel() != n || st.v.numel() != n {
            return Err(Error::ShapeMismatch {
                op,
                expected: vec![st.m.numel()],
                got: vec![n],
            });
        }
        for t in [&mut st.m, &mut st.v] {
            if t.dtype() != dt {
                // An f64 parameter's state loaded from f32 values (or the reverse).
                *t = t.to_dtype(dt)?;
            }
            if t.device() != device {
                // Loaded from a state dict (host values), or left behind by a move.
                *t = t.to_device(device)?;
            }
        }
        st.step += 1;
        if dt == DType::F64 && !device.is_cuda() {
            adam_update_f64(c, decoupled, st.step, &pg.param, grad, &st.m, &st.v)?;
            continue;
        }
        if device.is_cuda() {
            let group = &mut on_device.entry(hp.group).or_insert((*c, Vec::new())).1;
            group.push(AdamItem {
                param: pg.param.clone(),
                grad: grad.clone(),
                m: st.m.clone(),
                v: st.v.clone(),
                step: st.step,
            });
            continue;
        }
        let g = grad.f32()?;
        let g: &[f32] = &g;
        let mut p = pg.param.f32_mut()?;
        let (mut m, mut v) = (st.m.f32_mut()?, st.v.f32_mut()?);
        let bc1 = 1.0 - (b1 as f64).powi(st.step as i32);
        let bc2 = 1.0 - (b2 as f64).powi(st.step as i32);
        let h = AdamScalars {
            b1,
            b2,
            step_size: (c.lr as f64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: c.eps,
            lr_wd: c.lr * c.weight_decay,
            wd: c.weight_decay,
            decoupled,
        };
        let len = p.len();
        // Elementwise, one pass over p, g, m, v: any split gives the same bits.
        crate::backend::cpu::parallel::rows_mut3(
            (&mut p, 1),
            (&mut m, 1),
            (&mut v, 1),
            len,
            crate::backend::cpu::parallel::HEAVY_GRAIN,
            |r, p, m, v| {
                adam_update(&h, &g[r], p, m, v);
                Ok(())
            },
        )?;
    }
    for (c, items) in on_device.values() {
        fused::adam(items, c, decoupled)?;
    }
    Ok(())
}

/// The scalars of one Adam/AdamW update.
/// One Adam/AdamW update of an f64 parameter with f64 moments, in PyTorch's single-tensor
/// order (`torch/optim/adam.py` `_single_tensor_adam`): the weight decay (added to the
/// gradient, or AdamW's `param *= 1 - lr wd`), `exp_avg.lerp_(grad, 1 - beta1)` (CPU lerp:
/// `m + w (g - m)` for a weight below 0.5), `exp_avg_sq = beta2 v + (1 - beta2) g^2`, then
/// `param -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`. The hyperparameters are the f64
/// their decimal spelling names (PyTorch's are Python floats).
fn adam_update_f64(
    c: &AdamConfig,
    decoupled: bool,
    step: u64,
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
) -> Result<()> {
    let w = crate::ops::double::widen;
    let (lr, b1, b2, eps, wd) = (
        w(c.lr),
        w(c.betas.0),
        w(c.betas.1),
        w(c.eps),
        w(c.weight_decay),
    );
    let g = grad.data::<f64>()?;
    let mut p = param.data_mut::<f64>()?;
    let (mut m, mut v) = (m.data_mut::<f64>()?, v.data_mut::<f64>()?);
    // `beta ** step` as Python computes it (C `pow`).
    let bc1 = 1.0 - b1.powf(step as f64);
    let bc2_sqrt = (1.0 - b2.powf(step as f64)).sqrt();
    let step_size = lr / bc1;
    let weight = 1.0 - b1;
    for i in 0..p.len() {
        let mut gi = g[i];
        if decoupled {
            p[i] *= 1.0 - lr * wd;
        } else if wd != 0.0 {
            gi += wd * p[i];
        }
        m[i] = if weight < 0.5 {
            m[i] + weight * (gi - m[i])
        } else {
            gi - (gi - m[i]) * (1.0 - weight)
        };
        v[i] = v[i] * b2 + gi * gi * (1.0 - b2);
        let denom = v[i].sqrt() / bc2_sqrt + eps;
        p[i] -= step_size * (m[i] / denom);
    }
    Ok(())
}

struct AdamScalars {
    b1: f32,
    b2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
    lr_wd: f32,
    wd: f32,
    decoupled: bool,
}

crate::backend::cpu::simd::multiversion! {
    /// The CPU reference update of one contiguous piece (the loop `optim.cu`'s `adam_f32`
    /// reproduces), in place on `p`, `m`, `v`.
    fn adam_update(h: &AdamScalars, g: &[f32], p: &mut [f32], m: &mut [f32], v: &mut [f32]) {
        let (b1, b2) = (h.b1, h.b2);
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
            let mut gi = g;
            if h.decoupled {
                *p *= 1.0 - h.lr_wd;
            } else if h.wd != 0.0 {
                gi += h.wd * *p;
            }
            *m = b1 * *m + (1.0 - b1) * gi;
            *v = b2 * *v + (1.0 - b2) * gi * gi;
            let denom = v.sqrt() / h.bc2_sqrt + h.eps;
            *p -= h.step_size * *m / denom;
        }
    }
}

/// Adam with L2 weight decay added to the gradient:
/// `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`.
pub struct Adam {
    /// The hyperparameters (the defaults of every parameter group); [`Optimizer::set_lr`]
    /// changes `config.lr`. Checked at each step ([`AdamConfig::check`]).
    pub config: AdamConfig,
    state: Vec<Moments>,
    /// Parameter groups; `None`: one group of every tensor with `config`'s lr and decay.
    groups: Option<Vec<ParamGroup>>,
}

impl Adam {
    /// `torch.optim.Adam` with `config` (start from [`AdamConfig::adam`]); the moments,
    /// two f32 per element, are allocated on the first step.
    pub fn new(config: AdamConfig) -> Self {
        Adam {
            config,
            state: Vec::new(),
            groups: None,
        }
    }
}

/// AdamW: Adam with decoupled weight decay `p *= 1 - lr * wd` before the update
/// (Loshchilov & Hutter, as `torch.optim.AdamW`).
pub struct AdamW {
    /// The hyperparameters (the defaults of every parameter group); [`Optimizer::set_lr`]
    /// changes `config.lr`. Checked at each step ([`AdamConfig::check`]).
    pub config: AdamConfig,
    state: Vec<Moments>,
    /// Parameter groups; `None`: one group of every tensor with `config`'s lr and decay.
    groups: Option<Vec<ParamGroup>>,
}

impl AdamW {
    /// `torch.optim.AdamW` with `config` (start from [`AdamConfig::adamw`]); the moments,
    /// two f32 per element, are allocated on the first step.
    pub fn new(config: AdamConfig) -> Self {
        AdamW {
            config,
            state: Vec::new(),
            groups: None,
        }
    }
}

fn export(
    c: &AdamConfig,
    groups: Option<&[ParamGroup]>,
    kind: &str,
    state: &[Moments],
) -> Result<OptimizerState> {
    snapshot(c, groups, kind, state, &mut |t| Ok(t.clone()))?.into_state(&mut Vec::new())
}

/// The state with each moment passed through `copy`, converted by
/// [`StateSnapshot::into_state`] (what [`export`] returns).
fn snapshot(
    c: &AdamConfig,
    groups: Option<&[ParamGroup]>,
    kind: &str,
    state: &[Moments],
    copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
) -> Result<StateSnapshot> {
    Ok(StateSnapshot::Tensors {
        kind: kind.to_string(),
        hyperparams: vec![
            ("lr".into(), c.lr as f64),
            ("beta1".into(), c.betas.0 as f64),
            ("beta2".into(), c.betas.1 as f64),
            ("eps".into(), c.eps as f64),
            ("weight_decay".into(), c.weight_decay as f64),
        ],
        tensors: state
            .iter()
            .map(|s| {
                (s.step > 0 || s.m.numel() > 0)
                    .then(|| {
                        Ok(TensorSnapshot {
                            step: Some(s.step),
                            buffers: vec![("exp_avg", copy(&s.m)?), ("exp_avg_sq", copy(&s.v)?)],
                        })
                    })
                    .transpose()
            })
            .collect::<Result<_>>()?,
        param_groups: groups.map(<[ParamGroup]>::to_vec).unwrap_or_default(),
    })
}

/// Checks `st` for an Adam of `kind` and builds the new config and moments (on the host;
/// each moves to its tensor's device at the next step).
#[allow(clippy::type_complexity)]
fn import(
    kind: &str,
    st: &OptimizerState,
) -> Result<(AdamConfig, Option<Vec<ParamGroup>>, Vec<Moments>)> {
    st.check_kind(kind)?;
    let config = AdamConfig {
        lr: st.require("lr")? as f32,
        betas: (st.require("beta1")? as f32, st.require("beta2")? as f32),
        eps: st.require("eps")? as f32,
        weight_decay: st.require("weight_decay")? as f32,
    };
    config
        .check_as(kind)
        .map_err(|e| Error::StateDict(e.to_string()))?;
    let groups = st.groups()?;
    let mut out = Vec::with_capacity(st.tensors.len());
    for (i, t) in st.tensors.iter().enumerate() {
        let Some(t) = t else {
            out.push(Moments {
                step: 0,
                m: zeros(0, Device::Cpu)?,
                v: zeros(0, Device::Cpu)?,
            });
            continue;
        };
        let step = t
            .step
            .ok_or_else(|| Error::StateDict(format!("{kind} state of tensor {i} has no 'step'")))?;
        let (m, v) = (
            t.buffer_tensor(kind, i, "exp_avg")?,
            t.buffer_tensor(kind, i, "exp_avg_sq")?,
        );
        if m.numel() != v.numel() {
            return Err(Error::StateDict(format!(
                "{kind} state of tensor {i}: exp_avg has {} elements and exp_avg_sq {}",
                m.numel(),
                v.numel()
            )));
        }
        out.push(Moments { step, m, v });
    }
    Ok((config, groups, out))
}

macro_rules! impl_adam {
    ($t:ty, $decoupled:expr, $op:expr, $kind:expr) => {
        impl Optimizer for $t {
            fn state_dict(&self) -> Result<OptimizerState> {
                export(&self.config, self.groups.as_deref(), $kind, &self.state)
            }
            fn snapshot(
                &self,
                copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
            ) -> Result<StateSnapshot> {
                snapshot(
                    &self.config,
                    self.groups.as_deref(),
                    $kind,
                    &self.state,
                    copy,
                )
            }
            fn load_state_dict(&mut self, st: &OptimizerState) -> Result<()> {
                let (config, groups, state) = import($kind, st)?;
                self.config = config;
                self.groups = groups;
                self.state = state;
                Ok(())
            }
            fn step(&mut self, params: &[ParamGrad]) -> Result<()> {
                adam_step(
                    &self.config,
                    self.groups.as_deref(),
                    $decoupled,
                    params,
                    &mut self.state,
                    $op,
                )
            }
            fn init_state(&mut self, params: &[ParamGrad]) -> Result<()> {
                init_moments($op, &mut self.state, params)
            }
            fn state_bytes(&self) -> usize {
                self.state
                    .iter()
                    .map(|s| s.m.nbytes() + s.v.nbytes() + 8)
                    .sum()
            }
            fn lr(&self) -> f32 {
                self.config.lr
            }
            fn set_lr(&mut self, lr: f32) -> Result<()> {
                check_non_negative($kind, "lr", lr)?;
                self.config.lr = lr;
                for g in self.groups.iter_mut().flatten() {
                    g.lr = lr;
                }
                Ok(())
            }
            fn param_groups(&self) -> Option<&[ParamGroup]> {
                self.groups.as_deref()
            }
            fn set_param_groups(&mut self, groups: Vec<ParamGroup>) -> Result<()> {
                check_groups($kind, &groups)?;
                resolve_positions(&groups)?;
                self.groups = Some(groups);
                Ok(())
            }
            fn set_group_lrs(&mut self, lrs: &[f32]) -> Result<()> {
                set_group_lrs($kind, &mut self.config.lr, &mut self.groups, lrs)
            }
        }
    };
}

impl_adam!(Adam, false, "Adam.step", "Adam");
impl_adam!(AdamW, true, "AdamW.step", "AdamW");
