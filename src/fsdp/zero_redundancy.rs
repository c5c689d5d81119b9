//! [`ZeroRedundancyOptimizer`]: ZeRO stage 1 over a NoShard model. Parameters stay whole
//! on every rank (`ShardingStrategy::NoShard`, DDP's layout) while optimizer state is
//! split: each rank keeps and updates the state of one chunk of every flat parameter.
//!
//! The step, per unit:
//!
//! ```text
//! backward:  flat grad (c_o W, padded) -- reduce-scatter over the world --> grad shard (c_o)
//!            (NoShard alone all-reduces the whole flat gradient instead)
//! step:      inner optimizer on this rank's chunk [lo, hi) of the flat parameter and its
//!            gradient shard (state: c_o elements per buffer, 1/W of NoShard's)
//!            -> all-gather of every rank's updated chunk (c_o each) into the whole parameter
//! ```
//!
//! Chunks follow FSDP's flat-parameter layout (`c_o = ceil(N / W)`, zero padding at the
//! end), so the gradient sums, the elementwise updates and therefore the parameters are
//! those of NoShard: the reduce-scatter adds each element over the ranks in the order the
//! all-reduce does. Optimizer state dicts and checkpoints hold each rank's chunk under the
//! original parameter names, like FullShard's, and reload at any world size or strategy.
//!
//! PyTorch's `torch.distributed.optim.ZeroRedundancyOptimizer`
//! (`torch/distributed/optim/zero_redundancy_optimizer.py`) wraps an optimizer class the
//! same way over DDP; it assigns whole parameters to ranks and broadcasts them after the
//! step, over DDP's all-reduced gradients. Here the partition is by flat elements and the
//! gradients are reduce-scattered, as DeepSpeed's ZeRO stage 1 (`"zero_optimization":
//! {"stage": 1}`) does.

use super::progress::{Held, Pass};
use super::scheduler::Scheduler;
use super::{
    FullStateDictConfig, FullyShardedDataParallel, OptimStateDict, ShardingStrategy,
    StateDictConfig,
};
use crate::distributed::fingerprint::Phase;
use crate::distributed::{staged, Group};
use crate::error::{Error, Result};
use crate::optim::{Optimizer, OptimizerState, ParamGrad, ParamGroup};
use crate::tensor::Tensor;
use parking_lot::Mutex;
use std::sync::Arc;

/// What the all-gather after a step needs of one unit.
struct UnitSync {
    /// The unit's whole flat parameter `(N)` (NoShard's local shard, f32 or f64): the
    /// optimizer updates elements `[lo, hi)` in place, the all-gather brings the rest.
    full: Tensor,
    /// Chunk size `c_o = ceil(N / W)`.
    chunk: usize,
    /// This rank's chunk, unpadded: `[lo, hi)` of the flat parameter.
    lo: usize,
    hi: usize,
    /// The rank's scheduler (buffer pool, collective fingerprints) and the unit's id in it.
    sched: Arc<Mutex<Scheduler>>,
    id: usize,
}

/// ZeRO stage 1 (`torch.distributed.optim.ZeroRedundancyOptimizer`): any [`Optimizer`]
/// (SGD, Adam, AdamW, with parameter groups) stepping only this rank's chunk of each flat
/// parameter of a [`ShardingStrategy::NoShard`] model, whose parameters and gradients
/// stay whole on every rank. See the module docs for the data flow.
///
/// [`new`](Self::new) switches the model's gradient reduction from an all-reduce to a
/// reduce-scatter into each rank's chunk; from then on
/// [`optimizer_params`](FullyShardedDataParallel::optimizer_params) lists the chunk. Each
/// [`step`](Optimizer::step) updates the chunk with the inner optimizer, then all-gathers
/// every rank's chunk into the whole parameters (a collective over the model's world:
/// every rank steps). Training then gives NoShard's numbers, with 1/W of its optimizer
/// state (`state_bytes`) and of its gradient shard bytes per rank.
///
/// Everything else is the inner optimizer's: learning rates, parameter groups (positions
/// in the chunk list, as
/// [`optimizer_param_names`](FullyShardedDataParallel::optimizer_param_names) names them
/// once `new` returned; groups the inner optimizer had before are mapped there), and
/// `state_dict` / `load_state_dict` (this rank's chunk). Whole-model state goes through
/// the model's [`optim_state_dict`](FullyShardedDataParallel::optim_state_dict) (sharded:
/// each rank's chunk by parameter name) and checkpoints, as under FullShard, or
/// [`consolidate_state_dict`](Self::consolidate_state_dict); either loads back at any
/// world size with [`load_optim_state_dict`](FullyShardedDataParallel::load_optim_state_dict)
/// or [`load_checkpoint`](crate::checkpoint::load_checkpoint).
///
/// ```
/// use fsdp::distributed::{launch, LaunchOptions};
/// use fsdp::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy, ZeroRedundancyOptimizer};
/// use fsdp::nn::{loss, Context, InitKey, Linear, Module};
/// use fsdp::optim::{AdamConfig, AdamW, Optimizer};
/// use fsdp::tensor::Tensor;
///
/// launch(&LaunchOptions::new(2), |pg| {
///     let lin = Linear::new(4, 3, true, &InitKey::new(0))?;
///     let cfg = FsdpConfig { sharding_strategy: ShardingStrategy::NoShard, ..Default::default() };
///     let mut model = FullyShardedDataParallel::new(Box::new(lin), pg, cfg)?;
///     let mut opt = ZeroRedundancyOptimizer::new(&mut model, Box::new(AdamW::new(AdamConfig::adamw())))?;
///     let x = Tensor::from_vec(vec![1.0f32; 8], &[2, 4])?;
///     let y = model.forward(&x, &Context::train())?;
///     let (_, dy) = loss::sum_loss(&y)?;
///     model.backward(&dy, &Context::train())?;
///     opt.step(&model.optimizer_params())?; // this rank's chunk of the 15 elements, then the gather
///     model.zero_grad();
///     // Rank 0: two f32 moments of its 8 elements (a ceil(15 / 2) chunk: the weight's
///     // first 8) and one step count; NoShard's AdamW keeps 2 * 15 * 4 + 2 * 8 bytes.
///     if model.process_group().rank() == 0 {
///         assert_eq!(opt.state_bytes(), 2 * 8 * 4 + 8);
///     }
///     Ok(())
/// })
/// .unwrap();
/// ```
pub struct ZeroRedundancyOptimizer {
    inner: Box<dyn Optimizer>,
    units: Vec<UnitSync>,
    /// The model's world: the chunks' ranks.
    pg: Group,
    /// Entries of the model's `optimizer_params()` (chunk runs and ignored parameters).
    params_len: usize,
}

impl ZeroRedundancyOptimizer {
    /// Wraps `inner`, a fresh optimizer (no state yet), to step `model`'s chunks, and
    /// turns the model's gradient reduction into a reduce-scatter over its world into
    /// each rank's chunk (`model` keeps that mode for good; build it again for plain
    /// NoShard). Every rank calls it, before the first backward or after `zero_grad`.
    /// Parameter groups `inner` has (positions in the model's whole list, as
    /// `torch.optim` takes `model.parameters()`) are carried over to the chunk list by
    /// parameter name.
    ///
    /// # Errors
    /// `InvalidArgument` naming both when `model` uses a sharded strategy (its optimizer
    /// state is sharded already: ZeRO-1 is for `NoShard`); `Fsdp` on a nested unit, with
    /// gradients held or a forward pending; `InvalidArgument` when `inner` holds state.
    pub fn new(model: &mut FullyShardedDataParallel, inner: Box<dyn Optimizer>) -> Result<Self> {
        let strategy = model.sharding_strategy();
        if strategy != ShardingStrategy::NoShard {
            return Err(Error::InvalidArgument(format!(
                "ZeroRedundancyOptimizer shards the optimizer state of a model whose parameters are whole on every rank ({}); this model uses {}, which shards its optimizer state already",
                ShardingStrategy::NoShard.api_name(),
                strategy.api_name()
            )));
        }
        if !model.is_root() {
            return Err(Error::Fsdp(format!(
                "ZeroRedundancyOptimizer::new called on unit '{}': give it the root",
                model.module_name()
            )));
        }
        if !matches!(
            model.rs.sched.lock().progress.pass(),
            Pass::Idle(Held::Nothing)
        ) {
            return Err(Error::Fsdp(
                "ZeroRedundancyOptimizer::new with gradients held or a forward waiting for its backward: build it before the first forward, or after zero_grad".into(),
            ));
        }
        if inner.state_bytes() > 0 {
            return Err(Error::InvalidArgument(format!(
                "ZeroRedundancyOptimizer::new: the optimizer holds {} bytes of state for another list of tensors; give it a fresh one and load state afterwards (load_optim_state_dict, load_checkpoint)",
                inner.state_bytes()
            )));
        }
        let mut inner = inner;
        let pg = model.process_group().clone();
        let (world, rank) = (pg.size(), pg.rank());
        let whole_list = model.optimizer_param_names();
        let mut units = Vec::new();
        model.for_each_unit(&mut |u| {
            u.flat.partition_optimizer(world, rank)?;
            let (lo, hi) = u.flat.optim_range();
            units.push(UnitSync {
                full: u.flat.local_shard.clone(),
                chunk: u.flat.optim_shard_numel(),
                lo,
                hi,
                sched: u.rs.sched.clone(),
                id: u.id,
            });
            Ok(())
        })?;
        let chunk_list = model.optimizer_param_names();
        let groups = inner
            .param_groups()
            .map(|g| regroup(g, &whole_list, &chunk_list));
        if let Some(groups) = groups {
            inner.set_param_groups(groups)?;
        }
        let params_len = chunk_list.len();
        Ok(ZeroRedundancyOptimizer {
            inner,
            units,
            pg,
            params_len,
        })
    }

    /// The wrapped optimizer (its state is this rank's chunk's).
    pub fn inner(&self) -> &dyn Optimizer {
        self.inner.as_ref()
    }

    /// The whole optimizer state, every rank's chunk gathered, by original parameter name
    /// (PyTorch's `consolidate_state_dict(to)` followed by `state_dict()` on rank `to`):
    /// `Some` on rank `to`, `None` on the others. A collective over `model`'s world (one
    /// all-gather per unit and buffer). Load it on any world size with
    /// [`load_optim_state_dict`](FullyShardedDataParallel::load_optim_state_dict), each
    /// rank taking its chunk.
    ///
    /// # Errors
    /// `InvalidArgument` when `to` is not a rank of the world; `StateDict` when `model` is
    /// not the one this optimizer steps (no ZeRO-1 partition, or another list of tensors);
    /// a collective's errors.
    pub fn consolidate_state_dict(
        &self,
        model: &mut FullyShardedDataParallel,
        to: usize,
    ) -> Result<Option<OptimStateDict>> {
        if to >= self.pg.size() {
            return Err(Error::InvalidArgument(format!(
                "consolidate_state_dict(to = {to}): the world has ranks 0..{}",
                self.pg.size()
            )));
        }
        if !model.zero_redundancy() {
            return Err(Error::StateDict(
                "consolidate_state_dict: the model's optimizer state is not partitioned by a ZeroRedundancyOptimizer (pass the model this optimizer was built on)".into(),
            ));
        }
        let config = StateDictConfig::Full(FullStateDictConfig {
            offload_to_cpu: true,
            rank0_only: false,
        });
        let osd = model.optim_state_dict(self, config)?;
        Ok((self.pg.rank() == to).then_some(osd))
    }

    /// Brings every rank's updated chunk of each unit into this rank's whole flat
    /// parameter (one all-gather per unit over the world, of `c_o` elements from each).
    fn gather_chunks(&self) -> Result<()> {
        let w = self.pg.size();
        for u in self.units.iter().filter(|u| u.full.numel() > 0) {
            let _tag =
                super::progress::enter(u.sched.lock().progress.other(u.id, Phase::OptimizerStep));
            let (dtype, device) = (u.full.dtype(), u.full.device());
            let len = u.hi - u.lo;
            // A whole chunk is sent from the parameter itself; the short last one from a
            // zero-padded copy.
            let (padded, out) = {
                let mut s = u.sched.lock();
                let padded = (len < u.chunk)
                    .then(|| s.take_buffer(u.chunk, dtype, device, true))
                    .transpose()?;
                (padded, s.take_buffer(u.chunk * w, dtype, device, false)?)
            };
            let input = match &padded {
                Some(p) => {
                    if len > 0 {
                        p.view(0, &[len])?.copy_from(&u.full.view(u.lo, &[len])?)?;
                    }
                    p.clone()
                }
                None => u.full.view(u.lo, &[len])?,
            };
            staged::all_gather_into_tensor(self.pg.as_ref(), &out, &input)?;
            u.full.copy_from(&out.view(0, &[u.full.numel()])?)?;
            let mut s = u.sched.lock();
            s.buffers.give(out);
            if let Some(p) = padded {
                s.buffers.give(p);
            }
        }
        Ok(())
    }
}

/// `groups` over the entries of `whole` (the model's list before partitioning, by
/// parameter name) as groups over the entries of `chunks` (the list of this rank's
/// chunks): each entry goes to the group of its parameter.
fn regroup(
    groups: &[ParamGroup],
    whole: &[(String, Vec<usize>)],
    chunks: &[(String, Vec<usize>)],
) -> Vec<ParamGroup> {
    groups
        .iter()
        .map(|g| {
            let names: Vec<&str> = g
                .params
                .iter()
                .filter_map(|&i| whole.get(i).map(|(n, _)| n.as_str()))
                .collect();
            ParamGroup {
                params: (0..chunks.len())
                    .filter(|&p| names.contains(&chunks[p].0.as_str()))
                    .collect(),
                ..g.clone()
            }
        })
        .collect()
}

impl Optimizer for ZeroRedundancyOptimizer {
    /// The inner optimizer's step on `params` (the model's
    /// [`optimizer_params`](FullyShardedDataParallel::optimizer_params): this rank's
    /// chunks), then the all-gather of every rank's chunks into the whole parameters.
    ///
    /// # Errors
    /// `ShapeMismatch` when `params` is not as long as the model's list; the inner step's
    /// errors; the all-gather's errors (a peer that failed or did not step).
    fn step(&mut self, params: &[ParamGrad]) -> Result<()> {
        if params.len() != self.params_len {
            return Err(Error::ShapeMismatch {
                op: "ZeroRedundancyOptimizer.step",
                expected: vec![self.params_len],
                got: vec![params.len()],
            });
        }
        self.inner.step(params)?;
        self.gather_chunks()
    }

    fn init_state(&mut self, params: &[ParamGrad]) -> Result<()> {
        self.inner.init_state(params)
    }

    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }

    fn lr(&self) -> f32 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.inner.set_lr(lr)
    }

    fn param_groups(&self) -> Option<&[ParamGroup]> {
        self.inner.param_groups()
    }

    fn set_param_groups(&mut self, groups: Vec<ParamGroup>) -> Result<()> {
        self.inner.set_param_groups(groups)
    }

    fn group_lrs(&self) -> Vec<f32> {
        self.inner.group_lrs()
    }

    fn set_group_lrs(&mut self, lrs: &[f32]) -> Result<()> {
        self.inner.set_group_lrs(lrs)
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        self.inner.state_dict()
    }

    fn snapshot(
        &self,
        copy: &mut dyn FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<crate::optim::StateSnapshot> {
        self.inner.snapshot(copy)
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        self.inner.load_state_dict(state)
    }
}
