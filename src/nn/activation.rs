//! Elementwise activations: `ReLU` and exact (erf) `GELU`, as `torch.nn.ReLU` / `torch.nn.GELU()`,
//! on any device (through [`crate::ops::pointwise`]).

use super::{Context, Module};
pub use crate::backend::cpu::scalar::{gelu, gelu_grad, relu, relu_grad};
use crate::error::{Error, Result};
use crate::ops::{self, Pointwise as Op};
use crate::tensor::Tensor;

/// The scalar function of a pointwise activation and its derivative, and the op that
/// computes it over a tensor on any device.
pub trait PointwiseFn: Send + 'static {
    /// Type name (`"GELU"`).
    const NAME: &'static str;
    /// The device-dispatching op computing `f` and `f'` over tensors.
    const OP: Op;
    fn f(x: f32) -> f32;
    fn df(x: f32) -> f32;
}

/// A pointwise activation `y = f(x)`, `dx = dy * f'(x)`; any shape, f32, any device.
pub struct Pointwise<F: PointwiseFn> {
    saved_x: Option<Tensor>,
    _f: std::marker::PhantomData<F>,
}

impl<F: PointwiseFn> Pointwise<F> {
    pub fn new() -> Self {
        Pointwise {
            saved_x: None,
            _f: std::marker::PhantomData,
        }
    }
}

impl<F: PointwiseFn> Pointwise<F> {
    /// The input saved by the last training forward, if any (what backward reads).
    pub(crate) fn saved_input(&self) -> Option<&Tensor> {
        self.saved_x.as_ref()
    }

    /// Drops the saved input: a caller that ran this module's backward itself (the MLP's
    /// fused GELU and bias gradient) ends its forward-backward pair.
    pub(crate) fn clear_saved(&mut self) {
        self.saved_x = None;
    }

    /// Saves `x` as the input of a forward a caller ran itself (the MLP's fused bias and
    /// GELU), as [`forward`](Module::forward) would have under `cx`.
    pub(crate) fn save_input(&mut self, x: &Tensor, cx: &Context) {
        if cx.grad_enabled {
            self.saved_x = Some(x.clone());
        }
    }
}

impl<F: PointwiseFn> Default for Pointwise<F> {
    fn default() -> Self {
        Self::new()
    }
}

impl<F: PointwiseFn> Module for Pointwise<F> {
    fn type_name(&self) -> &str {
        F::NAME
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let y = ops::pointwise(F::OP, x)?;
        if cx.grad_enabled {
            self.saved_x = Some(x.clone());
        }
        Ok(y)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let x = self
            .saved_x
            .take()
            .ok_or(Error::NoSavedForward { module: F::NAME })?;
        ops::pointwise_backward(F::OP, &x, dy)
    }
    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        out.extend(self.saved_x.clone());
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn for_each_param(&mut self, f: &mut super::ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }
    fn for_each_child(&mut self, f: &mut super::ChildVisitor<'_>) -> Result<()> {
        super::no_children(f)
    }
}

/// `max(x, 0)`.
pub struct ReluFn;
impl PointwiseFn for ReluFn {
    const NAME: &'static str = "ReLU";
    const OP: Op = Op::Relu;
    #[inline]
    fn f(x: f32) -> f32 {
        relu(x)
    }
    #[inline]
    fn df(x: f32) -> f32 {
        relu_grad(x)
    }
}

/// Exact (erf) GELU.
pub struct GeluFn;
impl PointwiseFn for GeluFn {
    const NAME: &'static str = "GELU";
    const OP: Op = Op::Gelu;
    #[inline]
    fn f(x: f32) -> f32 {
        gelu(x)
    }
    #[inline]
    fn df(x: f32) -> f32 {
        gelu_grad(x)
    }
}

/// `y = max(x, 0)`; any shape, f32 (`torch.nn.ReLU`).
pub type ReLU = Pointwise<ReluFn>;

/// `y = x * Phi(x)` with the exact normal CDF `Phi(x) = (1 + erf(x / sqrt 2)) / 2`
/// (`torch.nn.GELU()`, `approximate='none'`); any shape, f32.
pub type GELU = Pointwise<GeluFn>;
