//! The store server: one thread accepting clients, one thread per client serving its
//! requests in order against a shared key-value map (c10d's `TCPStoreBackend`, with threads
//! instead of an event loop: a store serves tens of clients, each mostly idle).
//!
//! Every connection first passes the job handshake (`distributed/auth.rs`, [Note: job
//! auth]): a client of another job, or one that cannot prove the job secret, is refused
//! before it can read or change a key, and the refusal is logged once per peer.
//!
//! At most [`MAX_HANDSHAKES`] connections may be in the handshake at once (each holds a
//! thread for up to [`HANDSHAKE_TIMEOUT`]): beyond that a new connection is answered `BUSY`
//! and closed at once, so that idle or garbage connections cannot grow the server to a
//! thread each. Its clients retry a `BUSY` answer until their timeout. These refusals are
//! counted ([`TcpStoreServer::busy_refusals`]) and logged in one line per
//! [`BUSY_LOG_EVERY`] at most, not one per connection.

use super::protocol::{op, read_frame, status, write_frame, Decoder, Encoder, MAGIC};
use crate::distributed::auth::{self, JobAuth};
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::{HashMap, HashSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest a `WAIT` or `GET` may block in the server, whatever the client asks.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// How long a new connection may take to pass the job handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most connections in the job handshake at once (each with its thread); more are answered
/// `BUSY`. A job's ranks each pass the handshake in about a millisecond, so a burst of a
/// few hundred ranks connecting together only retries a few times.
pub const MAX_HANDSHAKES: usize = 64;

/// Least time between two log lines about `BUSY` refusals.
const BUSY_LOG_EVERY: Duration = Duration::from_secs(30);

/// Distinct refusals remembered (and logged); later ones are dropped silently.
const MAX_REFUSALS: usize = 1024;

/// What the server threads share.
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    /// Signalled on every change of `map` and on stop.
    changed: Condvar,
    stop: AtomicBool,
    /// A clone of every open client stream by connection number, to shut them down on
    /// stop; each serving thread removes its own when its client leaves.
    conns: Mutex<HashMap<u64, TcpStream>>,
    /// The job a client must belong to (and prove, when secured).
    auth: JobAuth,
    /// Random per server: tells a client that hosts this server that it reached it.
    instance: [u8; 16],
    /// `host:port` as bound, for log lines.
    name: String,
    /// Refusal log lines so far, and what was logged (peer IP, role, reason), to log each
    /// refused peer once.
    refused: Mutex<(Vec<String>, HashSet<String>)>,
    /// Connections in the job handshake now.
    handshakes: AtomicUsize,
    /// Connections answered `BUSY` so far, and when that was last logged (with the count
    /// then).
    busy: Mutex<(u64, Option<(Instant, u64)>)>,
    /// The last heartbeat of each rank that beats, by rank; a rank's entry goes when its
    /// heartbeat connection closes (it exited, or was killed: not stale, gone).
    beats: Mutex<HashMap<u64, Instant>>,
}

impl Shared {
    /// Counts a connection from `peer` answered `BUSY`, and logs it when no line was
    /// written in the last [`BUSY_LOG_EVERY`].
    fn note_busy(&self, peer: Option<SocketAddr>) {
        let mut g = self.busy.lock();
        g.0 += 1;
        let now = Instant::now();
        if g.1.is_some_and(|(at, _)| now - at < BUSY_LOG_EVERY) {
            return;
        }
        let since = g.0 - g.1.map_or(0, |(_, n)| n);
        g.1 = Some((now, g.0));
        drop(g);
        let shown = peer.map_or_else(|| "an unknown address".into(), |p| p.to_string());
        auth::log(&format!(
            "fsdp: TCPStore at {}: {MAX_HANDSHAKES} connections are in the job handshake, the most it serves at once; refused {since} more (the latest from {shown}) until they finish or time out ({} s); counted, logged at most every {} s",
            self.name,
            HANDSHAKE_TIMEOUT.as_secs(),
            BUSY_LOG_EVERY.as_secs()
        ));
    }

    /// Logs the refusal of `peer` on stderr once per (peer IP, dialer, reason).
    fn refuse(&self, peer: Option<SocketAddr>, r: &auth::Refusal) {
        let who = format!("fsdp: TCPStore at {}", self.name);
        let shown = peer.map_or_else(|| "an unknown address".into(), |p| p.to_string());
        let key = format!("{:?}|{:?}|{}", peer.map(|p| p.ip()), r.dialer, r.reason);
        let mut g = self.refused.lock();
        if g.1.len() >= MAX_REFUSALS || !g.1.insert(key) {
            return;
        }
        let line = r.line(&who, &shown);
        auth::log(&line);
        g.0.push(line);
    }
}

/// A running store server (`c10d::TCPStore` with `is_master=True` hosts one). Clients
/// connect with [`TcpStore`](super::TcpStore). Dropping it stops the server: the listener
/// closes and every client connection is shut down.
pub struct TcpStoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpStoreServer {
    /// Starts a server listening on `host:port` (port 0: one the OS picks, see
    /// [`local_addr`](Self::local_addr)) for clients without a job id or secret (an open
    /// store, as c10d's). When `host` resolves to no address of this machine (a name that
    /// points elsewhere, as behind NAT) it listens on every interface instead, as c10d does.
    ///
    /// # Errors
    /// `InvalidArgument` when `host` does not resolve; `Io` when the port cannot be bound
    /// (in use, or not permitted), naming it.
    pub fn bind(host: &str, port: u16) -> Result<TcpStoreServer> {
        Self::bind_with_auth(host, port, JobAuth::default())
    }

    /// As [`bind`](Self::bind), for the clients of job `auth` only: a client of another job
    /// id, or (when `auth` has a secret) one that cannot prove it, is refused at connect,
    /// before it can read or change any key; each refusal is logged on stderr once per peer
    /// (`refused a connection from ADDR: ...`, never with the secret) and kept in
    /// [`refused`](Self::refused).
    ///
    /// # Errors
    /// As [`bind`](Self::bind); `Io` when the OS random source fails.
    pub fn bind_with_auth(host: &str, port: u16, auth: JobAuth) -> Result<TcpStoreServer> {
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| {
                Error::InvalidArgument(format!("TCPStore host '{host}' does not resolve: {e}"))
            })?
            .collect();
        let mut last: Option<io::Error> = None;
        let mut listener = None;
        for a in &addrs {
            match TcpListener::bind(a) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let listener = match (listener, last) {
            (Some(l), _) => l,
            (None, Some(e)) if e.kind() == io::ErrorKind::AddrNotAvailable => {
                TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))
                    .map_err(|e| Error::io(format!("TCPStore: binding port {port}"), e))?
            }
            (None, Some(e)) if e.kind() == io::ErrorKind::AddrInUse => {
                return Err(Error::io(
                    format!(
                        "TCPStore: port {port} on {host} is in use (another job holds it, or another program; give each job its own --master-port / MASTER_PORT)"
                    ),
                    e,
                ))
            }
            (None, e) => {
                return Err(Error::io(
                    format!("TCPStore: listening on {host}:{port}"),
                    e.unwrap_or_else(|| io::ErrorKind::AddrNotAvailable.into()),
                ))
            }
        };
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("TCPStore: reading the listening address", e))?;
        let shared = Arc::new(Shared {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            auth,
            instance: auth::instance_id()?,
            name: format!("{host}:{}", addr.port()),
            refused: Mutex::new((Vec::new(), HashSet::new())),
            handshakes: AtomicUsize::new(0),
            busy: Mutex::new((0, None)),
            beats: Mutex::new(HashMap::new()),
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("tcpstore-accept".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| Error::io("TCPStore: starting the server thread", e))?;
        Ok(TcpStoreServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the port the OS picked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The refusals logged so far, one line each: `fsdp: TCPStore at HOST:PORT: refused a
    /// connection from ADDR (ROLE, job 'ID'): REASON`.
    pub fn refused(&self) -> Vec<String> {
        self.shared.refused.lock().0.clone()
    }

    /// Connections answered `BUSY` so far because [`MAX_HANDSHAKES`] others were in the job
    /// handshake.
    pub fn busy_refusals(&self) -> u64 {
        self.shared.busy.lock().0
    }

    /// This server's random instance id (a hosting client checks it reached this server).
    pub(super) fn instance(&self) -> [u8; 16] {
        self.shared.instance
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _m = self.shared.map.lock();
            self.shared.changed.notify_all();
        }
        for (_, c) in self.shared.conns.lock().drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        // Wake the blocking accept with a connection of our own, then wait for the thread
        // so that the port is free when this returns.
        let ip = match self.addr.ip() {
            IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let woke = TcpStream::connect_timeout(
            &SocketAddr::new(ip, self.addr.port()),
            Duration::from_secs(1),
        )
        .is_ok();
        if let Some(h) = self.accept.take() {
            if woke {
                let _ = h.join();
            }
        }
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    let mut next_id = 0u64;
    for conn in listener.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = conn else {
            // A failed accept (the client gave up, or descriptors ran out): keep serving.
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        if sh.handshakes.load(Ordering::SeqCst) >= MAX_HANDSHAKES {
            auth::refuse_busy(&mut stream);
            let _ = stream.shutdown(std::net::Shutdown::Both);
            sh.note_busy(stream.peer_addr().ok());
            continue;
        }
        // Counted down by `serve` when the handshake ends, either way.
        sh.handshakes.fetch_add(1, Ordering::SeqCst);
        let id = next_id;
        next_id += 1;
        if let Ok(clone) = stream.try_clone() {
            sh.conns.lock().insert(id, clone);
        }
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new()
            .name("tcpstore-conn".into())
            .spawn(move || {
                serve(stream, &sh2);
                sh2.conns.lock().remove(&id);
            });
        if spawned.is_err() {
            sh.conns.lock().remove(&id);
            sh.handshakes.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Serves one client until it disconnects, sends bad bytes, or the server stops; a client
/// that does not pass the job handshake is refused before its first request.
fn serve(mut stream: TcpStream, sh: &Shared) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT));
    let passed = auth::accept(&mut stream, &sh.auth, "store");
    sh.handshakes.fetch_sub(1, Ordering::SeqCst);
    if let Err(r) = passed {
        if !sh.stop.load(Ordering::SeqCst) {
            sh.refuse(stream.peer_addr().ok(), &r);
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    // The rank this connection beats for, if it does: forgotten when it closes.
    let mut beating: Option<u64> = None;
    serve_requests(&mut stream, sh, &mut beating);
    if let Some(r) = beating {
        sh.beats.lock().remove(&r);
    }
}

/// Answers the requests of an admitted client until it leaves or errs.
fn serve_requests(stream: &mut TcpStream, sh: &Shared, beating: &mut Option<u64>) {
    let mut greeted = false;
    loop {
        let body = match read_frame(stream) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => {
                let _ = reply_error(stream, &format!("bad request: {e}"));
                return;
            }
        };
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let reply = if greeted && body.first() == Some(&op::HEARTBEAT) {
            heartbeat(sh, &body, beating)
        } else if greeted {
            handle(sh, &body)
        } else {
            greeted = true;
            hello(&body, &sh.instance)
        };
        match reply {
            Ok(r) => {
                if write_frame(stream, &r).is_err() {
                    return;
                }
            }
            Err(e) => {
                // Bad bytes: say why and drop the client (its stream is out of step).
                let _ = reply_error(stream, &format!("bad request: {e}"));
                let _ = stream.shutdown(std::net::Shutdown::Both);
                return;
            }
        }
    }
}

/// A `HEARTBEAT`: records the beat of the rank (this connection beats for it from now on)
/// and answers the ranks whose last beat is older than the given age, the beating rank
/// excepted.
fn heartbeat(sh: &Shared, body: &[u8], beating: &mut Option<u64>) -> io::Result<Vec<u8>> {
    let mut d = Decoder::new(body);
    d.u8("opcode")?;
    let rank = d.u64("rank")?;
    let stale_after = Duration::from_millis(d.u64("stale_after_ms")?);
    d.finish()?;
    let now = Instant::now();
    let mut beats = sh.beats.lock();
    if let Some(old) = beating.replace(rank).filter(|&o| o != rank) {
        beats.remove(&old);
    }
    beats.insert(rank, now);
    let mut stale: Vec<u64> = beats
        .iter()
        .filter(|&(_, &at)| now.duration_since(at) > stale_after)
        .map(|(&r, _)| r)
        .collect();
    drop(beats);
    stale.sort_unstable();
    let mut e = Encoder::new(status::OK).u64(stale.len() as u64);
    for r in stale {
        e = e.u64(r);
    }
    Ok(e.0)
}

fn reply_error(stream: &mut TcpStream, msg: &str) -> io::Result<()> {
    write_frame(stream, &Encoder::new(status::ERROR).bytes(msg.as_bytes()).0)
}

fn hello(body: &[u8], instance: &[u8; 16]) -> io::Result<Vec<u8>> {
    let mut d = Decoder::new(body);
    let code = d.u8("opcode")?;
    let magic = d.bytes("greeting")?;
    d.finish()?;
    if code != op::HELLO || magic != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the first message must be the fsdp store greeting",
        ));
    }
    Ok(Encoder::new(status::OK).bytes(MAGIC).bytes(instance).0)
}

fn wait_ms(d: &mut Decoder<'_>) -> io::Result<Duration> {
    Ok(Duration::from_millis(d.u64("wait_ms")?).min(MAX_WAIT))
}

/// Answers one request; `Err` for a malformed one.
fn handle(sh: &Shared, body: &[u8]) -> io::Result<Vec<u8>> {
    let mut d = Decoder::new(body);
    let code = d.u8("opcode")?;
    let ok = || Encoder::new(status::OK);
    let reply = match code {
        op::SET => {
            let key = d.key()?;
            let value = d.bytes("value")?.to_vec();
            d.finish()?;
            sh.map.lock().insert(key, value);
            sh.changed.notify_all();
            ok().0
        }
        op::GET => {
            let key = d.key()?;
            let wait = wait_ms(&mut d)?;
            d.finish()?;
            match wait_for(sh, std::slice::from_ref(&key), wait) {
                Ok(()) => match sh.map.lock().get(&key) {
                    Some(v) => ok().bytes(v).0,
                    // Deleted between the wait and the read.
                    None => timeout_reply(&[key]),
                },
                Err(missing) => timeout_reply(&missing),
            }
        }
        op::ADD => {
            let key = d.key()?;
            let delta = d.i64("delta")?;
            d.finish()?;
            let mut map = sh.map.lock();
            let old = match map.get(&key) {
                None => Some(0),
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok()),
            };
            let new = old.and_then(|o| o.checked_add(delta));
            match (old, new) {
                (Some(_), Some(n)) => {
                    map.insert(key, n.to_string().into_bytes());
                    drop(map);
                    sh.changed.notify_all();
                    ok().i64(n).0
                }
                (None, _) => {
                    Encoder::new(status::ERROR)
                        .bytes(
                            format!("add: key '{key}' holds a value that is not an integer")
                                .as_bytes(),
                        )
                        .0
                }
                (Some(o), None) => {
                    Encoder::new(status::ERROR)
                        .bytes(format!("add: {o} + {delta} overflows i64 (key '{key}')").as_bytes())
                        .0
                }
            }
        }
        op::WAIT => {
            let keys = d.keys()?;
            let wait = wait_ms(&mut d)?;
            d.finish()?;
            match wait_for(sh, &keys, wait) {
                Ok(()) => ok().0,
                Err(missing) => timeout_reply(&missing),
            }
        }
        op::CHECK => {
            let keys = d.keys()?;
            d.finish()?;
            let map = sh.map.lock();
            ok().u8(keys.iter().all(|k| map.contains_key(k)) as u8).0
        }
        op::DELETE => {
            let key = d.key()?;
            d.finish()?;
            let existed = sh.map.lock().remove(&key).is_some();
            ok().u8(existed as u8).0
        }
        op::NUM_KEYS => {
            d.finish()?;
            let n = sh.map.lock().len();
            ok().u64(n as u64).0
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown opcode {other}"),
            ))
        }
    };
    Ok(reply)
}

fn timeout_reply(missing: &[String]) -> Vec<u8> {
    Encoder::new(status::TIMEOUT).keys(missing).0
}

/// Blocks until every key exists (`Ok`) or `wait` passed or the server stops (`Err` with
/// the missing keys).
fn wait_for(sh: &Shared, keys: &[String], wait: Duration) -> Result<(), Vec<String>> {
    let deadline = Instant::now() + wait;
    let mut map = sh.map.lock();
    loop {
        let missing: Vec<String> = keys
            .iter()
            .filter(|k| !map.contains_key(*k))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if sh.stop.load(Ordering::SeqCst) || sh.changed.wait_until(&mut map, deadline).timed_out() {
            let missing = keys
                .iter()
                .filter(|k| !map.contains_key(*k))
                .cloned()
                .collect::<Vec<_>>();
            return if missing.is_empty() {
                Ok(())
            } else {
                Err(missing)
            };
        }
    }
}
