//! A unit's parameters before they are flattened: deferred init through `param_init_fn`
//! (FSDP1 `_materialize_with_param_init_fn`) and `sync_module_states` (FSDP1
//! `_sync_module_params_and_buffers`), both in `_init_utils.py`.

use super::unit::RankState;
use crate::backend::Device;
use crate::distributed::fingerprint::{self, Fingerprint, Name, Phase};
use crate::distributed::{staged, ReduceOp};
use crate::error::{Error, Result};
use crate::nn::{visit_parameters, ChildVisitor, Context, Module, Parameter};
use crate::tensor::alloc::{vec_with_capacity, zeroed_vec};
use crate::tensor::{DType, Tensor};

/// Calls the user's `param_init_fn` on `module` (the unit being wrapped) with every nested
/// FSDP unit below it taken out for the call, so that the function sees only the modules
/// this unit owns: a `reset_parameters()`-style function that walks every parameter
/// cannot reach into a unit already wrapped, whose parameters may be live views of its
/// FlatParameter (under NoShard). As PyTorch since #104189, which materializes only the
/// modules outside already-wrapped units; every module is initialized exactly once.
///
/// # Errors
/// The function's error; `Fsdp` when it replaced or removed modules so that the nested
/// units cannot be put back.
pub(super) fn call_param_init_fn(
    module: &mut dyn Module,
    prefix: &str,
    init: &super::ParamInitFn,
) -> Result<()> {
    let mut units = Vec::new();
    take_units(module, &mut units)?;
    let n = units.len();
    let r = init(module);
    let mut back = units.into_iter();
    put_units(module, &mut back)?;
    if back.len() > 0 {
        return Err(Error::Fsdp(format!(
            "param_init_fn changed the module tree of unit '{prefix}': {} of its {n} nested FSDP units could not be put back",
            back.len()
        )));
    }
    r
}

/// Where a nested unit sits while `param_init_fn` runs: no parameters, no children.
struct HiddenUnit;

impl Module for HiddenUnit {
    fn type_name(&self) -> &str {
        "FsdpUnitHiddenDuringInit"
    }
    fn forward(&mut self, _: &Tensor, _: &Context) -> Result<Tensor> {
        Err(Error::Fsdp(
            "a nested FSDP unit is out of the tree while param_init_fn runs".into(),
        ))
    }
    fn backward(&mut self, g: &Tensor, cx: &Context) -> Result<Tensor> {
        self.forward(g, cx)
    }
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn for_each_param(&mut self, f: &mut crate::nn::ParamVisitor<'_>) -> Result<()> {
        crate::nn::no_params(f)
    }
    fn for_each_child(&mut self, f: &mut crate::nn::ChildVisitor<'_>) -> Result<()> {
        crate::nn::no_children(f)
    }
}

/// Moves every FSDP unit below `m` (not below those units) into `out`, in pre-order.
fn take_units(m: &mut dyn Module, out: &mut Vec<Box<dyn Module>>) -> Result<()> {
    m.for_each_child(&mut |_, child| {
        if child.is_fsdp_unit() {
            out.push(std::mem::replace(child, Box::new(HiddenUnit)));
            Ok(())
        } else {
            take_units(child.as_mut(), out)
        }
    })
}

/// Puts the units [`take_units`] took back in their places, in the same order.
fn put_units(m: &mut dyn Module, units: &mut std::vec::IntoIter<Box<dyn Module>>) -> Result<()> {
    let visit: &mut ChildVisitor<'_> = &mut |_, child| {
        let hidden = child
            .as_any_mut()
            .is_some_and(|a| a.downcast_mut::<HiddenUnit>().is_some());
        if hidden {
            if let Some(u) = units.next() {
                *child = u;
            }
            Ok(())
        } else {
            put_units(child.as_mut(), units)
        }
    };
    m.for_each_child(visit)
}

/// One tensor of the unit as this rank holds it, under each of its names.
struct Held {
    names: Vec<String>,
    tensor: Tensor,
}

/// `sync_module_states`: makes the parameters `module` owns (nested units and ignored
/// modules excepted) equal to rank 0's on every rank, before they are flattened.
///
/// The decision is the same on every rank whatever each rank built: first an all-reduce
/// of one flag per parameter says which parameters some rank holds values of. Those are
/// broadcast from rank 0 in one flat buffer: rank 0 computes any it holds only on the meta
/// device (from its initializer), every other rank takes rank 0's values in place of its
/// own (meta or not). A parameter that every rank holds on the meta device is left for
/// deferred init, which computes the same values everywhere shard by shard. So rank 0
/// may load a checkpoint into an eager model while the others build it on the meta device
/// (PyTorch's pattern), and the result is bitwise rank 0's.
///
/// # Errors
/// `NotMaterialized` for a parameter without data, or one rank 0 holds on the meta device
/// without an initializer that another rank holds values of; `Fsdp` for a non-f32
/// parameter; `CollectiveMismatch` when ranks built units of different parameter counts
/// or sizes; the collectives' errors.
pub(super) fn sync_module_states(
    module: &mut dyn Module,
    prefix: &str,
    rs: &RankState,
) -> Result<()> {
    let _tag = fingerprint::enter(Some(Fingerprint {
        unit: Name::new(prefix),
        phase: Phase::Init,
        step: 0,
        micro_batch: 0,
        call: 0,
    }));
    sync_buffers(module, prefix, rs)?;
    let held = held_tensors(module, prefix, rs)?;
    let pg = rs.pg.as_ref();
    let flags: Vec<i32> = held
        .iter()
        .map(|h| i32::from(h.tensor.device() != Device::Meta))
        .collect();
    let any = Tensor::from_vec(flags, &[held.len()])?;
    staged::all_reduce(pg, &any, ReduceOp::Max)?;
    let any = any.data::<i32>()?.to_vec();
    let synced: Vec<&Held> = held
        .iter()
        .zip(&any)
        .filter(|(_, &a)| a != 0)
        .map(|(h, _)| h)
        .collect();
    let total: usize = synced.iter().map(|h| h.tensor.numel()).sum();
    // One buffer in the parameters' dtype: f32, or f64 for a unit of f64 parameters (the
    // values go through f64 on the host either way, exactly).
    let dtype = match synced.first() {
        Some(h) if h.tensor.dtype() == DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let oom = |e: Error| {
        e.allocating(|| format!("sync_module_states' buffer of {total} elements of '{prefix}'"))
    };
    let mut flat = vec_with_capacity::<f64>(if pg.rank() == 0 { total } else { 0 }).map_err(oom)?;
    if pg.rank() == 0 {
        for h in &synced {
            let values = h.tensor.materialize().map_err(|_| Error::NotMaterialized {
                name: h.names[0].clone(),
                state: "meta without an initializer on rank 0, while another rank holds its values (sync_module_states broadcasts rank 0's)",
            })?;
            flat.extend(values.to_vec_f64()?);
        }
    } else {
        flat = zeroed_vec::<f64>(total).map_err(oom)?;
    }
    let flat = Tensor::from_vec(flat, &[total])?.to_dtype(dtype)?;
    staged::broadcast(pg, &flat, 0)?;
    let flat = flat.to_vec_f64()?;
    let mut at = 0;
    let mut replace: Vec<(&[String], Tensor)> = Vec::new();
    for h in &synced {
        let n = h.tensor.numel();
        if pg.rank() != 0 || h.tensor.device() == Device::Meta {
            replace.push((
                &h.names,
                Tensor::from_vec(flat[at..at + n].to_vec(), h.tensor.shape())?
                    .to_dtype(h.tensor.dtype())?,
            ));
        }
        at += n;
    }
    if replace.is_empty() {
        return Ok(());
    }
    visit_parameters(module, prefix, true, &mut |name, p| match replace
        .iter()
        .find(|(names, _)| names.iter().any(|n| n == name))
    {
        Some((_, t)) => p.set_data(Some(t.clone())),
        None => Ok(()),
    })
}

/// The buffers half of `sync_module_states` (FSDP1 `_sync_module_params_and_buffers`
/// broadcasts `module.buffers()` too): every buffer of the modules this unit owns (nested
/// units and ignored modules excepted), persistent or not, becomes bitwise rank 0's, in its
/// own dtype and on its own device. One broadcast over the whole world per buffer, through
/// a host copy, so under hybrid sharding the replicas of other nodes get rank 0's values
/// as well.
///
/// # Errors
/// `NotMaterialized` for a buffer on the meta device; `CollectiveMismatch` when ranks hold
/// buffers of different counts, shapes or dtypes; the collectives' errors.
fn sync_buffers(module: &mut dyn Module, prefix: &str, rs: &RankState) -> Result<()> {
    let pg = rs.pg.as_ref();
    crate::nn::visit_buffers(module, prefix, true, &mut |name, b| {
        if rs.is_ignored(name) {
            return Ok(());
        }
        if b.data.device() == Device::Meta {
            return Err(Error::NotMaterialized {
                name: name.to_string(),
                state: "a buffer on the meta device at sync_module_states",
            });
        }
        let host = b.data.to_device(Device::Cpu)?;
        let host = if host.shares_storage(&b.data) {
            host.deep_clone()?
        } else {
            host
        };
        staged::broadcast(pg, &host, 0)?;
        b.data.copy_from(&host)
    })
}

/// The distinct tensors of the parameters `module` owns, in visit order, each with every
/// name it has (tied parameters are one tensor).
fn held_tensors(module: &mut dyn Module, prefix: &str, rs: &RankState) -> Result<Vec<Held>> {
    let mut held: Vec<Held> = Vec::new();
    visit_parameters(module, prefix, true, &mut |name, p: &mut Parameter| {
        if rs.is_ignored(name) {
            return Ok(());
        }
        let d = match p.data() {
            Ok(d) if d.dtype() != DType::F32 && d.dtype() != DType::F64 => {
                return Err(Error::Fsdp(format!(
                    "parameter '{name}' is {}; FlatParameter holds f32 master weights (use MixedPrecision for low-precision compute)",
                    d.dtype()
                )));
            }
            Ok(d) => d,
            Err(_) => {
                return Err(Error::NotMaterialized {
                    name: name.to_string(),
                    state: "sync_module_states",
                });
            }
        };
        match held.iter_mut().find(|h| h.tensor.same_view(d)) {
            Some(h) => h.names.push(name.to_string()),
            None => held.push(Held {
                names: vec![name.to_string()],
                tensor: d.clone(),
            }),
        }
        Ok(())
    })?;
    Ok(held)
}
