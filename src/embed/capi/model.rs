//! Declaring units by their parameters (`fsdp_spec_*`) and building the sharded model
//! (`fsdp_model_new`: [`crate::embed::fully_shard`] with a subset of [`FsdpConfig`]);
//! units by name or index, their parameters' names and shapes; freeing.

use super::handles::{self, fsdp_group_t, fsdp_model_t, fsdp_spec_t, fsdp_unit_t, Kind, Object};
use super::{c_str, fsdp_status, guard, write_out, Fail, Res, FSDP_ERR_INVALID_HANDLE};
use crate::embed::{fully_shard, ParamSpec, UnitSpec};
use crate::fsdp::{
    BackwardPrefetch, CpuOffload, FsdpConfig, FullyShardedDataParallel, MixedPrecision,
    ShardingStrategy,
};
use crate::nn::{InitKey, ParamInit};
use crate::tensor::{DType, Tensor};
use parking_lot::Mutex;
use std::ffi::{c_char, CString};
use std::sync::Arc;

/// `ShardingStrategy.FULL_SHARD` (ZeRO-3), the default.
pub const FSDP_FULL_SHARD: i32 = 0;
/// `ShardingStrategy.SHARD_GRAD_OP` (ZeRO-2).
pub const FSDP_SHARD_GRAD_OP: i32 = 1;
/// `ShardingStrategy.NO_SHARD` (DDP).
pub const FSDP_NO_SHARD: i32 = 2;
/// `ShardingStrategy.HYBRID_SHARD` (needs `ranks_per_node`).
pub const FSDP_HYBRID_SHARD: i32 = 3;
/// `ShardingStrategy._HYBRID_SHARD_ZERO2` (needs `ranks_per_node`).
pub const FSDP_HYBRID_SHARD_ZERO2: i32 = 4;

/// f32 throughout (no `MixedPrecision`), the default.
pub const FSDP_PRECISION_F32: i32 = 0;
/// `MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=torch.bfloat16)`: parameters are
/// all-gathered in bfloat16 and their views are float32 holding bfloat16-rounded values
/// (fsdp computes in f32 on rounded values); gradients are float32.
pub const FSDP_PRECISION_BF16: i32 = 1;
/// As [`FSDP_PRECISION_BF16`] with float16.
pub const FSDP_PRECISION_F16: i32 = 2;

/// `backward_prefetch=None`.
pub const FSDP_BACKWARD_PREFETCH_NONE: i32 = 0;
/// `BackwardPrefetch.BACKWARD_PRE`, the default.
pub const FSDP_BACKWARD_PREFETCH_PRE: i32 = 1;
/// `BackwardPrefetch.BACKWARD_POST`.
pub const FSDP_BACKWARD_PREFETCH_POST: i32 = 2;

/// U(-scale, scale) (`nn.init.uniform_`), element `i` a function of (seed, unit, name, i):
/// the values `fsdp::nn` layers draw from `InitKey::new(seed).child(unit)`.
pub const FSDP_INIT_UNIFORM: i32 = 1;
/// N(0, scale^2) (`nn.init.normal_`), as [`FSDP_INIT_UNIFORM`].
pub const FSDP_INIT_NORMAL: i32 = 2;
/// Every element `scale` (`nn.init.constant_`).
pub const FSDP_INIT_CONSTANT: i32 = 3;

/// The subset of `FullyShardedDataParallel`'s options a declared model takes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_camel_case_types)]
pub struct fsdp_config {
    /// An `FSDP_*_SHARD*` strategy.
    pub sharding_strategy: i32,
    /// Ranks per node, for the hybrid strategies only (0 otherwise).
    pub ranks_per_node: i32,
    /// An `FSDP_PRECISION_*`.
    pub mixed_precision: i32,
    /// `CpuOffload(offload_params=True)`.
    pub cpu_offload: bool,
    /// An `FSDP_BACKWARD_PREFETCH_*`.
    pub backward_prefetch: i32,
    /// `forward_prefetch=True`.
    pub forward_prefetch: bool,
    /// `limit_all_gathers` (default true).
    pub limit_all_gathers: bool,
    /// `sync_module_states=True`: rank 0's values everywhere (parameters declared without
    /// values on the other ranks get them).
    pub sync_module_states: bool,
}

impl fsdp_config {
    fn to_config(self) -> Res<FsdpConfig> {
        let strategy = match self.sharding_strategy {
            FSDP_FULL_SHARD => ShardingStrategy::FullShard,
            FSDP_SHARD_GRAD_OP => ShardingStrategy::ShardGradOp,
            FSDP_NO_SHARD => ShardingStrategy::NoShard,
            FSDP_HYBRID_SHARD => ShardingStrategy::HybridShard,
            FSDP_HYBRID_SHARD_ZERO2 => ShardingStrategy::HybridShardZero2,
            s => {
                return Err(Fail::arg(format!(
                    "config.sharding_strategy {s} is not an FSDP_*_SHARD value"
                )))
            }
        };
        let mixed_precision = match self.mixed_precision {
            FSDP_PRECISION_F32 => None,
            FSDP_PRECISION_BF16 => Some(MixedPrecision::uniform(DType::BF16)),
            FSDP_PRECISION_F16 => Some(MixedPrecision::uniform(DType::F16)),
            p => {
                return Err(Fail::arg(format!(
                    "config.mixed_precision {p} is not an FSDP_PRECISION_* value"
                )))
            }
        };
        let backward_prefetch = match self.backward_prefetch {
            FSDP_BACKWARD_PREFETCH_NONE => None,
            FSDP_BACKWARD_PREFETCH_PRE => Some(BackwardPrefetch::BackwardPre),
            FSDP_BACKWARD_PREFETCH_POST => Some(BackwardPrefetch::BackwardPost),
            b => {
                return Err(Fail::arg(format!(
                    "config.backward_prefetch {b} is not an FSDP_BACKWARD_PREFETCH_* value"
                )))
            }
        };
        let ranks_per_node = match self.ranks_per_node {
            0 => None,
            r if r > 0 => Some(r as usize),
            r => return Err(Fail::arg(format!("config.ranks_per_node {r} is negative"))),
        };
        Ok(FsdpConfig {
            sharding_strategy: strategy,
            ranks_per_node,
            mixed_precision,
            cpu_offload: CpuOffload {
                offload_params: self.cpu_offload,
            },
            backward_prefetch,
            forward_prefetch: self.forward_prefetch,
            limit_all_gathers: self.limit_all_gathers,
            sync_module_states: self.sync_module_states,
            ..FsdpConfig::default()
        })
    }
}

/// Fills `*out` with FSDP1's defaults: FullShard, f32, no offload, BACKWARD_PRE, no
/// forward prefetch, limit_all_gathers, no sync_module_states.
///
/// Errors: `FSDP_ERR_INVALID_ARGUMENT` when `out` is NULL.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_config_default(out: *mut fsdp_config) -> fsdp_status {
    guard("fsdp_config_default", || {
        let v = fsdp_config {
            sharding_strategy: FSDP_FULL_SHARD,
            ranks_per_node: 0,
            mixed_precision: FSDP_PRECISION_F32,
            cpu_offload: false,
            backward_prefetch: FSDP_BACKWARD_PREFETCH_PRE,
            forward_prefetch: false,
            limit_all_gathers: true,
            sync_module_states: false,
        };
        // SAFETY: the caller's promise.
        unsafe { write_out(out, "out", v) }
    })
}

/// A declaration being built: units in order and the root's parameters.
pub(crate) struct SpecObj {
    units: Vec<UnitSpec>,
    root: Vec<ParamSpec>,
}

impl SpecObj {
    fn params_of(&mut self, unit: &str) -> Res<&mut Vec<ParamSpec>> {
        if unit.is_empty() {
            return Ok(&mut self.root);
        }
        let known: Vec<String> = self.units.iter().map(|u| format!("'{}'", u.name)).collect();
        match self.units.iter_mut().find(|u| u.name == unit) {
            Some(u) => Ok(&mut u.params),
            None => Err(Fail::arg(format!(
                "unit '{unit}' is not declared (fsdp_spec_add_unit first; declared: [{}]; \"\" is the root)",
                known.join(", ")
            ))),
        }
    }
}

/// A new, empty model declaration in `*out`.
///
/// Errors: `FSDP_ERR_INVALID_ARGUMENT` when `out` is NULL.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_spec_new(out: *mut fsdp_spec_t) -> fsdp_status {
    guard("fsdp_spec_new", || {
        if out.is_null() {
            return Err(Fail::arg("out (the out-pointer) is NULL"));
        }
        let id = handles::insert(Object::Spec(Arc::new(Mutex::new(SpecObj {
            units: Vec::new(),
            root: Vec::new(),
        }))));
        // SAFETY: checked non-null; valid for a write (the caller's promise).
        unsafe { write_out(out, "out", fsdp_spec_t { id }) }
    })
}

/// Declares the FSDP unit of module path `name` (`"layers.0"`: dots nest it inside the
/// unit `"layers"` when that is declared too). Units flatten and communicate in
/// declaration order: every rank declares the same units in the same order.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for a NULL, empty or
/// non-UTF-8 name (repeated or malformed names are refused by `fsdp_model_new`).
///
/// # Safety
/// `name` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fsdp_spec_add_unit(spec: fsdp_spec_t, name: *const c_char) -> fsdp_status {
    guard("fsdp_spec_add_unit", || {
        let s = handles::spec(spec.id, "spec")?;
        // SAFETY: the caller's promise.
        let name = unsafe { c_str(name, "name") }?;
        if name.is_empty() {
            return Err(Fail::arg("name is empty: the root (\"\") is implicit"));
        }
        s.lock().units.push(UnitSpec::new(name, Vec::new()));
        Ok(())
    })
}

/// # Safety
/// `shape` valid for `ndim` reads.
unsafe fn shape_arg(ndim: i32, shape: *const i64) -> Res<Vec<usize>> {
    if !(0..=64).contains(&ndim) {
        return Err(Fail::arg(format!("ndim {ndim} is not in 0..=64")));
    }
    if ndim > 0 && shape.is_null() {
        return Err(Fail::arg("shape is NULL"));
    }
    (0..ndim as usize)
        .map(|i| {
            // SAFETY: valid for ndim reads (the caller's promise), checked non-null.
            let d = unsafe { *shape.add(i) };
            usize::try_from(d).map_err(|_| Fail::arg(format!("shape[{i}] = {d} is negative")))
        })
        .collect()
}

/// Adds a parameter to unit `unit` (`""`: the root): `name` (no dots), `ndim`
/// dimensions of `shape`, f32 `values` (row-major, the shape's element count; copied), or
/// `values` NULL for a parameter without values on this rank (it gets rank 0's with
/// `sync_module_states`). `requires_grad` false: frozen (no gradient, never updated).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for an undeclared unit,
/// a NULL or non-UTF-8 string, a negative dimension.
///
/// # Safety
/// `unit`, `name` are NUL-terminated strings; `shape` is valid for `ndim` reads; `values`
/// is NULL or valid for the shape's element count of reads.
#[no_mangle]
pub unsafe extern "C" fn fsdp_spec_add_param(
    spec: fsdp_spec_t,
    unit: *const c_char,
    name: *const c_char,
    ndim: i32,
    shape: *const i64,
    values: *const f32,
    requires_grad: bool,
) -> fsdp_status {
    guard("fsdp_spec_add_param", || {
        let s = handles::spec(spec.id, "spec")?;
        // SAFETY: the caller's promises on the strings and the shape.
        let (unit, name, shape) = unsafe {
            (
                c_str(unit, "unit")?,
                c_str(name, "name")?,
                shape_arg(ndim, shape)?,
            )
        };
        let n: usize = shape.iter().product();
        let mut p = match values.is_null() {
            true => ParamSpec::empty(name, &shape),
            false => {
                // SAFETY: values is valid for n reads (the caller's promise).
                let v = unsafe { std::slice::from_raw_parts(values, n) }.to_vec();
                ParamSpec::values(name, &shape, v)
            }
        };
        p.requires_grad = requires_grad;
        s.lock().params_of(unit)?.push(p);
        Ok(())
    })
}

/// Adds a parameter computed by an initializer (deferred init: each rank computes only
/// its shard): `init` an `FSDP_INIT_*`, `scale` its bound, standard deviation or value.
/// Element `i` depends only on (`seed`, `unit`, `name`, `i`): the same values as an
/// `fsdp::nn` layer built with `InitKey::new(seed).child(unit)`, at every world size.
///
/// Errors: as [`fsdp_spec_add_param`]; `FSDP_ERR_INVALID_ARGUMENT` for an unknown `init`.
///
/// # Safety
/// As [`fsdp_spec_add_param`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn fsdp_spec_add_param_init(
    spec: fsdp_spec_t,
    unit: *const c_char,
    name: *const c_char,
    ndim: i32,
    shape: *const i64,
    init: i32,
    seed: u64,
    scale: f32,
    requires_grad: bool,
) -> fsdp_status {
    guard("fsdp_spec_add_param_init", || {
        let s = handles::spec(spec.id, "spec")?;
        // SAFETY: the caller's promises on the strings and the shape.
        let (unit, name, shape) = unsafe {
            (
                c_str(unit, "unit")?,
                c_str(name, "name")?,
                shape_arg(ndim, shape)?,
            )
        };
        let key = InitKey::new(seed).child(unit);
        let init = match init {
            FSDP_INIT_UNIFORM => {
                crate::nn::on_meta_device(|| key.uniform(name, &shape, scale))?.meta_initializer()
            }
            FSDP_INIT_NORMAL => {
                crate::nn::on_meta_device(|| key.normal(name, &shape, scale))?.meta_initializer()
            }
            FSDP_INIT_CONSTANT => Some((ParamInit::Constant(scale), 0)),
            i => return Err(Fail::arg(format!("init {i} is not an FSDP_INIT_* value"))),
        }
        .ok_or_else(|| Fail::arg("internal: the initializer was not recorded"))?
        .0;
        let mut p = ParamSpec::init(name, &shape, init);
        p.requires_grad = requires_grad;
        s.lock().params_of(unit)?.push(p);
        Ok(())
    })
}

/// Frees a declaration (models built from it are not affected).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE` (NULL, freed, another kind).
#[no_mangle]
pub extern "C" fn fsdp_spec_free(spec: fsdp_spec_t) -> fsdp_status {
    guard("fsdp_spec_free", || {
        handles::remove(spec.id, Kind::Spec, "spec").map(drop)
    })
}

/// One parameter of a unit, as the host sees it.
pub(crate) struct ParamMeta {
    pub(crate) fqn: String,
    c_name: CString,
    /// Dimensions as DLPack wants them; the boxed slice never moves, so `DLTensor.shape`
    /// may point at it for the model's life.
    pub(crate) shape: Box<[i64]>,
    pub(crate) requires_grad: bool,
}

/// One FSDP unit of a model.
pub(crate) struct UnitMeta {
    pub(crate) name: String,
    c_name: CString,
    pub(crate) params: Vec<ParamMeta>,
    handle: u64,
    /// Tensors whose memory the host holds views of, until the matching post hook.
    pub(crate) held: Vec<Tensor>,
}

/// A built model: the FSDP root, its units as the host addresses them, and the group it
/// communicates on.
pub(crate) struct ModelObj {
    pub(crate) fsdp: FullyShardedDataParallel,
    pub(crate) units: Vec<UnitMeta>,
    /// The group handle the model was built on (checked live at every call).
    group: u64,
    /// The call running now; still set at the next call when that one panicked.
    busy: Option<&'static str>,
}

/// Runs `f` on the model of handle `h`: refused when its group was destroyed or an
/// earlier call panicked half-way.
pub(crate) fn with_model<R>(
    h: u64,
    what: &str,
    call: &'static str,
    f: impl FnOnce(&mut ModelObj) -> Res<R>,
) -> Res<R> {
    let m = handles::model(h, what)?;
    let mut m = m.lock();
    if let Some(c) = m.busy {
        return Err(Fail::new(
            FSDP_ERR_INVALID_HANDLE,
            format!("{what}: the model is unusable: {c} failed inside fsdp (FSDP_ERR_PANIC) and may have left it inconsistent; free it"),
        ));
    }
    if !handles::is_live(m.group) {
        return Err(Fail::new(
            FSDP_ERR_INVALID_HANDLE,
            format!(
                "{what}: the process group this model was built on was destroyed; free the model"
            ),
        ));
    }
    if let Err(f) = super::group::live_group(m.group, "the model's process group") {
        return Err(Fail::new(f.status, format!("{what}: {}", f.msg)));
    }
    m.busy = Some(call);
    let r = f(&mut m);
    m.busy = None;
    r
}

/// Runs `f` on the model of unit handle `h` and the unit's index.
pub(crate) fn with_unit<R>(
    h: u64,
    call: &'static str,
    f: impl FnOnce(&mut ModelObj, usize) -> Res<R>,
) -> Res<R> {
    let (model, index) = handles::unit(h, "unit")?;
    with_model(model, "the unit's model", call, |m| f(m, index))
}

/// Builds and shards the declared model on `group` (`fully_shard`): every declared unit
/// becomes an FSDP unit nested by path inside the root, which owns the root's
/// parameters. A collective over `group` (every rank calls it, with the same declaration).
/// `config` NULL: the defaults of [`fsdp_config_default`]. Unit 0 is the root (name `""`),
/// then the declared units in pre-order.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for repeated or
/// malformed names, values that do not fit the shape, a bad config value; `FSDP_ERR_USAGE`
/// for options that do not fit together; collective errors.
///
/// # Safety
/// `config` is NULL or a valid `fsdp_config`; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_model_new(
    group: fsdp_group_t,
    spec: fsdp_spec_t,
    config: *const fsdp_config,
    out: *mut fsdp_model_t,
) -> fsdp_status {
    guard("fsdp_model_new", || {
        if out.is_null() {
            return Err(Fail::arg("out (the out-pointer) is NULL"));
        }
        let pg = super::group::live_group(group.id, "group")?;
        let s = handles::spec(spec.id, "spec")?;
        let cfg = match config.is_null() {
            true => {
                let mut c = std::mem::MaybeUninit::<fsdp_config>::uninit();
                // SAFETY: valid for a write; fsdp_config_default fills every field.
                unsafe { fsdp_config_default(c.as_mut_ptr()) };
                // SAFETY: initialized just above.
                unsafe { c.assume_init() }
            }
            // SAFETY: non-null, a valid fsdp_config (the caller's promise).
            false => unsafe { *config },
        }
        .to_config()?;
        let (units, root) = {
            let s = s.lock();
            (s.units.clone(), s.root.clone())
        };
        let mut fsdp = fully_shard(units.clone(), root.clone(), pg, cfg)?;
        let mut names = Vec::new();
        fsdp.for_each_unit(&mut |u| names.push(u.module_name().to_string()));
        let mut metas = Vec::new();
        for name in names {
            let params = match name.is_empty() {
                true => &root,
                false => match units.iter().find(|u| u.name == name) {
                    Some(u) => &u.params,
                    None => {
                        return Err(Fail::arg(format!(
                            "internal: unit '{name}' was not declared"
                        )))
                    }
                },
            };
            let params = params
                .iter()
                .map(|p| {
                    let fqn = crate::nn::join_name(&name, &p.name);
                    Ok(ParamMeta {
                        c_name: cstring(&fqn)?,
                        fqn,
                        shape: p.shape.iter().map(|&d| d as i64).collect(),
                        requires_grad: p.requires_grad,
                    })
                })
                .collect::<Res<_>>()?;
            metas.push(UnitMeta {
                c_name: cstring(&name)?,
                name,
                params,
                handle: 0,
                held: Vec::new(),
            });
        }
        let obj = Arc::new(Mutex::new(ModelObj {
            fsdp,
            units: metas,
            group: group.id,
            busy: None,
        }));
        let id = handles::insert(Object::Model(obj.clone()));
        let mut o = obj.lock();
        for (index, u) in o.units.iter_mut().enumerate() {
            u.handle = handles::insert(Object::Unit { model: id, index });
        }
        // SAFETY: checked non-null; valid for a write (the caller's promise).
        unsafe { write_out(out, "out", fsdp_model_t { id }) }
    })
}

fn cstring(s: &str) -> Res<CString> {
    CString::new(s).map_err(|_| Fail::arg(format!("name '{s}' contains a NUL byte")))
}

/// Frees a model, its unit handles and every view it handed out. Optimizers made for it
/// are refused afterwards (free them too).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE` (NULL, freed, another kind).
#[no_mangle]
pub extern "C" fn fsdp_model_free(model: fsdp_model_t) -> fsdp_status {
    guard("fsdp_model_free", || {
        if let Object::Model(m) = handles::remove(model.id, Kind::Model, "model")? {
            for u in &m.lock().units {
                handles::remove_quiet(u.handle);
            }
        }
        Ok(())
    })
}

/// Number of FSDP units in `*n` (the root included).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_INVALID_ARGUMENT` (`n` NULL).
///
/// # Safety
/// `n` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_model_num_units(model: fsdp_model_t, n: *mut usize) -> fsdp_status {
    guard("fsdp_model_num_units", || {
        let k = with_model(model.id, "model", "fsdp_model_num_units", |m| {
            Ok(m.units.len())
        })?;
        // SAFETY: the caller's promise.
        unsafe { write_out(n, "n", k) }
    })
}

/// The unit of module path `name` (`""`: the root) in `*out`.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` naming the units when
/// no unit has that name.
///
/// # Safety
/// `name` is a NUL-terminated string; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_model_unit(
    model: fsdp_model_t,
    name: *const c_char,
    out: *mut fsdp_unit_t,
) -> fsdp_status {
    guard("fsdp_model_unit", || {
        // SAFETY: the caller's promise.
        let name = unsafe { c_str(name, "name") }?;
        let id = with_model(model.id, "model", "fsdp_model_unit", |m| {
            match m.units.iter().find(|u| u.name == name) {
                Some(u) => Ok(u.handle),
                None => {
                    let all: Vec<String> =
                        m.units.iter().map(|u| format!("'{}'", u.name)).collect();
                    Err(Fail::arg(format!(
                        "no unit named '{name}' (units: [{}])",
                        all.join(", ")
                    )))
                }
            }
        })?;
        // SAFETY: the caller's promise.
        unsafe { write_out(out, "out", fsdp_unit_t { id }) }
    })
}

/// Unit number `index` (0: the root; then the declared units in pre-order) in `*out`.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for an index out of
/// range.
///
/// # Safety
/// `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_model_unit_at(
    model: fsdp_model_t,
    index: usize,
    out: *mut fsdp_unit_t,
) -> fsdp_status {
    guard("fsdp_model_unit_at", || {
        let id = with_model(model.id, "model", "fsdp_model_unit_at", |m| {
            m.units.get(index).map(|u| u.handle).ok_or_else(|| {
                Fail::arg(format!(
                    "unit index {index} is out of range (the model has {} units)",
                    m.units.len()
                ))
            })
        })?;
        // SAFETY: the caller's promise.
        unsafe { write_out(out, "out", fsdp_unit_t { id }) }
    })
}

/// The unit's module path in `*name` (`""` for the root), valid until the model is
/// freed.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_INVALID_ARGUMENT` (`name` NULL).
///
/// # Safety
/// `name` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_unit_name(
    unit: fsdp_unit_t,
    name: *mut *const c_char,
) -> fsdp_status {
    guard("fsdp_unit_name", || {
        let p = with_unit(unit.id, "fsdp_unit_name", |m, i| {
            Ok(m.units[i].c_name.as_ptr())
        })?;
        // SAFETY: the caller's promise.
        unsafe { write_out(name, "name", p) }
    })
}

/// Number of the unit's own parameters in `*n`: the length of the `DLTensor` arrays its
/// hooks fill and take.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`, `FSDP_ERR_INVALID_ARGUMENT` (`n` NULL).
///
/// # Safety
/// `n` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_unit_num_params(unit: fsdp_unit_t, n: *mut usize) -> fsdp_status {
    guard("fsdp_unit_num_params", || {
        let k = with_unit(unit.id, "fsdp_unit_num_params", |m, i| {
            Ok(m.units[i].params.len())
        })?;
        // SAFETY: the caller's promise.
        unsafe { write_out(n, "n", k) }
    })
}

/// Parameter `index` of the unit, in declaration order: its fully qualified name
/// (`"layers.0.weight"`), dimensions and shape (valid until the model is freed), and
/// whether it trains. Any of the out-pointers may be NULL.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for an index out of
/// range.
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn fsdp_unit_param_info(
    unit: fsdp_unit_t,
    index: usize,
    name: *mut *const c_char,
    ndim: *mut i32,
    shape: *mut *const i64,
    requires_grad: *mut bool,
) -> fsdp_status {
    guard("fsdp_unit_param_info", || {
        let (n, d, s, r) = with_unit(unit.id, "fsdp_unit_param_info", |m, i| {
            let u = &m.units[i];
            let p = u.params.get(index).ok_or_else(|| {
                Fail::arg(format!(
                    "parameter index {index} is out of range (unit '{}' has {})",
                    u.name,
                    u.params.len()
                ))
            })?;
            Ok((
                p.c_name.as_ptr(),
                p.shape.len() as i32,
                p.shape.as_ptr(),
                p.requires_grad,
            ))
        })?;
        // SAFETY (each): NULL or valid for a write (the caller's promise).
        unsafe {
            if !name.is_null() {
                name.write(n);
            }
            if !ndim.is_null() {
                ndim.write(d);
            }
            if !shape.is_null() {
                shape.write(s);
            }
            if !requires_grad.is_null() {
                requires_grad.write(r);
            }
        }
        Ok(())
    })
}
