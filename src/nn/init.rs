//! Counter-based parameter initialization.
//!
//! Element `i` of parameter `name` under seed `s` is a pure function of `(s, name, i)`: a
//! SplitMix64 hash of the three. So a rank can compute exactly the values of its shard, and
//! a model is initialized identically for every world size, strategy and wrap policy.

use crate::error::Result;
use crate::tensor::{numel_of, Tensor};

/// Where a module draws its initial values: the seed and the module's path in the model.
#[derive(Debug, Clone)]
pub struct InitKey {
    seed: u64,
    path: String,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl InitKey {
    /// The root key of a model.
    pub fn new(seed: u64) -> Self {
        InitKey {
            seed,
            path: String::new(),
        }
    }

    /// The key of child `name` (`key.child("blocks.0")`).
    pub fn child(&self, name: &str) -> InitKey {
        InitKey {
            seed: self.seed,
            path: crate::nn::join_name(&self.path, name),
        }
    }

    /// The module path this key stands for.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn stream(&self, name: &str) -> u64 {
        splitmix64(self.seed ^ fnv1a(&crate::nn::join_name(&self.path, name)))
    }

    /// 64 random bits for element `i` of parameter `name`.
    pub fn bits(&self, name: &str, i: u64) -> u64 {
        splitmix64(self.stream(name) ^ splitmix64(i))
    }

    /// Element `i` of `name` drawn from N(0, std^2) (Box-Muller on the two 32-bit halves).
    pub fn normal_at(&self, stream: u64, i: u64, std: f32) -> f32 {
        let b = splitmix64(stream ^ splitmix64(i));
        let u1 = ((b >> 40) as f64 + 1.0) / (1u64 << 24) as f64; // (0, 1]
        let u2 = ((b & 0xFF_FFFF) as f64) / (1u64 << 24) as f64; // [0, 1)
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        (z * std as f64) as f32
    }

    /// f32 tensor of `shape` with N(0, std^2) values (`torch.nn.init.normal_`).
    pub fn normal(&self, name: &str, shape: &[usize], std: f32) -> Result<Tensor> {
        let s = self.stream(name);
        let v = (0..numel_of(shape) as u64)
            .map(|i| self.normal_at(s, i, std))
            .collect();
        Tensor::from_vec(v, shape)
    }

    /// f32 tensor of `shape` with U(-bound, bound) values (`torch.nn.init.uniform_`).
    pub fn uniform(&self, name: &str, shape: &[usize], bound: f32) -> Result<Tensor> {
        let s = self.stream(name);
        let v = (0..numel_of(shape) as u64)
            .map(|i| {
                let u = (splitmix64(s ^ splitmix64(i)) >> 40) as f32 / (1u64 << 24) as f32;
                (2.0 * u - 1.0) * bound
            })
            .collect();
        Tensor::from_vec(v, shape)
    }

    /// f32 tensor of `shape` filled with `value`.
    pub fn constant(shape: &[usize], value: f32) -> Result<Tensor> {
        Tensor::from_vec(vec![value; numel_of(shape)], shape)
    }
}
