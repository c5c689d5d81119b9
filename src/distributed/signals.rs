//! SIGINT/SIGTERM for `fsdp launch`: the launcher records the signal instead of dying, so it
//! can pass it on to its ranks and wait for them (torchrun's `SignalException` handling).
//! The handlers are signal-hook's (one atomic store each, async-signal-safe); sending a
//! signal to a rank is `kill(2)`, on Unix only.

use signal_hook::consts::{SIGINT, SIGTERM};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The number of the last signal caught, 0 for none.
static CAUGHT: AtomicUsize = AtomicUsize::new(0);

/// From now on SIGINT and SIGTERM are recorded (see [`caught`]) instead of ending the
/// process. Best effort: a signal whose handler cannot be installed keeps its default.
pub(crate) fn catch_int_term() {
    for sig in [SIGINT, SIGTERM] {
        // signal-hook replaces the default action (termination) by the store.
        let _ = signal_hook::flag::register_usize(sig, &CAUGHT, sig as usize);
    }
}

/// The signal caught since [`catch_int_term`], if any (its number).
pub(crate) fn caught() -> Option<i32> {
    match CAUGHT.load(Ordering::SeqCst) {
        0 => None,
        s => i32::try_from(s).ok(),
    }
}

/// Sends signal `sig` to process `pid` (best effort: it may have exited).
pub(crate) fn send(pid: u32, sig: i32) {
    #[cfg(unix)]
    // SAFETY: kill(2) with a pid of our own child and a valid signal number.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
    #[cfg(not(unix))]
    let _ = (pid, sig);
}

/// The name of a caught signal (`"SIGINT"`).
pub(crate) fn name(sig: i32) -> &'static str {
    signal_hook::low_level::signal_name(sig).unwrap_or("a signal")
}
