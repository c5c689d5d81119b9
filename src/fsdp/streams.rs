//! A rank's FSDP streams (FSDP1's `_init_streams` in
//! `_runtime_utils.py`): besides the rank's own compute stream (its thread),
//!
//! | stream | runs | overlaps |
//! |---|---|---|
//! | `unshard` | parameter all-gathers (NoShard: the compute copy) | the compute of the unit before |
//! | `post_backward` | predivide + cast, reduce-scatter, hybrid / NoShard all-reduce, postdivide (+ D2H under offload) | the backward of the units after, and their all-gathers |
//! | `pre_unshard` | H2D copy of an offloaded shard and its cast to `param_dtype`, ahead of its gather | the gather before |
//!
//! Each is a [`CommStream`]: a thread, with its own CUDA stream on a GPU, ordered after the
//! submitting thread's work by an event (see `distributed::work`). A gather that needs a
//! pre-unshard job waits for it on the unshard stream, so the compute thread never blocks
//! on it.
//!
//! Two streams never run collectives on one communicator at once: the order in which two
//! threads enter a group would differ between ranks. So when the unshard stream gathers
//! over the shard group, the post-backward stream reduce-scatters over a second
//! communicator of the same ranks ([`crate::distributed::ProcessGroup::new_group`]: one more NCCL communicator
//! per root). PyTorch can share one communicator because a single host thread enqueues
//! both streams' collectives in program order; here each stream is its own thread. Where a
//! backend cannot create one (a subgroup passed as the world on NCCL), the reductions fall
//! back to the unshard stream, one stream in issue order.
//!
//! At world size 1 on the host there is nothing to overlap: every group has one rank, so a
//! gather is a copy and a reduction a scaled copy, which the compute thread would only
//! wait for. [`Streams::run_inline`] is then true and FSDP runs those jobs on the calling
//! thread ([`Streams::run`]): no thread hand-off, no wake-up, no boxed job or `Work`
//! allocated per unit. The jobs and their order are the same, so are the results, bit for
//! bit. On a GPU the streams stay (their order is the device's), as they do for CPU
//! offload's pre-unshard copies.

use crate::backend::Device;
use crate::distributed::{CommStream, Group, Work};
use crate::error::Result;
use crate::tensor::Tensor;
use std::time::Duration;

/// A job handed to [`Streams::run`]: queued on a stream, or already run on the caller.
pub(super) enum Pending {
    /// In flight on a stream thread.
    Queued(Work),
    /// Run on the calling thread; its result.
    Ran(Result<()>),
}

impl Pending {
    /// Waits for the job ([`Work::wait_timed`]); a job run on the caller waited for
    /// nothing.
    pub fn wait_timed(self) -> (Result<()>, Duration) {
        match self {
            Pending::Queued(w) => w.wait_timed(),
            Pending::Ran(r) => (r, Duration::ZERO),
        }
    }
}

/// The streams of one rank, shared by its units (through the scheduler).
pub(super) struct Streams {
    /// All-gathers of the parameters.
    pub unshard: CommStream,
    /// Gradient reductions; `None` when they share `unshard` (see the module docs).
    post_backward: Option<CommStream>,
    /// H2D copies and casts ahead of a gather; created for CPU offload only.
    pub pre_unshard: Option<CommStream>,
    /// The group the post-backward stream reduce-scatters over.
    pub reduce_pg: Group,
    /// Gathers and reduce-scatters run on two communicators of more than one rank.
    apart: bool,
    /// Jobs run on the calling thread (see the module docs).
    inline: bool,
}

impl Streams {
    /// The streams of world rank `rank` on `device`. `pg` is the FSDP root's group (the one
    /// `new_group` is called on), `shard_pg` the group parameters are sharded over;
    /// `sharded` says whether the unshard stream gathers over it; `offload` adds the
    /// pre-unshard stream.
    ///
    /// # Errors
    /// As [`CommStream::on_device`]; the error of creating the second communicator when the
    /// backend supports it and it fails.
    pub fn new(
        rank: usize,
        device: Device,
        pg: &Group,
        shard_pg: &Group,
        sharded: bool,
        offload: bool,
    ) -> Result<Streams> {
        let name = |s: &str| format!("fsdp-{s}-rank{rank}");
        let unshard = CommStream::on_device(&name("unshard"), device)?;
        let pre_unshard = offload
            .then(|| CommStream::on_device(&name("pre-unshard"), device))
            .transpose()?;
        // A group of one needs no second communicator: its collectives wait for no peer, and
        // each backend serializes a rank's calls on one group handle.
        let apart = sharded && shard_pg.size() > 1;
        let reduce_pg = if apart {
            second_communicator(pg, shard_pg)?
        } else {
            Some(shard_pg.clone())
        };
        let apart = apart && reduce_pg.is_some();
        // Host, no offload, and every group FSDP communicates over (the world for
        // averaging and NoShard reductions, the shard group) of one rank.
        let inline = !device.is_cuda() && !offload && pg.size() == 1 && shard_pg.size() == 1;
        let (post_backward, reduce_pg) = match reduce_pg {
            Some(g) => (
                Some(CommStream::on_device(&name("post-backward"), device)?),
                g,
            ),
            None => (None, shard_pg.clone()),
        };
        Ok(Streams {
            unshard,
            post_backward,
            pre_unshard,
            reduce_pg,
            apart,
            inline,
        })
    }

    /// Whether gradient reductions run on their own communicator of more than one rank,
    /// apart from the gathers' (sharded strategies): then two ranks can wait on different
    /// communicators for each other, which only an agreement on the unshard stream at the
    /// end of backward can see.
    pub fn reduces_apart(&self) -> bool {
        self.apart
    }

    /// Whether [`run`](Self::run) runs jobs on the calling thread (world size 1 on the host;
    /// see the module docs).
    pub fn run_inline(&self) -> bool {
        self.inline
    }

    /// Runs `job` on `stream` ([`CommStream::submit_keeping`] with `keep`), or, when
    /// [`run_inline`](Self::run_inline), on the calling thread at once.
    pub fn run(
        &self,
        stream: &CommStream,
        keep: impl FnOnce() -> Vec<Tensor>,
        job: impl FnOnce() -> Result<()> + Send + 'static,
    ) -> Pending {
        if self.inline {
            Pending::Ran(job())
        } else {
            Pending::Queued(stream.submit_keeping(keep(), job))
        }
    }

    /// The stream gradient reductions go on.
    pub fn post_backward(&self) -> &CommStream {
        self.post_backward.as_ref().unwrap_or(&self.unshard)
    }

    /// Waits until every stream is idle; returns how long the calling thread waited.
    pub fn synchronize(&self) -> Duration {
        let mut waited = Duration::ZERO;
        if let Some(s) = &self.pre_unshard {
            waited += s.synchronize();
        }
        waited += self.unshard.synchronize();
        if let Some(s) = &self.post_backward {
            waited += s.synchronize();
        }
        waited
    }
}

/// A second communicator over `g`'s ranks, made through `world` (every member of `g` calls
/// this once per root, in the same order, as `new_group` requires); `None` when the
/// backend has no `new_group` here.
fn second_communicator(world: &Group, g: &Group) -> Result<Option<Group>> {
    // `None` (not a member) can only mean `world` is not the world the ranks are numbered
    // in: no second communicator then either.
    match world.new_group(&g.ranks()) {
        Ok(dup) => Ok(dup),
        Err(crate::error::Error::Unsupported(_) | crate::error::Error::InvalidArgument(_)) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
