//! Building the sharded model from a declaration (`fsdp_model_new`:
//! [`fsdp::embed::fully_shard`]); units by name or index, their parameters' names and
//! shapes; freeing. The declaration itself is `spec.rs`.

use super::handles::{self, fsdp_group_t, fsdp_model_t, fsdp_spec_t, fsdp_unit_t, Kind, Object};
use super::spec::{fsdp_config, fsdp_config_default};
use super::{c_str, fsdp_status, guard, write_out, Fail, Res, FSDP_ERR_INVALID_HANDLE};
use fsdp::embed::fully_shard;
use fsdp::fsdp::FullyShardedDataParallel;
use fsdp::tensor::Tensor;
use parking_lot::Mutex;
use std::ffi::{c_char, CString};
use std::sync::Arc;

/// One parameter of a unit, as the host sees it.
pub(crate) struct ParamMeta {
    pub(crate) fqn: String,
    c_name: CString,
    /// Dimensions as DLPack wants them; the boxed slice never moves, so `DLTensor.shape`
    /// may point at it for the model's life.
    pub(crate) shape: Box<[i64]>,
    pub(crate) requires_grad: bool,
}

/// What a view handed to the host shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ViewKind {
    /// A full parameter (read-only for the host).
    Parameter,
    /// A gradient buffer the host adds into.
    Gradient,
}

/// A view fsdp handed to the host and still owns: never taken back as a gradient.
pub(crate) struct HeldView {
    pub(crate) kind: ViewKind,
    /// The parameter's fully qualified name.
    pub(crate) fqn: String,
    /// The memory behind the view.
    pub(crate) tensor: Tensor,
}

/// One FSDP unit of a model.
pub(crate) struct UnitMeta {
    pub(crate) name: String,
    c_name: CString,
    pub(crate) params: Vec<ParamMeta>,
    handle: u64,
    /// Tensors whose memory the host holds views of, until the matching post hook.
    pub(crate) held: Vec<HeldView>,
    /// Under low-precision mixed precision, between pre_backward and post_backward: the
    /// float32 gradient views handed to the host, each with the unit's `param_dtype`
    /// gradient it is added into (one rounding) before the reduction.
    pub(crate) grad_f32: Vec<(Tensor, Tensor)>,
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
/// parameters. A collective over `group`: every rank calls it, with the same declaration
/// and the same `config` settings, which the ranks check first with one all-gather of an
/// 8-byte hash of them (the same `sharding_strategy`, `ranks_per_node`,
/// `mixed_precision`, `cpu_offload`, prefetch settings, `sync_module_states` and device
/// type; the same units, parameter names, shapes, dtypes and `requires_grad`, in the same
/// order).
/// `config` NULL: the defaults of [`fsdp_config_default`]. Unit 0 is the root (name `""`),
/// then the declared units in pre-order.
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_COLLECTIVE_MISMATCH` on every rank when
/// the ranks declared different models or passed different settings, naming the first
/// difference (a setting by its `fsdp_config` field and both values) and both ranks;
/// `FSDP_ERR_INVALID_ARGUMENT` for repeated or malformed names, a bad config value, a
/// declaration without parameters, a parameter without values that nothing gives values
/// (no `sync_module_states`); `FSDP_ERR_USAGE` for options that do not fit together
/// (`ranks_per_node` without a hybrid strategy, a hybrid strategy without it);
/// `FSDP_ERR_OUT_OF_MEMORY` naming the bytes when this rank's shards do not fit (the
/// process goes on); collective errors. `*out` is left as it was on error.
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
        let (units, root) = s.lock().try_clone()?;
        // The units' parameters as the host addresses them, made before the declaration
        // goes to the model: `(unit, its parameters)`, the root first.
        let params_of = |unit: &str, ps: &[fsdp::embed::ParamSpec]| {
            ps.iter()
                .map(|p| {
                    let fqn = fsdp::nn::join_name(unit, &p.name);
                    Ok(ParamMeta {
                        c_name: cstring(&fqn)?,
                        fqn,
                        shape: p.shape.iter().map(|&d| d as i64).collect(),
                        requires_grad: p.requires_grad,
                    })
                })
                .collect::<Res<Vec<_>>>()
        };
        let mut declared = vec![(String::new(), params_of("", &root)?)];
        for u in &units {
            declared.push((u.name.clone(), params_of(&u.name, &u.params)?));
        }
        let mut fsdp = fully_shard(units, root, pg, cfg)?;
        let mut names = Vec::new();
        fsdp.for_each_unit(&mut |u| {
            names.push(u.module_name().to_string());
            Ok(())
        })?;
        let mut metas = Vec::new();
        for name in names {
            let Some(at) = declared.iter().position(|(u, _)| *u == name) else {
                return Err(Fail::arg(format!(
                    "internal: unit '{name}' was not declared"
                )));
            };
            let (name, params) = declared.swap_remove(at);
            metas.push(UnitMeta {
                c_name: cstring(&name)?,
                name,
                params,
                handle: 0,
                held: Vec::new(),
                grad_f32: Vec::new(),
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
