//! `state_dict` and `load_state_dict` of the root unit (FSDP1 `_state_dict_utils.py`).

use super::buffers::{buffer_copies, plan_buffers};
use super::layout::{
    gather_chunk, host_copy, ignored_params, lookup, unit_metas, write_values, Src, UnitMeta,
};
use super::{
    FullStateDict, FullStateDictConfig, IncompatibleKeys, LocalFlatShard, LocalRange,
    LocalStateDict, ShardPiece, ShardedStateDict, ShardedTensor, StateDict, StateDictConfig,
};
use crate::error::{Error, Result};
use crate::fsdp::FullyShardedDataParallel;
use crate::nn::state_dict::{buffer_metas, write_buffers, BufferPlan};
use crate::tensor::{DType, Tensor};

/// Values to write into one unit's chunk: `(chunk start, values)`.
type ChunkWrites = Vec<(usize, Vec<f64>)>;

/// What a load writes: per unit its chunk writes, per ignored parameter its values, and
/// the keys a non-strict load skipped.
type Plan = (Vec<ChunkWrites>, Vec<(String, Vec<f64>)>, IncompatibleKeys);

impl FullyShardedDataParallel {
    /// `Fsdp` error unless this is the root.
    pub(crate) fn check_root(&self, what: &str) -> Result<()> {
        if !self.is_root() {
            return Err(Error::Fsdp(format!(
                "{what} must be called on the root FSDP instance, not on unit '{}'",
                self.module_name()
            )));
        }
        Ok(())
    }

    /// `Fsdp` error while a forward waits for its backward or inside `summon_full_params`:
    /// new values there would be ignored by (or would corrupt) the pending backward.
    pub(crate) fn check_idle(&self, what: &str) -> Result<()> {
        let s = self.rs.sched.lock();
        if s.progress.owes_backward() {
            return Err(Error::Fsdp(format!(
                "{what} between a forward and its backward: the pending backward would compute gradients for parameters other than those the forward used; call it before the forward or after the backward ({} leaves nothing pending)",
                crate::error::Term::NoGradForward
            )));
        }
        if matches!(s.progress.pass(), crate::fsdp::progress::Pass::Summoning(_)) {
            return Err(Error::Fsdp(format!(
                "{what} inside summon_full_params: modify the parameters through the module there, or call {what} after the closure returns"
            )));
        }
        Ok(())
    }

    /// Parameter and persistent-buffer names in `model.state_dict()` order (tied
    /// parameters under each name).
    fn state_dict_order(&mut self) -> Vec<String> {
        crate::nn::state_dict::state_dict_keys(self).unwrap_or_else(|_| {
            crate::nn::parameter_shapes(self)
                .into_iter()
                .map(|(n, _)| n)
                .collect()
        })
    }

    /// This model's state dict of the type `config` names (`model.state_dict()` under
    /// `FSDP.state_dict_type(model, type, config)`). Full: every rank must call it (it
    /// all-gathers each unit in turn, so at most one unit is whole at a time); sharded and
    /// local: no communication.
    ///
    /// # Errors
    /// `Fsdp` on a nested unit; a collective's error.
    pub fn state_dict(&mut self, config: StateDictConfig) -> Result<StateDict> {
        Ok(match config {
            StateDictConfig::Full(c) => StateDict::Full(self.full_state_dict(c)?),
            StateDictConfig::Sharded => StateDict::Sharded(self.sharded_state_dict()?),
            StateDictConfig::Local => StateDict::Local(self.local_state_dict()?),
        })
    }

    /// FULL_STATE_DICT: every parameter whole, f32, under its original name, in
    /// `model.state_dict()` order; with `rank0_only`, empty on every rank but 0. A
    /// collective over the world. With `offload_to_cpu` the tensors are in host memory;
    /// without, on the device the shards live on (copies, as PyTorch's GPU state dict).
    ///
    /// # Errors
    /// `Fsdp` on a nested unit; a collective's error.
    pub fn full_state_dict(&mut self, config: FullStateDictConfig) -> Result<FullStateDict> {
        self.check_root("state_dict")?;
        let keep = !config.rank0_only || self.process_group().rank() == 0;
        let mut out: Vec<(String, Tensor)> = Vec::new();
        self.for_each_unit(&mut |u| {
            let full = gather_chunk(u, u.flat_param().local_shard())?;
            if keep {
                for (name, idx) in u.slots() {
                    let i = &u.flat_param().param_infos()[*idx];
                    let v = full.view(i.offset, &i.shape)?;
                    out.push((
                        name.clone(),
                        if config.offload_to_cpu {
                            host_copy(&v)?
                        } else {
                            v.deep_clone()?
                        },
                    ));
                }
            }
            Ok(())
        })?;
        if keep {
            self.visit_ignored(&mut |name, p| {
                out.push((name.to_string(), host_copy(p.data()?)?));
                Ok(())
            })?;
            out.extend(buffer_copies(self, config.offload_to_cpu)?);
        }
        let order = self.state_dict_order();
        out.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        Ok(FullStateDict { tensors: out })
    }

    /// SHARDED_STATE_DICT: every parameter's global shape and this rank's piece of it (the
    /// part of its flattened elements in this rank's chunk); ignored modules' parameters as
    /// one whole piece. No communication.
    ///
    /// # Errors
    /// `Fsdp` on a nested unit.
    pub fn sharded_state_dict(&mut self) -> Result<ShardedStateDict> {
        self.sharded_snapshot(&mut |t| Ok(t.clone()))?
            .into_state_dict(&mut Vec::new())
    }

    /// What [`sharded_state_dict`](Self::sharded_state_dict) is made of, each unit's local
    /// shard passed to `copy` (a background checkpoint's copy into host buffers of its
    /// own); [`ShardedSnapshot::into_state_dict`] builds the state dict on any thread. No
    /// communication.
    ///
    /// # Errors
    /// `Fsdp` on a nested unit; `copy`'s error.
    pub(crate) fn sharded_snapshot(
        &mut self,
        copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<ShardedSnapshot> {
        self.check_root("state_dict")?;
        let rank = self.process_group().rank();
        let world_size = self.process_group().size();
        let metas = unit_metas(self);
        let mut shards = Vec::with_capacity(metas.len());
        self.for_each_unit(&mut |u| {
            shards.push(copy(u.flat_param().local_shard())?);
            Ok(())
        })?;
        let mut whole: Vec<(String, ShardedTensor)> = Vec::new();
        self.visit_ignored(&mut |name, p| {
            let d = p.data()?;
            let data = host_copy(&d.reshape(&[d.numel()])?)?;
            whole.push((
                name.to_string(),
                ShardedTensor {
                    global_shape: p.shape().to_vec(),
                    pieces: vec![ShardPiece {
                        offset: 0,
                        data,
                        rank,
                    }],
                },
            ));
            Ok(())
        })?;
        for (name, t) in buffer_copies(self, true)? {
            let n = t.numel();
            whole.push((
                name,
                ShardedTensor {
                    global_shape: t.shape().to_vec(),
                    pieces: (n > 0)
                        .then(|| -> Result<ShardPiece> {
                            Ok(ShardPiece {
                                offset: 0,
                                data: t.reshape(&[n])?,
                                rank,
                            })
                        })
                        .transpose()?
                        .into_iter()
                        .collect(),
                },
            ));
        }
        Ok(ShardedSnapshot {
            rank,
            world_size,
            metas,
            shards,
            whole,
            order: self.state_dict_order(),
        })
    }

    /// LOCAL_STATE_DICT: each unit's flat shard, padding included, with the world size and
    /// rank it belongs to. No communication.
    ///
    /// # Errors
    /// `Fsdp` on a nested unit.
    pub fn local_state_dict(&mut self) -> Result<LocalStateDict> {
        self.check_root("state_dict")?;
        let mut flat_params = Vec::new();
        self.for_each_unit(&mut |u| {
            let f = u.flat_param();
            let shard = host_copy(f.local_shard())?;
            flat_params.push((
                crate::nn::join_name(u.module_name(), "flat_param"),
                LocalFlatShard {
                    numel: f.numel(),
                    shard,
                },
            ));
            Ok(())
        })?;
        let mut params = Vec::new();
        self.visit_ignored(&mut |name, p| {
            params.push((name.to_string(), host_copy(p.data()?)?));
            Ok(())
        })?;
        let buffers = buffer_copies(self, true)?;
        let f = self.flat_param();
        Ok(LocalStateDict {
            world_size: self.process_group().size(),
            rank: self.process_group().rank(),
            shard_world_size: f.shard_world_size(),
            shard_rank: f.shard_rank(),
            flat_params,
            params,
            buffers,
        })
    }

    /// Copies `state_dict` into this rank's shards (`model.load_state_dict(sd, strict)`).
    /// Every entry is checked first (shape, dtype f32, coverage of the pieces, and with
    /// `strict` missing and unexpected keys); only when all are right is anything written.
    /// A full state dict must be given on every rank; a sharded one must hold the pieces
    /// this rank needs (its own at the same world size, every rank's at another); a local
    /// one only at the world size and rank it was taken at. No communication.
    ///
    /// # Errors
    /// `StateDict` listing every problem (each naming the parameter and what was expected);
    /// for a local state dict of another world size, one quoting both world sizes. `Fsdp`
    /// on a nested unit, between a forward and its backward, or inside
    /// `summon_full_params`.
    pub fn load_state_dict(
        &mut self,
        state_dict: &StateDict,
        strict: bool,
    ) -> Result<IncompatibleKeys> {
        self.load_or_check(state_dict, strict, true)
    }

    /// Every check of [`load_state_dict`](Self::load_state_dict), without writing anything:
    /// what a multi-rank loader runs on every rank before any rank writes.
    ///
    /// # Errors
    /// As `load_state_dict`.
    pub fn check_state_dict(
        &mut self,
        state_dict: &StateDict,
        strict: bool,
    ) -> Result<IncompatibleKeys> {
        self.load_or_check(state_dict, strict, false)
    }

    /// Every state-dict name with the global shape of its parameter and the elements
    /// `[lo, hi)` of the flattened parameter this rank holds (`None`: none), in
    /// `model.state_dict()` order: what a SHARDED load reads on this rank.
    pub fn state_dict_ranges(&mut self) -> Vec<LocalRange> {
        let mut out = Vec::new();
        for m in unit_metas(self) {
            for (name, idx) in &m.slots {
                let info = &m.infos[*idx];
                out.push(LocalRange {
                    name: name.clone(),
                    shape: info.shape.clone(),
                    range: m.portion(info).map(|(a, b, _)| (a, b)),
                });
            }
        }
        for (name, shape, _) in ignored_params(self) {
            let n = crate::tensor::numel_of(&shape);
            out.push(LocalRange {
                name,
                shape,
                range: (n > 0).then_some((0, n)),
            });
        }
        // Buffers are whole on every rank.
        for b in buffer_metas(self).unwrap_or_default() {
            let n = crate::tensor::numel_of(&b.shape);
            out.push(LocalRange {
                name: b.name,
                shape: b.shape,
                range: (n > 0).then_some((0, n)),
            });
        }
        let order = self.state_dict_order();
        out.sort_by_key(|r| {
            order
                .iter()
                .position(|o| *o == r.name)
                .unwrap_or(usize::MAX)
        });
        out
    }

    /// This rank's index among the ranks that hold the same shards: 0 under FullShard and
    /// ShardGradOp; the node index under hybrid sharding (the rank in the replicate group);
    /// the rank itself under NoShard. Checkpoint writers save the pieces of replica 0 only.
    pub fn shard_replica_rank(&self) -> usize {
        match &self.rs.replicate_pg {
            Some(r) => r.rank(),
            None if self.sharding_strategy().is_sharded() => 0,
            None => self.process_group().rank(),
        }
    }

    fn load_or_check(
        &mut self,
        state_dict: &StateDict,
        strict: bool,
        write: bool,
    ) -> Result<IncompatibleKeys> {
        self.check_root("load_state_dict")?;
        self.check_idle("load_state_dict")?;
        let metas = unit_metas(self);
        let ignored = ignored_params(self);
        let bufs = plan_buffers(state_dict, &buffer_metas(self)?);
        let (writes, ignored_writes, keys) = match state_dict {
            StateDict::Local(l) => self.plan_local(l, &metas, &ignored, &bufs, strict)?,
            sd => plan_unflat(sd, &metas, &ignored, &bufs, strict)?,
        };
        if !write {
            return Ok(keys);
        }
        // Everything checked: write.
        let mut k = 0;
        self.for_each_unit(&mut |u| {
            let w = &writes[k];
            k += 1;
            w.iter()
                .try_for_each(|(start, v)| write_values(u.flat_param().local_shard(), *start, v))
        })?;
        self.visit_ignored(
            &mut |name, p| match ignored_writes.iter().find(|(n, _)| n == name) {
                Some((_, v)) => write_values(p.data()?, 0, v),
                None => Ok(()),
            },
        )?;
        write_buffers(self, &bufs.writes)?;
        Ok(keys)
    }

    fn plan_local(
        &self,
        l: &LocalStateDict,
        metas: &[UnitMeta],
        ignored: &[(String, Vec<usize>, bool)],
        bufs: &BufferPlan,
        strict: bool,
    ) -> Result<Plan> {
        let (w, r) = (self.process_group().size(), self.process_group().rank());
        let f = self.flat_param();
        if l.world_size != w {
            return Err(Error::StateDict(format!(
                "LOCAL_STATE_DICT taken at world size {} (rank {}) cannot be loaded at world size {w} (rank {r}): it holds one rank's flat shards; use a SHARDED or FULL state dict to change the world size",
                l.world_size, l.rank
            )));
        }
        if (l.rank, l.shard_world_size, l.shard_rank) != (r, f.shard_world_size(), f.shard_rank()) {
            return Err(Error::StateDict(format!(
                "LOCAL_STATE_DICT of rank {} (chunk {} of {}) cannot be loaded on rank {r} (chunk {} of {}) at world size {w}: each rank must load its own",
                l.rank,
                l.shard_rank,
                l.shard_world_size,
                f.shard_rank(),
                f.shard_world_size()
            )));
        }
        let (mut problems, mut missing) = (bufs.problems.clone(), bufs.missing.clone());
        let mut writes = Vec::with_capacity(metas.len());
        for m in metas {
            let mut w = Vec::new();
            match l.flat_params.iter().find(|(k, _)| *k == m.local_key) {
                None => missing.push(format!(
                    "'{}' (expected a flat shard of {} elements, f32)",
                    m.local_key, m.shard_numel
                )),
                Some((_, s)) if s.numel != m.numel || s.shard.numel() != m.shard_numel => {
                    problems.push(format!(
                        "'{}': expected a flat shard of {} elements of a FlatParameter of {}, got {} of {}",
                        m.local_key,
                        m.shard_numel,
                        m.numel,
                        s.shard.numel(),
                        s.numel
                    ))
                }
                Some((_, s)) if !matches!(s.shard.dtype(), DType::F32 | DType::F64) => problems.push(format!(
                    "'{}': expected dtype f32 or f64, got {}",
                    m.local_key,
                    s.shard.dtype()
                )),
                Some((_, s)) => w.push((0, s.shard.to_vec_f64()?)),
            }
            writes.push(w);
        }
        let mut ignored_writes = Vec::new();
        for (name, shape, _) in ignored {
            match l.params.iter().find(|(n, _)| n == name) {
                None => missing.push(format!("'{name}' (expected shape {shape:?}, f32)")),
                Some((_, t)) => {
                    let p = Src::Full(t).check(name, shape);
                    if p.is_empty() {
                        ignored_writes.push((name.clone(), t.to_vec_f64()?));
                    }
                    problems.extend(p);
                }
            }
        }
        let unexpected: Vec<String> = l
            .flat_params
            .iter()
            .map(|(k, _)| k)
            .chain(l.params.iter().map(|(k, _)| k))
            .chain(l.buffers.iter().map(|(k, _)| k))
            .filter(|k| {
                !metas.iter().any(|m| &m.local_key == *k)
                    && !ignored.iter().any(|i| &i.0 == *k)
                    && !bufs.names.contains(k)
            })
            .cloned()
            .collect();
        crate::nn::state_dict::load_verdict(
            "LOCAL_STATE_DICT",
            problems,
            missing,
            unexpected,
            strict,
        )
        .map(|keys| (writes, ignored_writes, keys))
    }
}

/// Checks a full or sharded state dict against the model and returns what to write into
/// each unit's chunk and each ignored parameter.
fn plan_unflat(
    sd: &StateDict,
    metas: &[UnitMeta],
    ignored: &[(String, Vec<usize>, bool)],
    bufs: &BufferPlan,
    strict: bool,
) -> Result<Plan> {
    let lookup = |name: &str| lookup(sd, name);
    let what = match sd {
        StateDict::Sharded(_) => "SHARDED_STATE_DICT",
        _ => "FULL_STATE_DICT",
    };
    let (mut problems, mut missing) = (bufs.problems.clone(), bufs.missing.clone());
    let mut writes = Vec::with_capacity(metas.len());
    for m in metas {
        let mut w = Vec::new();
        for (name, idx) in &m.slots {
            let info = &m.infos[*idx];
            let Some(src) = lookup(name) else {
                missing.push(format!("'{name}' (expected shape {:?}, f32)", info.shape));
                continue;
            };
            let p = src.check(name, &info.shape);
            if !p.is_empty() {
                problems.extend(p);
                continue;
            }
            if let Some((a, b, start)) = m.portion(info) {
                match src.read_f64(name, a, b)? {
                    Ok(v) => w.push((start, v)),
                    Err(p) => problems.push(p),
                }
            }
        }
        writes.push(w);
    }
    let mut ignored_writes = Vec::new();
    for (name, shape, _) in ignored {
        let Some(src) = lookup(name) else {
            missing.push(format!("'{name}' (expected shape {shape:?}, f32)"));
            continue;
        };
        let p = src.check(name, shape);
        if !p.is_empty() {
            problems.extend(p);
            continue;
        }
        match src.read_f64(name, 0, crate::tensor::numel_of(shape))? {
            Ok(v) => ignored_writes.push((name.clone(), v)),
            Err(p) => problems.push(p),
        }
    }
    let known = |k: &str| {
        metas.iter().any(|m| m.slots.iter().any(|(n, _)| n == k))
            || ignored.iter().any(|i| i.0 == k)
            || bufs.names.iter().any(|n| n == k)
    };
    let unexpected: Vec<String> = sd
        .keys()
        .into_iter()
        .filter(|k| !known(k))
        .map(str::to_string)
        .collect();
    crate::nn::state_dict::load_verdict(what, problems, missing, unexpected, strict)
        .map(|keys| (writes, ignored_writes, keys))
}

/// A sharded state dict before it is cut into pieces: each unit's local shard (a copy of
/// its own for a background checkpoint) and layout, ignored parameters and buffers whole.
/// Built by [`FullyShardedDataParallel::sharded_snapshot`] on the training thread; cut by
/// [`into_state_dict`](Self::into_state_dict) on any thread.
pub(crate) struct ShardedSnapshot {
    rank: usize,
    world_size: usize,
    metas: Vec<UnitMeta>,
    /// Each unit's local shard `(c)`, in [`unit_metas`] order.
    shards: Vec<Tensor>,
    /// Ignored modules' parameters and persistent buffers, one whole piece each.
    whole: Vec<(String, ShardedTensor)>,
    /// The keys in `model.state_dict()` order.
    order: Vec<String>,
}

impl ShardedSnapshot {
    /// The sharded state dict: each parameter's piece copied out of its unit's shard (in
    /// host memory). The shards are pushed onto `reuse` afterwards.
    ///
    /// # Errors
    /// A failed copy (CUDA).
    pub(crate) fn into_state_dict(self, reuse: &mut Vec<Tensor>) -> Result<ShardedStateDict> {
        let ShardedSnapshot {
            rank,
            world_size,
            metas,
            shards,
            whole,
            order,
        } = self;
        let mut out: Vec<(String, ShardedTensor)> = Vec::new();
        for (m, shard) in metas.iter().zip(&shards) {
            for (name, idx) in &m.slots {
                let info = &m.infos[*idx];
                let pieces = match m.portion(info) {
                    Some((a, b, start)) => vec![ShardPiece {
                        offset: a,
                        data: host_copy(&shard.view(start, &[b - a])?)?,
                        rank,
                    }],
                    None => Vec::new(),
                };
                out.push((
                    name.clone(),
                    ShardedTensor {
                        global_shape: info.shape.clone(),
                        pieces,
                    },
                ));
            }
        }
        reuse.extend(shards);
        out.extend(whole);
        out.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        Ok(ShardedStateDict {
            world_size,
            tensors: out,
        })
    }
}
