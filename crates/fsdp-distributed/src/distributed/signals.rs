//! Signals between `fsdp launch` and its ranks. SIGINT/SIGTERM: the launcher records the
//! signal instead of dying, so it can pass it on to its ranks and wait for them (torchrun's
//! `SignalException` handling). The handlers are signal-hook's (one atomic store each,
//! async-signal-safe); sending a signal to a rank is `kill(2)`, on Unix only. A launcher that
//! dies without a chance to pass anything on (`SIGKILL`: the OOM killer, a scheduler's
//! preemption) takes its ranks with it: [`die_with_launcher`].

use signal_hook::consts::{SIGINT, SIGTERM};
use std::process::Command;
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

/// Makes the process `cmd` starts die with this one (Linux): between fork and exec the child
/// asks the kernel for `SIGKILL` when its parent dies (`prctl(PR_SET_PDEATHSIG)`), then
/// checks that its parent is still this process, for the launcher may have died before the
/// request, and then no signal would ever come: such a child exits at once (status 1)
/// instead of running. Exec keeps the request (it is cleared only for set-user-ID
/// programs), so the rank a `sh -c 'exec ...'` becomes is covered too; grandchildren are
/// not. The signal follows the death of the thread that spawned the child: `fsdp launch`
/// spawns from its main thread, which lives as long as the launcher. Elsewhere than on
/// Linux, nothing is set.
pub(crate) fn die_with_launcher(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let launcher = std::process::id();
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: prctl(2) and getppid(2) are system calls,
        // and the errors are built from an errno without allocating.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if u32::try_from(libc::getppid()).ok() != Some(launcher) {
                    // Re-parented already: the launcher is gone.
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}
