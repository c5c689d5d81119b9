//! The FSDP unit: a `Module` that owns one FlatParameter; construction, wrapping and
//! accessors. The hooks around forward and backward are in `runtime.rs`.

use super::flat_param::FlatParameter;
use super::runtime::PendingGrad;
use super::scheduler::{RuntimeStats, Scheduler};
use super::{AutoWrapPolicy, FsdpConfig, MemoryStats, MixedPrecision, ShardingStrategy};
use crate::distributed::{CommStream, DeviceMesh, Group};
use crate::error::{Error, Result};
use crate::nn::{join_name, visit_parameters, Module, Parameter, Sequential};
use crate::optim::ParamGrad;
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;

/// State every unit of one rank shares.
#[derive(Clone)]
pub(super) struct RankState {
    /// The whole data-parallel world (gradient averaging is over all of it).
    pub(super) pg: Group,
    /// Ranks that split each FlatParameter: `pg` itself, or one node's ranks under hybrid
    /// sharding.
    pub(super) shard_pg: Group,
    /// Under hybrid sharding, the ranks holding the same shard on the other nodes.
    pub(super) replicate_pg: Option<Group>,
    pub(super) strategy: ShardingStrategy,
    pub(super) mem: Arc<Mutex<MemoryStats>>,
    pub(super) mp: MixedPrecision,
    /// Prefetch decisions and the communication stream, shared by the rank's units.
    pub(super) sched: Arc<Mutex<Scheduler>>,
    /// Fully qualified names of the ignored modules.
    ignored: Arc<Vec<String>>,
}

impl RankState {
    /// Whether the parameter or module `fqn` lies inside an ignored module.
    fn is_ignored(&self, fqn: &str) -> bool {
        self.ignored.iter().any(|m| {
            fqn == m
                || (fqn.len() > m.len()
                    && fqn.starts_with(m.as_str())
                    && fqn.as_bytes()[m.len()] == b'.')
        })
    }
}

/// Every parameter flattened so far on this rank, with its name and unit, to recognize
/// tied parameters (one tensor reachable under two names).
#[derive(Default)]
struct Seen(Vec<(Tensor, String, String)>);

/// `FullyShardedDataParallel`: wraps a module so its parameters are sharded across the
/// ranks of a process group and gathered only while it computes.
///
/// The outermost instance (built with [`FullyShardedDataParallel::new`]) is the root; the
/// `auto_wrap_policy` turns submodules into nested units first. Semantics follow PyTorch
/// FSDP1 (`torch/distributed/fsdp/fully_sharded_data_parallel.py`).
pub struct FullyShardedDataParallel {
    pub(super) module: Box<dyn Module>,
    pub(super) flat: FlatParameter,
    prefix: String,
    pub(super) is_root: bool,
    pub(super) rs: RankState,
    /// This unit's index in the rank's scheduler.
    pub(super) id: usize,
    /// The gradient reduction issued by the last backward, until the root's backward ends.
    pub(super) pending_grad: Option<PendingGrad>,
    /// The unit's parameters in visit order (tied ones under each name) and the index of
    /// the flattened parameter each one is.
    slots: Vec<(String, usize)>,
    /// False inside [`FullyShardedDataParallel::no_sync`]: backward accumulates the
    /// unsharded gradient locally instead of reducing it.
    pub(super) sync_grads: bool,
}

/// FSDP1's gradient divide factors for a data-parallel world of `dp` ranks
/// (`_get_gradient_predivide_factor`): `pre` is the largest power of two with
/// `pre * pre < dp` dividing `dp` (roughly `sqrt(dp)`); `post = dp / pre`. Dividing in two
/// steps keeps fp16 sums from overflowing and from underflowing.
pub fn gradient_divide_factors(dp: usize) -> (f32, f32) {
    let mut pre = 1usize;
    while dp % pre == 0 && dp / pre > pre {
        pre *= 2;
    }
    (pre as f32, dp as f32 / pre as f32)
}

impl FullyShardedDataParallel {
    /// Wraps `module` as the root unit on this rank's `pg`, first wrapping the submodules
    /// that `config.auto_wrap_policy` selects (bottom-up).
    ///
    /// Every rank must build the same module (same parameter names and shapes in the same
    /// order); the values of rank 0 are not broadcast (sync_module_states lands later), so
    /// build them from the same seed.
    ///
    /// # Errors
    /// `NotMaterialized` when a parameter has no data; `Fsdp` for non-f32 parameters, for
    /// hybrid groups that do not cover `pg`, and for a `device_mesh` that is not 2-D, comes
    /// with `hybrid_groups` or `ranks_per_node`, or with a non-hybrid strategy.
    pub fn new(mut module: Box<dyn Module>, pg: Group, config: FsdpConfig) -> Result<Self> {
        let (shard_pg, replicate_pg) = shard_and_replicate_groups(&pg, &config)?;
        let mp = config.mixed_precision.unwrap_or_default();
        mp.validate()?;
        super::config::check_device(config.device_id)?;
        let stream = CommStream::new(&format!("fsdp-comm-rank{}", pg.world_rank()))?;
        let mem = Arc::new(Mutex::new(MemoryStats::default()));
        let mut sched = Scheduler::new(
            stream,
            shard_pg.clone(),
            config.sharding_strategy.is_sharded(),
            mp,
            mem.clone(),
        );
        sched.backward_prefetch = config.backward_prefetch;
        sched.forward_prefetch = config.forward_prefetch;
        sched.limit_all_gathers = config.limit_all_gathers;
        sched.offload = config.cpu_offload.offload_params;
        let rs = RankState {
            pg,
            shard_pg,
            replicate_pg,
            strategy: config.sharding_strategy,
            mem,
            mp,
            sched: Arc::new(Mutex::new(sched)),
            ignored: Arc::new(config.ignored_modules.clone()),
        };
        let names = module_names(module.as_mut());
        if let Some(bad) = config.ignored_modules.iter().find(|m| !names.contains(m)) {
            return Err(Error::Fsdp(format!(
                "ignored_modules: the model has no submodule '{bad}'"
            )));
        }
        if config.sync_module_states {
            // Rank 0's values everywhere, before anything is flattened (FSDP1
            // `_sync_module_params_and_buffers`).
            let mut res: Result<()> = Ok(());
            visit_parameters(module.as_mut(), "", false, &mut |name, p| {
                if res.is_ok() {
                    res = match p.data() {
                        Ok(d) => rs.pg.broadcast(d, 0),
                        Err(_) => Err(Error::NotMaterialized {
                            name: name.to_string(),
                            state: "sync_module_states",
                        }),
                    };
                }
            });
            res?;
        }
        let mut seen = Seen::default();
        if let Some(policy) = &config.auto_wrap_policy {
            wrap_children(module.as_mut(), "", policy, &rs, &mut seen)?;
        }
        let mut root = Self::wrap_one(module, "", &rs, &mut seen)?;
        root.is_root = true;
        rs.sched.lock().set_root(root.id);
        Ok(root)
    }

    fn wrap_one(
        mut module: Box<dyn Module>,
        prefix: &str,
        rs: &RankState,
        seen: &mut Seen,
    ) -> Result<Self> {
        let mut params: Vec<(String, Tensor, bool)> = Vec::new();
        let mut slots: Vec<(String, usize)> = Vec::new();
        let mut bad: Result<()> = Ok(());
        visit_parameters(module.as_mut(), prefix, true, &mut |name, p| {
            if bad.is_err() || rs.is_ignored(name) {
                return;
            }
            let d = match p.data() {
                Ok(d) => d,
                Err(_) => {
                    bad = Err(Error::NotMaterialized {
                        name: name.to_string(),
                        state: "not materialized at wrap time",
                    });
                    return;
                }
            };
            // Tied parameters: flattened once; every name views the same elements.
            match seen.0.iter().find(|(t, _, _)| t.shares_storage(d)) {
                Some((t, first, unit)) if t.same_view(d) && unit == prefix => {
                    let idx = params.iter().position(|(n, _, _)| n == first).unwrap_or(0);
                    slots.push((name.to_string(), idx));
                }
                Some((_, first, unit)) => {
                    bad = Err(Error::Fsdp(format!(
                        "parameter '{name}' (unit '{prefix}') shares its storage with '{first}' (unit '{unit}'): tied parameters must be flattened into one FSDP unit; wrap a module that contains both"
                    )));
                }
                None => {
                    seen.0
                        .push((d.clone(), name.to_string(), prefix.to_string()));
                    slots.push((name.to_string(), params.len()));
                    params.push((name.to_string(), d.clone(), p.requires_grad));
                }
            }
        });
        bad?;
        let (rank, world) = if rs.strategy.is_sharded() {
            (rs.shard_pg.rank(), rs.shard_pg.size())
        } else {
            (0, 1)
        };
        let flat = FlatParameter::new(&params, rank, world)?;
        drop(params);
        let id = rs.sched.lock().register(&flat);
        let mut unit = FullyShardedDataParallel {
            module,
            flat,
            prefix: prefix.to_string(),
            is_root: false,
            rs: rs.clone(),
            sync_grads: true,
            id,
            pending_grad: None,
            slots,
        };
        // The originals now live in the FlatParameter: free them (sharded state).
        unit.point_params(None, false)?;
        if !rs.strategy.is_sharded() && !rs.mp.is_low_precision() && !rs.sched.lock().offload {
            // NoShard: the "shard" is the whole flat parameter; parameters view it for good
            // (with low-precision compute, unshard makes a rounded copy instead).
            let full = unit.flat.local_shard.clone();
            unit.point_params(Some(&full), false)?;
            unit.flat.unsharded = Some(full);
        }
        {
            let mut m = rs.mem.lock();
            m.param_shard_bytes += unit.flat.local_shard.nbytes();
            m.cpu_offload = rs.sched.lock().offload;
        }
        Ok(unit)
    }

    /// Points every original parameter's data (or grad) at its view of `buf`, or frees it.
    pub(super) fn point_params(&mut self, buf: Option<&Tensor>, grads: bool) -> Result<()> {
        let views = buf.map(|b| self.flat.views(b)).transpose()?;
        let slots = &self.slots;
        let rs = &self.rs;
        let mut i = 0;
        let mut bad: Result<()> = Ok(());
        visit_parameters(
            self.module.as_mut(),
            &self.prefix,
            true,
            &mut |name, p: &mut Parameter| {
                if bad.is_err() || rs.is_ignored(name) {
                    return;
                }
                let Some(&(_, k)) = slots.get(i).filter(|(n, _)| n == name) else {
                    bad = Err(Error::Fsdp(format!("parameter '{name}' was not flattened into this unit (module changed after wrapping)")));
                    return;
                };
                p.set_name(name);
                let v = views.as_ref().map(|v| v[k].clone());
                if grads {
                    p.set_grad(v);
                } else if let Err(e) = p.set_data(v) {
                    bad = Err(e);
                }
                i += 1;
            },
        );
        bad?;
        if i != self.slots.len() {
            return Err(Error::Fsdp(format!(
                "unit '{}' flattened {} parameters but its module now has {i}",
                self.prefix,
                self.slots.len()
            )));
        }
        Ok(())
    }

    /// Every unit of this rank (self first, then nested units in pre-order).
    pub fn for_each_unit(&mut self, f: &mut dyn FnMut(&mut FullyShardedDataParallel)) {
        f(self);
        walk_units(self.module.as_mut(), f);
    }

    /// What an optimizer steps on: views of every unit's local shard and gradient shard,
    /// one per run of trainable elements (frozen parameters and padding excluded, so they
    /// are never updated, not even by weight decay), then the trainable parameters of the
    /// ignored modules, whole. The same list at every step.
    pub fn optimizer_params(&mut self) -> Vec<ParamGrad> {
        let mut out = Vec::new();
        self.for_each_unit(&mut |u| {
            for &(start, len) in &u.flat.trainable_runs {
                // Views inside the chunk: in bounds by construction.
                if let Ok(param) = u.flat.local_shard.view(start, &[len]) {
                    let grad = u
                        .flat
                        .grad_shard
                        .as_ref()
                        .and_then(|g| g.view(start, &[len]).ok());
                    out.push(ParamGrad { param, grad });
                }
            }
        });
        self.visit_ignored(&mut |_, p| {
            if let (true, Ok(param)) = (p.requires_grad, p.data()) {
                out.push(ParamGrad {
                    param: param.clone(),
                    grad: p.grad().cloned(),
                });
            }
        });
        out
    }

    /// Visits the parameters of the ignored modules (whole on every rank, FSDP does not
    /// manage them; their gradients are local).
    pub fn visit_ignored(&mut self, f: &mut dyn FnMut(&str, &mut Parameter)) {
        if self.rs.ignored.is_empty() {
            return;
        }
        let rs = self.rs.clone();
        let prefix = self.prefix.clone();
        visit_parameters(self.module.as_mut(), &prefix, false, &mut |name, p| {
            if rs.is_ignored(name) {
                f(name, p)
            }
        });
    }

    /// Drops every sharded gradient, and the ignored modules' gradients
    /// (`zero_grad(set_to_none=True)`, PyTorch's default).
    pub fn zero_grad(&mut self) {
        let mem = self.rs.mem.clone();
        self.for_each_unit(&mut |u| {
            if let Some(g) = u.flat.grad_shard.take() {
                let mut m = mem.lock();
                m.grad_shard_bytes = m.grad_shard_bytes.saturating_sub(g.nbytes());
            }
        });
        self.visit_ignored(&mut |_, p| p.set_grad(None));
    }

    /// This rank's FSDP memory figures.
    pub fn memory_stats(&self) -> MemoryStats {
        *self.rs.mem.lock()
    }

    /// Starts a new peak window for [`MemoryStats`].
    pub fn reset_peak_memory_stats(&self) {
        self.rs.mem.lock().reset_peak();
    }

    /// This rank's communication counters (time waited on collectives, gathers issued and
    /// prefetched) since the last [`reset_runtime_stats`](Self::reset_runtime_stats).
    pub fn runtime_stats(&self) -> RuntimeStats {
        self.rs.sched.lock().stats
    }

    /// Zeroes the [`RuntimeStats`] counters.
    pub fn reset_runtime_stats(&self) {
        self.rs.sched.lock().stats = RuntimeStats::default();
    }

    /// The mixed-precision policy in use (all `None`: f32 throughout).
    pub fn mixed_precision(&self) -> MixedPrecision {
        self.rs.mp
    }

    /// `(name, index into the FlatParameter's params)` of every parameter name of this
    /// unit, in visit order: a tied parameter appears under each of its names.
    pub(super) fn slots(&self) -> &[(String, usize)] {
        &self.slots
    }

    /// This unit's FlatParameter.
    pub fn flat_param(&self) -> &FlatParameter {
        &self.flat
    }

    /// The wrapped module.
    pub fn module_mut(&mut self) -> &mut dyn Module {
        self.module.as_mut()
    }

    /// The strategy in use.
    pub fn sharding_strategy(&self) -> ShardingStrategy {
        self.rs.strategy
    }

    /// The process group.
    pub fn process_group(&self) -> &Group {
        &self.rs.pg
    }

    /// The group each FlatParameter is sharded over (the world, or a node under hybrid
    /// sharding).
    pub fn shard_group(&self) -> &Group {
        &self.rs.shard_pg
    }

    /// Whether this is the root unit.
    pub fn is_root(&self) -> bool {
        self.is_root
    }

    /// Fully qualified name of the wrapped module (`""` for the root).
    pub fn module_name(&self) -> &str {
        &self.prefix
    }

    /// Gathers every unit's full parameters and returns `(name, values)` in
    /// `named_parameters()` order; every rank must call it (it runs collectives).
    pub fn full_parameters(&mut self) -> Result<Vec<(String, Vec<f32>)>> {
        let mut infos = Vec::new();
        let mut res: Result<()> = Ok(());
        self.for_each_unit(&mut |u| {
            if res.is_err() {
                return;
            }
            res = (|| {
                let full = Tensor::zeros(&[u.flat.padded_numel()], DType::F32);
                if u.rs.strategy.is_sharded() {
                    u.rs.shard_pg
                        .all_gather_into_tensor(&full, &u.flat.local_shard)?;
                } else {
                    full.copy_from(&u.flat.local_shard)?;
                }
                let v = full.f32()?;
                for i in &u.flat.infos {
                    infos.push((i.fqn.clone(), v[i.offset..i.offset + i.numel].to_vec()));
                }
                Ok(())
            })();
        });
        res?;
        self.visit_ignored(&mut |name, p| {
            if let Ok(v) = p.data().and_then(|d| d.to_vec_f32()) {
                infos.push((name.to_string(), v));
            }
        });
        // Units are visited root-first; named_parameters() order is module pre-order.
        let order: Vec<String> = crate::nn::parameter_shapes(self)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        infos.sort_by_key(|(n, _)| order.iter().position(|o| o == n).unwrap_or(usize::MAX));
        Ok(infos)
    }
}

/// The (shard, replicate) groups of this rank for hybrid sharding with `ranks_per_node`
/// ranks per node: node `k` is world ranks `[k n, (k+1) n)`; the replicate group of local
/// rank `l` is `{l, l + n, l + 2n, ...}` (FSDP1's default for `HYBRID_SHARD`). These are the
/// groups of dims 1 and 0 of the mesh `init_device_mesh(world, [W / n, n], ["replicate",
/// "shard"])`, which builds them. A collective over `world`: every rank calls it.
///
/// # Errors
/// `InvalidArgument` when `ranks_per_node` is 0 or does not divide the world size.
pub fn hybrid_groups(world: &Group, ranks_per_node: usize) -> Result<(Group, Group)> {
    let w = world.size();
    if ranks_per_node == 0 || w % ranks_per_node != 0 {
        crate::error::bail_arg!("ranks per node {ranks_per_node} must divide the world size {w}");
    }
    let mesh = DeviceMesh::new(
        world.as_ref(),
        &[w / ranks_per_node, ranks_per_node],
        &["replicate", "shard"],
    )?;
    Ok((mesh.get_group(1)?, mesh.get_group(0)?))
}

/// The groups a root on world `pg` shards and replicates over: `pg` itself without hybrid
/// sharding; else `config.hybrid_groups`, the dims (1, 0) of `config.device_mesh`, or
/// [`hybrid_groups`] with `config.ranks_per_node` (default the whole world).
fn shard_and_replicate_groups(pg: &Group, config: &FsdpConfig) -> Result<(Group, Option<Group>)> {
    let mesh = config.device_mesh.as_ref();
    if !config.sharding_strategy.is_hybrid() {
        if mesh.is_some() {
            return Err(Error::Fsdp(format!(
                "device_mesh is for HybridShard and HybridShardZero2; with {:?} pass the group as pg",
                config.sharding_strategy
            )));
        }
        return Ok((pg.clone(), None));
    }
    let (s, r) = match (&config.hybrid_groups, mesh) {
        (None, None) => hybrid_groups(pg, config.ranks_per_node.unwrap_or(pg.size()))?,
        (Some(groups), None) => groups.clone(),
        (None, Some(m)) if m.ndim() == 2 && config.ranks_per_node.is_none() => {
            (m.get_group(1)?, m.get_group(0)?)
        }
        (_, Some(m)) => {
            return Err(Error::Fsdp(format!(
            "hybrid sharding takes a 2-D device_mesh (replicate, shard) alone, got a {}-D mesh{}{}",
            m.ndim(),
            if config.hybrid_groups.is_some() {
                " with hybrid_groups"
            } else {
                ""
            },
            if config.ranks_per_node.is_some() {
                " with ranks_per_node"
            } else {
                ""
            },
        )))
        }
    };
    if s.size() * r.size() != pg.size() {
        return Err(Error::Fsdp(format!(
            "hybrid groups of {} (shard) x {} (replicate) ranks do not cover the world of {}",
            s.size(),
            r.size(),
            pg.size()
        )));
    }
    Ok((s, Some(r)))
}

fn walk_units(m: &mut dyn Module, f: &mut dyn FnMut(&mut FullyShardedDataParallel)) {
    let _ = m.for_each_child(&mut |_, child| {
        match child
            .as_any_mut()
            .and_then(|a| a.downcast_mut::<FullyShardedDataParallel>())
        {
            Some(u) => {
                f(u);
                walk_units(u.module.as_mut(), f);
            }
            None => walk_units(child.as_mut(), f),
        }
        Ok(())
    });
}

fn wrap_children(
    m: &mut dyn Module,
    prefix: &str,
    policy: &AutoWrapPolicy,
    rs: &RankState,
    seen: &mut Seen,
) -> Result<()> {
    m.for_each_child(&mut |name, child| {
        let fqn = join_name(prefix, name);
        if rs.is_ignored(&fqn) {
            return Ok(());
        }
        wrap_children(child.as_mut(), &fqn, policy, rs, seen)?;
        if !child.is_fsdp_unit() && policy.should_wrap(child.as_mut()) {
            let inner = std::mem::replace(child, Box::new(Sequential::new(Vec::new())));
            *child = Box::new(FullyShardedDataParallel::wrap_one(inner, &fqn, rs, seen)?);
        }
        Ok(())
    })
}

/// Fully qualified names of every submodule below `m` (`named_modules()` without the root).
fn module_names(m: &mut dyn Module) -> Vec<String> {
    fn walk(m: &mut dyn Module, prefix: &str, out: &mut Vec<String>) {
        let _ = m.for_each_child(&mut |name, child| {
            let fqn = join_name(prefix, name);
            if !name.is_empty() {
                out.push(fqn.clone());
            }
            walk(child.as_mut(), &fqn, out);
            Ok(())
        });
    }
    let mut out = Vec::new();
    walk(m, "", &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::gradient_divide_factors;

    #[test]
    fn divide_factors_match_fsdp1() {
        assert_eq!(gradient_divide_factors(1), (1.0, 1.0));
        assert_eq!(gradient_divide_factors(2), (2.0, 1.0));
        assert_eq!(gradient_divide_factors(3), (2.0, 1.5));
        assert_eq!(gradient_divide_factors(4), (2.0, 2.0));
        assert_eq!(gradient_divide_factors(8), (4.0, 2.0));
        assert_eq!(gradient_divide_factors(16), (4.0, 4.0));
    }
}
