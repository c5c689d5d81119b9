//! The data movement of each collective of the `tcp` backend (table in [`super`]), typed by
//! element. Reductions run the `threads` backend's kernel over this rank's own values and
//! the peers' received ones, in rank order, so that results are the same bit for bit.

use super::{Call, TcpGroup};
use crate::distributed::desc::{Arg, Desc};
use crate::distributed::threads::kernels;
use crate::distributed::ReduceOp;
use crate::error::Result;
use crate::tensor::{Element, Tensor};

use crate::distributed::threads::is_chunk_of;

fn bytes<T: Element>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// The elements of a received payload (8-byte aligned, length checked by `Call::recv`).
fn elems<T: Element>(p: &super::wire::Payload) -> &[T] {
    bytemuck::try_cast_slice(p.bytes()).unwrap_or_default()
}

/// Sources of a reduction in rank order: this rank's own `mine`, the peers' payloads.
fn sources<T: Element>(
    call: &Call<'_>,
    mine: *const T,
    got: &[super::wire::Payload],
) -> Vec<*const T> {
    let me = call.mesh.rank;
    let mut it = got.iter();
    (0..call.mesh.size())
        .map(|s| {
            if s == me {
                mine
            } else {
                it.next()
                    .map_or(std::ptr::null(), |p| elems::<T>(p).as_ptr())
            }
        })
        .collect()
}

impl TcpGroup {
    pub(super) fn all_gather_typed<T: Element>(
        &self,
        output: &Tensor,
        input: &Tensor,
    ) -> Result<()> {
        let (rank, n) = (self.mesh.rank, input.numel());
        let size = std::mem::size_of::<T>();
        let in_place = is_chunk_of(input, output, rank * n);
        let input = crate::distributed::threads::unaliased(input, output, in_place)?;
        let input: &Tensor = &input;
        let desc = Desc {
            op: "all_gather_into_tensor",
            dtype: T::DTYPE,
            in_numel: n,
            out_numel: output.numel(),
            arg: Arg::None,
            cuda: false,
            tag: None,
        };
        self.run(desc, |call| {
            let peers = call.peers();
            let mut out = output.data_mut::<T>()?;
            if !in_place {
                out[rank * n..(rank + 1) * n].copy_from_slice(&input.data::<T>()?);
            }
            for &p in &peers {
                call.send(p, bytes(&out[rank * n..(rank + 1) * n]))?;
            }
            let got = call.recv(&peers, |_| n * size)?;
            for (&p, payload) in peers.iter().zip(&got) {
                out[p * n..(p + 1) * n].copy_from_slice(elems::<T>(payload));
            }
            Ok(())
        })
    }

    pub(super) fn reduce_scatter_typed<T: Element>(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let (rank, m) = (self.mesh.rank, output.numel());
        let size = std::mem::size_of::<T>();
        let in_place = is_chunk_of(output, input, rank * m);
        let input = crate::distributed::threads::unaliased(input, output, in_place)?;
        let input: &Tensor = &input;
        let desc = Desc {
            op: "reduce_scatter_tensor",
            dtype: T::DTYPE,
            in_numel: input.numel(),
            out_numel: m,
            arg: Arg::Op(op),
            cuda: false,
            tag: None,
        };
        self.run(desc, |call| {
            let peers = call.peers();
            let w = call.mesh.size();
            // In place, one write lock covers input and output.
            let mut guards = crate::distributed::threads::kernels::InOutGuards::<T>::lock(
                input, output, in_place,
            )?;
            let (in_ptr, out_ptr) = guards.ptrs(rank * m);
            for &p in &peers {
                // SAFETY: the input holds `w * m` elements (checked by the caller), locked
                // above; chunk `p < w` is in bounds and nothing writes it during the send.
                let chunk = unsafe { std::slice::from_raw_parts(in_ptr.add(p * m), m) };
                call.send(p, bytes(chunk))?;
            }
            let got = call.recv(&peers, |_| m * size)?;
            let srcs = sources(call, in_ptr.wrapping_add(rank * m), &got);
            // SAFETY: every source holds `m` elements (this rank's chunk of its input, or a
            // received payload of exactly `m` elements); `out_ptr` holds `m` elements and is
            // either separate memory or exactly this rank's chunk of the input (read before
            // written, chunk by chunk).
            unsafe { kernels::reduce::<T, _, _>(op, w, m, |s| srcs[s], 1, |_| out_ptr, false) };
            Ok(())
        })
    }

    pub(super) fn all_reduce_typed<T: Element>(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let len = tensor.numel();
        let size = std::mem::size_of::<T>();
        let desc = Desc {
            op: "all_reduce",
            dtype: T::DTYPE,
            in_numel: len,
            out_numel: len,
            arg: Arg::Op(op),
            cuda: false,
            tag: None,
        };
        self.run(desc, |call| {
            let (rank, w) = (call.mesh.rank, call.mesh.size());
            let peers = call.peers();
            // The threads backend's split: rank `s` reduces elements `range(s)` for all.
            let align = (64 / size).max(1);
            let range = |s: usize| kernels::split(len, w, s, align);
            let mut t = tensor.data_mut::<T>()?;
            for &p in &peers {
                let (lo, hi) = range(p);
                call.send(p, bytes(&t[lo..hi]))?;
            }
            let (lo, hi) = range(rank);
            let got = call.recv(&peers, |_| (hi - lo) * size)?;
            let base = t.as_mut_ptr().wrapping_add(lo);
            let srcs = sources(call, base, &got);
            // SAFETY: every source holds `hi - lo` elements (this rank's range of its own
            // tensor, or a payload of exactly that many); the destination is exactly this
            // rank's own source (read before written, chunk by chunk).
            unsafe { kernels::reduce::<T, _, _>(op, w, hi - lo, |s| srcs[s], 1, |_| base, false) };
            for &p in &peers {
                call.send(p, bytes(&t[lo..hi]))?;
            }
            let got = call.recv(&peers, |p| {
                let (a, b) = range(p);
                (b - a) * size
            })?;
            for (&p, payload) in peers.iter().zip(&got) {
                let (a, b) = range(p);
                t[a..b].copy_from_slice(elems::<T>(payload));
            }
            Ok(())
        })
    }

    pub(super) fn broadcast_typed<T: Element>(&self, tensor: &Tensor, src: usize) -> Result<()> {
        let len = tensor.numel();
        let desc = Desc {
            op: "broadcast",
            dtype: T::DTYPE,
            in_numel: len,
            out_numel: len,
            arg: Arg::Src(src),
            cuda: false,
            tag: None,
        };
        self.run(desc, |call| {
            if call.mesh.rank == src {
                let t = tensor.data::<T>()?;
                for p in call.peers() {
                    call.send(p, bytes(&t))?;
                }
            } else {
                let got = call.recv(&[src], |_| len * std::mem::size_of::<T>())?;
                let mut t = tensor.data_mut::<T>()?;
                if let Some(p) = got.first() {
                    t.copy_from_slice(elems::<T>(p));
                }
            }
            Ok(())
        })
    }
}
