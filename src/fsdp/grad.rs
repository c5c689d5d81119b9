//! Gradient utilities of the root unit: `no_sync` and `set_requires_gradient_sync`
//! (accumulation without communication), `zero_grad` and `clip_grad_norm_` (FSDP1
//! `FullyShardedDataParallel.no_sync` / `.clip_grad_norm_`, FSDP2's
//! `set_requires_gradient_sync`).

use super::FullyShardedDataParallel;
use crate::distributed::fingerprint::Phase;
use crate::distributed::staged;
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

impl FullyShardedDataParallel {
    /// Runs `f` with gradient synchronization off: backward passes inside accumulate each
    /// unit's unsharded gradient locally, with no reduce-scatter; the first backward after
    /// `f` returns reduces the accumulated sum with its own gradient. Every rank must do
    /// the same number of backwards inside. Costs one unsharded gradient buffer per unit
    /// until the synchronized backward (as PyTorch FSDP).
    ///
    /// # Errors
    /// Whatever `f` returns; synchronization is turned back on either way.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        self.each_unit(|u| u.sync_grads = false);
        let out = f(self);
        self.each_unit(|u| u.sync_grads = true);
        out
    }

    /// Turns gradient synchronization off (`false`) or back on (`true`) for every unit
    /// until called again: [`no_sync`](Self::no_sync) for a host whose backward spans
    /// several calls (FSDP2's `set_requires_gradient_sync`). Every rank does the same.
    pub fn set_requires_gradient_sync(&mut self, requires: bool) {
        self.each_unit(|u| u.sync_grads = requires);
    }

    /// Drops every sharded gradient, the unsharded gradients kept under `no_sync`, and the
    /// ignored modules' gradients (`zero_grad(set_to_none=True)`, PyTorch's default, which
    /// drops FSDP1's `no_sync` accumulation in `flat_param.grad` too). Also ends the step
    /// for the fingerprints of FSDP's collectives: the first call after a backward starts
    /// the next step (see `distributed::fingerprint`), so every rank calls it alike (once
    /// per optimizer step, as a training loop does). A host driving the hooks checks
    /// [`ready_for_zero_grad`](Self::ready_for_zero_grad) first: inside an unfinished
    /// backward the reductions still to come would survive this.
    pub fn zero_grad(&mut self) {
        self.rs.sched.lock().progress.step_boundary();
        let mem = self.rs.mem.clone();
        let sched = self.rs.sched.clone();
        self.each_unit(|u| {
            if let Some(g) = u.flat.grad_shard.take() {
                let mut m = mem.lock();
                m.grad_shard_bytes = m.grad_shard_bytes.saturating_sub(g.nbytes());
                // Its readers (clipping, the optimizer) ran on the compute stream: the
                // next backward's reduction can fill it again.
                sched.lock().buffers.give(g);
            }
            if let Some(g) = u.flat.unsynced_grad.take() {
                sched.lock().buffers.give(g);
            }
        });
        self.each_ignored(|_, p| p.set_grad(None));
    }

    /// Scales every gradient shard so that the total `norm_type`-norm of the gradients of
    /// all parameters (over all units and ranks) is at most `max_norm`, and returns that
    /// total norm before clipping, identical on every rank. `norm_type` is a finite `p >= 1`
    /// or `f32::INFINITY`. Padding never counts (its gradient is zero). Clip coefficient
    /// `min(1, max_norm / (total + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`. A
    /// collective: every rank calls it, on the root. Reads the norm to the host: on CUDA
    /// that waits for the device; [`clip_grad_norm_tensor_`](Self::clip_grad_norm_tensor_)
    /// does not.
    ///
    /// # Errors
    /// `Fsdp` on a nested unit, inside a forward or backward, or before `finish_backward`;
    /// `InvalidArgument` for a negative or non-finite `max_norm` or a `norm_type` below 1.
    pub fn clip_grad_norm_(&mut self, max_norm: f32, norm_type: f32) -> Result<f32> {
        Ok(self
            .clip_grad_norm_tensor_(max_norm, norm_type)?
            .to_vec_f32()?[0])
    }

    /// [`clip_grad_norm_`](Self::clip_grad_norm_) returning the total norm as a
    /// one-element f32 tensor on the gradients' device, as PyTorch returns it. With CUDA
    /// gradients and `norm_type = 2` everything happens on the device, ordered on the
    /// current stream: the squared norm accumulates in f64 there, the ranks all-reduce it
    /// as a device tensor, the clip coefficient is computed there and scales the gradients
    /// in place; the host never waits (PyTorch's way). The values are bit for bit the host
    /// path's.
    ///
    /// # Errors
    /// As [`clip_grad_norm_`](Self::clip_grad_norm_); [`Error::Cuda`].
    pub fn clip_grad_norm_tensor_(&mut self, max_norm: f32, norm_type: f32) -> Result<Tensor> {
        if !self.is_root {
            return Err(Error::Fsdp(
                "clip_grad_norm_ must be called on the root FSDP instance".into(),
            ));
        }
        // Inside a pass or before finish_backward the gradients are not all there yet.
        self.between_passes(crate::error::Term::ClipGradNorm)?;
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            crate::error::bail_arg!(
                "clip_grad_norm_: max_norm must be a finite number >= 0, got {max_norm}"
            );
        }
        if norm_type.is_nan() || norm_type < 1.0 {
            crate::error::bail_arg!(
                "clip_grad_norm_: norm_type must be >= 1 or infinity, got {norm_type}"
            );
        }
        let mut grads: Vec<Tensor> = Vec::new();
        self.each_unit(|u| grads.extend(u.flat.grad_shard.clone()));
        let mut ignored: Vec<Tensor> = Vec::new();
        self.each_ignored(|_, p| ignored.extend(p.grad().cloned()));
        if let Some((ordinal, dtype)) = on_one_gpu(&grads, &ignored, norm_type) {
            return self.clip_on_device(ordinal, dtype, max_norm, &grads, &ignored);
        }
        if grads
            .iter()
            .chain(&ignored)
            .any(|g| g.dtype() == DType::F64)
        {
            return self.clip_f64(max_norm, norm_type, &grads, &ignored);
        }
        let inf = norm_type == f32::INFINITY;
        let local = norm_accumulate(0.0, &grads, norm_type)?;
        let total = if self.zero_redundancy() {
            // ZeRO-1 gives NoShard's numbers: NoShard rounds its whole sum to f32 once,
            // so the chunks' partial sums are combined in f64 and the total rounded once.
            let t = Tensor::from_vec(vec![local], &[1])?;
            self.reduce_norm(&t, inf)?;
            let sum = t.data::<f64>()?[0];
            sum as f32 as f64
        } else {
            let t = Tensor::from_vec(vec![local as f32], &[1])?;
            self.reduce_norm(&t, inf)?;
            let sum = t.f32()?[0];
            sum as f64
        };
        // Ignored modules' parameters are whole on every rank: their local gradients count
        // once, without a reduction (as FSDP1 counts its non-sharded parameters).
        let total = norm_accumulate(total, &ignored, norm_type)?;
        grads.extend(ignored);
        let total = if inf {
            total
        } else if norm_type == 2.0 {
            total.sqrt() // correctly rounded, as on the device
        } else {
            total.powf(1.0 / norm_type as f64)
        } as f32;
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        for g in &grads {
            // On the gradient's device (a kernel on the current stream for CUDA shards).
            crate::ops::scale_(g, coef)?;
        }
        let device = grads
            .first()
            .map_or(crate::backend::Device::Cpu, Tensor::device);
        Tensor::from_vec(vec![total], &[1])?.to_device(device)
    }

    /// The host path for f64 gradients, in f64 throughout (PyTorch computes the norm and
    /// the clip coefficient of float64 gradients in float64): the local sums, their
    /// reduction as an f64 tensor, the root, `coef = max_norm / (total + 1e-6)` clamped to
    /// 1, and `g *= coef` in f64 (`max_norm` as the decimal it spells). Returns the total
    /// norm rounded to the f32 the API gives. f64 gradients on one GPU with `norm_type` 2
    /// take `clip_on_device` instead (with the `cuda` feature), the same steps as kernels.
    fn clip_f64(
        &self,
        max_norm: f32,
        norm_type: f32,
        grads: &[Tensor],
        ignored: &[Tensor],
    ) -> Result<Tensor> {
        if let Some(g) = grads
            .iter()
            .chain(ignored)
            .find(|g| g.dtype() != DType::F64 || g.device().is_cuda())
        {
            return Err(Error::Unsupported(format!(
                "clip_grad_norm_ over f64 gradients with a {} gradient on {} (f64 clips on the host, every gradient f64)",
                g.dtype(),
                g.device()
            )));
        }
        let inf = norm_type == f32::INFINITY;
        let p = crate::ops::double::widen(norm_type);
        let accumulate = |acc: f64, ts: &[Tensor]| -> Result<f64> {
            let mut acc = acc;
            for g in ts {
                for v in g.to_vec_f64()? {
                    let a = v.abs();
                    acc = if inf {
                        acc.max(a)
                    } else if p == 2.0 {
                        acc + a * a
                    } else {
                        acc + a.powf(p)
                    };
                }
            }
            Ok(acc)
        };
        let t = Tensor::from_vec(vec![accumulate(0.0, grads)?], &[1])?;
        self.reduce_norm(&t, inf)?;
        let total = accumulate(t.data::<f64>()?[0], ignored)?;
        let total = if inf {
            total
        } else if p == 2.0 {
            total.sqrt()
        } else {
            total.powf(1.0 / p)
        };
        let coef = (crate::ops::double::widen(max_norm) / (total + 1e-6)).min(1.0);
        for g in grads.iter().chain(ignored) {
            g.data_mut::<f64>()?.iter_mut().for_each(|v| *v *= coef);
        }
        let device = grads
            .first()
            .map_or(crate::backend::Device::Cpu, Tensor::device);
        Tensor::from_vec(vec![total as f32], &[1])?.to_device(device)
    }

    /// Combines the ranks' local sums (or maxima for `inf`) in `t` (one f32 or f64, on
    /// any device). Sharded gradients (and ZeRO-1's gradient chunks under NoShard) are
    /// disjoint pieces of the whole: combine over the shard group. Under hybrid sharding
    /// the replicas hold the same pieces (summing over the world would count each
    /// sqrt(replicas) times too many); under NoShard every rank holds all. Every rank of the world still takes part (a max of equal values, exact),
    /// as PyTorch all-reduces the norm under every strategy: a rank that clips while its
    /// peers do not then fails at once instead of training on alone.
    fn reduce_norm(&self, t: &Tensor, inf: bool) -> Result<()> {
        let _tag = self.fingerprint(Phase::ClipGradNorm);
        if self.grads_scattered() {
            let op = if inf { ReduceOp::Max } else { ReduceOp::Sum };
            staged::all_reduce(self.shard_group().as_ref(), t, op)?;
            if let Some(rep) = &self.rs.replicate_pg {
                staged::all_reduce(rep.as_ref(), t, ReduceOp::Max)?;
            }
        } else {
            staged::all_reduce(self.process_group().as_ref(), t, ReduceOp::Max)?;
        }
        Ok(())
    }

    /// The 2-norm clip on `cuda:ordinal` (see [`clip_grad_norm_tensor_`](Self::clip_grad_norm_tensor_)):
    /// the host path's steps, in its order, as kernels on the current stream. `dtype` is
    /// the gradients' (all f32, or all f64): f64 gradients all-reduce the f64 sum and
    /// scale by an f64 coefficient, as [`clip_f64`](Self::clip_f64) does on the host.
    fn clip_on_device(
        &self,
        ordinal: usize,
        dtype: DType,
        max_norm: f32,
        grads: &[Tensor],
        ignored: &[Tensor],
    ) -> Result<Tensor> {
        use crate::backend::cuda::{scale_all_by, scale_by, NormAccumulator, TensorList};
        use crate::backend::Device;
        let s = crate::backend::cuda::current_stream(ordinal)?;
        // Every unit's gradient in one list: each multi-tensor step is one launch.
        let list = TensorList::new(
            &s,
            &grads
                .iter()
                .map(Tensor::as_device_tensor)
                .collect::<Result<Vec<_>>>()?,
        )?;
        let acc = NormAccumulator::unset(&s)?;
        let dev = Device::Cuda(ordinal);
        // ZeRO-1 combines its chunks' partial sums in f64 and rounds the total once, as
        // NoShard rounds its whole sum (see the host path).
        let sum_dtype = if self.zero_redundancy() {
            DType::F64
        } else {
            dtype
        };
        let t = Tensor::zeros_on(&[1], sum_dtype, dev)?;
        if sum_dtype == DType::F32 {
            // The sum and its rounding to the all-reduced f32 in the fold's launch.
            acc.set_squares(&s, &list, Some(&t.as_device_tensor()?))?;
        } else {
            acc.set_squares(&s, &list, None)?;
            acc.store(&s, &t.as_device_tensor()?)?;
        }
        self.reduce_norm(&t, false)?;
        let norm = Tensor::zeros_on(&[1], DType::F32, dev)?;
        let coef = Tensor::zeros_on(&[1], dtype, dev)?;
        let max_norm = match dtype {
            DType::F64 => crate::ops::double::widen(max_norm),
            _ => f64::from(max_norm),
        };
        let (nd, cd) = (norm.as_device_tensor()?, coef.as_device_tensor()?);
        if sum_dtype == DType::F32 && ignored.is_empty() {
            // The all-reduced f32 sum is the total: read by the coefficient's launch.
            acc.clip_coef_of(&s, &t.as_device_tensor()?, max_norm, &nd, &cd)?;
        } else {
            acc.load(&s, &t.as_device_tensor()?)?;
            if sum_dtype != dtype {
                let rounded = Tensor::zeros_on(&[1], dtype, dev)?;
                let r = rounded.as_device_tensor()?;
                acc.store(&s, &r)?;
                acc.load(&s, &r)?;
            }
            for g in ignored {
                acc.add_squares(&s, &g.as_device_tensor()?)?;
            }
            acc.clip_coef(&s, max_norm, &nd, &cd)?;
        }
        let coef = coef.as_device_tensor()?;
        scale_all_by(&s, &list, &coef)?;
        for g in ignored {
            scale_by(&s, &g.as_device_tensor()?, &coef)?;
        }
        Ok(norm)
    }
}

/// The GPU all of `grads` and `ignored` are on, and their dtype, when they are all f32 or
/// all f64 and `norm_type` is 2 (the device path); `None` otherwise (host path).
fn on_one_gpu(grads: &[Tensor], ignored: &[Tensor], norm_type: f32) -> Option<(usize, DType)> {
    use crate::backend::Device;
    if norm_type != 2.0 {
        return None;
    }
    let mut found = None;
    for g in grads.iter().chain(ignored) {
        match (g.device(), found) {
            (Device::Cuda(i), None) if matches!(g.dtype(), DType::F32 | DType::F64) => {
                found = Some((i, g.dtype()))
            }
            (Device::Cuda(i), Some(f)) if f == (i, g.dtype()) => {}
            _ => return None,
        }
    }
    found
}

/// `acc` combined with the sum of `|g|^p` (or the max of `|g|` for `p = inf`) over `grads`,
/// in f64. Host gradients are summed element by element into `acc`; a CUDA gradient's
/// squares are summed on the device for `p = 2` ([`crate::ops::sum_squares`], f64 partials
/// in a fixed order) and added to `acc`, and copied to the host for other `p`.
fn norm_accumulate(acc: f64, grads: &[Tensor], norm_type: f32) -> Result<f64> {
    let inf = norm_type == f32::INFINITY;
    let mut acc = acc;
    let add = |values: &[f32], acc: &mut f64| {
        for &v in values {
            let a = (v as f64).abs();
            *acc = if inf {
                acc.max(a)
            } else if norm_type == 2.0 {
                // The usual case, without a pow call per element (the same value: a * a
                // is exact in f64 for an f32 a, and pow(a, 2) is correctly rounded).
                *acc + a * a
            } else {
                *acc + a.powf(norm_type as f64)
            };
        }
    };
    for g in grads {
        if g.device().is_cuda() {
            if norm_type == 2.0 {
                acc += crate::ops::sum_squares(g)?;
            } else {
                add(&g.to_vec_f32()?, &mut acc);
            }
        } else {
            add(&g.f32()?, &mut acc);
        }
    }
    Ok(acc)
}
