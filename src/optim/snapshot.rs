//! A copy of an optimizer's state taken quickly, converted later (for a background
//! checkpoint, `torch.distributed.checkpoint.async_save`'s staging): the training thread
//! copies the state tensors as they are ([`Optimizer::snapshot`](super::Optimizer::snapshot)),
//! and another thread converts them into the [`OptimizerState`] that
//! [`Optimizer::state_dict`](super::Optimizer::state_dict) returns
//! ([`StateSnapshot::into_state`]), with the same values.

use super::{OptimizerState, ParamGroup, TensorState};
use crate::error::Result;
use crate::tensor::Tensor;

/// One tensor's state in a [`StateSnapshot`]: its step and its buffers as tensors of
/// their own (f32, or f64 for an f64 parameter), by name.
#[derive(Debug)]
pub struct TensorSnapshot {
    /// As [`TensorState::step`].
    pub step: Option<u64>,
    /// `(buffer name, values)`: copies nothing else changes.
    pub buffers: Vec<(&'static str, Tensor)>,
}

/// An optimizer's state as [`Optimizer::snapshot`](super::Optimizer::snapshot) took it.
#[derive(Debug)]
pub enum StateSnapshot {
    /// Converted already (the default `snapshot`: [`state_dict`](super::Optimizer::state_dict)).
    State(OptimizerState),
    /// The state tensors, copied, with what [`OptimizerState`] holds besides them.
    Tensors {
        /// As [`OptimizerState::kind`].
        kind: String,
        /// As [`OptimizerState::hyperparams`].
        hyperparams: Vec<(String, f64)>,
        /// As [`OptimizerState::tensors`], before conversion.
        tensors: Vec<Option<TensorSnapshot>>,
        /// As [`OptimizerState::param_groups`].
        param_groups: Vec<ParamGroup>,
    },
}

impl StateSnapshot {
    /// Entries of the state's tensor list (as `OptimizerState::tensors.len()`).
    pub fn tensor_count(&self) -> usize {
        match self {
            StateSnapshot::State(s) => s.tensors.len(),
            StateSnapshot::Tensors { tensors, .. } => tensors.len(),
        }
    }

    /// The parameter groups by position (as [`OptimizerState::param_groups`]).
    pub fn param_groups(&self) -> &[ParamGroup] {
        match self {
            StateSnapshot::State(s) => &s.param_groups,
            StateSnapshot::Tensors { param_groups, .. } => param_groups,
        }
    }

    /// The [`OptimizerState`] of the snapshot: buffers as host vectors (an f64 buffer both
    /// exactly and rounded, as [`Optimizer::state_dict`](super::Optimizer::state_dict)
    /// gives them). The snapshot's tensors are pushed onto `reuse` afterwards.
    ///
    /// # Errors
    /// A failed read of a tensor (CUDA copy).
    pub fn into_state(self, reuse: &mut Vec<Tensor>) -> Result<OptimizerState> {
        let (kind, hyperparams, tensors, param_groups) = match self {
            StateSnapshot::State(s) => return Ok(s),
            StateSnapshot::Tensors {
                kind,
                hyperparams,
                tensors,
                param_groups,
            } => (kind, hyperparams, tensors, param_groups),
        };
        let mut out = Vec::with_capacity(tensors.len());
        for t in tensors {
            out.push(match t {
                Some(t) => {
                    let bufs: Vec<(&str, &Tensor)> =
                        t.buffers.iter().map(|(n, b)| (*n, b)).collect();
                    let st = TensorState::from_tensors(t.step, &bufs)?;
                    reuse.extend(t.buffers.into_iter().map(|(_, b)| b));
                    Some(st)
                }
                None => None,
            });
        }
        Ok(OptimizerState {
            kind,
            hyperparams,
            tensors: out,
            param_groups,
        })
    }
}
