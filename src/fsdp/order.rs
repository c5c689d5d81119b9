//! The order of a host's calls: which hook, step or `zero_grad` may run at which stage of
//! the root's [`Pass`] (see [Note: the step's stages] in `progress.rs`). Every refusal is
//! an `Fsdp` error that names the call, what was expected instead, and what skipping it
//! would have done, in the caller's API ([`Term`]: `finish_backward` in Rust,
//! `fsdp_model_finish_backward` through the C ABI). The hooks in `hooks.rs` check here
//! before they change anything, so a refused call leaves the model as it was.
//!
//! The root's hooks enclose every nested unit's: the root's `pre_forward` first and its
//! `post_forward` last, its `pre_backward` first and its `post_backward` last, then
//! `finish_backward` once. A nested unit may enter its forward again inside the backward
//! (recomputation), never after the root's `post_backward` until `finish_backward`.

use super::progress::{Held, Pass};
use super::FullyShardedDataParallel;
use crate::error::{Error, Result, Term};

impl FullyShardedDataParallel {
    /// Whether `hook` of this unit may run at the root's current stage.
    ///
    /// # Errors
    /// `Fsdp` naming what was expected instead.
    pub(super) fn check_order(&self, hook: Term) -> Result<()> {
        let pass = self.rs.sched.lock().progress.pass();
        let unit = self.module_name();
        let (root, nested) = (self.is_root, !self.is_root);
        match (hook, pass) {
            (Term::PreForward | Term::PreBackward, Pass::BackwardEnded) => Err(Error::Fsdp(format!(
                "{hook} on unit '{unit}' before {}: {}",
                Term::FinishBackward,
                unfinished()
            ))),
            (Term::PreForward, Pass::Backward { .. }) if root => Err(Error::Fsdp(format!(
                "{hook} on the root inside an unfinished backward: end it first (the root's {}, then {})",
                Term::PostBackward,
                Term::FinishBackward
            ))),
            (Term::PreBackward, Pass::Forward { .. }) => Err(Error::Fsdp(format!(
                "{hook} on unit '{unit}' inside the root's forward: the root's {} ends the forward first",
                Term::PostForward
            ))),
            (Term::PreBackward, Pass::Idle(h) | Pass::Summoning(h)) if root && !h.owes_backward() => {
                // No forward with grad since the last backward: nothing saved to go back
                // through (a forward without grad saves nothing).
                Err(Error::NoSavedForward { module: "FSDP root" })
            }
            (Term::PreForward, Pass::Idle(_) | Pass::Summoning(_)) if nested => {
                Err(Error::Fsdp(format!(
                    "{hook} on unit '{unit}' outside the root's forward: the root's {hook} comes first and its {} last, with every other unit's forward hooks in between (inside a backward a unit's forward may run again, to recompute)",
                    Term::PostForward
                )))
            }
            (Term::PreBackward, Pass::Idle(_) | Pass::Summoning(_)) if nested => {
                Err(Error::Fsdp(format!(
                    "{hook} on unit '{unit}' outside the root's backward: the root's {hook} comes first and its {} last, with every other unit's backward hooks in between",
                    Term::PostBackward
                )))
            }
            (Term::FinishBackward, Pass::BackwardEnded) => Ok(()),
            (Term::FinishBackward, Pass::Backward { .. }) => Err(Error::Fsdp(format!(
                "{hook} before the root's {}: the backward is still running; end every unit's backward, the root's last, then call {hook}",
                Term::PostBackward
            ))),
            (Term::FinishBackward, _) => Err(Error::Fsdp(format!(
                "{hook} without a backward: it ends the backward the root's {} began, once, after the root's {}",
                Term::PreBackward,
                Term::PostBackward
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses the root's `post_forward` (`backward` false) or `post_backward` (true) while
    /// a nested unit is still between its own pre and post hook: the root's hooks enclose
    /// every other unit's.
    ///
    /// # Errors
    /// `Fsdp` naming the unit.
    pub(super) fn check_nested_done(&mut self, backward: bool) -> Result<()> {
        let mut busy = Vec::new();
        self.each_unit(|u| {
            let inside = match backward {
                true => u.phase.in_backward(),
                false => u.phase.in_forward(),
            };
            if !u.is_root && inside {
                busy.push(format!("'{}'", u.module_name()));
            }
        });
        if busy.is_empty() {
            return Ok(());
        }
        let (hook, post) = match backward {
            true => (Term::PostBackward, Term::PostBackward),
            false => (Term::PostForward, Term::PostForward),
        };
        Err(Error::Fsdp(format!(
            "{hook} on the root while unit(s) {} are still inside: call {post} on them first (the root's comes last)",
            busy.join(", ")
        )))
    }

    /// The root's forward failed, so no backward follows: every nested unit's forward ends
    /// (one the failure cut short between its hooks included) and the units that keep
    /// their parameters gathered for the backward (ShardGradOp) free them. Otherwise an
    /// optimizer step or a state-dict load before the next forward would leave them
    /// stale, and the next forward would compute with the old values.
    pub(super) fn end_failed_forward(&mut self) -> Result<()> {
        self.each_unit_all(|u| {
            if u.is_root {
                return Ok(());
            }
            if u.phase.close_forward().is_some() {
                u.rs.sched.lock().on_post_forward(u.id);
            }
            u.reshard()
        })
    }

    /// What the step holds when `call` may run now: between passes, on the root.
    ///
    /// # Errors
    /// `Fsdp` inside a forward, a backward, before `finish_backward`, inside
    /// `summon_full_params`, or on a nested unit.
    pub(super) fn between_passes(&self, call: Term) -> Result<Held> {
        if !self.is_root {
            return Err(Error::Fsdp(format!(
                "{call} called on unit '{}': it belongs to the root",
                self.module_name()
            )));
        }
        match self.rs.sched.lock().progress.pass() {
            Pass::Idle(h) => Ok(h),
            Pass::Forward { .. } => Err(Error::Fsdp(format!(
                "{call} inside the root's forward (between its {} and {})",
                Term::PreForward,
                Term::PostForward
            ))),
            Pass::Backward { .. } => Err(Error::Fsdp(format!(
                "{call} in the middle of a backward (between the root's {} and {}): end the backward first (the root's {}, then {})",
                Term::PreBackward,
                Term::PostBackward,
                Term::PostBackward,
                Term::FinishBackward
            ))),
            Pass::BackwardEnded => Err(Error::Fsdp(format!(
                "{call} before {}: {}",
                Term::FinishBackward,
                unfinished()
            ))),
            Pass::Summoning(_) => Err(Error::Fsdp(format!(
                "{call} inside summon_full_params: call it after the closure returns"
            ))),
        }
    }

    /// Whether an optimizer step may run now (`optimizer.step()` on
    /// [`optimizer_params`](Self::optimizer_params)): between passes, with the gradients of
    /// a finished backward, none of them kept unreduced under `no_sync`. A host that drives
    /// the hooks calls it before each step; the modules' own `forward`/`backward` cannot
    /// get the order wrong. The C ABI's `fsdp_optimizer_step` does.
    ///
    /// # Errors
    /// `Fsdp` naming what was expected instead: the step is inside a pass, before
    /// `finish_backward`, after a backward or `finish_backward` that failed (until
    /// `zero_grad`), between a forward and its backward, without any gradient (no
    /// backward since `zero_grad`), or while `no_sync` keeps gradients unreduced.
    pub fn ready_for_step(&mut self) -> Result<()> {
        let step = Term::OptimizerStep;
        let held = self.between_passes(step)?;
        if let Some(why) = self.rs.sched.lock().progress.incomplete() {
            return Err(Error::Fsdp(format!(
                "{step} after a failed backward ({why}): the gradients held since {} are incomplete and the step would apply them; call {}, then run the step's forward and backward again",
                Term::ZeroGrad,
                Term::ZeroGrad
            )));
        }
        match held {
            Held::Nothing => Err(Error::Fsdp(format!(
                "{step} without gradients: no backward finished since {} (or since the model was built); run a forward and a backward, ended by {}, first",
                Term::ZeroGrad,
                Term::FinishBackward
            ))),
            Held::Forward | Held::GradsAndForward => Err(Error::Fsdp(format!(
                "{step} between a forward and its backward: that backward would compute gradients for other parameters than its forward used; step after the backward and {}",
                Term::FinishBackward
            ))),
            Held::Grads => {
                let mut kept = Vec::new();
                self.each_unit(|u| {
                    if u.flat.unsynced_grad.is_some() && u.flat.numel() > 0 {
                        kept.push(format!("'{}'", u.module_name()));
                    }
                });
                if kept.is_empty() {
                    return Ok(());
                }
                Err(Error::Fsdp(format!(
                    "{step} while gradients are kept unreduced under no_sync ({}) in unit(s) {}: the step would skip them; turn synchronization back on ({}) and run the last micro-batch's backward, which reduces them, then step",
                    Term::SyncOff,
                    kept.join(", "),
                    Term::SyncOn
                )))
            }
        }
    }

    /// Whether `zero_grad` may run now: between passes. Inside an unfinished backward it
    /// would drop the gradient shards while the backward's reductions are still to be added
    /// to them by `finish_backward` (carried into the next step). The C ABI's
    /// `fsdp_model_zero_grad` checks it.
    ///
    /// # Errors
    /// As [`ready_for_step`](Self::ready_for_step)'s pass errors.
    pub fn ready_for_zero_grad(&self) -> Result<()> {
        self.between_passes(Term::ZeroGrad).map(|_| ())
    }
}

/// Why a backward that the root's `post_backward` ended still needs `finish_backward`.
fn unfinished() -> String {
    format!(
        "the backward ended (the root's {}) but its gradient reductions were neither waited for nor added to the sharded gradients; call {} first (without it the step would miss this backward's gradients and the next one would add them in)",
        Term::PostBackward,
        Term::FinishBackward
    )
}
