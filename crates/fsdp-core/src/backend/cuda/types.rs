//! The CUDA backend's plain-Rust types, compiled in every build (with the `cuda` feature
//! or without it, where `standin/` stands in for the rest): the argument structs of
//! the typed ops (GEMM sizes, optimizer and BatchNorm arguments) and the byte accounting of
//! one rank ([`MemAccount`]). The ops above fill them in the same code whichever build runs.

use super::DeviceTensor;
use crate::backend::cpu::gemm::Transpose;
use crate::tensor::DType;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Sizes of one GEMM `C (m, n) = op(A) (m, k) op(B) (k, n)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// Rows of C.
    pub m: usize,
    /// Inner dimension.
    pub k: usize,
    /// Columns of C.
    pub n: usize,
    /// Which inputs are stored transposed.
    pub trans: Transpose,
}

/// Bytes charged to one owner (a rank): what its live buffers hold, and the peak.
#[derive(Debug, Default)]
pub struct MemAccount {
    allocated: AtomicUsize,
    peak: AtomicUsize,
}

/// A snapshot of a [`MemAccount`] or of a device pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemStats {
    /// Bytes of live buffers (requested sizes).
    pub allocated: usize,
    /// Highest `allocated` seen.
    pub peak: usize,
    /// Bytes the pool holds from the driver, cached blocks included (pool stats only; 0
    /// for an account).
    pub reserved: usize,
}

impl MemAccount {
    /// A new account with nothing charged.
    pub fn new() -> Arc<MemAccount> {
        Arc::new(MemAccount::default())
    }

    /// Current and peak bytes.
    pub fn stats(&self) -> MemStats {
        MemStats {
            allocated: self.allocated.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            reserved: 0,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the caching allocator charges it
    pub(crate) fn charge(&self, bytes: usize) {
        let now = self.allocated.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the caching allocator charges it
    pub(crate) fn release(&self, bytes: usize) {
        self.allocated.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// One tensor of an SGD step: f32 (or f64) `param` updated in place from `grad` of its
/// dtype (same element count), with its momentum buffer when momentum is on.
#[derive(Debug, Clone, Copy)]
pub struct SgdSlot<'a> {
    /// Parameter shard, updated in place.
    pub param: &'a DeviceTensor,
    /// Its gradient, read only.
    pub grad: &'a DeviceTensor,
    /// Momentum buffer (same size), `None` without momentum.
    pub momentum_buf: Option<&'a DeviceTensor>,
    /// True on the buffer's first step: it is set to the gradient, undamped (PyTorch).
    pub first: bool,
}

/// SGD hyperparameters, as `fsdp::optim::SgdConfig`, in f64: the f32 kernel rounds each
/// to f32 (pass an f32 value widened, `f64::from`, to get it back exactly), the f64 one
/// takes them as given (the optimizers pass the f64 the f32 setting's decimal spells, as
/// PyTorch's Python floats are).
#[derive(Debug, Clone, Copy)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: no buffer is read or written).
    pub momentum: f64,
    /// Dampening after the first step.
    pub dampening: f64,
    /// L2 penalty `wd * p` added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// One tensor of an Adam/AdamW step: f32 (or f64) `param`, `grad`, moments `m`, `v`, all
/// the same dtype and element count; `step` is this tensor's step count after the update (1 on the first).
#[derive(Debug, Clone, Copy)]
pub struct AdamSlot<'a> {
    /// Parameter shard, updated in place.
    pub param: &'a DeviceTensor,
    /// Its gradient, read only.
    pub grad: &'a DeviceTensor,
    /// First moment, updated in place (zeros before the first step).
    pub m: &'a DeviceTensor,
    /// Second moment, updated in place (zeros before the first step).
    pub v: &'a DeviceTensor,
    /// Step count including this update (>= 1).
    pub step: u64,
}

/// Adam/AdamW hyperparameters, as `fsdp::optim::AdamConfig`, in f64 as [`SgdHyper`]'s.
#[derive(Debug, Clone, Copy)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f64,
    /// `(beta1, beta2)`.
    pub betas: (f64, f64),
    /// Denominator epsilon.
    pub eps: f64,
    /// Weight decay: L2 on the gradient (Adam) or decoupled (AdamW).
    pub weight_decay: f64,
    /// AdamW's decoupled decay `p *= 1 - lr wd` instead of L2.
    pub decoupled: bool,
}

/// An f32 hyperparameter as the kernel of `dt` takes it: exactly itself for f32, the
/// decimal it spells for f64 (as the CPU's f64 updates take it).
pub fn widen_hyper(dt: DType, v: f32) -> f64 {
    match dt {
        DType::F64 => crate::dtype::widen(v),
        _ => f64::from(v),
    }
}

/// `(N, C, L)` of a BatchNorm input (`(N, C)`: `L = 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnDims {
    /// Batch.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Length (1 for an `(N, C)` input).
    pub l: usize,
}

impl BnDims {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the kernels' launchers use it
    pub(crate) fn numel(self) -> usize {
        self.n * self.c * self.l
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the kernels' launchers use it
    pub(crate) fn args(self) -> (i64, i64, i64) {
        (self.n as i64, self.c as i64, self.l as i64)
    }
}

/// The running statistics of [`batchnorm_stats`](super::batchnorm_stats): `mean`,
/// `var (C)`, read in evaluation, updated in training with the factor `1 / *count` (an
/// i64 `()`, the cumulative average) or `factor` (PyTorch's momentum).
#[derive(Debug, Clone, Copy)]
pub struct BnRunning<'a> {
    /// `running_mean (C)`.
    pub mean: &'a DeviceTensor,
    /// `running_var (C)`, of `mean`'s dtype.
    pub var: &'a DeviceTensor,
    /// The update factor when `count` is `None`.
    pub factor: f64,
    /// `num_batches_tracked ()` i64 for a cumulative average.
    pub count: Option<&'a DeviceTensor>,
}

/// The dtypes of one BatchNorm call: the input's `x`, the weight's and gradients' `param`,
/// the running stats' `running` (f32/f64 inputs: all `x`; bf16/f16: `param` and `running`
/// each `x` or f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BnTypes {
    /// Input, output and their gradients.
    pub x: DType,
    /// Weight, bias and their gradients.
    pub param: DType,
    /// Running mean and variance.
    pub running: DType,
}

impl BnTypes {
    /// Whether `batchnorm.cu` has kernels for these dtypes.
    pub fn supported(self) -> bool {
        match self.x {
            DType::F32 | DType::F64 => self.param == self.x && self.running == self.x,
            DType::BF16 | DType::F16 => [self.param, self.running]
                .iter()
                .all(|&d| d == self.x || d == DType::F32),
            _ => false,
        }
    }

    /// bf16/f16: the statistics `(3, C)` f32; f32/f64: `(2, C)` f64.
    pub fn stats_shape(self, c: usize) -> (DType, [usize; 2]) {
        if self.is_lp() {
            (DType::F32, [3, c])
        } else {
            (DType::F64, [2, c])
        }
    }

    /// The backward's channel sums: `(2, C)` f32 (bf16/f16) or f64.
    pub fn sums_shape(self, c: usize) -> (DType, [usize; 2]) {
        (self.stats_shape(c).0, [2, c])
    }

    fn is_lp(self) -> bool {
        matches!(self.x, DType::BF16 | DType::F16)
    }
}
