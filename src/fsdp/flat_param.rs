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
    /// Accumulated gradient of the optimizer's chunk, `(c_o)` f32 (`c_o = c` unless
    /// [`partition_optimizer`](Self::partition_optimizer) split it); `None` until the
    /// first backward.
    pub(crate) grad_shard: Option<Tensor>,
    /// Runs `(start, len)` of this rank's optimizer chunk (the parameter chunk, or under
    /// [`partition_optimizer`](Self::partition_optimizer) its own) that hold trainable
    /// parameters, one per parameter with elements in the chunk: what the optimizer steps
    /// on. Frozen parameters and padding are left out, so weight decay never touches them.
    pub(crate) trainable_runs: Vec<(usize, usize)>,
    /// ZeRO-1 over a whole flat parameter: `(world, rank)` of the chunks the optimizer
    /// state and the reduced gradient are split into while the parameter stays whole;
    /// `None`: they follow the parameter chunk.
    optim_partition: Option<(usize, usize)>,
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

/// Runs `(start, len)` of the trainable parameters' elements in chunk `[lo, hi)`, `start`
/// counted from `lo`. One run per parameter (not merged with its neighbours), so that each
/// entry of the optimizer's list belongs to one parameter and can have its parameter group
/// (no weight decay for biases and norms).
fn trainable_runs(infos: &[ParamInfo], lo: usize, hi: usize) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    for info in infos.iter().filter(|i| i.requires_grad) {
        let (a, b) = (info.offset.max(lo), (info.offset + info.numel).min(hi));
        if a < b {
            runs.push((a - lo, b - a));
        }
    }
    runs
}

/// Chunk `rank` of `world` over `numel` elements: `(c, lo, hi)` with `c = ceil(numel /
/// world)` and `[lo, hi)` its unpadded elements (`lo == hi` for pure padding).
fn chunk(numel: usize, world: usize, rank: usize) -> (usize, usize, usize) {
    let c = numel.div_ceil(world.max(1));
    (c, (rank * c).min(numel), ((rank + 1) * c).min(numel))
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
        let (shard_numel, lo, hi) = chunk(numel, shard_world, shard_rank);
        let local_shard = if dtype == DType::F64 {
            local_f64(params, &infos, shard_numel, (lo, hi))?
        } else {
            local_f32(params, &infos, shard_numel, (lo, hi))?
        };
        Ok(FlatParameter {
            trainable_runs: trainable_runs(&infos, lo, hi),
            optim_partition: None,
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
        let (_, lo, hi) = chunk(self.numel, self.shard_world, self.shard_rank);
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

    /// Splits the optimizer state and the reduced gradient of a whole (unsharded, `W = 1`)
    /// flat parameter into `world` chunks of `ceil(N / world)` elements, of which this
    /// rank's optimizer steps chunk `rank`, while the parameter stays whole: ZeRO stage 1
    /// ([`ZeroRedundancyOptimizer`](super::ZeroRedundancyOptimizer)). The chunks follow the
    /// layout of a sharded flat parameter (zero padding at the end). Idempotent.
    ///
    /// # Errors
    /// `Fsdp` for a flat parameter sharded already, or `rank >= world`.
    pub(crate) fn partition_optimizer(&mut self, world: usize, rank: usize) -> Result<()> {
        if self.shard_world != 1 || rank >= world {
            return Err(Error::Fsdp(format!(
                "optimizer partition {rank} of {world} over a flat parameter sharded {} ways (ZeRO-1 partitions a whole one)",
                self.shard_world
            )));
        }
        let (_, lo, hi) = chunk(self.numel, world, rank);
        self.trainable_runs = trainable_runs(&self.infos, lo, hi);
        self.optim_partition = Some((world, rank));
        Ok(())
    }

    /// Whether a [`ZeroRedundancyOptimizer`](super::ZeroRedundancyOptimizer) split the
    /// optimizer state and the reduced gradient of this whole flat parameter into per-rank
    /// chunks (ZeRO-1).
    pub fn optimizer_partitioned(&self) -> bool {
        self.optim_partition.is_some()
    }

    /// `(world, rank)` of the chunks the optimizer steps: the parameter's (`W`, `r`), or
    /// under ZeRO-1 the partition's.
    fn optim_chunks(&self) -> (usize, usize) {
        self.optim_partition
            .unwrap_or((self.shard_world, self.shard_rank))
    }

    /// Elements `c_o` of this rank's optimizer chunk and of its reduced gradient
    /// ([`grad_shard`](Self::grad_shard)): the chunk size `c`, or under ZeRO-1
    /// `ceil(N / world)` of the partition.
    pub fn optim_shard_numel(&self) -> usize {
        let (w, r) = self.optim_chunks();
        chunk(self.numel, w, r).0
    }

    /// The elements `[lo, hi)` of the unpadded flat buffer this rank's optimizer steps:
    /// [`shard_range`](Self::shard_range), or under ZeRO-1 its partition's chunk.
    pub fn optim_range(&self) -> (usize, usize) {
        let (w, r) = self.optim_chunks();
        let (_, lo, hi) = chunk(self.numel, w, r);
        (lo, hi)
    }

    /// Where this rank's optimizer chunk starts in [`local_shard`](Self::local_shard): 0,
    /// or under ZeRO-1 (whose local shard is the whole flat parameter) its offset `lo`.
    pub(crate) fn optim_offset(&self) -> usize {
        self.optim_range().0 - self.shard_range().0
    }

    /// Elements of the padded flat gradient a backward fills: `c W`, or under ZeRO-1
    /// `c_o world`, so that it reduce-scatters into the optimizer's chunks.
    pub(crate) fn grad_buffer_numel(&self) -> usize {
        match self.optim_partition {
            Some((w, _)) => self.optim_shard_numel() * w,
            None => self.padded_numel(),
        }
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

    /// This rank's chunk of the accumulated gradient, `(c_o)` (see
    /// [`optim_shard_numel`](Self::optim_shard_numel): the parameter chunk's size, or
    /// under ZeRO-1 the optimizer chunk's).
    pub fn grad_shard(&self) -> Option<&Tensor> {
        self.grad_shard.as_ref()
    }

    /// The view of `buffer` (padded flat layout) that is parameter `k`, of its shape.
    pub(crate) fn view(&self, buffer: &Tensor, k: usize) -> Result<Tensor> {
        let i = self.infos.get(k).ok_or_else(|| {
            Error::Fsdp(format!(
                "internal: FlatParameter has {} parameters, no parameter {k}",
                self.infos.len()
            ))
        })?;
        buffer.view(i.offset, &i.shape)
    }
}
