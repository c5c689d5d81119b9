//! Checkpoint files: safetensors data files and a JSON index, written so that a crash
//! during a save never destroys the previous checkpoint.
//!
//! | layout | files | written by |
//! |---|---|---|
//! | full | `model-g<G>.safetensors` (keys: parameter names, whole tensors), `optim-g<G>.safetensors` (keys `<buffer>/<name>`), `index.json` | rank 0 |
//! | sharded | `rank-<R>-g<G>.safetensors` (keys `<section>/<name>@<offset>`: this rank's pieces), `index.json` | every rank holding distinct shards (under ZeRO-1 every rank: its optimizer chunk, and rank 0 the model); the index by rank 0 |
//! | save directory of `fsdp train --save-dir` | `step-<N>/` checkpoint directories and `latest` naming the newest | rank 0 |
//!
//! The index lists every data file with its size and checksum, every tensor's global shape
//! and where each piece of it lies (file, key, element offset, count), the optimizer's
//! kind, hyperparameters and steps, the caller's `extra` JSON, and optionally each rank's
//! own JSON value (`rank_extra`). Any checkpoint's model and optimizer state loads at any
//! world size and strategy ([`load_checkpoint`]): each rank reads only the files with
//! pieces it needs.
//!
//! `index.json` ([`Index`]):
//!
//! | field | holds |
//! |---|---|
//! | `index_checksum` | version 4: CRC-32 of the index's text with these digits zeroed (the first field) |
//! | `format`, `version` | `"fsdp-checkpoint"`; 4 (this build writes 4 and reads 1 to 4; earlier builds wrote 1, 2 with `rank_extra`, or 3, and refuse newer ones: see [`VERSION`]) |
//! | `checksum_algorithm` | version 3 on: `"crc32"`, the algorithm of the files' checksums (absent before: the legacy 64-bit sum) |
//! | `state_dict_type`, `world_size`, `generation` | how it was saved, the data-parallel world size then, the save counter that names the data files |
//! | `files` | `[{name, bytes, checksum}]`; `checksum` of the whole file, CRC-32 as 8 hex digits from version 3 on |
//! | `model` | parameter name -> `{shape, dtype, pieces: [{file, key, offset, numel, rank, checksum}], checksum}` (a zero-size parameter has its shape and no pieces; `dtype` and the checksums from version 4 on: a piece's covers its entry's name, shape, dtype, its offset and count and its bytes, an entry's its name, shape, dtype and pieces) |
//! | `optim` | `{kind, hyperparams, steps, buffers: buffer -> parameter -> entry}`, or `null` |
//! | `extra` | the caller's JSON value, one for the whole checkpoint ([`save_checkpoint`]'s `extra`; `fsdp train` keeps its step, seed and config there, and its grad scaler's state under `extra.grad_scaler`: [`insert_grad_scaler_state`], [`CheckpointInfo::grad_scaler_state`]) |
//! | `rank_extra` | version 2 on, when a save had per-rank state: `world_size` JSON values, rank `r`'s at position `r` ([`save_checkpoint_with_rank_extra`]: a data-loader position, an RNG state) |
//!
//! Per-rank state (`torch.distributed.checkpoint`'s per-rank stateful objects): every rank
//! passes its own value to [`save_checkpoint_with_rank_extra`]; the values reach rank 0
//! with the file manifests and are written in the index, so they are as crash-safe as the
//! rest. On load each rank gets its own value back ([`CheckpointInfo::rank_extra`]); at
//! another world size the values cannot be resharded, so [`load_checkpoint`] refuses such
//! a checkpoint naming both world sizes, and [`load_checkpoint_with`] takes a
//! [`RankExtra`] saying to give every rank rank 0's value or none instead. An index without
//! `rank_extra` (every version-1 index, and saves without per-rank state) loads as before,
//! with no per-rank value.
//!
//! Checksums are CRC-32 (IEEE, zlib's), so a file can be checked by hand against the
//! index: `crc32 rank-0-g1.safetensors`, or `python3 -c 'import sys, zlib; print("%08x" %
//! zlib.crc32(open(sys.argv[1], "rb").read()))' rank-0-g1.safetensors`, equals its
//! `files[].checksum`. Each data file also carries the CRC-32 of its data section in its
//! safetensors header (`__metadata__["fsdp.crc32"]`). Checkpoints of earlier builds
//! (versions 1 and 2, `fsdp.checksum` in the headers) are checked with their legacy 64-bit
//! sum and load as before.
//!
//! Crash safety ([`write_atomic`]): every file is written to a temporary file in the same
//! directory, fsynced, renamed into place, and the directory fsynced. Data files of a new
//! save carry a new generation number `G`, so they never replace files the current index
//! names; the index is replaced last, and only then are older files removed. Truncated
//! files (size against the index, or an incomplete safetensors header) and corrupted ones
//! (checksums in the index and in each file's header) are reported naming the file. An
//! edited index (version 4) is refused naming the entry: a piece repointed at another
//! tensor's bytes, an edited shape, dtype or offset (`seal.rs`).
//!
//! Asynchronous saves ([`AsyncCheckpointer`], PyTorch's
//! `torch.distributed.checkpoint.async_save`) write the same files and index: the save
//! returns once the data is copied into host memory, a background thread per rank writes
//! the files, and the index is written at the next save or at
//! [`AsyncCheckpointer::wait`], after every rank's files are durable.
//!
//! | file | holds |
//! |---|---|
//! | `async_save.rs` | [`AsyncCheckpointer`]: saves whose files a background thread writes |
//! | `atomic.rs` | [`write_atomic`], the hidden `FSDP_CKPT_STALL` test hook (feature `test-hooks`) |
//! | `commit.rs` | the commit of a save: manifests to rank 0, the index built and written |
//! | `file.rs` | one safetensors file with a CRC-32: [`write_tensors`], [`read_tensors`], [`checksum`] |
//! | `grad_scaler.rs` | a [`ShardedGradScaler`](crate::fsdp::ShardedGradScaler)'s state in `extra`: [`insert_grad_scaler_state`], [`CheckpointInfo::grad_scaler_state`] |
//! | `index.rs` | [`Index`] and its parts |
//! | `plan.rs` | what one rank of a save writes: its files planned from state dicts or snapshots, each piece's checksum |
//! | `save.rs` | [`save_checkpoint`], [`save_checkpoint_with_rank_extra`] |
//! | `seal.rs` | index version 4: the checksums binding each piece to its entry, [`index_text`] |
//! | `load.rs` | [`load_checkpoint`], [`load_checkpoint_with`], [`RankExtra`], [`read_rank_extra`], [`resolve_checkpoint`] |
//! | `verify.rs` | cross-checks of an index against its files' names (world size, generation) |

mod async_save;
mod atomic;
mod commit;
mod file;
mod grad_scaler;
mod index;
mod load;
mod plan;
mod save;
mod seal;
mod verify;

pub use async_save::AsyncCheckpointer;
pub use atomic::{sync_dir, write_atomic};
pub use file::{
    checksum, parse_tensors, read_tensors, serialize, write_tensors, TensorFile, CHECKSUM_ALGORITHM,
};
pub use grad_scaler::{insert_grad_scaler_state, GRAD_SCALER_KEY};
pub use index::{
    read_index, Entry, FileEntry, Index, OptimIndex, PieceRef, FORMAT, INDEX_FILE, VERSION,
};
pub use load::{
    load_checkpoint, load_checkpoint_with, read_checkpoint_info, read_rank_extra,
    resolve_checkpoint, CheckpointInfo, RankExtra, LATEST_FILE,
};
pub use save::{save_checkpoint, save_checkpoint_with_rank_extra};
pub use seal::index_text;

use crate::error::Result;
use crate::fsdp::FullStateDict;
use std::collections::HashMap;
use std::path::Path;

/// Writes a full state dict to one safetensors file, keys the parameter names (what
/// `safetensors.torch.save_file(model.state_dict(), path)` writes), atomically. Call it on
/// one rank (rank 0 of a `rank0_only` full state dict).
///
/// # Errors
/// As [`write_tensors`].
pub fn save_state_dict_file(path: &Path, sd: &FullStateDict) -> Result<()> {
    write_tensors(path, &sd.tensors, &HashMap::new())
}

/// Reads a safetensors file as a full state dict (any safetensors file of f32, bf16, f16 or
/// i32 tensors; its checksum is checked when it has one), keys sorted: one PyTorch wrote
/// with `safetensors.torch.save_file(model.state_dict(), path)` too. Load it into any
/// module with [`crate::nn::load_state_dict`] (bf16 and f16 converted to the parameters'
/// f32), or into an FSDP model with `model.load_state_dict(&StateDict::Full(sd), strict)`
/// on every rank.
///
/// # Errors
/// As [`read_tensors`].
pub fn load_state_dict_file(path: &Path) -> Result<FullStateDict> {
    let mut f = read_tensors(path)?;
    f.tensors.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(FullStateDict { tensors: f.tensors })
}
