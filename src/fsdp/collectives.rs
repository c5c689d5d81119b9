//! A unit's two collective mechanisms: the all-gather that unshards its FlatParameter
//! (on the unshard stream, after the pre-unshard stream's host-to-device copy under CPU
//! offload) and the reduction of its flat gradient (on the post-backward stream): FSDP1's
//! `_unshard` / `_reduce_grad` in `_runtime_utils.py`, FSDP2's `_fsdp_collectives.py`.
//! Both take their output from the rank's [`BufferPool`](super::BufferPool) on the compute
//! thread and hand the stream job everything it reads, so the job never touches the unit;
//! the buffers travel with the job's `Work`, and go back to the pool behind their last use
//! (see [Note: free after event] in `buffers.rs`): from step 2 on no FSDP buffer is
//! allocated. Scratch buffers a job makes on its own stream are freed there and reused by
//! the caching allocator in stream order.

use super::mixed_precision::round_;
use super::progress;
use super::scheduler::Scheduler;
use super::streams::Pending;
use super::unit::gradient_divide_factors;
use super::FullyShardedDataParallel;
use crate::backend::Device;
use crate::distributed::{Group, ReduceOp};
use crate::error::Result;
use crate::ops::flat;
use crate::tensor::{DType, Tensor};

/// An all-gather in flight (or done): its handle and the buffer it fills.
pub(super) struct Gather {
    pub work: Pending,
    /// `(c W)` values: f32 (f64 for an f64 FlatParameter), or a `param_dtype` tensor
    /// under low-precision mixed precision (the parameters' views of it are then bf16/f16
    /// tensors, as FSDP1's unsharded flat parameter is).
    pub full: Tensor,
}

impl Scheduler {
    /// Issues the all-gather of unit `id` on the stream: the shard cast to `param_dtype`
    /// (FSDP1 `_use_low_precision_shard`), gathered straight into the `param_dtype` full
    /// buffer `full` (under `NoShard`, only the cast copy). `full` is allocated on the
    /// compute device by the calling (compute) thread; the stream's scratch buffers are its
    /// own. `full` (and the device copy of an offloaded shard) come from the rank's buffer
    /// pool.
    ///
    /// # Errors
    /// [`Error::Cuda`](crate::Error::Cuda) when the buffer cannot be allocated.
    pub fn issue_gather(&mut self, id: usize) -> Result<Gather> {
        // The gather's collectives name the unit and the pass it is for.
        let _tag = progress::enter(self.progress.gather(id));
        let device = self.device;
        let (padded, shard_dtype) = (self.units[id].padded, self.units[id].shard.dtype());
        // An f64 FlatParameter gathers in f64 (mixed precision is refused for it).
        let dtype = match shard_dtype {
            DType::F64 => DType::F64,
            _ => self.mp.compute_dtype(),
        };
        // Not zeroed: the gather (or NoShard's copy) writes all `padded` elements.
        let full = self.take_buffer(padded, dtype, device, false)?;
        let numel = self.units[id].shard.numel();
        let on_device = match self.streams.pre_unshard {
            Some(_) => Some(self.take_buffer(numel, dtype, device, false)?),
            None => None,
        };
        // A pinned shard goes to the device as it is, asynchronously, and is cast to
        // param_dtype there (a pageable one is cast on the host, then staged).
        let widened =
            if on_device.is_some() && dtype != shard_dtype && self.units[id].shard.is_pinned() {
                Some(self.take_buffer(numel, shard_dtype, device, false)?)
            } else {
                None
            };
        let u = &self.units[id];
        self.mem.lock().on_unshard(full.nbytes());
        self.stats.all_gathers += 1;
        let (sharded, unshard) = (self.sharded, &self.streams.unshard);
        let work = if let (Some(pre), Some(on_device)) = (&self.streams.pre_unshard, on_device) {
            // CpuOffload: the host-to-device copy (and cast to param_dtype) on the
            // pre-unshard stream, then the gather from it on the unshard stream, which
            // waits for the copy: the compute thread does not.
            let h2d = {
                let (shard, dst, wide) = (u.shard.clone(), on_device.clone(), widened.clone());
                let mut keep = vec![u.shard.clone(), on_device.clone()];
                keep.extend(widened.clone());
                pre.submit_keeping(keep, move || match &wide {
                    // FSDP1 `_use_low_precision_shard`: the cast on the pre-unshard stream.
                    Some(w) => {
                        w.copy_from_non_blocking(&shard)?;
                        dst.copy_from(w)
                    }
                    None => dst.copy_from_non_blocking(&shard),
                })
            };
            if let Some(w) = widened {
                // Read by the cast on the pre-unshard stream only.
                self.buffers.give_after(w, pre);
            }
            let (pg, out) = (self.shard_pg.clone(), full.clone());
            let keep = vec![full.clone(), on_device.clone()];
            let staged = on_device.clone();
            let work = unshard.submit_keeping(keep, move || {
                h2d.wait()?;
                if sharded {
                    pg.all_gather_into_tensor(&out, &on_device)
                } else {
                    out.copy_from(&on_device)
                }
            });
            // The staging buffer is free once the gather that reads it has run.
            self.buffers.give_after(staged, unshard);
            Pending::Queued(work)
        } else if self.streams.run_inline() {
            // World size 1 on the host (`streams.rs`): the job's work, on this thread.
            Pending::Ran(gather(&self.shard_pg, sharded, dtype, &full, &u.shard))
        } else {
            let (pg, shard, out) = (self.shard_pg.clone(), u.shard.clone(), full.clone());
            let keep = vec![full.clone(), u.shard.clone()];
            Pending::Queued(
                unshard.submit_keeping(keep, move || gather(&pg, sharded, dtype, &out, &shard)),
            )
        };
        Ok(Gather { work, full })
    }
}

/// Fills `out` (`(c W)` of `dtype`) from this rank's `shard` (f32, or f64): all-gathered
/// over `pg` when `sharded`, the shard cast to `dtype` first (FSDP1
/// `_use_low_precision_shard`: the gather is in low precision); under `NoShard` the
/// "shard" is the whole flat parameter and this is the compute copy.
fn gather(pg: &Group, sharded: bool, dtype: DType, out: &Tensor, shard: &Tensor) -> Result<()> {
    if !sharded {
        out.copy_from(shard)
    } else if dtype == shard.dtype() {
        pg.all_gather_into_tensor(out, shard)
    } else {
        pg.all_gather_into_tensor(out, &shard.to_dtype(dtype)?)
    }
}

/// A gradient reduction in flight (`work` set) or waited for and still to be added into
/// the sharded gradient (`work` taken): the f32 shard it fills (complete once the handle
/// is; on the host under CPU offload, once the host synchronized with the device).
pub(super) struct PendingGrad {
    work: Option<Pending>,
    out: Tensor,
}

impl FullyShardedDataParallel {
    /// Issues the reduction of the flat gradient on the stream: predivide, reduce-scatter
    /// over the shard group (then all-reduce over the replicate group under hybrid
    /// sharding; all-reduce over the world under NoShard, reduce-scatter over the world
    /// into the optimizer's chunk under NoShard with ZeRO-1), postdivide, all in
    /// `reduce_dtype`. FSDP1 `_post_backward_hook` / `_reduce_grad`. The f32 shard it
    /// produces is taken from the rank's buffer pool here, on the compute thread (on the
    /// host under CPU offload: the device-to-host copy ends the job), so its memory
    /// belongs to the compute stream; `flat_grad` goes back to the pool behind the job.
    pub(super) fn issue_reduce(&mut self, flat_grad: Tensor) -> Result<()> {
        // A unit that ran backward twice in one pass: fold the first result in first.
        self.finish_reduce()?;
        let mp = self.rs.mp;
        // The gradient of low-precision compute is a param_dtype tensor; the master shard's
        // gradient has the FlatParameter's dtype (f32, or f64 for an f64 FlatParameter,
        // which reduces in f64).
        let gd = self.flat.dtype();
        let rd = if gd == DType::F64 {
            gd
        } else {
            mp.reduce_dtype()
        };
        // Averaging is over the whole data-parallel world, hybrid or not.
        let (pre, post) = gradient_divide_factors(self.rs.pg.size());
        // The gradient shard: this rank's parameter chunk, or under ZeRO-1 (a whole flat
        // parameter whose optimizer state is partitioned) its optimizer chunk.
        let shard_numel = self.flat.optim_shard_numel();
        let scatter = self.grads_scattered();
        // The reduce-scatter's communicator: not the one the unshard stream gathers on.
        let (shard_pg, offload) = {
            let s = self.rs.sched.lock();
            (s.streams.reduce_pg.clone(), s.offload())
        };
        let (pg, rep) = (self.rs.pg.clone(), self.rs.replicate_pg.clone());
        let keep_lp = mp.keep_low_precision_grads.then(|| mp.compute_dtype());
        let device = self.rs.device;
        // Not zeroed: the job writes all `shard_numel` elements.
        let out = self.rs.sched.lock().take_buffer(
            shard_numel,
            gd,
            if offload { Device::Cpu } else { device },
            false,
        )?;
        let dst = out.clone();
        let released = flat_grad.clone();
        let keep = || vec![released.clone(), out.clone()];
        let job = move || -> Result<()> {
            // Predivide fused with the cast from the gradient's dtype to reduce_dtype (in
            // place when they are one dtype).
            let input = if rd == flat_grad.dtype() && matches!(rd, DType::F32 | DType::F64) {
                flat_grad.clone()
            } else {
                Tensor::zeros_on(flat_grad.shape(), rd, device)?
            };
            flat::pack_grad(&flat_grad, &input, 1.0 / pre)?;
            let reduced = if scatter {
                // The flat gradient is `shard_numel` times the group's size long (padded).
                // Straight into the shard when it is on this device in reduce_dtype: the
                // postdivide is then in place (none when `post` is 1).
                let out = if rd == gd && dst.device() == device {
                    dst.clone()
                } else {
                    Tensor::zeros_on(&[shard_numel], rd, device)?
                };
                shard_pg.reduce_scatter_tensor(&out, &input, ReduceOp::Sum)?;
                if let Some(rep) = &rep {
                    rep.all_reduce(&out, ReduceOp::Sum)?;
                }
                out
            } else {
                pg.all_reduce(&input, ReduceOp::Sum)?;
                input
            };
            // The postdivide happens in reduce_dtype, then the result is upcast (FSDP1):
            // straight into the shard, or (offload) into a device buffer copied to it.
            let shard = if dst.device() == device {
                dst.clone()
            } else if rd == gd {
                reduced.clone()
            } else {
                Tensor::zeros_on(&[shard_numel], gd, device)?
            };
            flat::unpack_grad(&reduced, &shard, 1.0 / post)?;
            if let Some(d) = keep_lp {
                round_(&shard, d)?;
            }
            // CpuOffload: the device-to-host copy of the gradient shard, queued on this
            // stream without a host wait when the shard is pinned; the host reads it after
            // the end of backward's synchronization (`runtime.rs`).
            if !shard.same_view(&dst) {
                dst.copy_from_non_blocking(&shard)?;
            }
            Ok(())
        };
        let work = {
            let mut s = self.rs.sched.lock();
            // The reduction's collectives name the unit and the forward calls it covers.
            let _tag = super::progress::enter(s.progress.reduce(self.id));
            s.progress.reduced();
            s.stats.reductions += 1;
            let work = s.streams.run(s.streams.post_backward(), keep, job);
            // The flat gradient is free for another unit's backward once the job ran.
            let s = &mut *s;
            if s.streams.run_inline() {
                // The job ran on this thread: nothing else uses the gradient any more.
                s.buffers.give(released);
            } else {
                s.buffers.give_after(released, s.streams.post_backward());
            }
            work
        };
        self.pending_grad = Some(PendingGrad {
            work: Some(work),
            out,
        });
        Ok(())
    }

    /// Waits for this unit's reduction in flight, if any, and accumulates its shard into
    /// the sharded gradient (under CPU offload on a GPU, after the host synchronized with
    /// the device when there is one to add to).
    pub(super) fn finish_reduce(&mut self) -> Result<()> {
        self.wait_reduce()?;
        if self.pending_grad.is_some() {
            self.sync_offloaded_grads()?;
        }
        self.accumulate_reduced()
    }

    /// Waits for this unit's reduction in flight, if any (the compute stream waits for it
    /// on the device). Its shard becomes the sharded gradient when there is none yet;
    /// otherwise it stays pending for [`accumulate_reduced`](Self::accumulate_reduced),
    /// which reads it: under CPU offload on a GPU, only once the host synchronized.
    pub(super) fn wait_reduce(&mut self) -> Result<()> {
        let Some(p) = self.pending_grad.as_mut() else {
            return Ok(());
        };
        if let Some(work) = p.work.take() {
            let (r, dt) = work.wait_timed();
            self.rs.sched.lock().add_wait(dt);
            if let Err(e) = r {
                self.pending_grad = None;
                return Err(e);
            }
        }
        if self.flat.grad_shard.is_none() {
            if let Some(p) = self.pending_grad.take() {
                self.rs.mem.lock().grad_shard_bytes += p.out.nbytes();
                self.flat.grad_shard = Some(p.out);
            }
        }
        Ok(())
    }

    /// Adds the shard [`wait_reduce`](Self::wait_reduce) left pending into the sharded
    /// gradient, and returns the shard's buffer to the pool.
    pub(super) fn accumulate_reduced(&mut self) -> Result<()> {
        let Some(p) = self.pending_grad.take() else {
            return Ok(());
        };
        if let Some(work) = p.work {
            // Callers wait first; a handle still here is waited for now.
            let (r, dt) = work.wait_timed();
            self.rs.sched.lock().add_wait(dt);
            r?;
        }
        let shard = p.out;
        match &self.flat.grad_shard {
            Some(acc) => {
                crate::ops::add_(acc, &shard)?;
                // Read on the compute stream (or by the host after it synchronized): free now.
                self.rs.sched.lock().buffers.give(shard);
            }
            None => {
                self.rs.mem.lock().grad_shard_bytes += shard.nbytes();
                self.flat.grad_shard = Some(shard);
            }
        }
        Ok(())
    }
}
