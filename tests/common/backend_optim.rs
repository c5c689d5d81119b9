//! The optimizer and GEMM entry points of the test [`Backend`] (tests/common/backend.rs),
//! used by tests/ops/kernels_nn.rs.
#![allow(dead_code)]

use crate::backend::Backend;
#[cfg(feature = "cuda")]
use crate::backend::{down, out, up};
#[cfg(feature = "cuda")]
use fsdp::backend::cuda as cu;
use fsdp::Result;

/// Hyperparameters of the optimizer tests, as both backends take them.
#[derive(Debug, Clone, Copy)]
pub enum Opt {
    /// `torch.optim.SGD`.
    Sgd(fsdp::optim::SgdConfig),
    /// `torch.optim.Adam` (`false`) or `AdamW` (`true`).
    Adam(fsdp::optim::AdamConfig, bool),
}

impl Backend {
    /// `steps` optimizer steps over `params` with fixed `grads` (one list position each);
    /// returns the parameters. CPU: the `fsdp::optim` optimizers; CUDA: `sgd_f32`/`adam_f32`.
    pub fn optimize(
        &self,
        params: &[Vec<f32>],
        grads: &[Vec<f32>],
        opt: Opt,
        steps: usize,
    ) -> Result<Vec<Vec<f32>>> {
        crate::on!(
            self,
            {
                use fsdp::optim::{Adam, AdamW, Optimizer, ParamGrad, SGD};
                use fsdp::tensor::Tensor;
                let list = params
                    .iter()
                    .zip(grads)
                    .map(|(p, g)| {
                        Ok(ParamGrad {
                            param: Tensor::from_vec(p.clone(), &[p.len()])?,
                            grad: Some(Tensor::from_vec(g.clone(), &[g.len()])?),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let mut o: Box<dyn Optimizer> = match opt {
                    Opt::Sgd(c) => Box::new(SGD::new(c)),
                    Opt::Adam(c, false) => Box::new(Adam::new(c)),
                    Opt::Adam(c, true) => Box::new(AdamW::new(c)),
                };
                for _ in 0..steps {
                    o.step(&list)?;
                }
                list.iter().map(|pg| pg.param.to_vec_f32()).collect()
            },
            |s| {
                let ps = params
                    .iter()
                    .map(|p| up(s, p))
                    .collect::<Result<Vec<_>>>()?;
                let gs = grads.iter().map(|g| up(s, g)).collect::<Result<Vec<_>>>()?;
                let zeros = |n: usize| up(s, &vec![0.0f32; n]);
                let st1 = params
                    .iter()
                    .map(|p| zeros(p.len()))
                    .collect::<Result<Vec<_>>>()?;
                let st2 = params
                    .iter()
                    .map(|p| zeros(p.len()))
                    .collect::<Result<Vec<_>>>()?;
                for step in 1..=steps {
                    match opt {
                        Opt::Sgd(c) => {
                            let slots: Vec<cu::SgdSlot<'_>> = (0..ps.len())
                                .map(|i| cu::SgdSlot {
                                    param: &ps[i],
                                    grad: &gs[i],
                                    momentum_buf: Some(&st1[i]),
                                    first: step == 1,
                                })
                                .collect();
                            let h = cu::SgdHyper {
                                lr: c.lr.into(),
                                momentum: c.momentum.into(),
                                dampening: c.dampening.into(),
                                weight_decay: c.weight_decay.into(),
                                nesterov: c.nesterov,
                            };
                            cu::sgd_step(s, &slots, &h)?;
                        }
                        Opt::Adam(c, decoupled) => {
                            let slots: Vec<cu::AdamSlot<'_>> = (0..ps.len())
                                .map(|i| cu::AdamSlot {
                                    param: &ps[i],
                                    grad: &gs[i],
                                    m: &st1[i],
                                    v: &st2[i],
                                    step: step as u64,
                                })
                                .collect();
                            let h = cu::AdamHyper {
                                lr: c.lr.into(),
                                betas: (c.betas.0.into(), c.betas.1.into()),
                                eps: c.eps.into(),
                                weight_decay: c.weight_decay.into(),
                                decoupled,
                            };
                            cu::adam_step(s, &slots, &h)?;
                        }
                    }
                }
                ps.iter().map(|p| down(s, p)).collect()
            }
        )
    }

    /// `c (m, n) = op(a) op(b)` with inputs rounded to `dtype` (f32, bf16) and an f32
    /// result. CPU: `backend::cpu::gemm::matmul` on the rounded inputs; CUDA: cuBLAS.
    pub fn gemm(
        &self,
        a: &[f32],
        b: &[f32],
        g: (usize, usize, usize),
        trans: fsdp::backend::cpu::gemm::Transpose,
        dtype: fsdp::tensor::DType,
    ) -> Result<Vec<f32>> {
        let (m, k, n) = g;
        let round = |x: &[f32]| -> Vec<f32> {
            match dtype {
                fsdp::tensor::DType::BF16 => x
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect(),
                _ => x.to_vec(),
            }
        };
        crate::on!(
            self,
            {
                let mut c = vec![0.0f32; m * n];
                fsdp::backend::cpu::gemm::matmul(
                    &mut c,
                    &round(a),
                    &round(b),
                    m,
                    k,
                    n,
                    trans,
                    false,
                )?;
                Ok(c)
            },
            |s| {
                let (ta, tb) = match dtype {
                    fsdp::tensor::DType::BF16 => {
                        let cv = |x: &[f32]| {
                            x.iter()
                                .map(|&v| half::bf16::from_f32(v))
                                .collect::<Vec<_>>()
                        };
                        (up(s, &cv(a))?, up(s, &cv(b))?)
                    }
                    _ => (up(s, a)?, up(s, b)?),
                };
                let c = out::<f32>(s, m * n)?;
                cu::gemm(s, &ta, &tb, &c, cu::GemmShape { m, k, n, trans }, 0.0)?;
                down(s, &c)
            }
        )
    }
}
