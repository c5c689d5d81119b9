//! Which job a connection belongs to, and proof of the job's secret at connect: used by the
//! store ([`TcpStore`](super::TcpStore), [`TcpStoreServer`](super::TcpStoreServer)) and by
//! the `tcp` backend's mesh, on every connection before anything else.
//!
//! # [Note: job auth]
//! torchrun checks a rendezvous id (`--rdzv-id`); c10d's `TCPStore` lets anyone who reaches
//! the port set or delete keys. Here every connection starts with a handshake that carries
//! the **job id** and, when the job has one, proves the **job secret** both ways:
//!
//! ```text
//! dialer -> acceptor  hello     = MAGIC | role | job id | dialer nonce (32 random bytes)
//! acceptor -> dialer  challenge = MAGIC | job id | secured: u8 | acceptor nonce | acceptor proof
//! dialer -> acceptor  proof     = dialer proof
//! acceptor -> dialer  verdict   = ok: u8 | reason
//! proof = HMAC-SHA256(secret, label | job id | role | dialer nonce | acceptor nonce)
//! ```
//!
//! Each message is `len: u32 LE | body`, each field of a body `len: u32 LE | bytes`; the
//! label (`"fsdp-auth/1 dialer"` or `"... acceptor"`) keeps one side's proof from being
//! played back as the other's, fresh nonces keep an old proof from being replayed, and
//! proofs are compared in constant time. The secret itself never travels.
//!
//! | acceptor \ dialer | no secret | same secret | other secret |
//! |---|---|---|---|
//! | no secret | accepted when the job ids are equal | dialer refuses: the acceptor proves nothing | dialer refuses |
//! | secret | acceptor refuses: no proof | accepted when the job ids are equal | both refuse |
//!
//! An acceptor that has too many handshakes in progress answers a new dialer `BUSY` in
//! place of the challenge (one message whose first field is `fsdp-busy`) and closes; the
//! dialer retries until its timeout.
//!
//! Job ids must be equal (absent is the empty id): a rank never joins another job's world,
//! and the message names both ids. The acceptor logs each refusal once per peer as
//! `refused a connection from ADDR: ...`, without the secret. `fsdp launch` always makes a
//! job id and a secret and hands them to its ranks as `FSDP_JOB_ID` and `FSDP_JOB_SECRET`;
//! `init_process_group` without them (tests, a torchrun-like launcher) runs open, as before,
//! with the job id check alone. This authenticates who connects; it does not encrypt, nor
//! stop an attacker who sits on the path and takes over a connection after the handshake.

use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};

/// The variable that carries the job id to the ranks (torchrun's `--rdzv-id`).
pub const JOB_ID_VAR: &str = "FSDP_JOB_ID";
/// The job id variable torchrun sets (read when [`JOB_ID_VAR`] is not set).
pub const RUN_ID_VAR: &str = "TORCHELASTIC_RUN_ID";
/// The variable that carries the job secret to the ranks (and to `fsdp launch` on every
/// node of a multi-node job). Never printed.
pub const JOB_SECRET_VAR: &str = "FSDP_JOB_SECRET";

/// Shortest job secret accepted, characters.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest job id, bytes.
const MAX_JOB_ID: usize = 128;
const MAGIC: &[u8] = b"fsdp-auth/1";
/// The first field of an acceptor's "busy, come back later" answer.
const BUSY: &[u8] = b"fsdp-busy";
const NONCE: usize = 32;
/// Largest handshake message: ids, roles and proofs are small.
const MAX_MSG: usize = 4096;

/// A job's shared secret: text known to every rank of the job and to nobody else. Its
/// `Debug` form hides it; compare secrets with `==` (constant time).
#[derive(Clone)]
pub struct JobSecret(String);

impl JobSecret {
    /// A fresh secret: 32 bytes from the operating system's random source, as 64 hex
    /// digits.
    ///
    /// # Errors
    /// `Io` when the OS random source fails.
    pub fn generate() -> Result<JobSecret> {
        Ok(JobSecret(hex(&random::<32>()?)))
    }

    /// The secret `text` (e.g. `FSDP_JOB_SECRET`).
    ///
    /// # Errors
    /// `InvalidArgument` when it is shorter than [`MIN_SECRET_LEN`] characters (the message
    /// gives its length, never the text).
    pub fn new(text: impl Into<String>) -> Result<JobSecret> {
        let text = text.into();
        let n = text.chars().count();
        if n < MIN_SECRET_LEN {
            crate::error::bail_arg!(
                "a job secret ({JOB_SECRET_VAR}) must be at least {MIN_SECRET_LEN} characters; this one has {n} (make one with e.g. `head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'`)"
            );
        }
        Ok(JobSecret(text))
    }

    /// The secret's text, to hand to a rank's environment. Never print or log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The job id every node of a multi-node job derives from the secret when none is
    /// given: `job-` and 16 hex digits of SHA-256 (reveals nothing of the secret).
    pub fn derived_job_id(&self) -> String {
        let digest = Sha256::new()
            .chain_update(b"fsdp job id\0")
            .chain_update(self.0.as_bytes())
            .finalize();
        format!("job-{}", hex(&digest[..8]))
    }
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(<hidden>)")
    }
}

impl PartialEq for JobSecret {
    fn eq(&self, other: &Self) -> bool {
        use subtle::ConstantTimeEq;
        self.0.as_bytes().ct_eq(other.0.as_bytes()).into()
    }
}

impl Eq for JobSecret {}

/// Who a rank is at rendezvous: its job id and, when the job has one, its secret (see
/// [Note: job auth] in this module). The default is the open, id-less job of a plain
/// `init_process_group`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobAuth {
    job_id: String,
    secret: Option<JobSecret>,
}

impl JobAuth {
    /// Job `job_id` (may be empty: no id), secured by `secret` when given.
    ///
    /// # Errors
    /// `InvalidArgument` for a job id over 128 bytes or with characters other than
    /// letters, digits and `. _ : -`.
    pub fn new(job_id: impl Into<String>, secret: Option<JobSecret>) -> Result<JobAuth> {
        let job_id = job_id.into();
        check_job_id(&job_id)?;
        Ok(JobAuth { job_id, secret })
    }

    /// The job id (empty when none).
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// The secret, when the job has one.
    pub fn secret(&self) -> Option<&JobSecret> {
        self.secret.as_ref()
    }

    /// Whether connections must prove the secret.
    pub fn is_secured(&self) -> bool {
        self.secret.is_some()
    }

    /// `'id'`, or `(no job id)`, for messages.
    fn shown(id: &str) -> String {
        if id.is_empty() {
            "(no job id)".into()
        } else {
            format!("'{id}'")
        }
    }
}

/// Checks a job id (see [`JobAuth::new`]).
///
/// # Errors
/// `InvalidArgument` naming the problem.
pub fn check_job_id(id: &str) -> Result<()> {
    if id.len() > MAX_JOB_ID {
        crate::error::bail_arg!(
            "a job id must be at most {MAX_JOB_ID} bytes; this one has {}",
            id.len()
        );
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        crate::error::bail_arg!(
            "job id '{}' holds {c:?}; use letters, digits and . _ : -",
            id.escape_debug()
        );
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| {
        Error::io(
            "reading the OS random source",
            io::Error::other(e.to_string()),
        )
    })?;
    Ok(b)
}

/// A fresh random 16-byte id (a store server's instance id).
pub(crate) fn instance_id() -> Result<[u8; 16]> {
    random::<16>()
}

type HmacSha256 = Hmac<Sha256>;

/// The MAC of one side over the handshake's fields, ready to finalize or verify.
fn mac(
    secret: &JobSecret,
    acceptor: bool,
    job_id: &str,
    role: &str,
    nonces: (&[u8], &[u8]),
) -> Option<HmacSha256> {
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret.0.as_bytes()).ok()?;
    let label: &[u8] = if acceptor {
        b"fsdp-auth/1 acceptor"
    } else {
        b"fsdp-auth/1 dialer"
    };
    for field in [
        label,
        job_id.as_bytes(),
        role.as_bytes(),
        nonces.0,
        nonces.1,
    ] {
        m.update(&(field.len() as u32).to_le_bytes());
        m.update(field);
    }
    Some(m)
}

fn proof(secret: &JobSecret, acceptor: bool, job: &str, role: &str, n: (&[u8], &[u8])) -> Vec<u8> {
    mac(secret, acceptor, job, role, n)
        .map_or_else(Vec::new, |m| m.finalize().into_bytes().to_vec())
}

/// Whether `got` is the right proof (constant-time).
fn verify(
    secret: &JobSecret,
    acceptor: bool,
    job: &str,
    role: &str,
    n: (&[u8], &[u8]),
    got: &[u8],
) -> bool {
    mac(secret, acceptor, job, role, n).is_some_and(|m| m.verify_slice(got).is_ok())
}

fn write_msg(s: &mut impl Write, fields: &[&[u8]]) -> io::Result<()> {
    let mut body = Vec::new();
    for f in fields {
        body.extend_from_slice(&(f.len() as u32).to_le_bytes());
        body.extend_from_slice(f);
    }
    let mut buf = (body.len() as u32).to_le_bytes().to_vec();
    buf.extend_from_slice(&body);
    s.write_all(&buf)?;
    s.flush()
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// Reads one message and splits it into `n` fields.
fn read_msg(s: &mut impl Read, n: usize) -> io::Result<Vec<Vec<u8>>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MSG {
        return Err(bad("message too long"));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    let mut rest = &body[..];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        if rest.len() < 4 {
            return Err(bad("message truncated"));
        }
        let k = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        if rest.len() - 4 < k {
            return Err(bad("field truncated"));
        }
        out.push(rest[4..4 + k].to_vec());
        rest = &rest[4 + k..];
    }
    if !rest.is_empty() {
        return Err(bad("bytes left over"));
    }
    Ok(out)
}

fn text(b: &[u8]) -> io::Result<String> {
    String::from_utf8(b.to_vec()).map_err(|_| bad("text is not UTF-8"))
}

/// Answers a dialer `BUSY` (the acceptor has too many handshakes in progress), best
/// effort: a few bytes on a fresh connection, which never block.
pub(crate) fn refuse_busy(s: &mut impl Write) {
    let _ = write_msg(s, &[BUSY, b"", b"", b"", b""]);
}

/// Whether `e` is [`dial`]'s error for an acceptor that answered `BUSY`: a later attempt
/// may pass.
pub(crate) fn is_busy(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == io::ErrorKind::ResourceBusy)
}

/// Writes `line` and a newline on stderr in one write, so that lines of processes sharing
/// stderr (the ranks of `fsdp launch`) do not interleave.
pub(crate) fn log(line: &str) {
    let line = format!("{line}\n");
    // One argument: one write (`eprint!` of several would write each on its own).
    eprint!("{line}");
}

/// Why an acceptor refused a dialer: the text of its log line, after
/// `refused a connection from ADDR: `. `dialer` names it when it said who it was.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) dialer: Option<String>,
    pub(crate) reason: String,
}

impl Refusal {
    /// The log line for a refusal of `peer` by `who`.
    pub(crate) fn line(&self, who: &str, peer: &str) -> String {
        match &self.dialer {
            Some(d) => format!(
                "{who}: refused a connection from {peer} ({d}): {}",
                self.reason
            ),
            None => format!("{who}: refused a connection from {peer}: {}", self.reason),
        }
    }
}

/// The acceptor's side of the handshake: accepts a dialer whose role (`store rank 1`,
/// `mesh rank 3`) starts with `role_prefix`, of this job, that proves the secret when this
/// job has one. The caller sets the stream's read timeout first.
///
/// # Errors
/// The [`Refusal`] to log; the dialer was told why (unless it did not speak the protocol).
pub(crate) fn accept(
    s: &mut (impl Read + Write),
    auth: &JobAuth,
    role_prefix: &str,
) -> std::result::Result<(), Refusal> {
    let refuse = |dialer: Option<String>, reason: String| Refusal { dialer, reason };
    let hello = read_msg(s, 4).map_err(|e| {
        refuse(
            None,
            format!("it does not speak the fsdp handshake ({})", io_why(&e)),
        )
    })?;
    let (magic, role, job, dialer_nonce) = (&hello[0], &hello[1], &hello[2], &hello[3]);
    let (Ok(role), Ok(job)) = (text(role), text(job)) else {
        return Err(refuse(None, "its greeting is not UTF-8".into()));
    };
    if magic != MAGIC || dialer_nonce.len() != NONCE {
        return Err(refuse(
            None,
            "it does not speak this version of the fsdp handshake".into(),
        ));
    }
    let who = Some(format!("{role}, job {}", JobAuth::shown(&job)));
    let nonce = random::<NONCE>().map_err(|e| refuse(who.clone(), e.to_string()))?;
    let nonces = (&dialer_nonce[..], &nonce[..]);
    let mine = auth
        .secret
        .as_ref()
        .map_or_else(Vec::new, |k| proof(k, true, &job, &role, nonces));
    let secured = [auth.is_secured() as u8];
    let sent = write_msg(s, &[MAGIC, auth.job_id.as_bytes(), &secured, &nonce, &mine]);
    let theirs = sent.and_then(|()| read_msg(s, 1)).map_err(|e| {
        refuse(
            who.clone(),
            format!("the handshake broke off ({})", io_why(&e)),
        )
    })?;
    let theirs = &theirs[0];
    let why = if job != auth.job_id {
        Some(format!(
            "it is of job {}, not of this job {} (another job uses this address)",
            JobAuth::shown(&job),
            JobAuth::shown(&auth.job_id)
        ))
    } else if !role.starts_with(role_prefix) {
        Some(format!("it is a {role}, not a {role_prefix} client"))
    } else {
        match &auth.secret {
            Some(_) if theirs.is_empty() => {
                Some("it has no job secret and this job requires one".to_string())
            }
            Some(k) if !verify(k, false, &job, &role, nonces, theirs) => {
                Some("its proof of the job secret is wrong (another secret)".to_string())
            }
            _ => None,
        }
    };
    let verdict = [why.is_none() as u8];
    let reason = why.clone().unwrap_or_default();
    let told = write_msg(s, &[&verdict, reason.as_bytes()]);
    match why {
        Some(reason) => Err(refuse(who, reason)),
        None => match told {
            Ok(()) => Ok(()),
            Err(e) => Err(refuse(
                who,
                format!("the handshake broke off ({})", io_why(&e)),
            )),
        },
    }
}

fn io_why(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof => "it closed the connection".into(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "it sent nothing in time".into(),
        _ => e.to_string(),
    }
}

/// The dialer's side of the handshake, as `role` (e.g. `store rank 1`), to `peer` (for
/// messages, e.g. `TCPStore at HOST:PORT (rank 1)`). The caller sets the stream's timeouts
/// first.
///
/// # Errors
/// `Refused` naming `peer` when it belongs to another job, cannot prove this job's secret,
/// or refused this rank; `Io` when the stream fails or the peer does not speak the
/// handshake.
pub(crate) fn dial(
    s: &mut (impl Read + Write),
    auth: &JobAuth,
    role: &str,
    peer: &str,
) -> Result<()> {
    let io_err = |what: &str, e: io::Error| Error::io(format!("{peer}: {what}"), e);
    let nonce = random::<NONCE>()?;
    write_msg(s, &[MAGIC, role.as_bytes(), auth.job_id.as_bytes(), &nonce])
        .map_err(|e| io_err("sending the handshake", e))?;
    let ch = read_msg(s, 5).map_err(|e| {
        let e = match e.kind() {
            io::ErrorKind::UnexpectedEof => bad(
                "it closed the connection without answering the fsdp handshake (not an fsdp peer?)",
            ),
            io::ErrorKind::InvalidData => bad(&format!("it is not an fsdp peer ({e})")),
            _ => e,
        };
        io_err("reading the handshake's answer", e)
    })?;
    let (magic, job, secured, their_nonce, their_proof) = (&ch[0], &ch[1], &ch[2], &ch[3], &ch[4]);
    if magic == BUSY {
        return Err(io_err(
            "the job handshake",
            io::Error::new(
                io::ErrorKind::ResourceBusy,
                "it is busy with other connections' handshakes (refused for now)",
            ),
        ));
    }
    if magic != MAGIC || their_nonce.len() != NONCE || secured.len() != 1 {
        return Err(io_err(
            "reading the handshake's answer",
            bad("it does not speak this version of the fsdp handshake"),
        ));
    }
    let job = text(job).map_err(|e| io_err("reading the handshake's answer", e))?;
    let nonces = (&nonce[..], &their_nonce[..]);
    let mine = auth
        .secret
        .as_ref()
        .map_or_else(Vec::new, |k| proof(k, false, &job, role, nonces));
    // Its verdict, when it gives one (it may close first once it refused).
    let verdict = write_msg(s, &[&mine])
        .and_then(|()| read_msg(s, 2))
        .ok()
        .map(|v| {
            (
                v[0].first() == Some(&1),
                String::from_utf8_lossy(&v[1]).into_owned(),
            )
        });
    let refused = |reason: String| Error::Refused {
        context: peer.to_string(),
        reason,
    };
    if job != auth.job_id {
        return Err(refused(format!(
            "it belongs to job {}, not to this rank's job {}: another job holds this address",
            JobAuth::shown(&job),
            JobAuth::shown(&auth.job_id)
        )));
    }
    match (&auth.secret, secured[0] != 0) {
        (Some(_), false) => {
            return Err(refused(format!(
                "it runs without a job secret but this rank has one ({JOB_SECRET_VAR}): it is not this job's"
            )))
        }
        (Some(k), true) if !verify(k, true, &job, role, nonces, their_proof) => {
            return Err(refused(format!(
                "it could not prove this job's secret: the secrets differ (another job, or {JOB_SECRET_VAR} differs between nodes)"
            )))
        }
        (None, true) => {
            return Err(refused(format!(
                "it requires the job secret and this rank has none ({JOB_SECRET_VAR} is not set; fsdp launch sets it, on every node give the same)"
            )))
        }
        _ => {}
    }
    match verdict {
        Some((true, _)) => Ok(()),
        Some((false, why)) => Err(refused(format!("it refused this rank: {why}"))),
        None => Err(refused(
            "it closed the connection during the handshake".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn pair(server: JobAuth, client: JobAuth) -> (Result<()>, std::result::Result<(), Refusal>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, &server, "store")
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let got = dial(&mut c, &client, "store rank 1", "peer");
        drop(c);
        (got, h.join().unwrap())
    }

    fn secret(s: &str) -> Option<JobSecret> {
        Some(JobSecret::new(s).unwrap())
    }

    #[test]
    fn every_pairing_of_ids_and_secrets() {
        let a = |id: &str, k: Option<&str>| JobAuth::new(id, k.and_then(secret)).unwrap();
        let k1 = Some("0123456789abcdef-one");
        let k2 = Some("0123456789abcdef-two");
        let (c, s) = pair(a("", None), a("", None));
        assert!(c.is_ok() && s.is_ok());
        let (c, s) = pair(a("j", k1), a("j", k1));
        assert!(c.is_ok() && s.is_ok(), "{c:?} {s:?}");
        let (c, s) = pair(a("j", k1), a("j", k2));
        assert!(c.unwrap_err().to_string().contains("secrets differ"));
        assert!(s
            .unwrap_err()
            .reason
            .contains("proof of the job secret is wrong"));
        let (c, s) = pair(a("j", k1), a("j", None));
        assert!(c.unwrap_err().to_string().contains("this rank has none"));
        assert!(s.unwrap_err().reason.contains("no job secret"));
        let (c, _) = pair(a("j", None), a("j", k1));
        assert!(c
            .unwrap_err()
            .to_string()
            .contains("runs without a job secret"));
        let (c, s) = pair(a("a", k1), a("b", k1));
        let c = c.unwrap_err().to_string();
        assert!(c.contains("job 'a', not to this rank's job 'b'"), "{c}");
        let s = s.unwrap_err();
        assert_eq!(s.dialer.as_deref(), Some("store rank 1, job 'b'"));
        assert!(
            s.reason.contains("job 'b', not of this job 'a'"),
            "{}",
            s.reason
        );
        // The secret never shows.
        let dbg = format!("{:?}", a("j", k1));
        assert!(!dbg.contains("0123456789abcdef"), "{dbg}");
    }

    #[test]
    fn secrets_and_ids_are_checked() {
        assert!(JobSecret::new("short")
            .unwrap_err()
            .to_string()
            .contains("at least 16"));
        let g = JobSecret::generate().unwrap();
        assert_eq!(g.expose().len(), 64);
        assert_ne!(g, JobSecret::generate().unwrap());
        assert_eq!(g.derived_job_id(), g.clone().derived_job_id());
        assert!(JobAuth::new("bad id", None).is_err());
        assert!(JobAuth::new("job-1.a_b:c", None).is_ok());
    }
}
