//! The current stream and memory account of the calling thread (`torch.cuda.current_stream`,
//! `torch.cuda.stream(s)`), so tensor ops need no stream argument.
//!
//! Every thread has, per device, a current [`Stream`]: its own compute stream, created on
//! first use, unless a [`StreamGuard`] from [`use_stream`] made another one current. Rank
//! threads of the threads backend therefore each compute on their own stream, and several
//! ranks share one GPU without serializing on the legacy default stream.
//!
//! Every thread also has a [`MemAccount`] its allocations are charged to: the rank's, once
//! the launcher called [`set_rank_account`] (a communication thread of a rank shares it),
//! else a private one created on first use.

use super::{CudaDevice, MemAccount, Stream};
use crate::error::Result;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

thread_local! {
    static ACCOUNT: RefCell<Option<Arc<MemAccount>>> = const { RefCell::new(None) };
    static DEFAULT: RefCell<HashMap<usize, Arc<Stream>>> = RefCell::new(HashMap::new());
    static OVERRIDE: RefCell<HashMap<usize, Arc<Stream>>> = RefCell::new(HashMap::new());
}

/// The account this thread's device allocations are charged to (created on first use).
pub fn rank_account() -> Arc<MemAccount> {
    ACCOUNT.with(|a| a.borrow_mut().get_or_insert_with(MemAccount::new).clone())
}

/// Charges this thread's later allocations to `account` (a rank's communication thread
/// passes its rank's account). Streams created before keep their account.
pub fn set_rank_account(account: Arc<MemAccount>) {
    ACCOUNT.with(|a| *a.borrow_mut() = Some(account));
}

/// This thread's current stream on `cuda:ordinal`: the one a live [`StreamGuard`] made
/// current, else the thread's own compute stream (created on first call, charged to
/// [`rank_account`]). Binds the device's context to the calling thread.
///
/// # Errors
/// [`crate::Error::Cuda`] without a driver, for a missing device, or when the stream
/// cannot be created.
pub fn current_stream(ordinal: usize) -> Result<Arc<Stream>> {
    let known = OVERRIDE
        .with(|o| o.borrow().get(&ordinal).cloned())
        .or_else(|| DEFAULT.with(|d| d.borrow().get(&ordinal).cloned()));
    if let Some(s) = known {
        // Ops that follow use raw driver calls on this thread: make the context current.
        s.bind()?;
        return Ok(s);
    }
    let dev = CudaDevice::get(ordinal)?;
    let s = Arc::new(Stream::new(&dev, rank_account())?);
    DEFAULT.with(|d| d.borrow_mut().insert(ordinal, s.clone()));
    Ok(s)
}

/// Makes `stream` this thread's current stream on its device until the guard drops
/// (`with torch.cuda.stream(s):`). Guards nest.
pub fn use_stream(stream: Arc<Stream>) -> StreamGuard {
    let ordinal = stream.device().ordinal();
    let prev = OVERRIDE.with(|o| o.borrow_mut().insert(ordinal, stream));
    StreamGuard { ordinal, prev }
}

/// Restores the previous current stream of one device when dropped; see [`use_stream`].
#[must_use = "the stream is current only while the guard lives"]
pub struct StreamGuard {
    ordinal: usize,
    prev: Option<Arc<Stream>>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        OVERRIDE.with(|o| {
            let mut o = o.borrow_mut();
            match self.prev.take() {
                Some(p) => o.insert(self.ordinal, p),
                None => o.remove(&self.ordinal),
            };
        });
    }
}
