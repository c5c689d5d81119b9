//! The threads backend on CUDA tensors: ranks are threads of this process whose tensors live
//! on one GPU (several ranks sharing it) or on several GPUs.
//!
//! The rendezvous is the host one (`rendezvous.rs`); what changes is how data moves:
//!
//! 1. *arrive*: a rank records an event on its current stream (the caller's: the compute
//!    stream for a blocking call, FSDP's communication stream for its collectives) after the
//!    work that produced its tensors, and publishes the event with the device addresses of
//!    its tensors and their device;
//! 2. *execute*: its current stream waits on every rank's event, then moves its share of the
//!    data exactly as the host path does (same split of the work, same rank order):
//!    device-to-device copies within one GPU, peer copies (`cuMemcpyPeerAsync`) across
//!    GPUs, and the reduction kernel `reduce_ranks_{dtype}` of `collective.cu`, which
//!    widens to f64, combines in rank order and rounds once, bit for bit the host reduction
//!    (sources on another GPU are first copied to scratch on this one; an all-reduce result
//!    for a rank on another GPU is copied to it afterwards); then it records a *done* event
//!    after that work;
//! 3. *depart*: as on the host, a rank returns only once every rank queued its work; its
//!    stream then waits on every peer's done event, since peers read its input and (all-reduce)
//!    write its output on their streams.
//!
//! The host never waits for the device: a collective on CUDA tensors is ordered on the
//! caller's current stream, as NCCL's are. What the caller queues next on that stream sees
//! the output, a copy to the host synchronizes, and a tensor freed afterwards is reused
//! only behind the stream's wait (the caching allocator keys blocks by stream; other
//! streams go through `record_stream` events). A done event lives in the group state until
//! its rank's next collective, by when every peer has queued its wait on it.

use super::kernels::split;
use super::rendezvous::{Arg, Arrival, Desc, Mark, Ptr};
use super::{is_chunk_of, ThreadsGroup};
use crate::backend::cuda::collective as dc;
use crate::backend::cuda::{self, DeviceTensor, Event, Stream};
use crate::distributed::ReduceOp;
use crate::error::Result;
use crate::tensor::{DType, Tensor};
use std::sync::Arc;

/// This rank's side of one device collective: the stream that moves its data (the caller's
/// current stream on the device) and the event marking its inputs ready.
pub(super) struct Side {
    ordinal: usize,
    stream: Arc<Stream>,
    /// Lives until the collective returned, i.e. after every peer waited on it.
    ready: Event,
}

impl Side {
    fn new(ordinal: usize) -> Result<Side> {
        let stream = cuda::current_stream(ordinal)?;
        let ready = stream.record()?;
        Ok(Side {
            ordinal,
            stream,
            ready,
        })
    }

    fn arrival(&self, desc: Desc, input: u64, output: u64) -> Arrival {
        Arrival {
            desc,
            input: Ptr::from_addr(input),
            output: Ptr::from_addr(output),
            ordinal: self.ordinal,
            event: Ptr::of(dc::event_ptr(&self.ready)),
        }
    }

    /// Makes the stream wait for every rank's inputs, queues `body`, and returns the mark
    /// of that work for the peers (also after an error of `body`: what it queued may still
    /// touch peers' memory, so they wait for it; the error is reported all the same).
    fn exec(&self, peers: &[Arrival], body: impl FnOnce() -> Result<()>) -> Result<Option<Mark>> {
        let r = peers
            .iter()
            // SAFETY: every peer's event lives until all ranks departed (`Side::ready`).
            .try_for_each(|p| unsafe { dc::wait_event_ptr(&self.stream, p.event.cast::<u8>()) })
            .and_then(|()| body());
        let done = self.stream.record()?;
        let mark = Mark {
            event: Ptr::of(dc::event_ptr(&done)),
            _owner: Box::new(done),
        };
        r.map(|()| Some(mark))
    }

    /// Makes the stream wait for a peer's mark (its done event).
    pub(super) fn wait_peer(&self, event: Ptr) -> Result<()> {
        // SAFETY: the peer's mark stays in the group state until its next departure, which
        // comes after this rank's next arrival (see the module docs).
        unsafe { dc::wait_event_ptr(&self.stream, event.cast::<u8>()) }
    }

    /// Queues a copy of `bytes` bytes from `src` on `cuda:src_ordinal` to `dst` here.
    ///
    /// # Safety
    /// As [`dc::copy_bytes`].
    unsafe fn copy_in(&self, dst: u64, src: u64, src_ordinal: usize, bytes: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { dc::copy_bytes(&self.stream, dst, self.ordinal, src, src_ordinal, bytes) }
    }
}

fn desc(op: &'static str, dtype: DType, in_numel: usize, out_numel: usize, arg: Arg) -> Desc {
    Desc {
        op,
        dtype,
        in_numel,
        out_numel,
        arg,
        cuda: true,
        tag: None,
    }
}

/// `input`, or a copy of it on the current stream when it overlaps `output` other than as
/// this rank's chunk (peers must not read what this rank is writing).
fn separate(input: &Tensor, output: &Tensor, in_place: bool) -> Result<Tensor> {
    if input.shares_storage(output) && !in_place {
        input.deep_clone()
    } else {
        Ok(input.clone())
    }
}

/// Sources for a reduction of `n` elements: the address of every rank's source (`src_of`
/// of its arrival) if it is on this GPU, else of a copy of it in `scratch` (one slot of
/// `n` elements per remote rank, in rank order). Queues those copies.
fn local_sources(
    side: &Side,
    peers: &[Arrival],
    n: usize,
    esz: usize,
    scratch: Option<&DeviceTensor>,
    src_of: impl Fn(&Arrival) -> u64,
) -> Result<Vec<u64>> {
    let mut srcs = Vec::with_capacity(peers.len());
    let mut slot = 0;
    for p in peers {
        let src = src_of(p);
        match scratch {
            Some(sc) if p.ordinal != side.ordinal => {
                let dst = sc.ptr() + (slot * n * esz) as u64;
                slot += 1;
                // SAFETY: the peer's source holds `n` elements (descriptors agree) and stays
                // allocated until all departed; the scratch slot holds `n` elements.
                unsafe { side.copy_in(dst, src, p.ordinal, n * esz)? };
                srcs.push(dst);
            }
            _ => srcs.push(src),
        }
    }
    Ok(srcs)
}

impl ThreadsGroup {
    /// [`ProcessGroup::all_gather_into_tensor`](crate::distributed::ProcessGroup) on
    /// `cuda:ordinal`: every rank copies each rank's input into chunk `s` of its output
    /// (skipping its own chunk when in place).
    pub(super) fn all_gather_cuda(
        &self,
        output: &Tensor,
        input: &Tensor,
        ordinal: usize,
    ) -> Result<()> {
        let (rank, n, dtype) = (self.rank, input.numel(), input.dtype());
        let esz = dtype.size_in_bytes();
        let in_place = is_chunk_of(input, output, rank * n);
        let input = separate(input, output, in_place)?;
        let (out, inp) = (output.as_device_tensor()?, input.as_device_tensor()?);
        let side = Side::new(ordinal)?;
        let d = desc(
            "all_gather_into_tensor",
            dtype,
            n,
            output.numel(),
            Arg::None,
        );
        let out_ptr = out.ptr();
        self.run_ordered(&side, side.arrival(d, inp.ptr(), out_ptr), |peers| {
            side.exec(peers, || {
                for (s, p) in peers.iter().enumerate() {
                    let dst = out_ptr + (s * n * esz) as u64;
                    if p.ordinal == ordinal && p.input.addr() == dst {
                        continue; // this rank's own chunk, already in place
                    }
                    // SAFETY: the descriptors agree, so the peer's input holds `n` elements
                    // (alive until all departed) and chunk `s` of `out` holds `n`; a peer's
                    // input overlaps this output only as this rank's chunk (skipped).
                    unsafe { side.copy_in(dst, p.input.addr(), p.ordinal, n * esz)? };
                }
                Ok(())
            })
        })
    }

    /// [`ProcessGroup::reduce_scatter_tensor`](crate::distributed::ProcessGroup) on
    /// `cuda:ordinal`: this rank reduces chunk `rank` of every rank's input into its output.
    pub(super) fn reduce_scatter_cuda(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        ordinal: usize,
    ) -> Result<()> {
        let (rank, m, dtype) = (self.rank, output.numel(), output.dtype());
        let esz = dtype.size_in_bytes();
        let in_place = is_chunk_of(output, input, rank * m);
        let input = separate(input, output, in_place)?;
        let (out, inp) = (output.as_device_tensor()?, input.as_device_tensor()?);
        let side = Side::new(ordinal)?;
        let d = desc(
            "reduce_scatter_tensor",
            dtype,
            input.numel(),
            m,
            Arg::Op(op),
        );
        self.run_ordered(&side, side.arrival(d, inp.ptr(), out.ptr()), |peers| {
            side.exec(peers, || {
                let remote = peers.iter().filter(|p| p.ordinal != ordinal).count();
                let scratch = if remote > 0 && m > 0 {
                    Some(DeviceTensor::empty(&side.stream, &[remote * m], dtype)?)
                } else {
                    None
                };
                let srcs = local_sources(&side, peers, m, esz, scratch.as_ref(), |p| {
                    p.input.addr() + (rank * m * esz) as u64
                })?;
                // SAFETY: every source is chunk `rank` (m elements) of a rank's input on
                // this GPU, alive until all departed, or a scratch copy of it; only this rank
                // reads chunk `rank`; the output is separate memory or exactly this rank's
                // source chunk (read before written, per element).
                unsafe { dc::reduce_ranks(&side.stream, dtype, &srcs, &[out.ptr()], m, op) }
            })
        })
    }

    /// [`ProcessGroup::all_reduce`](crate::distributed::ProcessGroup) on `cuda:ordinal`:
    /// as on the host, rank `r` reduces its `1/w` of the elements and writes the result
    /// into that range of every rank's tensor.
    pub(super) fn all_reduce_cuda(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
        ordinal: usize,
    ) -> Result<()> {
        let (rank, len, dtype) = (self.rank, tensor.numel(), tensor.dtype());
        let esz = dtype.size_in_bytes();
        let t = tensor.as_device_tensor()?;
        let side = Side::new(ordinal)?;
        let d = desc("all_reduce", dtype, len, len, Arg::Op(op));
        self.run_ordered(&side, side.arrival(d, t.ptr(), t.ptr()), |peers| {
            side.exec(peers, || {
                let (lo, hi) = split(len, peers.len(), rank, (64 / esz).max(1));
                let (cnt, off) = (hi - lo, (lo * esz) as u64);
                if cnt == 0 {
                    return Ok(());
                }
                let remote = peers.iter().filter(|p| p.ordinal != ordinal).count();
                // One slot per remote rank's range, then one for the result they get.
                let scratch = if remote > 0 {
                    Some(DeviceTensor::empty(
                        &side.stream,
                        &[(remote + 1) * cnt],
                        dtype,
                    )?)
                } else {
                    None
                };
                let srcs = local_sources(&side, peers, cnt, esz, scratch.as_ref(), |p| {
                    p.input.addr() + off
                })?;
                let mut dsts: Vec<u64> = peers
                    .iter()
                    .filter(|p| p.ordinal == ordinal)
                    .map(|p| p.output.addr() + off)
                    .collect();
                let result = scratch
                    .as_ref()
                    .map(|sc| sc.ptr() + (remote * cnt * esz) as u64);
                dsts.extend(result);
                // SAFETY: every rank's tensor holds `len` elements (descriptors agree), alive
                // until all departed; ranks reduce disjoint ranges `lo..hi`, so each range is
                // read and written by this rank only; a destination is either exactly its
                // rank's source range (read before written, per element) or scratch.
                unsafe { dc::reduce_ranks(&side.stream, dtype, &srcs, &dsts, cnt, op)? };
                if let Some(result) = result {
                    for p in peers.iter().filter(|p| p.ordinal != ordinal) {
                        // SAFETY: as above; the copy to the remote rank's range is queued
                        // after the kernel on this stream.
                        unsafe {
                            dc::copy_bytes(
                                &side.stream,
                                p.output.addr() + off,
                                p.ordinal,
                                result,
                                ordinal,
                                cnt * esz,
                            )?
                        };
                    }
                }
                Ok(())
            })
        })
    }

    /// [`ProcessGroup::broadcast`](crate::distributed::ProcessGroup) on `cuda:ordinal`:
    /// every rank but `src` copies `src`'s tensor into its own.
    pub(super) fn broadcast_cuda(&self, tensor: &Tensor, src: usize, ordinal: usize) -> Result<()> {
        let (rank, len, dtype) = (self.rank, tensor.numel(), tensor.dtype());
        let t = tensor.as_device_tensor()?;
        let side = Side::new(ordinal)?;
        let d = desc("broadcast", dtype, len, len, Arg::Src(src));
        self.run_ordered(&side, side.arrival(d, t.ptr(), t.ptr()), |peers| {
            side.exec(peers, || {
                if rank == src {
                    return Ok(());
                }
                let from = &peers[src];
                // SAFETY: the descriptors agree, so the source's tensor and this rank's
                // (distinct: each rank passes its own) hold `len` elements each, alive until
                // all departed; only this rank writes its tensor.
                unsafe {
                    side.copy_in(
                        t.ptr(),
                        from.input.addr(),
                        from.ordinal,
                        len * dtype.size_in_bytes(),
                    )
                }
            })
        })
    }
}
