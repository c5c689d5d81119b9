//! `Linear`: `y = x @ W^T + b` (`torch.nn.Linear`), on the device of its parameters.

use super::{Context, InitKey, Module, ParamVisitor, Parameter};
use crate::error::{Error, Result};
use crate::ops::{self, MatmulDims, Transpose};
use crate::tensor::Tensor;

/// Affine map over the last dimension. `weight: (out, in)`, `bias: (out)`; input
/// `(.., in)` -> output `(.., out)`, f32 (or f64, on the host or a CUDA device, once
/// [`module_to_dtype`](super::module_to_dtype) made the parameters f64). Default init as PyTorch: weight and bias
/// `U(-1/sqrt(in), 1/sqrt(in))`.
///
/// Zero sizes work as in PyTorch: `Linear(in, 0)` maps `(.., in)` to `(.., 0)` and its
/// input gradient is zeros; `Linear(0, out)` maps `(.., 0)` to the bias broadcast over the
/// rows (zeros without a bias), its weight gradient is `(out, 0)` and its bias gradient
/// the row sum of the output gradient; a batch of zero rows gives zero-row outputs and
/// leaves the parameter gradients unchanged. With `in = 0` the bias starts at zeros
/// (`nn.Linear.reset_parameters`: bound `1/sqrt(fan_in)` if `fan_in > 0`, else 0).
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
    /// A `Linear(in, out)` initialized from `key` (PyTorch's default init; with a key of
    /// [`InitKey::torch`], PyTorch's values: `kaiming_uniform_(a=sqrt(5))` then the bias,
    /// drawn from the key's generator).
    pub fn new(in_features: usize, out_features: usize, bias: bool, key: &InitKey) -> Result<Self> {
        if let Some(g) = key.torch_generator() {
            let (w, b) = super::torch_rng::linear_parameters(
                &mut g.lock(),
                in_features,
                out_features,
                bias,
            )?;
            return Ok(Linear {
                weight: Parameter::new("weight", w),
                bias: b.map(|b| Parameter::new("bias", b)),
                in_features,
                out_features,
                saved_x: None,
            });
        }
        let bound = 1.0 / (in_features.max(1) as f32).sqrt();
        let weight = Parameter::new(
            "weight",
            key.uniform("weight", &[out_features, in_features], bound)?,
        );
        let bias = if bias {
            // PyTorch's bias bound is 0 when fan_in is 0: the bias starts at zeros.
            let b = if in_features == 0 {
                InitKey::constant(&[out_features], 0.0)?
            } else {
                key.uniform("bias", &[out_features], bound)?
            };
            Some(Parameter::new("bias", b))
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

    /// The row count of `t (.., width)`: the product of its leading dimensions (not
    /// `numel / width`, which loses the rows when `width` is 0).
    fn rows(&self, t: &Tensor, op: &'static str, width: usize) -> Result<usize> {
        match t.shape().split_last() {
            Some((&last, lead)) if last == width => Ok(lead.iter().product()),
            _ => Err(Error::ShapeMismatch {
                op,
                expected: vec![width],
                got: t.shape().to_vec(),
            }),
        }
    }
}

impl Linear {
    /// [`Module::forward`]; `bias: false` leaves the bias to the caller, which adds it
    /// itself (the MLP's bias fused with its GELU, [`ops::bias_gelu_`]).
    pub(crate) fn forward_inner(&mut self, x: &Tensor, cx: &Context, bias: bool) -> Result<Tensor> {
        self.rows(x, "Linear.forward", self.in_features)?;
        let b = match bias {
            true => self.bias.as_ref().map(|b| b.data()).transpose()?,
            false => None,
        };
        let y = ops::linear(x, self.weight.data()?, b)?;
        if cx.grad_enabled {
            self.saved_x = Some(x.clone());
        }
        Ok(y)
    }

    /// [`Module::backward`]; `bias_grad: false` leaves the bias gradient to the caller,
    /// which has already added it (the MLP's GELU backward fused with it,
    /// [`ops::gelu_backward_bias_grad`]).
    pub(crate) fn backward_inner(&mut self, dy: &Tensor, bias_grad: bool) -> Result<Tensor> {
        let x = self
            .saved_x
            .take()
            .ok_or(Error::NoSavedForward { module: "Linear" })?;
        // Rows come from the saved input: with out = 0 the gradient has no elements to
        // count them by.
        let n = self.rows(&x, "Linear.backward", self.in_features)?;
        if self.rows(dy, "Linear.backward", self.out_features)? != n {
            let mut want = x.shape().to_vec();
            *want.last_mut().unwrap_or(&mut 0) = self.out_features;
            return Err(Error::ShapeMismatch {
                op: "Linear.backward",
                expected: want,
                got: dy.shape().to_vec(),
            });
        }
        let (i, o) = (self.in_features, self.out_features);
        // dx (n, i) = dy (n, o) @ W (o, i)
        let dx = ops::output_like(x.shape(), &x)?;
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
        if let (Some(b), true) = (&mut self.bias, bias_grad) {
            if let Some(g) = b.grad_for_accumulate()? {
                // db (o) += sum over rows of dy (n, o)
                ops::bias_grad(dy, g)?;
            }
        }
        Ok(dx)
    }
}

impl Module for Linear {
    fn type_name(&self) -> &str {
        "Linear"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.forward_inner(x, cx, true)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        self.backward_inner(dy, true)
    }

    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        out.extend(self.saved_x.clone());
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)?;
        match &mut self.bias {
            Some(b) => f("bias", b),
            None => Ok(()),
        }
    }
    fn for_each_child(&mut self, f: &mut super::ChildVisitor<'_>) -> Result<()> {
        super::no_children(f)
    }
}

/// `m`'s backward without its bias gradient when `m` is a plain [`Linear`] with a bias
/// that takes one: returns the input gradient and that bias's gradient tensor, to which the
/// caller must add the column sums of `dy` ([`ops::bias_grad`], same bits; the GPT block
/// adds them in the LayerNorm backward kernel that reads `dy` anyway). Any other module:
/// its backward, and `None`.
///
/// # Errors
/// As [`Module::backward`].
pub(crate) fn backward_deferring_bias(
    m: &mut Box<dyn Module>,
    dy: &Tensor,
    cx: &Context,
) -> Result<(Tensor, Option<Tensor>)> {
    let lin = m
        .as_any_mut()
        .and_then(|a| a.downcast_mut::<Linear>())
        .filter(|l| l.bias.is_some());
    match lin {
        Some(l) => {
            let dx = l.backward_inner(dy, false)?;
            let db = match l.bias.as_mut() {
                Some(b) => b.grad_for_accumulate()?.cloned(),
                None => None,
            };
            Ok((dx, db))
        }
        None => Ok((m.backward(dy, cx)?, None)),
    }
}
