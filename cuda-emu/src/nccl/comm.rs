//! Communicators of any size: ranks are threads of one process or separate processes (the
//! ranks of `fsdp launch`), and a collective goes through files in a directory named by
//! the communicator's unique id (under the temporary directory), which every rank of it
//! reaches. No transport of NCCL's is emulated, only what a collective means.
//!
//! A collective is a [`Poll`](crate::queue::Poll) in its stream: when the stream is forced
//! it posts this rank's input (a file `<seq>.<rank>`, written and renamed into place), then
//! finishes once every rank's file of that sequence number is there: it checks that all
//! ranks called the same collective with the same count, dtype, operation and root, and
//! writes the result. Until the peers arrive the stream is blocked: a query answers "not
//! ready", a synchronization waits (queue.rs), as on a GPU whose NCCL kernel spins.
//!
//! Reductions run in rank order in f64 (i64 for integers) with one rounding at the end, as
//! fsdp's `threads` backend does, so an emulated NCCL run matches a threads run bit for bit
//! (real NCCL reduces along its ring in the element type).
//!
//! Failures, as real NCCL reports them through `ncclCommGetAsyncError`: a peer that aborted
//! its communicator (a file `abort.<rank>`) or whose process is gone (`member.<rank>` holds
//! its pid) fails the waiting collective with `ncclRemoteError`; ranks that called
//! different collectives at the same point fail with `ncclInvalidUsage` naming both (NCCL
//! itself would hang or corrupt data: the emulator says what happened). A failed or aborted
//! collective finishes without writing its output, so the stream can drain.

use std::ffi::c_int;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const REMOTE_ERROR: c_int = 6;
pub const INVALID_USAGE: c_int = 5;

/// What a collective is, the same on every rank that takes part (the header of its file).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Op {
    /// 0 all-gather, 1 reduce-scatter, 2 all-reduce, 3 broadcast.
    pub kind: u32,
    pub dtype: c_int,
    /// ncclSum 0, ncclProd 1, ncclMax 2, ncclMin 3, ncclAvg 4 (reductions only).
    pub redop: c_int,
    pub root: c_int,
    /// Elements per rank (all-gather's send, reduce-scatter's receive), or in all.
    pub count: u64,
}

impl Op {
    pub fn name(&self) -> &'static str {
        [
            "ncclAllGather",
            "ncclReduceScatter",
            "ncclAllReduce",
            "ncclBroadcast",
        ]
        .get(self.kind as usize)
        .copied()
        .unwrap_or("?")
    }

    fn encode(&self) -> [u8; 32] {
        let mut h = [0u8; 32];
        h[0..4].copy_from_slice(&self.kind.to_le_bytes());
        h[4..8].copy_from_slice(&self.dtype.to_le_bytes());
        h[8..12].copy_from_slice(&self.redop.to_le_bytes());
        h[12..16].copy_from_slice(&self.root.to_le_bytes());
        h[16..24].copy_from_slice(&self.count.to_le_bytes());
        h
    }

    fn decode(h: &[u8]) -> Option<Op> {
        let int = |a: usize| i32::from_le_bytes(h[a..a + 4].try_into().unwrap());
        (h.len() >= 32).then(|| Op {
            kind: u32::from_le_bytes(h[0..4].try_into().unwrap()),
            dtype: int(4),
            redop: int(8),
            root: int(12),
            count: u64::from_le_bytes(h[16..24].try_into().unwrap()),
        })
    }

    fn describe(&self) -> String {
        format!(
            "{} of {} elements (dtype {}, op {}, root {})",
            self.name(),
            self.count,
            self.dtype,
            self.redop,
            self.root
        )
    }
}

/// A communicator's state, shared by its handle and its collectives in flight.
pub struct Shared {
    pub dir: PathBuf,
    pub rank: usize,
    pub nranks: usize,
    pub device: c_int,
    seq: AtomicU64,
    aborted: AtomicBool,
    error: AtomicI32,
    reason: Mutex<String>,
}

impl Shared {
    /// Joins the communicator of `id` as `rank` of `nranks`.
    pub fn join(id: &str, rank: usize, nranks: usize, device: c_int) -> std::io::Result<Shared> {
        let dir = std::env::temp_dir().join(format!("cuda-emu-nccl-{id}"));
        fs::create_dir_all(&dir)?;
        write_atomically(
            &dir,
            &format!("member.{rank}"),
            std::process::id().to_string().as_bytes(),
        )?;
        Ok(Shared {
            dir,
            rank,
            nranks,
            device,
            seq: AtomicU64::new(0),
            aborted: AtomicBool::new(false),
            error: AtomicI32::new(0),
            reason: Mutex::new(String::new()),
        })
    }

    pub fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// The asynchronous error (0 for none) and its text.
    pub fn error(&self) -> (c_int, String) {
        let e = self.error.load(Ordering::Acquire);
        (
            e,
            self.reason
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }

    fn fail(&self, code: c_int, why: String) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if self.error.load(Ordering::Acquire) == 0 {
            *r = why;
            self.error.store(code, Ordering::Release);
        }
    }

    /// `ncclCommAbort`: collectives in flight finish without output, and the peers learn it.
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        let _ = write_atomically(&self.dir, &format!("abort.{}", self.rank), b"");
    }

    /// Leaves the communicator: removes this rank's membership, and the directory once
    /// no member is left. The files this rank posted stay until then: a peer may not have
    /// read them yet (on a GPU, a rank that finished a collective and destroyed its
    /// communicator does not take back what it sent); a peer that finds every part of a
    /// collective finishes it, or sees that the ranks called different collectives.
    pub fn leave(&self) {
        let _ = fs::remove_file(self.dir.join(format!("member.{}", self.rank)));
        let members_left = fs::read_dir(&self.dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("member."))
        });
        if !members_left {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    /// Why a peer cannot arrive, if one cannot: it aborted, or its process is gone.
    fn dead_peer(&self) -> Option<String> {
        for p in (0..self.nranks).filter(|&p| p != self.rank) {
            if self.dir.join(format!("abort.{p}")).exists() {
                return Some(format!("rank {p} aborted its communicator"));
            }
            let pid = fs::read_to_string(self.dir.join(format!("member.{p}"))).ok();
            if let Some(pid) = pid.and_then(|s| s.trim().parse::<u32>().ok()) {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    return Some(format!("rank {p} (process {pid}) exited"));
                }
            }
        }
        None
    }
}

fn write_atomically(dir: &Path, name: &str, data: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    fs::write(&tmp, data)?;
    fs::rename(&tmp, dir.join(name))
}

/// One rank's part of one collective, polled by its stream (see the module docs).
pub struct Collective {
    pub shared: Arc<Shared>,
    pub op: Op,
    pub seq: u64,
    /// Device addresses and byte counts of this rank's input and output.
    pub send: usize,
    pub send_bytes: usize,
    pub recv: usize,
    pub recv_bytes: usize,
    posted: bool,
    last_check: Option<Instant>,
}

impl Collective {
    pub fn new(
        shared: Arc<Shared>,
        op: Op,
        send: usize,
        send_bytes: usize,
        recv: usize,
        recv_bytes: usize,
    ) -> Collective {
        let seq = shared.next_seq();
        Collective {
            shared,
            op,
            seq,
            send,
            send_bytes,
            recv,
            recv_bytes,
            posted: false,
            last_check: None,
        }
    }

    fn input(&self) -> &[u8] {
        // SAFETY: checked at issue to be `send_bytes` of live device memory; stream order
        // keeps it allocated and written until this collective has run.
        unsafe { std::slice::from_raw_parts(self.send as *const u8, self.send_bytes) }
    }

    /// One poll: true once the collective has finished (with or without an error).
    pub fn poll(&mut self) -> bool {
        let sh = self.shared.clone();
        if sh.aborted.load(Ordering::Acquire) || sh.error().0 != 0 {
            return true;
        }
        let me = sh.rank;
        // A broadcast's non-root ranks post only the header.
        let payload: &[u8] = if self.op.kind == 3 && self.op.root as usize != me {
            &[]
        } else {
            self.input()
        };
        if sh.nranks == 1 {
            let header = self.op.encode();
            let mut file = header.to_vec();
            file.extend_from_slice(payload);
            self.finish(&[file]);
            return true;
        }
        if !self.posted {
            let mut file = self.op.encode().to_vec();
            file.extend_from_slice(payload);
            if let Err(e) = write_atomically(&sh.dir, &format!("{}.{me}", self.seq), &file) {
                sh.fail(
                    REMOTE_ERROR,
                    format!("cuda-emu: posting {}: {e}", self.op.name()),
                );
                return true;
            }
            self.posted = true;
        }
        let paths: Vec<PathBuf> = (0..sh.nranks)
            .map(|p| sh.dir.join(format!("{}.{p}", self.seq)))
            .collect();
        if !paths.iter().all(|p| p.exists()) {
            let due = self
                .last_check
                .is_none_or(|t| t.elapsed() > Duration::from_millis(100));
            if due {
                self.last_check = Some(Instant::now());
                if let Some(why) = sh.dead_peer() {
                    sh.fail(REMOTE_ERROR, format!("{why} during {}", self.op.name()));
                    return true;
                }
            }
            return false;
        }
        let mut files = Vec::with_capacity(sh.nranks);
        for p in &paths {
            match fs::read(p) {
                Ok(f) => files.push(f),
                Err(_) => return false, // renamed into place but unreadable: next poll
            }
        }
        for (p, f) in files.iter().enumerate() {
            if Op::decode(f) != Some(self.op) {
                let theirs = Op::decode(f).map_or("an unreadable call".into(), |o| o.describe());
                sh.fail(
                    INVALID_USAGE,
                    format!(
                        "mismatched collectives at collective #{}: rank {me} called {}, rank {p} {theirs}",
                        self.seq + 1,
                        self.op.describe()
                    ),
                );
                return true;
            }
        }
        self.finish(&files);
        true
    }

    /// Writes the result from every rank's posted file (header, then data).
    fn finish(&self, files: &[Vec<u8>]) {
        let data: Vec<&[u8]> = files.iter().map(|f| &f[32..]).collect();
        // SAFETY: checked at issue: `recv_bytes` of live device memory.
        let out = unsafe { std::slice::from_raw_parts_mut(self.recv as *mut u8, self.recv_bytes) };
        let n = self.shared.nranks;
        match self.op.kind {
            0 => {
                for (r, d) in data.iter().enumerate() {
                    out[r * d.len()..(r + 1) * d.len()].copy_from_slice(d);
                }
            }
            3 => out.copy_from_slice(data[self.op.root as usize]),
            1 => {
                let chunk = self.recv_bytes;
                let at = self.shared.rank * chunk;
                let parts: Vec<&[u8]> = data.iter().map(|d| &d[at..at + chunk]).collect();
                super::reduce::reduce(self.op.dtype, self.op.redop, n, &parts, out);
            }
            _ => super::reduce::reduce(self.op.dtype, self.op.redop, n, &data, out),
        }
    }
}
