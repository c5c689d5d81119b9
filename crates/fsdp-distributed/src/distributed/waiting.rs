//! Progress lines of long waits: a rank that waits longer than a few seconds (for the
//! store to answer, for ranks to join, for peers to reach a collective) says so on stderr
//! every [`period`], naming what it waits for, instead of staying silent until the timeout.
//!
//! One line per period and waiting rank, written in one `write` (ranks of `fsdp launch`
//! share stderr):
//!
//! ```text
//! fsdp: rank 1 still waiting after 5 s (timeout 300 s): connecting to the TCPStore at 10.0.0.1:29500: nothing listens there (connection refused)
//! fsdp: rank 0 still waiting after 10 s (timeout 300 s): all_reduce: ranks [3] have not arrived
//! ```
//!
//! Two shapes of wait use it: a loop that sleeps on a condition variable asks a [`Pacer`]
//! how long it may sleep ([`Pacer::until`]) and lets it print ([`Pacer::tick`]); a call that
//! blocks in the kernel (a read with a timeout) runs under a [`Ticker`], a thread that
//! prints until the call returns.
//!
//! The period is [`PROGRESS_VAR`] (`FSDP_WAIT_PROGRESS`, seconds, default 5; `0` turns the
//! lines off), read once per process.

use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The variable that sets the seconds between progress lines (default 5; 0: no lines).
pub const PROGRESS_VAR: &str = "FSDP_WAIT_PROGRESS";

/// Seconds between progress lines when [`PROGRESS_VAR`] is not set.
pub const DEFAULT_PROGRESS: Duration = Duration::from_secs(5);

/// The period of progress lines: [`PROGRESS_VAR`] when it holds a number of seconds, else
/// [`DEFAULT_PROGRESS`]; `None` when it is `0` (off). A value that is not a number is
/// ignored (the default applies): a progress line is no reason to fail a job.
pub(crate) fn period() -> Option<Duration> {
    static PERIOD: OnceLock<Option<Duration>> = OnceLock::new();
    *PERIOD.get_or_init(|| {
        let raw = std::env::var(PROGRESS_VAR).ok();
        match raw.as_deref().map(str::trim).map(str::parse::<f64>) {
            Some(Ok(0.0)) => None,
            Some(Ok(s)) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s.max(0.01))),
            _ => Some(DEFAULT_PROGRESS),
        }
    })
}

/// Writes one progress line: `fsdp: rank R still waiting after E s (timeout T s): WHAT`.
fn line(rank: usize, waited: Duration, timeout: Duration, what: &str) {
    crate::distributed::auth::log(&format!(
        "fsdp: rank {rank} still waiting after {} s (timeout {} s): {what}",
        seconds(waited),
        seconds(timeout)
    ));
}

/// `d` in seconds, whole when it is at least 10 s, else with one decimal.
fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 10.0 || s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}

/// Paces the progress lines of one wait that loops on a condition variable.
#[derive(Debug)]
pub(crate) struct Pacer {
    rank: usize,
    timeout: Duration,
    start: Instant,
    /// When the next line is due; `None` when lines are off.
    next: Option<Instant>,
}

impl Pacer {
    /// A wait of rank `rank` that started now and gives up after `timeout`.
    pub(crate) fn new(rank: usize, timeout: Duration) -> Pacer {
        let start = Instant::now();
        Pacer {
            rank,
            timeout,
            start,
            next: period().map(|p| start + p),
        }
    }

    /// How long the wait may sleep: until `deadline` or the next line, whichever is first.
    pub(crate) fn until(&self, deadline: Instant) -> Instant {
        self.next.map_or(deadline, |n| n.min(deadline))
    }

    /// Prints `what()` when a line is due (and schedules the next one).
    pub(crate) fn tick(&mut self, what: impl FnOnce() -> String) {
        let (Some(next), Some(p)) = (self.next, period()) else {
            return;
        };
        let now = Instant::now();
        if now < next {
            return;
        }
        line(self.rank, now - self.start, self.timeout, &what());
        // The next multiple of the period after now (a long sleep skips lines, not bunches).
        let mut n = next + p;
        while n <= now {
            n += p;
        }
        self.next = Some(n);
    }
}

/// A thread that prints a progress line every period until dropped: for a call that blocks
/// in the kernel and cannot look at the clock itself.
#[derive(Debug)]
pub(crate) struct Ticker {
    /// Dropping it ends the thread (its `recv_timeout` sees the channel closed).
    _stop: mpsc::Sender<()>,
}

impl Ticker {
    /// Starts printing `what()` for rank `rank` every period, the first line after one
    /// period; `None` when lines are off or the thread cannot start (the wait then goes on
    /// silently, as before).
    pub(crate) fn start(
        rank: usize,
        timeout: Duration,
        what: impl Fn() -> String + Send + 'static,
    ) -> Option<Ticker> {
        let p = period()?;
        let (tx, rx) = mpsc::channel::<()>();
        let start = Instant::now();
        std::thread::Builder::new()
            .name("fsdp-wait-progress".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(p) {
                    line(rank, start.elapsed(), timeout, &what());
                }
            })
            .ok()?;
        Some(Ticker { _stop: tx })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_whole_from_ten() {
        assert_eq!(seconds(Duration::from_millis(2500)), "2.5");
        assert_eq!(seconds(Duration::from_secs(5)), "5");
        assert_eq!(seconds(Duration::from_millis(12_400)), "12");
    }

    #[test]
    fn a_pacer_sleeps_no_longer_than_its_next_line() {
        let p = Pacer::new(0, Duration::from_secs(300));
        let far = Instant::now() + Duration::from_secs(3600);
        match period() {
            Some(per) => assert!(p.until(far) <= Instant::now() + per),
            None => assert_eq!(p.until(far), far),
        }
        let near = Instant::now();
        assert_eq!(p.until(near), near);
    }
}
