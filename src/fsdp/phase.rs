//! The unit's hook phase: which of its hooks are open, with the data that only exists
//! while they are (FSDP1's `HandleTrainingState`, defined in
//! `torch/distributed/fsdp/_common_utils.py` and moved through by the hooks of
//! `_runtime_utils.py`). The gathered parameters have their own machine, `ParamState` in
//! `scheduler.rs`; the rank's position in the step (FSDP1's `TrainingState`) is
//! `progress::Pass`.
//!
//! ```text
//! Each edge: the call that goes right or down / the call that comes back (-> what it
//! returns).
//!
//!                 pre_forward(grad) / post_forward -> grad
//!   Idle  <------------------------------------------------>  Forward { grad }
//!    ^                                                              ^
//!    | pre_backward(b) /                          pre_backward(b) / |
//!    | post_backward -> b                      post_backward -> b   |
//!    v                                                              v
//!   Backward {       pre_forward(grad) / post_forward -> grad    Backward {
//!     open: b,  <------------------------------------------->      open: b,
//!     forward: None }                                              forward: Some(grad) }
//!
//! grad_views: legal in both Backward states, no change.
//! Refused, the phase unchanged:
//!   pre_forward   while a forward is open  ("pre_forward ... without its post_forward")
//!   post_forward  while none is            ("post_forward ... without pre_forward")
//!   pre_backward  in either Backward state ("pre_backward ... without its post_backward")
//!   post_backward, grad_views in Idle or Forward ("... without pre_backward")
//! ```
//!
//! PyTorch's states against these:
//!
//! | `HandleTrainingState` | here |
//! |---|---|
//! | `IDLE` | `Idle` |
//! | `FORWARD` | `Forward { grad }` (`grad`: whether the forward saves activations) |
//! | `BACKWARD_PRE` | `Backward { open, .. }`: `open` is the flat gradient the backward adds into and the unit it reaches next |
//! | `BACKWARD_POST` | `Idle` again, the reduction issued by `post_backward` in flight in the unit's `pending_grad` until the root's `finish_backward` (it outlives a recomputing forward and backward of the same unit, so it is no phase's data) |
//! | `SUMMON_FULL_PARAMS` | the rank's `Pass::Summoning` (`summon_full_params` gathers every unit at once) |
//!
//! The unit's other per-pass fields are no phase's data: `sync_grads` is a mode
//! (`no_sync`) that holds across many passes, and `input_cast` is what a `Module` forward
//! saves for its backward, across the `Idle` between them.
//!
//! A forward opened inside the unit's own backward (`Backward { forward: Some(_) }`, or
//! `pre_backward` inside an open forward) is a host recomputing the unit's activations
//! between its backward hooks; only a nested unit inside the root's backward gets there
//! (`order.rs` refuses it elsewhere), and the two hooks then close independently.
//!
//! Each transition checks its source phase and returns the error the call order earns;
//! [`UnitPhase::refuse`] is that check alone, so that a hook can refuse a call before it
//! does anything and move the phase once its work is done.

use crate::error::{Error, Result, Term};
use crate::tensor::Tensor;

/// A unit's hook phase (see the module's diagram).
pub(super) enum UnitPhase {
    /// No hook open.
    Idle,
    /// Between `pre_forward` and `post_forward`; `grad`: the forward saves activations
    /// for a backward (false is `torch.no_grad()`).
    Forward { grad: bool },
    /// Between `pre_backward` and `post_backward`, with the flat gradient the backward
    /// adds into; `forward`: a forward opened inside it (its `grad`), until its
    /// `post_forward`.
    Backward {
        open: InBackward,
        forward: Option<bool>,
    },
}

/// What a unit's backward holds between `pre_backward` and `post_backward`: the unit
/// backward reaches next (for `BackwardPost` prefetch) and the flat gradient its
/// parameters' grads view.
pub(super) struct InBackward {
    pub next: Option<(usize, usize)>,
    pub flat_grad: Tensor,
}

/// A call that moves (or reads) the phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Hook {
    PreForward,
    PostForward,
    PreBackward,
    PostBackward,
    GradViews,
}

impl UnitPhase {
    /// Whether a forward is open (`Forward`, or one opened inside a backward).
    pub fn in_forward(&self) -> bool {
        matches!(
            self,
            UnitPhase::Forward { .. }
                | UnitPhase::Backward {
                    forward: Some(_),
                    ..
                }
        )
    }

    /// Whether a backward is open.
    pub fn in_backward(&self) -> bool {
        matches!(self, UnitPhase::Backward { .. })
    }

    /// Whether `hook` may run in this phase (the transition table's legal half).
    pub fn allows(&self, hook: Hook) -> bool {
        match hook {
            Hook::PreForward => !self.in_forward(),
            Hook::PostForward => self.in_forward(),
            Hook::PreBackward => !self.in_backward(),
            Hook::PostBackward | Hook::GradViews => self.in_backward(),
        }
    }

    /// The error `hook` earns in this phase, `Ok` when it may run; `unit` names the unit
    /// (its module's name). Nothing changes.
    ///
    /// # Errors
    /// `Fsdp` naming the call, the unit and the hook it lacks.
    pub fn refuse(&self, hook: Hook, unit: &str) -> Result<()> {
        match self.allows(hook) {
            true => Ok(()),
            false => Err(hook.out_of_order(unit)),
        }
    }

    /// `pre_forward(grad)`: `Idle -> Forward`, or opens a forward inside a backward.
    ///
    /// # Errors
    /// As [`refuse`](Self::refuse), the phase unchanged.
    pub fn pre_forward(&mut self, grad: bool, unit: &str) -> Result<()> {
        self.refuse(Hook::PreForward, unit)?;
        match self {
            UnitPhase::Backward { forward, .. } => *forward = Some(grad),
            _ => *self = UnitPhase::Forward { grad },
        }
        Ok(())
    }

    /// `post_forward`: closes the open forward and returns its `grad`.
    ///
    /// # Errors
    /// As [`refuse`](Self::refuse), the phase unchanged.
    pub fn post_forward(&mut self, unit: &str) -> Result<bool> {
        self.close_forward()
            .ok_or_else(|| Hook::PostForward.out_of_order(unit))
    }

    /// Closes the open forward, if any, and returns its `grad` (`None`: none was open).
    /// How a failed root forward ends the nested units' forwards.
    pub fn close_forward(&mut self) -> Option<bool> {
        match self {
            UnitPhase::Forward { grad } => {
                let grad = *grad;
                *self = UnitPhase::Idle;
                Some(grad)
            }
            UnitPhase::Backward { forward, .. } => forward.take(),
            UnitPhase::Idle => None,
        }
    }

    /// `pre_backward`, once its gradient buffer `open` is ready: opens the backward (an
    /// open forward stays open inside it).
    ///
    /// # Errors
    /// As [`refuse`](Self::refuse), the phase unchanged.
    pub fn pre_backward(&mut self, open: InBackward, unit: &str) -> Result<()> {
        self.refuse(Hook::PreBackward, unit)?;
        let forward = match self {
            UnitPhase::Forward { grad } => Some(*grad),
            _ => None,
        };
        *self = UnitPhase::Backward { open, forward };
        Ok(())
    }

    /// `post_backward`: closes the backward and returns what it held; a forward opened
    /// inside it stays open.
    ///
    /// # Errors
    /// As [`refuse`](Self::refuse), the phase unchanged.
    pub fn post_backward(&mut self, unit: &str) -> Result<InBackward> {
        match std::mem::replace(self, UnitPhase::Idle) {
            UnitPhase::Backward { open, forward } => {
                if let Some(grad) = forward {
                    *self = UnitPhase::Forward { grad };
                }
                Ok(open)
            }
            other => {
                *self = other;
                Err(Hook::PostBackward.out_of_order(unit))
            }
        }
    }
}

impl Hook {
    /// The error of this call on `unit` in a phase that does not allow it: the hook it
    /// lacks first, and the order of a unit's hooks.
    fn out_of_order(self, unit: &str) -> Error {
        let (call, needs) = match self {
            Hook::PreForward => (Term::PreForward, format!("its {}", Term::PostForward)),
            Hook::PostForward => (Term::PostForward, Term::PreForward.to_string()),
            Hook::PreBackward => (Term::PreBackward, format!("its {}", Term::PostBackward)),
            Hook::PostBackward => (Term::PostBackward, Term::PreBackward.to_string()),
            Hook::GradViews => (Term::GradViews, Term::PreBackward.to_string()),
        };
        Error::Fsdp(format!(
            "{call} on unit '{unit}' without {needs} first: each unit's hooks go {}, {}, then {}, {}",
            Term::PreForward,
            Term::PostForward,
            Term::PreBackward,
            Term::PostBackward
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{Hook, InBackward, UnitPhase};
    use crate::error::Api;
    use crate::tensor::{DType, Tensor};

    const ORDER: &str =
        "each unit's hooks go pre_forward, post_forward, then pre_backward, post_backward";

    fn open(n: usize) -> InBackward {
        InBackward {
            next: Some((n, n + 1)),
            flat_grad: Tensor::zeros(&[n], DType::F32),
        }
    }

    /// The four phases, by name: `(name, phase)`.
    fn phases() -> Vec<(&'static str, UnitPhase)> {
        vec![
            ("idle", UnitPhase::Idle),
            ("forward", UnitPhase::Forward { grad: true }),
            (
                "backward",
                UnitPhase::Backward {
                    open: open(3),
                    forward: None,
                },
            ),
            (
                "backward+forward",
                UnitPhase::Backward {
                    open: open(3),
                    forward: Some(false),
                },
            ),
        ]
    }

    /// `(in_forward, in_backward, flat gradient length, the Backward's forward)`.
    fn shape(p: &UnitPhase) -> (bool, bool, Option<usize>, Option<bool>) {
        let (len, fwd) = match p {
            UnitPhase::Backward { open, forward } => (Some(open.flat_grad.numel()), *forward),
            UnitPhase::Forward { grad } => (None, Some(*grad)),
            UnitPhase::Idle => (None, None),
        };
        (p.in_forward(), p.in_backward(), len, fwd)
    }

    #[test]
    fn every_legal_transition_moves_to_its_phase_and_returns_its_data() {
        // pre_forward: Idle -> Forward; Backward -> Backward with a forward open.
        let mut p = UnitPhase::Idle;
        p.pre_forward(false, "u").unwrap();
        assert_eq!(shape(&p), (true, false, None, Some(false)));
        let mut p = UnitPhase::Backward {
            open: open(2),
            forward: None,
        };
        p.pre_forward(true, "u").unwrap();
        assert_eq!(shape(&p), (true, true, Some(2), Some(true)));
        // post_forward: Forward -> Idle; Backward+forward -> Backward; returns grad.
        let mut p = UnitPhase::Forward { grad: true };
        assert!(p.post_forward("u").unwrap());
        assert_eq!(shape(&p), (false, false, None, None));
        let mut p = UnitPhase::Backward {
            open: open(2),
            forward: Some(false),
        };
        assert!(!p.post_forward("u").unwrap());
        assert_eq!(shape(&p), (false, true, Some(2), None));
        // pre_backward: Idle -> Backward; Forward -> Backward with the forward kept open.
        let mut p = UnitPhase::Idle;
        p.pre_backward(open(4), "u").unwrap();
        assert_eq!(shape(&p), (false, true, Some(4), None));
        let mut p = UnitPhase::Forward { grad: false };
        p.pre_backward(open(4), "u").unwrap();
        assert_eq!(shape(&p), (true, true, Some(4), Some(false)));
        // post_backward: Backward -> Idle; Backward+forward -> Forward; returns the
        // backward's data.
        let mut p = UnitPhase::Backward {
            open: open(5),
            forward: None,
        };
        let b = p.post_backward("u").unwrap();
        assert_eq!((b.next, b.flat_grad.numel()), (Some((5, 6)), 5));
        assert_eq!(shape(&p), (false, false, None, None));
        let mut p = UnitPhase::Backward {
            open: open(5),
            forward: Some(true),
        };
        assert_eq!(p.post_backward("u").unwrap().flat_grad.numel(), 5);
        assert_eq!(shape(&p), (true, false, None, Some(true)));
        // grad_views: in either Backward.
        for (name, p) in phases().into_iter().skip(2) {
            assert!(p.refuse(Hook::GradViews, "u").is_ok(), "{name}");
        }
        // close_forward: the open forward's grad, or None.
        for (name, mut p) in phases() {
            let want = match name {
                "forward" => Some(true),
                "backward+forward" => Some(false),
                _ => None,
            };
            assert_eq!(p.close_forward(), want, "{name}");
            assert!(!p.in_forward(), "{name}");
        }
    }

    #[test]
    fn every_illegal_transition_returns_its_error_and_leaves_the_phase() {
        let errors = [
            (
                Hook::PreForward,
                "pre_forward on unit 'u' without its post_forward first",
            ),
            (
                Hook::PostForward,
                "post_forward on unit 'u' without pre_forward first",
            ),
            (
                Hook::PreBackward,
                "pre_backward on unit 'u' without its post_backward first",
            ),
            (
                Hook::PostBackward,
                "post_backward on unit 'u' without pre_backward first",
            ),
            (
                Hook::GradViews,
                "grad_views on unit 'u' without pre_backward first",
            ),
        ];
        // (phase, hook) pairs that are refused: the complement of the legal table above.
        let refused = |name: &str, hook: Hook| match hook {
            Hook::PreForward => matches!(name, "forward" | "backward+forward"),
            Hook::PostForward => matches!(name, "idle" | "backward"),
            Hook::PreBackward => matches!(name, "backward" | "backward+forward"),
            Hook::PostBackward | Hook::GradViews => matches!(name, "idle" | "forward"),
        };
        let mut seen = 0;
        for (hook, message) in errors {
            for (name, mut p) in phases() {
                let before = shape(&p);
                let want = format!("fsdp: {message}: {ORDER}");
                let got = match hook {
                    Hook::PreForward => p.pre_forward(true, "u").err(),
                    Hook::PostForward => p.post_forward("u").err(),
                    Hook::PreBackward => p.pre_backward(open(7), "u").err(),
                    Hook::PostBackward => p.post_backward("u").err(),
                    Hook::GradViews => p.refuse(hook, "u").err(),
                };
                if refused(name, hook) {
                    seen += 1;
                    let e = got.unwrap_or_else(|| panic!("{hook:?} in {name} was let through"));
                    assert_eq!(e.to_string(), want, "{hook:?} in {name}");
                    assert_eq!(p.refuse(hook, "u").unwrap_err().to_string(), want);
                    assert_eq!(shape(&p), before, "{hook:?} in {name} moved the phase");
                } else {
                    assert!(got.is_none(), "{hook:?} in {name}: {got:?}");
                }
            }
        }
        assert_eq!(seen, 10);
    }

    #[test]
    fn refusals_name_the_calls_of_the_callers_api() {
        let _c = Api::C.enter();
        let e = UnitPhase::Idle.refuse(Hook::PostBackward, "1").unwrap_err();
        assert!(
            e.to_string().contains(
                "fsdp_unit_post_backward on unit '1' without fsdp_unit_pre_backward first"
            ),
            "{e}"
        );
    }
}
