//! `LayerNorm` over the last dimension (`torch.nn.LayerNorm(C)`, eps 1e-5, affine).

use super::{Context, InitKey, Module, Parameter};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `y = (x - mean) / sqrt(var + eps) * weight + bias` over the last dim of size `C`, with
/// the biased variance. `weight, bias: (C)`, init ones / zeros. Input `(.., C)`, f32.
pub struct LayerNorm {
    /// Scale `gamma`, `(C)` f32, init ones (`nn.LayerNorm.weight`).
    pub weight: Parameter,
    /// Shift `beta`, `(C)` f32, init zeros (`nn.LayerNorm.bias`).
    pub bias: Parameter,
    dim: usize,
    eps: f32,
    /// (normalized x (.., C), 1/std per row)
    saved: Option<(Vec<f32>, Vec<f32>)>,
}

impl LayerNorm {
    /// `LayerNorm(dim)` with eps 1e-5.
    pub fn new(dim: usize) -> Result<Self> {
        Ok(LayerNorm {
            weight: Parameter::new("weight", InitKey::constant(&[dim], 1.0)?),
            bias: Parameter::new("bias", InitKey::constant(&[dim], 0.0)?),
            dim,
            eps: 1e-5,
            saved: None,
        })
    }
}

impl Module for LayerNorm {
    fn type_name(&self) -> &'static str {
        "LayerNorm"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let c = self.dim;
        if x.shape().last() != Some(&c) {
            return Err(Error::ShapeMismatch {
                op: "LayerNorm.forward",
                expected: vec![c],
                got: x.shape().to_vec(),
            });
        }
        let xv = x.f32()?;
        let (w, b) = (self.weight.data()?.f32()?, self.bias.data()?.f32()?);
        let rows = xv.len() / c.max(1);
        let mut y = vec![0.0f32; xv.len()];
        let mut xhat = vec![0.0f32; if cx.grad_enabled { xv.len() } else { 0 }];
        let mut rstds = Vec::with_capacity(rows);
        for r in 0..rows {
            let row = &xv[r * c..(r + 1) * c];
            let mean = row.iter().sum::<f32>() / c as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c as f32;
            let rstd = 1.0 / (var + self.eps).sqrt();
            rstds.push(rstd);
            for j in 0..c {
                let n = (row[j] - mean) * rstd;
                if cx.grad_enabled {
                    xhat[r * c + j] = n;
                }
                y[r * c + j] = n * w[j] + b[j];
            }
        }
        if cx.grad_enabled {
            self.saved = Some((xhat, rstds));
        }
        Tensor::from_vec(y, x.shape())
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let (xhat, rstds) = self.saved.take().ok_or(Error::NoSavedForward {
            module: "LayerNorm",
        })?;
        let c = self.dim;
        let dyv = dy.f32()?;
        if dyv.len() != xhat.len() {
            return Err(Error::ShapeMismatch {
                op: "LayerNorm.backward",
                expected: vec![xhat.len()],
                got: dy.shape().to_vec(),
            });
        }
        let w = self.weight.data()?.f32()?.to_vec();
        if let Some(g) = self.weight.grad_for_accumulate() {
            let mut g = g.f32_mut()?;
            for (dyr, xr) in dyv.chunks_exact(c).zip(xhat.chunks_exact(c)) {
                for j in 0..c {
                    g[j] += dyr[j] * xr[j];
                }
            }
        }
        if let Some(g) = self.bias.grad_for_accumulate() {
            let mut g = g.f32_mut()?;
            for dyr in dyv.chunks_exact(c) {
                crate::backend::cpu::ops::add_(&mut g, dyr);
            }
        }
        // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w
        let mut dx = vec![0.0f32; dyv.len()];
        crate::backend::cpu::kernels::layernorm_bwd(&dyv, &xhat, &rstds, &w, &mut dx)?;
        Tensor::from_vec(dx, dy.shape())
    }

    fn for_each_param(&mut self, f: &mut dyn FnMut(&str, &mut Parameter)) {
        f("weight", &mut self.weight);
        f("bias", &mut self.bias);
    }
}
