//! `BatchNorm1d` (`torch.nn.BatchNorm1d`, `torch/nn/modules/batchnorm.py`): per-channel
//! normalization over the batch, with running statistics kept in buffers.

use super::{BufferVisitor, ChildVisitor, Context, Module, ModuleBuffer, ParamVisitor, Parameter};
use crate::error::{Error, Result};
use crate::ops::{self, BatchNormSaved, RunningStats, UpdateFactor};
use crate::tensor::{DType, Tensor};

/// `y = (x - mean) / sqrt(var + eps) * weight + bias` per channel of an input `(N, C)` or
/// `(N, C, L)`, f32 (or f64 when its parameters and buffers are f64; a bf16/f16 input, e.g.
/// under FSDP `MixedPrecision`, is computed with f32 statistics and rounded where
/// PyTorch's CPU kernel rounds: `ops::batch_norm`).
///
/// Training mode ([`Context::training`]) normalizes with the batch's mean and biased
/// variance over `N` (and `L`) and updates the running stats: `running_mean = (1 - m)
/// running_mean + m mean`, `running_var = (1 - m) running_var + m var_unbiased`, with
/// `m = momentum`, or `1 / num_batches_tracked` (a cumulative average) when `momentum` is
/// `None`; `num_batches_tracked` counts the training forwards. Evaluation mode normalizes
/// with the running stats and changes nothing. Under FSDP each rank normalizes with its
/// own batch and keeps its own running stats (no `SyncBatchNorm`).
///
/// | name | kind | shape, dtype | init |
/// |---|---|---|---|
/// | `weight` | parameter (`affine`) | `(C)` f32 | ones |
/// | `bias` | parameter (`affine`) | `(C)` f32 | zeros |
/// | `running_mean` | persistent buffer (`track_running_stats`) | `(C)` f32 | zeros |
/// | `running_var` | persistent buffer | `(C)` f32 | ones |
/// | `num_batches_tracked` | persistent buffer | `()` i64 | 0 |
///
/// Without `track_running_stats` there are no buffers and both modes use batch
/// statistics, as PyTorch.
pub struct BatchNorm1d {
    /// Scale `gamma`, `(C)` (`nn.BatchNorm1d.weight`); `None` without `affine`.
    pub weight: Option<Parameter>,
    /// Shift `beta`, `(C)` (`nn.BatchNorm1d.bias`); `None` without `affine`.
    pub bias: Option<Parameter>,
    /// `running_mean (C)`, `running_var (C)`, `num_batches_tracked ()` i64; `None` without
    /// `track_running_stats`.
    stats: Option<[ModuleBuffer; 3]>,
    num_features: usize,
    eps: f64,
    momentum: Option<f64>,
    saved: Option<BatchNormSaved>,
}

impl BatchNorm1d {
    /// `BatchNorm1d(num_features)` with PyTorch's defaults: `eps = 1e-5`, `momentum =
    /// 0.1`, `affine = true`, `track_running_stats = true`.
    ///
    /// # Errors
    /// As [`BatchNorm1d::with_options`].
    pub fn new(num_features: usize) -> Result<Self> {
        Self::with_options(num_features, 1e-5, Some(0.1), true, true)
    }

    /// `BatchNorm1d(num_features, eps, momentum, affine, track_running_stats)`;
    /// `momentum: None` is PyTorch's `momentum=None` (cumulative moving average).
    ///
    /// # Errors
    /// `InvalidArgument` for a negative or non-finite `eps`, or a `momentum` outside
    /// `[0, 1]`.
    pub fn with_options(
        num_features: usize,
        eps: f64,
        momentum: Option<f64>,
        affine: bool,
        track_running_stats: bool,
    ) -> Result<Self> {
        if !(eps.is_finite() && eps >= 0.0) {
            crate::error::bail_arg!("BatchNorm1d: eps must be finite and >= 0, got {eps}");
        }
        if let Some(m) = momentum.filter(|m| !(0.0..=1.0).contains(m)) {
            crate::error::bail_arg!("BatchNorm1d: momentum must be in [0, 1], got {m}");
        }
        let c = num_features;
        let (weight, bias) = if affine {
            (
                Some(Parameter::new(
                    "weight",
                    Tensor::from_vec(vec![1.0f32; c], &[c])?,
                )),
                Some(Parameter::new(
                    "bias",
                    Tensor::from_vec(vec![0.0f32; c], &[c])?,
                )),
            )
        } else {
            (None, None)
        };
        let stats = if track_running_stats {
            Some([
                ModuleBuffer::new(Tensor::from_vec(vec![0.0f32; c], &[c])?),
                ModuleBuffer::new(Tensor::from_vec(vec![1.0f32; c], &[c])?),
                ModuleBuffer::new(Tensor::from_vec(vec![0i64], &[])?),
            ])
        } else {
            None
        };
        Ok(BatchNorm1d {
            weight,
            bias,
            stats,
            num_features,
            eps,
            momentum,
            saved: None,
        })
    }

    /// `running_mean (C)`, if tracked.
    pub fn running_mean(&self) -> Option<&Tensor> {
        self.stats.as_ref().map(|s| &s[0].data)
    }

    /// `running_var (C)`, if tracked.
    pub fn running_var(&self) -> Option<&Tensor> {
        self.stats.as_ref().map(|s| &s[1].data)
    }

    /// `num_batches_tracked`, if tracked.
    ///
    /// # Errors
    /// When the buffer was replaced by one that is not an i64 scalar.
    pub fn num_batches_tracked(&self) -> Result<Option<i64>> {
        match &self.stats {
            None => Ok(None),
            Some(s) => Ok(s[2].data.to_vec_f64()?.first().map(|&v| v as i64)),
        }
    }

    /// Converts the parameters and the floating-point buffers to `dtype` (`module.to(dtype)`
    /// for f32 / f64 / bf16 / f16; a bf16/f16 module computes as PyTorch's CPU kernel for
    /// reduced-precision floats, see `ops::batch_norm`).
    ///
    /// # Errors
    /// `InvalidArgument` for a dtype other than f32, f64, bf16 and f16.
    pub fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        if !matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
            crate::error::bail_arg!("BatchNorm1d computes in f32, f64, bf16 or f16, not {dtype}");
        }
        for p in self.weight.iter_mut().chain(self.bias.iter_mut()) {
            let d = p.data()?.to_dtype(dtype)?;
            p.set_data(Some(d))?;
        }
        for b in self.stats.iter_mut().flat_map(|s| s[..2].iter_mut()) {
            b.data = b.data.to_dtype(dtype)?;
        }
        Ok(())
    }
}

impl Module for BatchNorm1d {
    fn type_name(&self) -> &'static str {
        "BatchNorm1d"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let c = self.num_features;
        if !matches!(x.shape(), [_, cc] | [_, cc, _] if *cc == c) {
            return Err(Error::ShapeMismatch {
                op: "BatchNorm1d.forward",
                expected: vec![0, c],
                got: x.shape().to_vec(),
            });
        }
        // PyTorch: batch statistics in training, or whenever no running stats are kept.
        let batch_stats = cx.training || self.stats.is_none();
        let mut running = None;
        if let Some([mean, var, count]) = &self.stats {
            let factor = if cx.training {
                // num_batches_tracked += 1, then the factor (batchnorm.py `forward`); on
                // the count's device, so a CUDA forward reads nothing back.
                ops::batch_norm_count_(&count.data)?;
                match self.momentum {
                    Some(m) => UpdateFactor::Momentum(m),
                    None => UpdateFactor::CumulativeAverage(&count.data),
                }
            } else {
                UpdateFactor::Momentum(0.0)
            };
            running = Some(RunningStats {
                mean: &mean.data,
                var: &var.data,
                factor,
            });
        }
        let w = self.weight.as_ref().map(|p| p.data()).transpose()?;
        let b = self.bias.as_ref().map(|p| p.data()).transpose()?;
        let (y, saved) = ops::batch_norm(x, w, b, running, batch_stats, self.eps)?;
        if cx.grad_enabled {
            self.saved = Some(saved);
        }
        Ok(y)
    }

    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let saved = self.saved.take().ok_or(Error::NoSavedForward {
            module: "BatchNorm1d",
        })?;
        let w = self
            .weight
            .as_ref()
            .map(|p| p.data().cloned())
            .transpose()?;
        let dw = match &mut self.weight {
            Some(p) => p.grad_for_accumulate()?.cloned(),
            None => None,
        };
        let db = match &mut self.bias {
            Some(p) => p.grad_for_accumulate()?.cloned(),
            None => None,
        };
        ops::batch_norm_backward(dy, &saved, w.as_ref(), dw.as_ref(), db.as_ref())
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        super::no_children(f)
    }
    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        if let Some(w) = &mut self.weight {
            f("weight", w)?;
        }
        match &mut self.bias {
            Some(b) => f("bias", b),
            None => Ok(()),
        }
    }

    fn for_each_buffer(&mut self, f: &mut BufferVisitor<'_>) -> Result<()> {
        let Some(s) = &mut self.stats else {
            return Ok(());
        };
        let [mean, var, n] = s;
        f("running_mean", mean)?;
        f("running_var", var)?;
        f("num_batches_tracked", n)
    }
}
