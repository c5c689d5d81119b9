//! The `--metrics` file: one JSON object per step. A fresh run starts it empty; a run
//! resumed after step `S` keeps the records of steps `1..=S` that the interrupted run
//! wrote, drops the ones after `S` (they are trained again), and appends. Lines that are
//! not such a record (not a JSON object with a numeric `step`: a half-written last line,
//! text added by hand or by another program) are dropped too, so the file stays one
//! record per line, in step order, for whatever reads it.

use crate::checkpoint::write_atomic;
use crate::error::{Error, Result};
use std::fs::File;
use std::path::Path;

/// Opens `path` for this run's records: truncated for a fresh run; for a run resumed after
/// step `resumed_after`, first rewritten atomically (temporary file, fsync, rename) with
/// only the records of steps up to `resumed_after` (see [`keep_through`]), then opened for
/// appending.
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

/// The step records of `bytes` (lines holding a JSON object with a numeric `step`) of
/// steps up to `step`, each ending in `\n`. Every other line is dropped: a record of a
/// later step (trained again), a record the interrupted run was writing when it stopped,
/// and anything that is not a record.
fn keep_through(bytes: &[u8], step: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    for line in bytes.split_inclusive(|&b| b == b'\n') {
        let record_step = serde_json::from_slice::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v.as_object()?.get("step")?.as_u64());
        if record_step.is_none_or(|s| s > step) {
            continue;
        }
        let text = line.strip_suffix(b"\n").unwrap_or(line);
        let text = text.strip_suffix(b"\r").unwrap_or(text);
        out.extend_from_slice(text);
        out.push(b'\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::keep_through;

    #[test]
    fn keeps_the_records_up_to_the_resumed_step_and_nothing_else() {
        let text = b"{\"step\":1}\n{\"step\":2}\nnote\n{\"step\":3}\n{\"step\":4,\"lo";
        assert_eq!(
            keep_through(text, 2),
            b"{\"step\":1}\n{\"step\":2}\n".to_vec()
        );
        // Not records: garbage, blank lines, JSON without a numeric step, a JSON array.
        let text = b"{\"step\":1}\n\xff garbage\n\n{\"loss\":2}\n{\"step\":\"2\"}\n[1]\n7\n{\"step\":2}\r\n";
        assert_eq!(
            keep_through(text, 5),
            b"{\"step\":1}\n{\"step\":2}\n".to_vec()
        );
        assert_eq!(keep_through(b"{\"step\":1}", 1), b"{\"step\":1}\n".to_vec());
        assert_eq!(keep_through(b"", 5), b"".to_vec());
    }
}
