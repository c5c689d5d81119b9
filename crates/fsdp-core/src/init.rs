//! [`ParamInit`]: how element `i` of a parameter is initialized, as a pure function of `i`.
//! A leaf module: the tensor layer records an initializer in a meta tensor's storage
//! (deferred init), `nn` builds initializers from a seed and a parameter path
//! (`nn::InitKey`), and FSDP computes each rank's shard of them.
//!
//! Element `i` of parameter `name` under seed `s` is a pure function of `(s, name, i)`: a
//! SplitMix64 hash of the three. So a rank can compute exactly the values of its shard, and
//! a model is initialized identically for every world size, strategy and wrap policy.

/// How element `i` of a parameter is initialized: a pure function of `i` (and the seed and
/// parameter path folded into `stream`), so any range of elements can be computed alone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// N(0, std^2) (`torch.nn.init.normal_`), Box-Muller on the two halves of 48 hash bits.
    Normal {
        /// Hash of (seed, parameter path).
        stream: u64,
        /// Standard deviation.
        std: f32,
    },
    /// U(-bound, bound) (`torch.nn.init.uniform_`).
    Uniform {
        /// Hash of (seed, parameter path).
        stream: u64,
        /// Half-width of the interval.
        bound: f32,
    },
    /// Every element `value` (`torch.nn.init.constant_`).
    Constant(f32),
}

impl ParamInit {
    /// The value of element `i`.
    pub fn value_at(&self, i: u64) -> f32 {
        match *self {
            ParamInit::Normal { stream, std } => {
                let b = splitmix64(stream ^ splitmix64(i));
                let u1 = ((b >> 40) as f64 + 1.0) / (1u64 << 24) as f64; // (0, 1]
                let u2 = ((b & 0xFF_FFFF) as f64) / (1u64 << 24) as f64; // [0, 1)
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (z * std as f64) as f32
            }
            ParamInit::Uniform { stream, bound } => {
                let u = (splitmix64(stream ^ splitmix64(i)) >> 40) as f32 / (1u64 << 24) as f32;
                (2.0 * u - 1.0) * bound
            }
            ParamInit::Constant(v) => v,
        }
    }

    /// `out[k] = value_at(start + k)`.
    pub fn fill(&self, start: u64, out: &mut [f32]) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.value_at(start + k as u64);
        }
    }
}

/// SplitMix64's output function (Steele, Lea and Flood 2014): a bijective 64-bit mix.
#[doc(hidden)] // crate-internal, public only for the layers above
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
