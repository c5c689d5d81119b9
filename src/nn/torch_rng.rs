//! PyTorch's CPU random number generator, bit for bit: `torch.manual_seed`, `uniform_`,
//! `normal_`, `randn`, `randperm`, and the default initializers of `nn.Linear`,
//! `nn.Embedding` and `nn.LayerNorm` drawn from it. An opt-in initializer
//! ([`InitKey::torch`](super::InitKey::torch)): with it a model built here starts from the
//! values PyTorch gives the same script after `torch.manual_seed(seed)`. The counter-based
//! [`InitKey::new`](super::InitKey::new) stays the default, because only it lets a rank
//! compute its shard alone (a sequential generator draws every element before the next).
//!
//! | piece | PyTorch file |
//! |---|---|
//! | mt19937, seeding, `random()`, `random64()` | `aten/src/ATen/core/MT19937RNGEngine.h`, `aten/src/ATen/CPUGeneratorImpl.cpp` |
//! | uniform and Box-Muller transforms, the cached second normal | `aten/src/ATen/core/TransformationHelper.h`, `aten/src/ATen/core/DistributionsHelper.h` |
//! | `uniform_`, `normal_` on the CPU (the 16-wide normal kernel) | `aten/src/ATen/native/cpu/DistributionTemplates.h` |
//! | the float log/sin/cos of that kernel (Cephes polynomials) | `aten/src/ATen/native/cpu/avx_mathfun.h` |
//! | `randperm` | `aten/src/ATen/native/TensorFactories.cpp` |
//! | `kaiming_uniform_`, `calculate_gain`, `nn.Linear.reset_parameters` | `torch/nn/init.py`, `torch/nn/modules/linear.py` |
//!
//! Checked against values printed by pip torch 2.11.0 (`tests/torch_ref/make_rng_refs.py`,
//! `tests/nn_optim/torch_rng.rs`): every draw below is bitwise equal. Limits: `normal_` on an f32
//! tensor of 16 or more elements follows the x86-64 kernel PyTorch runs on any CPU with AVX2
//! (its AVX-512 build uses the same one); PyTorch on other CPUs (arm64) computes that
//! case with the C library's `log`/`cos`/`sin` in float, which can differ in the last bit.
//! The f64 transforms call the platform's `log1p`, `sin`, `cos` as PyTorch does (glibc on
//! Linux).

use crate::error::Result;
use crate::tensor::{numel_of, Tensor};

/// Words of the Mersenne Twister state.
const N: usize = 624;
/// The twist offset.
const M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UPPER: u32 = 0x8000_0000;
const LOWER: u32 = 0x7fff_ffff;

/// The 32-bit Mersenne Twister (`std::mt19937`, PyTorch's `at::mt19937`), seeded from the
/// low 32 bits of a 64-bit seed as PyTorch does.
#[derive(Clone)]
struct Mt19937 {
    state: [u32; N],
    /// Index of the next word to temper; `N` means the state must be regenerated first.
    next: usize,
}

impl Mt19937 {
    fn new(seed: u64) -> Self {
        let mut state = [0u32; N];
        state[0] = seed as u32;
        for j in 1..N {
            let prev = state[j - 1];
            state[j] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(j as u32);
        }
        Mt19937 { state, next: N }
    }

    fn twist(u: u32, v: u32) -> u32 {
        let mixed = (u & UPPER) | (v & LOWER);
        (mixed >> 1) ^ if v & 1 != 0 { MATRIX_A } else { 0 }
    }

    /// Regenerates all `N` words (the reference's `next_state`).
    fn refill(&mut self) {
        let s = &mut self.state;
        for k in 0..N {
            let v = s[(k + 1) % N];
            s[k] = s[(k + M) % N] ^ Self::twist(s[k], v);
        }
        self.next = 0;
    }

    fn next_u32(&mut self) -> u32 {
        if self.next >= N {
            self.refill();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }
}

/// PyTorch's CPU generator (`torch.Generator()`, the default one `torch.manual_seed` seeds):
/// an mt19937 engine plus the cached second sample of the scalar Box-Muller transform.
///
/// ```
/// use fsdp::nn::TorchGenerator;
/// let mut g = TorchGenerator::manual_seed(0);
/// let mut u = [0f32; 3];
/// g.uniform_f32(&mut u, 0.0, 1.0); // torch.empty(3).uniform_(0, 1)
/// assert_eq!(u[0], 0.49625659); // torch.manual_seed(0); torch.rand(3)[0]
/// let x = g.randn(&[2, 4]).unwrap(); // torch.randn(2, 4): f32 (2, 4)
/// assert_eq!(x.shape(), &[2, 4]);
/// ```
#[derive(Clone)]
pub struct TorchGenerator {
    engine: Mt19937,
    seed: u64,
    /// `next_double_normal_sample`: the sine half of the last scalar Box-Muller pair.
    next_normal: Option<f64>,
}

impl std::fmt::Debug for TorchGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TorchGenerator(seed {})", self.seed)
    }
}

impl TorchGenerator {
    /// A generator seeded with `seed` (`torch.Generator().manual_seed(seed)`, or the state
    /// of the default generator after `torch.manual_seed(seed)`). Only the low 32 bits of
    /// the seed reach the engine, as in PyTorch.
    pub fn manual_seed(seed: u64) -> Self {
        TorchGenerator {
            engine: Mt19937::new(seed),
            seed,
            next_normal: None,
        }
    }

    /// The seed given to [`TorchGenerator::manual_seed`] (`initial_seed()`).
    pub fn initial_seed(&self) -> u64 {
        self.seed
    }

    /// The next 32 random bits (`CPUGeneratorImpl::random`).
    pub fn random(&mut self) -> u32 {
        self.engine.next_u32()
    }

    /// 64 random bits from two draws, the first in the high half
    /// (`CPUGeneratorImpl::random64`).
    pub fn random64(&mut self) -> u64 {
        let hi = self.random() as u64;
        let lo = self.random() as u64;
        (hi << 32) | lo
    }

    /// One f32 in `[0, 1)` from the low 24 bits of a 32-bit draw.
    fn unit_f32(&mut self) -> f32 {
        (self.random() & 0x00ff_ffff) as f32 * (1.0 / 16_777_216.0)
    }

    /// One f64 in `[0, 1)` from the low 53 bits of a 64-bit draw.
    fn unit_f64(&mut self) -> f64 {
        (self.random64() & ((1u64 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// Fills `out` as `tensor.uniform_(from, to)` does an f32 tensor: one 32-bit draw per
    /// element, in order; the bounds are rounded to f32 first and `u * (to - from) + from`
    /// is computed in f32 with one fused multiply-add, as PyTorch's x86-64 build does
    /// (`uniform_real` of `TransformationHelper.h`, contracted by the compiler). `from > to`
    /// is PyTorch's error; here the interval is used as is.
    pub fn uniform_f32(&mut self, out: &mut [f32], from: f64, to: f64) {
        let (from, to) = (from as f32, to as f32);
        let width = to - from;
        for o in out {
            *o = self.unit_f32().mul_add(width, from);
        }
    }

    /// Fills `out` as `uniform_(from, to)` does an f64 tensor (one 64-bit draw per element,
    /// fused multiply-add as in [`uniform_f32`](Self::uniform_f32)).
    pub fn uniform_f64(&mut self, out: &mut [f64], from: f64, to: f64) {
        let width = to - from;
        for o in out {
            *o = self.unit_f64().mul_add(width, from);
        }
    }

    /// One sample of the scalar Box-Muller transform (`at::normal_distribution<double>`):
    /// the cached sine half of the previous pair if there is one, else a new pair from two
    /// 64-bit draws whose sine half is cached.
    fn normal_scalar(&mut self, mean: f64, std: f64) -> f64 {
        let z = match self.next_normal.take() {
            Some(z) => z,
            None => {
                let u1 = self.unit_f64();
                let u2 = self.unit_f64();
                let r = (-2.0 * (-u2).ln_1p()).sqrt();
                let theta = 2.0 * std::f64::consts::PI * u1;
                self.next_normal = Some(r * theta.sin());
                r * theta.cos()
            }
        };
        z * std + mean
    }

    /// Fills `out` as `tensor.normal_(mean, std)` does a contiguous f32 tensor on the CPU:
    /// below 16 elements, the scalar transform (f64, with its cached sample); from 16 on,
    /// uniforms for every element first, then the 16-wide kernel on each block of 16
    /// (element `j` and `j + 8` from one pair), and when 16 does not divide the length, 16
    /// fresh uniforms for the last 16 elements, transformed again.
    pub fn normal_f32(&mut self, out: &mut [f32], mean: f64, std: f64) {
        let n = out.len();
        if n < 16 {
            for o in out {
                *o = self.normal_scalar(mean, std) as f32;
            }
            return;
        }
        let (mean, std) = (mean as f32, std as f32);
        for o in out.iter_mut() {
            *o = self.unit_f32();
        }
        for block in out.chunks_exact_mut(16) {
            normal_block_f32(block, mean, std);
        }
        if n % 16 != 0 {
            let tail = &mut out[n - 16..];
            for o in tail.iter_mut() {
                *o = self.unit_f32();
            }
            normal_block_f32(tail, mean, std);
        }
    }

    /// Fills `out` as `normal_(mean, std)` does a contiguous f64 tensor: the scalar
    /// transform below 16 elements; from 16 on, the 16-element blocks of
    /// [`normal_f32`](Self::normal_f32) computed in f64 with the platform's `ln`, `cos`,
    /// `sin`.
    pub fn normal_f64(&mut self, out: &mut [f64], mean: f64, std: f64) {
        let n = out.len();
        if n < 16 {
            for o in out {
                *o = self.normal_scalar(mean, std);
            }
            return;
        }
        for o in out.iter_mut() {
            *o = self.unit_f64();
        }
        for block in out.chunks_exact_mut(16) {
            normal_block_f64(block, mean, std);
        }
        if n % 16 != 0 {
            let tail = &mut out[n - 16..];
            for o in tail.iter_mut() {
                *o = self.unit_f64();
            }
            normal_block_f64(tail, mean, std);
        }
    }

    /// `torch.rand(shape)`: f32 U[0, 1).
    pub fn rand(&mut self, shape: &[usize]) -> Result<Tensor> {
        let mut v = vec![0f32; numel_of(shape)];
        self.uniform_f32(&mut v, 0.0, 1.0);
        Tensor::from_vec(v, shape)
    }

    /// `torch.randn(shape)`: f32 N(0, 1), drawn as [`normal_f32`](Self::normal_f32).
    pub fn randn(&mut self, shape: &[usize]) -> Result<Tensor> {
        let mut v = vec![0f32; numel_of(shape)];
        self.normal_f32(&mut v, 0.0, 1.0);
        Tensor::from_vec(v, shape)
    }

    /// `torch.randperm(n)`: a permutation of `0..n` as PyTorch's CPU kernel draws it. Below
    /// `2^32 / 20`, element `i` is swapped with element `i + random() % (n - i)` for `i` in
    /// `0..n - 1` (checked against PyTorch); from there on, PyTorch's inside-out shuffle with
    /// `random64() % (i + 1)` (followed from the source, not checked: such a permutation
    /// takes gigabytes).
    pub fn randperm(&mut self, n: usize) -> Vec<usize> {
        if (n as u64) < u32::MAX as u64 / 20 {
            let mut perm: Vec<usize> = (0..n).collect();
            for i in 0..n.saturating_sub(1) {
                let z = self.random() as usize % (n - i);
                perm.swap(i, i + z);
            }
            return perm;
        }
        let mut perm = vec![0usize; n];
        for i in 0..n {
            let z = (self.random64() % (i as u64 + 1)) as usize;
            perm[i] = perm[z];
            perm[z] = i;
        }
        perm
    }

    /// `nn.init.uniform_(t, from, to)` on a new f32 tensor of `shape`.
    pub fn uniform_tensor(&mut self, shape: &[usize], from: f64, to: f64) -> Result<Tensor> {
        let mut v = vec![0f32; numel_of(shape)];
        self.uniform_f32(&mut v, from, to);
        Tensor::from_vec(v, shape)
    }

    /// `nn.init.normal_(t, mean, std)` on a new f32 tensor of `shape`.
    pub fn normal_tensor(&mut self, shape: &[usize], mean: f64, std: f64) -> Result<Tensor> {
        let mut v = vec![0f32; numel_of(shape)];
        self.normal_f32(&mut v, mean, std);
        Tensor::from_vec(v, shape)
    }

    /// `nn.init.kaiming_uniform_(t, a)` (fan_in mode, leaky_relu gain) on a new f32 tensor
    /// of `shape` (at least 2-D: fan_in is the product of the dimensions after the first).
    /// A tensor with no elements draws nothing, as PyTorch returns early for it.
    pub fn kaiming_uniform(&mut self, shape: &[usize], a: f64) -> Result<Tensor> {
        if numel_of(shape) == 0 {
            return Tensor::from_vec(Vec::<f32>::new(), shape);
        }
        let bound = kaiming_uniform_bound(a, shape.iter().skip(1).product());
        self.uniform_tensor(shape, -bound, bound)
    }
}

/// The bound of `kaiming_uniform_(a=a, mode="fan_in", nonlinearity="leaky_relu")` as
/// `torch/nn/init.py` computes it in f64: `sqrt(3) * sqrt(2 / (1 + a^2)) / sqrt(fan_in)`
/// (`1 / sqrt(fan_in)` up to rounding for `nn.Linear`'s `a = sqrt(5)`).
pub fn kaiming_uniform_bound(a: f64, fan_in: usize) -> f64 {
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    let std = gain / (fan_in as f64).sqrt();
    3f64.sqrt() * std
}

/// `nn.Linear(in_features, out_features, bias)`'s parameters as `reset_parameters` draws
/// them from `g`: the weight `(out, in)` by `kaiming_uniform_(a=sqrt(5))`, then the bias
/// `(out)` from `U(-1/sqrt(in), 1/sqrt(in))` (zeros' bound when `in` is 0; no draw for no
/// bias). f32 tensors on the host.
///
/// ```
/// use fsdp::nn::torch_rng::{kaiming_uniform_bound, linear_parameters};
/// use fsdp::nn::TorchGenerator;
/// let mut g = TorchGenerator::manual_seed(0); // torch.manual_seed(0)
/// let (w, b) = linear_parameters(&mut g, 4, 3, true).unwrap(); // nn.Linear(4, 3)
/// let bound = kaiming_uniform_bound(5f64.sqrt(), 4) as f32; // 1/sqrt(4) up to rounding
/// assert!(w.to_vec_f32().unwrap().iter().all(|v| v.abs() <= bound));
/// assert_eq!(b.unwrap().shape(), &[3]);
/// ```
pub fn linear_parameters(
    g: &mut TorchGenerator,
    in_features: usize,
    out_features: usize,
    bias: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let weight = g.kaiming_uniform(&[out_features, in_features], 5f64.sqrt())?;
    let bias = if bias {
        let bound = if in_features > 0 {
            1.0 / (in_features as f64).sqrt()
        } else {
            0.0
        };
        Some(g.uniform_tensor(&[out_features], -bound, bound)?)
    } else {
        None
    };
    Ok((weight, bias))
}

/// Rounds an f64 constant to f32 as C does for `float c = 0.70710678...;` written in
/// double (the literal is a double first).
const fn c(v: f64) -> f32 {
    v as f32
}

/// `log256_ps`: the Cephes float logarithm, one lane (only called on `(0, 1]`). The
/// constants are written as in the reference (doubles rounded to f32).
#[allow(clippy::excessive_precision)]
fn cephes_logf(x: f32) -> f32 {
    const SQRTHF: f32 = c(std::f64::consts::FRAC_1_SQRT_2);
    const P: [f32; 9] = [
        c(7.0376836292E-2),
        c(-1.1514610310E-1),
        c(1.1676998740E-1),
        c(-1.2420140846E-1),
        c(1.4249322787E-1),
        c(-1.6668057665E-1),
        c(2.0000714765E-1),
        c(-2.4999993993E-1),
        c(3.3333331174E-1),
    ];
    const Q1: f32 = c(-2.12194440e-4);
    const Q2: f32 = c(0.693359375);
    let invalid = x <= 0.0;
    let x = x.max(f32::MIN_POSITIVE);
    let bits = x.to_bits();
    let mut e = ((bits >> 23) as i32 - 0x7f) as f32 + 1.0;
    // Mantissa in [0.5, 1).
    let m = f32::from_bits((bits & !0x7f80_0000) | 0.5f32.to_bits());
    let below = m < SQRTHF;
    let mut x = m - 1.0;
    if below {
        e -= 1.0;
        x += m;
    } else {
        x += 0.0;
    }
    // PyTorch's build contracts each product feeding a sum into one fused multiply-add
    // (GCC's default -ffp-contract=fast on the AVX2 kernel): the same fusions here.
    let z = x * x;
    let mut y = P[0];
    for &p in &P[1..] {
        y = y.mul_add(x, p);
    }
    y *= x;
    y = y.mul_add(z, e * Q1);
    y = (-z).mul_add(0.5, y);
    let out = e.mul_add(Q2, x + y);
    if invalid {
        f32::NAN
    } else {
        out
    }
}

/// `sincos256_ps`: the Cephes float sine and cosine, one lane; returns `(sin, cos)`. The
/// constants are written as in the reference (doubles rounded to f32).
#[allow(clippy::excessive_precision)]
fn cephes_sincosf(x: f32) -> (f32, f32) {
    const FOPI: f32 = c(1.27323954473516);
    const DP1: f32 = c(-0.78515625);
    const DP2: f32 = c(-2.4187564849853515625e-4);
    const DP3: f32 = c(-3.77489497744594108e-8);
    const SIN: [f32; 3] = [c(-1.9515295891E-4), c(8.3321608736E-3), c(-1.6666654611E-1)];
    const COS: [f32; 3] = [
        c(2.443315711809948E-005),
        c(-1.388731625493765E-003),
        c(4.166664568298827E-002),
    ];
    const SIGN: u32 = 0x8000_0000;
    let mut sign_sin = x.to_bits() & SIGN;
    let mut x = x.abs();
    // Octant j, rounded up to even (truncating conversion, as cvttps).
    let j = (((x * FOPI) as i32).wrapping_add(1)) & !1;
    let y = j as f32;
    sign_sin ^= ((j & 4) as u32) << 29;
    let sine_poly = j & 2 == 0;
    let sign_cos = ((!(j.wrapping_sub(2)) & 4) as u32) << 29;
    // Extended-precision reduction: x - y * pi/4 in three parts (fused as in PyTorch's
    // build, see cephes_logf).
    x = y.mul_add(DP1, x);
    x = y.mul_add(DP2, x);
    x = y.mul_add(DP3, x);
    let z = x * x;
    let mut yc = COS[0].mul_add(z, COS[1]);
    yc = yc.mul_add(z, COS[2]);
    yc *= z;
    yc = yc.mul_add(z, -(z * 0.5));
    yc += 1.0;
    let mut ys = SIN[0].mul_add(z, SIN[1]);
    ys = ys.mul_add(z, SIN[2]);
    ys *= z;
    ys = ys.mul_add(x, x);
    // The kernel selects with bit masks and adds the zeros it masked out: the same here,
    // so signed zeros come out as in PyTorch.
    let (ysin2, ysin1) = if sine_poly { (ys, 0.0) } else { (0.0, yc) };
    let s = ysin1 + ysin2;
    let cval = (yc - ysin1) + (ys - ysin2);
    (
        f32::from_bits(s.to_bits() ^ sign_sin),
        f32::from_bits(cval.to_bits() ^ sign_cos),
    )
}

/// `normal_fill_16_AVX2`: uniforms `u` in `block[0..16]` become normals, element `j` and
/// `j + 8` from the pair `(1 - u[j], u[j + 8])`, then `n * std + mean` fused.
fn normal_block_f32(block: &mut [f32], mean: f32, std: f32) {
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    for j in 0..8 {
        let u1 = 1.0 - block[j];
        let u2 = block[j + 8];
        let radius = (-2.0 * cephes_logf(u1)).sqrt();
        let (s, co) = cephes_sincosf(two_pi * u2);
        block[j] = (radius * co).mul_add(std, mean);
        block[j + 8] = (radius * s).mul_add(std, mean);
    }
}

/// `normal_fill_16<double>`: as [`normal_block_f32`] in f64 with the platform's functions.
fn normal_block_f64(block: &mut [f64], mean: f64, std: f64) {
    for j in 0..8 {
        let u1 = 1.0 - block[j];
        let u2 = block[j + 8];
        let radius = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        block[j] = radius * theta.cos() * std + mean;
        block[j + 8] = radius * theta.sin() * std + mean;
    }
}
