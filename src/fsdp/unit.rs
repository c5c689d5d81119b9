//! The FSDP unit: a `Module` that owns one FlatParameter and runs FSDP's hooks around its
//! wrapped module's forward and backward (FSDP1 `_runtime_utils.py`).
//!
//! ```text
//! forward:  unshard (all-gather) -> inner.forward -> reshard if the strategy frees after
//!           forward and this is not the root (or always, without grad)
//! backward: unshard if freed -> point grads at a zeroed flat grad buffer -> inner.backward
//!           -> reshard -> predivide -> reduce-scatter (NoShard: all-reduce) -> postdivide
//!           -> accumulate into the sharded grad
//! ```

use super::flat_param::FlatParameter;
use super::{AutoWrapPolicy, FsdpConfig, MemoryStats, ShardingStrategy};
use crate::backend::cpu::ops;
use crate::distributed::{DeviceMesh, Group, ReduceOp};
use crate::error::{Error, Result};
use crate::nn::{
    join_name, visit_parameters, ChildVisitor, Context, Module, Parameter, Sequential,
};
use crate::optim::ParamGrad;
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;

/// State every unit of one rank shares.
#[derive(Clone)]
struct RankState {
    /// The whole data-parallel world (gradient averaging is over all of it).
    pg: Group,
    /// Ranks that split each FlatParameter: `pg` itself, or one node's ranks under hybrid
    /// sharding.
    shard_pg: Group,
    /// Under hybrid sharding, the ranks holding the same shard on the other nodes.
    replicate_pg: Option<Group>,
    strategy: ShardingStrategy,
    mem: Arc<Mutex<MemoryStats>>,
}

/// `FullyShardedDataParallel`: wraps a module so its parameters are sharded across the
/// ranks of a process group and gathered only while it computes.
///
/// The outermost instance (built with [`FullyShardedDataParallel::new`]) is the root; the
/// `auto_wrap_policy` turns submodules into nested units first. Semantics follow PyTorch
/// FSDP1 (`torch/distributed/fsdp/fully_sharded_data_parallel.py`).
pub struct FullyShardedDataParallel {
    module: Box<dyn Module>,
    pub(super) flat: FlatParameter,
    prefix: String,
    pub(super) is_root: bool,
    rs: RankState,
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
        let rs = RankState {
            pg,
            shard_pg,
            replicate_pg,
            strategy: config.sharding_strategy,
            mem: Arc::new(Mutex::new(MemoryStats::default())),
        };
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
        if let Some(policy) = &config.auto_wrap_policy {
            wrap_children(module.as_mut(), "", policy, &rs)?;
        }
        let mut root = Self::wrap_one(module, "", &rs)?;
        root.is_root = true;
        Ok(root)
    }

    fn wrap_one(mut module: Box<dyn Module>, prefix: &str, rs: &RankState) -> Result<Self> {
        let mut params: Vec<(String, Tensor, bool)> = Vec::new();
        let mut missing: Option<String> = None;
        visit_parameters(
            module.as_mut(),
            prefix,
            true,
            &mut |name, p| match p.data() {
                Ok(d) => params.push((name.to_string(), d.clone(), p.requires_grad)),
                Err(_) => {
                    missing.get_or_insert_with(|| name.to_string());
                }
            },
        );
        if let Some(name) = missing {
            return Err(Error::NotMaterialized {
                name,
                state: "not materialized at wrap time",
            });
        }
        let (rank, world) = if rs.strategy.is_sharded() {
            (rs.shard_pg.rank(), rs.shard_pg.size())
        } else {
            (0, 1)
        };
        let flat = FlatParameter::new(&params, rank, world)?;
        drop(params);
        let mut unit = FullyShardedDataParallel {
            module,
            flat,
            prefix: prefix.to_string(),
            is_root: false,
            rs: rs.clone(),
            sync_grads: true,
        };
        // The originals now live in the FlatParameter: free them (sharded state).
        unit.point_params(None, false)?;
        if !rs.strategy.is_sharded() {
            // NoShard: the "shard" is the whole flat parameter; parameters view it for good.
            let full = unit.flat.local_shard.clone();
            unit.point_params(Some(&full), false)?;
            unit.flat.unsharded = Some(full);
        }
        rs.mem.lock().param_shard_bytes += unit.flat.local_shard.nbytes();
        Ok(unit)
    }

    /// Points every original parameter's data (or grad) at its view of `buf`, or frees it.
    fn point_params(&mut self, buf: Option<&Tensor>, grads: bool) -> Result<()> {
        let views = buf.map(|b| self.flat.views(b)).transpose()?;
        let infos = &self.flat.infos;
        let mut i = 0;
        let mut bad: Result<()> = Ok(());
        visit_parameters(
            self.module.as_mut(),
            &self.prefix,
            true,
            &mut |name, p: &mut Parameter| {
                if bad.is_err() {
                    return;
                }
                if infos.get(i).map(|x| x.fqn.as_str()) != Some(name) {
                    bad = Err(Error::Fsdp(format!("parameter '{name}' was not flattened into this unit (module changed after wrapping)")));
                    return;
                }
                p.set_name(name);
                let v = views.as_ref().map(|v| v[i].clone());
                if grads {
                    p.set_grad(v);
                } else if let Err(e) = p.set_data(v) {
                    bad = Err(e);
                }
                i += 1;
            },
        );
        bad?;
        if i != infos.len() {
            return Err(Error::Fsdp(format!(
                "unit '{}' flattened {} parameters but its module now has {i}",
                self.prefix,
                infos.len()
            )));
        }
        Ok(())
    }

    /// All-gathers the FlatParameter and points the parameters at it (no-op when already
    /// unsharded). FSDP1 `_unshard`.
    pub fn unshard(&mut self) -> Result<()> {
        if self.flat.unsharded.is_some() {
            return Ok(());
        }
        let full = Tensor::zeros(&[self.flat.padded_numel()], DType::F32);
        self.rs
            .shard_pg
            .all_gather_into_tensor(&full, &self.flat.local_shard)?;
        self.point_params(Some(&full), false)?;
        self.rs.mem.lock().on_unshard(full.nbytes());
        self.flat.unsharded = Some(full);
        Ok(())
    }

    /// Frees the unsharded buffer; parameters become unmaterialized. FSDP1 `_reshard`.
    /// A no-op under `NoShard`.
    pub fn reshard(&mut self) -> Result<()> {
        if !self.rs.strategy.is_sharded() {
            return Ok(());
        }
        if let Some(full) = self.flat.unsharded.take() {
            self.point_params(None, false)?;
            self.rs.mem.lock().on_reshard(full.nbytes());
        }
        Ok(())
    }

    /// Reduces the flat gradient over ranks and accumulates this rank's chunk into the
    /// sharded gradient (FSDP1 `_post_backward_hook` / `_reduce_grad`).
    fn reduce_grad(&mut self, flat_grad: Tensor) -> Result<()> {
        let pg = &self.rs.pg;
        // Averaging is over the whole data-parallel world, hybrid or not.
        let (pre, post) = gradient_divide_factors(pg.size());
        ops::scale_(&mut flat_grad.f32_mut()?, 1.0 / pre);
        let shard = if self.rs.strategy.is_sharded() {
            let out = Tensor::zeros(&[self.flat.shard_numel()], DType::F32);
            self.rs
                .shard_pg
                .reduce_scatter_tensor(&out, &flat_grad, ReduceOp::Sum)?;
            if let Some(rep) = &self.rs.replicate_pg {
                rep.all_reduce(&out, ReduceOp::Sum)?;
            }
            out
        } else {
            pg.all_reduce(&flat_grad, ReduceOp::Sum)?;
            flat_grad
        };
        ops::scale_(&mut shard.f32_mut()?, 1.0 / post);
        match &self.flat.grad_shard {
            Some(acc) => ops::add_(&mut acc.f32_mut()?, &shard.f32()?),
            None => {
                self.rs.mem.lock().grad_shard_bytes += shard.nbytes();
                self.flat.grad_shard = Some(shard);
            }
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
    /// are never updated, not even by weight decay). The same list at every step.
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
        out
    }

    /// Drops every sharded gradient (`zero_grad(set_to_none=True)`, PyTorch's default).
    pub fn zero_grad(&mut self) {
        let mem = self.rs.mem.clone();
        self.for_each_unit(&mut |u| {
            if let Some(g) = u.flat.grad_shard.take() {
                let mut m = mem.lock();
                m.grad_shard_bytes = m.grad_shard_bytes.saturating_sub(g.nbytes());
            }
        });
    }

    /// This rank's FSDP memory figures.
    pub fn memory_stats(&self) -> MemoryStats {
        *self.rs.mem.lock()
    }

    /// Starts a new peak window for [`MemoryStats`].
    pub fn reset_peak_memory_stats(&self) {
        self.rs.mem.lock().reset_peak();
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
) -> Result<()> {
    m.for_each_child(&mut |name, child| {
        let fqn = join_name(prefix, name);
        wrap_children(child.as_mut(), &fqn, policy, rs)?;
        if !child.is_fsdp_unit() && policy.should_wrap(child.as_mut()) {
            let inner = std::mem::replace(child, Box::new(Sequential::new(Vec::new())));
            *child = Box::new(FullyShardedDataParallel::wrap_one(inner, &fqn, rs)?);
        }
        Ok(())
    })
}

impl Module for FullyShardedDataParallel {
    fn type_name(&self) -> &'static str {
        "FullyShardedDataParallel"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.unshard()?;
        let y = self.module.forward(x, cx);
        let free = !cx.grad_enabled || (!self.is_root && self.rs.strategy.reshard_after_forward());
        if free || y.is_err() {
            self.reshard()?;
        }
        y
    }

    fn backward(&mut self, grad_out: &Tensor, cx: &Context) -> Result<Tensor> {
        self.unshard()?;
        // Layers accumulate (+=) into their grad views, so a gradient kept from backwards
        // under no_sync simply keeps growing.
        let flat_grad = match self.flat.unsynced_grad.take() {
            Some(g) => g,
            None => Tensor::zeros(&[self.flat.padded_numel()], DType::F32),
        };
        self.point_params(Some(&flat_grad), true)?;
        let dx = self.module.backward(grad_out, cx);
        self.point_params(None, true)?;
        self.reshard()?;
        let dx = dx?;
        if self.sync_grads {
            self.reduce_grad(flat_grad)?;
        } else {
            self.flat.unsynced_grad = Some(flat_grad);
        }
        Ok(dx)
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("", &mut self.module)
    }

    fn is_fsdp_unit(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
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
