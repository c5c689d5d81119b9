//! `DistributedSampler` (`torch/utils/data/distributed.py`): each rank's share of a
//! dataset's indices for an epoch, the same number on every rank.
//!
//! With `shuffle`, the order is `torch.randperm(len, generator=g)` with
//! `g.manual_seed(seed + epoch)` — PyTorch's own permutation, bit for bit
//! ([`TorchGenerator::randperm`]); then, as PyTorch, the list is padded by repeating its
//! head up to a multiple of the world size (or cut down to one with `drop_last`), and rank
//! `r` takes elements `r, r + W, r + 2W, ...`.

use crate::error::{Error, Result};
use crate::nn::TorchGenerator;

/// Splits the indices `0..len` of a dataset between `num_replicas` ranks, as
/// `torch.utils.data.distributed.DistributedSampler`.
///
/// ```
/// use fsdp::train::DistributedSampler;
/// // 10 samples over 4 ranks, no shuffle: padded to 12 by repeating the first two.
/// let mut s = DistributedSampler::new(10, 4, 1, false, 0, false).unwrap();
/// assert_eq!(s.indices(), vec![1, 5, 9]);
/// assert_eq!(s.len(), 3);
/// // drop_last: cut to 8, two each.
/// let s = DistributedSampler::new(10, 4, 3, false, 0, true).unwrap();
/// assert_eq!(s.indices(), vec![3, 7]);
/// // shuffled: torch.randperm(10, generator=torch.Generator().manual_seed(0 + epoch)).
/// let mut s = DistributedSampler::new(10, 2, 0, true, 0, false).unwrap();
/// s.set_epoch(1);
/// assert_eq!(s.indices().len(), 5);
/// ```
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    /// Samples in the dataset (`len(dataset)`).
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    num_samples: usize,
}

impl DistributedSampler {
    /// A sampler over `len` samples for rank `rank` of `num_replicas`; `shuffle` reorders
    /// each epoch from `seed + epoch`; `drop_last` drops the tail that does not divide
    /// evenly instead of padding.
    ///
    /// # Errors
    /// `InvalidArgument` for `num_replicas` 0 or `rank >= num_replicas` (PyTorch's
    /// `ValueError`).
    pub fn new(
        len: usize,
        num_replicas: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
        drop_last: bool,
    ) -> Result<Self> {
        if num_replicas == 0 {
            return Err(Error::InvalidArgument(
                "DistributedSampler: num_replicas 0; it must be at least 1 (the world size)".into(),
            ));
        }
        // The padded index list holds num_samples * num_replicas entries.
        if len
            .div_ceil(num_replicas)
            .checked_mul(num_replicas)
            .is_none()
        {
            return Err(Error::InvalidArgument(format!(
                "DistributedSampler: num_replicas {num_replicas} with {len} samples overflows the index list"
            )));
        }
        if rank >= num_replicas {
            return Err(Error::InvalidArgument(format!(
                "DistributedSampler: invalid rank {rank}, rank should be in the interval [0, {}]",
                num_replicas as i64 - 1
            )));
        }
        let num_samples = if drop_last && len % num_replicas != 0 {
            // ceil((len - W) / W), 0 when len < W.
            len.saturating_sub(num_replicas).div_ceil(num_replicas)
        } else {
            len.div_ceil(num_replicas)
        };
        Ok(DistributedSampler {
            dataset_len: len,
            num_replicas,
            rank,
            shuffle,
            seed,
            drop_last,
            epoch: 0,
            num_samples,
        })
    }

    /// Sets the epoch the next [`indices`](Self::indices) is for (`set_epoch`): with
    /// `shuffle`, each epoch has its own order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The epoch set last (0 at first).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Samples per rank per epoch (`len(sampler)`), the same on every rank.
    pub fn len(&self) -> usize {
        self.num_samples
    }

    /// True when this rank gets no sample.
    pub fn is_empty(&self) -> bool {
        self.num_samples == 0
    }

    /// Whether the tail that does not split evenly is dropped (`sampler.drop_last`) rather
    /// than padded by repeating the first indices.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// Indices over all ranks in one epoch (`sampler.total_size`): the dataset padded to,
    /// or with `drop_last` truncated to, a multiple of the number of replicas.
    pub fn total_size(&self) -> usize {
        self.num_samples * self.num_replicas
    }

    /// This rank's dataset indices for the current epoch (`list(iter(sampler))`).
    pub fn indices(&self) -> Vec<usize> {
        let all: Vec<usize> = if self.shuffle {
            TorchGenerator::manual_seed(self.seed.wrapping_add(self.epoch))
                .randperm(self.dataset_len)
        } else {
            (0..self.dataset_len).collect()
        };
        if all.is_empty() {
            return Vec::new();
        }
        // Position p of the padded (or, with drop_last, truncated) list of total_size
        // entries is all[p % len]: PyTorch pads by repeating the list from its start. Only
        // this rank's positions are built, so a world far larger than the dataset costs
        // nothing more.
        (0..self.num_samples)
            .map(|k| all[(self.rank + k * self.num_replicas) % all.len()])
            .collect()
    }
}
