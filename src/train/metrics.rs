//! The `--metrics` file: one JSON object per step. A fresh run starts it empty; a run
//! resumed after step `S` keeps the records of steps `1..=S` that the interrupted run
//! wrote, drops the ones after `S` (they are trained again), and appends.

use crate::checkpoint::write_atomic;
use crate::error::{Error, Result};
use std::fs::File;
use std::path::Path;

/// Opens `path` for this run's records: truncated for a fresh run; for a run resumed after
/// step `resumed_after`, first rewritten atomically (temporary file, fsync, rename)
/// without the lines of later steps, then opened for appending. Other lines (no numeric
/// `step`) are kept, except a last line without its newline that is not JSON: a record
/// the interrupted run was writing when it stopped.
///
/// # Errors
/// `Io` naming the file when it cannot be read, rewritten or opened.
pub(super) fn open_metrics(path: &Path, resumed_after: Option<usize>) -> Result<File> {
    let ctx = |what: &str| format!("{what} metrics file '{}'", path.display());
    let Some(step) = resumed_after else {
        return File::create(path).map_err(|e| Error::io(ctx("creating"), e));
    };
    match std::fs::read(path) {
        Ok(bytes) => {
            let kept = keep_through(&bytes, step as u64);
            if kept != bytes {
                write_atomic(path, &kept)?;
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(ctx("reading"), e)),
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io(ctx("opening"), e))
}

/// The lines of `bytes` except step records of steps after `step`, each ending in `\n`.
fn keep_through(bytes: &[u8], step: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        let json = serde_json::from_slice::<serde_json::Value>(line).ok();
        let later = json
            .as_ref()
            .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
            .is_some_and(|s| s > step);
        let cut_short = !line.ends_with(b"\n") && json.is_none();
        if later || cut_short {
            continue;
        }
        out.extend_from_slice(line);
        if !line.ends_with(b"\n") {
            out.push(b'\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::keep_through;

    #[test]
    fn keeps_steps_up_to_the_resumed_one_and_other_lines() {
        let text = b"{\"step\":1}\n{\"step\":2}\nnote\n{\"step\":3}\n{\"step\":4,\"lo";
        assert_eq!(
            keep_through(text, 2),
            b"{\"step\":1}\n{\"step\":2}\nnote\n".to_vec()
        );
        assert_eq!(keep_through(b"{\"step\":1}", 1), b"{\"step\":1}\n".to_vec());
        assert_eq!(keep_through(b"", 5), b"".to_vec());
    }
}
