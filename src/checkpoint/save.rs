//! Saving a model (and optimizer) to a checkpoint directory: data files first, each
//! written atomically under a name no current index refers to, then the index, atomically,
//! then stale files are removed. A crash at any point leaves the previous checkpoint of the
//! directory loadable.

use super::atomic::remove_stale_temps;
use super::file::{checksum, serialize};
use super::index::{read_index, FileEntry, FORMAT};
use super::plan::{piece_sums, plan_snapshot, planned};
use crate::distributed::staged;
use crate::error::{Error, Result};
use crate::fsdp::{FullyShardedDataParallel, OptimSnapshot, ShardedSnapshot, StateDictType};
use crate::optim::Optimizer;
use crate::tensor::Tensor;
use std::collections::HashMap;
use std::path::Path;

/// What one rank wrote, sent to rank 0 for the index.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct Manifest {
    /// This rank's failure, if any.
    pub(super) error: Option<String>,
    pub(super) files: Vec<FileEntry>,
    /// `(section, name, global shape)` of every key this rank's state dicts have;
    /// section is `model` or an optimizer buffer name.
    pub(super) entries: Vec<(String, String, Vec<usize>)>,
    /// The dtype of each entry's tensor (`"F32"`, ...), as `entries`; `None` where this
    /// rank holds no piece of it.
    #[serde(default)]
    pub(super) entry_dtypes: Vec<Option<String>>,
    /// `(section, name, file (index into files), key, offset, numel)`.
    pub(super) pieces: Vec<(String, String, usize, String, usize, usize)>,
    /// Each piece's checksum binding it to its entry (see `seal.rs`), as `pieces`; filled
    /// when the files are written.
    #[serde(default)]
    pub(super) piece_sums: Vec<String>,
    /// Optimizer kind, hyperparameters and the steps this rank knows.
    pub(super) optim: Option<OptimMeta>,
    /// The optimizer's parameter groups by name (the same on every rank).
    #[serde(default)]
    pub(super) optim_groups: Vec<crate::fsdp::NamedParamGroup>,
    /// This rank's own extra value, when the save has per-rank state: empty for none, else
    /// one element (so that a JSON `null` value is told from no value; an
    /// `Option<Value>` would read `null` back as `None`).
    #[serde(default)]
    pub(super) rank_extra: Vec<serde_json::Value>,
}

/// `(kind, hyperparameters, steps)` of an optimizer state dict.
pub(super) type OptimMeta = (String, Vec<(String, f64)>, Vec<(String, u64)>);

/// Saves `model` and, when given, `optim` (an optimizer over `model.optimizer_params()`)
/// to the directory `dir` as a checkpoint of type `ty` (`Full`: rank 0 writes one model
/// file, whose keys are the parameter names, and one optimizer file; `Sharded`: every rank
/// holding distinct shards writes one file of its pieces; under ZeRO-1, every rank, holding its
/// chunk of the optimizer state). `extra` is stored in the index
/// as is. A collective: every rank of the model's world calls it.
///
/// Crash safety: data files get names carrying a new generation number, the index is
/// replaced atomically (temporary file, fsync, rename, fsync of the directory) after every
/// rank's files are durable, and only then are the previous generation's files removed.
///
/// # Errors
/// `Io` or `Checkpoint` naming the file a rank could not write (every rank returns an
/// error, and the previous checkpoint of `dir` stays as it was); `Unsupported` for `Local`.
pub fn save_checkpoint(
    dir: &Path,
    model: &mut FullyShardedDataParallel,
    optim: Option<&dyn Optimizer>,
    ty: StateDictType,
    extra: serde_json::Value,
) -> Result<()> {
    save(dir, model, What::new(optim, ty, extra, None))
}

/// [`save_checkpoint`] plus per-rank state: each rank passes its own `rank_extra` (a
/// data-loader position, an RNG state: what `torch.distributed.checkpoint` saves per rank
/// for a stateful object whose state differs between ranks), and every rank's value is
/// kept, in the index, in rank order (index version 2). The values travel to rank 0 with
/// the file manifests and become durable with the index, atomically: a crash never
/// leaves a checkpoint with some ranks' values. Meant for small JSON values (each byte
/// is gathered as a 4-byte word); tensors belong in the model or optimizer state. Any JSON
/// value is kept as given, `null` included (it comes back as `Some(Value::Null)`, while a
/// checkpoint without per-rank state gives `None`). Load
/// them back with [`load_checkpoint_with`](super::load_checkpoint_with): each rank gets
/// its own value at the same world size; see [`RankExtra`](super::RankExtra) for another.
///
/// # Errors
/// As [`save_checkpoint`]; `Checkpoint` on every rank when some ranks called
/// [`save_checkpoint`] for the same save (no per-rank value) and others this function.
pub fn save_checkpoint_with_rank_extra(
    dir: &Path,
    model: &mut FullyShardedDataParallel,
    optim: Option<&dyn Optimizer>,
    ty: StateDictType,
    extra: serde_json::Value,
    rank_extra: serde_json::Value,
) -> Result<()> {
    save(dir, model, What::new(optim, ty, extra, Some(rank_extra)))
}

/// What a save writes besides the model: the arguments of the public save functions.
pub(super) struct What<'a> {
    optim: Option<&'a dyn Optimizer>,
    ty: StateDictType,
    extra: serde_json::Value,
    rank_extra: Option<serde_json::Value>,
}

impl<'a> What<'a> {
    /// The optimizer, layout, `extra` and this rank's value of a save.
    pub(super) fn new(
        optim: Option<&'a dyn Optimizer>,
        ty: StateDictType,
        extra: serde_json::Value,
        rank_extra: Option<serde_json::Value>,
    ) -> Self {
        What {
            optim,
            ty,
            extra,
            rank_extra,
        }
    }
}

fn save(dir: &Path, model: &mut FullyShardedDataParallel, what: What<'_>) -> Result<()> {
    let staged = stage(dir, model, what, None)?;
    let pg = model.process_group().clone();
    let (written, _) = staged.writes.write();
    staged.commit.commit(&pg, written, None, true).map(drop)
}

/// A save whose collectives are done: what remains is file I/O ([`Writes::write`]) and
/// the index ([`Commit::commit`]).
pub(super) struct Staged {
    pub(super) writes: Writes,
    pub(super) commit: Commit,
}

/// What this rank's data files are made of.
enum Content {
    /// The files, `(file name, tensors)`; empty on ranks that write none.
    Files(Vec<(String, Vec<(String, Tensor)>)>),
    /// A background sharded save's snapshots of the model (on the ranks writing it) and
    /// of the optimizer: host copies of the shards and optimizer buffers taken on the
    /// training thread, cut into the state dicts and planned into files by the writer
    /// thread ([`plan_snapshot`]), with the same bytes as a synchronous save's files.
    Snapshot {
        model: Option<Box<ShardedSnapshot>>,
        optim: Option<Box<OptimSnapshot>>,
        world_size: usize,
    },
}

/// This rank's files of a staged save.
pub(super) struct Writes {
    content: Content,
    /// This rank's manifest without its `files` (or with the error of planning them).
    manifest: Manifest,
    rank: usize,
    dir: std::path::PathBuf,
    generation: u64,
}

/// What the index of a staged save needs besides the ranks' manifests.
pub(super) struct Commit {
    pub(super) dir: std::path::PathBuf,
    pub(super) generation: u64,
    pub(super) ty: StateDictType,
    pub(super) extra: serde_json::Value,
}

/// This rank's manifest after its writes (carrying the error of a failed write).
pub(super) struct Written(pub(super) Manifest);

/// What a save written in the background needs from its [`AsyncCheckpointer`](super::AsyncCheckpointer).
pub(super) struct Background<'a> {
    /// The directory and generation of an index this process may still be writing: a save
    /// to the same directory takes the next generation and leaves this process's
    /// temporary files.
    pub(super) after: Option<(&'a Path, u64)>,
    /// Host buffers to copy into (page-locked for a CUDA model; one of the same shape and
    /// dtype when there is one, else a new one).
    pub(super) pool: &'a mut Vec<Tensor>,
}

/// The first half of a save, on every rank: rank 0 prepares `dir` and picks the
/// generation, the state dicts are taken (collectives for `Full`) and this rank's pieces
/// planned into files. For a `background` save every tensor is copied into host memory of
/// its own (see [`Background`]), so training may change the model while the files are
/// written: a sharded one copies only each unit's shard and the optimizer's state tensors
/// here, and the writer thread cuts them into the state dicts ([`Content::Snapshot`]);
/// otherwise the files may alias the model's storage until they are written.
///
/// # Errors
/// As [`save_checkpoint`], for the steps before the writes.
pub(super) fn stage(
    dir: &Path,
    model: &mut FullyShardedDataParallel,
    what: What<'_>,
    background: Option<Background<'_>>,
) -> Result<Staged> {
    let What {
        optim,
        ty,
        extra,
        rank_extra,
    } = what;
    let (after, pool) = match background {
        Some(b) => (b.after, Some(b.pool)),
        None => (None, None),
    };
    if ty == StateDictType::Local {
        return Err(Error::Unsupported(
            "LOCAL_STATE_DICT checkpoints; save FULL or SHARDED (they reload at any world size)"
                .into(),
        ));
    }
    let pg = model.process_group().clone();
    let rank = pg.rank();
    // Rank 0 prepares the directory and picks the generation; everyone learns both.
    let prep = if rank == 0 {
        prepare(dir, after.filter(|(d, _)| *d == dir).map(|(_, g)| g))
    } else {
        Ok(0)
    };
    let word = Tensor::from_vec(vec![prep.as_ref().map_or(-1, |&g| g as i32)], &[1])?;
    staged::broadcast(pg.as_ref(), &word, 0)?;
    let generation = word.data::<i32>()?[0];
    prep?;
    if generation < 0 {
        return Err(Error::Checkpoint {
            path: dir.display().to_string(),
            detail: "rank 0 could not prepare the directory; nothing was written".into(),
        });
    }
    let generation = generation as u64;
    // Sharded: the ranks holding distinct shards write the model (replica 0), and under
    // ZeRO-1 every rank writes its chunk of the optimizer state (the model only on rank 0).
    let model_writer = match ty {
        StateDictType::Full => rank == 0,
        _ => model.shard_replica_rank() == 0,
    };
    let writer = model_writer
        || (ty == StateDictType::Sharded && optim.is_some() && model.zero_redundancy());
    let (mut manifest, content) = match (ty, pool) {
        // A background sharded save: on this thread only copies of the shards and of the
        // optimizer's state into host buffers of their own, and the layout; the writer
        // thread cuts them into the state dicts (see [`Content::Snapshot`]).
        (StateDictType::Sharded, Some(pool)) => {
            // A failed copy (out of memory) fails this rank's save at the commit, as a
            // failed write does; the rank goes on through the same collectives meanwhile.
            let mut failed: Option<Error> = None;
            let mut copy = |t: &Tensor| {
                super::async_save::host_copy(t, pool).or_else(|e| {
                    failed.get_or_insert(e);
                    Ok(t.clone())
                })
            };
            let model_part = if model_writer {
                Some(Box::new(model.sharded_snapshot(&mut copy)?))
            } else {
                None
            };
            let optim_part = match optim {
                Some(o) if writer => Some(Box::new(model.optim_snapshot(o, &mut copy)?)),
                // Every rank takes part in its collective (named parameter groups).
                Some(o) => model
                    .optim_snapshot(o, &mut |t| Ok(t.clone()))
                    .map(|_| None)?,
                None => None,
            };
            match failed {
                Some(e) => (
                    Manifest {
                        error: Some(e.to_string()),
                        ..Manifest::default()
                    },
                    Content::Files(Vec::new()),
                ),
                None if writer => (
                    Manifest::default(),
                    Content::Snapshot {
                        model: model_part,
                        optim: optim_part,
                        world_size: pg.size(),
                    },
                ),
                None => (Manifest::default(), Content::Files(Vec::new())),
            }
        }
        (_, pool) => {
            let (manifest, files) = planned(
                model,
                optim,
                ty,
                rank,
                generation,
                model_writer,
                writer,
                pool,
            )?;
            (manifest, Content::Files(files))
        }
    };
    // Every rank's value, writer or not (replicas under hybrid sharding write no file).
    manifest.rank_extra = rank_extra.into_iter().collect();
    Ok(Staged {
        writes: Writes {
            content,
            manifest,
            rank,
            dir: dir.to_path_buf(),
            generation,
        },
        commit: Commit {
            dir: dir.to_path_buf(),
            generation,
            ty,
            extra,
        },
    })
}

impl Writes {
    /// Writes this rank's data files (no collective: it may run on any thread); a failure
    /// is kept in the manifest, for [`Commit::commit`] to report on every rank. Returns the
    /// host buffers to reuse: a snapshot's copies, or the planned files' tensors.
    pub(super) fn write(self) -> (Written, Vec<Tensor>) {
        let Writes {
            content,
            mut manifest,
            rank,
            dir,
            generation,
        } = self;
        let mut reuse = Vec::new();
        let (files, keep) = match content {
            Content::Files(files) => (files, true),
            Content::Snapshot {
                model,
                optim,
                world_size,
            } => match plan_snapshot(rank, generation, model, optim, world_size, &mut reuse) {
                Ok((m, files)) => {
                    manifest = Manifest {
                        rank_extra: std::mem::take(&mut manifest.rank_extra),
                        ..m
                    };
                    (files, false)
                }
                Err(e) => {
                    manifest.error = Some(e.to_string());
                    (Vec::new(), false)
                }
            },
        };
        if manifest.error.is_none() {
            if let Err(e) = write_files(&dir, rank, generation, &files, &mut manifest) {
                manifest.error = Some(e.to_string());
                manifest.files.clear();
            }
        }
        if keep {
            reuse.extend(files.into_iter().flat_map(|(_, t)| t).map(|(_, t)| t));
        }
        (Written(manifest), reuse)
    }
}

/// A manifest that says this rank's background writer was lost (it panicked).
pub(super) fn lost_writer(dir: &Path) -> Written {
    Written(Manifest {
        error: Some(format!(
            "the background writer of checkpoint '{}' stopped before its files were written",
            dir.display()
        )),
        ..Manifest::default()
    })
}

/// Creates `dir` and returns the next generation number: after the current index's, and
/// after `after`, the generation of an index this process may still be writing there
/// (whose temporary files are then left alone).
fn prepare(dir: &Path, after: Option<u64>) -> Result<u64> {
    std::fs::create_dir_all(dir).map_err(|e| {
        Error::io(
            format!("creating checkpoint directory '{}'", dir.display()),
            e,
        )
    })?;
    remove_stale_temps(dir, after.is_some());
    let current = read_index(dir).map_or(0, |i| i.generation);
    Ok(current.max(after.unwrap_or(0)) + 1)
}

/// Writes this rank's planned data files, each atomically, and records their sizes and
/// checksums in `m`.
fn write_files(
    dir: &Path,
    rank: usize,
    generation: u64,
    files: &[(String, Vec<(String, Tensor)>)],
    m: &mut Manifest,
) -> Result<()> {
    let meta: HashMap<String, String> = [
        ("format".to_string(), FORMAT.to_string()),
        ("generation".to_string(), generation.to_string()),
        ("rank".to_string(), rank.to_string()),
    ]
    .into_iter()
    .collect();
    piece_sums(files, m)?;
    for (name, tensors) in files {
        let path = dir.join(name);
        let bytes = serialize(&path, tensors, &meta)?;
        super::atomic::write_atomic(&path, &bytes)?;
        m.files.push(FileEntry {
            name: name.clone(),
            bytes: bytes.len() as u64,
            checksum: checksum(&bytes),
        });
    }
    Ok(())
}
