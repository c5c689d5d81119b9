//! Asynchronous checkpoints (`torch.distributed.checkpoint.async_save`): a save returns
//! once this rank's shards are copied into host memory of their own; a background thread
//! writes the files, and the index that makes the checkpoint visible is written once every
//! rank's files are durable.
//!
//! What the training thread does for a sharded save: a raw copy of each unit's local
//! shard and of the optimizer's state tensors into reused host buffers, and the layout
//! (names, shapes, offsets, steps). Cutting those into the state dicts (the optimizer's
//! runs cut at parameter boundaries, through f64), serializing and writing happen on the
//! writer thread. Collectives (the generation's broadcast, named parameter groups, a full
//! state dict's gathers, the commit) stay on the training thread.
//!
//! Why the index waits: it may be written only after every rank's files are durable,
//! which the ranks learn from a collective, and collectives run on the training thread
//! only (a background thread's collective would interleave with training's on the same
//! group). So each rank's writer thread does file I/O and nothing else, and the next save
//! (or [`AsyncCheckpointer::wait`]) first commits the previous one on the training thread:
//! it waits for this rank's writer, the ranks' manifests meet at rank 0 (a collective) and
//! every rank learns whether every file was written. Rank 0 then writes the index (and
//! runs the `on_commit` hook) on a thread of its own, whose failure the following commit
//! reports on every rank; `wait` writes it before returning. At most one save is in
//! flight per rank. A crash before the index is written leaves the previous checkpoint of
//! the directory as it was: the new files carry a new generation that no index names yet.

use super::save::{lost_writer, stage, Background, Commit, What, Written};
use crate::backend::Device;
use crate::distributed::Group;
use crate::error::{Error, Result};
use crate::fsdp::{FullyShardedDataParallel, StateDictType};
use crate::optim::Optimizer;
use crate::tensor::Tensor;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

/// `t`'s values in host memory that nothing else refers to: a CPU tensor no other tensor
/// shares storage with as it is; any other tensor copied as [`host_copy`] copies it.
///
/// # Errors
/// As [`host_copy`].
pub(super) fn to_host(t: &Tensor, pool: &mut Vec<Tensor>) -> Result<Tensor> {
    if !t.device().is_cuda() && t.is_sole_owner() {
        return Ok(t.clone());
    }
    host_copy(t, pool)
}

/// A copy of `t` in host memory of its own: into a buffer of `pool` of its shape and
/// dtype (page-locked for a CUDA tensor) when there is one, else into a new one
/// (`pin_memory` for a CUDA tensor, as PyTorch's async staging does), waiting for the copy.
///
/// # Errors
/// As [`Tensor::pinned_zeros`] and [`Tensor::copy_from`].
pub(super) fn host_copy(t: &Tensor, pool: &mut Vec<Tensor>) -> Result<Tensor> {
    let cuda = match t.device() {
        Device::Cuda(ordinal) => Some(ordinal),
        _ => None,
    };
    let fits = |b: &Tensor| {
        b.shape() == t.shape()
            && b.dtype() == t.dtype()
            && (cuda.is_none() || b.is_pinned())
            && b.is_sole_owner()
    };
    let host = match pool.iter().position(fits) {
        Some(i) => pool.swap_remove(i),
        None => match cuda {
            Some(ordinal) => Tensor::pinned_zeros(t.shape(), t.dtype(), ordinal)?,
            None => Tensor::try_zeros(t.shape(), t.dtype())?,
        },
    };
    host.copy_from(t)?;
    Ok(host)
}

/// One rank's save in flight: its writer thread and what the commit needs.
struct InFlight {
    commit: Commit,
    writer: JoinHandle<(Written, Vec<Tensor>)>,
}

/// What runs on rank 0 after a checkpoint's index is durable.
type OnCommit = Arc<dyn Fn(&Path) -> Result<()> + Send + Sync>;

/// Saves checkpoints in the background, one at a time per rank (PyTorch's
/// `torch.distributed.checkpoint.async_save`; the same files and index as
/// [`save_checkpoint`](super::save_checkpoint), with the same crash safety). Every rank
/// of the model's world holds one and calls the same methods in the same order.
///
/// Memory: between saves it keeps the last save's host copy (one rank's shards of the
/// model and optimizer state), reused by the next save, as PyTorch's staging cache does.
///
/// Dropping it waits for its threads; a save whose files were not committed by a
/// [`wait`](Self::wait) or a later save never becomes visible, and the directory's
/// previous checkpoint stays the one that loads. Call [`wait`](Self::wait) at the end of
/// training.
#[derive(Default)]
pub struct AsyncCheckpointer {
    group: Option<Group>,
    in_flight: Option<InFlight>,
    /// The last save every rank wrote whose index rank 0 may still be writing: its
    /// directory and generation.
    indexed: Option<(PathBuf, u64)>,
    /// Rank 0: the thread writing that index.
    indexing: Option<JoinHandle<Result<()>>>,
    on_commit: Option<OnCommit>,
    /// Host buffers of the last save, reused by the next one (page-locked memory is slow to
    /// allocate).
    pool: Vec<Tensor>,
}

impl std::fmt::Debug for AsyncCheckpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCheckpointer")
            .field("in_flight", &self.in_flight())
            .field("indexed", &self.indexed)
            .finish()
    }
}

impl AsyncCheckpointer {
    /// No save in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f(dir)` on rank 0 after each checkpoint's index is durable, on the thread
    /// that wrote it (`fsdp train` points `latest` at it there and rotates). An error is
    /// reported as a failed save at the next save or at [`wait`](Self::wait).
    pub fn on_commit(mut self, f: impl Fn(&Path) -> Result<()> + Send + Sync + 'static) -> Self {
        self.on_commit = Some(Arc::new(f));
        self
    }

    /// The directory of the save in flight (written or being written, not yet committed).
    pub fn in_flight(&self) -> Option<&Path> {
        self.in_flight.as_ref().map(|s| s.commit.dir.as_path())
    }

    /// [`save_checkpoint`](super::save_checkpoint) in the background: first commits the
    /// save in flight, if any (see the module doc), then copies this rank's state into
    /// host memory of its own (page-locked for a CUDA model) and returns; a thread writes
    /// the files. Sharded: only each unit's local shard and the optimizer's state tensors
    /// are copied here, raw; the writer thread cuts them into the state dicts (the same
    /// bytes as the synchronous save). Full: the state dicts are taken here (collectives, as
    /// the synchronous save) and copied. The model and optimizer may change as soon as it
    /// returns. A collective.
    ///
    /// Returns the directories whose index this call confirmed durable (the save before
    /// the previous one: rank 0 wrote its index in the background since the last call).
    ///
    /// # Errors
    /// What [`wait`](Self::wait) reports for the earlier saves (then nothing of this one
    /// was started); then as [`save_checkpoint`](super::save_checkpoint) for the steps
    /// before the writes (`Unsupported` for `Local`; rank 0 could not create `dir`).
    pub fn save_checkpoint_async(
        &mut self,
        dir: &Path,
        model: &mut FullyShardedDataParallel,
        optim: Option<&dyn Optimizer>,
        ty: StateDictType,
        extra: serde_json::Value,
    ) -> Result<Vec<PathBuf>> {
        self.save(dir, model, What::new(optim, ty, extra, None))
    }

    /// [`save_checkpoint_async`](Self::save_checkpoint_async) with this rank's own value,
    /// as [`save_checkpoint_with_rank_extra`](super::save_checkpoint_with_rank_extra).
    ///
    /// # Errors
    /// As [`save_checkpoint_async`](Self::save_checkpoint_async).
    pub fn save_checkpoint_async_with_rank_extra(
        &mut self,
        dir: &Path,
        model: &mut FullyShardedDataParallel,
        optim: Option<&dyn Optimizer>,
        ty: StateDictType,
        extra: serde_json::Value,
        rank_extra: serde_json::Value,
    ) -> Result<Vec<PathBuf>> {
        self.save(dir, model, What::new(optim, ty, extra, Some(rank_extra)))
    }

    fn save(
        &mut self,
        dir: &Path,
        model: &mut FullyShardedDataParallel,
        what: What<'_>,
    ) -> Result<Vec<PathBuf>> {
        self.group = Some(model.process_group().clone());
        let visible = self.commit(false)?;
        let after = self.indexed.as_ref().map(|(d, g)| (d.as_path(), *g));
        let staged = stage(
            dir,
            model,
            what,
            Some(Background {
                after,
                pool: &mut self.pool,
            }),
        )?;
        let writes = staged.writes;
        let writer = std::thread::Builder::new()
            .name(format!("fsdp-ckpt-writer-{}", model.process_group().rank()))
            .spawn(move || writes.write())
            .map_err(|e| Error::io("starting the checkpoint writer thread", e))?;
        self.in_flight = Some(InFlight {
            commit: staged.commit,
            writer,
        });
        Ok(visible)
    }

    /// Waits for the save in flight, if any, and commits it: every rank's files are
    /// durable, then rank 0 writes the index atomically (and runs the `on_commit` hook).
    /// A collective. Returns the directories whose index this call confirmed durable.
    ///
    /// # Errors
    /// On every rank, when a rank's background write failed, or rank 0's index write or
    /// `on_commit` hook: `Checkpoint` (or `Io`) naming the file that could not be written
    /// on that rank, `PeerFailed` naming the rank and quoting its error on the others; the
    /// index is not replaced, so the directory's previous checkpoint stays the one that
    /// loads. A failed save is reported once: the checkpointer is idle after.
    pub fn wait(&mut self) -> Result<Vec<PathBuf>> {
        self.commit(true)
    }

    /// Commits the save in flight (see the module doc); with `last`, rank 0 writes its
    /// index before returning.
    fn commit(&mut self, last: bool) -> Result<Vec<PathBuf>> {
        let Some(group) = self.group.clone() else {
            return Ok(Vec::new());
        };
        // Rank 0's failure to write the previous index, reported on every rank below.
        let earlier = match self.indexing.take() {
            Some(h) => match h.join() {
                Ok(r) => r.err().map(|e| e.to_string()),
                Err(_) => Some("the thread writing the checkpoint index stopped".into()),
            },
            None => None,
        };
        let mut visible: Vec<PathBuf> = self.indexed.take().map(|(d, _)| d).into_iter().collect();
        let Some(s) = self.in_flight.take() else {
            // Only an index may be outstanding (a save failed before its writes began).
            let failed = super::index::first_failed(&group, earlier.is_none())?;
            if let Some(e) = earlier {
                return Err(Error::Checkpoint {
                    path: visible
                        .pop()
                        .map_or_else(String::new, |d| d.display().to_string()),
                    detail: e,
                });
            }
            if let Some(r) = failed {
                return Err(Error::PeerFailed {
                    failed_rank: group.ranks().get(r).copied().unwrap_or(r),
                    reason: "could not write a checkpoint index".into(),
                });
            }
            return Ok(visible);
        };
        let (dir, generation) = (s.commit.dir.clone(), s.commit.generation);
        let written = match s.writer.join() {
            Ok((written, buffers)) => {
                self.pool = buffers;
                written
            }
            Err(_) => lost_writer(&dir),
        };
        let job = s.commit.commit(&group, written, earlier, last)?;
        let hook = self.on_commit.clone();
        let publish = move |d: &Path| hook.as_ref().map_or(Ok(()), |f| f(d));
        if last {
            if group.rank() == 0 {
                publish(&dir)?;
            }
            visible.push(dir);
        } else {
            if let Some(job) = job {
                let d = dir.clone();
                let h = std::thread::Builder::new()
                    .name("fsdp-ckpt-index".into())
                    .spawn(move || job.write().and_then(|()| publish(&d)))
                    .map_err(|e| Error::io("starting the checkpoint index thread", e))?;
                self.indexing = Some(h);
            }
            self.indexed = Some((dir, generation));
        }
        Ok(visible)
    }
}

impl Drop for AsyncCheckpointer {
    fn drop(&mut self) {
        if let Some(s) = self.in_flight.take() {
            let _ = s.writer.join();
        }
        if let Some(h) = self.indexing.take() {
            let _ = h.join();
        }
    }
}
