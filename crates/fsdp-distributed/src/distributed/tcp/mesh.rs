//! One group's full mesh of TCP streams: set up through the store, then one reader thread
//! per peer that drains its stream into this rank's inbox.
//!
//! Set-up (every member): bind a listener on the interface that reaches the store, publish
//! `addr/<group rank>` in the group's [`PrefixStore`](crate::distributed::PrefixStore),
//! wait for every member's address, connect to every lower rank (handshake, ack) and accept
//! every higher one. A connection that fails the job handshake (`mesh_auth.rs`) is refused
//! and logged, one whose handshake is not this group's is dropped (a stray client); a rank
//! claimed twice or a different group size is an error.
//!
//! Because every peer's stream is always being read, a rank can write any amount to any
//! peer without waiting for that peer to read: no collective can deadlock on full socket
//! buffers, and a peer that closes its stream or sends `ABORT`/`BYE` is noticed while this
//! rank waits, whatever it waits for.

use super::wire::{self, kind, Handshake, Payload, BYTE_ORDER, HANDSHAKE_LEN};
use crate::distributed::backoff::Backoff;
use crate::distributed::waiting::Pacer;
use crate::distributed::{JobAuth, Store};
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Why a peer's stream ended.
#[derive(Debug, Clone)]
pub(super) enum Closed {
    /// It sent `BYE`: it left the group.
    Bye,
    /// It sent `ABORT` with its error.
    Abort(String),
    /// The stream ended without a word (the process exited or was killed).
    Eof,
    /// Reading failed, or the peer sent bytes that are not this protocol.
    Error(String),
}

/// The first failure any peer reported (`ABORT`) in any group of this rank's world: every
/// later collective of every group fails with it at once, as in the `threads` backend.
#[derive(Default)]
pub(super) struct WorldFailure {
    first: OnceLock<(usize, String)>,
    inboxes: Mutex<Vec<Weak<Inbox>>>,
}

impl WorldFailure {
    /// Records that world rank `rank` failed (the first record is kept) and wakes every
    /// waiting collective of the world.
    pub(super) fn record(&self, rank: usize, reason: String) {
        let _ = self.first.set((rank, reason));
        let inboxes: Vec<Arc<Inbox>> = {
            let mut l = self.inboxes.lock();
            l.retain(|w| w.strong_count() > 0);
            l.iter().filter_map(Weak::upgrade).collect()
        };
        for i in inboxes {
            let _g = i.state.lock();
            i.cv.notify_all();
        }
    }

    /// The cause to report for `e`, an error of the store while a group is set up: a peer
    /// that fails aborts its world (an `ABORT` on every stream) and then its process ends,
    /// closing the store it hosts, so a rank waiting in the store sees the store go first
    /// and the peer's reason a moment later. The reason is what the user needs, so it is
    /// awaited up to [`CAUSE_GRACE`] and preferred when it comes; else `e` stands.
    pub(super) fn cause_of(&self, e: Error) -> Error {
        if matches!(e, Error::Timeout { .. }) {
            return e;
        }
        let until = Instant::now() + CAUSE_GRACE;
        loop {
            if let Some(failed) = self.error() {
                return failed;
            }
            if Instant::now() >= until {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The recorded failure as the error peers see.
    pub(super) fn error(&self) -> Option<Error> {
        self.first.get().map(|(r, why)| Error::PeerFailed {
            failed_rank: *r,
            reason: why.clone(),
        })
    }
}

/// Frames received from each peer, and which peers' streams ended.
pub(super) struct Inbox {
    state: Mutex<InboxState>,
    cv: Condvar,
}

struct InboxState {
    queues: Vec<VecDeque<(u8, Payload)>>,
    closed: Vec<Option<Closed>>,
    /// Set when this rank closed the mesh (left or failed): its waits end at once.
    left: bool,
}

/// This rank's side of one group's mesh.
pub(super) struct Mesh {
    /// This rank's index in the group.
    pub(super) rank: usize,
    /// World ranks of the members, by group rank.
    pub(super) members: Vec<usize>,
    writers: Vec<Option<Mutex<TcpStream>>>,
    /// A clone of each peer's stream, to shut it without its writer's lock (`cut`).
    raw: Vec<Option<TcpStream>>,
    inbox: Arc<Inbox>,
    failure: Arc<WorldFailure>,
    timeout: Duration,
    /// Set once this rank closed the mesh.
    shut: AtomicBool,
}

/// Where a mesh is being set up, for its errors.
pub(super) struct MeshSpec<'a> {
    /// The group's view of the store (keys `addr/<r>`, `join/<r>`).
    pub(super) store: &'a dyn Store,
    /// What is being set up, for messages: `init_process_group (rendezvous 'HOST:PORT')`.
    pub(super) what: String,
    /// Tells this group's connections from any other's.
    pub(super) tag: u64,
    /// This rank's group rank.
    pub(super) rank: usize,
    /// World ranks of the members, by group rank.
    pub(super) members: Vec<usize>,
    /// The interface to listen on and advertise.
    pub(super) ip: IpAddr,
    pub(super) timeout: Duration,
    /// The job every connection must prove it belongs to.
    pub(super) job: &'a JobAuth,
}

impl MeshSpec<'_> {
    pub(super) fn me(&self) -> usize {
        self.members[self.rank]
    }

    pub(super) fn timeout_err(&self, missing: Vec<usize>) -> Error {
        Error::Timeout {
            op: self.what.clone(),
            rank: self.me(),
            timeout_s: self.timeout.as_secs_f64(),
            missing_ranks: missing,
        }
    }

    fn io(&self, what: String, e: io::Error) -> Error {
        Error::io(format!("{} on rank {}: {what}", self.what, self.me()), e)
    }
}

/// FNV-1a of `s`: the tag of the group named `s`.
pub(super) fn tag_of(s: &str) -> u64 {
    crate::hash::fnv1a(s.as_bytes())
}

/// Sets up this rank's side of the mesh (see the module docs).
///
/// # Errors
/// `Timeout` naming the members that did not publish their address or connect in time;
/// `InvalidArgument` when two members claim one rank or disagree on the group size; `Io`
/// when this rank cannot listen or a member published an address that does not parse.
pub(super) fn connect(spec: MeshSpec<'_>, failure: Arc<WorldFailure>) -> Result<Mesh> {
    let deadline = Instant::now() + spec.timeout;
    let n = spec.members.len();
    let me = spec.rank;
    let joins = spec
        .store
        .add(&format!("join/{me}"), 1)
        .map_err(|e| failure.cause_of(e))?;
    if joins > 1 {
        crate::error::bail_arg!(
            "{}: rank {} joined twice (two processes gave the same rank)",
            spec.what,
            spec.me()
        );
    }
    let listener = TcpListener::bind((spec.ip, 0))
        .map_err(|e| spec.io(format!("listening on {}", spec.ip), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| spec.io("reading the listening address".into(), e))?;
    spec.store
        .set(&format!("addr/{me}"), addr.to_string().as_bytes())
        .map_err(|e| failure.cause_of(e))?;
    let keys: Vec<String> = (0..n).map(|r| format!("addr/{r}")).collect();
    wait_for_addresses(&spec, &keys, deadline).map_err(|e| failure.cause_of(e))?;
    let hello = |rank: usize| Handshake {
        tag: spec.tag,
        size: n as u32,
        rank: rank as u32,
        byte_order: BYTE_ORDER,
    };
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    for p in 0..me {
        let raw = spec.store.get(&keys[p]).map_err(|e| failure.cause_of(e))?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let peer: SocketAddr = text.parse().map_err(|_| {
            spec.io(
                format!("rank {} published the address '{text}'", spec.members[p]),
                io::ErrorKind::InvalidData.into(),
            )
        })?;
        let mut s = connect_until(&peer, deadline)
            .ok_or_else(|| spec.timeout_err(vec![spec.members[p]]))?;
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(remaining(deadline)));
        super::mesh_auth::dial(&spec, &mut s, p, &peer)?;
        s.write_all(&hello(me).encode())
            .map_err(|e| spec.io(format!("greeting rank {}", spec.members[p]), e))?;
        let ack = read_handshake(&mut s).map_err(|e| {
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                spec.timeout_err(vec![spec.members[p]])
            } else {
                spec.io(format!("reading rank {}'s answer", spec.members[p]), e)
            }
        })?;
        check_peer(&spec, ack, p)?;
        streams[p] = Some(s);
    }
    accept_higher(&spec, &listener, &mut streams, deadline, hello(me))?;
    drop(listener);
    start(spec, streams, failure)
}

/// How long a store error while a group is set up waits for a peer's recorded failure
/// ([`WorldFailure::cause_of`]): a failed peer's `ABORT` reaches this rank
/// milliseconds after its store's end does; this only runs on a path that already failed.
const CAUSE_GRACE: Duration = Duration::from_secs(2);

/// How long one wait for the members' addresses lasts before this rank looks which are
/// still missing: what it reports if the store goes away (its host gave up) meanwhile.
const ADDRESS_POLL: Duration = Duration::from_millis(200);

/// How close to the deadline the store's host may give up for its loss to be the timeout:
/// the host's deadline is about this rank's.
const STORE_HOST_SLACK: Duration = Duration::from_secs(5);

/// Waits until every member published its address; on timeout names the ones that did not.
/// A store lost long before the deadline is rank 0's failure (`PeerFailed`), naming it.
fn wait_for_addresses(spec: &MeshSpec<'_>, keys: &[String], deadline: Instant) -> Result<()> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut missing: Option<Vec<usize>> = None;
    let mut pace = Pacer::new(spec.me(), spec.timeout);
    loop {
        let slice = deadline
            .saturating_duration_since(Instant::now())
            .min(ADDRESS_POLL);
        let res = spec.store.wait_timeout(&refs, slice);
        let store_gone = |e: Error, missing: Option<Vec<usize>>| {
            match missing {
            // The store's host (rank 0) gave up at its deadline, which is about ours.
            Some(m) if Instant::now() + STORE_HOST_SLACK >= deadline => spec.timeout_err(m),
            // Long before it: the host is gone (killed, its machine unreachable).
            m => Error::PeerFailed {
                failed_rank: 0,
                reason: format!(
                    "{} on rank {}: lost the rendezvous store that rank 0 hosts, while waiting for {}: {e}",
                    spec.what,
                    spec.me(),
                    m.map_or("the members' addresses".into(), |m| format!("ranks {m:?} to join"))
                ),
            },
        }
        };
        match res {
            Ok(()) => return Ok(()),
            Err(Error::Timeout { .. }) => {
                let mut now_missing = Vec::new();
                for (r, k) in refs.iter().enumerate() {
                    match spec.store.check(&[k]) {
                        Ok(true) => {}
                        Ok(false) => now_missing.push(spec.members[r]),
                        Err(e) => return Err(store_gone(e, missing)),
                    }
                }
                if Instant::now() >= deadline {
                    return Err(spec.timeout_err(now_missing));
                }
                pace.tick(|| format!("{}: ranks {now_missing:?} have not joined", spec.what));
                missing = Some(now_missing);
            }
            Err(e) => return Err(store_gone(e, missing)),
        }
    }
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn connect_until(addr: &SocketAddr, deadline: Instant) -> Option<TcpStream> {
    let mut backoff = Backoff::new(
        Duration::from_millis(1),
        Duration::from_millis(50),
        deadline,
    );
    loop {
        if let Ok(s) =
            TcpStream::connect_timeout(addr, remaining(deadline).min(Duration::from_secs(2)))
        {
            return Some(s);
        }
        if !backoff.wait() {
            return None;
        }
    }
}

fn read_handshake(s: &mut TcpStream) -> io::Result<Option<Handshake>> {
    let mut b = [0u8; HANDSHAKE_LEN];
    s.read_exact(&mut b)?;
    Ok(Handshake::decode(&b))
}

/// Checks a peer's handshake claiming to be group rank `expect` (any higher rank when
/// `None`); returns its rank.
fn check_peer(spec: &MeshSpec<'_>, h: Option<Handshake>, expect: usize) -> Result<usize> {
    let bad = |why: String| spec.io(why, io::ErrorKind::InvalidData.into());
    let Some(h) = h else {
        return Err(bad(format!(
            "the peer at rank {}'s address does not speak this protocol",
            spec.members[expect]
        )));
    };
    if h.byte_order != BYTE_ORDER {
        return Err(Error::Unsupported(format!(
            "{}: rank {} runs on a host of another byte order",
            spec.what, spec.members[expect]
        )));
    }
    if h.tag != spec.tag || h.rank as usize != expect {
        return Err(bad(format!(
            "the peer at rank {}'s address belongs to another group",
            spec.members[expect]
        )));
    }
    if h.size as usize != spec.members.len() {
        crate::error::bail_arg!(
            "{}: rank {} has a group of {} ranks but rank {} has {}",
            spec.what,
            spec.me(),
            spec.members.len(),
            spec.members[expect],
            h.size
        );
    }
    Ok(expect)
}

/// Accepts the connections of every higher rank, until `deadline`.
fn accept_higher(
    spec: &MeshSpec<'_>,
    listener: &TcpListener,
    streams: &mut [Option<TcpStream>],
    deadline: Instant,
    mine: Handshake,
) -> Result<()> {
    let n = streams.len();
    let me = spec.rank;
    listener
        .set_nonblocking(true)
        .map_err(|e| spec.io("configuring the listener".into(), e))?;
    let mut gate = super::mesh_auth::Gate::default();
    let mut pace = Pacer::new(spec.me(), spec.timeout);
    while streams[me + 1..].iter().any(Option::is_none) {
        let missing = || -> Vec<usize> {
            (me + 1..n)
                .filter(|&r| streams[r].is_none())
                .map(|r| spec.members[r])
                .collect()
        };
        if Instant::now() >= deadline {
            return Err(spec.timeout_err(missing()));
        }
        pace.tick(|| format!("{}: ranks {:?} have not connected", spec.what, missing()));
        let (mut s, from) = match listener.accept() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(spec.io("accepting a peer".into(), e)),
        };
        let _ = s.set_nonblocking(false);
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(2))));
        if !gate.pass(spec, &mut s, from) {
            continue;
        }
        // A connection that is not a peer of this group (a stray client, a port scan) is
        // dropped and the wait goes on.
        let Ok(Some(h)) = read_handshake(&mut s) else {
            continue;
        };
        let r = h.rank as usize;
        if h.tag != spec.tag || r <= me || r >= n {
            continue;
        }
        check_peer(spec, Some(h), r)?;
        if streams[r].is_some() {
            crate::error::bail_arg!(
                "{}: rank {} connected twice (two processes gave the same rank)",
                spec.what,
                spec.members[r]
            );
        }
        s.write_all(&mine.encode())
            .map_err(|e| spec.io(format!("answering rank {}", spec.members[r]), e))?;
        streams[r] = Some(s);
    }
    Ok(())
}

/// Starts one reader thread per peer and returns the mesh.
fn start(
    spec: MeshSpec<'_>,
    streams: Vec<Option<TcpStream>>,
    failure: Arc<WorldFailure>,
) -> Result<Mesh> {
    let n = streams.len();
    let inbox = Arc::new(Inbox {
        state: Mutex::new(InboxState {
            queues: (0..n).map(|_| VecDeque::new()).collect(),
            closed: vec![None; n],
            left: false,
        }),
        cv: Condvar::new(),
    });
    failure.inboxes.lock().push(Arc::downgrade(&inbox));
    let mut writers = Vec::with_capacity(n);
    let mut raw = Vec::with_capacity(n);
    for (p, s) in streams.into_iter().enumerate() {
        let Some(s) = s else {
            writers.push(None);
            raw.push(None);
            continue;
        };
        raw.push(s.try_clone().ok());
        let _ = s.set_read_timeout(None);
        let _ = s.set_write_timeout(Some(spec.timeout));
        let reader = s
            .try_clone()
            .map_err(|e| spec.io("cloning a peer stream".into(), e))?;
        let (ib, fl, peer) = (inbox.clone(), failure.clone(), spec.members[p]);
        std::thread::Builder::new()
            .name(format!("tcp-pg-{}-from-{peer}", spec.me()))
            .spawn(move || read_loop(reader, p, peer, &ib, &fl))
            .map_err(|e| spec.io("starting a reader thread".into(), e))?;
        writers.push(Some(Mutex::new(s)));
    }
    Ok(Mesh {
        rank: spec.rank,
        members: spec.members,
        writers,
        raw,
        inbox,
        failure,
        timeout: spec.timeout,
        shut: AtomicBool::new(false),
    })
}

/// Drains peer `p`'s stream into the inbox until it ends.
fn read_loop(mut s: TcpStream, p: usize, world_rank: usize, inbox: &Inbox, failure: &WorldFailure) {
    let closed = loop {
        match wire::read_frame(&mut s) {
            Ok(Some((k @ (kind::HEADER | kind::DATA), payload))) => {
                let mut st = inbox.state.lock();
                st.queues[p].push_back((k, payload));
                inbox.cv.notify_all();
            }
            Ok(Some((kind::ABORT, payload))) => {
                let why = String::from_utf8_lossy(payload.bytes()).into_owned();
                failure.record(world_rank, why.clone());
                break Closed::Abort(why);
            }
            Ok(Some((kind::BYE, _))) => break Closed::Bye,
            Ok(Some((k, _))) => break Closed::Error(format!("sent an unknown frame kind {k}")),
            Ok(None) => break Closed::Eof,
            Err(e) => break Closed::Error(e.to_string()),
        }
    };
    let mut st = inbox.state.lock();
    st.closed[p] = Some(closed);
    inbox.cv.notify_all();
}

impl Mesh {
    /// Number of members.
    pub(super) fn size(&self) -> usize {
        self.members.len()
    }

    /// Whether this rank closed the mesh.
    pub(super) fn has_left(&self) -> bool {
        self.shut.load(Ordering::SeqCst)
    }

    /// World rank of this rank.
    pub(super) fn me(&self) -> usize {
        self.members[self.rank]
    }

    /// The error for a peer whose stream ended while `op` needed it.
    fn closed_error(&self, p: usize, why: &Closed, op: &str) -> Error {
        let r = self.members[p];
        let reason = match why {
            Closed::Bye => format!("rank {r} exited without calling {op} (it left the group)"),
            Closed::Abort(e) => e.clone(),
            Closed::Eof => format!(
                "rank {r} closed its connection during {op} (its process exited or was killed)"
            ),
            Closed::Error(e) => format!("the connection to rank {r} failed during {op}: {e}"),
        };
        Error::PeerFailed {
            failed_rank: r,
            reason,
        }
    }

    /// The world's recorded failure, if any.
    pub(super) fn world_failure(&self) -> Option<Error> {
        self.failure.error()
    }

    /// Waits until every group rank in `from` has a frame queued, then pops one from each
    /// (in `from`'s order).
    ///
    /// # Errors
    /// `PeerFailed` naming a peer whose stream ended (or any failure recorded in the world);
    /// `Timeout` naming the peers still silent at `deadline`.
    pub(super) fn recv(
        &self,
        from: &[usize],
        op: &str,
        deadline: Instant,
    ) -> Result<Vec<(u8, Payload)>> {
        let mut st = self.inbox.state.lock();
        let mut pace = Pacer::new(self.me(), self.timeout);
        loop {
            if from.iter().all(|&p| !st.queues[p].is_empty()) {
                return Ok(from
                    .iter()
                    .filter_map(|&p| st.queues[p].pop_front())
                    .collect());
            }
            if let Some(e) = self.failure.error() {
                return Err(e);
            }
            if st.left {
                crate::error::bail_arg!(
                    "{op}: rank {} left the group while waiting (destroy_process_group)",
                    self.me()
                );
            }
            if let Some((p, why)) = from
                .iter()
                .filter(|&&p| st.queues[p].is_empty())
                .find_map(|&p| st.closed[p].as_ref().map(|c| (p, c)))
            {
                return Err(self.closed_error(p, why, op));
            }
            if self
                .inbox
                .cv
                .wait_until(&mut st, pace.until(deadline))
                .timed_out()
            {
                let missing: Vec<usize> = from
                    .iter()
                    .filter(|&&p| st.queues[p].is_empty())
                    .map(|&p| self.members[p])
                    .collect();
                if missing.is_empty() {
                    continue;
                }
                if Instant::now() < deadline {
                    pace.tick(|| format!("{op}: ranks {missing:?} have not arrived"));
                    continue;
                }
                return Err(Error::Timeout {
                    op: op.to_string(),
                    rank: self.me(),
                    timeout_s: self.timeout.as_secs_f64(),
                    missing_ranks: missing,
                });
            }
        }
    }

    /// Sends one frame to group rank `to`.
    ///
    /// # Errors
    /// `PeerFailed` naming `to` when its connection is gone; `Timeout` naming it when it
    /// did not take the bytes within the group timeout.
    pub(super) fn send(&self, to: usize, k: u8, payload: &[u8], op: &str) -> Result<()> {
        let Some(w) = &self.writers[to] else {
            return Ok(());
        };
        let res = wire::write_frame(&mut *w.lock(), k, payload);
        res.map_err(|e| {
            if let Some(f) = self.failure.error() {
                return f;
            }
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                return Error::Timeout {
                    op: op.to_string(),
                    rank: self.me(),
                    timeout_s: self.timeout.as_secs_f64(),
                    missing_ranks: vec![self.members[to]],
                };
            }
            let closed = self.inbox.state.lock().closed[to].clone();
            let why = closed.unwrap_or(Closed::Error(e.to_string()));
            self.closed_error(to, &why, op)
        })
    }

    /// Shuts the stream to world rank `rank` both ways, if it is a member: a send blocked
    /// on it returns, and its reader thread ends (for a peer found dead by the heartbeat).
    pub(super) fn cut(&self, rank: usize) {
        if let Some(Some(s)) = self
            .members
            .iter()
            .position(|&m| m == rank)
            .map(|p| &self.raw[p])
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Sends `farewell` (`ABORT` with a reason, or `BYE`) to every peer, best effort, and
    /// closes every stream; the reader threads end. Idempotent.
    pub(super) fn close(&self, farewell: Option<(u8, &[u8])>) {
        if self.shut.swap(true, Ordering::SeqCst) {
            return;
        }
        {
            let mut st = self.inbox.state.lock();
            st.left = true;
            self.inbox.cv.notify_all();
        }
        for w in self.writers.iter().flatten() {
            let mut s = w.lock();
            if let Some((k, payload)) = farewell {
                let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = wire::write_frame(&mut *s, k, payload);
            }
            // Our side only: the reader thread drains the peer until it closes too, so no
            // unread bytes turn the close into a reset that could lose the farewell.
            let _ = s.shutdown(Shutdown::Write);
        }
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.close(Some((kind::BYE, &[])));
    }
}
