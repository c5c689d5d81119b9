//! SIGINT/SIGTERM for `fsdp launch`: the launcher records the signal instead of dying, so it
//! can pass it on to its ranks and wait for them (torchrun's `SignalException` handling).
//! Unix only; elsewhere nothing is caught.

use std::sync::atomic::{AtomicI32, Ordering};

static CAUGHT: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    // Async-signal-safe: one atomic store.
    CAUGHT.store(sig, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM are recorded (see [`caught`]) instead of ending the
/// process.
pub(crate) fn catch_int_term() {
    #[cfg(unix)]
    // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// The signal caught since [`catch_int_term`], if any (its number).
pub(crate) fn caught() -> Option<i32> {
    match CAUGHT.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
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

/// The name of a caught signal.
pub(crate) fn name(sig: i32) -> &'static str {
    #[cfg(unix)]
    {
        if sig == libc::SIGINT {
            return "SIGINT";
        }
        if sig == libc::SIGTERM {
            return "SIGTERM";
        }
    }
    let _ = sig;
    "a signal"
}
