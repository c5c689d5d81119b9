//! `state_dict` and `load_state_dict` of any module, wrapped by FSDP or not
//! (`torch.nn.Module.state_dict` / `load_state_dict`, `torch/nn/modules/module.py`), and
//! what every load shares with FSDP's state dicts (`crate::fsdp::state_dict`): the key
//! order, the checks, and the planning and writing of persistent buffers.
//!
//! Keys are PyTorch's `state_dict()` keys for a model built with the same names, in its
//! order ([`visit_state`]): module pre-order, each module's own parameters
//! ([`visit_parameters`] names; a tied parameter under each name), then its own persistent
//! buffers in their own dtype (`BatchNorm1d.num_batches_tracked` i64), then its children
//! (`Module._save_to_state_dict`, then the recursion); non-persistent buffers are left
//! out. An FSDP root's state dict has the same keys, in the same order. A load checks every
//! entry first (shape, dtype, and with `strict` missing and unexpected keys) and writes
//! only when all are right: one error lists every problem, as PyTorch's `RuntimeError:
//! Error(s) in loading state_dict`.

use super::{join_name, visit_parameters, Module, ModuleBuffer, Parameter};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Whole parameters and persistent buffers by fully qualified name, in `model.state_dict()`
/// order (PyTorch's `OrderedDict[str, Tensor]`; FSDP's `FULL_STATE_DICT`).
#[derive(Debug, Clone, Default)]
pub struct FullStateDict {
    /// `(name, values)` pairs.
    pub tensors: Vec<(String, Tensor)>,
}

impl FullStateDict {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when there are no entries (every rank but 0 with `rank0_only`).
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }
}

/// Keys a non-strict load skipped (`torch.nn.modules.module._IncompatibleKeys`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IncompatibleKeys {
    /// Parameters and persistent buffers of the model the state dict did not have; left
    /// unchanged.
    pub missing_keys: Vec<String>,
    /// Keys of the state dict the model does not have; ignored.
    pub unexpected_keys: Vec<String>,
}

/// The state dict of `m`: a copy of every parameter and persistent buffer, on its device,
/// in `model.state_dict()` order (module pre-order, each module's parameters then its
/// persistent buffers; see the module docs). Buffers keep their dtype (`BatchNorm1d`'s
/// `num_batches_tracked` is i64); non-persistent ones are left out. PyTorch's entries share
/// storage with the module, these are copies. A module that keeps its parameters elsewhere
/// answers through [`Module::state_dict_override`]: an FSDP root gathers each unit's shards
/// (every rank must call it then; the result is FSDP's full state dict, parameters in f32,
/// with the same keys as this function gives for the unwrapped model).
///
/// ```
/// use fsdp::nn::{load_state_dict, state_dict, BatchNorm1d, InitKey, Linear, Module, Sequential};
/// let mut a = Linear::new(3, 2, true, &InitKey::new(1))?;
/// let mut b = Linear::new(3, 2, true, &InitKey::new(2))?;
/// let sd = state_dict(&mut a)?;
/// assert_eq!(sd.keys().collect::<Vec<_>>(), ["weight", "bias"]);
/// let skipped = load_state_dict(&mut b, &sd, true)?;
/// assert!(skipped.missing_keys.is_empty() && skipped.unexpected_keys.is_empty());
/// assert_eq!(b.weight.data()?.to_vec_f32()?, a.weight.data()?.to_vec_f32()?);
///
/// let mut bn = Sequential::new(vec![Box::new(BatchNorm1d::new(2)?) as Box<dyn Module>]);
/// let sd = state_dict(&mut bn)?;
/// let keys: Vec<&str> = sd.keys().collect();
/// assert_eq!(keys, ["0.weight", "0.bias", "0.running_mean", "0.running_var", "0.num_batches_tracked"]);
/// assert_eq!(sd.get("0.num_batches_tracked").unwrap().dtype(), fsdp::tensor::DType::I64);
/// # Ok::<(), fsdp::Error>(())
/// ```
///
/// # Errors
/// `NotMaterialized` for a parameter without data (on the meta device, or sharded by a
/// nested FSDP unit: take the root's state dict); a device copy's error;
/// `InvalidArgument` for an empty or repeated name ([`check_names`](super::check_names)).
pub fn state_dict(m: &mut dyn Module) -> Result<FullStateDict> {
    if let Some(sd) = m.state_dict_override() {
        return sd;
    }
    super::check_names(m)?;
    let mut tensors = Vec::new();
    visit_state(m, "", &mut |name, e| {
        let t = match e {
            StateEntry::Param(p) => p.data()?.deep_clone()?,
            StateEntry::Buffer(b) => b.data.deep_clone()?,
        };
        tensors.push((name.to_string(), t));
        Ok(())
    })?;
    Ok(FullStateDict { tensors })
}

/// Copies `sd` into the parameters and persistent buffers of `m` (`m.load_state_dict(sd,
/// strict)`), converting the dtype as PyTorch's `param.copy_(input)` does (a bf16 or f16
/// entry into an f32 parameter; a buffer takes its own dtype) and moving values to the
/// tensor's device. Every entry is checked before anything is written. A module that keeps its parameters elsewhere loads through
/// [`Module::load_state_dict_override`] (an FSDP root: every rank passes the whole dict and
/// keeps its shard of it).
///
/// # Errors
/// `StateDict` listing every problem: a shape that differs from the parameter's or
/// buffer's (PyTorch's `size mismatch`), an integer entry for a parameter, an integer entry
/// for a floating buffer or the reverse, and with `strict` every missing and unexpected key
/// (a non-persistent buffer's name is unexpected); nothing is written then. `NotMaterialized` for a parameter without data.
pub fn load_state_dict(
    m: &mut dyn Module,
    sd: &FullStateDict,
    strict: bool,
) -> Result<IncompatibleKeys> {
    if sd
        .tensors
        .iter()
        .any(|(_, t)| matches!(t.dtype(), DType::BF16 | DType::F16))
    {
        // FSDP loads f32 and f64; cast 16-bit values here as `copy_` would (integers are
        // reported below).
        let mut cast = FullStateDict::default();
        for (n, t) in &sd.tensors {
            let t = match t.dtype() {
                DType::BF16 | DType::F16 => t.to_dtype(DType::F32)?,
                _ => t.clone(),
            };
            cast.tensors.push((n.clone(), t));
        }
        if let Some(r) = m.load_state_dict_override(&cast, strict) {
            return r;
        }
        return load_visited(m, &cast, strict);
    }
    if let Some(r) = m.load_state_dict_override(sd, strict) {
        return r;
    }
    load_visited(m, sd, strict)
}

/// The load of [`load_state_dict`] over the parameters and persistent buffers `m` visits.
fn load_visited(m: &mut dyn Module, sd: &FullStateDict, strict: bool) -> Result<IncompatibleKeys> {
    super::check_names(m)?;
    let mut params: Vec<(String, Vec<usize>)> = Vec::new();
    visit_parameters(m, "", false, &mut |name, p| {
        params.push((name.to_string(), p.shape().to_vec()));
        Ok(())
    })?;
    let bufs = plan_buffers(&buffer_metas(m)?, true, |b| {
        sd.get(&b.name).map(|t| Ok(t.clone()))
    });
    let (mut problems, mut missing) = (Vec::new(), Vec::new());
    for (name, shape) in &params {
        match sd.get(name) {
            None => missing.push(format!("'{name}' (expected shape {shape:?})")),
            Some(t) => problems.extend(entry_problems(name, t, shape, false)),
        }
    }
    problems.extend(bufs.problems);
    missing.extend(bufs.missing);
    let unexpected: Vec<String> = sd
        .keys()
        .filter(|k| !params.iter().any(|(n, _)| n == k) && !bufs.names.iter().any(|n| n == k))
        .map(str::to_string)
        .collect();
    let keys = load_verdict("state_dict", problems, missing, unexpected, strict)?;
    visit_parameters(m, "", false, &mut |name, p| match sd.get(name) {
        Some(t) => p.data()?.copy_from(t),
        None => Ok(()),
    })?;
    write_buffers(m, &bufs.writes)?;
    Ok(keys)
}

/// One entry of a state dict as [`visit_state`] meets it.
pub(crate) enum StateEntry<'a> {
    /// A parameter.
    Param(&'a mut Parameter),
    /// A persistent buffer.
    Buffer(&'a mut ModuleBuffer),
}

/// Visits every entry of `m`'s state dict in `model.state_dict()` order, with fully
/// qualified names: module pre-order, each module's own parameters, then its own persistent
/// buffers, then its children (`nn.Module._save_to_state_dict`, then the recursion). FSDP
/// units add no name and are walked through.
///
/// # Errors
/// The first error `f` (or a module's own walk) returns; the walk stops there.
pub(crate) fn visit_state(
    m: &mut dyn Module,
    prefix: &str,
    f: &mut dyn FnMut(&str, StateEntry<'_>) -> Result<()>,
) -> Result<()> {
    m.for_each_param(&mut |n, p| f(&join_name(prefix, n), StateEntry::Param(p)))?;
    m.for_each_buffer(&mut |n, b| {
        if b.persistent {
            f(&join_name(prefix, n), StateEntry::Buffer(b))?;
        }
        Ok(())
    })?;
    m.for_each_child(&mut |n, c| visit_state(c.as_mut(), &join_name(prefix, n), f))
}

/// Every key of `model.state_dict()`, in its order ([`visit_state`]).
///
/// # Errors
/// A module's walk error.
pub(crate) fn state_dict_keys(m: &mut dyn Module) -> Result<Vec<String>> {
    let mut out = Vec::new();
    visit_state(m, "", &mut |n, _| {
        out.push(n.to_string());
        Ok(())
    })?;
    Ok(out)
}

/// A persistent buffer as a load checks it: name, shape, dtype.
#[derive(Debug, Clone)]
pub(crate) struct BufferMeta {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// Every persistent buffer below `m`, in `named_buffers()` order.
///
/// # Errors
/// A module's walk error.
pub(crate) fn buffer_metas(m: &mut dyn Module) -> Result<Vec<BufferMeta>> {
    Ok(super::named_buffers(m, true)?
        .into_iter()
        .map(|(name, t)| BufferMeta {
            name,
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
        })
        .collect())
}

/// What a load does with the persistent buffers: the values to copy in, and what was wrong.
#[derive(Debug, Default)]
pub(crate) struct BufferPlan {
    /// `(name, value)` per buffer found, checked.
    pub writes: Vec<(String, Tensor)>,
    /// Problems, in words (shape, dtype, and what `find` reported).
    pub problems: Vec<String>,
    /// Buffers the state dict lacks, in words (`'name' (buffer of shape [6], f32)`).
    pub missing: Vec<String>,
    /// The names of all persistent buffers (keys a state dict may hold).
    pub names: Vec<String>,
}

/// Checks the state dict's entry of every buffer in `metas`: `find` gives the entry (`None`:
/// missing; `Err`: a problem it saw), which must hold the buffer's element count (and its
/// shape with `exact_shape`; a sharded entry is flat) and be floating exactly when the buffer
/// is. Each value is copied into its buffer later by [`write_buffers`] (cast to its dtype,
/// as `Tensor.copy_`).
pub(crate) fn plan_buffers(
    metas: &[BufferMeta],
    exact_shape: bool,
    mut find: impl FnMut(&BufferMeta) -> Option<std::result::Result<Tensor, String>>,
) -> BufferPlan {
    let mut plan = BufferPlan::default();
    for m in metas {
        plan.names.push(m.name.clone());
        let t = match find(m) {
            None => {
                plan.missing.push(format!(
                    "'{}' (buffer of shape {:?}, {})",
                    m.name, m.shape, m.dtype
                ));
                continue;
            }
            Some(Err(p)) => {
                plan.problems.push(p);
                continue;
            }
            Some(Ok(t)) => t,
        };
        if t.numel() != crate::tensor::numel_of(&m.shape)
            || (exact_shape && t.shape() != m.shape.as_slice())
        {
            plan.problems.push(format!(
                "'{}': expected shape {:?}, got {:?}",
                m.name,
                m.shape,
                t.shape()
            ));
        } else if t.dtype().is_float() != m.dtype.is_float() {
            plan.problems.push(format!(
                "'{}': expected a buffer of dtype {}, got {}",
                m.name,
                m.dtype,
                t.dtype()
            ));
        } else {
            plan.writes.push((m.name.clone(), t));
        }
    }
    plan
}

/// Copies each planned value into its persistent buffer below `m` (cast to the buffer's
/// dtype, on its device).
///
/// # Errors
/// A copy's error (a device copy).
pub(crate) fn write_buffers(m: &mut dyn Module, writes: &[(String, Tensor)]) -> Result<()> {
    if writes.is_empty() {
        return Ok(());
    }
    super::visit_buffers(
        m,
        "",
        false,
        &mut |name, b| match writes.iter().find(|(n, _)| n == name) {
            Some((_, t)) if b.persistent => b.data.copy_from(t),
            _ => Ok(()),
        },
    )
}

/// What is wrong with entry `t` for the parameter `(name, shape)`: its shape, and its
/// dtype (f32 only when `f32_only`, as FSDP's flat buffers hold; else any float).
fn entry_problems(name: &str, t: &Tensor, shape: &[usize], f32_only: bool) -> Vec<String> {
    shape_problem(name, shape, t.shape())
        .into_iter()
        .chain(dtype_problem(name, t.dtype(), f32_only))
        .collect()
}

/// A shape that is not the parameter's (`size mismatch` in PyTorch's words).
pub(crate) fn shape_problem(name: &str, want: &[usize], got: &[usize]) -> Option<String> {
    (want != got).then(|| format!("'{name}': expected shape {want:?}, got {got:?}"))
}

/// A dtype a load cannot take: not f32 or f64 (the FlatParameter's dtypes; a value is cast
/// to the parameter's dtype on load, as `Tensor.copy_`) when `exact_floats`, an integer
/// otherwise.
pub(crate) fn dtype_problem(name: &str, dtype: DType, exact_floats: bool) -> Option<String> {
    let bad = if exact_floats {
        !matches!(dtype, DType::F32 | DType::F64)
    } else {
        matches!(dtype, DType::I32 | DType::I64)
    };
    bad.then(|| {
        format!(
            "'{name}': expected dtype {}, got {dtype}",
            if exact_floats {
                "f32 or f64"
            } else {
                "f32, f64, bf16 or f16"
            }
        )
    })
}

/// The one error a failed load reports: every problem, then missing and unexpected keys.
pub(crate) fn load_error(
    what: &str,
    problems: &[String],
    missing: &[String],
    unexpected: &[String],
) -> Error {
    let mut parts: Vec<String> = problems.to_vec();
    if !missing.is_empty() {
        parts.push(format!("missing key(s): {}", missing.join(", ")));
    }
    if !unexpected.is_empty() {
        parts.push(format!(
            "unexpected key(s): {}",
            unexpected
                .iter()
                .map(|k| format!("'{k}'"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Error::StateDict(format!(
        "error(s) in loading {what}; nothing was modified: {}",
        parts.join("; ")
    ))
}

/// A load's verdict: an error for any problem (and, with `strict`, for missing or
/// unexpected keys); else the keys a non-strict load skipped. `missing` entries are
/// `'name' (what was expected)`; the result names them alone.
pub(crate) fn load_verdict(
    what: &str,
    problems: Vec<String>,
    missing: Vec<String>,
    unexpected: Vec<String>,
    strict: bool,
) -> Result<IncompatibleKeys> {
    if !problems.is_empty() || (strict && !(missing.is_empty() && unexpected.is_empty())) {
        let (m, u): (&[String], &[String]) = if strict {
            (&missing, &unexpected)
        } else {
            (&[], &[])
        };
        return Err(load_error(what, &problems, m, u));
    }
    let missing_keys = missing
        .iter()
        .map(|m| {
            m.trim_start_matches('\'')
                .split('\'')
                .next()
                .unwrap_or(m)
                .to_string()
        })
        .collect();
    Ok(IncompatibleKeys {
        missing_keys,
        unexpected_keys: unexpected,
    })
}
