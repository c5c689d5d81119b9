//! Where a rank is in training: its [`Pass`] (FSDP's `TrainingState`), whether a forward
//! still owes its backward, and, for the [`Fingerprint`]s of its FSDP collectives, the
//! step, the micro-batch and how many times each unit entered the pass. Every rank that
//! runs the same program computes the same fingerprints, so a rank that took another path
//! (a unit applied more often, a skipped micro-batch, a step taken earlier) fails at its
//! next collective with both calls named, instead of pairing the wrong collectives (see
//! `distributed::fingerprint`).
//!
//! Steps are counted by `zero_grad()`: the first call after a backward ends a step (a
//! training loop clears the gradients once per optimizer step, after every micro-batch of
//! it).
//!
//! # [Note: end-of-backward agreement]
//! Gathers and gradient reductions run on two streams over two communicators
//! (`streams.rs`). A rank that skips the reductions of a micro-batch (`no_sync` on that
//! rank alone) goes on to its next forward's gathers while its peers wait for it in the
//! reductions: each waits for the other on another communicator, and no two differing
//! fingerprints ever meet. So the root's `finish_backward` first runs a barrier on the
//! unshard stream whose fingerprint counts the reductions the backward issued; ranks that
//! differ fail there at once, and abort their world so that the reductions in flight end
//! too. One header-only collective per backward, when the strategy shards over more than
//! one rank.

use crate::distributed::fingerprint::{self, Fingerprint, Name, Phase};

/// What the rank's root is doing (FSDP1's and FSDP2's `TrainingState`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Pass {
    /// Between passes: optimizer steps, state dicts, checkpoints.
    #[default]
    Idle,
    /// Inside the root's forward; `grad`: activations are saved for a backward.
    Forward { grad: bool },
    /// Inside the root's backward.
    Backward,
    /// Inside `summon_full_params` (FSDP1 `SUMMON_FULL_PARAMS`): no forward or backward.
    Summoning,
}

/// The training position of one rank's FSDP units.
#[derive(Debug, Default)]
pub(super) struct Progress {
    pass: Pass,
    /// A root forward with grad enabled has run and its backward has not finished: the
    /// parameters that backward uses must not change, so state-dict loading and
    /// `summon_full_params` refuse to run (FSDP1's `FORWARD_BACKWARD`). A forward without
    /// grad in between leaves it set.
    owes_backward: bool,
    step: u32,
    micro_batch: u32,
    /// A root backward ran since the step began.
    grads_pending: bool,
    /// Gradient reductions issued by the backward under way.
    reductions: u32,
    /// Each unit's name, and how often it entered the last forward with grad, the last
    /// forward without grad, and the current backward.
    names: Vec<Name>,
    forward_calls: Vec<u32>,
    no_grad_calls: Vec<u32>,
    backward_calls: Vec<u32>,
}

impl Progress {
    /// Registers unit `id` (ids are given in order) under its module name.
    pub fn register(&mut self, id: usize, name: &str) {
        debug_assert_eq!(id, self.names.len());
        self.names.push(Name::new(name));
        self.forward_calls.push(0);
        self.no_grad_calls.push(0);
        self.backward_calls.push(0);
    }

    /// The pass under way.
    pub fn pass(&self) -> Pass {
        self.pass
    }

    /// Whether a forward with grad still waits for its backward.
    pub fn owes_backward(&self) -> bool {
        self.owes_backward
    }

    /// The root's forward begins: counts of its calls start again.
    pub fn begin_forward(&mut self, grad: bool) {
        self.pass = Pass::Forward { grad };
        self.calls_mut().iter_mut().for_each(|c| *c = 0);
    }

    /// The call counts of the pass under way.
    fn calls_mut(&mut self) -> &mut Vec<u32> {
        match self.pass {
            Pass::Forward { grad: false } => &mut self.no_grad_calls,
            Pass::Backward => &mut self.backward_calls,
            _ => &mut self.forward_calls,
        }
    }

    /// The root's forward ended; `ok` when it succeeded.
    pub fn end_forward(&mut self, ok: bool) {
        if self.pass == (Pass::Forward { grad: true }) && ok {
            self.owes_backward = true;
        }
        self.pass = Pass::Idle;
    }

    /// The root's backward begins.
    pub fn begin_backward(&mut self) {
        self.pass = Pass::Backward;
        self.reductions = 0;
        self.backward_calls.iter_mut().for_each(|c| *c = 0);
    }

    /// The root's backward ended (successfully or not): a micro-batch is done.
    pub fn end_backward(&mut self) {
        self.micro_batch += 1;
        self.grads_pending = true;
        self.owes_backward = false;
        self.pass = Pass::Idle;
    }

    /// A unit's gradient reduction was issued.
    pub fn reduced(&mut self) {
        self.reductions += 1;
    }

    /// `summon_full_params` begins (`true`) or ends.
    pub fn set_summoning(&mut self, on: bool) {
        self.pass = if on { Pass::Summoning } else { Pass::Idle };
    }

    /// Unit `id` entered the pass under way (after its gather was issued).
    pub fn entered(&mut self, id: usize) {
        if let Some(c) = self.calls_mut().get_mut(id) {
            *c += 1;
        }
    }

    /// The gradients of this step were dropped (`zero_grad`, which a training loop calls
    /// once per optimizer step): the next backward belongs to the next step.
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
            Pass::Backward => self.fingerprint(id, Phase::Backward, at(&self.backward_calls)),
            Pass::Forward { grad: true } => {
                self.fingerprint(id, Phase::Forward, at(&self.forward_calls))
            }
            Pass::Forward { grad: false } => {
                self.fingerprint(id, Phase::NoGradForward, at(&self.no_grad_calls))
            }
            Pass::Idle | Pass::Summoning => self.fingerprint(id, Phase::StateDict, 0),
        }
    }

    /// The reduction of unit `id`'s gradient (how many forward calls with grad it covers).
    pub fn reduce(&self, id: usize) -> Fingerprint {
        let calls = self.forward_calls.get(id).copied().unwrap_or(0);
        self.fingerprint(id, Phase::Reduce, calls)
    }

    /// The ranks' agreement at the end of the backward under way (root `id`): how many
    /// gradient reductions it issued.
    pub fn end_of_backward(&self, id: usize) -> Fingerprint {
        self.fingerprint(id, Phase::EndOfBackward, self.reductions)
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
        p.entered(1);
        p.entered(1);
        let g = p.gather(1);
        assert_eq!(
            (g.phase, g.call, g.step, g.micro_batch),
            (Phase::Forward, 2, 0, 0)
        );
        p.end_forward(true);
        assert!(p.owes_backward());
        // A forward without grad in between: the backward is still owed.
        p.begin_forward(false);
        p.entered(1);
        assert_eq!(p.gather(1).call, 1);
        p.end_forward(true);
        assert!(p.owes_backward());
        p.begin_backward();
        assert_eq!(p.gather(1).phase, Phase::Backward);
        assert_eq!(
            p.reduce(1).call,
            2,
            "the forward without grad is not counted"
        );
        p.end_backward();
        assert!(!p.owes_backward());
        assert_eq!(
            (p.pass(), p.gather(1).phase),
            (Pass::Idle, Phase::StateDict)
        );
        p.begin_forward(false);
        let g = p.gather(0);
        assert_eq!((g.phase, g.micro_batch), (Phase::NoGradForward, 1));
        p.end_forward(true);
        assert!(!p.owes_backward());
        p.set_summoning(true);
        assert_eq!(p.pass(), Pass::Summoning);
        p.set_summoning(false);
        p.step_boundary();
        p.step_boundary(); // a second call in the same step changes nothing
        let g = p.other(0, Phase::ClipGradNorm);
        assert_eq!((g.step, g.micro_batch), (1, 0));
    }
}
