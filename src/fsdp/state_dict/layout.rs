//! Where each original parameter's elements sit in a unit's local chunk, and reading the
//! elements a rank needs from a full tensor or from sharded pieces.

use super::{ShardPiece, ShardedTensor};
use crate::backend::Device;
use crate::distributed::fingerprint::Phase;
use crate::distributed::staged;
use crate::error::{Error, Result};
use crate::fsdp::{FullyShardedDataParallel, ParamInfo};
use crate::nn::state_dict::{dtype_problem, shape_problem};
use crate::tensor::{DType, Tensor};

/// A copy of one unit's layout: enough to (un)flatten without borrowing the unit.
#[derive(Debug, Clone)]
pub(super) struct UnitMeta {
    /// `<module name>.flat_param` (`flat_param` for the root).
    pub local_key: String,
    /// Every name of the unit's parameters and the index of its [`ParamInfo`].
    pub slots: Vec<(String, usize)>,
    pub infos: Vec<ParamInfo>,
    /// The unpadded flat elements `[lo, hi)` this rank's chunk holds.
    pub lo: usize,
    pub hi: usize,
    /// Unpadded element count `N`.
    pub numel: usize,
    /// Chunk size `c`.
    pub shard_numel: usize,
    /// Trainable runs `(start, len)` of the optimizer's chunk (what the optimizer steps
    /// on; the chunk of [`optim_unit_metas`], which is this one but under ZeRO-1).
    pub runs: Vec<(usize, usize)>,
    /// The FlatParameter's dtype (f32, or f64 for a float64 model, whose optimizer state
    /// is f64 too).
    pub dtype: crate::tensor::DType,
}

impl UnitMeta {
    /// The part of parameter `info` in this rank's chunk: `(param_lo, param_hi, chunk_start)`
    /// (elements `[param_lo, param_hi)` of the flattened parameter sit at `chunk_start..` of
    /// the chunk), or `None` when the chunk holds none of it.
    pub fn portion(&self, info: &ParamInfo) -> Option<(usize, usize, usize)> {
        let a = info.offset.max(self.lo);
        let b = (info.offset + info.numel).min(self.hi);
        (a < b).then(|| (a - info.offset, b - info.offset, a - self.lo))
    }
}

/// The layout of every unit of the root, in [`FullyShardedDataParallel::for_each_unit`]
/// order (the order `optimizer_params` lists their runs in): each unit's parameter chunk.
pub(super) fn unit_metas(root: &mut FullyShardedDataParallel) -> Vec<UnitMeta> {
    metas(root, false)
}

/// [`unit_metas`] with each unit's optimizer chunk instead (the layout of its optimizer
/// state): the parameter chunk, or under ZeRO-1 the chunk of the optimizer partition.
pub(super) fn optim_unit_metas(root: &mut FullyShardedDataParallel) -> Vec<UnitMeta> {
    metas(root, true)
}

fn metas(root: &mut FullyShardedDataParallel, optim: bool) -> Vec<UnitMeta> {
    let mut out = Vec::new();
    root.each_unit(|u| {
        let f = u.flat_param();
        let ((lo, hi), shard_numel) = if optim {
            (f.optim_range(), f.optim_shard_numel())
        } else {
            (f.shard_range(), f.shard_numel())
        };
        out.push(UnitMeta {
            local_key: crate::nn::join_name(u.module_name(), "flat_param"),
            slots: u.slots().to_vec(),
            infos: f.param_infos().to_vec(),
            lo,
            hi,
            numel: f.numel(),
            shard_numel,
            runs: f.trainable_runs.clone(),
            dtype: f.dtype(),
        });
    });
    out
}

/// `(name, shape, requires_grad)` of the parameters of ignored modules (whole on every
/// rank), in visit order.
pub(super) fn ignored_params(
    root: &mut FullyShardedDataParallel,
) -> Vec<(String, Vec<usize>, bool)> {
    let mut out = Vec::new();
    root.each_ignored(|name, p| out.push((name.to_string(), p.shape().to_vec(), p.requires_grad)));
    out
}

/// A copy of `t` in host memory (state dicts hold host tensors, whatever device the
/// parameters and optimizer state live on).
pub(super) fn host_copy(t: &Tensor) -> Result<Tensor> {
    if t.device().is_cuda() {
        t.to_device(Device::Cpu)
    } else {
        t.deep_clone()
    }
}

/// Overwrites elements `start..start + values.len()` of the f32 or f64 tensor `t`, on its
/// device, casting the f64 values to its dtype (exact for values read from an f32 source).
pub(super) fn write_values(t: &Tensor, start: usize, values: &[f64]) -> Result<()> {
    if start + values.len() > t.numel() {
        return Err(Error::Fsdp(format!(
            "write of {} elements at {start} runs past {} elements",
            values.len(),
            t.numel()
        )));
    }
    let src = Tensor::from_vec(values.to_vec(), &[values.len()])?;
    t.view(start, &[values.len()])?.copy_from(&src)
}

/// The padded flat buffer `(c W)` whose chunk on this rank is `chunk`, on the chunk's
/// device: all-gathered over the unit's shard group (every rank of it must call this), or
/// a copy under NoShard.
pub(super) fn gather_chunk(u: &FullyShardedDataParallel, chunk: &Tensor) -> Result<Tensor> {
    gather(u, chunk, u.sharding_strategy().is_sharded())
}

/// [`gather_chunk`] for a chunk in the optimizer's layout ([`optim_unit_metas`]): under
/// ZeRO-1 the whole flat parameter's optimizer chunks, all-gathered over the world into
/// `(c_o W)` elements.
pub(super) fn gather_optim_chunk(u: &FullyShardedDataParallel, chunk: &Tensor) -> Result<Tensor> {
    gather(u, chunk, u.grads_scattered())
}

fn gather(u: &FullyShardedDataParallel, chunk: &Tensor, split: bool) -> Result<Tensor> {
    if !split {
        return chunk.deep_clone();
    }
    let g = u.shard_group();
    let full = Tensor::zeros_on(&[chunk.numel() * g.size()], chunk.dtype(), chunk.device())?;
    let _tag = u.fingerprint(Phase::StateDict);
    staged::all_gather_into_tensor(g.as_ref(), &full, chunk)?;
    Ok(full)
}

/// The entry called `name` of a full or sharded state dict (`None` for a local one).
pub(super) fn lookup<'a>(sd: &'a super::StateDict, name: &str) -> Option<Src<'a>> {
    match sd {
        super::StateDict::Full(d) => d.get(name).map(Src::Full),
        super::StateDict::Sharded(d) => d.get(name).map(Src::Sharded),
        super::StateDict::Local(_) => None,
    }
}

/// A state-dict entry to read a parameter's elements from.
pub(super) enum Src<'a> {
    /// A whole tensor.
    Full(&'a Tensor),
    /// Pieces of it.
    Sharded(&'a ShardedTensor),
}

impl Src<'_> {
    /// The shape of the whole parameter this entry stands for.
    pub fn shape(&self) -> &[usize] {
        match self {
            Src::Full(t) => t.shape(),
            Src::Sharded(s) => &s.global_shape,
        }
    }

    /// Checks shape and dtype against `(name, shape)`; the problems found, in words.
    pub fn check(&self, name: &str, shape: &[usize]) -> Vec<String> {
        let mut out: Vec<String> = shape_problem(name, shape, self.shape())
            .into_iter()
            .collect();
        match self {
            Src::Full(t) => out.extend(dtype_problem(name, t.dtype(), true)),
            Src::Sharded(s) => {
                if let Some(p) = s.pieces.iter().find(|p| p.data.dtype() != DType::F32) {
                    out.extend(dtype_problem(name, p.data.dtype(), true));
                }
                let n = s.global_numel();
                if let Some(p) = s.pieces.iter().find(|p| p.offset + p.data.numel() > n) {
                    out.push(format!(
                        "'{name}': piece [{}, {}) of rank {} runs past the {n} elements of shape {:?}",
                        p.offset,
                        p.offset + p.data.numel(),
                        p.rank,
                        s.global_shape
                    ));
                }
            }
        }
        out
    }

    /// Elements `[lo, hi)` of the flattened parameter as f32; `Ok(Err(problem))` when the
    /// pieces at hand do not cover them. Call after [`Src::check`] found no problem.
    pub fn read(&self, name: &str, lo: usize, hi: usize) -> Result<Result<Vec<f32>, String>> {
        Ok(self
            .read_f64(name, lo, hi)?
            .map(|v| v.into_iter().map(|x| x as f32).collect()))
    }

    /// [`Src::read`] in f64 (exact for f32 and f64 sources): what a model load writes.
    pub fn read_f64(&self, name: &str, lo: usize, hi: usize) -> Result<Result<Vec<f64>, String>> {
        match self {
            Src::Full(t) => Ok(Ok(t
                .reshape(&[t.numel()])?
                .view(lo, &[hi - lo])?
                .to_vec_f64()?)),
            Src::Sharded(s) => read_pieces(name, s, lo, hi),
        }
    }
}

fn read_pieces(
    name: &str,
    s: &ShardedTensor,
    lo: usize,
    hi: usize,
) -> Result<Result<Vec<f64>, String>> {
    let mut out = vec![0.0f64; hi - lo];
    let mut hits: Vec<&ShardPiece> = s
        .pieces
        .iter()
        .filter(|p| p.offset < hi && lo < p.offset + p.data.numel())
        .collect();
    hits.sort_by_key(|p| p.offset);
    let mut covered = lo;
    for p in hits {
        let (a, b) = (p.offset.max(lo), (p.offset + p.data.numel()).min(hi));
        if a > covered {
            break;
        }
        let v = p.data.view(a - p.offset, &[b - a])?.to_vec_f64()?;
        out[a - lo..b - lo].copy_from_slice(&v);
        covered = covered.max(b);
    }
    if covered < hi {
        let mut ranks: Vec<usize> = s.pieces.iter().map(|p| p.rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        return Ok(Err(format!(
            "'{name}': elements [{covered}, {hi}) of the flattened parameter are in no piece at hand (pieces of ranks {ranks:?}); merge every rank's sharded state dict (ShardedStateDict::merge) or load a sharded checkpoint"
        )));
    }
    Ok(Ok(out))
}
