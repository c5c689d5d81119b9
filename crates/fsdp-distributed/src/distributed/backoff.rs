//! The one retry pacing of this crate: exponential backoff up to a cap, never sleeping past
//! a deadline. Used where a peer may not listen yet (a rank dialing the store before rank 0
//! hosts it, mesh connections before a peer's listener is up).

use std::time::{Duration, Instant};

/// Exponential backoff between attempts: `first`, `2 first`, ... up to `max`, until
/// `deadline`.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
    deadline: Instant,
}

impl Backoff {
    /// Pacing that starts at `first`, doubles up to `max`, and stops at `deadline`.
    pub(crate) fn new(first: Duration, max: Duration, deadline: Instant) -> Backoff {
        Backoff {
            next: first,
            max,
            deadline,
        }
    }

    /// Sleeps before the next attempt and returns `true`; returns `false` at once when
    /// that sleep would reach the deadline (give up: no later attempt would be in time).
    pub(crate) fn wait(&mut self) -> bool {
        if Instant::now() + self.next >= self.deadline {
            return false;
        }
        self.sleep();
        true
    }

    /// Sleeps the current pause and doubles it up to the cap, whatever the deadline.
    fn sleep(&mut self) {
        std::thread::sleep(self.next);
        self.next = (self.next * 2).min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_and_stops_before_the_deadline() {
        let start = Instant::now();
        let mut b = Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(4),
            start + Duration::from_millis(40),
        );
        let mut sleeps = 0;
        while b.wait() {
            sleeps += 1;
            assert!(sleeps < 40, "never gave up");
        }
        assert_eq!(b.next, Duration::from_millis(4));
        // 1 + 2 + 4 + 4 + ... ms: it never slept past the deadline.
        assert!(
            start.elapsed() < Duration::from_millis(40 + 20),
            "{:?}",
            start.elapsed()
        );
        assert!(sleeps >= 3, "{sleeps}");
        let mut done = Backoff::new(Duration::from_millis(5), Duration::from_millis(5), start);
        assert!(!done.wait(), "a passed deadline waits no more");
    }
}
