//! Optimizer state keyed by original parameter name (FSDP1 `_optim_utils.py`:
//! `FSDP.optim_state_dict`, `FSDP.optim_state_dict_to_load`).
//!
//! The optimizer keeps one state per entry of
//! [`optimizer_params`](FullyShardedDataParallel::optimizer_params): a run of trainable
//! elements of a unit's chunk, possibly spanning several parameters. Here that state is cut
//! at parameter boundaries and named like the parameters, full or sharded exactly as the
//! model's state dict, so it can be reloaded at another world size or strategy.

use super::layout::{gather_optim_chunk, ignored_params, lookup, optim_unit_metas, UnitMeta};
pub(crate) use super::optim_cut::OptimSnapshot;
use super::optim_cut::{check_count, optim_kind, positions, Assembly, Position};
use super::optim_groups::{to_named, to_positions, NamedParamGroup};
use super::{FullStateDictConfig, ShardedStateDict, StateDict, StateDictConfig};
use crate::distributed::fingerprint::Phase;
use crate::distributed::staged;
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use crate::fsdp::FullyShardedDataParallel;
use crate::nn::state_dict::load_error;
use crate::optim::{buffer_names, Optimizer, OptimizerState, TensorState};
use crate::tensor::{DType, Tensor};

/// An optimizer's state by original parameter name (what `FSDP.optim_state_dict` returns):
/// the optimizer kind and hyperparameters, each parameter's step, and each per-element
/// buffer (`exp_avg`, `exp_avg_sq`, `momentum_buffer`) as a full or sharded state dict
/// keyed by parameter name, and the parameter groups by name. Parameters without state (frozen ones, or before the first
/// step) have no entries. A trainable zero-size parameter has empty buffers of its shape
/// and the step of the others whenever any parameter has state, as PyTorch's optimizers
/// keep state for every parameter with a gradient.
#[derive(Debug, Clone)]
pub struct OptimStateDict {
    /// `"SGD"`, `"Adam"` or `"AdamW"`.
    pub kind: String,
    /// `param_groups[0]` by PyTorch name (see [`OptimizerState::hyperparams`]).
    pub hyperparams: Vec<(String, f64)>,
    /// `(parameter name, state["step"])` for optimizers that count steps (Adam, AdamW).
    pub steps: Vec<(String, u64)>,
    /// `(buffer name, values by parameter name)`; [`StateDict::Full`] or
    /// [`StateDict::Sharded`].
    pub buffers: Vec<(String, StateDict)>,
    /// The optimizer's parameter groups by parameter name (every rank's parameters);
    /// empty when it has one group of every tensor with `hyperparams`' lr and decay.
    pub param_groups: Vec<NamedParamGroup>,
}

impl OptimStateDict {
    /// The step of parameter `name`.
    pub fn step(&self, name: &str) -> Option<u64> {
        self.steps.iter().find(|(n, _)| n == name).map(|&(_, s)| s)
    }

    /// The state dict of buffer `name`.
    pub fn buffer(&self, name: &str) -> Option<&StateDict> {
        self.buffers.iter().find(|(n, _)| n == name).map(|(_, d)| d)
    }

    /// The union of several ranks' sharded optimizer state dicts (see
    /// [`ShardedStateDict::merge`]).
    ///
    /// # Errors
    /// `StateDict` when they disagree on the optimizer, or a buffer is not sharded.
    pub fn merge(dicts: &[OptimStateDict]) -> Result<OptimStateDict> {
        let Some(first) = dicts.first() else {
            return Err(Error::StateDict("no optimizer state dicts to merge".into()));
        };
        let mut steps: Vec<(String, u64)> = Vec::new();
        for d in dicts {
            if d.kind != first.kind {
                return Err(Error::StateDict(format!(
                    "cannot merge optimizer state of {} and {}",
                    first.kind, d.kind
                )));
            }
            for (n, s) in &d.steps {
                match steps.iter_mut().find(|(m, _)| m == n) {
                    Some((_, t)) => *t = (*t).max(*s),
                    None => steps.push((n.clone(), *s)),
                }
            }
        }
        let mut buffers = Vec::new();
        for (name, _) in &first.buffers {
            let mut parts = Vec::new();
            for d in dicts {
                match d.buffer(name) {
                    Some(StateDict::Sharded(s)) => parts.push(s.clone()),
                    Some(_) => {
                        return Err(Error::StateDict(format!(
                            "optimizer buffer '{name}' is not sharded; only sharded optimizer state dicts merge"
                        )))
                    }
                    None => {}
                }
            }
            buffers.push((
                name.clone(),
                StateDict::Sharded(ShardedStateDict::merge(&parts)?),
            ));
        }
        Ok(OptimStateDict {
            kind: first.kind.clone(),
            hyperparams: first.hyperparams.clone(),
            steps,
            buffers,
            param_groups: first.param_groups.clone(),
        })
    }
}

impl FullyShardedDataParallel {
    /// `optim`'s state by original parameter name (`FSDP.optim_state_dict(model, optim)`),
    /// full or sharded as `config` says (`Local` is refused). `optim` must step on
    /// [`optimizer_params`](Self::optimizer_params) of this model. Full: a collective over
    /// the world (one all-gather per unit and buffer); sharded: no communication (but one
    /// all-reduce when the optimizer has parameter groups).
    ///
    /// # Errors
    /// `StateDict` when the optimizer's state does not match `optimizer_params()`;
    /// `Unsupported` for a local config or an optimizer without `state_dict`; `Fsdp` on a
    /// nested unit.
    pub fn optim_state_dict(
        &mut self,
        optim: &dyn Optimizer,
        config: StateDictConfig,
    ) -> Result<OptimStateDict> {
        match config {
            StateDictConfig::Full(c) => self.full_optim_state_dict(optim, c),
            StateDictConfig::Sharded => self
                .optim_snapshot(optim, &mut |t| Ok(t.clone()))?
                .into_state_dict(&mut Vec::new()),
            StateDictConfig::Local => Err(Error::Unsupported(
                "optim_state_dict with LOCAL_STATE_DICT; use FULL or SHARDED".into(),
            )),
        }
    }

    /// What the sharded [`optim_state_dict`](Self::optim_state_dict) is made of:
    /// `optim`'s [`snapshot`](Optimizer::snapshot) through `copy` (a background
    /// checkpoint's copy into host buffers of its own) and this model's layout;
    /// [`OptimSnapshot::into_state_dict`] builds the state dict on any thread. No
    /// communication but the all-reduce of named parameter groups, when there are groups.
    ///
    /// # Errors
    /// As [`optim_state_dict`](Self::optim_state_dict); `copy`'s error.
    pub(crate) fn optim_snapshot(
        &mut self,
        optim: &dyn Optimizer,
        copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<OptimSnapshot> {
        self.check_root("optim_state_dict")?;
        let st = optim.snapshot(copy)?;
        let metas = optim_unit_metas(self);
        let ignored = ignored_params(self);
        check_count(&optim_kind(&st), st.tensor_count(), &metas, &ignored)?;
        let param_groups = self.named_groups(&metas, &ignored, st.param_groups())?;
        Ok(OptimSnapshot {
            state: st,
            metas,
            ignored,
            param_groups,
            rank: self.process_group().rank(),
            world_size: self.process_group().size(),
        })
    }

    /// The optimizer's parameter groups by name (every rank's parameters): one
    /// all-reduce of the membership, when there are groups.
    fn named_groups(
        &mut self,
        metas: &[UnitMeta],
        ignored: &[(String, Vec<usize>, bool)],
        groups: &[crate::optim::ParamGroup],
    ) -> Result<Vec<NamedParamGroup>> {
        if groups.is_empty() {
            return Ok(Vec::new());
        }
        let names = self.optimizer_param_names();
        to_named(self, metas, ignored, &names, groups)
    }

    /// FULL_STATE_DICT of `optim`: every buffer gathered unit by unit (a collective).
    fn full_optim_state_dict(
        &mut self,
        optim: &dyn Optimizer,
        c: FullStateDictConfig,
    ) -> Result<OptimStateDict> {
        self.check_root("optim_state_dict")?;
        let st = optim.state_dict()?;
        let metas = optim_unit_metas(self);
        let ignored = ignored_params(self);
        check_count(&st.kind, st.tensors.len(), &metas, &ignored)?;
        let keep = !c.rank0_only || self.process_group().rank() == 0;
        let mut a = Assembly::new(&st, &metas, &ignored, keep, true);
        let mut k = 0;
        self.for_each_unit(&mut |u| {
            let (ui, m) = (k, &metas[k]);
            k += 1;
            let local = a.local_steps(ui, m);
            let step_of = if u.grads_scattered() {
                let t = Tensor::from_vec(local, &[m.infos.len()])?;
                let _tag = u.fingerprint(Phase::StateDict);
                staged::all_reduce(u.shard_group().as_ref(), &t, ReduceOp::Max)?;
                let v = t.data::<i32>()?.to_vec();
                v
            } else {
                local
            };
            a.unit(
                ui,
                m,
                &step_of,
                Some(&mut |chunk| gather_optim_chunk(u, chunk)),
            )
        })?;
        let param_groups = self.named_groups(&metas, &ignored, &st.param_groups)?;
        let world_size = self.process_group().size();
        a.finish(&ignored, world_size, param_groups)
    }

    /// The per-tensor [`OptimizerState`] an optimizer over this model's
    /// [`optimizer_params`](Self::optimizer_params) loads (`FSDP.optim_state_dict_to_load`):
    /// `osd` cut to this rank's runs. A full `osd` must be given on every rank; a sharded
    /// one must hold the pieces this rank needs. Parameters `osd` has no state for start
    /// fresh (zero buffers, step of the other parameters in their run). No communication.
    ///
    /// # Errors
    /// `StateDict` naming each parameter whose buffer has the wrong shape or dtype or is
    /// not covered, each key the model does not have, and a missing step or buffer.
    pub fn optim_state_dict_to_load(&mut self, osd: &OptimStateDict) -> Result<OptimizerState> {
        self.check_root("optim_state_dict_to_load")?;
        let metas = optim_unit_metas(self);
        let ignored = ignored_params(self);
        let pos = positions(&metas, &ignored);
        let names = buffer_names(&osd.kind);
        let mut out = OptimizerState {
            kind: osd.kind.clone(),
            hyperparams: osd.hyperparams.clone(),
            tensors: Vec::new(),
            param_groups: if osd.param_groups.is_empty() {
                Vec::new()
            } else {
                to_positions(&osd.param_groups, &self.optimizer_param_names())?
            },
        };
        if osd.buffers.is_empty() && osd.steps.is_empty() {
            return Ok(out); // saved before the first step
        }
        let counts_steps = matches!(osd.kind.as_str(), "Adam" | "AdamW");
        let mut problems: Vec<String> = Vec::new();
        let mut sources: Vec<&StateDict> = Vec::new();
        for n in names {
            match osd.buffer(n) {
                Some(sd @ (StateDict::Full(_) | StateDict::Sharded(_))) => sources.push(sd),
                Some(StateDict::Local(_)) => problems.push(format!("buffer '{n}' is a LOCAL state dict; optimizer state loads from FULL or SHARDED")),
                None => problems.push(format!("{} state has no '{n}' buffers", osd.kind)),
            }
        }
        if !problems.is_empty() {
            return Err(load_error("optimizer state", &problems, &[], &[]));
        }
        // Per unit and buffer: the chunk-layout values, and per parameter whether it has state.
        // f64 values (exact for f32 and f64 sources), kept as f64 state for an f64 unit.
        let mut chunks: Vec<Vec<Vec<f64>>> = Vec::new();
        let mut has: Vec<Vec<Option<u64>>> = Vec::new();
        for m in &metas {
            let mut c = vec![vec![0.0f64; m.shard_numel]; names.len()];
            let mut h: Vec<Option<u64>> = vec![None; m.infos.len()];
            for (name, idx) in &m.slots {
                let info = &m.infos[*idx];
                for (b, sd) in sources.iter().enumerate() {
                    let Some(src) = lookup(sd, name) else {
                        continue;
                    };
                    let p = src.check(&format!("{name}.{}", names[b]), &info.shape);
                    if !p.is_empty() {
                        problems.extend(p);
                        continue;
                    }
                    let step = if counts_steps {
                        match osd.step(name) {
                            Some(s) => s,
                            None => {
                                problems.push(format!("'{name}': has '{}' but no step", names[b]));
                                continue;
                            }
                        }
                    } else {
                        0
                    };
                    h[*idx] = Some(step);
                    if let Some((a, bb, start)) = m.portion(info) {
                        match src.read_f64(name, a, bb)? {
                            Ok(v) => c[b][start..start + v.len()].copy_from_slice(&v),
                            Err(p) => problems.push(p),
                        }
                    }
                }
            }
            chunks.push(c);
            has.push(h);
        }
        let known = |k: &str| {
            metas.iter().any(|m| m.slots.iter().any(|(n, _)| n == k))
                || ignored.iter().any(|i| i.0 == k)
        };
        let mut unexpected: Vec<String> = Vec::new();
        for sd in &sources {
            for k in sd.keys() {
                if !known(k) && !unexpected.iter().any(|u| u == k) {
                    unexpected.push(k.to_string());
                }
            }
        }
        for p in &pos {
            let t = match p {
                Position::Run { unit, start, len } => {
                    let m = &metas[*unit];
                    // The parameters overlapping this run, and their steps.
                    let steps: Vec<Option<u64>> = m
                        .infos
                        .iter()
                        .enumerate()
                        .filter(|(_, i)| {
                            m.portion(i)
                                .is_some_and(|(a, b, s)| s < start + len && *start < s + (b - a))
                        })
                        .map(|(i, _)| has[*unit][i])
                        .collect();
                    let exact = m.dtype == DType::F64;
                    let values = |b: usize| &chunks[*unit][b][*start..start + len];
                    steps.iter().flatten().max().map(|&step| TensorState {
                        step: counts_steps.then_some(step),
                        buffers: names
                            .iter()
                            .enumerate()
                            .map(|(b, n)| {
                                (n.to_string(), values(b).iter().map(|&v| v as f32).collect())
                            })
                            .collect(),
                        buffers_f64: names
                            .iter()
                            .enumerate()
                            .filter(|_| exact)
                            .map(|(b, n)| (n.to_string(), values(b).to_vec()))
                            .collect(),
                    })
                }
                Position::Ignored { name, numel } => {
                    let mut bufs = Vec::new();
                    let shape = ignored
                        .iter()
                        .find(|i| &i.0 == name)
                        .map_or(vec![*numel], |i| i.1.clone());
                    for (b, sd) in sources.iter().enumerate() {
                        if let Some(src) = lookup(sd, name) {
                            let p = src.check(name, &shape);
                            if !p.is_empty() {
                                problems.extend(p);
                                continue;
                            }
                            match src.read(name, 0, *numel)? {
                                Ok(v) => bufs.push((names[b].to_string(), v)),
                                Err(p) => problems.push(p),
                            }
                        }
                    }
                    (bufs.len() == names.len() && !bufs.is_empty()).then(|| TensorState {
                        buffers_f64: Vec::new(),
                        step: counts_steps.then(|| osd.step(name).unwrap_or(0)),
                        buffers: bufs,
                    })
                }
            };
            out.tensors.push(t);
        }
        if !problems.is_empty() || !unexpected.is_empty() {
            return Err(load_error("optimizer state", &problems, &[], &unexpected));
        }
        Ok(out)
    }

    /// Loads `osd` into `optim`, an optimizer over this model's
    /// [`optimizer_params`](Self::optimizer_params):
    /// [`optim_state_dict_to_load`](Self::optim_state_dict_to_load) then
    /// `optim.load_state_dict`. Nothing changes on error.
    ///
    /// # Errors
    /// As `optim_state_dict_to_load`; `StateDict` when `osd` is of another optimizer kind.
    pub fn load_optim_state_dict(
        &mut self,
        optim: &mut dyn Optimizer,
        osd: &OptimStateDict,
    ) -> Result<()> {
        let st = self.optim_state_dict_to_load(osd)?;
        optim.load_state_dict(&st)
    }
}
