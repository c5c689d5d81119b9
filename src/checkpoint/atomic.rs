//! Crash-safe file replacement: write a temporary file in the target's directory, fsync
//! it, rename it over the target, fsync the directory. A crash at any point leaves either
//! the old file or the new one, never a mix or a truncated file under the target's name.
//!
//! Hidden test hook, compiled only with the `test-hooks` feature: with
//! `FSDP_CKPT_STALL=<substring>` in the environment, the first write whose target path
//! contains `<substring>` writes half its bytes to the temporary file, fsyncs, prints
//! `FSDP_CKPT_STALL: stalled writing <path>` on stderr and sleeps for ten minutes, so a test
//! can kill the process in the middle of a save. Not part of any documented interface;
//! other builds never read the variable.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Suffix of temporary files; leftovers of a crashed save carry it.
pub(crate) const TMP_SUFFIX: &str = ".fsdp-tmp";

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` by a file holding `bytes`, atomically and durably (see the module doc).
///
/// # Errors
/// `Io` naming the file and the step (create, write, fsync, rename) that failed; the
/// temporary file is removed on error.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.{}-{}{TMP_SUFFIX}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let res = write_then_rename(&tmp, path, bytes);
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res?;
    sync_dir(&dir)
}

fn write_then_rename(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    let ctx = |what: &str| format!("{what} '{}'", tmp.display());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(|e| Error::io(ctx("creating temporary checkpoint file"), e))?;
    #[cfg(feature = "test-hooks")]
    stall::maybe_stall(&mut f, path, bytes).map_err(|e| Error::io(ctx("writing"), e))?;
    f.write_all(bytes)
        .map_err(|e| Error::io(ctx("writing"), e))?;
    f.sync_all().map_err(|e| Error::io(ctx("fsync of"), e))?;
    drop(f);
    std::fs::rename(tmp, path).map_err(|e| {
        Error::io(
            format!("renaming '{}' to '{}'", tmp.display(), path.display()),
            e,
        )
    })
}

/// Whether the test hook asks this write to stall (at most once per process).
/// The `FSDP_CKPT_STALL` hook (see the module doc); only in builds with `test-hooks`.
#[cfg(feature = "test-hooks")]
mod stall {
    use std::io::Write;
    use std::path::Path;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The hook's variable.
    const VAR: &str = "FSDP_CKPT_STALL";

    static STALLED: AtomicBool = AtomicBool::new(false);

    /// When `path` is the first target that contains the variable's value: writes half of
    /// `bytes` to `f`, fsyncs, says so on stderr and sleeps ten minutes (to be killed).
    pub(super) fn maybe_stall(
        f: &mut std::fs::File,
        path: &Path,
        bytes: &[u8],
    ) -> std::io::Result<()> {
        let hit = match std::env::var(VAR) {
            Ok(s) => !s.is_empty() && path.to_string_lossy().contains(&s),
            Err(_) => false,
        };
        if !hit || STALLED.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        f.write_all(&bytes[..bytes.len() / 2])?;
        f.sync_all()?;
        let _ = writeln!(
            std::io::stderr(),
            "{VAR}: stalled writing {}",
            path.display()
        );
        std::thread::sleep(std::time::Duration::from_secs(600));
        Ok(())
    }
}

/// fsyncs a directory so that renames and removals in it are durable.
///
/// # Errors
/// `Io` naming the directory.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let d = std::fs::File::open(dir)
        .map_err(|e| Error::io(format!("opening directory '{}'", dir.display()), e))?;
    d.sync_all()
        .map_err(|e| Error::io(format!("fsync of directory '{}'", dir.display()), e))
}

/// Removes temporary files a crashed save left in `dir` (best effort); with `keep_own`,
/// not those of this process (a background write of its own may be under way).
pub(crate) fn remove_stale_temps(dir: &Path, keep_own: bool) {
    let own = format!(".{}-", std::process::id());
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.ends_with(TMP_SUFFIX) && !(keep_own && n.contains(&own)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("fsdp-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.bin");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two!").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two!");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
