//! The NCCL watchdog: one thread per process that watches every NCCL collective in flight,
//! so that the thread that issued one never waits for it (PyTorch's ProcessGroupNCCL
//! watchdog, `ProcessGroupNCCL::watchdogHandler`).
//!
//! It polls the completion events recorded after the collectives and the communicator's
//! asynchronous error (`ncclCommGetAsyncError`), quietly: the first poll comes 2 ms after
//! new work that ends an idle spell, later ones back off to one every 100 ms (PyTorch's watchdog sleeps 100 ms),
//! and each poll queries one event per group and stream, the newest collective's (one
//! stream completes its work in order, so when the newest is done every older one is);
//! only when it is not are the older ones looked at, oldest first, to drop those that
//! finished and time the oldest in flight. On cuda-emu the 2-layer GPT at 2 processes made
//! 507-711 event queries per process per step before, 23-24 now (`event_queries` in
//! `backend::counters`; docs/cuda.md). A collective slow past a
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

use super::super::Store;
use super::Shared;
use crate::backend::cuda::Event;
use crate::error::Error;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// One collective in flight.
pub(super) struct InFlight {
    group: Arc<Shared>,
    op: &'static str,
    /// The group's collective count up to and including this one.
    seq: u64,
    done: Event,
    /// The stream it was issued on (its raw handle): collectives of one group on one
    /// stream complete in order.
    stream: usize,
    issued: Instant,
    /// When this rank recorded its collective count in the store (once slow).
    published: Option<Instant>,
}

impl InFlight {
    pub(super) fn new(
        group: Arc<Shared>,
        op: &'static str,
        seq: u64,
        done: Event,
        stream: usize,
    ) -> InFlight {
        InFlight {
            group,
            op,
            seq,
            done,
            stream,
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

    /// The lane it completes in order with: its group and stream.
    fn lane(&self) -> (usize, usize) {
        (Arc::as_ptr(&self.group) as usize, self.stream)
    }

    /// One look at a collective found still in flight (the oldest of its lane): its
    /// group's asynchronous error, a peer's recorded failure, or its timeout, if any.
    fn watch(&mut self) -> Option<Error> {
        if let Some(e) = self.group.async_failure(self.op, self.seq, false) {
            return Some(e);
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
                return Some(Error::PeerFailed {
                    failed_rank,
                    reason,
                });
            }
        }
        // Past the timeout, one more `slow` for a peer that entered late to record its
        // count; and this rank's own count recorded at least `slow` ago, so that a peer
        // that entered, watched as late as this rank (the watchdog of a loaded process
        // may look seconds late), had as long to record its own.
        let recorded = self.published.is_some_and(|t| t.elapsed() > self.slow());
        if age > self.group.timeout + self.slow() && recorded {
            return Some(Error::Timeout {
                op: self.op.to_string(),
                rank: self.group.world_rank(),
                timeout_s: self.group.timeout.as_secs_f64(),
                missing_ranks: self.group.evidence.lagging_ranks(self.seq),
            });
        }
        None
    }
}

struct Watchdog {
    /// Collectives handed over since the thread last looked (it sorts them into lanes).
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
/// cause (`evidence.rs`). A process that exits ends it sooner.
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

/// Hands a collective just issued to the watchdog. Collectives of one group on one stream
/// must be handed over in the order they were issued (the caller holds the group's
/// communicator from issue to here).
pub(super) fn watch(c: InFlight) {
    let w = watchdog();
    w.queue.lock().push(c);
    w.wake.notify_one();
}

/// The collectives in flight of one group on one stream, oldest first. They complete in
/// that order (stream order), so the newest one's event answers for all of them.
struct Lane {
    key: (usize, usize),
    items: VecDeque<InFlight>,
}

impl Lane {
    /// One look at the lane; false once it is empty (all done, or the group failed).
    fn poll(&mut self) -> bool {
        let Some(newest) = self.items.back() else {
            return false;
        };
        if newest.group.has_failed() {
            self.items.clear(); // reported already; nothing more to watch
            return false;
        }
        // The newest one done: every older one is (one query for the lane).
        let older = self.items.len() > 1;
        match newest.done.query() {
            Ok(true) => {
                self.items.clear();
                return false;
            }
            Ok(false) => {}
            Err(e) => return self.failed(e),
        }
        // Drop the older ones that finished, oldest first; the oldest in flight is the one
        // whose age counts toward the timeout.
        while older && self.items.len() > 1 {
            match self.items[0].done.query() {
                Ok(true) => {
                    self.items.pop_front();
                }
                Ok(false) => break,
                Err(e) => return self.failed(e),
            }
        }
        match self.items[0].watch() {
            None => true,
            Some(e) => self.failed(e),
        }
    }

    /// Records `e` as the group's failure (which aborts its communicator); the lane ends.
    fn failed(&mut self, e: Error) -> bool {
        if let Some(c) = self.items.front() {
            c.group.fail(e);
        }
        self.items.clear();
        false
    }
}

/// The first poll after new work, and the most the polls back off to (PyTorch's watchdog
/// sleeps 100 ms, `kWatchdogThreadSleepMillis`). A healthy step makes a handful of polls,
/// each one event query per group and stream (`scripts/cuda-emu.sh` checks at most 50
/// event queries a step); the detection times (seconds) gain at most the cap. New work
/// restarts the backoff only when the watchdog had nothing in flight for longer than the
/// cap: in a training loop collectives follow each other closely, and the watchdog's polls
/// would otherwise start over at every one that finds it idle.
const FIRST_POLL: Duration = Duration::from_millis(2);
const MAX_POLL: Duration = Duration::from_millis(100);

fn run(w: &'static Watchdog) {
    let mut lanes: Vec<Lane> = Vec::new();
    let mut pause = FIRST_POLL;
    // When the last poll found collectives in flight.
    let mut busy = Instant::now();
    loop {
        {
            let mut q = w.queue.lock();
            if q.is_empty() && lanes.is_empty() {
                while q.is_empty() {
                    w.wake.wait(&mut q);
                }
                // Work after a pause: poll soon. Work that follows the last within the
                // longest poll (a training loop's next collectives) keeps the backoff.
                if busy.elapsed() > MAX_POLL {
                    pause = FIRST_POLL;
                }
            }
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(MAX_POLL);
        // Sorted into lanes outside the polls: a query may run emulated device work, a
        // store request may take a while; issuing threads keep adding meanwhile.
        let arrived = std::mem::take(&mut *w.queue.lock());
        for c in arrived {
            let key = c.lane();
            match lanes.iter_mut().find(|l| l.key == key) {
                Some(l) => l.items.push_back(c),
                None => lanes.push(Lane {
                    key,
                    items: VecDeque::from([c]),
                }),
            }
        }
        // Never during a CUDA graph capture (`fsdp train --cuda-graphs`): a global-mode
        // capture fails at an event query from any thread. The capture waits for a poll
        // under way, the poll for the capture to end.
        crate::backend::cuda::outside_captures(|| lanes.retain_mut(Lane::poll));
        busy = Instant::now();
    }
}
