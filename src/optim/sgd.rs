//! Stochastic gradient descent with momentum (`torch.optim.SGD`).

use super::fused::{self, SgdItem};
use super::param_groups::{
    check_groups, check_non_negative, resolve, resolve_positions, set_group_lrs,
};
use super::{
    check_pair, ensure_state, Optimizer, OptimizerState, ParamGrad, ParamGroup, StateSnapshot,
    TensorSnapshot,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use std::collections::BTreeMap;

/// `torch.optim.SGD` arguments and defaults (lr 1e-3 as PyTorch >= 2.3).
#[derive(Debug, Clone, Copy)]
pub struct SgdConfig {
    /// Learning rate (`torch.optim.SGD(lr=...)`), default 1e-3.
    pub lr: f32,
    /// Momentum factor (`torch.optim.SGD(momentum=...)`), default 0 (no momentum buffer).
    pub momentum: f32,
    /// Dampening of the gradient added to the momentum buffer after the first step
    /// (`torch.optim.SGD(dampening=...)`), default 0.
    pub dampening: f32,
    /// L2 penalty added to the gradient as `wd * p` (`torch.optim.SGD(weight_decay=...)`),
    /// default 0.
    pub weight_decay: f32,
    /// Nesterov momentum (`torch.optim.SGD(nesterov=...)`), default false; has an effect
    /// only with a nonzero `momentum`.
    pub nesterov: bool,
}

impl SgdConfig {
    /// PyTorch's checks of `torch.optim.SGD(...)`: lr, momentum and weight_decay finite
    /// and `>= 0`, dampening finite, nesterov only with momentum and no dampening.
    ///
    /// # Errors
    /// `InvalidArgument` naming the first bad value.
    pub fn check(&self) -> Result<()> {
        check_non_negative("SGD", "lr", self.lr)?;
        check_non_negative("SGD", "momentum", self.momentum)?;
        check_non_negative("SGD", "weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "SGD: dampening {} must be finite",
                self.dampening
            )));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::InvalidArgument(
                "SGD: nesterov momentum requires a momentum and zero dampening".into(),
            ));
        }
        Ok(())
    }
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// `g = grad + wd p; buf = g` (first step) `| momentum buf + (1 - dampening) g;`
/// `g = nesterov ? g + momentum buf : buf; p -= lr g`.
pub struct SGD {
    /// The hyperparameters (the defaults of every parameter group); [`Optimizer::set_lr`]
    /// changes `config.lr`. Checked at each step ([`SgdConfig::check`]).
    pub config: SgdConfig,
    /// Momentum buffers, 1-D f32 on the parameter's device (empty until a parameter's
    /// first step with momentum).
    bufs: Vec<Option<Tensor>>,
    /// Parameter groups; `None`: one group of every tensor with `config`'s lr and decay.
    groups: Option<Vec<ParamGroup>>,
}

impl SGD {
    /// `torch.optim.SGD` with `config`; momentum buffers are allocated on the first step
    /// that uses them.
    pub fn new(config: SgdConfig) -> Self {
        SGD {
            config,
            bufs: Vec::new(),
            groups: None,
        }
    }
}

impl Optimizer for SGD {
    fn step(&mut self, params: &[ParamGrad]) -> Result<()> {
        self.config.check()?;
        let hyper = resolve(
            self.groups.as_deref(),
            params.len(),
            self.config.lr,
            self.config.weight_decay,
        )?;
        ensure_state("SGD.step", &mut self.bufs, params, |_| Ok(None))?;
        // The CUDA tensors of each group, stepped by one fused launch per group.
        let mut on_device: BTreeMap<usize, (SgdConfig, Vec<SgdItem>)> = BTreeMap::new();
        for ((pg, buf), h) in params.iter().zip(self.bufs.iter_mut()).zip(&hyper) {
            let c = SgdConfig {
                lr: h.lr,
                weight_decay: h.weight_decay,
                ..self.config
            };
            check_pair("SGD.step", pg)?;
            let Some(grad) = &pg.grad else { continue };
            let device = crate::ops::same_device("SGD.step", &[&pg.param, grad])?;
            let n = pg.param.numel();
            let first = c.momentum != 0.0 && buf.is_none();
            if first {
                *buf = Some(Tensor::zeros_on(&[n], pg.param.dtype(), device)?);
            }
            if let Some(b) = buf.as_ref().filter(|b| b.numel() != n) {
                return Err(Error::ShapeMismatch {
                    op: "SGD.step",
                    expected: vec![b.numel()],
                    got: vec![n],
                });
            }
            if let Some(b) = buf.as_mut().filter(|b| b.device() != device) {
                // Loaded from a state dict (host values), or left behind by a move.
                *b = b.to_device(device)?;
            }
            if let Some(b) = buf.as_mut().filter(|b| b.dtype() != pg.param.dtype()) {
                // An f64 parameter's buffer loaded from f32 state (or the reverse).
                *b = b.to_dtype(pg.param.dtype())?;
            }
            if device.is_cuda() {
                let group = &mut on_device.entry(h.group).or_insert((c, Vec::new())).1;
                group.push(SgdItem {
                    param: pg.param.clone(),
                    grad: grad.clone(),
                    buf: buf.clone(),
                    first,
                });
                continue;
            }
            if pg.param.dtype() == DType::F64 {
                step_f64(&pg.param, grad, buf.as_ref(), &c, first)?;
                continue;
            }
            let g = grad.f32()?;
            let mut p = pg.param.f32_mut()?;
            let mut b = buf.as_ref().map(|b| b.f32_mut()).transpose()?;
            for i in 0..p.len() {
                let mut d = g[i] + c.weight_decay * p[i];
                if let Some(b) = b.as_mut() {
                    // The first step copies the gradient into the buffer, undamped.
                    b[i] = if first {
                        d
                    } else {
                        c.momentum * b[i] + (1.0 - c.dampening) * d
                    };
                    d = if c.nesterov {
                        d + c.momentum * b[i]
                    } else {
                        b[i]
                    };
                }
                p[i] -= c.lr * d;
            }
        }
        for (c, items) in on_device.values() {
            fused::sgd(items, c)?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        self.bufs.iter().flatten().map(|b| b.nbytes()).sum()
    }

    fn lr(&self) -> f32 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f32) -> Result<()> {
        check_non_negative("SGD", "lr", lr)?;
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
        check_groups("SGD", &groups)?;
        resolve_positions(&groups)?;
        self.groups = Some(groups);
        Ok(())
    }

    fn set_group_lrs(&mut self, lrs: &[f32]) -> Result<()> {
        set_group_lrs("SGD", &mut self.config.lr, &mut self.groups, lrs)
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        self.snapshot(&mut |t| Ok(t.clone()))?
            .into_state(&mut Vec::new())
    }

    fn snapshot(&self, copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>) -> Result<StateSnapshot> {
        let c = self.config;
        Ok(StateSnapshot::Tensors {
            kind: "SGD".into(),
            hyperparams: vec![
                ("lr".into(), c.lr as f64),
                ("momentum".into(), c.momentum as f64),
                ("dampening".into(), c.dampening as f64),
                ("weight_decay".into(), c.weight_decay as f64),
                ("nesterov".into(), if c.nesterov { 1.0 } else { 0.0 }),
            ],
            tensors: self
                .bufs
                .iter()
                .map(|b| {
                    b.as_ref()
                        .map(|b| {
                            Ok(TensorSnapshot {
                                step: None,
                                buffers: vec![("momentum_buffer", copy(b)?)],
                            })
                        })
                        .transpose()
                })
                .collect::<Result<_>>()?,
            param_groups: self.groups.clone().unwrap_or_default(),
        })
    }

    fn load_state_dict(&mut self, st: &OptimizerState) -> Result<()> {
        st.check_kind("SGD")?;
        let config = SgdConfig {
            lr: st.require("lr")? as f32,
            momentum: st.require("momentum")? as f32,
            dampening: st.require("dampening")? as f32,
            weight_decay: st.require("weight_decay")? as f32,
            nesterov: st.require("nesterov")? != 0.0,
        };
        config
            .check()
            .map_err(|e| Error::StateDict(e.to_string()))?;
        let groups = st.groups()?;
        let mut bufs = Vec::with_capacity(st.tensors.len());
        for (i, t) in st.tensors.iter().enumerate() {
            bufs.push(match t {
                None => None,
                Some(t) => Some(t.buffer_tensor("SGD", i, "momentum_buffer")?),
            });
        }
        self.config = config;
        self.bufs = bufs;
        self.groups = groups;
        Ok(())
    }
}

/// The SGD update of an f64 parameter on the host, in f64 throughout (the f32 loop of
/// [`SGD::step`] with the hyperparameters widened): PyTorch's `_single_tensor_sgd` on a
/// float64 parameter. `grad` and `buf` must be f64 too.
fn step_f64(
    param: &Tensor,
    grad: &Tensor,
    buf: Option<&Tensor>,
    c: &SgdConfig,
    first: bool,
) -> Result<()> {
    // The hyperparameters as the f64 their decimal spelling names (PyTorch's are Python
    // floats): lr 0.05 is 0.05, not 0.0500000007.
    let w = crate::ops::double::widen;
    let (lr, wd) = (w(c.lr), w(c.weight_decay));
    let (mom, damp) = (w(c.momentum), w(c.dampening));
    let g = grad.data::<f64>()?;
    let mut p = param.data_mut::<f64>()?;
    let mut b = buf.map(|b| b.data_mut::<f64>()).transpose()?;
    for i in 0..p.len() {
        let mut d = g[i] + wd * p[i];
        if let Some(b) = b.as_mut() {
            b[i] = if first {
                d
            } else {
                mom * b[i] + (1.0 - damp) * d
            };
            d = if c.nesterov { d + mom * b[i] } else { b[i] };
        }
        p[i] -= lr * d;
    }
    Ok(())
}
