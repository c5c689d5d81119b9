//! Index version 4: what binds each piece of an index to its tensor, so that an edited
//! index is refused naming the entry instead of being trusted.
//!
//! | checksum | covers | checked |
//! |---|---|---|
//! | [`PieceRef::checksum`] | the entry's section and name, global shape, dtype, the piece's offset and element count, and the piece's bytes | when a rank reads the piece ([`check_piece`]) |
//! | [`Entry::checksum`] | the entry's section and name, shape, dtype and every piece reference (file, key, offset, count, rank, checksum) | by [`read_index`](super::read_index) |
//! | [`Index::index_checksum`] | the whole text of `index.json` with its own 8 digits as zeros | by [`read_index`](super::read_index), after the entries |
//!
//! All are CRC-32 ([`checksum`]): they find edits and accidents, not a forger who
//! recomputes them. A piece repointed at another tensor's bytes of the same size is found
//! by its entry's checksum; were that recomputed too, by the piece's own, which covers the
//! name it is stored under.

use super::file::{checksum, tensor_checksum};
use super::index::{Entry, Index, PieceRef};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::path::Path;

/// How a version-4 `index.json` begins: its checksum is its first field, so that it sits
/// at a known place in the text.
const HEAD: &str = "{\n  \"index_checksum\": \"";
/// The index checksum's digits while the text's checksum is computed.
const ZEROS: &str = "00000000";

fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Data(e.to_string()))
}

/// The bytes a piece's checksum covers before the piece's data: the entry's section
/// (`model` or an optimizer buffer) and name, global shape and dtype, and the piece's
/// element offset and count.
///
/// # Errors
/// `Data` when JSON cannot encode them (never for these types).
pub(super) fn piece_head(
    section: &str,
    name: &str,
    shape: &[usize],
    dtype: &str,
    offset: usize,
    numel: usize,
) -> Result<Vec<u8>> {
    json(&("fsdp-piece", section, name, shape, dtype, offset, numel))
}

/// The checksum of entry `name` of `section`: its shape, dtype and piece references.
fn entry_checksum(section: &str, name: &str, e: &Entry) -> Result<String> {
    Ok(checksum(&json(&(
        "fsdp-entry",
        section,
        name,
        &e.shape,
        &e.dtype,
        &e.pieces,
    ))?))
}

/// `(section, name, entry)` of every entry of the index: the model's, then each optimizer
/// buffer's.
fn entries(index: &Index) -> impl Iterator<Item = (&str, &String, &Entry)> {
    let model = index.model.iter().map(|(n, e)| ("model", n, e));
    let optim = index.optim.iter().flat_map(|o| {
        o.buffers
            .iter()
            .flat_map(|(b, m)| m.iter().map(move |(n, e)| (b.as_str(), n, e)))
    });
    model.chain(optim)
}

/// The section of an entry in words.
fn section_words(section: &str) -> String {
    if section == "model" {
        "the model".into()
    } else {
        format!("optimizer buffer '{section}'")
    }
}

/// The text of `index.json` for `index`: for version 4 on, with every entry's checksum
/// and the index checksum computed (what a save writes; a tool that rewrites an index
/// calls it too). Pieces' checksums are kept as they are: they need the data.
///
/// # Errors
/// `Data` when the index cannot be encoded as JSON.
pub fn index_text(index: &Index) -> Result<Vec<u8>> {
    if index.version < 4 {
        return serde_json::to_vec_pretty(index).map_err(|e| Error::Data(e.to_string()));
    }
    let mut ix = index.clone();
    for (n, e) in ix.model.iter_mut() {
        e.checksum = None;
        e.checksum = Some(entry_checksum("model", n, e)?);
    }
    for o in ix.optim.iter_mut() {
        for (b, m) in o.buffers.iter_mut() {
            for (n, e) in m.iter_mut() {
                e.checksum = None;
                e.checksum = Some(entry_checksum(b, n, e)?);
            }
        }
    }
    ix.index_checksum = Some(ZEROS.into());
    let mut text = serde_json::to_vec_pretty(&ix).map_err(|e| Error::Data(e.to_string()))?;
    if !text.starts_with(HEAD.as_bytes()) {
        return Err(Error::Data(
            "index_checksum is not the first field of the index".into(),
        ));
    }
    let sum = checksum(&text);
    text[HEAD.len()..HEAD.len() + ZEROS.len()].copy_from_slice(sum.as_bytes());
    Ok(text)
}

/// Checks a version-4 index read from `path` (`text` as read): every entry's checksum
/// (naming the first edited entry), every piece carries a checksum and every entry with
/// pieces a dtype, then the index checksum over the text. An index of an earlier version
/// must carry none of these fields.
///
/// # Errors
/// `Checkpoint` naming `path` and the entry (or the index checksum) that does not match.
pub(super) fn check_index(path: &Path, text: &str, index: &Index) -> Result<()> {
    let bad = |detail: String| {
        Err(Error::Checkpoint {
            path: path.display().to_string(),
            detail,
        })
    };
    if index.version < 4 {
        let sealed = index.index_checksum.is_some()
            || entries(index).any(|(_, _, e)| {
                e.checksum.is_some()
                    || e.dtype.is_some()
                    || e.pieces.iter().any(|p| p.checksum.is_some())
            });
        if sealed {
            return bad(format!(
                "the index is edited: version {} with the checksums only version 4 records",
                index.version
            ));
        }
        return Ok(());
    }
    for (section, name, e) in entries(index) {
        let want = entry_checksum(section, name, e)?;
        let what = format!("entry '{name}' of {}", section_words(section));
        match &e.checksum {
            Some(c) if *c == want => {}
            Some(c) => {
                return bad(format!(
                    "{what} was edited: its checksum {c} does not match its shape, dtype and pieces (they sum to {want}); the index cannot be trusted"
                ))
            }
            None => return bad(format!("{what} has no checksum, which version 4 requires")),
        }
        if !e.pieces.is_empty() && e.dtype.is_none() {
            return bad(format!(
                "{what} has pieces but no dtype, which version 4 requires"
            ));
        }
        if e.pieces.iter().any(|p| p.checksum.is_none()) {
            return bad(format!(
                "{what} has a piece without a checksum, which version 4 requires"
            ));
        }
    }
    let digits = text
        .strip_prefix(HEAD)
        .and_then(|rest| rest.get(..ZEROS.len()));
    let Some(stored) = index.index_checksum.as_deref() else {
        return bad("version 4 without an index_checksum".into());
    };
    if digits != Some(stored) {
        return bad(
            "index_checksum is not the first field, where this build writes it: the index was edited or reformatted".into(),
        );
    }
    let mut zeroed = text.as_bytes().to_vec();
    zeroed[HEAD.len()..HEAD.len() + ZEROS.len()].copy_from_slice(ZEROS.as_bytes());
    let want = checksum(&zeroed);
    if want != stored {
        return bad(format!(
            "the index was edited: its index_checksum {stored} does not match its text (which sums to {want})"
        ));
    }
    Ok(())
}

/// Checks that tensor `key` read from data file `file` is piece `p` of entry `name` of
/// `section` (index version 4): the entry's dtype, and the piece's checksum over the
/// entry's name, shape and dtype, the piece's offset and count, and the tensor's bytes.
///
/// # Errors
/// `Checkpoint` naming `file`, the tensor and the entry.
pub(super) fn check_piece(
    file: &Path,
    section: &str,
    name: &str,
    e: &Entry,
    p: &PieceRef,
    t: &Tensor,
) -> Result<()> {
    let bad = |detail: String| {
        Err(Error::Checkpoint {
            path: file.display().to_string(),
            detail,
        })
    };
    let what = format!("entry '{name}' of {} in the index", section_words(section));
    let dtype = super::file::dtype_name(t.dtype());
    if e.dtype.as_deref() != Some(dtype) {
        return bad(format!(
            "tensor '{}' is {dtype}, but {what} says {}: the index was edited or points at another tensor",
            p.key,
            e.dtype.as_deref().unwrap_or("(none)")
        ));
    }
    let head = piece_head(section, name, &e.shape, dtype, p.offset, p.numel)?;
    let got = tensor_checksum(&head, t)?;
    if p.checksum.as_deref() != Some(got.as_str()) {
        return bad(format!(
            "tensor '{}' is not the piece at offset {} of {what}: the checksum binding the entry's name, shape, dtype and offset to the bytes is {got}, the index says {}; the index was edited or points at another tensor's bytes",
            p.key,
            p.offset,
            p.checksum.as_deref().unwrap_or("(none)")
        ));
    }
    Ok(())
}
