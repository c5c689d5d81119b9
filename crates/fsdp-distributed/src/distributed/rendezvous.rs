//! The rendezvous of the `threads` backend: a process-global registry of pending worlds,
//! keyed by rendezvous address or name. Each joining thread claims its rank's handle of a
//! world created by the first to arrive; all return once the last arrives, or fail with a
//! timeout naming the ranks that never joined.

use super::init_options::Rendezvous;
use super::ThreadsGroup;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Instant;

/// A world being assembled: the handles of ranks that have not joined yet.
struct Pending {
    world_size: usize,
    state: Mutex<PendingState>,
    cv: Condvar,
}

struct PendingState {
    /// `Some` until rank `r` claims its handle.
    handles: Vec<Option<ThreadsGroup>>,
    joined: usize,
    /// Set when a rank gave up waiting: the ranks that never joined.
    abandoned: Option<Vec<usize>>,
}

/// Pending worlds by rendezvous key. Lock order: this map, then a `Pending`'s state.
static PENDING: LazyLock<Mutex<HashMap<String, Arc<Pending>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Joins `rv.key`'s world as `rv.rank`; blocks until all `rv.world_size` ranks joined.
///
/// # Errors
/// `InvalidArgument` for a rank already claimed or a different world size than the first
/// rank's; `Timeout` naming the ranks that did not join within `rv.timeout`.
pub(super) fn join(rv: &Rendezvous) -> Result<ThreadsGroup> {
    let (pending, handle) = {
        let mut map = PENDING.lock();
        let reuse = map
            .get(&rv.key)
            .filter(|p| p.state.lock().abandoned.is_none());
        let pending = match reuse {
            Some(p) => p.clone(),
            None => {
                let handles = ThreadsGroup::new_world(rv.world_size, rv.timeout)?;
                let p = Arc::new(Pending {
                    world_size: rv.world_size,
                    state: Mutex::new(PendingState {
                        handles: handles.into_iter().map(Some).collect(),
                        joined: 0,
                        abandoned: None,
                    }),
                    cv: Condvar::new(),
                });
                map.insert(rv.key.clone(), p.clone());
                p
            }
        };
        if pending.world_size != rv.world_size {
            crate::error::bail_arg!(
                "init_process_group: rendezvous '{}' has world size {} (set by the first rank to join) but rank {} gave {}",
                rv.key,
                pending.world_size,
                rv.rank,
                rv.world_size
            );
        }
        let mut st = pending.state.lock();
        let Some(handle) = st.handles[rv.rank].take() else {
            crate::error::bail_arg!(
                "init_process_group: rank {} already joined rendezvous '{}' (two threads gave the same rank)",
                rv.rank,
                rv.key
            );
        };
        st.joined += 1;
        if st.joined == pending.world_size {
            map.remove(&rv.key);
            pending.cv.notify_all();
            return Ok(handle);
        }
        drop(st);
        (pending, handle)
    };
    let deadline = Instant::now() + rv.timeout;
    let mut pace = crate::distributed::waiting::Pacer::new(rv.rank, rv.timeout);
    let mut st = pending.state.lock();
    loop {
        if st.joined == pending.world_size {
            return Ok(handle);
        }
        if let Some(missing) = &st.abandoned {
            return Err(join_timeout(rv, missing.clone()));
        }
        if pending
            .cv
            .wait_until(&mut st, pace.until(deadline))
            .timed_out()
            && st.joined < pending.world_size
            && Instant::now() < deadline
        {
            let missing: Vec<usize> = (0..pending.world_size)
                .filter(|&r| st.handles[r].is_some())
                .collect();
            pace.tick(|| {
                format!(
                    "init_process_group (rendezvous '{}'): ranks {missing:?} have not joined",
                    rv.key
                )
            });
            continue;
        }
        if Instant::now() >= deadline && st.joined < pending.world_size && st.abandoned.is_none() {
            let missing: Vec<usize> = (0..pending.world_size)
                .filter(|&r| st.handles[r].is_some())
                .collect();
            st.abandoned = Some(missing.clone());
            pending.cv.notify_all();
            drop(st);
            // A later init with this key starts a fresh world.
            let mut map = PENDING.lock();
            if map.get(&rv.key).is_some_and(|p| Arc::ptr_eq(p, &pending)) {
                map.remove(&rv.key);
            }
            return Err(join_timeout(rv, missing));
        }
    }
}

fn join_timeout(rv: &Rendezvous, missing: Vec<usize>) -> Error {
    Error::Timeout {
        op: format!("init_process_group (rendezvous '{}')", rv.key),
        rank: rv.rank,
        timeout_s: rv.timeout.as_secs_f64(),
        missing_ranks: missing,
    }
}
