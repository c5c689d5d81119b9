//! How long a stream stood still waiting for another: the exposed part of communication on
//! a GPU. When the compute stream waits for a collective's event ([`Stream::wait_timed`]),
//! an event is recorded on it just before the wait and one just after; the time between
//! the two, read once both have completed, is how long the compute stream idled because the
//! collective was not done yet. Overlapped communication costs (almost) nothing here,
//! exposed communication all of its remaining time: the figure `fsdp train` reports as
//! `comm_wait_us` on CUDA and `scripts/gpu-check.sh` as the exposed fraction of a step.
//!
//! PyTorch has no counter of its own for this; its profiler traces show the same gaps on
//! the compute stream. Reading the times never blocks: pairs whose events have not
//! completed stay until a later read.

use super::stream::{Event, Stream};
use crate::error::Result;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// The (before, after) event pairs of this thread's timed waits not yet read, in the
    /// order they were recorded, with the stream (its raw handle) they were recorded on.
    static PAIRS: RefCell<Vec<Pair>> = const { RefCell::new(Vec::new()) };
    /// Seconds of pairs already read back but not yet taken by [`take_stream_stall_s`].
    static FOLDED_S: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// One timed wait: the events recorded just before and just after it, and its stream.
struct Pair {
    before: Event,
    after: Event,
    stream: usize,
}

/// Pairs held before [`Stream::wait_timed`] folds the completed ones itself, so a thread
/// whose caller never takes the figure keeps a bounded number of events alive.
const FOLD_AT: usize = 1024;

/// Turns the timing of stream waits on (the default) or off for the whole process: each
/// timed wait costs two event records on the waiting stream.
pub fn time_stream_waits(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

impl Stream {
    /// [`Stream::wait`], timed when [`time_stream_waits`] is on: the stall is added to the
    /// calling thread's total, read by [`take_stream_stall_s`].
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) from the driver.
    pub fn wait_timed(&self, event: &Event) -> Result<()> {
        if !ENABLED.load(Ordering::Relaxed) {
            return self.wait(event);
        }
        let before = self.record()?;
        self.wait(event)?;
        let after = self.record()?;
        let held = PAIRS.with(|p| {
            let mut p = p.borrow_mut();
            p.push(Pair {
                before,
                after,
                stream: self.inner.cu_stream() as usize,
            });
            p.len()
        });
        if held >= FOLD_AT {
            FOLDED_S.with(|f| f.set(f.get() + fold_completed()));
        }
        Ok(())
    }
}

/// Seconds the calling thread's streams stood still in [`Stream::wait_timed`] waits whose
/// events have completed since the last call; waits still in flight are kept for a later
/// call. Never blocks the host.
pub fn take_stream_stall_s() -> f64 {
    fold_completed() + FOLDED_S.with(|f| f.replace(0.0))
}

/// Reads and drops this thread's completed pairs, returning their seconds; pairs still in
/// flight stay. One event query per completed pair and one per stream with pairs in flight:
/// a stream runs its work in order, so a pair's `after` done means its `before` is, and the
/// first `after` not done on a stream means none after it on that stream is.
fn fold_completed() -> f64 {
    PAIRS.with(|p| {
        let mut pairs = p.borrow_mut();
        let mut total = 0.0f64;
        let mut busy: Vec<usize> = Vec::new();
        pairs.retain(
            |Pair {
                 before,
                 after,
                 stream,
             }| {
                // A pair is read once both events completed; an error reads as "not yet" here
                // and reaches the caller through its next synchronizing call.
                if busy.contains(stream) {
                    return true;
                }
                if !matches!(after.query(), Ok(true)) {
                    busy.push(*stream);
                    return true;
                }
                // SAFETY: both events are live and complete (`after` checked above, `before`
                // recorded ahead of it on the same stream), so the driver
                // reads their times without waiting (cudarc's elapsed_ms would synchronize).
                let ms = unsafe {
                    cudarc::driver::result::event::elapsed(
                        before.inner.cu_event(),
                        after.inner.cu_event(),
                    )
                };
                if let Ok(ms) = ms {
                    total += f64::from(ms.max(0.0)) / 1e3;
                }
                false
            },
        );
        total
    })
}
