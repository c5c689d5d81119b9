//! Stochastic gradient descent with momentum (`torch.optim.SGD`).

use super::fused::{self, SgdItem};
use super::{check_pair, ensure_state, Optimizer, OptimizerState, ParamGrad, TensorState};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

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
    /// The hyperparameters; [`Optimizer::set_lr`] changes `config.lr`.
    pub config: SgdConfig,
    /// Momentum buffers, 1-D f32 on the parameter's device (empty until a parameter's
    /// first step with momentum).
    bufs: Vec<Option<Tensor>>,
}

impl SGD {
    /// `torch.optim.SGD` with `config`; momentum buffers are allocated on the first step
    /// that uses them.
    pub fn new(config: SgdConfig) -> Self {
        SGD {
            config,
            bufs: Vec::new(),
        }
    }
}

impl Optimizer for SGD {
    fn step(&mut self, params: &[ParamGrad]) -> Result<()> {
        ensure_state("SGD.step", &mut self.bufs, params, |_| Ok(None))?;
        let c = self.config;
        let mut on_device = Vec::new();
        for (pg, buf) in params.iter().zip(self.bufs.iter_mut()) {
            check_pair("SGD.step", pg)?;
            let Some(grad) = &pg.grad else { continue };
            let device = crate::ops::same_device("SGD.step", &[&pg.param, grad])?;
            let n = pg.param.numel();
            let first = c.momentum != 0.0 && buf.is_none();
            if first {
                *buf = Some(Tensor::zeros_on(&[n], DType::F32, device)?);
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
            if device.is_cuda() {
                on_device.push(SgdItem {
                    param: pg.param.clone(),
                    grad: grad.clone(),
                    buf: buf.clone(),
                    first,
                });
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
        fused::sgd(&on_device, &c)
    }

    fn state_bytes(&self) -> usize {
        self.bufs.iter().flatten().map(|b| b.numel() * 4).sum()
    }

    fn lr(&self) -> f32 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.config.lr = lr;
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let c = self.config;
        Ok(OptimizerState {
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
                            Ok(TensorState {
                                step: None,
                                buffers: vec![("momentum_buffer".into(), b.to_vec_f32()?)],
                            })
                        })
                        .transpose()
                })
                .collect::<Result<_>>()?,
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
        let mut bufs = Vec::with_capacity(st.tensors.len());
        for (i, t) in st.tensors.iter().enumerate() {
            bufs.push(match t {
                None => None,
                Some(t) => {
                    let b = t.buffer("momentum_buffer").ok_or_else(|| {
                        Error::StateDict(format!(
                            "SGD state of tensor {i} has no 'momentum_buffer'"
                        ))
                    })?;
                    Some(Tensor::from_vec(b.to_vec(), &[b.len()])?)
                }
            });
        }
        self.config = config;
        self.bufs = bufs;
        Ok(())
    }
}
