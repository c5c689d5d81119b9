//! [`CandleFsdp`]: a candle model whose vars fsdp shards; each step gathers them into fresh
//! candle vars, lets candle run the forward and its autograd, and hands the gradients back.

use crate::error::{candle, Error, Result};
use crate::vars::{add_grad, declare, to_candle};
use crate::wrap::{VarTree, Wrap, UNIT_TYPE};
use candle::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use fsdp::checkpoint::CheckpointInfo;
use fsdp::distributed::Group;
use fsdp::fsdp::{
    AutoWrapPolicy, FsdpConfig, FullyShardedDataParallel, MemoryStats, StateDictType,
};
use fsdp::nn::Module;
use fsdp::optim::Optimizer;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The model builder: what a candle model's `new(vb)` is, called once at construction and
/// once per step (each time with a `VarBuilder` over that step's gathered vars).
pub type Builder<M> = dyn Fn(VarBuilder) -> candle::Result<M> + Send + Sync;

/// Where the model is in its step.
#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// No gradients held: the next call is a forward.
    Idle,
    /// Gradients of `backwards` backward passes are reduced into the shards and wait for
    /// [`CandleFsdp::step`].
    Grads { backwards: usize },
    /// A call failed inside a step's collectives (the reason); nothing works any more.
    Failed(String),
}

/// A candle-nn model trained with fully sharded data parallelism: fsdp owns the f32
/// master parameters as shards (1/W of each unit's FlatParameter per rank), their
/// gradient shards and, through [`step`](Self::step), the sharded optimizer state; the
/// user's model keeps its own forward and candle's autograd.
///
/// Each training step ([`forward_backward`](Self::forward_backward)):
/// 1. gathers every unit's parameters (fsdp's pre-forward hooks, unit by unit in forward
///    order) and copies them into fresh candle `Var`s;
/// 2. builds the model from a `VarBuilder` over those vars (the builder only looks tensors
///    up), runs the user's closure (forward and loss), and `loss.backward()`;
/// 3. hands each unit's gradients from candle's `GradStore` to fsdp, units in reverse
///    order (pre-backward, add into the gradient views, post-backward: the gradients are
///    reduce-scattered, averaged over all ranks), then ends fsdp's backward;
/// 4. drops the model, the vars, the graph and the gradients.
///
/// Between steps a rank holds only its shards. See "candle through fsdp" in
/// docs/embedding.md for what candle makes awkward (all gradients arrive at once, the graph keeps the
/// gathered parameters until backward, one copy each way).
///
/// One instance per rank; every rank makes the same calls in the same order (they run
/// collectives). Not for use from several threads at once.
pub struct CandleFsdp<M> {
    fsdp: FullyShardedDataParallel,
    build: Box<Builder<M>>,
    /// Unit paths in forward order.
    units: Vec<String>,
    /// Every var's name and shape, in builder order.
    vars: Vec<(String, Vec<usize>)>,
    phase: Phase,
}

impl<M> CandleFsdp<M> {
    /// Builds the model once with candle's initializers (each var as the builder's layers
    /// initialize it), splits its vars into units by `wrap`, and shards them over `pg`.
    /// Ranks draw different random values; rank 0's are broadcast to all
    /// (`sync_module_states` is always on). A collective: every rank calls it.
    ///
    /// `config` is fsdp's: strategy (full-shard, shard-grad-op, no-shard, hybrid with
    /// `ranks_per_node`, `hybrid_groups` or `device_mesh`), prefetch, CPU offload.
    ///
    /// # Errors
    /// `InvalidArgument` for a config this adapter cannot honour (an `auto_wrap_policy`:
    /// units come from `wrap`; low-precision `mixed_precision`; a CUDA `device_id`;
    /// `ignored_modules`), a bad `wrap`, or ranks that built different models; `Candle`
    /// when the builder fails; fsdp's errors from sharding.
    pub fn new<F>(build: F, wrap: &Wrap, pg: Group, config: FsdpConfig) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle::Result<M> + Send + Sync + 'static,
    {
        Self::declare(Box::new(build), VarMap::new(), true, wrap, pg, config)
    }

    /// As [`new`](Self::new), with the initial values taken from `init` (e.g. filled by
    /// `VarMap::load` from a safetensors file, or by a first build of the model): every var
    /// the builder asks for must be in it with its shape, and it may hold no other var.
    /// Rank 0's values are broadcast. The adapter keeps no reference to `init`: drop it to
    /// free the full-size values.
    ///
    /// # Errors
    /// As [`new`](Self::new); `Candle` naming a var the builder asks for that `init` lacks;
    /// `InvalidArgument` naming a var of `init` the builder never asks for.
    pub fn from_varmap<F>(
        build: F,
        init: &VarMap,
        wrap: &Wrap,
        pg: Group,
        config: FsdpConfig,
    ) -> Result<Self>
    where
        F: Fn(VarBuilder) -> candle::Result<M> + Send + Sync + 'static,
    {
        Self::declare(Box::new(build), init.clone(), false, wrap, pg, config)
    }

    fn declare(
        build: Box<Builder<M>>,
        map: VarMap,
        create: bool,
        wrap: &Wrap,
        pg: Group,
        config: FsdpConfig,
    ) -> Result<Self> {
        check_config(&config)?;
        let declared = declare(build.as_ref(), map, create)?;
        let vars: Vec<(String, Vec<usize>)> = declared
            .iter()
            .map(|d| (d.name.clone(), d.shape.clone()))
            .collect();
        let names: Vec<String> = vars.iter().map(|(n, _)| n.clone()).collect();
        let units = wrap.units(&names)?;
        crate::agree::same_model(&pg, &vars, &units)?;
        let mut tensors = Vec::with_capacity(declared.len());
        for d in declared {
            tensors.push((d.name, fsdp::tensor::Tensor::from_vec(d.values, &d.shape)?));
        }
        let tree = VarTree::build(tensors, &units);
        let policy =
            AutoWrapPolicy::Custom(Arc::new(|m: &dyn Module, _| m.type_name() == UNIT_TYPE));
        let config = FsdpConfig {
            auto_wrap_policy: Some(policy),
            sync_module_states: true,
            ..config
        };
        let fsdp = FullyShardedDataParallel::new(Box::new(tree), pg, config)?;
        Ok(CandleFsdp {
            fsdp,
            build,
            units,
            vars,
            phase: Phase::Idle,
        })
    }

    /// One training forward and backward: `f` gets the model built over this step's
    /// gathered vars and returns the loss (a scalar, the mean over this rank's part of the
    /// batch); candle's backward computes the gradients, which fsdp reduce-scatters and
    /// averages over the ranks into the gradient shards. Returns this rank's loss value.
    /// Then call [`step`](Self::step).
    ///
    /// An error of this rank's own part (the builder, the closure, a loss that is not a
    /// scalar or has no gradient path, candle's backward) is exchanged before any
    /// collective of the backward: every rank returns `PassFailed` naming the failed
    /// rank(s) and their errors, nothing changes, and the next pass trains as if this one
    /// had not been made. An error of fsdp's collectives cannot be taken back: this rank
    /// aborts its process group, so the peers fail at once rather than wait, and the model
    /// is unusable afterwards (`Error::Failed`).
    ///
    /// # Errors
    /// `OutOfOrder` when the last backward's gradients still wait for `step` (nothing is
    /// done); `PassFailed` when the builder, the closure or candle's backward failed on any
    /// rank, or a rank's loss is not a scalar or depends on no var; fsdp's collective
    /// errors; `Failed` after an earlier failure.
    pub fn forward_backward<F>(&mut self, f: F) -> Result<f32>
    where
        F: FnOnce(&M) -> candle::Result<Tensor>,
    {
        self.live("forward_backward")?;
        if let Phase::Grads { backwards } = self.phase {
            return Err(Error::OutOfOrder {
                call: "forward_backward",
                reason: format!(
                    "the gradients of {backwards} backward pass(es) wait for step() (or zero_grad()); forward_backward_accumulate adds another micro-batch's gradients to them"
                ),
            });
        }
        self.train_pass(f)
    }

    /// [`forward_backward`](Self::forward_backward) that adds this micro-batch's gradients
    /// to those of the backward passes since the last step (gradient accumulation; scale
    /// each loss by 1/K for the mean over K micro-batches). Each pass reduces its
    /// gradients (fsdp's `no_sync` is not used).
    ///
    /// # Errors
    /// As [`forward_backward`](Self::forward_backward), without the `OutOfOrder` case.
    pub fn forward_backward_accumulate<F>(&mut self, f: F) -> Result<f32>
    where
        F: FnOnce(&M) -> candle::Result<Tensor>,
    {
        self.live("forward_backward_accumulate")?;
        self.train_pass(f)
    }

    fn train_pass<F>(&mut self, f: F) -> Result<f32>
    where
        F: FnOnce(&M) -> candle::Result<Tensor>,
    {
        match self.train_pass_inner(f) {
            Ok(loss) => {
                let backwards = match self.phase {
                    Phase::Grads { backwards } => backwards + 1,
                    _ => 1,
                };
                self.phase = Phase::Grads { backwards };
                Ok(loss)
            }
            // Every rank skipped the pass before its collectives: the step holds what it
            // held.
            Err(e @ Error::PassFailed { .. }) => Err(e),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn train_pass_inner<F>(&mut self, f: F) -> Result<f32>
    where
        F: FnOnce(&M) -> candle::Result<Tensor>,
    {
        let mut vars = self.gather(true)?;
        // The builder, the closure and candle's backward run on this rank alone; the ranks
        // agree that all of them succeeded before any collective of the backward (see
        // `status.rs`), with the root still inside its forward and nothing in flight.
        let local = self.local_pass(&vars, f);
        let failure = local.as_ref().err().map(ToString::to_string);
        let agreed = crate::status::every_rank_ok(self.fsdp.process_group(), failure);
        // A failed forward owes no backward: the root's post_forward frees every unit's
        // gathered parameters (shard-grad-op's too, which an optimizer step before the
        // next forward would leave stale).
        self.fsdp.post_forward(agreed.is_ok())?;
        agreed?;
        let (value, mut grads) = local?;
        // Reverse forward order, as autograd would reach the units; each unit's candle
        // tensors and gradients are dropped once handed over.
        let mut take = |views: Vec<(String, fsdp::tensor::Tensor)>| -> Result<()> {
            for (name, view) in views {
                let Some(t) = vars.remove(&name) else {
                    continue;
                };
                if let Some(g) = grads.remove(&t) {
                    add_grad(&name, &view, &g)?;
                }
            }
            Ok(())
        };
        let fsdp = &mut self.fsdp;
        fsdp.pre_backward()?;
        for u in self.units.iter().rev() {
            fsdp.with_unit(u, |u| -> Result<()> {
                u.pre_backward()?;
                let r = u.grad_views().map_err(Error::from).and_then(&mut take);
                u.post_backward(r.is_ok())?;
                r
            })??;
        }
        let r = fsdp.grad_views().map_err(Error::from).and_then(&mut take);
        fsdp.post_backward(r.is_ok())?;
        r?;
        fsdp.finish_backward()?;
        Ok(value)
    }

    /// This rank's part of a training pass, between the gathers and the backward's
    /// collectives: builds the model over `vars`, runs `f`, checks the loss and runs
    /// candle's backward. Returns the loss value and the gradients.
    ///
    /// # Errors
    /// `Candle` from the builder, `f`, reading the loss or the backward;
    /// `InvalidArgument` when the loss is not a scalar or depends on no var.
    fn local_pass<F>(
        &self,
        vars: &HashMap<String, Tensor>,
        f: F,
    ) -> Result<(f32, candle::backprop::GradStore)>
    where
        F: FnOnce(&M) -> candle::Result<Tensor>,
    {
        let vb = VarBuilder::from_tensors(vars.clone(), DType::F32, &Device::Cpu);
        let model = (self.build)(vb).map_err(candle("the model builder"))?;
        let loss = f(&model).map_err(candle("the forward/loss closure"))?;
        drop(model);
        if loss.rank() != 0 {
            return Err(Error::InvalidArgument(format!(
                "the closure returned a loss of shape {:?}; return a scalar (e.g. candle_nn::loss::mse, or .mean_all())",
                loss.dims()
            )));
        }
        let value = loss
            .to_dtype(DType::F32)
            .and_then(|l| l.to_scalar::<f32>())
            .map_err(candle("reading the loss"))?;
        let grads = loss.backward().map_err(candle("loss.backward()"))?;
        drop(loss);
        if !vars.values().any(|t| grads.get(t).is_some()) {
            return Err(Error::InvalidArgument(
                "the loss depends on no var of the model (detached, or computed without it): there is no gradient to reduce".into(),
            ));
        }
        Ok((value, grads))
    }

    /// Gathers every unit and copies its parameters into candle tensors (vars when
    /// `grad`), by var name. Under strategies that free parameters after the forward
    /// (full-shard, hybrid) each nested unit's gathered buffer is freed as soon as its copy
    /// is made (the root's at the backward, as FSDP keeps the root's); without `grad`
    /// every unit's, the root's included. The root stays inside its forward: the caller
    /// ends it with the root's `post_forward`.
    fn gather(&mut self, grad: bool) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(self.vars.len());
        let mut copy = |views: Vec<(String, fsdp::tensor::Tensor)>| -> Result<()> {
            for (name, view) in views {
                out.insert(name, to_candle(&view, grad)?);
            }
            Ok(())
        };
        let fsdp = &mut self.fsdp;
        fsdp.pre_forward(grad)?;
        // The root's own vars (those of no unit), then each unit's.
        fsdp.param_views()
            .map_err(Error::from)
            .and_then(&mut copy)?;
        for u in &self.units {
            fsdp.with_unit(u, |u| -> Result<()> {
                u.pre_forward(grad)?;
                let r = u.param_views().map_err(Error::from).and_then(&mut copy);
                u.post_forward(r.is_ok())?;
                r
            })??;
        }
        Ok(out)
    }

    /// Runs `f` on the model built over gathered parameters without autograd (no vars, no
    /// graph; every unit's gathered buffer is freed after its copy): evaluation,
    /// generation. Gradients waiting for a step are left as they are.
    ///
    /// # Errors
    /// `Candle` from the builder or `f` (the model stays usable: the collectives were
    /// over); fsdp's collective errors (then `Failed` as in
    /// [`forward_backward`](Self::forward_backward)).
    pub fn eval<R, F>(&mut self, f: F) -> Result<R>
    where
        F: FnOnce(&M) -> candle::Result<R>,
    {
        self.live("eval")?;
        let gathered = self.gather(false).and_then(|v| {
            self.fsdp.post_forward(true)?;
            Ok(v)
        });
        let vars = match gathered {
            Ok(v) => v,
            Err(e) => return Err(self.fail(e)),
        };
        let vb = VarBuilder::from_tensors(vars, DType::F32, &Device::Cpu);
        let model = (self.build)(vb).map_err(candle("the model builder"))?;
        f(&model).map_err(candle("the eval closure"))
    }

    /// Applies `opt` (an fsdp optimizer: SGD, Adam, AdamW) to this rank's parameter
    /// shards with their gradient shards, then drops the gradients (as candle's
    /// `Optimizer::backward_step` leaves none behind). The optimizer's state is sharded
    /// like the parameters; pass the same optimizer at every step.
    ///
    /// # Errors
    /// `OutOfOrder` when no backward ran since the last step (nothing would be applied);
    /// the optimizer's error (gradients are kept then).
    pub fn step(&mut self, opt: &mut dyn Optimizer) -> Result<()> {
        self.live("step")?;
        if self.phase == Phase::Idle {
            return Err(Error::OutOfOrder {
                call: "step",
                reason: "no gradients since the last step: call forward_backward first".into(),
            });
        }
        opt.step(&self.fsdp.optimizer_params())?;
        self.fsdp.zero_grad();
        self.phase = Phase::Idle;
        Ok(())
    }

    /// Drops the gradients waiting for a step (a skipped step).
    ///
    /// # Errors
    /// `Failed` after an earlier failure.
    pub fn zero_grad(&mut self) -> Result<()> {
        self.live("zero_grad")?;
        self.fsdp.zero_grad();
        self.phase = Phase::Idle;
        Ok(())
    }

    /// Clips the gradients waiting for a step to a total `norm_type` norm of at most
    /// `max_norm` over all ranks' shards (`clip_grad_norm_`, a collective) and returns the
    /// norm before clipping.
    ///
    /// # Errors
    /// `OutOfOrder` without gradients; fsdp's errors (then `Failed`).
    pub fn clip_grad_norm(&mut self, max_norm: f32, norm_type: f32) -> Result<f32> {
        self.live("clip_grad_norm")?;
        if self.phase == Phase::Idle {
            return Err(Error::OutOfOrder {
                call: "clip_grad_norm",
                reason: "no gradients since the last step: call forward_backward first".into(),
            });
        }
        self.fsdp
            .clip_grad_norm_(max_norm, norm_type)
            .map_err(|e| self.fail(e.into()))
    }

    /// Saves the model and, when given, `opt` as an fsdp checkpoint in `dir` (`Sharded`:
    /// every rank writes its pieces; `Full`: rank 0 writes one safetensors file whose keys
    /// are the candle var names). `extra` is kept in the index (a step counter). Loads at
    /// any world size and strategy. A collective.
    ///
    /// # Errors
    /// fsdp's checkpoint errors (every rank gets one; the previous checkpoint in `dir`
    /// stays).
    pub fn save_checkpoint(
        &mut self,
        dir: &Path,
        opt: Option<&dyn Optimizer>,
        ty: StateDictType,
        extra: serde_json::Value,
    ) -> Result<()> {
        self.live("save_checkpoint")?;
        Ok(fsdp::checkpoint::save_checkpoint(
            dir,
            &mut self.fsdp,
            opt,
            ty,
            extra,
        )?)
    }

    /// Loads a checkpoint saved by [`save_checkpoint`](Self::save_checkpoint) at any world
    /// size and strategy into the shards and, when given, `opt`. A collective; nothing
    /// changes on any rank unless every rank's part checked out.
    ///
    /// # Errors
    /// `OutOfOrder` while gradients wait for a step (they belong to the old values);
    /// fsdp's checkpoint errors.
    pub fn load_checkpoint(
        &mut self,
        dir: &Path,
        opt: Option<&mut dyn Optimizer>,
    ) -> Result<CheckpointInfo> {
        self.live("load_checkpoint")?;
        if self.phase != Phase::Idle {
            return Err(Error::OutOfOrder {
                call: "load_checkpoint",
                reason: "gradients of the current values wait for step() or zero_grad()".into(),
            });
        }
        Ok(fsdp::checkpoint::load_checkpoint(dir, &mut self.fsdp, opt)?)
    }

    /// The full trained parameters as a candle `VarMap` (f32, on the CPU), on every rank:
    /// for inference with the plain candle model or `VarMap::save`. Gathers everything (a
    /// collective) and holds the full model on each rank while it lives.
    ///
    /// # Errors
    /// fsdp's collective errors (then `Failed`); `Candle` on allocation failure.
    pub fn to_varmap(&mut self) -> Result<VarMap> {
        self.live("to_varmap")?;
        let full = self
            .fsdp
            .full_parameters()
            .map_err(|e| self.fail(e.into()))?;
        let shapes: HashMap<&str, &[usize]> = self
            .vars
            .iter()
            .map(|(n, s)| (n.as_str(), &s[..]))
            .collect();
        let map = VarMap::new();
        {
            let mut data = map
                .data()
                .lock()
                .map_err(|_| Error::InvalidArgument("the VarMap's lock is poisoned".into()))?;
            for (name, values) in full {
                let shape = shapes.get(name.as_str()).copied().unwrap_or(&[]);
                let var = Var::from_vec(values, shape, &Device::Cpu)
                    .map_err(candle("building the VarMap"))?;
                data.insert(name, var);
            }
        }
        Ok(map)
    }

    /// The unit paths, in forward order (the root, holding every var of no unit, is not
    /// listed).
    pub fn units(&self) -> &[String] {
        &self.units
    }

    /// Every var's `(name, shape)`, in the order the builder asks for them.
    pub fn vars(&self) -> &[(String, Vec<usize>)] {
        &self.vars
    }

    /// Elements of all vars together (the unsharded parameter count).
    pub fn num_params(&self) -> usize {
        self.vars
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// This rank's fsdp memory figures: parameter shard bytes, gradient shard bytes (while
    /// gradients wait for a step), gathered bytes now and at peak.
    pub fn memory_stats(&self) -> MemoryStats {
        self.fsdp.memory_stats()
    }

    /// The name and whole shape of the parameter behind each entry the optimizer steps on
    /// (this rank's pieces), for parameter groups such as
    /// [`no_decay_groups`](fsdp::optim::no_decay_groups).
    pub fn optimizer_param_names(&mut self) -> Vec<(String, Vec<usize>)> {
        self.fsdp.optimizer_param_names()
    }

    /// The fsdp root underneath (process group, strategy, flat parameters), read-only:
    /// the hooks are the adapter's to drive.
    pub fn fsdp(&self) -> &FullyShardedDataParallel {
        &self.fsdp
    }

    fn live(&self, call: &'static str) -> Result<()> {
        match &self.phase {
            Phase::Failed(why) => Err(Error::Failed(format!("{call} after: {why}"))),
            _ => Ok(()),
        }
    }

    /// Records `e` as fatal, aborts the process group so no peer waits on this rank, and
    /// returns `e`.
    fn fail(&mut self, e: Error) -> Error {
        let why = e.to_string();
        self.fsdp
            .process_group()
            .abort(&format!("fsdp-candle: a rank failed mid-step: {why}"));
        self.phase = Phase::Failed(why);
        e
    }
}

/// Refuses what the adapter cannot honour.
fn check_config(c: &FsdpConfig) -> Result<()> {
    let bad = |why: &str| Err(Error::InvalidArgument(why.to_string()));
    if c.auto_wrap_policy.is_some() {
        return bad(
            "FsdpConfig::auto_wrap_policy: the units come from the Wrap argument; leave it unset",
        );
    }
    if c.mixed_precision
        .is_some_and(|m| m.compute_dtype() != fsdp::tensor::DType::F32)
    {
        return bad("FsdpConfig::mixed_precision with a low-precision param_dtype: candle computes in the dtype of its tensors; cast inside the model instead (the vars stay f32)");
    }
    if c.device_id.is_some_and(|d| d.is_cuda()) {
        return bad("FsdpConfig::device_id cuda: fsdp-candle trains on the CPU (see docs/embedding.md, \"candle through fsdp\": CUDA, not built)");
    }
    if !c.ignored_modules.is_empty() {
        return bad("FsdpConfig::ignored_modules: every var of a candle model is sharded; keep a var out of the model instead");
    }
    Ok(())
}
