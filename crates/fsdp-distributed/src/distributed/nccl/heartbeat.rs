//! The heartbeat of the `nccl` backend's rank processes ([Note: heartbeat] in
//! `heartbeat.rs`, the same beat as the `tcp` backend's): a rank process that stops as a
//! whole (`SIGSTOP`, a frozen VM, a host cut off) is named by its peers within the
//! heartbeat timeout, not after the collective timeout.
//!
//! A world group made through the rendezvous store ([`NcclGroup::init`](super::nccl::NcclGroup::init),
//! `init_process_group(backend="nccl")`, the ranks of `fsdp launch`) starts one heartbeat
//! thread with its own store connection (no `store_ops` per step). Every group of that
//! world (the world group and each `new_group`) registers here. When the heartbeat finds a
//! peer stale, every live group records [`Error::PeerFailed`] naming it and aborts its
//! communicator at once, as the watchdog does at a timeout (`watchdog.rs`): the
//! collective in flight ends, the streams drain, and the group's next call (or the
//! waiting `barrier`) returns the error. A group made after that fails the same way.
//! Thread ranks made with [`NcclGroup::new`](super::nccl::NcclGroup::new) have no
//! heartbeat (one process: it stops as a whole).

use super::super::heartbeat::{self, BeatSpec, Heartbeat};
use super::Shared;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::sync::{Arc, Weak};

/// What the groups of one rank's NCCL world share: their list (to fail them all when a
/// peer is stale) and the heartbeat, which stops when the last group is dropped.
#[derive(Default)]
pub(super) struct Peers {
    groups: Mutex<Vec<Weak<Shared>>>,
    /// The stale peer and why, once the heartbeat found one.
    stale: Mutex<Option<(usize, String)>>,
    beat: Mutex<Option<Heartbeat>>,
}

impl Peers {
    /// Registers the group `g` of this world; fails it at once when a peer is already
    /// known to be stale.
    pub(super) fn add(&self, g: &Arc<Shared>) {
        let mut groups = self.groups.lock();
        groups.retain(|w| w.strong_count() > 0);
        groups.push(Arc::downgrade(g));
        drop(groups);
        if let Some((rank, why)) = self.stale.lock().clone() {
            g.fail(stale_error(rank, why));
        }
    }

    /// Starts the heartbeat of world rank `rv.rank` through the rendezvous store
    /// (`rv.key`, `HOST:PORT`), beating every fifth of `rv.heartbeat_timeout`; nothing for a
    /// world of one rank.
    ///
    /// # Errors
    /// `Io` when its thread cannot start.
    pub(super) fn start(self: &Arc<Self>, rv: &super::super::Rendezvous) -> Result<()> {
        let Some(spec) = BeatSpec::of(rv) else {
            return Ok(());
        };
        let weak = Arc::downgrade(self);
        let beat = heartbeat::start(spec, move |r, why| {
            if let Some(p) = weak.upgrade() {
                p.peer_stale(r, why);
            }
        })?;
        *self.beat.lock() = Some(beat);
        Ok(())
    }

    /// World rank `rank` sent no heartbeat in time: every live group of this world records
    /// its failure and aborts its communicator.
    fn peer_stale(&self, rank: usize, why: String) {
        *self.stale.lock() = Some((rank, why.clone()));
        let live: Vec<Arc<Shared>> = self
            .groups
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for g in live {
            g.fail(stale_error(rank, why.clone()));
        }
    }
}

fn stale_error(failed_rank: usize, reason: String) -> Error {
    Error::PeerFailed {
        failed_rank,
        reason,
    }
}
