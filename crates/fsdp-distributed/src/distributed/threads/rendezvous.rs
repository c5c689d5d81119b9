//! The rendezvous every collective of the threads backend runs: *arrive*, *execute*,
//! *depart* on one mutex + condvar per group (see the module docs of [`super`]).
//!
//! Nothing here allocates once a group is set up: descriptors are `Copy`, the arrivals are
//! copied into the caller's scratch, and strings are built only for error messages.

use crate::distributed::waiting::Pacer;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) use crate::distributed::desc::{Arg, Desc};

/// The address of one rank's tensor memory, published to its peers for one collective.
#[derive(Clone, Copy, Debug)]
pub(super) struct Ptr(*mut u8);

// SAFETY: a `Ptr` is only an address while it sits in the group state; it is dereferenced
// only inside `exec`, between the rendezvous and the departure of every rank, while the
// rank that published it holds the lock of the storage it points into (see `collective`).
unsafe impl Send for Ptr {}
// SAFETY: as for `Send`: sharing the address is harmless, accesses are ordered by the
// rendezvous.
unsafe impl Sync for Ptr {}

impl Ptr {
    /// No memory (barrier, a rank that only reads or only writes).
    pub(super) const NULL: Ptr = Ptr(std::ptr::null_mut());

    /// The address of `p`.
    pub(super) fn of<T>(p: *const T) -> Ptr {
        Ptr(p as *mut u8)
    }

    /// The address as a pointer to `T`.
    pub(super) fn cast<T>(self) -> *mut T {
        self.0.cast()
    }

    /// A device address (CUDA tensors publish device pointers, not host ones).
    pub(super) fn from_addr(addr: u64) -> Ptr {
        Ptr(addr as usize as *mut u8)
    }

    /// The address as a device address.
    pub(super) fn addr(self) -> u64 {
        self.0 as usize as u64
    }
}

/// One rank's part of a collective: what it called and where its tensors are.
#[derive(Clone, Copy, Debug)]
pub(super) struct Arrival {
    pub(super) desc: Desc,
    pub(super) input: Ptr,
    pub(super) output: Ptr,
    /// CUDA tensors: the device they are on (0 on the host).
    pub(super) ordinal: usize,
    /// CUDA tensors: an event recorded on the rank's stream after the work that produced
    /// its input (the driver handle; peers make their streams wait on it before reading);
    /// NULL on the host.
    pub(super) event: Ptr,
}

impl Arrival {
    /// A host rank's arrival (no device, no event).
    pub(super) fn host(desc: Desc, input: Ptr, output: Ptr) -> Arrival {
        Arrival {
            desc,
            input,
            output,
            ordinal: 0,
            event: Ptr::NULL,
        }
    }
}

/// What a device collective leaves its peers at departure: an event after this rank's
/// device work of the collective (its reads of peers' inputs, its writes into peers'
/// outputs), which every peer's stream waits on before it returns, and the event's owner,
/// kept in the group state until this rank's next departure (by then every peer has
/// queued its wait: it arrived at that next collective).
pub(super) struct Mark {
    pub(super) event: Ptr,
    /// Held for its `Drop` (destroys the event).
    pub(super) _owner: Box<dyn Send>,
}

struct State {
    generation: u64,
    /// Each rank's [`Mark`] of its last device collective, `None` after a host one.
    marks: Vec<Option<Mark>>,
    /// `Some(check)` once every rank arrived: `Ok` or the mismatch message.
    ready: Option<std::result::Result<(), String>>,
    slots: Vec<Option<Arrival>>,
    arrived: usize,
    departed: usize,
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
}

/// The state one group's members share.
pub(super) struct Shared {
    size: usize,
    timeout: Duration,
    /// World ranks of the members, in group-rank order.
    members: Vec<usize>,
    state: Mutex<State>,
    cv: Condvar,
    /// Bumped with every change of `state` that waiters look for, so that a waiter can spin
    /// on it without the lock before it sleeps on `cv`.
    progress: AtomicU64,
}

/// How long a waiting rank polls before it sleeps. Waking a sleeping thread costs 50 - 80 us
/// here (the idle vCPU has to be rescheduled), more than a small collective; polling, with a
/// yield between polls so that ranks sharing a core let each other run, brought 1 KiB
/// collectives to about 5 us. A rank that waits longer (a peer still computing) sleeps after
/// this, so the cost is bounded by this much CPU time per collective.
const SPIN: Duration = Duration::from_micros(50);

impl Shared {
    pub(super) fn new(members: Vec<usize>, timeout: Duration) -> Arc<Shared> {
        let size = members.len();
        Arc::new(Shared {
            size,
            timeout,
            members,
            state: Mutex::new(State {
                generation: 0,
                marks: (0..size).map(|_| None).collect(),
                ready: None,
                slots: vec![None; size],
                arrived: 0,
                departed: 0,
                failure: None,
                exited: vec![false; size],
            }),
            cv: Condvar::new(),
            progress: AtomicU64::new(0),
        })
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(super) fn members(&self) -> &[usize] {
        &self.members
    }

    /// Wakes every waiter after a change of the state. Called with the lock held: a spinning
    /// waiter reads `progress` under the lock before it sleeps, so a bump made outside it
    /// could fall between that read and the sleep and be lost.
    fn wake(&self) {
        self.progress.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
    }

    /// Polls for a change of the state for up to [`SPIN`] without holding the lock; true
    /// when it changed (the caller re-checks), false when the caller should sleep on `cv`.
    /// The answer is read again under the lock, so a change made between the last poll and
    /// the relock is not lost (changes are made under the lock).
    fn spin(&self, st: &mut MutexGuard<'_, State>) -> bool {
        let seen = self.progress.load(Ordering::Acquire);
        MutexGuard::unlocked(st, || {
            let start = Instant::now();
            let mut polls = 0u32;
            while self.progress.load(Ordering::Acquire) == seen {
                polls += 1;
                if polls < 128 {
                    std::hint::spin_loop();
                } else if start.elapsed() < SPIN {
                    std::thread::yield_now();
                } else {
                    break;
                }
            }
        });
        self.progress.load(Ordering::Acquire) != seen
    }

    /// Records that world rank `who` failed (the first failure is kept) and wakes waiters.
    pub(super) fn record_failure(&self, who: usize, reason: &str) {
        let mut st = self.state.lock();
        if st.failure.is_none() {
            st.failure = Some((who, reason.to_string()));
        }
        self.wake();
    }

    /// Records that world rank `who` calls no more collectives, if it is a member.
    pub(super) fn record_exit(&self, who: usize) {
        if let Some(local) = self.members.iter().position(|&m| m == who) {
            let mut st = self.state.lock();
            st.exited[local] = true;
            self.wake();
        }
    }

    /// Runs one collective for group rank `rank`: posts `arrival`, waits until every member
    /// arrived and their descriptors agree, runs `exec` on the arrivals (rank order), and
    /// returns once every member finished its `exec`, so that no rank releases memory a peer
    /// still reads or writes. `peers` is the caller's scratch (no allocation once it has
    /// room for the group). An error of `exec` (a CUDA copy that failed) is this rank's
    /// result; it still departs only with the others.
    pub(super) fn collective<F>(
        &self,
        rank: usize,
        arrival: Arrival,
        peers: &mut Vec<Arrival>,
        exec: F,
    ) -> Result<()>
    where
        F: FnOnce(&[Arrival]) -> Result<()>,
    {
        self.collective_ordered(rank, arrival, peers, |p| exec(p).map(|()| None), None)
    }

    /// [`collective`](Self::collective) for device memory moved by streams: `exec` queues
    /// this rank's work and returns a [`Mark`] after it, and at departure `wait_peer` is
    /// called with every peer's mark (its event), so that this rank's stream waits for the
    /// peers' work on its memory before anything it queues later: the collective is
    /// ordered on the streams without the host waiting for the device.
    pub(super) fn collective_ordered<F>(
        &self,
        rank: usize,
        arrival: Arrival,
        peers: &mut Vec<Arrival>,
        exec: F,
        wait_peer: Option<&dyn Fn(Ptr) -> Result<()>>,
    ) -> Result<()>
    where
        F: FnOnce(&[Arrival]) -> Result<Option<Mark>>,
    {
        let mut arrival = arrival;
        arrival.desc.tag = crate::distributed::fingerprint::current();
        let deadline = Instant::now() + self.timeout;
        let desc = arrival.desc;
        let mut st = self.state.lock();
        if let Some(e) = peer_failed(&st) {
            return Err(e);
        }
        let gen = st.generation;
        st.slots[rank] = Some(arrival);
        st.arrived += 1;
        if st.arrived == self.size {
            st.ready = Some(check_descs(&st.slots, &self.members));
            self.wake();
        }
        let mut pace = Pacer::new(self.members[rank], self.timeout);
        while st.ready.is_none() {
            if let Err(e) = self.wait_for_peers(&mut st, &desc, rank, deadline, &mut pace) {
                // Withdraw, so that no peer ever reads this rank's (soon released) memory.
                st.slots[rank] = None;
                st.arrived -= 1;
                return Err(e);
            }
        }
        let check = st.ready.clone().unwrap_or(Ok(()));
        peers.clear();
        peers.extend(st.slots.iter().flatten().copied());
        drop(st);

        // Every member is past the loop above (`ready` is set only once all arrived, and a
        // waiting rank checks it before anything else), so every member reaches `depart`.
        let mut depart = Depart {
            shared: self,
            gen,
            rank,
            done: false,
        };
        let (result, mark) = match check {
            Ok(()) if peers.len() == self.size => match exec(peers) {
                Ok(m) => (Ok(()), m),
                Err(e) => (Err(e), None),
            },
            Ok(()) => (
                Err(Error::Fsdp("internal: incomplete rendezvous".into())),
                None,
            ),
            Err(detail) => (
                Err(Error::CollectiveMismatch {
                    group_size: self.size,
                    detail,
                }),
                None,
            ),
        };
        let waited = depart.finish(mark, wait_peer);
        waited.and(result)
    }

    /// One wait for the missing ranks of the arrive phase; an error when a peer failed or
    /// exited or the deadline passed (recorded as the group's failure).
    fn wait_for_peers(
        &self,
        st: &mut MutexGuard<'_, State>,
        desc: &Desc,
        rank: usize,
        deadline: Instant,
        pace: &mut Pacer,
    ) -> Result<()> {
        if let Some(e) = peer_failed(st) {
            return Err(e);
        }
        if let Some(gone) = (0..self.size).find(|&r| st.slots[r].is_none() && st.exited[r]) {
            let gone = self.members[gone];
            let missing = self.missing(st);
            let what = desc.tag.map(|fp| format!(" for {fp}")).unwrap_or_default();
            let why = format!(
                "rank {gone} exited without calling {}{what} (ranks {missing:?} never arrived)",
                desc.op
            );
            st.failure = Some((gone, why.clone()));
            self.wake();
            return Err(Error::PeerFailed {
                failed_rank: gone,
                reason: why,
            });
        }
        if self.spin(st) {
            return Ok(());
        }
        if self.cv.wait_until(st, pace.until(deadline)).timed_out()
            && st.ready.is_none()
            && Instant::now() < deadline
        {
            let missing = self.missing(st);
            pace.tick(|| format!("{}: ranks {missing:?} have not arrived", desc.op));
            return Ok(());
        }
        if Instant::now() >= deadline && st.ready.is_none() {
            let missing = self.missing(st);
            let err = Error::Timeout {
                op: desc.op.to_string(),
                rank: self.members[rank],
                timeout_s: self.timeout.as_secs_f64(),
                missing_ranks: missing.clone(),
            };
            if st.failure.is_none() {
                st.failure = Some((missing.first().copied().unwrap_or(rank), err.to_string()));
            }
            self.wake();
            return Err(err);
        }
        Ok(())
    }

    /// World ranks that have not arrived.
    fn missing(&self, st: &State) -> Vec<usize> {
        (0..self.size)
            .filter(|&r| st.slots[r].is_none())
            .map(|r| self.members[r])
            .collect()
    }
}

/// The depart phase: [`finish`](Depart::finish), or on drop if `exec` unwound. Counts this
/// rank out and waits until every member has.
struct Depart<'a> {
    shared: &'a Shared,
    gen: u64,
    rank: usize,
    done: bool,
}

impl Depart<'_> {
    /// Leaves `mark` for the peers, departs, and calls `wait_peer` with every peer's mark
    /// (under the lock, which keeps the marks in place; queuing a stream wait does not
    /// block). Returns the first error of those calls.
    fn finish(
        &mut self,
        mark: Option<Mark>,
        wait_peer: Option<&dyn Fn(Ptr) -> Result<()>>,
    ) -> Result<()> {
        self.done = true;
        let st = self.depart(mark);
        let Some(wait) = wait_peer else {
            return Ok(());
        };
        (0..self.shared.size)
            .filter(|&r| r != self.rank)
            .filter_map(|r| st.marks[r].as_ref().map(|m| m.event))
            .try_for_each(wait)
    }

    fn depart(&self, mark: Option<Mark>) -> MutexGuard<'_, State> {
        let sh = self.shared;
        let mut st = sh.state.lock();
        // The mark of this rank's previous collective is replaced only now: every peer
        // arrived at this one, so each has queued its wait on that previous event.
        st.marks[self.rank] = mark;
        st.departed += 1;
        if st.departed == sh.size {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.arrived = 0;
            st.departed = 0;
            st.ready = None;
            st.generation += 1;
            sh.wake();
        }
        // No timeout and no early exit on a peer's failure: every member is past its
        // arrival and only finishes its `exec` (bounded work on memory it holds locked, no
        // waiting) before it departs. Returning earlier would let this rank release tensors
        // that a peer still reads or writes.
        while st.generation == self.gen {
            if !sh.spin(&mut st) {
                sh.cv.wait(&mut st);
            }
        }
        st
    }
}

impl Drop for Depart<'_> {
    fn drop(&mut self) {
        if !self.done {
            drop(self.depart(None));
        }
    }
}

fn peer_failed(st: &State) -> Option<Error> {
    st.failure.as_ref().map(|(r, why)| Error::PeerFailed {
        failed_rank: *r,
        reason: why.clone(),
    })
}

/// Compares every rank's descriptor with the first member's; ranks named by world rank.
fn check_descs(slots: &[Option<Arrival>], members: &[usize]) -> std::result::Result<(), String> {
    crate::distributed::desc::check_descs(slots.len(), |r| slots[r].map(|a| a.desc), members)
}
