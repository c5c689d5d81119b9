//! What the ranks of an NCCL group leave in the job's store for each other when something
//! goes wrong, and how a rank reads it to name the rank at fault (PyTorch's
//! ProcessGroupNCCL: the collective counts of its desync debugging,
//! `ProcessGroupNCCL::retrieveDesyncReport`, and the failure a rank records before it
//! exits). A healthy collective writes and reads none of it.
//!
//! - **Collective counts.** A rank whose collective is slow records how many collectives
//!   of the group it entered, under `"{prefix}/seq/{group rank}"`. At a timeout, the ranks
//!   whose count is below the stuck collective's never entered it. A rank never names
//!   itself: it did enter.
//! - **Failures, in order.** A rank that fails records why under `"nccl/failed/{world
//!   rank}"`, behind its place in the job's order of failures (the counter
//!   `"nccl/failure_order"`, the store's atomic `add`). A peer names the earliest: the rank
//!   that failed first, not one that failed because of it and recorded so too.
//! - **Timeouts.** A rank whose collective timed out records the ranks it found missing,
//!   under `"{prefix}/timeout"`, before it aborts its communicator. A peer whose collective
//!   then fails because that rank aborted (NCCL's remote error) reports the same timeout
//!   naming the same ranks, not the rank that gave up on them.
//!
//! The store is hosted by rank 0's process: when rank 0's group fails, the watchdog keeps
//! the group (and so the store server) alive for a while (`watchdog::linger`), so
//! that peers that find the failure a little later can still read who was at fault.

use super::super::Store;
use std::sync::Arc;

/// The store key counting the job's recorded failures (their order).
const FAILURE_ORDER: &str = "nccl/failure_order";

/// The store key where world rank `rank` records its failure.
fn failure_key(rank: usize) -> String {
    format!("nccl/failed/{rank}")
}

/// One rank's view of its group's records in the store.
pub(super) struct Evidence {
    /// This rank in the group, and the group's world ranks in group-rank order.
    pub(super) rank: usize,
    pub(super) members: Vec<usize>,
    pub(super) store: Arc<dyn Store>,
    /// Key prefix of the group's collective counts.
    pub(super) prefix: String,
}

impl Evidence {
    fn world_rank(&self) -> usize {
        self.members[self.rank]
    }

    /// Records in the store that this rank failed, with `reason`, after every failure
    /// recorded before it (a second record of this rank keeps the first). A store error
    /// only loses the record: peers then name the rank by its collective count.
    pub(super) fn record_failure(&self, reason: &str) {
        let key = failure_key(self.world_rank());
        if self.store.check(&[key.as_str()]).unwrap_or(false) {
            return;
        }
        let order = self.store.add(FAILURE_ORDER, 1).unwrap_or(i64::MAX);
        let _ = self.store.set(&key, format!("{order} {reason}").as_bytes());
    }

    /// The peer that recorded the earliest failure, with its reason; None when no peer
    /// recorded one (or the store cannot be read).
    pub(super) fn failed_peer(&self) -> Option<(usize, String)> {
        let me = self.world_rank();
        let mut first: Option<(i64, usize, String)> = None;
        for &r in self.members.iter().filter(|&&r| r != me) {
            let key = failure_key(r);
            if !self.store.check(&[key.as_str()]).unwrap_or(false) {
                continue;
            }
            let Ok(v) = self.store.get(&key) else {
                continue;
            };
            let text = String::from_utf8_lossy(&v).into_owned();
            let parsed = text
                .split_once(' ')
                .and_then(|(n, reason)| Some((n.parse::<i64>().ok()?, reason.to_string())));
            let (order, reason) = parsed.unwrap_or((i64::MAX, text));
            if first.as_ref().is_none_or(|(o, _, _)| order < *o) {
                first = Some((order, r, reason));
            }
        }
        first.map(|(_, r, reason)| (r, reason))
    }

    /// Records in the store that a collective of the group timed out at this rank,
    /// `missing` (world ranks) never having entered it; a store error only loses that.
    pub(super) fn record_timeout(&self, missing: &[usize]) {
        let text: Vec<String> = missing.iter().map(|r| r.to_string()).collect();
        let _ = self.store.set(
            &format!("{}/timeout", self.prefix),
            text.join(",").as_bytes(),
        );
    }

    /// The ranks a peer found missing when a collective of the group timed out there, if
    /// one recorded that (see [`record_timeout`](Self::record_timeout)).
    pub(super) fn timed_out(&self) -> Option<Vec<usize>> {
        let key = format!("{}/timeout", self.prefix);
        if !self.store.check(&[key.as_str()]).ok()? {
            return None;
        }
        let text = String::from_utf8(self.store.get(&key).ok()?).ok()?;
        text.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().ok())
            .collect()
    }

    /// Records in the store that this rank entered `seq` collectives of the group (for a
    /// peer's [`lagging_ranks`](Self::lagging_ranks)); a store error only loses that hint.
    pub(super) fn publish_seq(&self, seq: u64) {
        let _ = self.store.set(
            &format!("{}/seq/{}", self.prefix, self.rank),
            seq.to_string().as_bytes(),
        );
    }

    /// World ranks of the peers that have not shown they entered collective number `seq`
    /// (their recorded count is below it, absent, or unreadable). Never this rank.
    pub(super) fn lagging_ranks(&self, seq: u64) -> Vec<usize> {
        (0..self.members.len())
            .filter(|&r| r != self.rank && self.count_of(r).is_none_or(|n| n < seq))
            .map(|r| self.members[r])
            .collect()
    }

    /// Group rank `r`'s recorded collective count, if it recorded one and it can be read.
    fn count_of(&self, r: usize) -> Option<u64> {
        let key = format!("{}/seq/{r}", self.prefix);
        if !self.store.check(&[key.as_str()]).ok()? {
            return None;
        }
        let v = self.store.get(&key).ok()?;
        String::from_utf8(v).ok()?.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::distributed::TcpStore;
    use std::time::Duration;

    fn views(world: usize) -> Vec<Evidence> {
        let master = TcpStore::new("127.0.0.1", 0, 0, true, Duration::from_secs(5)).unwrap();
        let port = master.port();
        let master: Arc<dyn Store> = Arc::new(master);
        (0..world)
            .map(|rank| Evidence {
                rank,
                members: (0..world).collect(),
                store: if rank == 0 {
                    master.clone()
                } else {
                    Arc::new(
                        TcpStore::new("127.0.0.1", port, rank, false, Duration::from_secs(5))
                            .unwrap(),
                    )
                },
                prefix: "nccl/world".into(),
            })
            .collect()
    }

    /// A victim of lower rank that records its failure after the rank that failed first is
    /// not the one named; a second record of a rank keeps its first place and reason.
    #[test]
    fn peers_name_the_earliest_failure_not_the_lowest_rank() {
        let ranks = views(4);
        assert_eq!(ranks[0].failed_peer(), None);
        ranks[2].record_failure("out of data");
        ranks[0].record_failure("rank 2 failed: out of data");
        ranks[2].record_failure("a later error");
        for r in [1, 3] {
            assert_eq!(
                ranks[r].failed_peer(),
                Some((2, "out of data".into())),
                "rank {r}"
            );
        }
        // The failed rank itself sees the other record only.
        assert_eq!(
            ranks[2].failed_peer(),
            Some((0, "rank 2 failed: out of data".into()))
        );
    }

    /// A rank is lagging when its recorded count is below the collective's or absent;
    /// never the rank that asks, whatever it recorded.
    #[test]
    fn lagging_ranks_are_the_peers_below_the_collective() {
        let ranks = views(4);
        assert_eq!(ranks[1].lagging_ranks(3), vec![0, 2, 3]);
        ranks[0].publish_seq(3);
        ranks[2].publish_seq(2);
        ranks[3].publish_seq(4);
        assert_eq!(ranks[1].lagging_ranks(3), vec![2]);
        assert_eq!(ranks[2].lagging_ranks(3), vec![1]);
        assert_eq!(ranks[1].lagging_ranks(5), vec![0, 2, 3]);
    }

    /// What one rank records at its timeout, every peer reads back.
    #[test]
    fn a_recorded_timeout_names_the_missing_ranks_to_every_peer() {
        let ranks = views(3);
        assert_eq!(ranks[1].timed_out(), None);
        ranks[0].record_timeout(&[2]);
        assert_eq!(ranks[1].timed_out(), Some(vec![2]));
        assert_eq!(ranks[2].timed_out(), Some(vec![2]));
    }
}
