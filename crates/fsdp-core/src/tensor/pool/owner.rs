//! Which thread a pooled buffer belongs to, and the key of its bucket ([Note: pool bound]
//! in the parent module).

use super::with_pool;
use crate::dtype::DType;
use std::hash::Hasher;
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

/// The buckets' hasher: a multiply-rotate over the key's three words (FxHash's scheme).
/// A key is hashed on every take and drop; SipHash's resistance to chosen keys buys
/// nothing for keys the program makes.
#[derive(Default)]
pub(super) struct KeyHasher(u64);

impl KeyHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.add(u64::from(b));
        }
    }
    fn write_u8(&mut self, n: u8) {
        self.add(u64::from(n));
    }
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    fn write_isize(&mut self, n: isize) {
        self.add(n as u64);
    }
}
