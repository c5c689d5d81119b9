//! Asynchronous checkpoints (`torch.distributed.checkpoint.async_save`): a save returns
//! once this rank's shards are copied into host memory of their own; a background thread
//! writes the files, and the index that makes the checkpoint visible is written when the
//! next save starts or at [`AsyncCheckpointer::wait`].
//!
//! Why the index waits: it may be written only after every rank's files are durable,
//! which the ranks learn from a collective, and collectives run on the training thread
//! only (a background thread's collective would interleave with training's on the same
//! group). So each rank's writer thread does file I/O and nothing else, and the commit (the
//! ranks' manifests gathered at rank 0, the index written atomically, a failure agreed by
//! every rank) is the first thing the next save, or `wait`, does on the training thread.
//! At most one save is in flight per rank. A crash before the commit leaves the previous
//! checkpoint of the directory as it was: the new files carry a new generation that no
//! index names yet.

use super::save::{lost_writer, stage, Commit, Written};
use crate::backend::Device;
use crate::distributed::Group;
use crate::error::Result;
use crate::fsdp::{FullyShardedDataParallel, StateDictType};
use crate::optim::Optimizer;
use crate::tensor::Tensor;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// `t`'s values in host memory that nothing else refers to: a CPU tensor no other tensor
/// shares storage with as it is; any other tensor copied into a buffer of `pool` of its
/// shape and dtype (page-locked for a CUDA tensor) when there is one, else into a new one
/// (`pin_memory` for a CUDA tensor, as PyTorch's async staging does), waiting for the copy.
///
/// # Errors
/// As [`Tensor::pinned_zeros`] and [`Tensor::copy_from`].
pub(super) fn to_host(t: &Tensor, pool: &mut Vec<Tensor>) -> Result<Tensor> {
    let cuda = match t.device() {
        Device::Cuda(ordinal) => Some(ordinal),
        _ if t.is_sole_owner() => return Ok(t.clone()),
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
    group: Group,
    commit: Commit,
    writer: JoinHandle<(Written, Vec<Tensor>)>,
}

/// Saves checkpoints in the background, one at a time per rank (PyTorch's
/// `torch.distributed.checkpoint.async_save`; the same files and index as
/// [`save_checkpoint`](super::save_checkpoint), with the same crash safety). Every rank
/// of the model's world holds one and calls the same methods in the same order.
///
/// Memory: between saves it keeps the last save's host copy (one rank's shards of the
/// model and optimizer state), reused by the next save, as PyTorch's staging cache does.
///
/// Dropping it with a save in flight waits for the writes but writes no index: that save
/// never becomes visible, and the directory's previous checkpoint stays the one that
/// loads. Call [`wait`](Self::wait) at the end of training.
#[derive(Default)]
pub struct AsyncCheckpointer {
    in_flight: Option<InFlight>,
    /// Host buffers of the last save, reused by the next one (page-locked memory is slow to
    /// allocate).
    pool: Vec<Tensor>,
}

impl std::fmt::Debug for AsyncCheckpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCheckpointer")
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl AsyncCheckpointer {
    /// No save in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// The directory of the save in flight (written or being written, its index not yet).
    pub fn in_flight(&self) -> Option<&Path> {
        self.in_flight.as_ref().map(|s| s.commit.dir.as_path())
    }

    /// [`save_checkpoint`](super::save_checkpoint) in the background: first commits the
    /// save in flight, if any ([`wait`](Self::wait)), then takes the state dicts
    /// (collectives, as the synchronous save), copies this rank's pieces into host memory
    /// of their own (page-locked for a CUDA model) and returns; a thread writes the files.
    /// The model and optimizer may change as soon as it returns. The checkpoint becomes
    /// visible (its index written) at the next call or at [`wait`](Self::wait). A
    /// collective.
    ///
    /// Returns the directory of the previous save when this call committed one.
    ///
    /// # Errors
    /// What [`wait`](Self::wait) reports for the previous save (then nothing of this one
    /// was started); then as [`save_checkpoint`](super::save_checkpoint) for the steps
    /// before the writes (`Unsupported` for `Local`; rank 0 could not create `dir`).
    pub fn save_checkpoint_async(
        &mut self,
        dir: &Path,
        model: &mut FullyShardedDataParallel,
        optim: Option<&dyn Optimizer>,
        ty: StateDictType,
        extra: serde_json::Value,
    ) -> Result<Option<PathBuf>> {
        self.save(dir, model, optim, ty, extra, None)
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
    ) -> Result<Option<PathBuf>> {
        self.save(dir, model, optim, ty, extra, Some(rank_extra))
    }

    fn save(
        &mut self,
        dir: &Path,
        model: &mut FullyShardedDataParallel,
        optim: Option<&dyn Optimizer>,
        ty: StateDictType,
        extra: serde_json::Value,
        rank_extra: Option<serde_json::Value>,
    ) -> Result<Option<PathBuf>> {
        let committed = self.wait()?;
        let staged = stage(
            dir,
            model,
            optim,
            ty,
            extra,
            rank_extra,
            Some(&mut self.pool),
        )?;
        let writes = staged.writes;
        let writer = std::thread::Builder::new()
            .name(format!("fsdp-ckpt-writer-{}", model.process_group().rank()))
            .spawn(move || writes.write())
            .map_err(|e| crate::error::Error::io("starting the checkpoint writer thread", e))?;
        self.in_flight = Some(InFlight {
            group: model.process_group().clone(),
            commit: staged.commit,
            writer,
        });
        Ok(committed)
    }

    /// Waits for the save in flight, if any, and commits it: every rank's files are
    /// durable, then rank 0 writes the index atomically. A collective. Returns the
    /// directory committed, `None` when no save was in flight.
    ///
    /// # Errors
    /// On every rank, when a rank's background write failed: `Checkpoint` (or `Io`) naming
    /// the file that could not be written on that rank, `PeerFailed` naming the rank on the
    /// others; the index is not replaced, so the directory's previous checkpoint stays the
    /// one that loads. A failed save is reported once: the checkpointer is idle after.
    pub fn wait(&mut self) -> Result<Option<PathBuf>> {
        let Some(s) = self.in_flight.take() else {
            return Ok(None);
        };
        let dir = s.commit.dir.clone();
        let written = match s.writer.join() {
            Ok((written, buffers)) => {
                self.pool = buffers;
                written
            }
            Err(_) => lost_writer(&dir),
        };
        s.commit.commit(&s.group, written)?;
        Ok(Some(dir))
    }
}

impl Drop for AsyncCheckpointer {
    fn drop(&mut self) {
        if let Some(s) = self.in_flight.take() {
            let _ = s.writer.join();
        }
    }
}
