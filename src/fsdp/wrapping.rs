//! Building FSDP units: `FullyShardedDataParallel::new` wraps the submodules the
//! auto-wrap policy picks (bottom-up), then the root; each unit's parameters are
//! materialized if needed (deferred init), checked for ties, and flattened (FSDP1
//! `_init_utils.py`, `wrap.py`).

use super::flat_param::FlatParameter;
use super::scheduler::Scheduler;
use super::streams::Streams;
use super::unit::RankState;
use super::{AutoWrapPolicy, FsdpConfig, FullyShardedDataParallel, MemoryStats};
use crate::backend::Device;
use crate::distributed::{DeviceMesh, Group};
use crate::error::{Error, Result, Term};
use crate::nn::{
    first_fsdp_unit, join_name, visit_all, visit_parameters, CheckpointWrapper, Module, Sequential,
};
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::sync::Arc;

/// What wrapping has seen so far on this rank: every parameter flattened, with its name and
/// unit, to recognize tied parameters (one tensor reachable under two names); and the bytes
/// of materialized parameters, to report the peak at init.
#[derive(Default)]
struct Seen {
    params: Vec<(Tensor, String, String)>,
    live_bytes: usize,
    peak_bytes: usize,
}

/// Bytes of the distinct materialized (non-meta) parameter storages among `tensors`.
fn materialized_bytes(tensors: &[Tensor]) -> usize {
    let mut uniq: Vec<&Tensor> = Vec::new();
    for t in tensors {
        if t.device() != Device::Meta && !uniq.iter().any(|u| u.same_view(t)) {
            uniq.push(t);
        }
    }
    uniq.iter().map(|t| t.nbytes()).sum()
}

impl FullyShardedDataParallel {
    /// Wraps `module` as the root unit on this rank's `pg`, first wrapping the submodules
    /// that `config.auto_wrap_policy` selects (bottom-up).
    ///
    /// Every rank must build the same module (same parameter names and shapes in the same
    /// order) with the same values: from the same seed, on the meta device (each rank then
    /// computes only its shard), or with `sync_module_states` (rank 0's values broadcast).
    ///
    /// # Errors
    /// `Fsdp` when the module has no parameters (ignored modules aside; see [Note: a model
    /// without parameters] in `wrapping.rs`); `InvalidArgument` for an empty or repeated
    /// parameter or child name ([`check_names`](crate::nn::check_names)). `NotMaterialized` when a parameter has no
    /// data; `Fsdp` for non-f32 parameters, for
    /// hybrid groups that do not cover `pg`, and for a `device_mesh` that is not 2-D, comes
    /// with `hybrid_groups` or `ranks_per_node`, or with a non-hybrid strategy.
    pub fn new(mut module: Box<dyn Module>, pg: Group, config: FsdpConfig) -> Result<Self> {
        // Names first: two parameters under one name would share one state-dict entry.
        crate::nn::check_names(module.as_mut())?;
        let (shard_pg, replicate_pg) = shard_and_replicate_groups(&pg, &config)?;
        let mp = config.mixed_precision.unwrap_or_default();
        mp.validate()?;
        let device = super::config::check_device(config.device_id)?;
        // The unshard, post-backward and pre-unshard streams: their all-gathers, copies
        // and reductions overlap the rank's compute (on CUDA, streams of their own charged
        // to the rank's account).
        let sharded = config.sharding_strategy.is_sharded();
        let streams = Streams::new(
            pg.world_rank(),
            device,
            &pg,
            &shard_pg,
            sharded,
            config.cpu_offload.offload_params,
        )?;
        let mem = Arc::new(Mutex::new(MemoryStats::default()));
        let mut sched = Scheduler::new(
            streams,
            shard_pg.clone(),
            config.sharding_strategy.is_sharded(),
            mp,
            mem.clone(),
            device,
        );
        sched.backward_prefetch = config.backward_prefetch;
        sched.forward_prefetch = config.forward_prefetch;
        sched.limit_all_gathers = config.limit_all_gathers;
        let rs = RankState {
            pg,
            shard_pg,
            replicate_pg,
            strategy: config.sharding_strategy,
            mem,
            mp,
            sched: Arc::new(Mutex::new(sched)),
            ignored: Arc::new(config.ignored_modules.clone()),
            param_init_fn: config.param_init_fn.clone(),
            sync_module_states: config.sync_module_states,
            device,
        };
        let names = module_names(module.as_mut());
        if let Some(bad) = config.ignored_modules.iter().find(|m| !names.contains(m)) {
            return Err(Error::Fsdp(format!(
                "ignored_modules: the model has no submodule '{bad}'"
            )));
        }
        check_has_parameters(module.as_mut(), &rs)?;
        let mut all = Vec::new();
        let mut meta_ignored = None;
        visit_all(module.as_mut(), |name, p| {
            if let Ok(d) = p.data() {
                if meta_ignored.is_none() && d.device() == Device::Meta && rs.is_ignored(name) {
                    meta_ignored = Some(name.to_string());
                }
                all.push(d.clone());
            }
        });
        if let Some(name) = meta_ignored {
            return Err(Error::Fsdp(format!(
                "parameter '{name}' of an ignored module is on the meta device: FSDP leaves ignored modules as they are (it neither materializes nor syncs them), so materialize it before wrapping (fsdp::nn::materialize)"
            )));
        }
        let mut seen = Seen {
            live_bytes: materialized_bytes(&all),
            ..Seen::default()
        };
        seen.peak_bytes = seen.live_bytes;
        drop(all);
        if let Some(policy) = &config.auto_wrap_policy {
            wrap_children(module.as_mut(), "", policy, &rs, &mut seen)?;
        }
        check_checkpoint_boundaries(module.as_mut(), "")?;
        let mut root = Self::wrap_one(module, "", &rs, &mut seen)?;
        root.is_root = true;
        rs.sched.lock().set_root(root.id);
        rs.mem.lock().init_peak_bytes = seen.peak_bytes;
        Ok(root)
    }

    fn wrap_one(
        mut module: Box<dyn Module>,
        prefix: &str,
        rs: &RankState,
        seen: &mut Seen,
    ) -> Result<Self> {
        let own = |m: &mut dyn Module| -> Result<Vec<Tensor>> {
            let mut v = Vec::new();
            visit_parameters(m, prefix, true, &mut |name, p| {
                if !rs.is_ignored(name) {
                    v.extend(p.data().ok().cloned())
                }
                Ok(())
            })?;
            Ok(v)
        };
        let before = own(module.as_mut())?;
        let before_bytes = materialized_bytes(&before);
        if let Some(init) = &rs.param_init_fn {
            if before.iter().any(|t| t.device() == Device::Meta) {
                // FSDP1 `_materialize_with_param_init_fn`: the user's init for this module,
                // nested units out of its reach.
                super::materialize::call_param_init_fn(module.as_mut(), prefix, init)?;
            }
        }
        drop(before);
        // Buffers are not flattened: they stay whole in the module, on the compute device
        // (FSDP1 `_move_module_to_device` moves them with `device_id`).
        let dev = rs.device;
        crate::nn::visit_buffers(module.as_mut(), prefix, true, &mut |name, b| {
            if !rs.is_ignored(name) && b.data.device() != dev && b.data.device() != Device::Meta {
                b.data = b.data.to_device(dev)?;
            }
            Ok(())
        })?;
        if rs.sync_module_states {
            // Rank 0's values everywhere, before flattening.
            super::materialize::sync_module_states(module.as_mut(), prefix, rs)?;
        }
        let after = materialized_bytes(&own(module.as_mut())?);
        seen.live_bytes += after.saturating_sub(before_bytes);
        seen.peak_bytes = seen.peak_bytes.max(seen.live_bytes);
        let mut params: Vec<(String, Tensor, bool)> = Vec::new();
        let mut slots: Vec<(String, usize)> = Vec::new();
        visit_parameters(module.as_mut(), prefix, true, &mut |name, p| {
            if rs.is_ignored(name) {
                return Ok(());
            }
            let d = p.data().map_err(|_| Error::NotMaterialized {
                name: name.to_string(),
                state: "not materialized at wrap time",
            })?;
            // Tied parameters: flattened once; every name views the same elements.
            match seen.params.iter().find(|(t, _, _)| t.shares_storage(d)) {
                Some((t, first, unit)) if t.same_view(d) && unit == prefix => {
                    let idx = params.iter().position(|(n, _, _)| n == first).unwrap_or(0);
                    slots.push((name.to_string(), idx));
                }
                Some((_, first, unit)) => {
                    return Err(Error::Fsdp(format!(
                        "parameter '{name}' (unit '{prefix}') shares its storage with '{first}' (unit '{unit}'): tied parameters must be flattened into one FSDP unit; wrap a module that contains both"
                    )));
                }
                None => {
                    seen.params
                        .push((d.clone(), name.to_string(), prefix.to_string()));
                    slots.push((name.to_string(), params.len()));
                    params.push((name.to_string(), d.clone(), p.requires_grad));
                }
            }
            Ok(())
        })?;
        let (rank, world) = if rs.strategy.is_sharded() {
            (rs.shard_pg.rank(), rs.shard_pg.size())
        } else {
            (0, 1)
        };
        let mut flat = FlatParameter::new(&params, rank, world)?;
        if flat.dtype() == DType::F64 && (rs.mp.is_low_precision() || rs.mp.reduce_dtype.is_some())
        {
            return Err(Error::Unsupported(format!(
                "MixedPrecision param_dtype/reduce_dtype with the f64 parameters of unit '{prefix}' (an f64 FlatParameter computes and reduces in f64)"
            )));
        }
        if !rs.sched.lock().offload() {
            // device_id: the shard lives on the compute device (on the host under offload).
            flat.move_shard_to(rs.device)?;
        } else if let Device::Cuda(i) = rs.device {
            // Offloaded on a GPU: in pinned host memory, copied to the device
            // asynchronously.
            flat.pin_shard(i)?;
        }
        // Peak at init: the originals are still alive next to every shard made so far.
        let shards = rs.mem.lock().param_shard_bytes + flat.local_shard.nbytes();
        seen.peak_bytes = seen.peak_bytes.max(seen.live_bytes + shards);
        let own_bytes =
            materialized_bytes(&params.iter().map(|(_, t, _)| t.clone()).collect::<Vec<_>>());
        drop(params);
        let id = rs.sched.lock().register(&flat, prefix);
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
            phase: super::phase::UnitPhase::Idle,
            input_cast: false,
            _pool_user: crate::tensor::PoolUser::new(),
        };
        // The originals now live in the FlatParameter: free them (sharded state).
        unit.point_params(None, false)?;
        if rs.keeps_unsharded() {
            // NoShard: the "shard" is the whole flat parameter; parameters view it for good
            // (with low-precision compute, unshard makes a rounded copy instead).
            let full = unit.flat.local_shard.clone();
            unit.point_params(Some(&full), false)?;
            rs.sched.lock().set_unsharded(unit.id, full);
        }
        // The originals are freed (FSDP held the last reference to them).
        seen.live_bytes = seen.live_bytes.saturating_sub(own_bytes);
        {
            let mut m = rs.mem.lock();
            m.param_shard_bytes += unit.flat.local_shard.nbytes();
            m.cpu_offload = rs.sched.lock().offload();
        }
        Ok(unit)
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
        crate::error::bail_arg!(
            "{} {ranks_per_node} must divide the world size {w} (node k is ranks [k n, (k+1) n) for n ranks per node)",
            Term::RanksPerNode
        );
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
/// [`hybrid_groups`] with `config.ranks_per_node` (one of the three is required).
fn shard_and_replicate_groups(pg: &Group, config: &FsdpConfig) -> Result<(Group, Option<Group>)> {
    let mesh = config.device_mesh.as_ref();
    if !config.sharding_strategy.is_hybrid() {
        let hybrid_only = [
            (mesh.is_some(), "device_mesh".to_string()),
            (config.hybrid_groups.is_some(), "hybrid_groups".to_string()),
            (
                config.ranks_per_node.is_some(),
                Term::RanksPerNode.to_string(),
            ),
        ];
        if let Some((_, what)) = hybrid_only.iter().find(|(set, _)| *set) {
            return Err(Error::Fsdp(format!(
                "{what} is for {}; with {} {}",
                Term::HybridStrategies,
                config.sharding_strategy.api_name(),
                Term::NotHybrid
            )));
        }
        return Ok((pg.clone(), None));
    }
    let (s, r) = match (&config.hybrid_groups, mesh) {
        (None, None) => match config.ranks_per_node {
            Some(n) => hybrid_groups(pg, n)?,
            // FSDP1 raises ValueError here too ("requires explicit specification of
            // process group or device_mesh"): guessing a node size would run FullShard
            // (one node) or a split the user never asked for.
            None => {
                return Err(Error::Fsdp(format!(
                    "{} needs to know which ranks share a node: {}",
                    config.sharding_strategy.api_name(),
                    Term::NodeChoices
                )))
            }
        },
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
        unit_around_checkpoint(child);
        if !child.is_fsdp_unit() && policy.should_wrap(child.as_mut()) {
            warn_if_empty(child.as_mut(), &fqn, rs);
            let inner = std::mem::replace(child, Box::new(Sequential::new(Vec::new())));
            *child = Box::new(FullyShardedDataParallel::wrap_one(inner, &fqn, rs, seen)?);
        }
        Ok(())
    })
}

/// [Note: checkpointing inside the unit] A [`CheckpointWrapper`] recomputes its module's
/// forward inside its backward, so an FSDP unit must sit around it, never inside it (the
/// unit's forward hooks would run again in the middle of the backward):
/// `FSDP(CheckpointWrapper(Block))`, whose backward hook gathers the parameters that the
/// recompute then reads. Given a model checkpointed before wrapping, the policy judges the
/// module inside the wrapper first (bottom-up) and makes `CheckpointWrapper(FSDP(Block))`;
/// this turns it around into `FSDP(CheckpointWrapper(Block))`, the same unit with the same
/// parameters and names (the wrapper adds none). A unit deeper inside a wrapper cannot be
/// turned around and is refused ([`check_checkpoint_boundaries`]).
fn unit_around_checkpoint(child: &mut Box<dyn Module>) {
    let as_unit = |m: &mut Box<dyn Module>| {
        m.as_any_mut()
            .and_then(|a| a.downcast_mut::<FullyShardedDataParallel>())
            .is_some()
    };
    let unit_box = {
        let Some(ck) = child
            .as_any_mut()
            .and_then(|a| a.downcast_mut::<CheckpointWrapper>())
        else {
            return;
        };
        if !as_unit(ck.module_mut()) {
            return;
        }
        let Some(unit) = ck
            .module_mut()
            .as_any_mut()
            .and_then(|a| a.downcast_mut::<FullyShardedDataParallel>())
        else {
            return;
        };
        let inner = std::mem::replace(&mut unit.module, Box::new(Sequential::new(Vec::new())));
        std::mem::replace(ck.module_mut(), inner)
    };
    // `child` is the wrapper (now around the unit's module), `unit_box` the unit: swap them.
    let wrapper = std::mem::replace(child, unit_box);
    if let Some(unit) = child
        .as_any_mut()
        .and_then(|a| a.downcast_mut::<FullyShardedDataParallel>())
    {
        unit.module = wrapper;
    }
}

/// `InvalidArgument` naming the first [`CheckpointWrapper`] at or below `m` that holds an
/// FSDP unit ([Note: checkpointing inside the unit]).
fn check_checkpoint_boundaries(m: &mut dyn Module, prefix: &str) -> Result<()> {
    if let Some(ck) = m
        .as_any_mut()
        .and_then(|a| a.downcast_mut::<CheckpointWrapper>())
    {
        // The wrapper adds no name: its module's path is its own.
        if let Some(u) = first_fsdp_unit(ck.module_mut().as_mut(), prefix)? {
            crate::error::bail_arg!(
                "activation checkpointing of '{prefix}' would enclose FSDP unit '{u}': its recompute would run the unit's forward hooks inside the backward. Let the auto_wrap_policy pick the checkpointed module itself (FSDP then goes around the wrapper), or apply_activation_checkpointing after FullyShardedDataParallel::new"
            );
        }
        return Ok(());
    }
    m.for_each_child(&mut |name, child| {
        check_checkpoint_boundaries(child.as_mut(), &join_name(prefix, name))
    })
}

/// [Note: a model without parameters] A `Module` whose `for_each_param` or
/// `for_each_child` leaves out what it holds trains nothing, and nothing else would say
/// so. FSDP1 wraps a module without parameters without complaint (its unit gets no
/// FlatParameter); here the root refuses it: a model with no parameter at all (ignored
/// modules aside) is an `Fsdp` error naming its type. An auto-wrapped submodule without
/// parameters of its own is still wrapped, as FSDP1 does (so unit counts match PyTorch's),
/// with a warning on stderr from rank 0, since such a unit has nothing to shard.
fn check_has_parameters(module: &mut dyn Module, rs: &RankState) -> Result<()> {
    let mut n = 0;
    visit_all(module, |name, _| n += usize::from(!rs.is_ignored(name)));
    if n > 0 {
        return Ok(());
    }
    Err(Error::Fsdp(format!(
        "the module to wrap ('{}', the root) has no parameters{}: there is nothing to shard or train. If it holds layers, its Module::for_each_param / for_each_child must visit them (README: Your own models)",
        module.type_name(),
        if rs.ignored.is_empty() {
            ""
        } else {
            " outside ignored_modules"
        }
    )))
}

/// The warning of [Note: a model without parameters] for an auto-wrapped submodule.
fn warn_if_empty(module: &mut dyn Module, fqn: &str, rs: &RankState) {
    let mut n = 0;
    let walked = visit_parameters(module, fqn, true, &mut |name, _| {
        n += usize::from(!rs.is_ignored(name));
        Ok(())
    });
    if walked.is_ok() && n == 0 && rs.pg.rank() == 0 {
        eprintln!(
            "fsdp: warning: auto_wrap_policy wraps '{fqn}' ({}), which has no parameters of its own: its FSDP unit shards nothing (as in PyTorch). If that is not meant: the policy may already have wrapped its layers in units of their own, or its Module::for_each_param / for_each_child do not visit them",
            module.type_name()
        );
    }
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
