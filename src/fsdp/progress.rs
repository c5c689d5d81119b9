//! Where a rank is in training: its [`Pass`] (FSDP's `TrainingState`, and what the step
//! holds between passes: a forward owed its backward, gradients), and, for the [`Fingerprint`]s of its FSDP collectives, the
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
//!
//! # [Note: the step's stages]
//! One enum, [`Pass`], owned by the rank's [`Progress`], says where the root is: inside
//! its forward, its backward, between the root's `post_backward` and `finish_backward`,
//! or between passes, and then what the step holds ([`Held`]: nothing, a forward owed
//! its backward, gradients for the optimizer, or both). Every rule about the order of a
//! host's calls reads it (`hooks.rs`, `order.rs`, `FullyShardedDataParallel::ready_for`):
//!
//! ```text
//!   Idle(h) --root pre_forward--> Forward{h} --root post_forward--> Idle(h + forward, if grad)
//!   Idle(h) --root pre_backward--> Backward --root post_backward--> BackwardEnded
//!   BackwardEnded --finish_backward--> Idle(Grads)      zero_grad: Idle(h) -> Idle(h - grads)
//! ```
//!
//! An optimizer step is taken in `Idle(Grads)` only; `finish_backward` only in
//! `BackwardEnded`; a new forward or backward never in `Backward` or `BackwardEnded` (the
//! last backward's reductions would be carried into the next step). Gradient
//! accumulation is several `Backward -> BackwardEnded -> Idle(Grads)` rounds before one
//! step.

use crate::distributed::fingerprint::{self, Fingerprint, Name, Phase};

/// What the step holds between passes (since the last `zero_grad`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Held {
    /// Nothing: no gradient, no forward owed its backward.
    #[default]
    Nothing,
    /// A forward with grad ran and its backward has not: the parameters that backward
    /// uses must not change (FSDP1's `FORWARD_BACKWARD`).
    Forward,
    /// Gradients of finished backwards, for the optimizer.
    Grads,
    /// Gradients of finished backwards, and a further forward owed its backward (the
    /// next micro-batch of gradient accumulation).
    GradsAndForward,
}

impl Held {
    /// Whether a forward with grad still waits for its backward.
    pub fn owes_backward(self) -> bool {
        matches!(self, Held::Forward | Held::GradsAndForward)
    }

    /// Whether gradients of a finished backward are held.
    pub fn has_grads(self) -> bool {
        matches!(self, Held::Grads | Held::GradsAndForward)
    }

    fn with(owes_backward: bool, grads: bool) -> Held {
        match (owes_backward, grads) {
            (false, false) => Held::Nothing,
            (true, false) => Held::Forward,
            (false, true) => Held::Grads,
            (true, true) => Held::GradsAndForward,
        }
    }
}

/// What the rank's root is doing (FSDP1's and FSDP2's `TrainingState`), and what the step
/// holds between passes. See [Note: the step's stages].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// Between passes: optimizer steps, state dicts, checkpoints.
    Idle(Held),
    /// Inside the root's forward; `grad`: activations are saved for a backward; `held`:
    /// what the step held before it.
    Forward { grad: bool, held: Held },
    /// From the root's `pre_backward` to its `post_backward`; `held` as before it (what a
    /// failed root `pre_backward` returns to).
    Backward { held: Held },
    /// From the root's `post_backward` to `finish_backward`: every reduction is issued,
    /// none yet waited for or added to the sharded gradients.
    BackwardEnded,
    /// Inside `summon_full_params` (FSDP1 `SUMMON_FULL_PARAMS`): no forward or backward.
    Summoning(Held),
}

impl Default for Pass {
    fn default() -> Pass {
        Pass::Idle(Held::Nothing)
    }
}

/// The training position of one rank's FSDP units.
#[derive(Debug, Default)]
pub(super) struct Progress {
    pass: Pass,
    step: u32,
    micro_batch: u32,
    /// Gradient reductions issued by the backward under way.
    reductions: u32,
    /// Why the gradients held since the last `zero_grad` are incomplete (a unit's backward
    /// or `finish_backward` failed): no optimizer step may use them until `zero_grad`.
    incomplete: Option<String>,
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

    /// Whether the parameters must not change now: a forward with grad still waits for its
    /// backward, or a backward has not finished. A forward without grad in between leaves
    /// it as it was.
    pub fn owes_backward(&self) -> bool {
        match self.pass {
            Pass::Idle(h) | Pass::Summoning(h) | Pass::Forward { held: h, .. } => h.owes_backward(),
            Pass::Backward { .. } | Pass::BackwardEnded => true,
        }
    }

    /// The root's forward begins (from between passes): counts of its calls start again.
    pub fn begin_forward(&mut self, grad: bool) {
        let held = self.held();
        self.pass = Pass::Forward { grad, held };
        self.calls_mut().iter_mut().for_each(|c| *c = 0);
    }

    /// What the step holds (as before the pass under way).
    fn held(&self) -> Held {
        match self.pass {
            Pass::Idle(h)
            | Pass::Summoning(h)
            | Pass::Forward { held: h, .. }
            | Pass::Backward { held: h } => h,
            Pass::BackwardEnded => Held::Grads,
        }
    }

    /// The call counts of the pass under way.
    fn calls_mut(&mut self) -> &mut Vec<u32> {
        match self.pass {
            Pass::Forward { grad: false, .. } => &mut self.no_grad_calls,
            Pass::Backward { .. } | Pass::BackwardEnded => &mut self.backward_calls,
            _ => &mut self.forward_calls,
        }
    }

    /// The root's forward ended; `ok` when it succeeded.
    pub fn end_forward(&mut self, ok: bool) {
        if let Pass::Forward { grad, held } = self.pass {
            let owes = held.owes_backward() || (grad && ok);
            self.pass = Pass::Idle(Held::with(owes, held.has_grads()));
        }
    }

    /// The root's backward begins.
    pub fn begin_backward(&mut self) {
        self.pass = Pass::Backward { held: self.held() };
        self.reductions = 0;
        self.backward_calls.iter_mut().for_each(|c| *c = 0);
    }

    /// The root's `pre_backward` failed: back to what the step held before it.
    pub fn abort_backward(&mut self) {
        if let Pass::Backward { held } = self.pass {
            self.pass = Pass::Idle(held);
        }
    }

    /// The root's `post_backward` ran: the backward waits for `finish_backward`.
    pub fn root_backward_done(&mut self) {
        self.pass = Pass::BackwardEnded;
    }

    /// The backward finished: a micro-batch is done, its gradients are held for the
    /// optimizer; `failed`: why it did not succeed (the gradients are then incomplete, see
    /// [`mark_incomplete`](Self::mark_incomplete)).
    pub fn end_backward(&mut self, failed: Option<String>) {
        if let Some(why) = failed {
            self.mark_incomplete(why);
        }
        self.micro_batch += 1;
        self.pass = Pass::Idle(Held::Grads);
    }

    /// The gradients of this step are incomplete (`why`: what failed); the first reason
    /// is kept until `zero_grad`.
    pub fn mark_incomplete(&mut self, why: String) {
        self.incomplete.get_or_insert(why);
    }

    /// Why the gradients held are incomplete, if they are.
    pub fn incomplete(&self) -> Option<&str> {
        self.incomplete.as_deref()
    }

    /// A unit's gradient reduction was issued.
    pub fn reduced(&mut self) {
        self.reductions += 1;
    }

    /// `summon_full_params` begins (`true`) or ends.
    pub fn set_summoning(&mut self, on: bool) {
        let held = self.held();
        self.pass = if on {
            Pass::Summoning(held)
        } else {
            Pass::Idle(held)
        };
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
        let without = |h: Held| Held::with(h.owes_backward(), false);
        self.incomplete = None;
        let h = self.held();
        if !h.has_grads() {
            return;
        }
        self.step += 1;
        self.micro_batch = 0;
        self.pass = match self.pass {
            Pass::Idle(h) => Pass::Idle(without(h)),
            Pass::Summoning(h) => Pass::Summoning(without(h)),
            Pass::Forward { grad, held } => Pass::Forward {
                grad,
                held: without(held),
            },
            Pass::Backward { held } => Pass::Backward {
                held: without(held),
            },
            p @ Pass::BackwardEnded => p,
        };
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
            Pass::Backward { .. } | Pass::BackwardEnded => {
                self.fingerprint(id, Phase::Backward, at(&self.backward_calls))
            }
            Pass::Forward { grad: true, .. } => {
                self.fingerprint(id, Phase::Forward, at(&self.forward_calls))
            }
            Pass::Forward { grad: false, .. } => {
                self.fingerprint(id, Phase::NoGradForward, at(&self.no_grad_calls))
            }
            Pass::Idle(_) | Pass::Summoning(_) => self.fingerprint(id, Phase::StateDict, 0),
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
        assert!(p.owes_backward(), "an unfinished backward still owes");
        p.root_backward_done();
        assert_eq!(p.pass(), Pass::BackwardEnded);
        p.end_backward(None);
        assert!(!p.owes_backward());
        assert_eq!(
            (p.pass(), p.gather(1).phase),
            (Pass::Idle(Held::Grads), Phase::StateDict)
        );
        p.begin_forward(false);
        let g = p.gather(0);
        assert_eq!((g.phase, g.micro_batch), (Phase::NoGradForward, 1));
        p.end_forward(true);
        assert!(!p.owes_backward());
        p.set_summoning(true);
        assert_eq!(p.pass(), Pass::Summoning(Held::Grads));
        p.set_summoning(false);
        // The next micro-batch's forward, then zero_grad before its backward (PyTorch's
        // `out = model(x); opt.zero_grad(); loss.backward()`): the forward stays owed.
        p.begin_forward(true);
        p.end_forward(true);
        assert_eq!(p.pass(), Pass::Idle(Held::GradsAndForward));
        p.step_boundary();
        assert_eq!(p.pass(), Pass::Idle(Held::Forward));
        // A failed root pre_backward returns to what the step held.
        p.begin_backward();
        p.abort_backward();
        assert_eq!(p.pass(), Pass::Idle(Held::Forward));
        p.step_boundary(); // a second call in the same step changes nothing
        let g = p.other(0, Phase::ClipGradNorm);
        assert_eq!((g.step, g.micro_batch), (1, 0));
    }
}
