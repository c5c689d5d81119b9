//! The save directory of `fsdp train --save-dir`: one run's checkpoints, never two runs'
//! mixed. A fresh run refuses a directory that already holds files (another run's
//! checkpoints would interleave with its own, `latest` would jump between them and
//! `--keep-last` would delete the wrong ones) unless `--resume` continues the run saved
//! there or `--overwrite` removes the checkpoints `fsdp` wrote there first. Each
//! checkpoint's index records the run's id (`extra.run_id`, kept across resumes), and
//! rotation deletes only checkpoints of this run.

use super::config::TrainConfig;
use crate::checkpoint::{read_index, resolve_checkpoint, INDEX_FILE, LATEST_FILE};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Prefix of the probe file `validate` writes to test that the directory is writable;
/// another rank's probe does not make a directory non-empty.
pub(super) const PROBE_PREFIX: &str = ".fsdp-write-probe-";

/// Suffix of the temporary files of an atomic write (`checkpoint::write_atomic`).
const TMP_SUFFIX: &str = ".fsdp-tmp";

/// The step of a checkpoint directory name `step-<N>`.
pub(super) fn step_of(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// A new run id: 16 hex digits from the clock, the process id and the standard library's
/// per-process random hasher keys.
pub(super) fn new_run_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// The run id recorded in a checkpoint's `extra`, if any.
pub(super) fn run_id_of(extra: &serde_json::Value) -> Option<String> {
    extra.get("run_id")?.as_str().map(str::to_string)
}

/// Whether `--resume` loads a checkpoint of `save_dir` itself (the directory, or one of
/// its `step-<N>/` checkpoints), so the run saved there continues.
fn resumes_from(cfg: &TrainConfig, save_dir: &Path) -> bool {
    let Some(r) = &cfg.resume else {
        return false;
    };
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    let Some(save) = canon(save_dir) else {
        return false;
    };
    let resolved = resolve_checkpoint(r).ok().and_then(|d| canon(&d));
    canon(r).as_ref() == Some(&save)
        || resolved
            .as_ref()
            .and_then(|d| d.parent())
            .is_some_and(|p| p == save)
}

/// The entries of `dir` that make it non-empty (sorted, folders with a trailing `/`);
/// empty when it is missing.
fn contents(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(PROBE_PREFIX) {
                return None;
            }
            Some(if e.path().is_dir() {
                format!("{n}/")
            } else {
                n
            })
        })
        .collect();
    names.sort();
    names
}

/// Checks the save directory before any thread starts: a non-empty one is refused
/// unless `--resume` continues the run saved there or `--overwrite` is given, and
/// `--overwrite` may not delete the checkpoint `--resume` loads.
///
/// # Errors
/// `InvalidArgument` naming the directory, what it holds, and the two ways out.
pub(super) fn validate(cfg: &TrainConfig) -> Result<()> {
    let Some(dir) = &cfg.save_dir else {
        if cfg.overwrite {
            crate::error::bail_arg!("--overwrite needs --save-dir (the directory to clear)");
        }
        return Ok(());
    };
    let resumed = resumes_from(cfg, dir);
    if cfg.overwrite {
        if resumed {
            crate::error::bail_arg!(
                "--overwrite would delete the checkpoints of --save-dir {}, and --resume loads one of them; drop --overwrite to continue that run there",
                dir.display()
            );
        }
        return Ok(());
    }
    let held = contents(dir);
    if resumed || held.is_empty() {
        return Ok(());
    }
    let mut shown: Vec<&str> = held.iter().take(3).map(String::as_str).collect();
    let more = held.len() - shown.len();
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    if shown.is_empty() {
        shown.push("?");
    }
    crate::error::bail_arg!(
        "--save-dir {} is not empty (it holds {}{more}); this run's checkpoints would mix with what is there. Pass --resume {} to continue the run saved there, or --overwrite to delete the checkpoints fsdp wrote there (step-N/ folders and latest; other files are kept) and start over",
        dir.display(),
        shown.join(", "),
        dir.display()
    )
}

/// `--overwrite`: removes from `dir` the checkpoints `fsdp train` wrote (the files of its
/// `step-<N>/` folders, which are then removed when nothing else is in them, `latest`
/// when it names such a folder, and leftover temporary files); any other file stays.
/// Call it once, before the first save (rank 0).
///
/// # Errors
/// `Io` naming the file that could not be removed.
pub(super) fn clear_checkpoints(dir: &Path) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let remove = |p: &Path| {
        std::fs::remove_file(p)
            .map_err(|e| Error::io(format!("--overwrite: removing '{}'", p.display()), e))
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        if step_of(&name).is_some() && path.is_dir() {
            for f in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                let n = f.file_name().to_string_lossy().into_owned();
                let ours = (n == INDEX_FILE && read_index(&path).is_ok())
                    || is_data_file_name(&n)
                    || n.ends_with(TMP_SUFFIX);
                if ours {
                    remove(&f.path())?;
                }
            }
            // Removed only when nothing else was in it.
            let _ = std::fs::remove_dir(&path);
        } else if name == LATEST_FILE && path.is_file() {
            let named = std::fs::read_to_string(&path).unwrap_or_default();
            if step_of(named.trim()).is_some() {
                remove(&path)?;
            }
        } else if name.starts_with(&format!(".{LATEST_FILE}.")) && name.ends_with(TMP_SUFFIX) {
            remove(&path)?;
        }
    }
    crate::checkpoint::sync_dir(dir)
}

/// Whether `n` is the name of a checkpoint data file: `rank-<R>-g<G>.safetensors`,
/// `model-g<G>.safetensors` or `optim-g<G>.safetensors`.
fn is_data_file_name(n: &str) -> bool {
    let Some(stem) = n.strip_suffix(".safetensors") else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let gen_ok = |s: &str| s.strip_prefix('g').is_some_and(digits);
    if let Some(rest) = stem.strip_prefix("rank-") {
        return rest
            .split_once('-')
            .is_some_and(|(r, g)| digits(r) && gen_ok(g));
    }
    ["model-", "optim-"]
        .iter()
        .any(|p| stem.strip_prefix(p).is_some_and(gen_ok))
}

/// Rotation: removes all but the newest `keep` checkpoints of run `run_id` in `root`
/// (never `current`); checkpoints of other runs, and folders without a readable index,
/// stay. Best effort.
pub(super) fn prune(root: &Path, keep: usize, current: &str, run_id: &str) {
    let Ok(rd) = std::fs::read_dir(root) else {
        return;
    };
    let mut mine: Vec<(u64, String, PathBuf)> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = step_of(&name)?;
            let path = e.path();
            let index = read_index(&path).ok()?;
            (run_id_of(&index.extra).as_deref() == Some(run_id)).then_some((step, name, path))
        })
        .collect();
    mine.sort();
    let n = mine.len();
    for (_, name, path) in mine.into_iter().take(n.saturating_sub(keep)) {
        if name != current {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(step_of("step-00000020"), Some(20));
        assert_eq!(step_of("step-"), None);
        assert_eq!(step_of("step-1a"), None);
        assert!(is_data_file_name("rank-00003-g12.safetensors"));
        assert!(is_data_file_name("model-g1.safetensors"));
        assert!(!is_data_file_name("rank-3.safetensors"));
        assert!(!is_data_file_name("notes.txt"));
        assert_ne!(new_run_id(), new_run_id());
    }
}
