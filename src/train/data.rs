//! Byte-level text data for the main job: tokens are the file's bytes (vocab 256), the last
//! 10% held out for evaluation, and batches drawn by a counter-based generator keyed by
//! (seed, split, step), so the global batch of a step never depends on world size or
//! strategy.

use crate::error::{Error, Result};
use std::path::Path;

/// Vocabulary of byte-level tokens.
pub const VOCAB_SIZE: usize = 256;

/// A text corpus split into train (first 90%) and validation (last 10%) tokens.
#[derive(Debug, Clone)]
pub struct TextDataset {
    /// Training tokens: the first `floor(9n / 10)` bytes of the file, one i32 in `0..256`
    /// each.
    pub train: Vec<i32>,
    /// Held-out tokens: the remaining last ~10% of the bytes, used for eval loss.
    pub val: Vec<i32>,
}

/// Which split a batch is drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// [`TextDataset::train`], the first 90%.
    Train,
    /// [`TextDataset::val`], the held-out last 10%.
    Val,
}

/// The smallest file length whose held-out 10% (`n - floor(9n / 10)`) has `need` bytes.
fn min_len_for_val(need: usize) -> usize {
    // The held-out part of n bytes is n - floor(9n / 10) = ceil(n / 10).
    need.max(1).saturating_mul(10).saturating_sub(9)
}

/// The bytes of the data file `path`.
///
/// # Errors
/// `Data` naming the file when it is not a regular file, is missing or cannot be read.
fn read_data_file(path: &Path) -> Result<Vec<u8>> {
    // A directory, a device (/dev/zero) or a pipe is refused before reading it.
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err(Error::Data(format!(
                "data path '{}' is not a regular file",
                path.display()
            )));
        }
    }
    std::fs::read(path).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::NotFound {
            " (run scripts/get_data.sh to fetch tinyshakespeare)"
        } else {
            ""
        };
        Error::Data(format!(
            "cannot read data file '{}': {e}{hint}",
            path.display()
        ))
    })
}

/// Whether `bytes` (the file `name`) are usable training text for rows of `seq_len`.
///
/// # Errors
/// `Data` naming the file when it is empty, not UTF-8 text, binary or too short.
fn check_bytes(bytes: &[u8], name: &str, seq_len: usize) -> Result<()> {
    if bytes.is_empty() {
        return Err(Error::Data(format!("data file '{name}' is empty")));
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(Error::Data(format!(
            "data file '{name}' is not UTF-8 text (invalid byte at offset {}); give a text file",
            e.valid_up_to()
        )));
    }
    if let Some(pos) = bytes.iter().position(|&b| b == 0) {
        return Err(Error::Data(format!(
            "data file '{name}' looks binary (NUL byte at offset {pos}); give a text file"
        )));
    }
    let val = bytes.len() - bytes.len() * 9 / 10;
    let need = seq_len.saturating_add(2);
    if val < need {
        return Err(Error::Data(format!(
            "data file '{name}' has {} bytes; with --seq-len {seq_len} it needs at least {} (10% held out must hold {need})",
            bytes.len(),
            min_len_for_val(need)
        )));
    }
    Ok(())
}

impl TextDataset {
    /// Reads a UTF-8 text file.
    ///
    /// # Errors
    /// `Data` naming the file when it is missing, unreadable, empty, not UTF-8 text, or too
    /// short to hold one `seq_len + 1` window in each split.
    pub fn load(path: &Path, seq_len: usize) -> Result<Self> {
        let bytes = read_data_file(path)?;
        Self::from_bytes(&bytes, &path.display().to_string(), seq_len)
    }

    /// The checks of [`TextDataset::load`] without keeping the tokens: what
    /// [`TrainConfig::validate`](super::TrainConfig::validate) runs first, so a missing or
    /// unusable data file is reported before any other problem of the options.
    ///
    /// # Errors
    /// As [`TextDataset::load`].
    pub fn check_file(path: &Path, seq_len: usize) -> Result<()> {
        let bytes = read_data_file(path)?;
        check_bytes(&bytes, &path.display().to_string(), seq_len)
    }

    /// As [`TextDataset::load`], from bytes in memory; `name` is used in errors.
    pub fn from_bytes(bytes: &[u8], name: &str, seq_len: usize) -> Result<Self> {
        check_bytes(bytes, name, seq_len)?;
        let n = bytes.len() * 9 / 10;
        Ok(TextDataset {
            train: bytes[..n].iter().map(|&b| b as i32).collect(),
            val: bytes[n..].iter().map(|&b| b as i32).collect(),
        })
    }

    fn tokens(&self, split: Split) -> &[i32] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Rows `rows` of the global batch of `step`: inputs and next-token targets, each
    /// `(rows.len(), seq_len)` i32 row-major. Row `i`'s window start is a pure function of
    /// `(seed, split, step, i)`.
    pub fn batch(
        &self,
        split: Split,
        seed: u64,
        step: u64,
        rows: std::ops::Range<usize>,
        seq_len: usize,
    ) -> (Vec<i32>, Vec<i32>) {
        let toks = self.tokens(split);
        let span = (toks.len() - seq_len - 1) as u64;
        let mut x = Vec::with_capacity(rows.len() * seq_len);
        let mut y = Vec::with_capacity(rows.len() * seq_len);
        let key = crate::nn::InitKey::new(seed).child(match split {
            Split::Train => "data.train",
            Split::Val => "data.val",
        });
        for i in rows {
            let start = (key.bits(&step.to_string(), i as u64) % span) as usize;
            x.extend_from_slice(&toks[start..start + seq_len]);
            y.extend_from_slice(&toks[start + 1..start + seq_len + 1]);
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_files() {
        assert!(TextDataset::from_bytes(b"", "e", 4)
            .unwrap_err()
            .to_string()
            .contains("empty"));
        assert!(TextDataset::from_bytes(&[0xff, 0xfe, 0x00], "b", 4)
            .unwrap_err()
            .to_string()
            .contains("UTF-8"));
        assert!(TextDataset::from_bytes(&[b'a', 0, b'b'], "z", 1)
            .unwrap_err()
            .to_string()
            .contains("binary"));
        assert!(TextDataset::from_bytes(b"short", "s", 4)
            .unwrap_err()
            .to_string()
            .contains("at least"));
    }

    #[test]
    fn min_len_holds_the_held_out_part() {
        for need in 1..200 {
            let n = min_len_for_val(need);
            assert!(n - n * 9 / 10 >= need && (n - 1) - (n - 1) * 9 / 10 < need);
        }
    }

    #[test]
    fn batch_rows_do_not_depend_on_the_split_across_ranks() {
        let text: Vec<u8> = (0..1000).map(|i| b'a' + (i % 26) as u8).collect();
        let ds = TextDataset::from_bytes(&text, "t", 8).unwrap();
        let (x_all, y_all) = ds.batch(Split::Train, 7, 3, 0..4, 8);
        let (x_hi, _) = ds.batch(Split::Train, 7, 3, 2..4, 8);
        assert_eq!(&x_all[16..], &x_hi[..]);
        assert_eq!(x_all[1..8], y_all[..7]);
    }
}
