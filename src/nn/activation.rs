//! Elementwise activations: `ReLU` and exact (erf) `GELU`, as `torch.nn.ReLU` / `torch.nn.GELU()`,
//! on any device (through [`crate::ops::pointwise`]).

use super::{Context, Module};
use crate::backend::cpu::ops::exp;
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

impl<F: PointwiseFn> Default for Pointwise<F> {
    fn default() -> Self {
        Self::new()
    }
}

impl<F: PointwiseFn> Module for Pointwise<F> {
    fn type_name(&self) -> &'static str {
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

/// ReLU of one value, `max(x, 0)` (the CPU reference of `relu_fwd_f32`).
#[inline]
pub fn relu(x: f32) -> f32 {
    x.max(0.0)
}

/// d ReLU / dx: 1 for `x > 0`, else 0.
#[inline]
pub fn relu_grad(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else {
        0.0
    }
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1 / sqrt(2 pi)
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// erf(x) to within 1.5e-7 absolute in exact arithmetic, 6e-7 in f32 (Abramowitz & Stegun 7.1.26): a polynomial and one
/// exp, so the loop over a tensor vectorizes (libm's erff does not, and was 13% of a CPU
/// training step in a profile).
#[inline]
pub fn erf(x: f32) -> f32 {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_7,
        -1.453_152_1,
        1.061_405_4,
    ];
    let ax = x.abs();
    let t = 1.0 / (1.0 + P * ax);
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    let y = 1.0 - poly * exp(-ax * ax);
    y.copysign(x)
}

/// GELU of one value (the CPU reference of the `gelu_f32` kernel).
#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * FRAC_1_SQRT_2))
}

/// d GELU / dx = Phi(x) + x * phi(x).
#[inline]
pub fn gelu_grad(x: f32) -> f32 {
    let cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
    let pdf = INV_SQRT_2PI * exp(-0.5 * x * x);
    cdf + x * pdf
}

#[cfg(test)]
mod tests {
    #[test]
    fn fast_erf_matches_libm() {
        let worst = (-4000..=4000)
            .map(|i| i as f32 / 1000.0)
            .map(|x| (super::erf(x) - libm::erff(x)).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-6, "max |erf - libm erff| = {worst}");
    }
}
