//! Elementwise activations: `ReLU` and exact (erf) `GELU`, as `torch.nn.ReLU` / `torch.nn.GELU()`.

use super::{Context, Module};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Shared forward/backward of a pointwise activation `y = f(x)`, `dx = dy * f'(x)`.
struct Pointwise {
    name: &'static str,
    f: fn(f32) -> f32,
    df: fn(f32) -> f32,
    saved_x: Option<Tensor>,
}

impl Pointwise {
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let f = self.f;
        let y: Vec<f32> = x.f32()?.iter().map(|&v| f(v)).collect();
        if cx.grad_enabled {
            self.saved_x = Some(x.clone());
        }
        Tensor::from_vec(y, x.shape())
    }

    fn backward(&mut self, dy: &Tensor) -> Result<Tensor> {
        let x = self
            .saved_x
            .take()
            .ok_or(Error::NoSavedForward { module: self.name })?;
        let df = self.df;
        let dx: Vec<f32> = x
            .f32()?
            .iter()
            .zip(dy.f32()?.iter())
            .map(|(&x, &g)| g * df(x))
            .collect();
        Tensor::from_vec(dx, x.shape())
    }
}

macro_rules! pointwise_module {
    ($(#[$doc:meta])* $t:ident, $f:expr, $df:expr) => {
        $(#[$doc])*
        pub struct $t(Pointwise);

        impl $t {
            pub fn new() -> Self {
                $t(Pointwise { name: stringify!($t), f: $f, df: $df, saved_x: None })
            }
        }

        impl Default for $t {
            fn default() -> Self {
                Self::new()
            }
        }

        impl Module for $t {
            fn type_name(&self) -> &'static str {
                stringify!($t)
            }
            fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
                self.0.forward(x, cx)
            }
            fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
                self.0.backward(dy)
            }
        }
    };
}

pointwise_module!(
    /// `y = max(x, 0)`; any shape, f32 (`torch.nn.ReLU`).
    ReLU,
    |x| x.max(0.0),
    |x| if x > 0.0 { 1.0 } else { 0.0 }
);

pointwise_module!(
    /// `y = x * Phi(x)` with the exact normal CDF `Phi(x) = (1 + erf(x / sqrt 2)) / 2`
    /// (`torch.nn.GELU()`, `approximate='none'`); any shape, f32.
    GELU,
    gelu,
    gelu_grad
);

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
    let y = 1.0 - poly * (-ax * ax).exp();
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
    let pdf = INV_SQRT_2PI * (-0.5 * x * x).exp();
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
