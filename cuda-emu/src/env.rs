//! The emulator's environment variables, each read once per process:
//!
//! | variable | values | unset or empty |
//! |---|---|---|
//! | `CUDA_EMU_DEVICES` | emulated GPUs, `0` to `8`; `0` emulates a machine without a GPU (`cuDeviceGetCount` reports 0, fsdp says "no device") | 2 |
//! | `CUDA_EMU_SCHEDULE` | `eager` (run work when issued) or `deferred` | deferred |
//! | `CUDA_EMU_SEED` | a u64: seeded random stream progress (`queue.rs`) | no random progress |
//!
//! A bad value is not fatal: one line on stderr names it, what the variable accepts and what
//! is used instead (a count above 8 is 8, a negative one 0, one that is not a number 2; a bad
//! schedule is deferred; a bad seed is no seed). The parsers are pure functions returning
//! the value and that warning, so the tests check both.

use std::ffi::c_int;
use std::sync::OnceLock;

pub const MAX_DEVICES: c_int = 8;
const DEFAULT_DEVICES: c_int = 2;

/// `v` as written in a warning: quoted when it holds spaces or other unprintable characters.
fn shown(v: &str) -> String {
    if v.chars().all(|c| c.is_ascii_graphic()) {
        v.to_string()
    } else {
        format!("{v:?}")
    }
}

/// `CUDA_EMU_DEVICES`: the number of emulated devices, and a warning for a bad value.
pub fn parse_devices(v: Option<&str>) -> (c_int, Option<String>) {
    let Some(v) = v.filter(|v| !v.is_empty()) else {
        return (DEFAULT_DEVICES, None);
    };
    let n = match v.parse::<i64>() {
        Ok(n) if (0..=MAX_DEVICES as i64).contains(&n) => return (n as c_int, None),
        Ok(n) if n < 0 => 0,
        Ok(_) => MAX_DEVICES,
        Err(_) => DEFAULT_DEVICES,
    };
    let warning = format!(
        "CUDA_EMU_DEVICES={} is not a number from 0 to {MAX_DEVICES}; using {n}",
        shown(v)
    );
    (n, Some(warning))
}

/// `CUDA_EMU_SCHEDULE`: whether work runs when issued (`eager`), and a warning for a bad
/// value.
pub fn parse_schedule(v: Option<&str>) -> (bool, Option<String>) {
    match v {
        None | Some("" | "deferred") => (false, None),
        Some("eager") => (true, None),
        Some(v) => (
            false,
            Some(format!(
                "CUDA_EMU_SCHEDULE={} is not eager or deferred; using deferred",
                shown(v)
            )),
        ),
    }
}

/// `CUDA_EMU_SEED`: the seed of random stream progress (None: none), and a warning for a
/// bad value.
pub fn parse_seed(v: Option<&str>) -> (Option<u64>, Option<String>) {
    let Some(v) = v.filter(|v| !v.is_empty()) else {
        return (None, None);
    };
    match v.parse::<u64>() {
        Ok(seed) => (Some(seed), None),
        Err(_) => (
            None,
            Some(format!(
                "CUDA_EMU_SEED={} is not a number from 0 to {}; using no seed (no random stream progress)",
                shown(v),
                u64::MAX
            )),
        ),
    }
}

/// Reads `name` (a value that is not UTF-8 is kept, lossily, to be refused) and prints the
/// parser's warning, if any.
fn read<T>(name: &str, parse: fn(Option<&str>) -> (T, Option<String>)) -> T {
    let v = std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    let (value, warning) = parse(v.as_deref());
    if let Some(w) = warning {
        eprintln!("cuda-emu: {w}");
    }
    value
}

/// Emulated devices (`CUDA_EMU_DEVICES`).
pub fn devices() -> c_int {
    static V: OnceLock<c_int> = OnceLock::new();
    *V.get_or_init(|| read("CUDA_EMU_DEVICES", parse_devices))
}

/// Whether work runs when issued (`CUDA_EMU_SCHEDULE=eager`).
pub fn eager() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| read("CUDA_EMU_SCHEDULE", parse_schedule))
}

/// The seed of random stream progress (`CUDA_EMU_SEED`).
pub fn seed() -> Option<u64> {
    static V: OnceLock<Option<u64>> = OnceLock::new();
    *V.get_or_init(|| read("CUDA_EMU_SEED", parse_seed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_valid_values_and_default() {
        assert_eq!(parse_devices(None), (2, None));
        assert_eq!(parse_devices(Some("")), (2, None));
        for n in 0..=8 {
            assert_eq!(parse_devices(Some(&n.to_string())), (n, None));
        }
    }

    #[test]
    fn devices_bad_values_warn() {
        let w = |s: &str| Some(s.to_string());
        assert_eq!(
            parse_devices(Some("abc")),
            (
                2,
                w("CUDA_EMU_DEVICES=abc is not a number from 0 to 8; using 2")
            )
        );
        assert_eq!(
            parse_devices(Some("9")),
            (
                8,
                w("CUDA_EMU_DEVICES=9 is not a number from 0 to 8; using 8")
            )
        );
        assert_eq!(
            parse_devices(Some("-1")),
            (
                0,
                w("CUDA_EMU_DEVICES=-1 is not a number from 0 to 8; using 0")
            )
        );
        assert_eq!(
            parse_devices(Some(" 2")),
            (
                2,
                w("CUDA_EMU_DEVICES=\" 2\" is not a number from 0 to 8; using 2")
            )
        );
    }

    #[test]
    fn schedule_values() {
        assert_eq!(parse_schedule(None), (false, None));
        assert_eq!(parse_schedule(Some("")), (false, None));
        assert_eq!(parse_schedule(Some("deferred")), (false, None));
        assert_eq!(parse_schedule(Some("eager")), (true, None));
        assert_eq!(
            parse_schedule(Some("bogus")),
            (
                false,
                Some("CUDA_EMU_SCHEDULE=bogus is not eager or deferred; using deferred".into())
            )
        );
        assert!(!parse_schedule(Some("EAGER")).0);
    }

    #[test]
    fn seed_values() {
        assert_eq!(parse_seed(None), (None, None));
        assert_eq!(parse_seed(Some("")), (None, None));
        assert_eq!(parse_seed(Some("7")), (Some(7), None));
        assert_eq!(
            parse_seed(Some("18446744073709551615")),
            (Some(u64::MAX), None)
        );
        let bad = "CUDA_EMU_SEED=xyz is not a number from 0 to 18446744073709551615; \
                   using no seed (no random stream progress)";
        assert_eq!(parse_seed(Some("xyz")), (None, Some(bad.to_string())));
        assert!(parse_seed(Some("-1")).1.is_some());
    }
}
