//! `index.json`: what a checkpoint directory holds and where each piece of each tensor is.
//! Written last, atomically, by rank 0: a directory without a readable index is not a
//! checkpoint (a save that did not finish), and an index only names complete files.

use super::file::CHECKSUM_ALGORITHM;
use crate::distributed::staged;
use crate::distributed::Group;
use crate::error::{Error, Result};
use crate::fsdp::StateDictType;
use crate::tensor::Tensor;
use std::collections::BTreeMap;
use std::path::Path;

/// `format` of every index.
pub const FORMAT: &str = "fsdp-checkpoint";
/// The layout version this crate writes; it reads every version from 1 to this.
///
/// | version | files' checksums | per-rank state | written by |
/// |---|---|---|---|
/// | 1 | legacy 64-bit mix | none | earlier builds |
/// | 2 | legacy 64-bit mix | [`Index::rank_extra`] | earlier builds, saves with per-rank state |
/// | 3 | CRC-32 ([`Index::checksum_algorithm`] `"crc32"`) | optional | earlier builds |
/// | 4 | CRC-32, plus each entry's dtype and the checksums binding pieces to entries ([`index_text`](super::index_text)) | optional | this build, every save |
///
/// Versions 1 to 3 still load (the checksums of 1 and 2 are checked with the legacy
/// algorithm; nothing binds their pieces to their names); an earlier build refuses a newer
/// index by its version.
pub const VERSION: u32 = 4;
/// The index's file name inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";

/// The index of a checkpoint directory.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Index {
    /// Version 4 on: the CRC-32 of the index's text with these 8 digits as zeros (the
    /// first field, so that it sits at a known place); `None` (absent) before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index_checksum: Option<String>,
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`] when written by this build; 1 to [`VERSION`] when read.
    pub version: u32,
    /// How [`FileEntry::checksum`] is computed (version 3 on): `"crc32"`
    /// ([`CHECKSUM_ALGORITHM`](super::file::CHECKSUM_ALGORITHM), so `crc32 FILE` or
    /// zlib's `crc32` checks a file by hand). `None` (absent from the JSON) in versions 1
    /// and 2, whose sums are the legacy 64-bit checksum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum_algorithm: Option<String>,
    /// Full (one model file and one optimizer file, by rank 0) or sharded (one file per
    /// rank holding pieces).
    pub state_dict_type: StateDictType,
    /// Data-parallel world size at save time.
    pub world_size: usize,
    /// Save counter of this directory; file names carry it, so a new save never
    /// overwrites a file the current index names.
    pub generation: u64,
    /// The data files, each with its size and checksum.
    pub files: Vec<FileEntry>,
    /// Model parameters by name.
    pub model: BTreeMap<String, Entry>,
    /// Optimizer state, when saved.
    pub optim: Option<OptimIndex>,
    /// Caller's data (the training loop's step, seed and config).
    pub extra: serde_json::Value,
    /// Each rank's own value given to
    /// [`save_checkpoint_with_rank_extra`](super::save_checkpoint_with_rank_extra) (a
    /// data-loader position, an RNG state), in data-parallel rank order: `world_size`
    /// entries. `None` (absent from the JSON) when the save had no per-rank state, and in
    /// every version-1 index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_extra: Option<Vec<serde_json::Value>>,
}

/// One data file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Checksum of the whole file by the index's
    /// [`checksum_algorithm`](Index::checksum_algorithm): 8 hex digits of CRC-32
    /// ([`checksum`](super::file::checksum)) in version 3 on, 16 of the legacy sum before.
    pub checksum: String,
}

/// One tensor: its global shape and its pieces.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Entry {
    /// Shape of the whole tensor.
    pub shape: Vec<usize>,
    /// Version 4 on: the safetensors dtype of its pieces (`"F32"`, `"F64"`, ...); `None`
    /// (absent) before, and for a tensor without pieces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Where its elements are; together they cover every element exactly once.
    pub pieces: Vec<PieceRef>,
    /// Version 4 on: the CRC-32 of its section, name, shape, dtype and pieces (see
    /// `seal.rs`); `None` (absent) before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

/// Elements `offset .. offset + numel` of a flattened tensor, stored as tensor `key` of
/// file `files[file]`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PieceRef {
    /// Index into [`Index::files`].
    pub file: usize,
    /// Tensor name inside that file.
    pub key: String,
    /// Element offset into the flattened tensor.
    pub offset: usize,
    /// Element count.
    pub numel: usize,
    /// Data-parallel rank that wrote the piece.
    pub rank: usize,
    /// Version 4 on: the CRC-32 of its entry's section, name, shape and dtype, its offset
    /// and count, and its bytes, binding the bytes to the name; `None` (absent) before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

/// The optimizer part of an index.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct OptimIndex {
    /// `"SGD"`, `"Adam"` or `"AdamW"`.
    pub kind: String,
    /// `param_groups[0]` hyperparameters.
    pub hyperparams: BTreeMap<String, f64>,
    /// Each parameter's step (Adam, AdamW).
    pub steps: BTreeMap<String, u64>,
    /// Per buffer name, the buffer of each parameter.
    pub buffers: BTreeMap<String, BTreeMap<String, Entry>>,
    /// The parameter groups by parameter name; absent (empty) for one group of every
    /// parameter with `hyperparams`' lr and weight decay.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub param_groups: Vec<crate::fsdp::NamedParamGroup>,
}

/// Reads and checks `dir/index.json`.
///
/// # Errors
/// `Checkpoint` naming the directory when there is no index (not a checkpoint, or a save
/// that did not finish), when it does not parse, when it is of another format or of a
/// version outside `1..=VERSION`, when its `rank_extra` does not hold one value per
/// rank of `world_size`, or (version 4) when an entry or the index does not match its
/// checksum: the error names the first edited entry.
pub fn read_index(dir: &Path) -> Result<Index> {
    let p = dir.join(INDEX_FILE);
    let bad = |detail: String| Error::Checkpoint {
        path: p.display().to_string(),
        detail,
    };
    let text = std::fs::read_to_string(&p).map_err(|e| {
        bad(format!(
            "cannot read the index ({e}): not a checkpoint directory, or its save did not finish"
        ))
    })?;
    let index: Index = serde_json::from_str(&text)
        .map_err(|e| bad(format!("the index is corrupted or truncated: {e}")))?;
    if index.format != FORMAT || !(1..=VERSION).contains(&index.version) {
        return Err(bad(format!(
            "format '{}' version {}; this build reads '{FORMAT}' versions 1 to {VERSION}",
            index.format, index.version
        )));
    }
    let algorithm = index.checksum_algorithm.as_deref();
    match (index.version, algorithm) {
        (1 | 2, None) => {}
        (1 | 2, Some(a)) => {
            return Err(bad(format!(
                "the index is corrupted: version {} names checksum algorithm '{a}', which only version 3 on records",
                index.version
            )))
        }
        (_, Some(CHECKSUM_ALGORITHM)) => {}
        (v, a) => {
            return Err(bad(format!(
                "version {v} with checksum algorithm {}; this build checks '{CHECKSUM_ALGORITHM}'",
                a.map_or("(none)".into(), |a| format!("'{a}'"))
            )))
        }
    }
    if let Some(r) = &index.rank_extra {
        if r.len() != index.world_size || index.version < 2 {
            return Err(bad(format!(
                "the index is corrupted: version {} with per-rank extra state of {} ranks at world size {}",
                index.version,
                r.len(),
                index.world_size
            )));
        }
    }
    super::seal::check_index(&p, &text, &index)?;
    Ok(index)
}

impl Index {
    /// The checksum of a data file's `bytes` as this index records it: CRC-32 in version
    /// 3 on, the legacy 64-bit sum in versions 1 and 2 ([`read_index`] checked which).
    pub fn checksum_of(&self, bytes: &[u8]) -> String {
        match self.checksum_algorithm {
            Some(_) => super::file::checksum(bytes),
            None => super::file::legacy_checksum(bytes),
        }
    }
}

/// The lowest rank of `pg` whose `ok` is false, if any (a collective).
pub(super) fn first_failed(pg: &Group, ok: bool) -> Result<Option<usize>> {
    let mine = if ok { i32::MAX } else { pg.rank() as i32 };
    let t = Tensor::from_vec(vec![mine], &[1])?;
    staged::all_reduce(pg.as_ref(), &t, crate::distributed::ReduceOp::Min)?;
    let v = t.data::<i32>()?[0];
    Ok((v != i32::MAX).then_some(v as usize))
}
