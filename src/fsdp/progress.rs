//! Where a rank is in training, as the [`Fingerprint`]s of its FSDP collectives say it:
//! the step, the micro-batch, the pass (forward, backward) and how many times each unit
//! entered it. Every rank that runs the same program computes the same fingerprints, so a
//! rank that took another path (a unit applied more often, a skipped micro-batch, a step
//! taken earlier) fails at its next collective with both calls named, instead of pairing
//! the wrong collectives (see `distributed::fingerprint`).
//!
//! Steps are counted from what FSDP sees of the optimizer: the first `optimizer_params()`
//! or `zero_grad()` after a backward ends a step (PyTorch's loop calls both once per step,
//! and a gradient-accumulation loop calls them once per K micro-batches).

use crate::distributed::fingerprint::{self, Fingerprint, Name, Phase};

/// The training position of one rank's FSDP units.
#[derive(Debug, Default)]
pub(super) struct Progress {
    step: u32,
    micro_batch: u32,
    /// A root backward ran since the step began.
    grads_pending: bool,
    /// The root pass under way: `Forward`/`NoGradForward` during the root's forward,
    /// `Backward` during its backward, `None` between them (state dicts, summoning).
    pass: Option<Phase>,
    /// Each unit's name, and how often it entered forward and backward in the current pass.
    names: Vec<Name>,
    forward_calls: Vec<u32>,
    backward_calls: Vec<u32>,
}

impl Progress {
    /// Registers unit `id` (ids are given in order) under its module name.
    pub fn register(&mut self, id: usize, name: &str) {
        debug_assert_eq!(id, self.names.len());
        self.names.push(Name::new(name));
        self.forward_calls.push(0);
        self.backward_calls.push(0);
    }

    /// The root's forward begins: counts of forward calls start again.
    pub fn begin_forward(&mut self, grad_enabled: bool) {
        self.pass = Some(if grad_enabled {
            Phase::Forward
        } else {
            Phase::NoGradForward
        });
        self.forward_calls.iter_mut().for_each(|c| *c = 0);
    }

    /// The root's backward begins.
    pub fn begin_backward(&mut self) {
        self.pass = Some(Phase::Backward);
        self.backward_calls.iter_mut().for_each(|c| *c = 0);
    }

    /// The root's pass ended; `backward` says it was a backward (a micro-batch is done).
    pub fn end_pass(&mut self, backward: bool) {
        if backward {
            self.micro_batch += 1;
            self.grads_pending = true;
        }
        self.pass = None;
    }

    /// Unit `id` entered forward (after its gather was issued).
    pub fn entered_forward(&mut self, id: usize) {
        if let Some(c) = self.forward_calls.get_mut(id) {
            *c += 1;
        }
    }

    /// Unit `id` entered backward (after its gather was issued).
    pub fn entered_backward(&mut self, id: usize) {
        if let Some(c) = self.backward_calls.get_mut(id) {
            *c += 1;
        }
    }

    /// The gradients of this step were handed to the optimizer or dropped: the next
    /// backward belongs to the next step.
    pub fn step_boundary(&mut self) {
        if self.grads_pending {
            self.step += 1;
            self.micro_batch = 0;
            self.grads_pending = false;
        }
    }

    fn fingerprint(&self, id: usize, phase: Phase, call: u32) -> Fingerprint {
        Fingerprint {
            unit: self.names.get(id).copied().unwrap_or(Name(0)),
            phase,
            step: self.step,
            micro_batch: self.micro_batch,
            call,
        }
    }

    /// The all-gather of unit `id` for its next entry into the current pass (a state-dict
    /// gather between passes).
    pub fn gather(&self, id: usize) -> Fingerprint {
        let at = |v: &[u32]| v.get(id).copied().unwrap_or(0);
        match self.pass {
            Some(Phase::Backward) => {
                self.fingerprint(id, Phase::Backward, at(&self.backward_calls))
            }
            Some(p) => self.fingerprint(id, p, at(&self.forward_calls)),
            None => self.fingerprint(id, Phase::StateDict, 0),
        }
    }

    /// The reduction of unit `id`'s gradient (how many forward calls it covers).
    pub fn reduce(&self, id: usize) -> Fingerprint {
        let calls = self.forward_calls.get(id).copied().unwrap_or(0);
        self.fingerprint(id, Phase::Reduce, calls)
    }

    /// A collective of unit `id` outside the passes (`Init`, `ClipGradNorm`, `StateDict`).
    pub fn other(&self, id: usize, phase: Phase) -> Fingerprint {
        self.fingerprint(id, phase, 0)
    }
}

/// Until the guard drops, this thread's collectives (and the stream jobs it submits) carry
/// `fp`.
pub(super) fn enter(fp: Fingerprint) -> fingerprint::Entered {
    fingerprint::enter(Some(fp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_micro_batches_and_calls_follow_the_passes() {
        let mut p = Progress::default();
        p.register(0, "");
        p.register(1, "head");
        p.step_boundary(); // nothing ran yet: still step 0
        p.begin_forward(true);
        assert_eq!(p.gather(1).call, 0);
        p.entered_forward(1);
        p.entered_forward(1);
        let g = p.gather(1);
        assert_eq!(
            (g.phase, g.call, g.step, g.micro_batch),
            (Phase::Forward, 2, 0, 0)
        );
        p.end_pass(false);
        p.begin_backward();
        assert_eq!(p.gather(1).phase, Phase::Backward);
        assert_eq!(p.reduce(1).call, 2);
        p.end_pass(true);
        assert_eq!(p.gather(1).phase, Phase::StateDict);
        p.begin_forward(false);
        let g = p.gather(0);
        assert_eq!((g.phase, g.micro_batch), (Phase::NoGradForward, 1));
        p.end_pass(false);
        p.step_boundary();
        p.step_boundary(); // a second call in the same step changes nothing
        let g = p.other(0, Phase::ClipGradNorm);
        assert_eq!((g.step, g.micro_batch), (1, 0));
    }
}
