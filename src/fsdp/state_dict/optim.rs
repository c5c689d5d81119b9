//! Optimizer state keyed by original parameter name (FSDP1 `_optim_utils.py`:
//! `FSDP.optim_state_dict`, `FSDP.optim_state_dict_to_load`).
//!
//! The optimizer keeps one state per entry of
//! [`optimizer_params`](FullyShardedDataParallel::optimizer_params): a run of trainable
//! elements of a unit's chunk, possibly spanning several parameters. Here that state is cut
//! at parameter boundaries and named like the parameters, full or sharded exactly as the
//! model's state dict, so it can be reloaded at another world size or strategy.

use super::layout::{gather_optim_chunk, ignored_params, lookup, optim_unit_metas, UnitMeta};
use super::optim_groups::{to_named, to_positions, NamedParamGroup};
use super::{
    FullStateDict, FullStateDictConfig, ShardPiece, ShardedStateDict, ShardedTensor, StateDict,
    StateDictConfig,
};
use crate::distributed::fingerprint::Phase;
use crate::distributed::staged;
use crate::distributed::ReduceOp;
use crate::error::{Error, Result};
use crate::fsdp::FullyShardedDataParallel;
use crate::nn::state_dict::load_error;
use crate::optim::{buffer_names, Optimizer, OptimizerState, StateSnapshot, TensorState};
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

/// One entry of `optimizer_params()`: a trainable run of unit `unit`'s chunk, or an ignored
/// module's parameter.
enum Position {
    Run {
        unit: usize,
        start: usize,
        len: usize,
    },
    Ignored {
        name: String,
        numel: usize,
    },
}

fn positions(metas: &[UnitMeta], ignored: &[(String, Vec<usize>, bool)]) -> Vec<Position> {
    let mut out = Vec::new();
    for (unit, m) in metas.iter().enumerate() {
        for &(start, len) in &m.runs {
            out.push(Position::Run { unit, start, len });
        }
    }
    for (name, shape, requires_grad) in ignored {
        if *requires_grad {
            out.push(Position::Ignored {
                name: name.clone(),
                numel: crate::tensor::numel_of(shape),
            });
        }
    }
    out
}

/// Zero-size parameters hold no element of any chunk, so no optimizer run has their
/// state. PyTorch's optimizers keep state for every parameter with a gradient, a zero-size
/// one included (`exp_avg` of shape `(8, 0)`): when this rank has state for any parameter,
/// each of `empties` gets empty buffers of its shape and the largest step, and every
/// buffer's entries are put back in parameter order.
fn add_zero_size_state(
    metas: &[UnitMeta],
    empties: &[(String, Vec<usize>)],
    steps: &mut Vec<(String, u64)>,
    bufs: &mut [Vec<(String, Tensor)>],
    pieces: &mut [Vec<(String, ShardedTensor)>],
) {
    let any = bufs.iter().any(|b| !b.is_empty()) || pieces.iter().any(|p| !p.is_empty());
    if empties.is_empty() || !any {
        return;
    }
    let step = steps.iter().map(|s| s.1).max();
    let order: Vec<&str> = metas
        .iter()
        .flat_map(|m| m.slots.iter().map(|(n, _)| n.as_str()))
        .collect();
    let at = |n: &str| order.iter().position(|o| *o == n).unwrap_or(order.len());
    for (name, shape) in empties {
        if let Some(s) = step {
            steps.push((name.clone(), s));
        }
        for b in bufs.iter_mut().filter(|b| !b.is_empty()) {
            b.push((
                name.clone(),
                Tensor::zeros(shape, crate::tensor::DType::F32),
            ));
        }
        for p in pieces.iter_mut().filter(|p| !p.is_empty()) {
            // No rank holds a piece of a zero-size parameter: the entry is its shape.
            p.push((
                name.clone(),
                ShardedTensor {
                    global_shape: shape.clone(),
                    pieces: Vec::new(),
                },
            ));
        }
    }
    steps.sort_by_key(|(n, _)| at(n));
    for b in bufs.iter_mut() {
        b.sort_by_key(|(n, _)| at(n));
    }
    for p in pieces.iter_mut() {
        p.sort_by_key(|(n, _)| at(n));
    }
}

/// The run of `runs` holding chunk element `at`, as an index into `positions`.
fn run_at(pos: &[Position], unit: usize, at: usize) -> Option<usize> {
    pos.iter().position(|p| {
        matches!(p, Position::Run { unit: u, start, len } if *u == unit && *start <= at && at < start + len)
    })
}

/// `StateDict` error when an optimizer's state has `count` tensors (none before the first
/// step) but the model's `optimizer_params()` another number.
fn check_count(
    kind: &str,
    count: usize,
    metas: &[UnitMeta],
    ignored: &[(String, Vec<usize>, bool)],
) -> Result<()> {
    let n = positions(metas, ignored).len();
    if count != 0 && count != n {
        return Err(Error::StateDict(format!(
            "the {kind} optimizer holds state for {count} tensors but optimizer_params() of this model has {n}: was it built on another model?"
        )));
    }
    Ok(())
}

/// The optimizer kind of a snapshot.
fn optim_kind(s: &StateSnapshot) -> String {
    match s {
        StateSnapshot::State(s) => s.kind.clone(),
        StateSnapshot::Tensors { kind, .. } => kind.clone(),
    }
}

/// An optimizer state dict being assembled from an [`OptimizerState`], unit by unit (the
/// cut of each run's buffers at parameter boundaries), full or sharded.
struct Assembly<'a> {
    st: &'a OptimizerState,
    pos: Vec<Position>,
    names: &'static [&'static str],
    counts_steps: bool,
    /// This rank keeps the result (not a `rank0_only` full state dict off rank 0).
    keep: bool,
    full: bool,
    rank: usize,
    metas: &'a [UnitMeta],
    steps: Vec<(String, u64)>,
    /// Full: per buffer, whole tensors by name.
    bufs: Vec<Vec<(String, Tensor)>>,
    /// Sharded: per buffer, this rank's pieces by name.
    pieces: Vec<Vec<(String, ShardedTensor)>>,
    /// Trainable zero-size parameters, `(name, shape)`: no run covers them.
    empties: Vec<(String, Vec<usize>)>,
}

impl<'a> Assembly<'a> {
    fn new(
        st: &'a OptimizerState,
        metas: &'a [UnitMeta],
        ignored: &[(String, Vec<usize>, bool)],
        keep: bool,
        full: bool,
    ) -> Self {
        let names = buffer_names(&st.kind);
        Assembly {
            st,
            pos: positions(metas, ignored),
            names,
            counts_steps: matches!(st.kind.as_str(), "Adam" | "AdamW"),
            keep,
            full,
            rank: 0,
            metas,
            steps: Vec::new(),
            bufs: vec![Vec::new(); names.len()],
            pieces: vec![Vec::new(); names.len()],
            empties: Vec::new(),
        }
    }

    fn state_at(&self, i: usize) -> Option<&'a TensorState> {
        self.st.tensors.get(i).and_then(Option::as_ref)
    }

    /// Each parameter of unit `ui`'s step on this rank (-1: no state here).
    fn local_steps(&self, ui: usize, m: &UnitMeta) -> Vec<i32> {
        let mut local: Vec<i32> = vec![-1; m.infos.len()];
        for (i, info) in m.infos.iter().enumerate() {
            if let Some((_, _, start)) = m.portion(info) {
                if let Some(t) = run_at(&self.pos, ui, start).and_then(|r| self.state_at(r)) {
                    local[i] = t.step.unwrap_or(0).min(i32::MAX as u64) as i32;
                }
            }
        }
        local
    }

    /// Adds unit `ui`'s entries, given each parameter's step (`step_of`, -1: no state):
    /// full with `gather` (the chunk of a buffer -> the whole flat buffer), else sharded.
    fn unit(
        &mut self,
        ui: usize,
        m: &UnitMeta,
        step_of: &[i32],
        mut gather: Option<&mut dyn FnMut(&Tensor) -> Result<Tensor>>,
    ) -> Result<()> {
        if self.keep {
            for (name, idx) in &m.slots {
                let i = &m.infos[*idx];
                if i.numel == 0 && i.requires_grad {
                    self.empties.push((name.clone(), i.shape.clone()));
                }
            }
        }
        for (b, bname) in self.names.iter().enumerate() {
            // The buffer in chunk layout (zero outside trainable runs with state), in
            // the FlatParameter's dtype: f64 state of an f64 model stays exact.
            let mut chunk = vec![0.0f64; m.shard_numel];
            for (pi, p) in self.pos.iter().enumerate() {
                if let (Position::Run { unit, start, len }, Some(t)) = (p, self.state_at(pi)) {
                    if *unit == ui {
                        let dst = &mut chunk[*start..start + len];
                        if let Some(v) = t.buffer_f64(bname).filter(|v| v.len() == *len) {
                            dst.copy_from_slice(v);
                        } else if let Some(v) = t.buffer(bname).filter(|v| v.len() == *len) {
                            dst.iter_mut().zip(v).for_each(|(d, &s)| *d = f64::from(s));
                        }
                    }
                }
            }
            let chunk = match m.dtype {
                DType::F64 => Tensor::from_vec(chunk, &[m.shard_numel])?,
                // f32 values widened and rounded back: the same bits.
                _ => Tensor::from_vec(
                    chunk.into_iter().map(|v| v as f32).collect::<Vec<f32>>(),
                    &[m.shard_numel],
                )?,
            };
            let with_state = m.slots.iter().filter(|(_, i)| step_of[*i] >= 0);
            match gather.as_mut() {
                Some(gather) => {
                    let whole = gather(&chunk)?;
                    for (name, idx) in with_state {
                        let i = &m.infos[*idx];
                        if self.keep {
                            self.bufs[b].push((
                                name.clone(),
                                whole.view(i.offset, &i.shape)?.deep_clone()?,
                            ));
                        }
                    }
                }
                None => {
                    for (name, idx) in with_state {
                        let info = &m.infos[*idx];
                        if let Some((a, bb, start)) = m.portion(info) {
                            self.pieces[b].push((
                                name.clone(),
                                ShardedTensor {
                                    global_shape: info.shape.clone(),
                                    pieces: vec![ShardPiece {
                                        offset: a,
                                        data: chunk.view(start, &[bb - a])?.deep_clone()?,
                                        rank: self.rank,
                                    }],
                                },
                            ));
                        }
                    }
                }
            }
        }
        if self.counts_steps && self.keep {
            for (name, idx) in &m.slots {
                if step_of[*idx] >= 0 {
                    self.steps.push((name.clone(), step_of[*idx] as u64));
                }
            }
        }
        Ok(())
    }

    /// The state dict: zero-size parameters' and ignored modules' state added.
    fn finish(
        mut self,
        ignored: &[(String, Vec<usize>, bool)],
        world_size: usize,
        param_groups: Vec<NamedParamGroup>,
    ) -> Result<OptimStateDict> {
        let st = self.st;
        add_zero_size_state(
            self.metas,
            &self.empties,
            &mut self.steps,
            &mut self.bufs,
            &mut self.pieces,
        );
        // Ignored modules' parameters: whole, their own state.
        for (pi, p) in self.pos.iter().enumerate() {
            let (Position::Ignored { name, numel }, Some(t), true) =
                (p, self.state_at(pi), self.keep)
            else {
                continue;
            };
            let shape = ignored
                .iter()
                .find(|i| &i.0 == name)
                .map_or(vec![*numel], |i| i.1.clone());
            for (b, bname) in self.names.iter().enumerate() {
                if t.buffer(bname).is_some() || t.buffer_f64(bname).is_some() {
                    let data = t.buffer_tensor(&st.kind, pi, bname)?;
                    if self.full {
                        self.bufs[b].push((name.clone(), data.reshape(&shape)?));
                    } else {
                        self.pieces[b].push((
                            name.clone(),
                            ShardedTensor {
                                global_shape: shape.clone(),
                                pieces: vec![ShardPiece {
                                    offset: 0,
                                    data,
                                    rank: self.rank,
                                }],
                            },
                        ));
                    }
                }
            }
            if self.counts_steps {
                self.steps.push((name.clone(), t.step.unwrap_or(0)));
            }
        }
        let full = self.full;
        let buffers = self
            .names
            .iter()
            .zip(self.bufs.into_iter().zip(self.pieces))
            .map(|(n, (f, s))| {
                let sd = if full {
                    StateDict::Full(FullStateDict { tensors: f })
                } else {
                    StateDict::Sharded(ShardedStateDict {
                        world_size,
                        tensors: s,
                    })
                };
                (n.to_string(), sd)
            })
            .collect();
        Ok(OptimStateDict {
            kind: st.kind.clone(),
            hyperparams: st.hyperparams.clone(),
            steps: self.steps,
            buffers,
            param_groups,
        })
    }
}

/// A sharded optimizer state dict before its conversion: the optimizer's
/// [`StateSnapshot`] and the model's layout. Built by
/// [`FullyShardedDataParallel::optim_snapshot`] on the training thread; converted by
/// [`into_state_dict`](Self::into_state_dict) on any thread.
pub(crate) struct OptimSnapshot {
    state: StateSnapshot,
    metas: Vec<UnitMeta>,
    ignored: Vec<(String, Vec<usize>, bool)>,
    param_groups: Vec<NamedParamGroup>,
    rank: usize,
    world_size: usize,
}

impl OptimSnapshot {
    /// The sharded optimizer state dict (host tensors). The snapshot's tensors are pushed
    /// onto `reuse` afterwards.
    ///
    /// # Errors
    /// A failed read of a tensor (CUDA copy).
    pub(crate) fn into_state_dict(self, reuse: &mut Vec<Tensor>) -> Result<OptimStateDict> {
        let st = self.state.into_state(reuse)?;
        let mut a = Assembly::new(&st, &self.metas, &self.ignored, true, false);
        a.rank = self.rank;
        for (ui, m) in self.metas.iter().enumerate() {
            let step_of = a.local_steps(ui, m);
            a.unit(ui, m, &step_of, None)?;
        }
        a.finish(&self.ignored, self.world_size, self.param_groups)
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
