//! `LayerNorm` over the last dimension (`torch.nn.LayerNorm(C)`, eps 1e-5, affine), on the
//! device of its parameters.

use super::{Context, InitKey, Module, ParamVisitor, Parameter};
use crate::error::{Error, Result};
use crate::ops::{self, LayerNormSaved};
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
    /// Normalized x (.., C) and 1/std per row, on the input's device.
    saved: Option<LayerNormSaved>,
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
    fn type_name(&self) -> &str {
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
        let (y, saved) = ops::layer_norm(x, self.weight.data()?, self.bias.data()?, self.eps)?;
        if cx.grad_enabled {
            self.saved = Some(saved);
        }
        Ok(y)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let saved = self.saved.take().ok_or(Error::NoSavedForward {
            module: "LayerNorm",
        })?;
        let w = self.weight.data()?.clone();
        let dw = self.weight.grad_for_accumulate()?.cloned();
        let db = self.bias.grad_for_accumulate()?.cloned();
        // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w
        ops::layer_norm_backward(dy, &saved, &w, dw.as_ref(), db.as_ref())
    }

    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        if let Some(s) = &self.saved {
            out.extend([s.xhat.clone(), s.rstd.clone()]);
            out.extend(s.mean.clone());
        }
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)?;
        f("bias", &mut self.bias)
    }
    fn for_each_child(&mut self, f: &mut super::ChildVisitor<'_>) -> Result<()> {
        super::no_children(f)
    }
}
