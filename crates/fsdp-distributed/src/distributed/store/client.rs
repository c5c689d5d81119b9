//! The store client: one TCP connection to the server, one request at a time
//! (`c10d::TCPStore` with `is_master=False`; with `is_master=True` it also hosts the server).

use super::protocol::{op, read_frame, status, write_frame, Decoder, Encoder, MAGIC, MAX_KEY};
use super::{Store, TcpStoreServer};
use crate::distributed::auth::{self, JobAuth};
use crate::distributed::backoff::Backoff;
use crate::distributed::waiting::Ticker;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Extra time a client waits for the server's answer to a `wait` or `get` beyond the wait
/// itself (the server answers `TIMEOUT` at the end of the wait; this covers the network).
const REPLY_SLACK: Duration = Duration::from_secs(5);

/// A client of a TCP key-value store (`torch.distributed.TCPStore`): ranks exchange small
/// values through it at start-up (listening addresses, an NCCL unique id).
///
/// ```
/// use fsdp_distributed::distributed::{Store, TcpStore};
/// use std::time::Duration;
///
/// // Rank 0 hosts the server (port 0: any free port) and is a client of it.
/// let master = TcpStore::new("127.0.0.1", 0, 0, true, Duration::from_secs(10))?;
/// let port = master.port();
/// let rank1 = std::thread::spawn(move || {
///     let store = TcpStore::new("127.0.0.1", port, 1, false, Duration::from_secs(10))?;
///     store.get("nccl_id") // waits until rank 0 set it
/// });
/// master.set("nccl_id", &[7u8; 128])?;
/// assert_eq!(rank1.join().unwrap()?, vec![7u8; 128]);
/// assert_eq!(master.add("counter", 5)?, 5);
/// # Ok::<(), fsdp_core::Error>(())
/// ```
pub struct TcpStore {
    conn: Mutex<Conn>,
    /// `host:port` as given, for messages.
    addr: String,
    port: u16,
    rank: usize,
    timeout: Duration,
    /// The server this client hosts (`is_master`); it stops when the last handle drops.
    server: Option<Arc<TcpStoreServer>>,
    /// Whether its requests count in `backend::counters` (not a heartbeat's connection).
    counted: bool,
}

struct Conn {
    stream: TcpStream,
    /// Set after an I/O error in the middle of a request: the stream is out of step.
    broken: Option<String>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .field("is_master", &self.server.is_some())
            .finish()
    }
}

impl TcpStore {
    /// `TCPStore(host, port, is_master=is_master, timeout=timeout)` for rank `rank` (named in
    /// errors), open to any client (no job id, no secret). With `is_master`, first starts a
    /// server on `host:port` (port 0: a free port, see [`port`](Self::port)) that lives as
    /// long as this client. Then connects, retrying while the server is not up yet (another
    /// process may start it later), until `timeout`. `timeout` also bounds every later `get`
    /// and `wait`.
    ///
    /// # Errors
    /// As [`with_auth`](Self::with_auth).
    pub fn new(
        host: &str,
        port: u16,
        rank: usize,
        is_master: bool,
        timeout: Duration,
    ) -> Result<TcpStore> {
        Self::with_auth(host, port, rank, is_master, timeout, JobAuth::default())
    }

    /// As [`new`](Self::new), for job `auth` (see [`JobAuth`]): the server (with
    /// `is_master`) refuses clients of another job or without its secret, and this client
    /// refuses a server of another job or that cannot prove the secret.
    ///
    /// Connecting retries while nothing listens at `host:port` (connection refused: rank 0
    /// is not up yet) or nothing answers, until `timeout`; an address with no route to it is
    /// an error at once. With `is_master` the server is up before this client connects, so
    /// it connects once, within 5 s: a `host` that does not lead back to this machine is an
    /// error at once.
    ///
    /// # Errors
    /// `Timeout` naming the address and `rank` when no server answered within `timeout`;
    /// `InvalidArgument` for a host that does not resolve; `Io` naming the address when it
    /// cannot be reached, when the server cannot bind its port (in use: another job holds
    /// it), or when the peer is not an fsdp store; `Refused` when the server belongs to
    /// another job, or one side cannot prove the job secret.
    pub fn with_auth(
        host: &str,
        port: u16,
        rank: usize,
        is_master: bool,
        timeout: Duration,
        auth: JobAuth,
    ) -> Result<TcpStore> {
        if !is_master {
            return Self::connect_with_auth(host, port, rank, timeout, auth);
        }
        let server = Arc::new(TcpStoreServer::bind_with_auth(host, port, auth.clone())?);
        let mut store = Self::reach_own(host, server.port(), rank, timeout, &auth, &server)?;
        store.server = Some(server);
        Ok(store)
    }

    /// A client of the open server at `host:port` (see [`new`](Self::new) with `is_master`
    /// false).
    ///
    /// # Errors
    /// As [`with_auth`](Self::with_auth).
    pub fn connect(host: &str, port: u16, rank: usize, timeout: Duration) -> Result<TcpStore> {
        Self::connect_with_auth(host, port, rank, timeout, JobAuth::default())
    }

    /// A client of job `auth` of the server at `host:port` (see
    /// [`with_auth`](Self::with_auth) with `is_master` false).
    ///
    /// # Errors
    /// As [`with_auth`](Self::with_auth).
    pub fn connect_with_auth(
        host: &str,
        port: u16,
        rank: usize,
        timeout: Duration,
        auth: JobAuth,
    ) -> Result<TcpStore> {
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(
            Duration::from_millis(5),
            Duration::from_millis(100),
            deadline,
        );
        // What the progress lines say this rank waits for (see `waiting.rs`).
        let state = Arc::new(Mutex::new("no attempt answered yet"));
        let _ticker = {
            let (addr, state) = (addr.clone(), state.clone());
            Ticker::start(rank, timeout, move || {
                format!("connecting to the TCPStore at {addr}: {}", state.lock())
            })
        };
        let mut last: Option<io::Error> = None;
        loop {
            let targets = resolve(host, port)?;
            let left = deadline.saturating_duration_since(Instant::now());
            let mut no_route: Option<io::Error> = None;
            let mut reached = None;
            for a in &targets {
                match TcpStream::connect_timeout(a, left.clamp(Duration::from_millis(1), ATTEMPT)) {
                    Ok(s) => {
                        reached = Some(s);
                        break;
                    }
                    Err(e) if unreachable(&e) => no_route = Some(e),
                    Err(e) => last = Some(e),
                }
            }
            if let Some(s) = reached {
                *state.lock() = "connected; the server has not answered the job handshake";
                let left = deadline.saturating_duration_since(Instant::now());
                match Self::greet(s, addr.clone(), port, rank, timeout, &auth, left) {
                    Err(e) if auth::is_busy(&e) => {
                        *state.lock() = BUSY;
                        last = Some(io::ErrorKind::ResourceBusy.into());
                    }
                    res => return res.map(|(store, _)| store),
                }
            }
            // Every address has no route to it: no retry will find one.
            if let (Some(e), None) = (no_route, &last) {
                return Err(Error::io(
                    format!(
                        "TCPStore: rank {rank} cannot reach the store at {addr} (check MASTER_ADDR / --master-addr)"
                    ),
                    e,
                ));
            }
            let why = match last.as_ref().map(io::Error::kind) {
                Some(io::ErrorKind::ConnectionRefused) => {
                    "nothing listens there (connection refused): rank 0 never started its store"
                }
                Some(io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) => {
                    "no answer (every attempt timed out): a wrong address, a host that is down, or a firewall"
                }
                Some(io::ErrorKind::ResourceBusy) => BUSY,
                _ => "no server answered",
            };
            if !backoff.wait() {
                return Err(Error::Timeout {
                    op: format!("connecting to the TCPStore at {addr} ({why})"),
                    rank,
                    timeout_s: timeout.as_secs_f64(),
                    missing_ranks: Vec::new(),
                });
            }
            *state.lock() = match why {
                "no server answered" => why,
                _ => why.split(':').next().unwrap_or(why),
            };
            last = None;
        }
    }

    /// Rank 0's client of the server it hosts, through `host` as every rank will: the
    /// server is up, so one attempt within [`HOSTING_PROBE`] tells whether `host` leads back
    /// to this machine (its address, or a NAT that forwards to it).
    fn reach_own(
        host: &str,
        port: u16,
        rank: usize,
        timeout: Duration,
        auth: &JobAuth,
        server: &TcpStoreServer,
    ) -> Result<TcpStore> {
        let addr = format!("{host}:{port}");
        let targets = resolve(host, port)?;
        let probe = timeout.min(HOSTING_PROBE);
        let mut why: Option<io::Error> = None;
        for a in &targets {
            let attempt = TcpStream::connect_timeout(a, probe)
                .map_err(|e| Error::io("connecting", e))
                .and_then(|s| Self::greet(s, addr.clone(), port, rank, timeout, auth, probe));
            match attempt {
                Ok((store, instance)) if instance == server.instance() => return Ok(store),
                Ok(_) => {
                    why = Some(io::Error::other(
                        "it leads to another fsdp store, not the one this rank hosts",
                    ))
                }
                Err(Error::Io { source, .. }) => why = Some(source),
                Err(e) => why = Some(io::Error::other(e.to_string())),
            }
        }
        let local = targets.iter().any(|a| is_local(a.ip()));
        let hint = if local {
            String::new()
        } else {
            format!(
                "; {host} is not an address of this machine (MASTER_ADDR / --master-addr must name the machine where rank 0 runs)"
            )
        };
        Err(Error::io(
            format!("TCPStore: rank {rank} hosts the store on port {port} but cannot reach it at {addr}{hint}"),
            why.unwrap_or_else(|| io::ErrorKind::AddrNotAvailable.into()),
        ))
    }

    /// Passes the job handshake and the store greeting on a fresh connection, each reply
    /// awaited for at most `reply_within`; returns the client and the server's instance id.
    fn greet(
        mut stream: TcpStream,
        addr: String,
        port: u16,
        rank: usize,
        timeout: Duration,
        auth: &JobAuth,
        reply_within: Duration,
    ) -> Result<(TcpStore, Vec<u8>)> {
        let _ = stream.set_nodelay(true);
        let within = Some(reply_within.max(Duration::from_millis(1)));
        let _ = stream.set_read_timeout(within);
        let _ = stream.set_write_timeout(within);
        let peer = format!("TCPStore at {addr} (rank {rank})");
        crate::distributed::auth::dial(&mut stream, auth, &format!("store rank {rank}"), &peer)
            .map_err(|e| match e {
                Error::Io { source, .. }
                    if matches!(
                        source.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    Error::Timeout {
                        op: format!("{peer}: the job handshake (the server did not answer)"),
                        rank,
                        timeout_s: reply_within.as_secs_f64(),
                        missing_ranks: Vec::new(),
                    }
                }
                e => e,
            })?;
        let store = TcpStore {
            conn: Mutex::new(Conn {
                stream,
                broken: None,
            }),
            addr,
            port,
            rank,
            timeout,
            server: None,
            // The greeting of a connection is not a step's request: a heartbeat thread that
            // connects late (a loaded machine) must not count in a training step's
            // `store_ops`; requests after it count (see `uncounted`).
            counted: false,
        };
        let reply = store.request(
            "greeting",
            Encoder::new(op::HELLO).bytes(MAGIC),
            reply_within,
        )?;
        let mut d = Decoder::new(&reply);
        let greeting = d.bytes("greeting").ok() == Some(MAGIC);
        let instance = d.bytes("instance id").map(<[u8]>::to_vec);
        match (greeting, instance, d.finish()) {
            (true, Ok(id), Ok(())) => Ok((
                TcpStore {
                    counted: true,
                    ..store
                },
                id,
            )),
            _ => Err(store.protocol_error(
                "greeting",
                "the server is not an fsdp TCPStore of this version",
            )),
        }
    }

    /// The server's port (the one the OS picked when hosting with port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The rank named in this client's errors.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether this client hosts the server.
    pub fn is_master(&self) -> bool {
        self.server.is_some()
    }

    /// The server this client hosts (with `is_master`), e.g. for its
    /// [`refused`](TcpStoreServer::refused) connections.
    pub fn server(&self) -> Option<&TcpStoreServer> {
        self.server.as_deref()
    }

    /// This client, with requests that do not count in `backend::counters`'s `store_ops`
    /// (the heartbeat's own connection: no store request per training step).
    pub(crate) fn uncounted(mut self) -> TcpStore {
        self.counted = false;
        self
    }

    /// Records a heartbeat of `rank` (this connection beats for it from now on; the server
    /// forgets it when the connection closes) and returns the other ranks whose last beat
    /// is older than `stale_after`; waits at most `stale_after` for the answer.
    ///
    /// # Errors
    /// `Timeout` when the server did not answer within `stale_after` (its process is
    /// stopped or hung); `Io` when it is gone or answered bytes that do not parse.
    pub(crate) fn heartbeat(&self, rank: usize, stale_after: Duration) -> Result<Vec<usize>> {
        let req = Encoder::new(op::HEARTBEAT)
            .u64(rank as u64)
            .u64(millis(stale_after));
        let body = self.request("heartbeat", req, stale_after)?;
        self.decode("heartbeat", &body, |d| {
            let n = d.u64("count")?;
            (0..n).map(|_| d.u64("rank").map(|r| r as usize)).collect()
        })
    }

    /// The local address of the connection to the server: the interface through which this
    /// machine reaches it, which peers can usually reach too (what a rank advertises as its
    /// own address).
    ///
    /// # Errors
    /// `Io` when the socket has no local address (closed).
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        let c = self.conn.lock();
        c.stream.local_addr().map(|a| a.ip()).map_err(|e| {
            Error::io(
                format!("TCPStore at {}: reading the local address", self.addr),
                e,
            )
        })
    }

    fn protocol_error(&self, what: &str, msg: &str) -> Error {
        Error::io(
            format!("TCPStore at {} (rank {}): {what}", self.addr, self.rank),
            io::Error::new(io::ErrorKind::InvalidData, msg.to_string()),
        )
    }

    /// Sends one request and returns the body of an `OK` reply (after the status byte).
    /// A `TIMEOUT` reply becomes [`Error::Timeout`] naming the missing keys.
    fn request(&self, what: &str, req: Encoder, reply_within: Duration) -> Result<Vec<u8>> {
        if self.counted {
            crate::backend::counters::count_store_op();
        }
        let mut c = self.conn.lock();
        if let Some(why) = &c.broken {
            return Err(self.protocol_error(
                what,
                &format!("the connection broke in an earlier request ({why})"),
            ));
        }
        let res = (|| {
            c.stream
                .set_read_timeout(Some(reply_within.max(Duration::from_millis(1))))?;
            c.stream
                .set_write_timeout(Some(self.timeout.max(Duration::from_millis(1))))?;
            write_frame(&mut c.stream, &req.0)?;
            read_frame(&mut c.stream)?.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection",
                )
            })
        })();
        let body = match res {
            Ok(b) => b,
            Err(e) => {
                c.broken = Some(e.to_string());
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    return Err(Error::Timeout {
                        op: format!(
                            "TCPStore.{what} at {} (the server did not answer)",
                            self.addr
                        ),
                        rank: self.rank,
                        timeout_s: reply_within.as_secs_f64(),
                        missing_ranks: Vec::new(),
                    });
                }
                return Err(Error::io(
                    format!("TCPStore at {} (rank {}): {what}", self.addr, self.rank),
                    e,
                ));
            }
        };
        drop(c);
        let mut d = Decoder::new(&body);
        let st = d
            .u8("status")
            .map_err(|e| self.protocol_error(what, &e.to_string()))?;
        let rest = body.get(1..).unwrap_or_default().to_vec();
        match st {
            status::OK => Ok(rest),
            status::TIMEOUT => {
                let missing = d.keys().unwrap_or_default();
                Err(Error::Timeout {
                    op: format!(
                        "TCPStore.{what} at {}: keys {missing:?} were never set",
                        self.addr
                    ),
                    rank: self.rank,
                    timeout_s: reply_within.saturating_sub(REPLY_SLACK).as_secs_f64(),
                    missing_ranks: Vec::new(),
                })
            }
            status::ERROR => {
                let msg = d
                    .bytes("message")
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_else(|_| "unreadable error".into());
                Err(self.protocol_error(what, &format!("the server answered: {msg}")))
            }
            other => Err(self.protocol_error(what, &format!("unknown reply status {other}"))),
        }
    }

    fn check_key(key: &str) -> Result<()> {
        if key.len() > MAX_KEY {
            crate::error::bail_arg!("TCPStore: a key of {} bytes exceeds {MAX_KEY}", key.len());
        }
        Ok(())
    }

    fn decode<T>(
        &self,
        what: &str,
        body: &[u8],
        f: impl FnOnce(&mut Decoder<'_>) -> io::Result<T>,
    ) -> Result<T> {
        let mut d = Decoder::new(body);
        let v = f(&mut d).and_then(|v| d.finish().map(|()| v));
        v.map_err(|e| self.protocol_error(what, &e.to_string()))
    }
}

/// Longest rank 0 tries to reach the server it hosts (see `reach_own`).
const HOSTING_PROBE: Duration = Duration::from_secs(5);

/// Why a client retries a server that answered `BUSY`.
const BUSY: &str = "the server was busy with other connections' handshakes (refused for now)";

/// Longest one connection attempt waits for an answer.
const ATTEMPT: Duration = Duration::from_secs(2);

fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    Ok((host, port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::InvalidArgument(format!("TCPStore host '{host}' does not resolve: {e}"))
        })?
        .collect())
}

/// A connect error no retry cures: there is no route to the address.
fn unreachable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::NetworkDown
            | io::ErrorKind::AddrNotAvailable
    )
}

/// Whether `ip` is an address of this machine (one it can listen on).
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u64::MAX as u128) as u64
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        Self::check_key(key)?;
        let what = format!("set('{key}')");
        let body = self.request(
            &what,
            Encoder::new(op::SET).bytes(key.as_bytes()).bytes(value),
            self.timeout,
        )?;
        self.decode(&what, &body, |_| Ok(()))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        Self::check_key(key)?;
        let what = format!("get('{key}')");
        let req = Encoder::new(op::GET)
            .bytes(key.as_bytes())
            .u64(millis(self.timeout));
        let body = self.request(&what, req, self.timeout + REPLY_SLACK)?;
        self.decode(&what, &body, |d| d.bytes("value").map(<[u8]>::to_vec))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        Self::check_key(key)?;
        let what = format!("add('{key}', {delta})");
        let body = self.request(
            &what,
            Encoder::new(op::ADD).bytes(key.as_bytes()).i64(delta),
            self.timeout,
        )?;
        self.decode(&what, &body, |d| d.i64("value"))
    }

    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        for k in keys {
            Self::check_key(k)?;
        }
        let what = format!("wait({keys:?})");
        let req = Encoder::new(op::WAIT).keys(keys).u64(millis(timeout));
        let body = self.request(&what, req, timeout + REPLY_SLACK)?;
        self.decode(&what, &body, |_| Ok(()))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        for k in keys {
            Self::check_key(k)?;
        }
        let what = format!("check({keys:?})");
        let body = self.request(&what, Encoder::new(op::CHECK).keys(keys), self.timeout)?;
        self.decode(&what, &body, |d| d.u8("answer").map(|b| b != 0))
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        Self::check_key(key)?;
        let what = format!("delete_key('{key}')");
        let body = self.request(
            &what,
            Encoder::new(op::DELETE).bytes(key.as_bytes()),
            self.timeout,
        )?;
        self.decode(&what, &body, |d| d.u8("answer").map(|b| b != 0))
    }

    fn num_keys(&self) -> Result<usize> {
        let body = self.request("num_keys()", Encoder::new(op::NUM_KEYS), self.timeout)?;
        self.decode("num_keys()", &body, |d| d.u64("count").map(|n| n as usize))
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
