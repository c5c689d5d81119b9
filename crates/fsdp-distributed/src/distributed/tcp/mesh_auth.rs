//! The job handshake on the mesh's connections ([Note: job auth] in
//! [`auth`](crate::distributed::auth)): a rank proves its job to every lower rank it dials,
//! and a rank accepts only higher ranks that prove theirs, so a process outside the job
//! that finds a mesh port cannot pose as a rank.

use super::mesh::MeshSpec;
use crate::distributed::auth;
use crate::error::{Error, Result};
use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};

/// This rank dials group rank `p` at `peer`: the job handshake, before the mesh's own. The
/// caller set the stream's read timeout to the set-up deadline.
///
/// # Errors
/// `Refused` when `peer` belongs to another job or cannot prove the job secret (or refused
/// this rank); `Timeout` naming rank `p` when it did not answer in time; `Io` otherwise.
pub(super) fn dial(
    spec: &MeshSpec<'_>,
    s: &mut TcpStream,
    p: usize,
    peer: &SocketAddr,
) -> Result<()> {
    let me = spec.me();
    let at = format!(
        "{} on rank {me}: rank {} at {peer}",
        spec.what, spec.members[p]
    );
    auth::dial(s, spec.job, &format!("mesh rank {me}"), &at).map_err(|e| match e {
        Error::Io { source, .. }
            if matches!(
                source.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            spec.timeout_err(vec![spec.members[p]])
        }
        e => e,
    })
}

/// The acceptor's side while a mesh is set up: remembers whom it logged.
#[derive(Default)]
pub(super) struct Gate {
    logged: HashSet<(IpAddr, String)>,
}

impl Gate {
    /// Whether the dialer of `s` (from `from`) passes the job handshake; a refusal is
    /// logged on stderr once per (peer IP, reason), as `refused a connection from ADDR: ...`.
    pub(super) fn pass(
        &mut self,
        spec: &MeshSpec<'_>,
        s: &mut TcpStream,
        from: SocketAddr,
    ) -> bool {
        match auth::accept(s, spec.job, "mesh") {
            Ok(()) => true,
            Err(r) => {
                if self.logged.insert((from.ip(), r.reason.clone())) {
                    let who = format!("fsdp: {} on rank {}", spec.what, spec.me());
                    auth::log(&r.line(&who, &from.to_string()));
                }
                false
            }
        }
    }
}
