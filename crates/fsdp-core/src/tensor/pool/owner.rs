//! Which thread a pooled buffer belongs to, and the key of its bucket ([Note: pool bound]
//! in the parent module).

use super::with_pool;
use crate::dtype::DType;
use std::sync::atomic::{AtomicU32, Ordering};

/// Which thread's buckets a buffer belongs to ([Note: pool bound]): the thread that took it
/// from the pool or made its storage. 0 for a thread whose owner slot is already gone (it
/// is exiting); such buffers share one set of buckets.
pub(crate) type Owner = u32;

/// The next thread's [`Owner`] (0 is the exiting threads').
static NEXT_OWNER: AtomicU32 = AtomicU32::new(1);

/// A thread's [`Owner`]; when the thread exits, the pool frees what it holds for it and
/// forgets its peaks.
struct OwnerSlot(Owner);

impl Drop for OwnerSlot {
    fn drop(&mut self) {
        let freed = with_pool(|p| p.forget_owner(self.0));
        drop(freed);
    }
}

thread_local! {
    static OWNER: OwnerSlot = OwnerSlot(NEXT_OWNER.fetch_add(1, Ordering::Relaxed).max(1));
}

/// The calling thread's [`Owner`] (made on its first use of the pool).
pub(super) fn current_owner() -> Owner {
    OWNER.try_with(|o| o.0).unwrap_or(0)
}

/// A bucket's key: its owner thread, dtype and length.
pub(super) type Key = (Owner, DType, usize);
