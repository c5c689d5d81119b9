//! Stream capture and graphs: work issued on a capturing stream is recorded, not run.
//!
//! As the driver's `cuStreamBeginCapture` ... `cuStreamEndCapture`: the origin stream
//! starts a capture; every kernel, copy, memset, GEMM and NCCL collective issued on a stream
//! of the capture becomes a node of the graph instead of work in the stream's queue (an
//! event recorded there adds no node: it marks the stream's last node, as the driver's
//! event then holds the capture's current dependencies). A stream
//! joins the capture when it waits on an event recorded in it (the fork of a multi-stream
//! capture), and must have rejoined the origin (the origin waits, directly or through other
//! streams, on its last node) by the end of the capture, or the end fails with
//! `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`.
//!
//! The nodes are kept per captured stream, in issue order, with the event waits between
//! streams as edges. A collective is kept as the recipe of its call (communicator, op,
//! buffers): each launch makes a fresh collective of it, which takes the communicator's next
//! sequence number when the launch queues it, so the ranks' replays meet as their eager
//! collectives do (NCCL >= 2.9 captures collectives the same way: a kernel node per call). A launch (`cuGraphLaunch`) puts the origin's nodes on the launch
//! stream and every other captured stream's nodes on a stream queue of its own, with the
//! same waits between them: the replay keeps the graph's ordering, and only it, so a node
//! that reads memory another node of a concurrent branch writes without an edge reads stale
//! memory here as on the device.
//!
//! What the driver refuses during a capture is refused here too (`driver/` calls
//! [`Captures::refuse_unsafe`] and the checks of `queue.rs`): a host synchronization of
//! captured work (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), work on the legacy stream
//! (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`), a capturing stream waiting on an event recorded
//! outside the capture (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`), and, unless the capture is
//! in relaxed mode, "potentially unsafe" calls from any thread: allocations and frees,
//! event queries and synchronizations (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`). A refused
//! call invalidates the capture: later work on its streams fails with
//! `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` and its end returns that error and no graph.
//! The thread-local mode is treated as the global one (the emulator does not track which
//! thread began a capture); fsdp captures in global mode, PyTorch's default.

use crate::queue::{Poll, Work};
use std::collections::HashMap;
use std::sync::Arc;

pub const UNSUPPORTED: u32 = 900;
pub const INVALIDATED: u32 = 901;
pub const MERGE: u32 = 902;
pub const UNMATCHED: u32 = 903;
pub const UNJOINED: u32 = 904;
pub const ISOLATION: u32 = 905;
pub const IMPLICIT: u32 = 906;
pub const ILLEGAL_STATE: u32 = 401;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
pub const MODE_RELAXED: u32 = 2;

/// Makes the work of one launch of a captured collective (`nccl/`): a fresh [`Poll`] each
/// time, with the communicator's next sequence number.
#[derive(Clone)]
pub struct MakePoll(Arc<dyn Fn() -> Poll + 'static>);
// SAFETY: as for `Work`: the recipe holds device addresses, copied values and the shared
// communicator state.
unsafe impl Send for MakePoll {}

impl MakePoll {
    pub fn new(f: impl Fn() -> Poll + 'static) -> MakePoll {
        MakePoll(Arc::new(f))
    }

    /// The work of one launch.
    pub fn make(&self) -> Poll {
        (self.0)()
    }
}

/// A node of a captured stream.
#[derive(Clone)]
pub enum Node {
    /// A kernel, copy, memset, GEMM (or the marker of an event recorded on an origin that
    /// had no node yet).
    Run(Work),
    /// A collective: made anew at each launch.
    Poll(MakePoll),
    /// Waits for node `idx` of captured stream `sid` (an event wait across streams).
    Wait { sid: usize, idx: usize },
}

/// A finished capture: the nodes of each captured stream (stream 0 is the origin), and the
/// order they were issued in (a valid order to push them for a replay).
#[derive(Clone, Default)]
pub struct Graph {
    pub streams: Vec<Vec<Node>>,
    pub order: Vec<usize>,
}

/// A point in a capture: after node `idx` of its captured stream `sid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Captured {
    pub capture: usize,
    pub sid: usize,
    pub idx: usize,
}

struct Capture {
    origin: usize,
    mode: u32,
    /// Real stream handle of each captured stream (index: sid).
    handles: Vec<usize>,
    graph: Graph,
    /// The error that invalidated the capture.
    invalid: Option<u32>,
}

/// Every capture in progress (one table, under the scheduler's lock).
#[derive(Default)]
pub struct Captures {
    next: usize,
    active: HashMap<usize, Capture>,
    /// Stream handle -> capture id, for every stream of a capture in progress.
    streams: HashMap<usize, usize>,
}

impl Captures {
    /// Whether any capture is in progress.
    pub fn any(&self) -> bool {
        !self.active.is_empty()
    }

    /// The capture `stream` belongs to, if any.
    pub fn of(&self, stream: usize) -> Option<usize> {
        self.streams.get(&stream).copied()
    }

    /// `cuStreamIsCapturing`: 0 none, 1 active, 2 invalidated.
    pub fn status(&self, stream: usize) -> u32 {
        match self.of(stream).and_then(|c| self.active.get(&c)) {
            None => 0,
            Some(c) if c.invalid.is_some() => 2,
            Some(_) => 1,
        }
    }

    /// Whether capture `id` is still in progress.
    pub fn is_active(&self, id: usize) -> bool {
        self.active.contains_key(&id)
    }

    /// Starts a capture with `stream` as its origin.
    pub fn begin(&mut self, stream: usize, mode: u32) -> Result<(), u32> {
        if stream == 0 || self.streams.contains_key(&stream) {
            return Err(ILLEGAL_STATE);
        }
        let id = self.next;
        self.next += 1;
        self.active.insert(
            id,
            Capture {
                origin: stream,
                mode,
                handles: vec![stream],
                graph: Graph {
                    streams: vec![Vec::new()],
                    order: Vec::new(),
                },
                invalid: None,
            },
        );
        self.streams.insert(stream, id);
        Ok(())
    }

    /// Marks capture `id` invalid with `why` (kept: the first error) and returns `why`.
    pub fn invalidate(&mut self, id: usize, why: u32) -> u32 {
        if let Some(c) = self.active.get_mut(&id) {
            c.invalid.get_or_insert(why);
        }
        why
    }

    /// A "potentially unsafe" call (allocation, free, event query or synchronization) made
    /// while captures are in progress: refused, invalidating them, unless all are relaxed.
    pub fn refuse_unsafe(&mut self) -> Result<(), u32> {
        let strict: Vec<usize> = self
            .active
            .iter()
            .filter(|(_, c)| c.mode != MODE_RELAXED)
            .map(|(k, _)| *k)
            .collect();
        if strict.is_empty() {
            return Ok(());
        }
        for id in strict {
            self.invalidate(id, UNSUPPORTED);
        }
        Err(UNSUPPORTED)
    }

    /// A host synchronization of `stream` (0: the legacy stream, which synchronizes with
    /// every stream): refused when it would wait for captured work.
    pub fn refuse_sync(&mut self, stream: usize) -> Result<(), u32> {
        if stream == 0 && self.any() {
            let ids: Vec<usize> = self.active.keys().copied().collect();
            for id in ids {
                self.invalidate(id, IMPLICIT);
            }
            return Err(IMPLICIT);
        }
        match self.of(stream) {
            Some(id) => Err(self.invalidate(id, UNSUPPORTED)),
            None => Ok(()),
        }
    }

    fn sid(&self, id: usize, stream: usize) -> usize {
        self.active[&id]
            .handles
            .iter()
            .position(|h| *h == stream)
            .expect("a stream of the capture")
    }

    /// Records `node` on capturing `stream`; the point after it.
    pub fn record(&mut self, stream: usize, node: Node) -> Result<Captured, u32> {
        let id = self.of(stream).ok_or(ILLEGAL_STATE)?;
        let sid = self.sid(id, stream);
        let c = self.active.get_mut(&id).expect("active capture");
        if c.invalid.is_some() {
            return Err(INVALIDATED);
        }
        let list = &mut c.graph.streams[sid];
        list.push(node);
        c.graph.order.push(sid);
        Ok(Captured {
            capture: id,
            sid,
            idx: list.len() - 1,
        })
    }

    /// The point after the last node of capturing `stream` (None: it has none yet).
    pub fn last(&self, stream: usize) -> Option<Captured> {
        let id = self.of(stream)?;
        let sid = self.sid(id, stream);
        let n = self.active[&id].graph.streams[sid].len();
        (n > 0).then(|| Captured {
            capture: id,
            sid,
            idx: n - 1,
        })
    }

    /// `stream` waits on captured point `at`: a capturing stream of the same capture gets
    /// an edge, a stream outside any capture joins it. Waiting on the point of a capture
    /// that has ended does nothing.
    pub fn wait(&mut self, stream: usize, at: Captured) -> Result<(), u32> {
        if !self.active.contains_key(&at.capture) {
            return match self.of(stream) {
                Some(id) => Err(self.invalidate(id, ISOLATION)),
                None => Ok(()),
            };
        }
        match self.of(stream) {
            Some(id) if id != at.capture => {
                self.invalidate(id, MERGE);
                return Err(self.invalidate(at.capture, MERGE));
            }
            Some(_) => {}
            None => {
                let c = self.active.get_mut(&at.capture).expect("checked");
                c.handles.push(stream);
                c.graph.streams.push(Vec::new());
                self.streams.insert(stream, at.capture);
            }
        }
        self.record(
            stream,
            Node::Wait {
                sid: at.sid,
                idx: at.idx,
            },
        )
        .map(drop)
    }

    /// Ends the capture `stream` began: its graph, or why there is none (the capture ends
    /// either way, and its streams leave it).
    pub fn end(&mut self, stream: usize) -> Result<Graph, u32> {
        let Some(id) = self.of(stream) else {
            return Err(ILLEGAL_STATE);
        };
        if self.active[&id].origin != stream {
            return Err(self.invalidate(id, UNMATCHED));
        }
        let c = self.active.remove(&id).expect("active");
        self.streams.retain(|_, v| *v != id);
        if let Some(e) = c.invalid {
            return Err(e);
        }
        if !all_joined(&c.graph) {
            return Err(UNJOINED);
        }
        Ok(c.graph)
    }
}

/// Whether the origin's last node depends, through stream order and waits, on the last
/// node of every captured stream (each forked stream rejoined the origin).
fn all_joined(g: &Graph) -> bool {
    // reached[s]: the highest node of stream s the origin's end depends on (+1; 0: none).
    let mut reached = vec![0usize; g.streams.len()];
    let mut work = vec![(0usize, g.streams[0].len())];
    while let Some((s, upto)) = work.pop() {
        if upto <= reached[s] {
            continue;
        }
        for node in &g.streams[s][reached[s]..upto] {
            if let Node::Wait { sid, idx } = node {
                work.push((*sid, idx + 1));
            }
        }
        reached[s] = upto;
    }
    g.streams.iter().zip(&reached).all(|(l, r)| *r == l.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> Node {
        Node::Run(Work::new(|| {}))
    }

    #[test]
    fn a_fork_must_rejoin_the_origin() {
        let mut g = Graph {
            streams: vec![vec![run()], vec![Node::Wait { sid: 0, idx: 0 }, run()]],
            order: vec![0, 1, 1],
        };
        assert!(!all_joined(&g), "stream 1's work is not waited on");
        g.streams[0].push(Node::Wait { sid: 1, idx: 0 });
        assert!(!all_joined(&g), "only its first node is waited on");
        g.streams[0].push(Node::Wait { sid: 1, idx: 1 });
        assert!(all_joined(&g));
    }

    #[test]
    fn a_capture_refuses_what_the_driver_refuses() {
        let mut c = Captures::default();
        c.begin(16, 0).unwrap();
        assert_eq!(c.begin(16, 0), Err(ILLEGAL_STATE));
        let p = c.record(16, run()).unwrap();
        // Another stream joins through the event, records, and rejoins.
        c.wait(32, p).unwrap();
        let q = c.record(32, run()).unwrap();
        assert_eq!(c.status(32), 1);
        // Ending from the forked stream is unmatched and invalidates the capture.
        assert_eq!(c.end(32).map(drop), Err(UNMATCHED));
        assert_eq!(c.status(16), 2);
        assert_eq!(c.record(16, run()).map(drop), Err(INVALIDATED));
        assert_eq!(c.end(16).map(drop), Err(UNMATCHED));
        assert_eq!(c.status(16), 0);
        assert!(!c.any());
        // A host synchronization of a captured stream invalidates the capture.
        c.begin(16, 0).unwrap();
        let p = c.record(16, run()).unwrap();
        c.wait(32, p).unwrap();
        let q2 = c.record(32, run()).unwrap();
        assert_ne!(q, q2);
        assert_eq!(c.refuse_sync(32), Err(UNSUPPORTED));
        assert_eq!(c.end(16).map(drop), Err(UNSUPPORTED));
        c.begin(16, 0).unwrap();
        let p = c.record(16, run()).unwrap();
        c.wait(32, p).unwrap();
        let q = c.record(32, run()).unwrap();
        assert_eq!(
            c.end(16).map(drop),
            Err(UNJOINED),
            "stream 32 never rejoined"
        );
        c.begin(16, 0).unwrap();
        let p = c.record(16, run()).unwrap();
        c.wait(32, p).unwrap();
        let q3 = c.record(32, run()).unwrap();
        c.wait(16, q3).unwrap();
        let g = c.end(16).unwrap();
        assert_eq!(g.order, vec![0, 1, 1, 0]);
        // The point of an ended capture: waiting on it from a capture is isolation.
        c.begin(16, 0).unwrap();
        assert_eq!(c.wait(16, q), Err(ISOLATION));
        let _ = c.end(16);
        // Relaxed captures let unsafe calls through; global ones refuse them.
        c.begin(16, MODE_RELAXED).unwrap();
        assert_eq!(c.refuse_unsafe(), Ok(()));
        let _ = c.end(16);
        c.begin(16, 0).unwrap();
        assert_eq!(c.refuse_unsafe(), Err(UNSUPPORTED));
        assert_eq!(c.end(16).map(drop), Err(UNSUPPORTED));
    }
}
