//! Cutting an optimizer's state at parameter boundaries (FSDP1 `_optim_utils.py`): each
//! run of `optimizer_params()` holds the state of one or more parameters' elements in a
//! unit's chunk; [`Assembly`] names it by parameter, full or sharded, unit by unit, and
//! [`OptimSnapshot`] is a sharded optimizer state dict taken on the training thread and
//! cut on another (a background checkpoint's writer).

use super::layout::UnitMeta;
use super::optim::OptimStateDict;
use super::optim_groups::NamedParamGroup;
use super::{FullStateDict, ShardPiece, ShardedStateDict, ShardedTensor, StateDict};
use crate::error::{Error, Result};
use crate::optim::{buffer_names, OptimizerState, StateSnapshot, TensorState};
use crate::tensor::{DType, Tensor};

/// One entry of `optimizer_params()`: a trainable run of unit `unit`'s chunk, or an ignored
/// module's parameter.
pub(super) enum Position {
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

pub(super) fn positions(
    metas: &[UnitMeta],
    ignored: &[(String, Vec<usize>, bool)],
) -> Vec<Position> {
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
pub(super) fn check_count(
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
pub(super) fn optim_kind(s: &StateSnapshot) -> String {
    match s {
        StateSnapshot::State(s) => s.kind.clone(),
        StateSnapshot::Tensors { kind, .. } => kind.clone(),
    }
}

/// The whole flat buffer of a unit from this rank's chunk of it (a full state dict's
/// all-gather).
pub(super) type Gather<'g> = &'g mut dyn FnMut(&Tensor) -> Result<Tensor>;

/// An optimizer state dict being assembled from an [`OptimizerState`], unit by unit (the
/// cut of each run's buffers at parameter boundaries), full or sharded.
pub(super) struct Assembly<'a> {
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
    pub(super) fn new(
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
    pub(super) fn local_steps(&self, ui: usize, m: &UnitMeta) -> Vec<i32> {
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
    pub(super) fn unit(
        &mut self,
        ui: usize,
        m: &UnitMeta,
        step_of: &[i32],
        mut gather: Option<Gather<'_>>,
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
    pub(super) fn finish(
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
    pub(super) state: StateSnapshot,
    pub(super) metas: Vec<UnitMeta>,
    pub(super) ignored: Vec<(String, Vec<usize>, bool)>,
    pub(super) param_groups: Vec<NamedParamGroup>,
    pub(super) rank: usize,
    pub(super) world_size: usize,
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
