//! FSDP's own buffers, kept from one step to the next: the unsharded parameter buffers
//! (all-gather outputs), the flat gradients the backward fills, the reduced gradient
//! shards, CPU offload's device staging buffers and the end-of-backward agreement's one
//! element. A training step needs the same buffers every step, so once the first step has
//! made them no later step asks the caching allocator, let alone the driver, for one
//! (YaFSDP's persistent buffers; FSDP2 leaves this to the caching allocator instead).
//!
//! A [`BufferPool`] keeps returned buffers by (length, dtype, device). It is shared across
//! units: ten transformer blocks of one size use as many unsharded buffers as are alive at
//! once (two or three under `limit_all_gathers`), not ten.
//!
//! [Note: free after event] A buffer handed to a stream job is reused only behind that
//! job, on the device. Buffers come back two ways:
//! - [`give`](BufferPool::give): every use of the buffer is already ordered before the
//!   compute stream's current position (the compute thread waited for the jobs that used
//!   it, as it waits for a gather before reading the parameters, or for a reduction
//!   before reading its shard). The compute thread reuses it at once: what it queues on
//!   its stream comes later, and a job it submits afterwards waits for the compute
//!   stream's work before it runs (`distributed::work`);
//! - [`give_after`](BufferPool::give_after): a stream job still uses the buffer (the
//!   post-backward stream reduces a flat gradient the compute stream no longer needs). A
//!   no-op job queued behind it on the same stream marks the end of that use; whoever
//!   takes the buffer waits for that job first ([`Work::wait`]: the host only until the
//!   job is queued, the device until it ran, with `cuStreamWaitEvent`).
//!
//! Such a buffer is taken only once `in_flight` younger ones of its size are also out on
//! streams (one for FSDP: double buffering, so the reduction of one unit overlaps the
//! backward of the next, and the third unit's backward waits for the first's reduction).
//! A buffer is reused only when nothing else holds its storage any more; one still
//! shared is left to the allocator.
//!
//! New buffers take new device blocks (`backend::cuda::with_fresh_blocks`), not blocks
//! cached for the step's short-lived tensors.
//!
//! Under CPU offload on a GPU ([`pin_host`](BufferPool::pin_host)) the host buffers (the
//! offloaded gradient shards) are page-locked (`cuMemHostAlloc`), so the device copies
//! into them asynchronously; kept like the others, no step after the first pins memory.
//!
//! The pool is used by the compute thread only. FSDP enables it on every device. On the
//! host the CPU tensor pool (`tensor::pool`) would reuse these buffers too, but a flat
//! gradient given back behind its reduction would then be freed by the communication
//! thread when the peer rank's half arrives, a moment set by the schedule, and the tensor
//! pool's bound would move with it ([Note: pool bound] in `tensor::pool`); kept here, the
//! number of buffers follows the rank's program alone. At world size 1 on the host the
//! reduction runs on the compute thread (`streams.rs`) and its gradient is given back at
//! once. With `enabled` false it allocates every time and keeps nothing: on the host when
//! the tensor pool keeps nothing either (`tensor::pool::set_pool_limit(0)`).

use crate::backend::Device;
use crate::distributed::{CommStream, Work};
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// How a returned buffer may be reused (see [Note: free after event]).
enum Free {
    /// At once, by the compute stream.
    Now,
    /// Once this job, queued behind the buffer's last use on its stream, has run.
    After(Work),
}

struct Entry {
    t: Tensor,
    free: Free,
}

/// Buffers FSDP reuses from step to step (see the module docs).
pub struct BufferPool {
    enabled: bool,
    /// Host buffers are pinned through this device's driver (CPU offload on a GPU).
    pin: Option<usize>,
    in_flight: usize,
    classes: HashMap<(usize, DType, Device), VecDeque<Entry>>,
    waited: Duration,
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("enabled", &self.enabled)
            .field("held", &self.held())
            .finish()
    }
}

impl BufferPool {
    /// A pool that keeps buffers when `enabled`; a buffer released to a stream is taken
    /// again only once `in_flight` younger ones of its size are released too (0: at once,
    /// behind its job).
    pub fn new(enabled: bool, in_flight: usize) -> BufferPool {
        BufferPool {
            enabled,
            pin: None,
            in_flight,
            classes: HashMap::new(),
            waited: Duration::ZERO,
        }
    }

    /// Makes the new host (`Device::Cpu`) buffers page-locked through `cuda:ordinal`'s
    /// driver ([`Tensor::pinned_zeros`]): CPU offload's gradient shards, which the device
    /// then fills without a host wait.
    pub fn pin_host(&mut self, ordinal: usize) {
        self.pin = Some(ordinal);
    }

    /// Buffers the pool holds now (idle, or waiting for their job).
    pub fn held(&self) -> usize {
        self.classes.values().map(VecDeque::len).sum()
    }

    /// Time the calling thread spent blocked in [`take`](Self::take) waiting for jobs to be
    /// queued since the last call (the device-side wait is not host time).
    pub fn take_waited(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }

    /// A 1-D buffer of `numel` elements of `dtype` on `device`, for the calling (compute)
    /// thread: a returned one, its contents undefined, or a new zeroed one (counted in
    /// [`fsdp_buffer_allocs`](crate::backend::counters::Counters::fsdp_buffer_allocs)).
    /// The calling thread's current stream is ordered after the returned buffer's last use.
    ///
    /// # Errors
    /// The device's allocation errors; [`Error::Cuda`](crate::Error::Cuda) when the stream
    /// wait cannot be queued.
    pub fn take(&mut self, numel: usize, dtype: DType, device: Device) -> Result<Tensor> {
        self.take_or_new(numel, dtype, device).map(|(t, _)| t)
    }

    /// [`take`](Self::take), zeroed (on the calling thread's stream).
    ///
    /// # Errors
    /// As [`take`](Self::take).
    pub fn take_zeroed(&mut self, numel: usize, dtype: DType, device: Device) -> Result<Tensor> {
        let (t, new) = self.take_or_new(numel, dtype, device)?;
        if !new {
            t.zero_()?;
        }
        Ok(t)
    }

    /// The buffer, and whether it is a new (zeroed) one.
    fn take_or_new(
        &mut self,
        numel: usize,
        dtype: DType,
        device: Device,
    ) -> Result<(Tensor, bool)> {
        if self.enabled {
            let in_flight = self.in_flight;
            if let Some(q) = self.classes.get_mut(&(numel, dtype, device)) {
                loop {
                    let now = q.iter().position(|e| matches!(e.free, Free::Now));
                    let released = q
                        .iter()
                        .filter(|e| matches!(e.free, Free::After(_)))
                        .count();
                    let pos = now.or_else(|| {
                        (released > in_flight)
                            .then(|| q.iter().position(|e| matches!(e.free, Free::After(_))))
                            .flatten()
                    });
                    let Some(e) = pos.and_then(|p| q.remove(p)) else {
                        break;
                    };
                    let ordered = match e.free {
                        Free::Now => true,
                        Free::After(w) => {
                            let (r, dt) = w.wait_timed();
                            self.waited += dt;
                            // A failed stream: its work may not have run; leave the buffer.
                            r.is_ok()
                        }
                    };
                    if ordered && e.t.is_sole_owner() {
                        return Ok((e.t, false));
                    }
                }
            }
        }
        crate::backend::counters::count_fsdp_buffer_alloc();
        if let (Device::Cpu, Some(ordinal)) = (device, self.pin) {
            return Tensor::pinned_zeros(&[numel], dtype, ordinal).map(|t| (t, true));
        }
        // Kept for the run: a new block, not one the step's own tensors will want back.
        if device.is_cuda() {
            return crate::backend::cuda::with_fresh_blocks(|| {
                Tensor::zeros_on(&[numel], dtype, device)
            })
            .map(|t| (t, true));
        }
        Tensor::zeros_on(&[numel], dtype, device).map(|t| (t, true))
    }

    /// Makes the calling (compute) thread's stream wait for every buffer still out on a
    /// stream, which are then free at once: called where the compute stream waits for
    /// those jobs anyway (the end of backward), so that the next step can take each of
    /// them without keeping one in flight.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) when a stream wait cannot be queued; a buffer
    /// whose job failed is dropped.
    pub fn settle(&mut self) -> Result<()> {
        let mut first = Ok(());
        for q in self.classes.values_mut() {
            for e in std::mem::take(q) {
                match e.free {
                    Free::Now => q.push_back(e),
                    Free::After(w) => {
                        let (r, dt) = w.wait_timed();
                        self.waited += dt;
                        match r {
                            Ok(()) => q.push_back(Entry {
                                t: e.t,
                                free: Free::Now,
                            }),
                            Err(err) => {
                                if first.is_ok() {
                                    first = Err(err);
                                }
                            }
                        }
                    }
                }
            }
        }
        first
    }

    /// Returns `t` for reuse by the compute stream at once: every use of it is already
    /// ordered before the compute stream's current position. Dropped when the pool is
    /// disabled.
    pub fn give(&mut self, t: Tensor) {
        self.push(t, Free::Now);
    }

    /// Returns `t`, which jobs queued on `stream` may still use: it is reused only behind a
    /// no-op job queued there now. Dropped when the pool is disabled.
    pub fn give_after(&mut self, t: Tensor, stream: &CommStream) {
        if self.enabled {
            let w = stream.submit(|| Ok(()));
            self.push(t, Free::After(w));
        }
    }

    fn push(&mut self, t: Tensor, free: Free) {
        if !self.enabled {
            return;
        }
        let key = (t.numel(), t.dtype(), t.device());
        self.classes
            .entry(key)
            .or_default()
            .push_back(Entry { t, free });
    }
}
