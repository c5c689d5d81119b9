//! `Linear`: `y = x @ W^T + b` (`torch.nn.Linear`), on the device of its parameters.

use super::{Context, InitKey, Module, Parameter};
use crate::error::{Error, Result};
use crate::ops::{self, MatmulDims, Transpose};
use crate::tensor::Tensor;

/// Affine map over the last dimension. `weight: (out, in)`, `bias: (out)`; input
/// `(.., in)` -> output `(.., out)`, f32. Default init as PyTorch: weight and bias
/// `U(-1/sqrt(in), 1/sqrt(in))`.
pub struct Linear {
    /// `(out_features, in_features)` f32 (`nn.Linear.weight`).
    pub weight: Parameter,
    /// `(out_features)` f32 (`nn.Linear.bias`); `None` when built with `bias: false`.
    pub bias: Option<Parameter>,
    in_features: usize,
    out_features: usize,
    saved_x: Option<Tensor>,
}

impl Linear {
    /// A `Linear(in, out)` initialized from `key` (PyTorch's default init).
    pub fn new(in_features: usize, out_features: usize, bias: bool, key: &InitKey) -> Result<Self> {
        let bound = 1.0 / (in_features.max(1) as f32).sqrt();
        let weight = Parameter::new(
            "weight",
            key.uniform("weight", &[out_features, in_features], bound)?,
        );
        let bias = if bias {
            Some(Parameter::new(
                "bias",
                key.uniform("bias", &[out_features], bound)?,
            ))
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            in_features,
            out_features,
            saved_x: None,
        })
    }

    /// A `Linear` with weight `N(0, std^2)` and zero bias (GPT-2 style init).
    pub fn new_normal(
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f32,
        key: &InitKey,
    ) -> Result<Self> {
        let mut l = Self::new(in_features, out_features, bias, key)?;
        l.weight.set_data(Some(key.normal(
            "weight",
            &[out_features, in_features],
            std,
        )?))?;
        if let Some(b) = &mut l.bias {
            b.set_data(Some(InitKey::constant(&[out_features], 0.0)?))?;
        }
        Ok(l)
    }

    fn rows(&self, x: &Tensor, op: &'static str, width: usize) -> Result<usize> {
        let last = x.shape().last().copied().unwrap_or(0);
        if last != width || x.shape().is_empty() {
            return Err(Error::ShapeMismatch {
                op,
                expected: vec![width],
                got: x.shape().to_vec(),
            });
        }
        Ok(x.numel() / width.max(1))
    }
}

impl Module for Linear {
    fn type_name(&self) -> &'static str {
        "Linear"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.rows(x, "Linear.forward", self.in_features)?;
        let bias = self.bias.as_ref().map(|b| b.data()).transpose()?;
        let y = ops::linear(x, self.weight.data()?, bias)?;
        if cx.grad_enabled {
            self.saved_x = Some(x.clone());
        }
        Ok(y)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let x = self
            .saved_x
            .take()
            .ok_or(Error::NoSavedForward { module: "Linear" })?;
        let n = self.rows(dy, "Linear.backward", self.out_features)?;
        let (i, o) = (self.in_features, self.out_features);
        // dx (n, i) = dy (n, o) @ W (o, i)
        let dx = ops::output(x.shape(), x.device())?;
        ops::matmul(
            &dx,
            dy,
            self.weight.data()?,
            MatmulDims::new(n, o, i, Transpose::NN),
            false,
        )?;
        if let Some(g) = self.weight.grad_for_accumulate()? {
            // dW (o, i) += dy^T (o, n) @ x (n, i)
            ops::matmul(g, dy, &x, MatmulDims::new(o, n, i, Transpose::TN), true)?;
        }
        if let Some(b) = &mut self.bias {
            if let Some(g) = b.grad_for_accumulate()? {
                // db (o) += sum over rows of dy (n, o)
                ops::bias_grad(dy, g)?;
            }
        }
        Ok(dx)
    }

    fn for_each_param(&mut self, f: &mut dyn FnMut(&str, &mut Parameter)) {
        f("weight", &mut self.weight);
        if let Some(b) = &mut self.bias {
            f("bias", b);
        }
    }
}
