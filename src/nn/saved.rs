//! Saved-activation accounting: the bytes of the tensors a module tree holds for its
//! backward (what autograd's saved tensors take in PyTorch, `torch.cuda.memory_allocated`
//! minus parameters at the end of a forward), and their peak over a step when activation
//! checkpointing recomputes some of them during backward.
//!
//! # [Note: the recompute peak]
//! Without checkpointing, saved activations peak at the end of the training forward: the
//! backward only consumes them. A [`CheckpointWrapper`](super::CheckpointWrapper) keeps
//! only its input through the forward and recomputes its module's saved tensors inside its
//! backward, so the peak may come then: the tensors still held from the forward (the
//! inputs of the checkpointed modules not yet reached, the saves of modules outside them)
//! plus the ones the recompute just made. [`track_saved_activations`] notes, at the end of
//! the forward, a weak handle to every saved tensor (one that does not keep it alive);
//! after each recompute the wrapper adds the recomputed tensors and sums those whose
//! storage something still holds. [`saved_activation_peak`] is the largest such sum, or
//! the end-of-forward figure. Per thread: a rank computes on its own thread.

use super::Module;
use crate::error::Result;
use crate::tensor::{Tensor, WeakTensor};
use std::cell::RefCell;

/// Bytes of the distinct tensors saved for backward below `m` (every module's
/// [`Module::saved_tensors`], FSDP units included; a tensor two modules hold counts once).
/// Saved activations peak at the end of a training forward, before backward consumes them
/// (unless a checkpointed module recomputes them: [Note: the recompute peak]): that is when
/// FSDP's root measures them ([`crate::fsdp::MemoryStats::activation_bytes`]).
/// Halved by a bf16/f16 `param_dtype`, whose layers save bf16/f16 tensors.
///
/// # Errors
/// None of its own; the `Result` carries a module's child-visiting error.
pub fn saved_activation_bytes(m: &mut dyn Module) -> Result<usize> {
    Ok(distinct_saved(m)?.iter().map(Tensor::nbytes).sum())
}

/// The distinct tensors saved for backward below `m`.
fn distinct_saved(m: &mut dyn Module) -> Result<Vec<Tensor>> {
    let mut all = Vec::new();
    collect(m, &mut all)?;
    let mut distinct: Vec<Tensor> = Vec::with_capacity(all.len());
    for t in all {
        if !distinct.iter().any(|d| d.same_view(&t)) {
            distinct.push(t);
        }
    }
    Ok(distinct)
}

fn collect(m: &mut dyn Module, out: &mut Vec<Tensor>) -> Result<()> {
    m.saved_tensors(out);
    m.for_each_child(&mut |_, c| collect(c.as_mut(), out))
}

/// This thread's step of [Note: the recompute peak].
struct Tracked {
    /// Every saved tensor seen this step: the forward's, then each recompute's.
    seen: Vec<WeakTensor>,
    /// The most bytes of them alive at once so far.
    peak: usize,
}

thread_local! {
    static TRACKED: RefCell<Option<Tracked>> = const { RefCell::new(None) };
}

/// Starts a step's saved-activation account on this thread, at the end of a training
/// forward of `m` (the whole model): returns [`saved_activation_bytes`] of `m`, and until
/// the next call every recompute of a [`CheckpointWrapper`](super::CheckpointWrapper) on
/// this thread may raise [`saved_activation_peak`] above it ([Note: the recompute peak]).
/// FSDP's root calls it after each training forward.
///
/// # Errors
/// As [`saved_activation_bytes`].
pub fn track_saved_activations(m: &mut dyn Module) -> Result<usize> {
    let saved = distinct_saved(m)?;
    let bytes = saved.iter().map(Tensor::nbytes).sum();
    let seen = saved.iter().map(Tensor::downgrade).collect();
    TRACKED.with(|t| *t.borrow_mut() = Some(Tracked { seen, peak: bytes }));
    Ok(bytes)
}

/// The most saved-activation bytes alive at once on this thread since the last
/// [`track_saved_activations`]: its end-of-forward figure, or more if a checkpointed
/// module's recompute in backward held more at once. 0 before any.
pub fn saved_activation_peak() -> usize {
    TRACKED.with(|t| t.borrow().as_ref().map_or(0, |t| t.peak))
}

/// Called by a [`CheckpointWrapper`](super::CheckpointWrapper) right after its recompute,
/// with its module: adds the recomputed saves to this thread's step and raises the peak to
/// the bytes alive now. Does nothing outside a tracked step.
pub(super) fn note_recompute(m: &mut dyn Module) -> Result<()> {
    let made = distinct_saved(m)?;
    TRACKED.with(|t| {
        let mut t = t.borrow_mut();
        let Some(t) = t.as_mut() else { return };
        for x in &made {
            // A weak handle keeps its storage's address from reuse: no false match.
            if !t.seen.iter().any(|s| s.is_alive() && s.is_view_of(x)) {
                t.seen.push(x.downgrade());
            }
        }
        let alive: usize = t
            .seen
            .iter()
            .filter(|s| s.is_alive())
            .map(WeakTensor::nbytes)
            .sum();
        t.peak = t.peak.max(alive);
    });
    Ok(())
}
