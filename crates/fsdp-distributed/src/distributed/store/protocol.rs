//! The store's wire format: length-prefixed frames over one TCP stream per client.
//!
//! ```text
//! (after the job handshake of `distributed/auth.rs`, which every connection passes first)
//! frame    = len: u32 LE (bytes of body, at most MAX_FRAME) | body
//! request  = op: u8 | fields        reply = status: u8 | fields
//! string   = len: u32 LE | bytes    (keys: UTF-8, at most MAX_KEY bytes)
//! ```
//!
//! | op | request fields | reply on success |
//! |---|---|---|
//! | `HELLO` | [`MAGIC`] bytes | [`MAGIC`] bytes, the server's instance id (16 bytes) |
//! | `SET` | key, value | - |
//! | `GET` | key, wait_ms: u64 | value (`TIMEOUT` when still missing after `wait_ms`) |
//! | `ADD` | key, delta: i64 | new value: i64 |
//! | `WAIT` | n: u32, n keys, wait_ms: u64 | - (`TIMEOUT` + the missing keys) |
//! | `CHECK` | n: u32, n keys | all present: u8 |
//! | `DELETE` | key | existed: u8 |
//! | `NUM_KEYS` | - | count: u64 |
//!
//! Reply statuses: `OK`, `TIMEOUT` (followed by n: u32 and the missing keys), `ERROR`
//! (followed by a message string). Every read checks lengths against what is left of the
//! frame, so bad bytes give an error, never a panic or an unbounded allocation.

use std::io::{self, Read, Write};

/// First bytes a client sends and the server echoes: tells an fsdp store from any other
/// server listening on the port.
pub(super) const MAGIC: &[u8] = b"fsdp-tcpstore/2";

/// Largest frame body accepted (1 GiB): larger lengths are bad input.
pub(super) const MAX_FRAME: usize = 1 << 30;

/// Largest key, bytes.
pub(super) const MAX_KEY: usize = 64 << 10;

/// Request opcodes.
pub(super) mod op {
    pub const HELLO: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const ADD: u8 = 3;
    pub const WAIT: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const DELETE: u8 = 6;
    pub const NUM_KEYS: u8 = 7;
    /// `rank: u64 | stale_after_ms: u64` -> `count: u64 | rank: u64 ...`: records a beat of
    /// `rank` on this connection and answers the ranks whose last beat is older than
    /// `stale_after_ms` (see `distributed/heartbeat.rs`).
    pub const HEARTBEAT: u8 = 8;
}

/// Reply statuses.
pub(super) mod status {
    pub const OK: u8 = 0;
    pub const TIMEOUT: u8 = 1;
    pub const ERROR: u8 = 2;
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Reads one frame body. `Ok(None)` on a clean end of stream before the length.
///
/// The body is read as it arrives (the buffer grows with the bytes received), so a
/// length that lies costs no more memory than the bytes actually sent.
pub(super) fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(bad(format!(
            "frame of {len} bytes exceeds the limit of {MAX_FRAME}"
        )));
    }
    let mut body = Vec::with_capacity(len.min(1 << 20));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(body))
}

/// Writes one frame.
pub(super) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a store message of {} bytes exceeds the limit of {MAX_FRAME}",
                body.len()
            ),
        ));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

/// Builds a message body.
#[derive(Default)]
pub(super) struct Encoder(pub(super) Vec<u8>);

impl Encoder {
    pub(super) fn new(first: u8) -> Self {
        Encoder(vec![first])
    }
    pub(super) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub(super) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(mut self, v: &[u8]) -> Self {
        self = self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    pub(super) fn keys<S: AsRef<str>>(mut self, keys: &[S]) -> Self {
        self = self.u32(keys.len() as u32);
        for k in keys {
            self = self.bytes(k.as_ref().as_bytes());
        }
        self
    }
}

/// Reads a message body front to back; every read is bounds-checked.
pub(super) struct Decoder<'a> {
    buf: &'a [u8],
}

impl<'a> Decoder<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Decoder { buf }
    }
    fn take(&mut self, n: usize, what: &str) -> io::Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(bad(format!(
                "message truncated: {what} needs {n} bytes, {} left",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    pub(super) fn u8(&mut self, what: &str) -> io::Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u32(&mut self, what: &str) -> io::Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub(super) fn u64(&mut self, what: &str) -> io::Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub(super) fn i64(&mut self, what: &str) -> io::Result<i64> {
        Ok(self.u64(what)? as i64)
    }
    pub(super) fn bytes(&mut self, what: &str) -> io::Result<&'a [u8]> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub(super) fn key(&mut self) -> io::Result<String> {
        let b = self.bytes("key")?;
        if b.len() > MAX_KEY {
            return Err(bad(format!(
                "key of {} bytes exceeds the limit of {MAX_KEY}",
                b.len()
            )));
        }
        String::from_utf8(b.to_vec()).map_err(|_| bad("key is not UTF-8"))
    }
    pub(super) fn keys(&mut self) -> io::Result<Vec<String>> {
        let n = self.u32("key count")? as usize;
        // Each key takes at least its 4-byte length: a count larger than that is a lie.
        if n > self.buf.len() / 4 {
            return Err(bad(format!("key count {n} exceeds what the message holds")));
        }
        (0..n).map(|_| self.key()).collect()
    }
    pub(super) fn finish(&self) -> io::Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(bad(format!(
                "{} unexpected bytes at the end of a message",
                self.buf.len()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_lengths_are_errors() {
        let mut wire = Vec::new();
        write_frame(&mut wire, b"hello").unwrap();
        let mut r = &wire[..];
        assert_eq!(read_frame(&mut r).unwrap().unwrap(), b"hello");
        assert!(read_frame(&mut r).unwrap().is_none());
        // A length that claims more than arrives.
        let mut r: &[u8] = &[10, 0, 0, 0, 1, 2];
        assert!(read_frame(&mut r).is_err());
        // A length over the limit.
        let mut r: &[u8] = &[0xff, 0xff, 0xff, 0xff];
        assert!(read_frame(&mut r).is_err());
        // Truncated fields and lying counts.
        let body = Encoder::new(op::WAIT).u32(1_000_000).0;
        let mut d = Decoder::new(&body[1..]);
        assert!(d.keys().is_err());
        let body = Encoder::new(op::SET).u32(50).0;
        let mut d = Decoder::new(&body[1..]);
        assert!(d.key().is_err());
    }
}
