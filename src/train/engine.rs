//! What the training loop drives: the model under FSDP, or the same model trained plainly
//! (the reference FSDP is measured against).

use crate::backend::Device;
use crate::distributed::staged;
use crate::distributed::{Group, ReduceOp};
use crate::error::Result;
use crate::fsdp::FullyShardedDataParallel;
use crate::nn::{visit_all, visit_parameters, Context, Module};
use crate::optim::{Optimizer, ParamGrad};
use crate::tensor::{DType, Tensor};

/// One rank's memory figures for a step, in bytes, and its communication figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankMemory {
    /// The rank these figures belong to, `0..world_size`.
    pub rank: usize,
    /// Parameter shards (f32, padding included); the whole model without FSDP.
    pub param_shard_bytes: usize,
    /// Gradient shards after backward.
    pub grad_shard_bytes: usize,
    /// Optimizer state (momenta, Adam moments) over the local shards.
    pub optim_state_bytes: usize,
    /// Peak bytes of unsharded (all-gathered) parameter buffers alive at once in the step.
    pub peak_unsharded_param_bytes: usize,
    /// Most FSDP units unsharded (or being gathered) at once in the step, root included.
    pub peak_unsharded_units: usize,
    /// Bytes of the activations saved for backward at the end of the step's forward
    /// (their peak; the largest over its micro-batches): FSDP's
    /// [`MemoryStats::peak_activation_bytes`](crate::fsdp::MemoryStats::peak_activation_bytes).
    pub activation_bytes: usize,
    /// Microseconds the rank waited on FSDP's collectives in the step: on the CPU its
    /// compute thread's blocked time; on CUDA also the time its compute stream stood still
    /// waiting for a collective's event (read without blocking, so a wait still in flight
    /// counts in a later step's figure).
    pub comm_wait_us: usize,
    /// On a CUDA device: the most device bytes the rank's memory account (its compute and
    /// communication streams) held at once so far; absent on the CPU.
    #[serde(skip_serializing_if = "is_zero")]
    pub device_peak_bytes: usize,
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

/// The most device bytes this rank's threads have held at once on `device` (the rank's
/// memory account, `backend::cuda::rank_account`); 0 on the CPU.
pub fn device_peak_bytes(device: Device) -> usize {
    if device.is_cuda() {
        return crate::backend::cuda::rank_account().stats().peak;
    }
    0
}

/// On a CUDA device: seconds this rank's streams stood still waiting for collectives since
/// the last call (`backend::cuda::take_stream_stall_s`: the exposed communication that no
/// host wait shows, since the host never waits for a collective there); 0 on the CPU.
fn stream_stall_s(device: Device) -> f64 {
    if device.is_cuda() {
        return crate::backend::cuda::take_stream_stall_s();
    }
    0.0
}

/// Moves every parameter of `m` to `device` (`module.to(device)`); tied parameters stay
/// one tensor.
///
/// # Errors
/// [`Error::Cuda`](crate::Error::Cuda) when the device is unavailable; `NotMaterialized`
/// for a meta parameter without an initializer.
pub fn module_to_device(m: &mut dyn Module, device: Device) -> Result<()> {
    let mut moved: Vec<(Tensor, Tensor)> = Vec::new();
    visit_parameters(m, "", false, &mut |_, p| {
        let Ok(d) = p.data() else { return Ok(()) };
        let t = match moved.iter().find(|(from, _)| from.same_view(d)) {
            Some((_, to)) => to.clone(),
            None => {
                let to = d.to_device(device)?;
                moved.push((d.clone(), to.clone()));
                to
            }
        };
        p.set_data(Some(t))
    })
}

impl RankMemory {
    /// Parameter + gradient + optimizer bytes.
    pub fn sharded_total(&self) -> usize {
        self.param_shard_bytes + self.grad_shard_bytes + self.optim_state_bytes
    }
}

/// A model being trained: under FSDP, or plain (world size 1, no wrapping).
pub enum Engine {
    /// The model wrapped as the root FSDP unit; the optimizer steps on local shards.
    Fsdp(Box<FullyShardedDataParallel>),
    /// The bare model (`--no-fsdp`, world size 1); the optimizer steps on whole parameters.
    Plain(Box<dyn Module>),
}

impl Engine {
    /// The module to call forward/backward on.
    pub fn module(&mut self) -> &mut dyn Module {
        match self {
            Engine::Fsdp(m) => m.as_mut(),
            Engine::Plain(m) => m.as_mut(),
        }
    }

    /// The tensors the optimizer steps on: local shards under FSDP, whole parameters else.
    pub fn optimizer_params(&mut self) -> Vec<ParamGrad> {
        match self {
            Engine::Fsdp(m) => m.optimizer_params(),
            Engine::Plain(m) => crate::optim::parameters(m.as_mut()),
        }
    }

    /// Backward from `grad_out`; with `defer_sync`, under FSDP's `no_sync` (gradients
    /// accumulate locally until the next synchronized backward).
    pub fn backward(&mut self, grad_out: &Tensor, defer_sync: bool) -> Result<()> {
        let cx = Context::train();
        match self {
            Engine::Fsdp(m) if defer_sync => m.no_sync(|m| m.backward(grad_out, &cx)).map(drop),
            _ => self.module().backward(grad_out, &cx).map(drop),
        }
    }

    /// Clips the global gradient 2-norm to `max_norm` and returns the norm before clipping
    /// (`FullyShardedDataParallel::clip_grad_norm_` / `torch.nn.utils.clip_grad_norm_`).
    pub fn clip_grad_norm(&mut self, max_norm: f32) -> Result<f32> {
        Ok(self.clip_grad_norm_tensor(max_norm)?.to_vec_f32()?[0])
    }

    /// [`clip_grad_norm`](Self::clip_grad_norm) with the norm as a one-element f32 tensor
    /// on the gradients' device: under FSDP on CUDA nothing waits for the device
    /// ([`FullyShardedDataParallel::clip_grad_norm_tensor_`]).
    ///
    /// # Errors
    /// As [`clip_grad_norm`](Self::clip_grad_norm).
    pub fn clip_grad_norm_tensor(&mut self, max_norm: f32) -> Result<Tensor> {
        match self {
            Engine::Fsdp(m) => m.clip_grad_norm_tensor_(max_norm, 2.0),
            Engine::Plain(m) => {
                let mut grads = Vec::new();
                visit_all(m.as_mut(), |_, p| grads.extend(p.grad().cloned()));
                let mut sq = 0.0f64;
                for g in &grads {
                    sq += crate::ops::sum_squares(g)?;
                }
                let total = sq.sqrt() as f32;
                let coef = (max_norm / (total + 1e-6)).min(1.0);
                for g in &grads {
                    crate::ops::scale_(g, coef)?;
                }
                let device = grads.first().map_or(Device::Cpu, Tensor::device);
                Tensor::from_vec(vec![total], &[1])?.to_device(device)
            }
        }
    }

    /// `zero_grad(set_to_none=True)`.
    pub fn zero_grad(&mut self) {
        match self {
            Engine::Fsdp(m) => m.zero_grad(),
            Engine::Plain(m) => crate::nn::zero_grad(m.as_mut()),
        }
    }

    /// This rank's memory now (call after backward, before `zero_grad`).
    pub fn memory(&mut self, rank: usize, opt: &dyn Optimizer) -> RankMemory {
        let optim_state_bytes = opt.state_bytes();
        let device_peak_bytes = device_peak_bytes(self.device());
        let stall_s = stream_stall_s(self.device());
        match self {
            Engine::Fsdp(m) => {
                let s = m.memory_stats();
                RankMemory {
                    rank,
                    param_shard_bytes: s.param_shard_bytes,
                    grad_shard_bytes: s.grad_shard_bytes,
                    optim_state_bytes,
                    peak_unsharded_param_bytes: s.peak_unsharded_param_bytes,
                    peak_unsharded_units: s.peak_unsharded_units,
                    activation_bytes: s.peak_activation_bytes,
                    comm_wait_us: ((m.runtime_stats().comm_wait_s + stall_s) * 1e6) as usize,
                    device_peak_bytes,
                }
            }
            Engine::Plain(m) => {
                let (mut p, mut g) = (0, 0);
                visit_all(m.as_mut(), |_, q| {
                    p += q.numel() * 4;
                    g += q.grad().map_or(0, |t| t.nbytes());
                });
                RankMemory {
                    rank,
                    param_shard_bytes: p,
                    grad_shard_bytes: g,
                    optim_state_bytes,
                    device_peak_bytes,
                    ..RankMemory::default()
                }
            }
        }
    }

    /// The device the model computes on: FSDP's `device_id`, or where the plain model's
    /// first parameter lives.
    pub fn device(&mut self) -> Device {
        match self {
            Engine::Fsdp(m) => m.compute_device(),
            Engine::Plain(m) => {
                let mut d = Device::Cpu;
                visit_all(m.as_mut(), |_, p| {
                    if let Ok(t) = p.data() {
                        if d == Device::Cpu {
                            d = t.device();
                        }
                    }
                });
                d
            }
        }
    }

    /// Starts a new window for the peak unsharded figures and the communication wait.
    pub fn reset_peak(&mut self) {
        if let Engine::Fsdp(m) = self {
            m.reset_peak_memory_stats();
            m.reset_runtime_stats();
        }
    }
}

/// i32 words of one [`RankMemory`] in a gather ([`RankMemory::to_words`]).
pub(crate) const MEMORY_WORDS: usize = 16;

impl RankMemory {
    /// The figures as [`MEMORY_WORDS`] i32 words for a collective (each count split into
    /// two: bits 30 and up, and the low 30 bits).
    pub(crate) fn to_words(self) -> [i32; MEMORY_WORDS] {
        let fields = [
            self.param_shard_bytes,
            self.grad_shard_bytes,
            self.optim_state_bytes,
            self.peak_unsharded_param_bytes,
            self.peak_unsharded_units,
            self.comm_wait_us,
            self.device_peak_bytes,
            self.activation_bytes,
        ];
        let mut w = [0i32; MEMORY_WORDS];
        for (i, f) in fields.into_iter().enumerate() {
            w[2 * i] = (f >> 30) as i32;
            w[2 * i + 1] = (f & ((1 << 30) - 1)) as i32;
        }
        w
    }

    /// Rank `rank`'s figures back from [`to_words`](Self::to_words).
    pub(crate) fn from_words(rank: usize, w: &[i32]) -> RankMemory {
        let f = |i: usize| ((w[2 * i] as usize) << 30) | w[2 * i + 1] as usize;
        RankMemory {
            rank,
            param_shard_bytes: f(0),
            grad_shard_bytes: f(1),
            optim_state_bytes: f(2),
            peak_unsharded_param_bytes: f(3),
            peak_unsharded_units: f(4),
            comm_wait_us: f(5),
            device_peak_bytes: f(6),
            activation_bytes: f(7),
        }
    }
}

/// Every rank's [`RankMemory`], gathered over `pg` (each byte count split into two i32).
pub fn gather_memory(pg: &Group, mine: RankMemory) -> Result<Vec<RankMemory>> {
    let local = Tensor::from_vec(mine.to_words().to_vec(), &[MEMORY_WORDS])?;
    let all = Tensor::zeros(&[MEMORY_WORDS * pg.size()], DType::I32);
    staged::all_gather_into_tensor(pg.as_ref(), &all, &local)?;
    let v = all.data::<i32>()?;
    Ok(v.chunks_exact(MEMORY_WORDS)
        .enumerate()
        .map(|(rank, w)| RankMemory::from_words(rank, w))
        .collect())
}

/// Every rank's value of a per-rank count, in rank order (each split into two i32).
pub fn gather_counts(pg: &Group, mine: usize) -> Result<Vec<usize>> {
    let local = Tensor::from_vec(
        vec![(mine >> 30) as i32, (mine & ((1 << 30) - 1)) as i32],
        &[2],
    )?;
    let all = Tensor::zeros(&[2 * pg.size()], DType::I32);
    staged::all_gather_into_tensor(pg.as_ref(), &all, &local)?;
    let v = all.data::<i32>()?;
    Ok(v.chunks_exact(2)
        .map(|w| ((w[0] as usize) << 30) | w[1] as usize)
        .collect())
}

/// Mean of a per-rank scalar over the group (`dist.all_reduce(t, op=ReduceOp.AVG)`),
/// identical on every rank. A collective: every rank of `pg` calls it.
///
/// # Errors
/// The collective's errors (a rank that failed or timed out).
pub fn mean_over_ranks(pg: &Group, v: f32) -> Result<f32> {
    let t = Tensor::from_vec(vec![v], &[1])?;
    staged::all_reduce(pg.as_ref(), &t, ReduceOp::Avg)?;
    let out = t.f32()?[0];
    Ok(out)
}

/// The global mean of a loss that each rank averaged over its own `count` samples (or
/// tokens): `sum_r(loss_r * count_r) / sum_r(count_r)` over the group, in f32, identical
/// on every rank; with equal counts, the mean of the ranks' losses (what logging the loss
/// of a data-parallel step needs). A NaN or infinite loss on any rank comes out NaN or
/// infinite everywhere. A collective: every rank of `pg` calls it.
///
/// ```
/// use fsdp::distributed::{launch, LaunchOptions};
/// use fsdp::train::global_mean_loss;
/// let means = launch(&LaunchOptions::new(2), |pg| {
///     // rank 0: mean 1.0 over 1 sample; rank 1: mean 4.0 over 3 samples.
///     let (loss, count) = if pg.rank() == 0 { (1.0, 1) } else { (4.0, 3) };
///     global_mean_loss(&pg, loss, count)
/// })
/// .unwrap();
/// assert_eq!(means, vec![3.25, 3.25]);
/// ```
///
/// # Errors
/// `InvalidArgument` on every rank when no rank has a sample; the collective's errors.
pub fn global_mean_loss(pg: &Group, loss: f32, count: usize) -> Result<f32> {
    // Zero samples contribute nothing, not 0 * NaN.
    let weighted = if count == 0 { 0.0 } else { loss * count as f32 };
    let t = Tensor::from_vec(vec![weighted, count as f32], &[2])?;
    staged::all_reduce(pg.as_ref(), &t, ReduceOp::Sum)?;
    let v = t.f32()?;
    if v[1] == 0.0 {
        return Err(crate::Error::InvalidArgument(
            "global_mean_loss: no rank has a sample".into(),
        ));
    }
    Ok(v[0] / v[1])
}
