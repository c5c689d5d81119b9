//! The `tcp` backend's wire format between two ranks of a group.
//!
//! ```text
//! handshake = MAGIC | group tag: u64 | group size: u32 | sender group rank: u32 | BYTE_ORDER: u32
//! frame     = kind: u8 | len: u64 | payload (len bytes)
//! header    = seq: u64 | op: u8 | dtype: u8 | arg kind: u8 | arg: u64 | in_numel: u64 | out_numel: u64
//!             | fingerprint (see `distributed::fingerprint`): has: u8 | unit: u64 | phase: u8 | step: u32 | micro-batch: u32 | call: u32
//! ```
//!
//! All integers little-endian. Tensor payloads are the elements' bytes in the host's order;
//! the handshake carries [`BYTE_ORDER`] so that hosts of different byte order refuse to
//! pair. Every collective sends one `HEADER` frame to every peer, then its `DATA` frames;
//! `ABORT` (payload: the reason, UTF-8) says the sender failed, `BYE` that it left the
//! group ([`destroy_process_group`](crate::distributed::destroy_process_group)).

use crate::distributed::desc::{Arg, Desc};
use crate::distributed::fingerprint;
use crate::distributed::ReduceOp;
use crate::tensor::DType;
use std::io::{self, Read, Write};

/// First bytes of a handshake.
pub(super) const MAGIC: &[u8; 13] = b"fsdp-tcp-pg/2";
/// Bytes of a handshake.
pub(super) const HANDSHAKE_LEN: usize = MAGIC.len() + 8 + 4 + 4 + 4;
/// Written in host order: reads back as this value only on a host of the same order.
pub(super) const BYTE_ORDER: u32 = 0x0102_0304;

/// Frame kinds.
pub(super) mod kind {
    pub const HEADER: u8 = 1;
    pub const DATA: u8 = 2;
    pub const ABORT: u8 = 3;
    pub const BYE: u8 = 4;
}

/// Bytes of a header payload.
pub(super) const HEADER_LEN: usize = 8 + 1 + 1 + 1 + 8 + 8 + 8 + fingerprint::WIRE_LEN;

/// Payloads are read in steps of at most this many bytes, so that memory grows with the
/// bytes that actually arrive, not with a length a peer claims.
const READ_STEP: usize = 16 << 20;

/// One side's handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Handshake {
    pub(super) tag: u64,
    pub(super) size: u32,
    pub(super) rank: u32,
    pub(super) byte_order: u32,
}

impl Handshake {
    pub(super) fn encode(&self) -> [u8; HANDSHAKE_LEN] {
        let mut b = [0u8; HANDSHAKE_LEN];
        let m = MAGIC.len();
        b[..m].copy_from_slice(MAGIC);
        b[m..m + 8].copy_from_slice(&self.tag.to_le_bytes());
        b[m + 8..m + 12].copy_from_slice(&self.size.to_le_bytes());
        b[m + 12..m + 16].copy_from_slice(&self.rank.to_le_bytes());
        b[m + 16..m + 20].copy_from_slice(&self.byte_order.to_ne_bytes());
        b
    }

    /// `None` when the bytes are not a handshake of this protocol.
    pub(super) fn decode(b: &[u8; HANDSHAKE_LEN]) -> Option<Handshake> {
        let m = MAGIC.len();
        if &b[..m] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&b[m..m + 8]);
        Some(Handshake {
            tag: u64::from_le_bytes(tag),
            size: u32_at(m + 8),
            rank: u32_at(m + 12),
            byte_order: u32::from_ne_bytes([b[m + 16], b[m + 17], b[m + 18], b[m + 19]]),
        })
    }
}

/// A received payload, 8-byte aligned so that it can be viewed as elements of any dtype.
pub(super) struct Payload {
    words: Vec<u64>,
    len: usize,
}

impl Payload {
    /// The payload's bytes.
    pub(super) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    /// Length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// Reads one frame: `Ok(None)` on a clean end of stream before its first byte.
pub(super) fn read_frame(r: &mut impl Read) -> io::Result<Option<(u8, Payload)>> {
    let mut head = [0u8; 9];
    let mut got = 0;
    while got < head.len() {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[1..]);
    let len = usize::try_from(u64::from_le_bytes(len))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "frame length overflows"))?;
    let mut words: Vec<u64> = Vec::new();
    let mut filled = 0;
    while filled < len {
        let step = (len - filled).min(READ_STEP);
        // Fallible: a frame too large for this host's memory fails this receive (the
        // collective reports it) instead of aborting the process.
        let need = (filled + step).div_ceil(8);
        words.try_reserve(need - words.len()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("out of memory: a {len}-byte frame from a peer does not fit"),
            )
        })?;
        words.resize(need, 0);
        let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[filled..filled + step];
        r.read_exact(buf)?;
        filled += step;
    }
    Ok(Some((head[0], Payload { words, len })))
}

/// Writes one frame: its 9-byte head and `payload`, in one write when small.
pub(super) fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = kind;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    if payload.len() <= 64 << 10 {
        let mut buf = Vec::with_capacity(9 + payload.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(payload);
        w.write_all(&buf)
    } else {
        w.write_all(&head)?;
        w.write_all(payload)
    }
}

const OPS: [&str; 5] = [
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
    "barrier",
];
const DTYPES: [DType; 6] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::I32,
    DType::F64,
    DType::I64,
];
const REDUCE_OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Product,
];

/// A collective's header: its sequence number in the group and the call.
pub(super) fn encode_header(seq: u64, d: &Desc) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[..8].copy_from_slice(&seq.to_le_bytes());
    b[8] = OPS
        .iter()
        .position(|&o| o == d.op)
        .unwrap_or(u8::MAX as usize) as u8;
    b[9] = DTYPES
        .iter()
        .position(|&t| t == d.dtype)
        .unwrap_or(u8::MAX as usize) as u8;
    let (ak, av) = match d.arg {
        Arg::None => (0u8, 0u64),
        Arg::Op(op) => (
            1,
            REDUCE_OPS.iter().position(|&o| o == op).unwrap_or(0) as u64,
        ),
        Arg::Src(s) => (2, s as u64),
    };
    b[10] = ak;
    b[11..19].copy_from_slice(&av.to_le_bytes());
    b[19..27].copy_from_slice(&(d.in_numel as u64).to_le_bytes());
    b[27..35].copy_from_slice(&(d.out_numel as u64).to_le_bytes());
    b[35..].copy_from_slice(&fingerprint::encode(d.tag));
    b
}

/// Decodes a header; `Err` says what is wrong with the bytes.
pub(super) fn decode_header(b: &[u8]) -> Result<(u64, Desc), String> {
    if b.len() != HEADER_LEN {
        return Err(format!(
            "a collective header of {} bytes (expected {HEADER_LEN})",
            b.len()
        ));
    }
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(a)
    };
    let op = *OPS
        .get(b[8] as usize)
        .ok_or_else(|| format!("unknown collective code {}", b[8]))?;
    let dtype = *DTYPES
        .get(b[9] as usize)
        .ok_or_else(|| format!("unknown dtype code {}", b[9]))?;
    let av = u64_at(11);
    let arg = match b[10] {
        0 => Arg::None,
        1 => Arg::Op(
            *REDUCE_OPS
                .get(av as usize)
                .ok_or_else(|| format!("unknown reduce op code {av}"))?,
        ),
        2 => Arg::Src(usize::try_from(av).map_err(|_| "broadcast src overflows".to_string())?),
        k => return Err(format!("unknown argument kind {k}")),
    };
    let numel = |v: u64| usize::try_from(v).map_err(|_| "element count overflows".to_string());
    Ok((
        u64_at(0),
        Desc {
            op,
            dtype,
            in_numel: numel(u64_at(19))?,
            out_numel: numel(u64_at(27))?,
            arg,
            cuda: false,
            tag: fingerprint::decode(&b[35..])?,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_handshakes_round_trip_and_bad_bytes_are_errors() {
        let d = Desc {
            op: "broadcast",
            dtype: DType::BF16,
            in_numel: 33,
            out_numel: 33,
            arg: Arg::Src(3),
            cuda: false,
            tag: Some(fingerprint::Fingerprint {
                unit: fingerprint::Name::new("blocks.1"),
                phase: fingerprint::Phase::Backward,
                step: 3,
                micro_batch: 1,
                call: 2,
            }),
        };
        assert_eq!(decode_header(&encode_header(7, &d)).unwrap(), (7, d));
        let untagged = Desc { tag: None, ..d };
        assert_eq!(
            decode_header(&encode_header(7, &untagged)).unwrap(),
            (7, untagged)
        );
        let mut bad = encode_header(7, &d);
        bad[8] = 99;
        assert!(decode_header(&bad)
            .unwrap_err()
            .contains("collective code 99"));
        assert!(decode_header(&bad[..5]).is_err());
        let h = Handshake {
            tag: 42,
            size: 4,
            rank: 2,
            byte_order: BYTE_ORDER,
        };
        assert_eq!(Handshake::decode(&h.encode()), Some(h));
        let mut wrong = h.encode();
        wrong[0] = b'x';
        assert_eq!(Handshake::decode(&wrong), None);
        let mut wire = Vec::new();
        write_frame(&mut wire, kind::DATA, b"abc").unwrap();
        let (k, p) = read_frame(&mut &wire[..]).unwrap().unwrap();
        assert_eq!((k, p.bytes()), (kind::DATA, &b"abc"[..]));
        // A length that lies: an error once the stream ends, after reading what came.
        let mut lie = vec![kind::DATA];
        lie.extend_from_slice(&u64::MAX.to_le_bytes());
        lie.extend_from_slice(b"xy");
        assert!(read_frame(&mut &lie[..]).is_err());
    }
}
