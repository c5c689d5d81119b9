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

impl LayerNorm {
    fn check_input(&self, x: &Tensor) -> Result<()> {
        if x.shape().last() != Some(&self.dim) {
            return Err(Error::ShapeMismatch {
                op: "LayerNorm.forward",
                expected: vec![self.dim],
                got: x.shape().to_vec(),
            });
        }
        Ok(())
    }

    /// What a backward reads: the saved forward (taken), the weight, and the parameters'
    /// gradients to accumulate into (`None` when frozen).
    #[allow(clippy::type_complexity)]
    fn backward_inputs(
        &mut self,
    ) -> Result<(LayerNormSaved, Tensor, Option<Tensor>, Option<Tensor>)> {
        let saved = self.saved.take().ok_or(Error::NoSavedForward {
            module: "LayerNorm",
        })?;
        let w = self.weight.data()?.clone();
        let dw = self.weight.grad_for_accumulate()?.cloned();
        let db = self.bias.grad_for_accumulate()?.cloned();
        Ok((saved, w, dw, db))
    }

    /// The residual add in front of this norm and the norm itself: `(x + r, self(x + r))`,
    /// the same bits as [`ops::add`] then [`forward`](Module::forward), one kernel on CUDA
    /// ([`ops::add_layer_norm`]). The GPT block's `x1 = x + attn(..)`, `ln_2(x1)`.
    ///
    /// # Errors
    /// As [`forward`](Module::forward) and [`ops::add`].
    pub fn forward_add(
        &mut self,
        x: &Tensor,
        r: &Tensor,
        cx: &Context,
    ) -> Result<(Tensor, Tensor)> {
        self.check_input(x)?;
        let (sum, y, saved) =
            ops::add_layer_norm(x, r, self.weight.data()?, self.bias.data()?, self.eps)?;
        if cx.grad_enabled {
            self.saved = Some(saved);
        }
        Ok((sum, y))
    }

    /// [`backward`](Module::backward) plus the residual stream's gradient: `res + dx`, the
    /// same bits as [`ops::add`]`(res, backward(dy))`, and `res_db += ` the column sums of
    /// `res` when given (a bias gradient the caller deferred, [`ops::bias_grad`]'s bits);
    /// one kernel on CUDA ([`ops::layer_norm_backward_add`]).
    ///
    /// # Errors
    /// As [`backward`](Module::backward), [`ops::add`] and [`ops::bias_grad`].
    pub fn backward_add(
        &mut self,
        dy: &Tensor,
        res: &Tensor,
        res_db: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (saved, w, dw, db) = self.backward_inputs()?;
        ops::layer_norm_backward_add(dy, &saved, &w, dw.as_ref(), db.as_ref(), res, res_db)
    }
}

impl Module for LayerNorm {
    fn type_name(&self) -> &str {
        "LayerNorm"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.check_input(x)?;
        let (y, saved) = ops::layer_norm(x, self.weight.data()?, self.bias.data()?, self.eps)?;
        if cx.grad_enabled {
            self.saved = Some(saved);
        }
        Ok(y)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let (saved, w, dw, db) = self.backward_inputs()?;
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

    /// Itself: the GPT block reaches it to fuse its residual adds in
    /// ([`forward_add`](LayerNorm::forward_add), [`backward_add`](LayerNorm::backward_add)).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}
