//! The NCCL watchdog: one thread per process that watches every NCCL collective in flight,
//! so that the thread that issued one never waits for it (PyTorch's ProcessGroupNCCL
//! watchdog, `ProcessGroupNCCL::watchdogHandler`).
//!
//! For each collective it polls the completion event recorded after it and the
//! communicator's asynchronous error (`ncclCommGetAsyncError`). A collective slow past a
//! quarter of the group timeout (at most 10 s) records this rank's collective count in the
//! store, as PyTorch's desync debugging asks each rank; a healthy one costs no store
//! request and no host wait. Once a collective is that slow, it also looks for a peer's
//! recorded failure, at most once a second per group. On a failure, and past the group
//! timeout (once this rank's count has been in the store a quarter of the timeout, so that
//! peers watched as late as this one recorded theirs), it records the error on the group
//! and aborts the communicator (its kernels end, the streams drain); the group's next call
//! returns the error: [`Error::Timeout`] naming the ranks that never entered the
//! collective (their counts are below it), [`Error::PeerFailed`] naming the peer that
//! failed first, or NCCL's error. A failed group's store handle is kept a while
//! ([`linger`]), so that the store rank 0 hosts outlives its failure for the peers.

use super::nccl::Shared;
use super::Store;
use crate::backend::cuda::Event;
use crate::error::Error;
use parking_lot::{Condvar, Mutex};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// One collective in flight.
pub(super) struct InFlight {
    group: Arc<Shared>,
    op: &'static str,
    /// The group's collective count up to and including this one.
    seq: u64,
    done: Event,
    issued: Instant,
    /// When this rank recorded its collective count in the store (once slow).
    published: Option<Instant>,
}

impl InFlight {
    pub(super) fn new(group: Arc<Shared>, op: &'static str, seq: u64, done: Event) -> InFlight {
        InFlight {
            group,
            op,
            seq,
            done,
            issued: Instant::now(),
            published: None,
        }
    }

    /// Past this, the collective is slow: this rank publishes its count. A quarter of the
    /// timeout, at most 10 s: far beyond a healthy collective on a GPU (and on cuda-emu's
    /// loaded CI machine), well within the timeout.
    fn slow(&self) -> Duration {
        (self.group.timeout / 4).min(Duration::from_secs(10))
    }

    /// One look: `Some(Ok)` when it finished, `Some(Err)` when it failed, None while in
    /// flight.
    fn check(&mut self) -> Option<Result<(), Error>> {
        if self.group.has_failed() {
            return Some(Ok(())); // reported already; nothing more to watch
        }
        match self.done.query() {
            Ok(true) => return Some(Ok(())),
            Ok(false) => {}
            Err(e) => return Some(Err(e)),
        }
        if let Some(e) = self.group.async_failure(self.op, self.seq, false) {
            return Some(Err(e));
        }
        let age = self.issued.elapsed();
        if self.published.is_none() && age > self.slow() {
            self.published = Some(Instant::now());
            self.group.evidence.publish_seq(self.seq);
        }
        // A peer's recorded failure is looked for only once this collective is slow too:
        // a healthy step (however loaded the machine) touches the store never.
        if age > self.slow() && self.group.peer_check_due() {
            if let Some((failed_rank, reason)) = self.group.evidence.failed_peer() {
                return Some(Err(Error::PeerFailed {
                    failed_rank,
                    reason,
                }));
            }
        }
        // Past the timeout, one more `slow` for a peer that entered late to record its
        // count; and this rank's own count recorded at least `slow` ago, so that a peer
        // that entered, watched as late as this rank (the watchdog of a loaded process
        // may look seconds late), had as long to record its own.
        let recorded = self.published.is_some_and(|t| t.elapsed() > self.slow());
        if age > self.group.timeout + self.slow() && recorded {
            return Some(Err(Error::Timeout {
                op: self.op.to_string(),
                rank: self.group.world_rank(),
                timeout_s: self.group.timeout.as_secs_f64(),
                missing_ranks: self.group.evidence.lagging_ranks(self.seq),
            }));
        }
        None
    }
}

struct Watchdog {
    queue: Mutex<Vec<InFlight>>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<&'static Watchdog> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Watchdog = Box::leak(Box::new(Watchdog {
            queue: Mutex::new(Vec::new()),
            wake: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("fsdp-nccl-watchdog".into())
            .spawn(move || run(w))
            .expect("spawning the NCCL watchdog thread");
        w
    })
}

/// Keeps `store`, the store handle of a group that failed, alive for the group's
/// `timeout` (at most a minute) past the group: the store server that rank 0 hosts stays
/// up while peers that find the failure later than this rank look in the store for its
/// cause (`nccl_evidence.rs`). A process that exits ends it sooner.
pub(super) fn linger(store: Arc<dyn Store>, timeout: Duration) {
    let keep = timeout.min(Duration::from_secs(60));
    // Without a thread the handle is dropped at once: peers may then name a rank
    // without evidence, never hang.
    let _ = std::thread::Builder::new()
        .name("fsdp-nccl-linger".into())
        .spawn(move || {
            std::thread::sleep(keep);
            drop(store);
        });
}

/// Hands a collective just issued to the watchdog.
pub(super) fn watch(c: InFlight) {
    let w = watchdog();
    w.queue.lock().push(c);
    w.wake.notify_one();
}

fn run(w: &'static Watchdog) {
    // Polls 20 us apart while collectives finish, backing off to 2 ms while none does.
    let (fast, slow) = (Duration::from_micros(20), Duration::from_millis(2));
    let mut pause = fast;
    loop {
        let mut batch = {
            let mut q = w.queue.lock();
            while q.is_empty() {
                w.wake.wait(&mut q);
                pause = fast;
            }
            std::mem::take(&mut *q)
        };
        let before = batch.len();
        // Checked outside the lock: a query may run emulated device work, a store request
        // may take a while; issuing threads keep adding meanwhile.
        batch.retain_mut(|c| match c.check() {
            None => true,
            Some(Ok(())) => false,
            Some(Err(e)) => {
                c.group.fail(e);
                false
            }
        });
        let progressed = batch.len() < before;
        {
            let mut q = w.queue.lock();
            // Older collectives first, as they were issued.
            batch.append(&mut q);
            *q = batch;
        }
        pause = if progressed {
            fast
        } else {
            (pause * 2).min(slow)
        };
        std::thread::sleep(pause);
    }
}
