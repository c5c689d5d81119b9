//! Declaring units by their parameters (`fsdp_spec_*`) and the subset of [`FsdpConfig`] a
//! declared model takes (`fsdp_config`).

use super::dlpack::{config_device, DLDevice};
use super::handles::{self, fsdp_spec_t, Kind, Object};
use super::{c_str, fsdp_status, guard, write_out, Fail, Res};
use fsdp::embed::{ParamSource, ParamSpec, UnitSpec};
use fsdp::fsdp::{BackwardPrefetch, CpuOffload, FsdpConfig, MixedPrecision, ShardingStrategy};
use fsdp::nn::{InitKey, ParamInit};
use fsdp::tensor::alloc::vec_from_slice;
use fsdp::tensor::DType;
use parking_lot::Mutex;
use std::ffi::c_char;
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
/// all-gathered in bfloat16 and the hooks' parameter views are bfloat16 `DLTensor`s
/// (`kDLBfloat`, 16 bits); the gradient views stay float32 (the runtime rounds the
/// gradient to bfloat16 before reducing it in bfloat16), and `fsdp_unit_post_backward`
/// also takes bfloat16 gradients. The sharded master weights and what the optimizer
/// steps on are float32.
pub const FSDP_PRECISION_BF16: i32 = 1;
/// As [`FSDP_PRECISION_BF16`] with float16 (views `kDLFloat`, 16 bits).
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
    /// For `FSDP_HYBRID_SHARD` and `FSDP_HYBRID_SHARD_ZERO2` only (0 otherwise; the hybrid
    /// strategies refuse 0): how many consecutive world ranks form a node. Node k is world
    /// ranks `[k n, (k+1) n)`; each unit's parameters are sharded over the n ranks of a
    /// node (FULL_SHARD or SHARD_GRAD_OP within it), and rank l of every node holds the same
    /// shard, its gradient all-reduced across the nodes. It must divide the world size; it
    /// need not be the machine's (n = the GPUs of one machine keeps the reduce-scatter
    /// inside each machine, n = world size is FULL_SHARD).
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
    /// `device_id=`: where the units compute, `{kDLCPU, 0}` (the default) or `{kDLCUDA,
    /// i}`. On `cuda:i` the shards (unless `cpu_offload`), the gathered parameters, the
    /// gradient buffers and the collectives live on that GPU; the hooks' views are
    /// `kDLCUDA` tensors and the host's gradients must be too, and every `stream` argument
    /// is the host's `CUstream` on that device (NULL: the legacy default stream).
    pub device: DLDevice,
}

impl fsdp_config {
    pub(crate) fn to_config(self) -> Res<FsdpConfig> {
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
        let device = config_device(self.device, "config.device")?;
        #[cfg(not(feature = "cuda"))]
        if device.is_cuda() {
            return Err(super::device::no_cuda(&format!("config.device {device}")));
        }
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
            device_id: Some(device),
            ..FsdpConfig::default()
        })
    }
}

/// Fills `*out` with FSDP1's defaults: FullShard, f32, no offload, BACKWARD_PRE, no
/// forward prefetch, limit_all_gathers, no sync_module_states, on the CPU (`device`
/// `{kDLCPU, 0}`).
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
            device: DLDevice {
                device_type: 1, // kDLCPU
                device_id: 0,
            },
        };
        // SAFETY: the caller's promise.
        unsafe { write_out(out, "out", v) }
    })
}

/// A declaration being built: units in order and the root's parameters.
pub(crate) struct SpecObj {
    pub(crate) units: Vec<UnitSpec>,
    pub(crate) root: Vec<ParamSpec>,
}

impl SpecObj {
    /// A copy of the declaration for a model to consume: the values are copied with
    /// fallible allocations (a declaration is kept for more models).
    ///
    /// # Errors
    /// `OutOfMemory` naming the parameter whose values do not fit twice.
    pub(crate) fn try_clone(&self) -> fsdp::Result<(Vec<UnitSpec>, Vec<ParamSpec>)> {
        let params = |unit: &str, ps: &[ParamSpec]| {
            ps.iter()
                .map(|p| {
                    let source = match &p.source {
                        ParamSource::Values(v) => ParamSource::Values(vec_from_slice(v).map_err(
                            |e| {
                                e.allocating(|| {
                                    format!(
                                        "the copy of the values of parameter '{}' for fsdp_model_new",
                                        fsdp::nn::join_name(unit, &p.name)
                                    )
                                })
                            },
                        )?),
                        s => s.clone(),
                    };
                    Ok(ParamSpec {
                        name: p.name.clone(),
                        shape: p.shape.clone(),
                        requires_grad: p.requires_grad,
                        source,
                    })
                })
                .collect::<fsdp::Result<Vec<_>>>()
        };
        let units = self
            .units
            .iter()
            .map(|u| Ok(UnitSpec::new(&u.name, params(&u.name, &u.params)?)))
            .collect::<fsdp::Result<_>>()?;
        Ok((units, params("", &self.root)?))
    }

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

/// The shape at `shape` and its element count, checked: no negative dimension, and an
/// element count whose f32 bytes fit `size_t` (a parameter no memory can hold is refused
/// here, before anything is allocated for it).
///
/// # Safety
/// `shape` valid for `ndim` reads.
unsafe fn shape_arg(ndim: i32, shape: *const i64) -> Res<(Vec<usize>, usize)> {
    if !(0..=64).contains(&ndim) {
        return Err(Fail::arg(format!("ndim {ndim} is not in 0..=64")));
    }
    if ndim > 0 && shape.is_null() {
        return Err(Fail::arg("shape is NULL"));
    }
    let dims = (0..ndim as usize)
        .map(|i| {
            // SAFETY: valid for ndim reads (the caller's promise), checked non-null.
            let d = unsafe { *shape.add(i) };
            usize::try_from(d).map_err(|_| Fail::arg(format!("shape[{i}] = {d} is negative")))
        })
        .collect::<Res<Vec<usize>>>()?;
    let (numel, _) = fsdp::tensor::alloc::checked_size(&dims, DType::F32)
        .map_err(|e| Fail::arg(format!("{e}: no memory holds this parameter")))?;
    Ok((dims, numel))
}

/// Adds a parameter to unit `unit` (`""`: the root): `name` (no dots), `ndim`
/// dimensions of `shape`, f32 `values` (row-major, the shape's element count; copied), or
/// `values` NULL for a parameter without values on this rank (it gets rank 0's with
/// `sync_module_states`; a shape with no elements needs nothing). `requires_grad` false:
/// frozen (no gradient, never updated).
///
/// Errors: `FSDP_ERR_INVALID_HANDLE`; `FSDP_ERR_INVALID_ARGUMENT` for an undeclared unit,
/// a NULL or non-UTF-8 string, a negative dimension, a shape whose element count or f32
/// size in bytes overflows `size_t`; `FSDP_ERR_OUT_OF_MEMORY` when the copy of `values`
/// cannot be allocated.
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
        let (unit, name, (shape, n)) = unsafe {
            (
                c_str(unit, "unit")?,
                c_str(name, "name")?,
                shape_arg(ndim, shape)?,
            )
        };
        let mut p = match values.is_null() {
            true => ParamSpec::empty(name, &shape),
            false => {
                // SAFETY: values is valid for n reads (the caller's promise).
                let v = unsafe { std::slice::from_raw_parts(values, n) };
                let v = vec_from_slice(v).map_err(|e| {
                    e.allocating(|| format!("the copy of the values of parameter '{name}'"))
                })?;
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
/// Errors: as [`fsdp_spec_add_param`] (no copy, so no `FSDP_ERR_OUT_OF_MEMORY`: the shards
/// are computed by `fsdp_model_new`); `FSDP_ERR_INVALID_ARGUMENT` for an unknown `init`.
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
        let (unit, name, (shape, _)) = unsafe {
            (
                c_str(unit, "unit")?,
                c_str(name, "name")?,
                shape_arg(ndim, shape)?,
            )
        };
        let key = InitKey::new(seed).child(unit);
        let init = match init {
            FSDP_INIT_UNIFORM => {
                fsdp::nn::on_meta_device(|| key.uniform(name, &shape, scale))?.meta_initializer()
            }
            FSDP_INIT_NORMAL => {
                fsdp::nn::on_meta_device(|| key.normal(name, &shape, scale))?.meta_initializer()
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
