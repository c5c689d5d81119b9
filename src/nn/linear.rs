//! `Linear`: `y = x @ W^T + b` (`torch.nn.Linear`).

use super::{Context, InitKey, Module, Parameter};
use crate::backend::cpu::gemm::{matmul, Transpose};
use crate::error::{Error, Result};
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
        let n = self.rows(x, "Linear.forward", self.in_features)?;
        let (i, o) = (self.in_features, self.out_features);
        let mut shape = x.shape().to_vec();
        *shape.last_mut().unwrap_or(&mut 0) = o;
        let mut y = vec![0.0f32; n * o];
        if let Some(b) = &self.bias {
            let b = b.data()?.f32()?;
            for row in y.chunks_exact_mut(o.max(1)) {
                row.copy_from_slice(&b);
            }
        }
        // y (n, o) += x (n, i) @ W^T, W stored (o, i)
        matmul(
            &mut y,
            &x.f32()?,
            &self.weight.data()?.f32()?,
            n,
            i,
            o,
            Transpose::NT,
            true,
        )?;
        if cx.grad_enabled {
            self.saved_x = Some(x.clone());
        }
        Tensor::from_vec(y, &shape)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let x = self
            .saved_x
            .take()
            .ok_or(Error::NoSavedForward { module: "Linear" })?;
        let n = self.rows(dy, "Linear.backward", self.out_features)?;
        let (i, o) = (self.in_features, self.out_features);
        let dyv = dy.f32()?;
        // dx (n, i) = dy (n, o) @ W (o, i)
        let mut dx = vec![0.0f32; n * i];
        matmul(
            &mut dx,
            &dyv,
            &self.weight.data()?.f32()?,
            n,
            o,
            i,
            Transpose::NN,
            false,
        )?;
        if let Some(g) = self.weight.grad_for_accumulate() {
            // dW (o, i) += dy^T (o, n) @ x (n, i)
            matmul(
                &mut g.f32_mut()?,
                &dyv,
                &x.f32()?,
                o,
                n,
                i,
                Transpose::TN,
                true,
            )?;
        }
        if let Some(b) = &mut self.bias {
            if let Some(g) = b.grad_for_accumulate() {
                let mut g = g.f32_mut()?;
                for row in dyv.chunks_exact(o.max(1)) {
                    crate::backend::cpu::ops::add_(&mut g, row);
                }
            }
        }
        Tensor::from_vec(dx, x.shape())
    }

    fn for_each_param(&mut self, f: &mut dyn FnMut(&str, &mut Parameter)) {
        f("weight", &mut self.weight);
        if let Some(b) = &mut self.bias {
            f("bias", b);
        }
    }
}
