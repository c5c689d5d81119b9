//! The `threads` backend: every rank is a thread of this process and collectives run over
//! shared memory.
//!
//! A collective is a three-phase rendezvous on one mutex + condvar per group:
//! 1. *arrive*: each rank posts a descriptor (op, dtype, element counts) and handles to its
//!    tensors; the last to arrive compares the descriptors of all ranks;
//! 2. *execute*: each rank computes its own output by reading the peers' inputs directly
//!    (all-gather copies each shard once into the output; reduce-scatter reduces only its
//!    own slice);
//! 3. *depart*: a rank returns only after every rank finished reading its input, so the
//!    caller may overwrite it at once. In-place ops (all-reduce) write their result here.
//!
//! Waiting is bounded by the group timeout; a rank that fails, panics or exits without
//! joining wakes the others at once with its rank named.

use super::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::{DType, Element, Tensor};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default collective timeout, as `torch.distributed`'s default for gloo/NCCL (300 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Debug, PartialEq, Eq)]
struct Desc {
    op: &'static str,
    dtype: DType,
    in_numel: usize,
    out_numel: usize,
    arg: String,
}

impl std::fmt::Display for Desc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}({}, {} -> {} elements",
            self.op, self.dtype, self.in_numel, self.out_numel
        )?;
        if !self.arg.is_empty() {
            write!(f, ", {}", self.arg)?;
        }
        f.write_str(")")
    }
}

#[derive(Clone)]
struct Arrival {
    desc: Desc,
    input: Option<Tensor>,
}

struct State {
    generation: u64,
    /// `Some(check)` once every rank arrived: `Ok` or the mismatch message.
    ready: Option<std::result::Result<(), String>>,
    slots: Vec<Option<Arrival>>,
    arrived: usize,
    departed: usize,
    failure: Option<(usize, String)>,
    exited: Vec<bool>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    /// World ranks of the members, in group-rank order.
    members: Vec<usize>,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn new(members: Vec<usize>, timeout: Duration) -> Arc<Shared> {
        let size = members.len();
        Arc::new(Shared {
            size,
            timeout,
            members,
            state: Mutex::new(State {
                generation: 0,
                ready: None,
                slots: vec![None; size],
                arrived: 0,
                departed: 0,
                failure: None,
                exited: vec![false; size],
            }),
            cv: Condvar::new(),
        })
    }
}

/// Every group of one in-process world, so that a rank's failure or exit reaches peers
/// waiting in any group, and so that the members of a `new_group` find the same one.
#[derive(Default)]
struct World {
    groups: Mutex<WorldGroups>,
}

#[derive(Default)]
struct WorldGroups {
    /// All groups, the world first.
    all: Vec<Arc<Shared>>,
    /// Subgroups by (sorted world ranks, how many groups with these ranks the caller
    /// created before).
    by_key: HashMap<(Vec<usize>, usize), Arc<Shared>>,
}

/// One rank's handle to an in-process group. Create all ranks' handles of a world at once
/// with [`ThreadsGroup::new_world`] and move one into each rank's thread; subgroups come
/// from [`ProcessGroup::new_group`].
pub struct ThreadsGroup {
    rank: usize,
    shared: Arc<Shared>,
    world: Arc<World>,
    /// This rank's `new_group` calls so far, per rank list (the n-th call by every member
    /// yields the same group, as `torch.distributed.new_group` requires the same order).
    created: Mutex<HashMap<Vec<usize>, usize>>,
}

impl ThreadsGroup {
    /// Handles for ranks `0..size` of one new group whose collectives time out after
    /// `timeout`.
    ///
    /// # Errors
    /// `InvalidArgument` when `size == 0`.
    pub fn new_world(size: usize, timeout: Duration) -> Result<Vec<ThreadsGroup>> {
        if size == 0 {
            crate::error::bail_arg!("a process group needs at least one rank");
        }
        let shared = Shared::new((0..size).collect(), timeout);
        let world = Arc::new(World::default());
        world.groups.lock().all.push(shared.clone());
        Ok((0..size)
            .map(|rank| ThreadsGroup {
                rank,
                shared: shared.clone(),
                world: world.clone(),
                created: Mutex::new(HashMap::new()),
            })
            .collect())
    }

    /// This rank's index in the world.
    pub fn world_rank(&self) -> usize {
        self.shared.members[self.rank]
    }

    /// World ranks of this group's members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.shared.members
    }

    /// Records that this rank failed; every rank waiting in a collective of this group
    /// returns [`Error::PeerFailed`] naming it. The first failure recorded is kept.
    /// The failure is recorded in every group of the world (ranks named by world rank).
    pub fn mark_failed(&self, reason: impl Into<String>) {
        let reason = reason.into();
        let me = self.world_rank();
        for g in self.world.groups.lock().all.iter() {
            let mut st = g.state.lock();
            if st.failure.is_none() {
                st.failure = Some((me, reason.clone()));
            }
            g.cv.notify_all();
        }
    }

    /// Records that this rank will call no more collectives (in any group of the world);
    /// peers waiting for it fail at once instead of waiting out the timeout.
    pub fn mark_exited(&self) {
        let me = self.world_rank();
        for g in self.world.groups.lock().all.iter() {
            if let Some(local) = g.members.iter().position(|&m| m == me) {
                g.state.lock().exited[local] = true;
                g.cv.notify_all();
            }
        }
    }

    fn peer_failed(st: &State) -> Option<Error> {
        st.failure.as_ref().map(|(r, why)| Error::PeerFailed {
            failed_rank: *r,
            reason: why.clone(),
        })
    }

    fn wait(&self, st: &mut MutexGuard<'_, State>, deadline: Instant) -> bool {
        self.shared.cv.wait_until(st, deadline).timed_out()
    }

    /// Runs one collective: arrive, `exec` (which may return a value to write into this
    /// rank's `inplace` tensor after every rank is done reading), depart.
    fn collective<F>(&self, desc: Desc, input: Option<Tensor>, exec: F) -> Result<()>
    where
        F: FnOnce(&[Arrival]) -> Result<Option<(Tensor, Tensor)>>,
    {
        let sh = &*self.shared;
        let deadline = Instant::now() + sh.timeout;
        let op = desc.op;
        let mut st = sh.state.lock();
        if let Some(e) = Self::peer_failed(&st) {
            return Err(e);
        }
        let gen = st.generation;
        st.slots[self.rank] = Some(Arrival { desc, input });
        st.arrived += 1;
        if st.arrived == sh.size {
            st.ready = Some(check_descs(&st.slots, &sh.members));
            sh.cv.notify_all();
        }
        while st.ready.is_none() {
            if let Some(e) = Self::peer_failed(&st) {
                return Err(e);
            }
            let missing: Vec<usize> = (0..sh.size).filter(|&r| st.slots[r].is_none()).collect();
            if let Some(&gone) = missing.iter().find(|&&r| st.exited[r]) {
                let gone = sh.members[gone];
                let missing: Vec<usize> = missing.iter().map(|&r| sh.members[r]).collect();
                let why = format!(
                    "rank {gone} exited without calling {op} (ranks {missing:?} never arrived)"
                );
                st.failure = Some((gone, why.clone()));
                sh.cv.notify_all();
                return Err(Error::PeerFailed {
                    failed_rank: gone,
                    reason: why,
                });
            }
            if self.wait(&mut st, deadline) && st.ready.is_none() {
                let missing: Vec<usize> = (0..sh.size)
                    .filter(|&r| st.slots[r].is_none())
                    .map(|r| sh.members[r])
                    .collect();
                let err = Error::Timeout {
                    op: op.to_string(),
                    rank: self.world_rank(),
                    timeout_s: sh.timeout.as_secs_f64(),
                    missing_ranks: missing.clone(),
                };
                if st.failure.is_none() {
                    st.failure = Some((
                        missing.first().copied().unwrap_or(self.rank),
                        err.to_string(),
                    ));
                }
                sh.cv.notify_all();
                return Err(err);
            }
        }
        let check = st.ready.clone().unwrap_or(Ok(()));
        let peers: Vec<Arrival> = st.slots.iter().flatten().cloned().collect();
        drop(st);

        let result = match check {
            Ok(()) if peers.len() == sh.size => exec(&peers),
            Ok(()) => Err(Error::Fsdp("internal: incomplete rendezvous".into())),
            Err(detail) => Err(Error::CollectiveMismatch {
                group_size: sh.size,
                detail,
            }),
        };

        let mut st = sh.state.lock();
        st.departed += 1;
        if st.departed == sh.size {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.arrived = 0;
            st.departed = 0;
            st.ready = None;
            st.generation += 1;
            sh.cv.notify_all();
        }
        while st.generation == gen {
            if let Some(e) = Self::peer_failed(&st) {
                return Err(e);
            }
            if self.wait(&mut st, deadline) && st.generation == gen {
                return Err(Error::Timeout {
                    op: op.to_string(),
                    rank: self.world_rank(),
                    timeout_s: sh.timeout.as_secs_f64(),
                    missing_ranks: vec![],
                });
            }
        }
        drop(st);
        match result? {
            Some((dst, value)) => dst.copy_from(&value),
            None => Ok(()),
        }
    }
}

/// Compares every rank's descriptor with the first member's; ranks named by world rank.
fn check_descs(slots: &[Option<Arrival>], members: &[usize]) -> std::result::Result<(), String> {
    let descs: Vec<&Desc> = slots.iter().flatten().map(|a| &a.desc).collect();
    let first = descs[0];
    let differing: Vec<String> = descs
        .iter()
        .enumerate()
        .filter(|(_, d)| **d != first)
        .map(|(r, d)| format!("rank {} called {d}", members[r]))
        .collect();
    if differing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "rank {} called {first} but {}",
            members[0],
            differing.join(", ")
        ))
    }
}

fn input(p: &Arrival) -> Result<&Tensor> {
    p.input
        .as_ref()
        .ok_or_else(|| Error::Fsdp("internal: collective without input".into()))
}

fn reduce<T: Element>(op: ReduceOp, n: usize, values: impl Iterator<Item = T>) -> T {
    let mut it = values.map(|v| v.to_f64());
    let first = it.next().unwrap_or(0.0);
    let r = it.fold(first, |acc, v| match op {
        ReduceOp::Sum | ReduceOp::Avg => acc + v,
        ReduceOp::Max => acc.max(v),
        ReduceOp::Min => acc.min(v),
        ReduceOp::Product => acc * v,
    });
    let r = if op == ReduceOp::Avg { r / n as f64 } else { r };
    T::from_f64(r)
}

macro_rules! dispatch {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::BF16 => $f::<half::bf16>($($arg),*),
            DType::F16 => $f::<half::f16>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
        }
    };
}

fn exec_all_gather<T: Element>(out: &Tensor, peers: &[Arrival]) -> Result<()> {
    let mut dst = out.data_mut::<T>()?;
    let n = dst.len() / peers.len().max(1);
    for (s, p) in peers.iter().enumerate() {
        dst[s * n..(s + 1) * n].copy_from_slice(&input(p)?.data::<T>()?);
    }
    Ok(())
}

fn exec_reduce_scatter<T: Element>(
    out: &Tensor,
    rank: usize,
    op: ReduceOp,
    peers: &[Arrival],
) -> Result<()> {
    let guards: Vec<_> = peers
        .iter()
        .map(|p| input(p)?.data::<T>())
        .collect::<Result<_>>()?;
    let mut dst = out.data_mut::<T>()?;
    let n = dst.len();
    let base = rank * n;
    for (j, d) in dst.iter_mut().enumerate() {
        *d = reduce(op, peers.len(), guards.iter().map(|g| g[base + j]));
    }
    Ok(())
}

fn exec_all_reduce<T: Element>(
    t: &Tensor,
    op: ReduceOp,
    peers: &[Arrival],
) -> Result<Option<(Tensor, Tensor)>> {
    let guards: Vec<_> = peers
        .iter()
        .map(|p| input(p)?.data::<T>())
        .collect::<Result<_>>()?;
    let n = t.numel();
    let out: Vec<T> = (0..n)
        .map(|j| reduce(op, peers.len(), guards.iter().map(|g| g[j])))
        .collect();
    Ok(Some((t.clone(), Tensor::from_vec(out, t.shape())?)))
}

impl ProcessGroup for ThreadsGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn world_rank(&self) -> usize {
        ThreadsGroup::world_rank(self)
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<super::Group>> {
        let world_size = self.world.groups.lock().all[0].size;
        let mut members = ranks.to_vec();
        members.sort_unstable();
        members.dedup();
        if members.is_empty()
            || members.len() != ranks.len()
            || members.iter().any(|&r| r >= world_size)
        {
            crate::error::bail_arg!(
                "new_group: ranks {ranks:?} must be distinct world ranks in 0..{world_size}, at least one"
            );
        }
        let nth = {
            let mut created = self.created.lock();
            let n = created.entry(members.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let me = self.world_rank();
        let Some(local) = members.iter().position(|&r| r == me) else {
            return Ok(None);
        };
        let shared = {
            let mut g = self.world.groups.lock();
            let WorldGroups { all, by_key } = &mut *g;
            by_key
                .entry((members.clone(), nth))
                .or_insert_with(|| {
                    let s = Shared::new(members.clone(), self.shared.timeout);
                    all.push(s.clone());
                    s
                })
                .clone()
        };
        Ok(Some(Arc::new(ThreadsGroup {
            rank: local,
            shared,
            world: self.world.clone(),
            created: Mutex::new(HashMap::new()),
        })))
    }

    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        let w = self.size();
        if output.numel() != w * input.numel() || output.dtype() != input.dtype() {
            crate::error::bail_arg!(
                "all_gather_into_tensor on rank {}: output {:?} {} must hold {} x input {:?} {}",
                self.rank,
                output.shape(),
                output.dtype(),
                w,
                input.shape(),
                input.dtype()
            );
        }
        // An input that is a view of the output (in-place all-gather) is read from a copy:
        // the output's write lock would otherwise block reading it.
        let input = if input.shares_storage(output) {
            input.deep_clone()?
        } else {
            input.clone()
        };
        let desc = Desc {
            op: "all_gather_into_tensor",
            dtype: input.dtype(),
            in_numel: input.numel(),
            out_numel: output.numel(),
            arg: String::new(),
        };
        let out = output.clone();
        self.collective(desc, Some(input), |peers| {
            dispatch!(out.dtype(), exec_all_gather(&out, peers))?;
            Ok(None)
        })
    }

    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        let w = self.size();
        if input.numel() != w * output.numel() || output.dtype() != input.dtype() {
            crate::error::bail_arg!(
                "reduce_scatter_tensor on rank {}: input {:?} {} must hold {} x output {:?} {}",
                self.rank,
                input.shape(),
                input.dtype(),
                w,
                output.shape(),
                output.dtype()
            );
        }
        if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
            crate::error::bail_arg!("reduce_scatter_tensor supports Sum and Avg, got {op:?}");
        }
        let input = if input.shares_storage(output) {
            input.deep_clone()?
        } else {
            input.clone()
        };
        let desc = Desc {
            op: "reduce_scatter_tensor",
            dtype: input.dtype(),
            in_numel: input.numel(),
            out_numel: output.numel(),
            arg: format!("{op:?}"),
        };
        let out = output.clone();
        let rank = self.rank;
        self.collective(desc, Some(input), |peers| {
            dispatch!(out.dtype(), exec_reduce_scatter(&out, rank, op, peers))?;
            Ok(None)
        })
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let desc = Desc {
            op: "all_reduce",
            dtype: tensor.dtype(),
            in_numel: tensor.numel(),
            out_numel: tensor.numel(),
            arg: format!("{op:?}"),
        };
        let t = tensor.clone();
        self.collective(desc, Some(tensor.clone()), |peers| {
            dispatch!(t.dtype(), exec_all_reduce(&t, op, peers))
        })
    }

    fn broadcast(&self, tensor: &Tensor, src: usize) -> Result<()> {
        if src >= self.size() {
            crate::error::bail_arg!(
                "broadcast: src rank {src} is not in a group of {} ranks",
                self.size()
            );
        }
        let desc = Desc {
            op: "broadcast",
            dtype: tensor.dtype(),
            in_numel: tensor.numel(),
            out_numel: tensor.numel(),
            arg: format!("src={src}"),
        };
        let t = tensor.clone();
        let rank = self.rank;
        self.collective(desc, Some(tensor.clone()), |peers| {
            if rank != src {
                t.copy_from(input(&peers[src])?)?;
            }
            Ok(None)
        })
    }

    fn barrier(&self) -> Result<()> {
        let desc = Desc {
            op: "barrier",
            dtype: DType::F32,
            in_numel: 0,
            out_numel: 0,
            arg: String::new(),
        };
        self.collective(desc, None, |_| Ok(None))
    }
}
