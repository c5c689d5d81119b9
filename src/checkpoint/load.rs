//! Loading a checkpoint directory at any world size and strategy: each rank reads only the
//! files holding pieces it needs, checks sizes and checksums, builds the sharded state
//! dicts, checks them against the model and optimizer, and writes only once every rank
//! has found its part sound.

use super::file::{parse_tensors, TensorFile};
use super::index::{first_failed, read_index, Entry, Index, INDEX_FILE};
use crate::error::{Error, Result};
use crate::fsdp::{
    FullyShardedDataParallel, OptimStateDict, ShardPiece, ShardedStateDict, ShardedTensor,
    StateDict, StateDictType,
};
use crate::optim::{Optimizer, OptimizerState};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The pointer file of a save directory: the name of its newest checkpoint directory.
pub const LATEST_FILE: &str = "latest";

/// Which per-rank extra value (see
/// [`save_checkpoint_with_rank_extra`](super::save_checkpoint_with_rank_extra)) each rank
/// gets back on load, in [`CheckpointInfo::rank_extra`]. A checkpoint without per-rank
/// state (saved by [`save_checkpoint`](super::save_checkpoint), or by an earlier build)
/// gives `None` under every choice, at any world size.
///
/// Per-rank values cannot be resharded (which rank of 3 continues rank 1 of 2's data
/// stream is the caller's decision), so loading them at another world size is refused
/// unless the caller says what to do instead, as torchtitan's data loader refuses a
/// checkpoint of another data-parallel degree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum RankExtra {
    /// Each rank gets the value it saved (rank `r` the value of rank `r`). The default,
    /// and what [`load_checkpoint`] does; at another world size than the saved one it is
    /// a `Checkpoint` error naming both sizes, before anything is modified.
    #[default]
    Own,
    /// Every rank gets rank 0's value, at any world size (e.g. a seed from which each
    /// rank re-derives its state).
    Rank0,
    /// The per-rank values are not read: `None` on every rank, at any world size.
    Ignore,
}

/// What a loaded checkpoint said about itself.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    /// The checkpoint directory read.
    pub dir: PathBuf,
    /// How it was saved.
    pub state_dict_type: StateDictType,
    /// Data-parallel world size at save time.
    pub world_size: usize,
    /// Whether it holds optimizer state.
    pub has_optim: bool,
    /// The caller's data given at save time.
    pub extra: serde_json::Value,
    /// Whether the checkpoint holds per-rank extra state (one value per rank of
    /// `world_size`).
    pub has_rank_extra: bool,
    /// This rank's per-rank value as the load's [`RankExtra`] chose it (`Some(Value::Null)`
    /// for a saved `null`); `None` when the checkpoint has none, under [`RankExtra::Ignore`], and from
    /// [`read_checkpoint_info`] (which reads no rank's value; see [`read_rank_extra`]).
    pub rank_extra: Option<serde_json::Value>,
}

impl CheckpointInfo {
    fn of(dir: &Path, index: &Index) -> CheckpointInfo {
        CheckpointInfo {
            dir: dir.to_path_buf(),
            state_dict_type: index.state_dict_type,
            world_size: index.world_size,
            has_optim: index.optim.is_some(),
            extra: index.extra.clone(),
            has_rank_extra: index.rank_extra.is_some(),
            rank_extra: None,
        }
    }
}

/// The per-rank value `how` gives to `rank` of a world of `world_size` from `index`.
fn pick_rank_extra(
    dir: &Path,
    index: &Index,
    rank: usize,
    world_size: usize,
    how: RankExtra,
) -> Result<Option<serde_json::Value>> {
    let Some(values) = &index.rank_extra else {
        return Ok(None);
    };
    match how {
        RankExtra::Ignore => Ok(None),
        RankExtra::Rank0 => Ok(values.first().cloned()),
        RankExtra::Own if world_size != index.world_size => Err(Error::Checkpoint {
            path: dir.display().to_string(),
            detail: format!(
                "holds per-rank extra state saved at world size {}, and this load is at world size {world_size}: per-rank values do not reshard; load with RankExtra::Rank0 (every rank gets rank 0's value) or RankExtra::Ignore (none)",
                index.world_size
            ),
        }),
        RankExtra::Own => values.get(rank).cloned().map(Some).ok_or_else(|| Error::Checkpoint {
            path: dir.display().to_string(),
            detail: format!("holds no per-rank extra state for rank {rank}"),
        }),
    }
}

/// Rank `rank`'s per-rank value (see [`RankExtra`]) of the checkpoint `path` stands for,
/// read from its index alone: no collective and no model needed (restore a data loader
/// before building the model). [`load_checkpoint_with`] returns the same value.
///
/// # Errors
/// As [`read_index`]; `Checkpoint` naming both world sizes for [`RankExtra::Own`] when
/// `world_size` differs from the saved one and the checkpoint has per-rank state.
pub fn read_rank_extra(
    path: &Path,
    rank: usize,
    world_size: usize,
    how: RankExtra,
) -> Result<Option<serde_json::Value>> {
    let dir = resolve_checkpoint(path)?;
    pick_rank_extra(&dir, &read_index(&dir)?, rank, world_size, how)
}

/// The checkpoint directory `path` stands for: `path` itself when it holds an
/// `index.json`, else the directory its `latest` file names (a save directory of
/// `fsdp train --save-dir`).
///
/// # Errors
/// `Checkpoint` naming `path` when it does not exist, is not a directory, holds neither an
/// index nor `latest`, or `latest` names nothing usable; where a save directory is at hand
/// (`path`'s parent, or `path` itself), the message lists the checkpoints it holds and
/// what its `latest` names.
pub fn resolve_checkpoint(path: &Path) -> Result<PathBuf> {
    if path.join(INDEX_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let bad = |p: &Path, detail: String| Error::Checkpoint {
        path: p.display().to_string(),
        detail,
    };
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // A checkpoint rotated away, or a typo: say what the save directory holds.
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            let held = save_dir_contents(parent)
                .map_or(String::new(), |c| format!("; {} {c}", parent.display()));
            return Err(bad(path, format!("does not exist{held}")));
        }
        Err(e) => return Err(bad(path, format!("cannot be read: {e}"))),
        Ok(m) if !m.is_dir() => {
            return Err(bad(
                path,
                format!(
                    "is not a directory (a checkpoint is a folder holding {INDEX_FILE}; a save directory holds {LATEST_FILE})"
                ),
            ))
        }
        Ok(_) => {}
    }
    let latest = path.join(LATEST_FILE);
    match std::fs::read_to_string(&latest) {
        Ok(name) => {
            let name = name.trim();
            let dir = path.join(name);
            if name.is_empty() || name.contains('/') || !dir.join(INDEX_FILE).is_file() {
                let held = checkpoints_in(path);
                let held = if held.is_empty() {
                    String::new()
                } else {
                    format!(" (this directory holds {})", held.join(", "))
                };
                return Err(bad(
                    &latest,
                    format!("names '{name}', which is not a checkpoint directory here{held}"),
                ));
            }
            Ok(dir)
        }
        Err(_) => {
            let held = checkpoints_in(path);
            let held = if held.is_empty() {
                String::new()
            } else {
                format!(
                    "; it holds the checkpoints {}: give one of them",
                    held.join(", ")
                )
            };
            Err(bad(
                path,
                format!(
                    "holds neither {INDEX_FILE} (a checkpoint) nor {LATEST_FILE} (a save directory){held}"
                ),
            ))
        }
    }
}

/// The names of the checkpoint directories (holding an index) inside `dir`, sorted.
fn checkpoints_in(dir: &Path) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = rd
        .flatten()
        .filter(|e| e.path().join(INDEX_FILE).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// What the save directory `dir` holds, as `holds the checkpoints a, b and its latest
/// names b`; `None` when it holds neither a checkpoint nor `latest`.
fn save_dir_contents(dir: &Path) -> Option<String> {
    let held = checkpoints_in(dir);
    let latest = std::fs::read_to_string(dir.join(LATEST_FILE))
        .ok()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty());
    let held_text = match held.len() {
        0 => "holds no checkpoint".to_string(),
        1 => format!("holds the checkpoint {}", held[0]),
        _ => format!("holds the checkpoints {}", held.join(", ")),
    };
    match latest {
        Some(l) => Some(format!(
            "{held_text} and its {LATEST_FILE} names {l} (give {} to resume from it)",
            dir.display()
        )),
        None if held.is_empty() => None,
        None => Some(held_text),
    }
}

/// Reads only the index of the checkpoint `path` stands for (see [`resolve_checkpoint`]).
///
/// # Errors
/// As [`resolve_checkpoint`] and [`read_index`]; `Checkpoint` when the index's
/// `world_size`, `generation` or layout disagrees with the files it lists.
pub fn read_checkpoint_info(path: &Path) -> Result<CheckpointInfo> {
    let dir = resolve_checkpoint(path)?;
    let index = read_index(&dir)?;
    super::verify::check_index_files(&dir, &index)?;
    Ok(CheckpointInfo::of(&dir, &index))
}

/// Loads the checkpoint `path` stands for (see [`resolve_checkpoint`]) into `model` and,
/// when given, `optim` (an optimizer over `model.optimizer_params()`), whatever world size
/// and strategy it was saved at. A collective: every rank calls it. Strict: every
/// parameter must be in the checkpoint with its shape, f32, and nothing else may be.
/// Nothing is modified on any rank unless every rank's part checked out.
///
/// Per-rank extra state: each rank gets its own value back in
/// [`CheckpointInfo::rank_extra`] ([`RankExtra::Own`]), so a checkpoint with per-rank
/// state loads only at its own world size here; [`load_checkpoint_with`] chooses
/// otherwise.
///
/// # Errors
/// `Checkpoint` naming the file that is missing, truncated (its size against the
/// index's), corrupted (checksum) or lacks a tensor the index lists; `Checkpoint` naming
/// both world sizes when the checkpoint has per-rank extra state saved at another world
/// size; `StateDict` naming each parameter with a wrong shape or dtype, missing or
/// unexpected; `StateDict` when the optimizer is of another kind or the checkpoint has no
/// optimizer state; on the other ranks, `PeerFailed` naming the first rank that failed.
pub fn load_checkpoint(
    path: &Path,
    model: &mut FullyShardedDataParallel,
    optim: Option<&mut dyn Optimizer>,
) -> Result<CheckpointInfo> {
    load_checkpoint_with(path, model, optim, RankExtra::Own)
}

/// [`load_checkpoint`] with the per-rank extra state handled as `rank_extra` says:
/// [`RankExtra::Own`] (each rank its own value; same world size only), [`RankExtra::Rank0`]
/// (rank 0's value everywhere) or [`RankExtra::Ignore`] (none). The model and optimizer
/// load at any world size and strategy either way.
///
/// # Errors
/// As [`load_checkpoint`]; the world-size error only under [`RankExtra::Own`].
pub fn load_checkpoint_with(
    path: &Path,
    model: &mut FullyShardedDataParallel,
    optim: Option<&mut dyn Optimizer>,
    rank_extra: RankExtra,
) -> Result<CheckpointInfo> {
    let pg = model.process_group().clone();
    let staged = stage(path, model, optim.as_deref(), rank_extra);
    let failed = first_failed(&pg, staged.is_ok())?;
    let (dir, index, sd, ost, mine) = staged?;
    if let Some(r) = failed {
        // An echo of that rank's own error, which `launch` reports as the root cause.
        return Err(Error::PeerFailed {
            failed_rank: pg.ranks().get(r).copied().unwrap_or(r),
            reason: format!(
                "could not load its part of checkpoint '{}'; nothing was modified",
                dir.display()
            ),
        });
    }
    model.load_state_dict(&sd, true)?;
    if let (Some(o), Some(st)) = (optim, ost) {
        o.load_state_dict(&st)?;
    }
    Ok(CheckpointInfo {
        rank_extra: mine,
        ..CheckpointInfo::of(&dir, &index)
    })
}

/// What `stage` found: the directory, its index, the model's state dict, the optimizer's
/// state and this rank's per-rank value.
type Staged = (
    PathBuf,
    Index,
    StateDict,
    Option<OptimizerState>,
    Option<serde_json::Value>,
);

/// Reads and checks everything this rank needs; modifies nothing.
fn stage(
    path: &Path,
    model: &mut FullyShardedDataParallel,
    optim: Option<&dyn Optimizer>,
    how: RankExtra,
) -> Result<Staged> {
    let dir = resolve_checkpoint(path)?;
    let index = read_index(&dir)?;
    super::verify::check_index_files(&dir, &index)?;
    let pg = model.process_group();
    let mine = pick_rank_extra(&dir, &index, pg.rank(), pg.size(), how)?;
    let ranges: HashMap<String, Option<(usize, usize)>> = model
        .state_dict_ranges()
        .into_iter()
        .map(|r| (r.name, r.range))
        .collect();
    let oi = match (optim, &index.optim) {
        (None, _) => None,
        (Some(_), Some(o)) => Some(o),
        (Some(_), None) => {
            return Err(Error::StateDict(format!(
                "checkpoint '{}' has no optimizer state to load",
                dir.display()
            )))
        }
    };
    let mut sections: Vec<&BTreeMap<String, Entry>> = vec![&index.model];
    if let Some(o) = oi {
        sections.extend(o.buffers.values());
    }
    // The files holding pieces this rank needs.
    let mut need: Vec<usize> = Vec::new();
    for map in &sections {
        for (name, e) in map.iter() {
            let Some(Some((a, b))) = ranges.get(name) else {
                continue;
            };
            for p in &e.pieces {
                if p.offset < *b && *a < p.offset + p.numel && !need.contains(&p.file) {
                    need.push(p.file);
                }
            }
        }
    }
    let mut files: HashMap<usize, TensorFile> = HashMap::new();
    for f in need {
        files.insert(f, read_data_file(&dir, &index, f)?);
    }
    let to_sharded = |section: &str, map: &BTreeMap<String, Entry>| -> Result<ShardedStateDict> {
        let mut tensors = Vec::new();
        for (name, e) in map {
            let mut pieces = Vec::new();
            for p in &e.pieces {
                let Some(file) = files.get(&p.file) else {
                    continue;
                };
                let fname = &index.files[p.file].name;
                let t = file.get(&p.key).ok_or_else(|| Error::Checkpoint {
                    path: dir.join(fname).display().to_string(),
                    detail: format!(
                        "has no tensor '{}', which the index lists for '{name}'",
                        p.key
                    ),
                })?;
                if t.numel() != p.numel {
                    return Err(Error::Checkpoint {
                        path: dir.join(fname).display().to_string(),
                        detail: format!(
                            "tensor '{}' has {} elements; the index says {}",
                            p.key,
                            t.numel(),
                            p.numel
                        ),
                    });
                }
                if index.version >= 4 {
                    super::seal::check_piece(&dir.join(fname), section, name, e, p, t)?;
                }
                pieces.push(ShardPiece {
                    offset: p.offset,
                    data: t.reshape(&[p.numel])?,
                    rank: p.rank,
                });
            }
            tensors.push((
                name.clone(),
                ShardedTensor {
                    global_shape: e.shape.clone(),
                    pieces,
                },
            ));
        }
        Ok(ShardedStateDict {
            world_size: index.world_size,
            tensors,
        })
    };
    let sd = StateDict::Sharded(to_sharded("model", &index.model)?);
    model.check_state_dict(&sd, true)?;
    let ost = match (optim, oi) {
        (Some(o), Some(oi)) => {
            let osd = OptimStateDict {
                kind: oi.kind.clone(),
                hyperparams: oi.hyperparams.clone().into_iter().collect(),
                steps: oi.steps.clone().into_iter().collect(),
                buffers: oi
                    .buffers
                    .iter()
                    .map(|(n, m)| Ok((n.clone(), StateDict::Sharded(to_sharded(n.as_str(), m)?))))
                    .collect::<Result<_>>()?,
                param_groups: oi.param_groups.clone(),
            };
            let mine = o.state_dict()?.kind;
            if mine != osd.kind {
                return Err(Error::StateDict(format!(
                    "the checkpoint's optimizer state is {}'s; this optimizer is {mine}",
                    osd.kind
                )));
            }
            Some(model.optim_state_dict_to_load(&osd)?)
        }
        _ => None,
    };
    Ok((dir, index, sd, ost, mine))
}

/// Reads data file `f` of the index, checking its size and checksum against the index.
fn read_data_file(dir: &Path, index: &Index, f: usize) -> Result<TensorFile> {
    let fe = index.files.get(f).ok_or_else(|| Error::Checkpoint {
        path: dir.join(INDEX_FILE).display().to_string(),
        detail: format!("a piece refers to file #{f}, which the index does not list"),
    })?;
    // The index names files of its own directory only: no path can reach outside it.
    let plain = Path::new(&fe.name)
        .file_name()
        .is_some_and(|n| n == std::ffi::OsStr::new(&fe.name));
    if !plain || fe.name.starts_with('.') {
        return Err(Error::Checkpoint {
            path: dir.join(INDEX_FILE).display().to_string(),
            detail: format!(
                "lists file '{}', which is not a plain file name in the checkpoint directory",
                fe.name
            ),
        });
    }
    let p = dir.join(&fe.name);
    let bad = |detail: String| Error::Checkpoint {
        path: p.display().to_string(),
        detail,
    };
    let bytes =
        std::fs::read(&p).map_err(|e| bad(format!("cannot read a file the index lists: {e}")))?;
    if bytes.len() as u64 != fe.bytes {
        return Err(bad(format!(
            "has {} bytes; the index says {}: the file is truncated or was replaced",
            bytes.len(),
            fe.bytes
        )));
    }
    let sum = index.checksum_of(&bytes);
    if sum != fe.checksum {
        return Err(bad(format!(
            "checksum {sum} differs from the index's {}: the file is corrupted",
            fe.checksum
        )));
    }
    parse_tensors(&p, &bytes)
}
