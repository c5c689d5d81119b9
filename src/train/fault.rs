//! Hidden, test-only fault hooks of `fsdp train`, read only in builds with the `test-hooks`
//! feature (others never inject a failure); not `TrainConfig` fields and not in `--help`.
//!
//! - `FSDP_FAIL_RANK=<rank>[:<step>]` makes that rank return an error in that 1-based step
//!   (default 1), between its forward and backward, so tests can check that one failing
//!   rank ends the whole job promptly with a message naming it.
//! - `FSDP_KILL_ONCE=<rank>:<step>:<marker file>` makes that rank kill its own process with
//!   `SIGKILL` (as `kill -9` would) at the same point of that step, once: only when the
//!   marker file does not exist yet, which it creates first. A job restarted with the same
//!   environment (`fsdp launch --max-restarts`) then runs through.

use crate::error::{Error, Result};

/// The variable's name.
pub(crate) const VAR: &str = "FSDP_FAIL_RANK";

/// Where the injected failure happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))] // never built then
pub(crate) struct FailAt {
    rank: usize,
    step: usize,
}

impl FailAt {
    /// Reads [`VAR`] from the process environment; `None` when unset or empty.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable and its value when it does not parse or names
    /// a rank or step the run does not have.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn from_env(world_size: usize, steps: usize) -> Result<Option<FailAt>> {
        match std::env::var(VAR) {
            Ok(v) if !v.trim().is_empty() => Self::parse(&v, world_size, steps).map(Some),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidArgument(format!(
                "{VAR}={v:?} is not <rank>[:<step>]"
            ))),
        }
    }

    /// Without the `test-hooks` feature: never a failure.
    #[cfg(not(feature = "test-hooks"))]
    pub(crate) fn from_env(world_size: usize, steps: usize) -> Result<Option<FailAt>> {
        let _ = (world_size, steps);
        Ok(None)
    }

    #[cfg(any(test, feature = "test-hooks"))]
    fn parse(v: &str, world_size: usize, steps: usize) -> Result<FailAt> {
        let bad = |why: String| Error::InvalidArgument(format!("{VAR}='{v}': {why}"));
        let (rank, step) = match v.trim().split_once(':') {
            Some((r, s)) => (r, Some(s)),
            None => (v.trim(), None),
        };
        let rank: usize = rank
            .parse()
            .map_err(|_| bad("expected <rank>[:<step>]".into()))?;
        let step: usize = match step {
            Some(s) => s
                .parse()
                .map_err(|_| bad("expected <rank>[:<step>]".into()))?,
            None => 1,
        };
        if rank >= world_size {
            return Err(bad(format!(
                "rank {rank} is not below --world-size {world_size}"
            )));
        }
        if step == 0 || step > steps {
            return Err(bad(format!("step {step} is not in 1..={steps}")));
        }
        Ok(FailAt { rank, step })
    }

    /// The injected error when `rank` is the failing rank and `step` its step.
    pub(crate) fn check(&self, rank: usize, step: usize) -> Result<()> {
        if (rank, step) == (self.rank, self.step) {
            return Err(Error::Fsdp(format!(
                "failure injected at step {step} by {VAR}={rank}:{step}"
            )));
        }
        Ok(())
    }
}

/// The `FSDP_KILL_ONCE` variable's name.
#[cfg_attr(not(feature = "test-hooks"), allow(dead_code))] // read only with test-hooks
pub(crate) const KILL_VAR: &str = "FSDP_KILL_ONCE";

/// Where the process kills itself, once (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))] // never built then
pub(crate) struct KillOnce {
    at: FailAt,
    marker: std::path::PathBuf,
}

impl KillOnce {
    /// Reads [`KILL_VAR`]; `None` when unset or empty.
    ///
    /// # Errors
    /// `InvalidArgument` naming the variable and its value when it is not
    /// `<rank>:<step>:<marker file>` of a rank and step the run has.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn from_env(world_size: usize, steps: usize) -> Result<Option<KillOnce>> {
        let v = std::env::var_os(KILL_VAR).unwrap_or_default();
        if v.is_empty() {
            return Ok(None);
        }
        let v = v.to_string_lossy();
        let bad = || {
            Error::InvalidArgument(format!(
                "{KILL_VAR}='{v}': expected <rank>:<step>:<marker file>"
            ))
        };
        let (rank, rest) = v.split_once(':').ok_or_else(bad)?;
        let (step, marker) = rest.split_once(':').ok_or_else(bad)?;
        if marker.is_empty() {
            return Err(bad());
        }
        let at = FailAt::parse(&format!("{rank}:{step}"), world_size, steps)
            .map_err(|e| Error::InvalidArgument(format!("{KILL_VAR}: {e}")))?;
        Ok(Some(KillOnce {
            at,
            marker: marker.into(),
        }))
    }

    /// Without the `test-hooks` feature: never a kill.
    #[cfg(not(feature = "test-hooks"))]
    pub(crate) fn from_env(world_size: usize, steps: usize) -> Result<Option<KillOnce>> {
        let _ = (world_size, steps);
        Ok(None)
    }

    /// Kills this process when `rank` is the rank, `step` the step, and the marker file
    /// could be created (it did not exist).
    pub(crate) fn check(&self, rank: usize, step: usize) {
        if self.at.check(rank, step).is_ok() {
            return;
        }
        let created = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&self.marker)
            .is_ok();
        #[cfg(all(unix, feature = "test-hooks"))]
        if created {
            // SAFETY: raise(3) with a valid signal number; SIGKILL ends the process here.
            unsafe {
                libc::raise(libc::SIGKILL);
            }
        }
        let _ = created;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rank_and_optional_step_and_names_bad_values() {
        assert_eq!(
            FailAt::parse("1", 2, 5).unwrap(),
            FailAt { rank: 1, step: 1 }
        );
        assert_eq!(
            FailAt::parse(" 0:3 ", 2, 5).unwrap(),
            FailAt { rank: 0, step: 3 }
        );
        for (v, want) in [
            ("x", "FSDP_FAIL_RANK='x': expected <rank>[:<step>]"),
            ("1:y", "expected <rank>[:<step>]"),
            ("2", "rank 2 is not below --world-size 2"),
            ("0:0", "step 0 is not in 1..=5"),
            ("0:6", "step 6 is not in 1..=5"),
        ] {
            let e = FailAt::parse(v, 2, 5).unwrap_err().to_string();
            assert!(e.contains(want), "{v}: {e}");
        }
        let f = FailAt::parse("1:2", 2, 5).unwrap();
        assert!(f.check(1, 2).is_err() && f.check(0, 2).is_ok() && f.check(1, 1).is_ok());
    }
}
