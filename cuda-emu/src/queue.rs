//! Stream queues: how the emulator keeps the device's asynchrony visible.
//!
//! On a GPU, work issued to a stream runs later, in stream order, and work on two streams is
//! ordered only by events. The emulator defers every stream-ordered operation (kernel,
//! copy, memset, GEMM, collective) into its stream's queue and runs it only when something
//! forces it: a host synchronization (stream, event, context, a copy to pageable host
//! memory, a free), or a stream waiting on an event recorded on another stream. So work
//! reads what an ordering through events guarantees and nothing more: a missing event wait
//! reads stale or never-written memory (fresh allocations are `0xff`), and the tests fail.
//!
//! `CUDA_EMU_SCHEDULE=eager` runs each operation when it is issued instead (the order of
//! issue), to tell an ordering bug from an arithmetic one. `CUDA_EMU_SEED=N` adds seeded
//! random progress: at one issue in four, some stream with pending work runs it all, as a
//! GPU advances its streams in an order of its own. That exposes the other half of the
//! races: a stream overwriting memory another stream has not finished reading.
//!
//! Everything runs under one lock: kernels of different streams never overlap here.
//!
//! A collective of a communicator of several ranks ([`Poll`], `nccl.rs`) may not be able to
//! finish when its stream is forced: its peers have not reached it yet. It then stays at the
//! head of its stream and the stream counts as blocked. A query answers "not ready"; a
//! host synchronization releases the lock and tries again (so other threads, the peers of
//! an in-process communicator among them, can issue and force their work meanwhile), as
//! the host of a GPU would sit in `cuStreamSynchronize` until NCCL's kernel ends.

use crate::capture::{self, Captured, Captures, MakePoll, Node};
use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// A deferred operation. Runs on whichever thread forces it, under the scheduler's lock;
/// a captured one (`capture.rs`) runs once per launch of its graph.
#[derive(Clone)]
pub struct Work(Arc<dyn Fn() + 'static>);
// SAFETY: the closures capture device addresses and copied argument values; they touch
// only emulated device memory (valid until freed, and a free drains the device first).
unsafe impl Send for Work {}

impl Work {
    pub fn new(f: impl Fn() + 'static) -> Work {
        Work(Arc::new(f))
    }
}

/// A deferred operation that may have to wait for something outside its stream (a
/// collective for its peers): called each time its stream is forced, until it returns true.
pub struct Poll(Box<dyn FnMut() -> bool + 'static>);
// SAFETY: as for `Work`: device addresses, copied values and shared communicator state.
unsafe impl Send for Poll {}

impl Poll {
    pub fn new(f: impl FnMut() -> bool + 'static) -> Poll {
        Poll(Box::new(f))
    }
}

enum Item {
    Run(Work),
    Poll(Poll),
    /// Run `stream`'s work up to and including item `seq` first (cuStreamWaitEvent).
    Wait {
        stream: usize,
        seq: u64,
    },
}

struct StreamQueue {
    device: c_int,
    /// Sequence number the next item gets; items `< done` have run.
    next: u64,
    done: u64,
    items: VecDeque<(u64, Item)>,
}

#[derive(Default)]
struct Scheduler {
    streams: HashMap<usize, StreamQueue>,
    /// Streams being drained by an enclosing `drain` (through a cross-stream wait): a wait
    /// cycle counts as blocked instead of recursing without end.
    draining: Vec<usize>,
    /// Captures in progress (`capture.rs`).
    captures: Captures,
}

/// A point in a stream's work: after its first `seq + 1` items (`cuEventRecord`).
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    pub stream: usize,
    pub seq: u64,
}

/// What an event recorded: a point in a stream's queue, or a node of a capture.
#[derive(Clone, Copy, Debug)]
pub enum Point {
    Queued(Mark),
    Captured(Captured),
}

static SCHED: Mutex<Option<Scheduler>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Scheduler>> {
    SCHED.lock().unwrap_or_else(|p| p.into_inner())
}

/// The next draw of `CUDA_EMU_SEED`'s generator (xorshift64*), or None without a seed.
fn draw() -> Option<u64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static STATE: OnceLock<Option<AtomicU64>> = OnceLock::new();
    let state = STATE
        .get_or_init(|| {
            let seed = crate::env::seed()?;
            Some(AtomicU64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1))
        })
        .as_ref()?;
    let mut x = state.load(Ordering::Relaxed);
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    state.store(x, Ordering::Relaxed);
    Some(x.wrapping_mul(0x2545_f491_4f6c_dd1d))
}

fn eager() -> bool {
    crate::env::eager()
}

impl Scheduler {
    /// Runs `stream`'s items with sequence numbers `<= upto`. False when an item cannot
    /// finish yet (a collective whose peers have not arrived, or a wait for such a stream):
    /// it stays at the head, the items before it have run.
    fn drain(&mut self, stream: usize, upto: u64) -> bool {
        let pending = self
            .streams
            .get(&stream)
            .and_then(|q| q.items.front())
            .is_some_and(|(seq, _)| *seq <= upto);
        if !pending {
            return true;
        }
        // Re-entered through a chain of waits that leads back here with work still due: a
        // cycle no device could finish either.
        if self.draining.contains(&stream) {
            return false;
        }
        self.draining.push(stream);
        let reached = self.drain_inner(stream, upto);
        self.draining.pop();
        reached
    }

    fn drain_inner(&mut self, stream: usize, upto: u64) -> bool {
        loop {
            let Some(q) = self.streams.get_mut(&stream) else {
                return true;
            };
            let seq = match q.items.front() {
                Some((seq, _)) if *seq <= upto => *seq,
                _ => return true,
            };
            let ready = match &mut q.items.front_mut().expect("front checked").1 {
                Item::Run(_) => true,
                Item::Poll(p) => (p.0)(),
                Item::Wait {
                    stream: other,
                    seq: until,
                } => {
                    let (other, until) = (*other, *until);
                    self.drain(other, until)
                }
            };
            if !ready {
                return false;
            }
            let q = self.streams.get_mut(&stream).expect("looked up above");
            let (_, item) = q.items.pop_front().expect("front checked");
            q.done = seq + 1;
            if let Item::Run(w) = item {
                (w.0)();
            }
        }
    }

    /// With `CUDA_EMU_SEED`: at one call in four, runs all the work of one stream picked
    /// at random among those with work pending.
    fn random_progress(&mut self) {
        let Some(r) = draw() else { return };
        if r % 4 != 0 {
            return;
        }
        let mut busy: Vec<usize> = self
            .streams
            .iter()
            .filter(|(_, q)| !q.items.is_empty())
            .map(|(k, _)| *k)
            .collect();
        if busy.is_empty() {
            return;
        }
        busy.sort_unstable(); // HashMap order is not reproducible; the seed's choice is
        let pick = busy[(r / 4) as usize % busy.len()];
        self.drain(pick, u64::MAX);
    }

    /// Drains every stream of `device`; false when one of them is blocked.
    fn drain_device(&mut self, device: c_int) -> bool {
        let mut keys: Vec<usize> = self
            .streams
            .iter()
            .filter(|(_, q)| q.device == device)
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        let mut all = true;
        for k in keys {
            all &= self.drain(k, u64::MAX);
        }
        all
    }

    fn push(&mut self, stream: usize, device: c_int, item: Item) -> u64 {
        let q = self.streams.entry(stream).or_insert(StreamQueue {
            device,
            next: 0,
            done: 0,
            items: VecDeque::new(),
        });
        let seq = q.next;
        q.next += 1;
        q.items.push_back((seq, item));
        seq
    }
}

fn with<R>(f: impl FnOnce(&mut Scheduler) -> R) -> R {
    let mut g = lock();
    f(g.get_or_insert_with(Scheduler::default))
}

/// Calls `f` under the lock until it returns true, releasing the lock between tries (a
/// host synchronization on work that waits for another thread or process).
fn until(mut f: impl FnMut(&mut Scheduler) -> bool) {
    let mut pause = std::time::Duration::from_micros(5);
    while !with(&mut f) {
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(2));
    }
}

/// Issues `work` on `stream` of `device` (stream 0: the legacy default stream, which waits
/// for the device's other work and runs at once). On a capturing stream the work becomes a
/// node of the capture; the error is the capture's (`capture.rs`).
pub fn issue(stream: usize, device: c_int, work: Work) -> Result<(), u32> {
    if stream == 0 {
        with(|s| s.captures.refuse_sync(0))?;
        let mut work = Some(work);
        until(|s| {
            if !s.drain_device(device) {
                return false;
            }
            if let Some(w) = work.take() {
                (w.0)();
            }
            true
        });
        return Ok(());
    }
    with(|s| {
        if s.captures.of(stream).is_some() {
            return s.captures.record(stream, Node::Run(work)).map(drop);
        }
        s.push(stream, device, Item::Run(work));
        if eager() {
            s.drain(stream, u64::MAX);
        }
        s.random_progress();
        Ok(())
    })
}

/// Issues a collective on `stream` (never the legacy stream: collectives name their
/// stream): `make` makes its work. Queued, it is made once now (taking the communicator's
/// next sequence number at issue, as NCCL's kernel is enqueued then); on a capturing stream
/// the recipe becomes a node of the capture, made anew at each launch of the graph.
pub fn issue_poll(stream: usize, device: c_int, make: MakePoll) -> Result<(), u32> {
    with(|s| {
        if s.captures.of(stream).is_some() {
            return s.captures.record(stream, Node::Poll(make)).map(drop);
        }
        s.push(stream, device, Item::Poll(make.make()));
        if eager() {
            s.drain(stream, u64::MAX);
        }
        s.random_progress();
        Ok(())
    })
}

/// Makes `stream` wait for `point` (`cuStreamWaitEvent`): a captured point joins the
/// stream to its capture; a capturing stream waiting on work outside its capture is refused
/// (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`).
pub fn wait(stream: usize, device: c_int, point: Point) -> Result<(), u32> {
    let mark = match point {
        Point::Captured(at) => {
            if stream == 0 {
                return with(|s| s.captures.refuse_sync(0));
            }
            return with(|s| s.captures.wait(stream, at));
        }
        Point::Queued(mark) => mark,
    };
    if stream == 0 {
        with(|s| s.captures.refuse_sync(0))?;
        until(|s| s.drain_device(device) && s.drain(mark.stream, mark.seq));
        return Ok(());
    }
    with(|s| {
        if let Some(id) = s.captures.of(stream) {
            return Err(s.captures.invalidate(id, capture::ISOLATION));
        }
        s.push(
            stream,
            device,
            Item::Wait {
                stream: mark.stream,
                seq: mark.seq,
            },
        );
        if eager() {
            s.drain(stream, u64::MAX);
        }
        s.random_progress();
        Ok(())
    })
}

/// The point after everything issued to `stream` so far, or None when that is nothing
/// pending (`cuEventRecord`); on a capturing stream, its last node.
pub fn mark(stream: usize) -> Option<Point> {
    with(|s| {
        if s.captures.of(stream).is_some() {
            return s.captures.last(stream).map(Point::Captured);
        }
        let q = s.streams.get(&stream)?;
        (q.next > q.done).then(|| {
            Point::Queued(Mark {
                stream,
                seq: q.next - 1,
            })
        })
    })
}

/// On a capturing `stream`: the point after its last node (`cuEventRecord` there), an
/// empty node first when it has none yet (an origin just begun); None outside captures.
pub fn captured_mark(stream: usize) -> Option<Point> {
    with(|s| {
        s.captures.of(stream)?;
        if let Some(at) = s.captures.last(stream) {
            return Some(Point::Captured(at));
        }
        s.captures
            .record(stream, Node::Run(Work::new(|| {})))
            .ok()
            .map(Point::Captured)
    })
}

/// A host synchronization of `stream` (0: the legacy stream) or of `point`, checked
/// against the captures in progress: `Err` with the driver's error when it would wait for
/// captured work (the capture is invalidated), or, for `unsafe_call`, when a capture that
/// is not relaxed forbids it (event queries and synchronizations, allocations and frees).
pub fn check_capture(
    stream: Option<usize>,
    point: Option<Point>,
    unsafe_call: bool,
) -> Result<(), u32> {
    with(|s| {
        if let Some(st) = stream {
            s.captures.refuse_sync(st)?;
        }
        if let Some(Point::Captured(at)) = point {
            if s.captures.is_active(at.capture) {
                return Err(s.captures.invalidate(at.capture, capture::UNSUPPORTED));
            }
        }
        if unsafe_call {
            s.captures.refuse_unsafe()?;
        }
        Ok(())
    })
}

/// Runs `f` on the capture table (begin, end, status of captures).
pub fn captures<R>(f: impl FnOnce(&mut Captures) -> R) -> R {
    with(|s| f(&mut s.captures))
}

/// Pushes a graph's nodes for one launch: the origin's on `stream`, captured stream `i`'s
/// on the queue `lanes[i - 1]` (a key no real stream has), with its waits between them.
pub fn launch(graph: &capture::Graph, stream: usize, device: c_int, lanes: &[usize]) {
    with(|s| {
        let key = |sid: usize| if sid == 0 { stream } else { lanes[sid - 1] };
        // The sequence number each node got in its queue.
        let mut seqs: Vec<Vec<u64>> = graph
            .streams
            .iter()
            .map(|l| Vec::with_capacity(l.len()))
            .collect();
        let mut next = vec![0usize; graph.streams.len()];
        for &sid in &graph.order {
            let node = &graph.streams[sid][next[sid]];
            next[sid] += 1;
            let item = match node {
                Node::Run(w) => Item::Run(w.clone()),
                Node::Poll(make) => Item::Poll(make.make()),
                Node::Wait { sid: other, idx } => Item::Wait {
                    stream: key(*other),
                    seq: seqs[*other][*idx],
                },
            };
            let seq = s.push(key(sid), device, item);
            seqs[sid].push(seq);
        }
        if eager() {
            s.drain(stream, u64::MAX);
        }
        s.random_progress();
    })
}

/// Whether the work up to `mark` has run.
pub fn is_complete(mark: Mark) -> bool {
    with(|s| {
        s.streams
            .get(&mark.stream)
            .is_none_or(|q| q.done > mark.seq)
    })
}

/// Runs what can run up to `mark` without waiting (`cuEventQuery`: the poll lets the
/// "device" make progress); true when all of it has.
pub fn try_complete(mark: Mark) -> bool {
    with(|s| s.drain(mark.stream, mark.seq))
}

/// Runs everything up to `mark`, waiting for blocked collectives (`cuEventSynchronize`).
pub fn complete(mark: Mark) {
    until(|s| s.drain(mark.stream, mark.seq))
}

/// Runs everything issued to `stream` (`cuStreamSynchronize`); 0 means the whole device.
pub fn synchronize(stream: usize, device: c_int) {
    until(|s| {
        if stream == 0 {
            s.drain_device(device)
        } else {
            s.drain(stream, u64::MAX)
        }
    })
}

/// Runs everything issued on `device` (`cuCtxSynchronize`, `cuMemFree`).
pub fn synchronize_device(device: c_int) {
    until(|s| s.drain_device(device))
}

/// Runs `stream`'s work and forgets it (`cuStreamDestroy`: pending work still completes).
pub fn destroy(stream: usize) {
    until(|s| {
        if !s.drain(stream, u64::MAX) {
            return false;
        }
        s.streams.remove(&stream);
        true
    })
}
