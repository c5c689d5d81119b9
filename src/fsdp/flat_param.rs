//! `FlatParameter`: the parameters of one FSDP unit flattened into one 1-D buffer, of which
//! each rank keeps one equal chunk (FSDP1 `flat_param.py`, `FlatParamHandle`).
//!
//! Layout: parameters in module pre-order (registration order within a module), each at
//! `offset .. offset + numel`; `N` elements in all. Sharded over `W` ranks with chunk
//! `c = ceil(N / W)`: rank `r` owns `[c r, c (r + 1))` of the buffer zero-padded to `c W`,
//! so trailing ranks may be short or pure padding (`N < W` leaves some ranks no data).
//! Unsharding all-gathers the chunks into a `c W` buffer and every parameter becomes a view
//! `buffer[offset .. offset + numel]` with its shape: nothing is copied to unflatten.

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::alloc::zeroed_vec;
use crate::tensor::{DType, Tensor};

/// Where one original parameter lives in the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// Fully qualified name (`blocks.0.attn.c_attn.weight`).
    pub fqn: String,
    /// The original parameter's shape; its view of the unsharded buffer gets this shape.
    pub shape: Vec<usize>,
    /// Element offset in the unpadded flat buffer.
    pub offset: usize,
    /// Element count (product of `shape`); the parameter spans `offset .. offset + numel`.
    pub numel: usize,
    /// The original parameter's `requires_grad` at wrap time (`nn.Parameter.requires_grad`).
    pub requires_grad: bool,
}

/// One unit's flattened parameters: the metadata, this rank's shard of the values (the f32
/// master copy the optimizer updates) and its sharded gradient. The gathered full buffer,
/// while it exists, belongs to the rank's scheduler (its `ParamState`).
#[derive(Debug)]
pub struct FlatParameter {
    pub(crate) infos: Vec<ParamInfo>,
    numel: usize,
    shard_world: usize,
    shard_rank: usize,
    shard_numel: usize,
    /// This rank's chunk, `(c)` f32, padding included.
    pub(crate) local_shard: Tensor,
    /// Accumulated gradient of the chunk, `(c)` f32; `None` until the first backward.
    pub(crate) grad_shard: Option<Tensor>,
    /// Runs `(start, len)` of this rank's chunk that hold trainable parameters, one per
    /// parameter with elements in the chunk: what the optimizer steps on. Frozen
    /// parameters and padding are left out, so weight decay never touches them.
    pub(crate) trainable_runs: Vec<(usize, usize)>,
    /// The padded flat gradient `(c W)` accumulated under `no_sync`, reduced by the next
    /// synchronized backward (FSDP1 keeps the unsharded gradient the same way).
    pub(crate) unsynced_grad: Option<Tensor>,
}

/// This rank's chunk `[lo, hi)` of the f32 flat parameter, zero-padded to `shard_numel`:
/// each parameter's part copied (from the host or a GPU) or, under deferred init,
/// computed element by element.
fn local_f32(
    params: &[(String, Tensor, bool)],
    infos: &[ParamInfo],
    shard_numel: usize,
    (lo, hi): (usize, usize),
) -> Result<Tensor> {
    let mut local = zeroed_vec::<f32>(shard_numel).map_err(|e| shard_oom(e, infos))?;

    // Copy the part of each parameter that falls into [lo, hi).
    for ((_, p, _), info) in params.iter().zip(infos) {
        let (a, b) = (info.offset.max(lo), (info.offset + info.numel).min(hi));
        if a < b {
            let dst = &mut local[a - lo..b - lo];
            match p.meta_initializer() {
                // Deferred init: compute only this rank's elements.
                Some((init, start)) => init.fill(start + (a - info.offset) as u64, dst),
                None if p.device().is_cuda() => {
                    // A parameter already on a GPU: only its part in the chunk comes over.
                    let part = p.view(a - info.offset, &[b - a])?.to_device(Device::Cpu)?;
                    dst.copy_from_slice(&part.f32()?);
                }
                None => {
                    let src = p.f32().map_err(|_| Error::NotMaterialized {
                        name: info.fqn.clone(),
                        state: crate::error::Term::MetaWithoutValues.as_str(),
                    })?;
                    dst.copy_from_slice(&src[a - info.offset..b - info.offset]);
                }
            }
        }
    }
    Tensor::from_vec(local, &[shard_numel])
}

/// The out-of-memory error of a local shard, naming the parameters it holds.
fn shard_oom(e: Error, infos: &[ParamInfo]) -> Error {
    e.allocating(|| {
        let names: Vec<&str> = infos.iter().map(|i| i.fqn.as_str()).take(3).collect();
        format!(
            "this rank's shard of the flat parameter holding '{}'{}",
            names.join("', '"),
            if infos.len() > 3 { ", ..." } else { "" }
        )
    })
}

/// [`local_f32`] for f64 parameters (host or device parameters; no deferred init).
fn local_f64(
    params: &[(String, Tensor, bool)],
    infos: &[ParamInfo],
    shard_numel: usize,
    (lo, hi): (usize, usize),
) -> Result<Tensor> {
    let mut local = zeroed_vec::<f64>(shard_numel).map_err(|e| shard_oom(e, infos))?;
    for ((_, p, _), info) in params.iter().zip(infos) {
        let (a, b) = (info.offset.max(lo), (info.offset + info.numel).min(hi));
        if a >= b {
            continue;
        }
        if p.device() == Device::Meta {
            return Err(Error::NotMaterialized {
                name: info.fqn.clone(),
                state: "an f64 parameter on the meta device (deferred init computes f32)",
            });
        }
        let part = p.view(a - info.offset, &[b - a])?.to_device(Device::Cpu)?;
        local[a - lo..b - lo].copy_from_slice(&part.data::<f64>()?);
    }
    Tensor::from_vec(local, &[shard_numel])
}

impl FlatParameter {
    /// Flattens `params` (fully qualified name, values, requires_grad) in the given order
    /// and keeps chunk `shard_rank` of `shard_world`. A meta parameter with an initializer
    /// ([`ParamInit`](crate::nn::ParamInit)) contributes the values of its elements in the
    /// chunk, computed here: nothing else of it is ever allocated.
    ///
    /// Parameters are f32, or all f64 (PyTorch FSDP flattens float64 parameters into a
    /// float64 FlatParameter; every collective then runs in f64).
    ///
    /// # Errors
    /// `Fsdp` for a parameter neither f32 nor f64, or f32 and f64 parameters in one unit,
    /// or a meta f64 parameter; `NotMaterialized` for a meta parameter without an
    /// initializer; `InvalidArgument` when the flat parameter's size overflows;
    /// `OutOfMemory` when this rank's shard cannot be allocated.
    pub fn new(
        params: &[(String, Tensor, bool)],
        shard_rank: usize,
        shard_world: usize,
    ) -> Result<Self> {
        let mut infos = Vec::with_capacity(params.len());
        let mut offset = 0;
        let dtype = params.first().map_or(DType::F32, |(_, p, _)| p.dtype());
        for (fqn, p, requires_grad) in params {
            if p.dtype() != DType::F32 && p.dtype() != DType::F64 {
                return Err(Error::Fsdp(format!(
                    "parameter '{fqn}' is {}; FlatParameter holds f32 (or f64) master weights (use MixedPrecision for low-precision compute)",
                    p.dtype()
                )));
            }
            if p.dtype() != dtype {
                return Err(Error::Fsdp(format!(
                    "parameter '{fqn}' is {} while '{}' is {dtype}: one FlatParameter holds one dtype (wrap them in separate units)",
                    p.dtype(),
                    params[0].0
                )));
            }
            infos.push(ParamInfo {
                fqn: fqn.clone(),
                shape: p.shape().to_vec(),
                offset,
                numel: p.numel(),
                requires_grad: *requires_grad,
            });
            offset = offset
                .checked_add(p.numel())
                .filter(|n| n.checked_mul(dtype.size_in_bytes()).is_some())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "the flat parameter of the unit holding '{}' overflows the address space at '{fqn}' ({} elements before it, {} in it)",
                        params[0].0,
                        offset,
                        p.numel()
                    ))
                })?;
        }
        let numel = offset;
        let shard_numel = numel.div_ceil(shard_world.max(1));
        let lo = (shard_rank * shard_numel).min(numel);
        let hi = ((shard_rank + 1) * shard_numel).min(numel);
        let local_shard = if dtype == DType::F64 {
            local_f64(params, &infos, shard_numel, (lo, hi))?
        } else {
            local_f32(params, &infos, shard_numel, (lo, hi))?
        };
        // One run per parameter (not merged with its neighbours), so that each entry of
        // the optimizer's list belongs to one parameter and can have its parameter group
        // (no weight decay for biases and norms).
        let mut trainable_runs: Vec<(usize, usize)> = Vec::new();
        for info in infos.iter().filter(|i| i.requires_grad) {
            let (a, b) = (info.offset.max(lo), (info.offset + info.numel).min(hi));
            if a < b {
                trainable_runs.push((a - lo, b - a));
            }
        }
        Ok(FlatParameter {
            trainable_runs,
            infos,
            numel,
            shard_world,
            shard_rank,
            shard_numel,
            local_shard,
            grad_shard: None,
            unsynced_grad: None,
        })
    }

    /// The dtype of the flat parameter: f32, or f64 for a unit of f64 parameters.
    pub fn dtype(&self) -> DType {
        self.local_shard.dtype()
    }

    /// Moves this rank's chunk (and its gradient, if any) to `device` (FSDP's
    /// `device_id`: the shard is computed on the host, then moved). A no-op when already
    /// there.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the device is unavailable or out of memory.
    pub(crate) fn move_shard_to(&mut self, device: Device) -> Result<()> {
        self.local_shard = self.local_shard.to_device(device)?;
        if let Some(g) = &self.grad_shard {
            self.grad_shard = Some(g.to_device(device)?);
        }
        Ok(())
    }

    /// Moves this rank's chunk into page-locked host memory pinned through `cuda:ordinal`
    /// (CPU offload on a GPU, FSDP1 `_flat_param.py`'s pinned `_local_shard`): the
    /// pre-unshard stream then copies it to the device without a host wait. A no-op for
    /// a shard not on the host or already pinned.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) when the allocation fails.
    pub(crate) fn pin_shard(&mut self, ordinal: usize) -> Result<()> {
        let s = &self.local_shard;
        if s.device() != Device::Cpu || s.is_pinned() {
            return Ok(());
        }
        let pinned = Tensor::pinned_zeros(s.shape(), s.dtype(), ordinal)?;
        pinned.copy_from(s)?;
        self.local_shard = pinned;
        Ok(())
    }

    /// The device this rank's chunk lives on.
    pub fn device(&self) -> Device {
        self.local_shard.device()
    }

    /// Unpadded element count `N`.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Chunk size `c = ceil(N / W)`.
    pub fn shard_numel(&self) -> usize {
        self.shard_numel
    }

    /// Padded size `c W`.
    pub fn padded_numel(&self) -> usize {
        self.shard_numel * self.shard_world
    }

    /// Number of real (non-padding) elements in this rank's chunk.
    pub fn valid_shard_numel(&self) -> usize {
        let (lo, hi) = self.shard_range();
        hi - lo
    }

    /// The elements `[lo, hi)` of the unpadded flat buffer this rank's chunk holds
    /// (`lo == hi` for a chunk of pure padding).
    pub fn shard_range(&self) -> (usize, usize) {
        let lo = (self.shard_rank * self.shard_numel).min(self.numel);
        let hi = ((self.shard_rank + 1) * self.shard_numel).min(self.numel);
        (lo, hi)
    }

    /// The number of chunks `W` (ranks the FlatParameter is split over; 1 under NoShard).
    pub fn shard_world_size(&self) -> usize {
        self.shard_world
    }

    /// This rank's chunk index `r` in `0..W`.
    pub fn shard_rank(&self) -> usize {
        self.shard_rank
    }

    /// The parameters of this unit, in flat order.
    pub fn param_infos(&self) -> &[ParamInfo] {
        &self.infos
    }

    /// This rank's chunk of the values, `(c)` f32, on the unit's device (the host under
    /// CPU offload).
    pub fn local_shard(&self) -> &Tensor {
        &self.local_shard
    }

    /// This rank's chunk of the accumulated gradient.
    pub fn grad_shard(&self) -> Option<&Tensor> {
        self.grad_shard.as_ref()
    }

    /// Views of `buffer` (padded flat layout) with each parameter's shape.
    pub(crate) fn views(&self, buffer: &Tensor) -> Result<Vec<Tensor>> {
        self.infos
            .iter()
            .map(|i| buffer.view(i.offset, &i.shape))
            .collect()
    }
}
