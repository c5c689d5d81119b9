//! `state_dict` and `load_state_dict` of any module, wrapped by FSDP or not
//! (`torch.nn.Module.state_dict` / `load_state_dict`, `torch/nn/modules/module.py`), and
//! the checks every load shares with FSDP's state dicts (`crate::fsdp::state_dict`).
//!
//! Keys are the fully qualified parameter names of [`visit_parameters`] (PyTorch's
//! `state_dict()` keys for a model built with the same names; a tied parameter under each
//! name). A load checks every entry first (shape, a floating dtype, and with `strict`
//! missing and unexpected keys) and writes only when all are right: one error lists every
//! problem, as PyTorch's `RuntimeError: Error(s) in loading state_dict`.

use super::{visit_parameters, Module};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Whole parameters by fully qualified name, in `model.state_dict()` order (PyTorch's
/// `OrderedDict[str, Tensor]`; FSDP's `FULL_STATE_DICT`).
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
    /// Parameters of the model the state dict did not have; left unchanged.
    pub missing_keys: Vec<String>,
    /// Keys of the state dict the model does not have; ignored.
    pub unexpected_keys: Vec<String>,
}

/// The state dict of `m`: a copy of every parameter, on its device, in `named_parameters()`
/// order (`m.state_dict()`; PyTorch's entries share storage with the parameters, these are
/// copies). A module that keeps its parameters elsewhere answers through
/// [`Module::state_dict_override`]: an FSDP root gathers each unit's shards (every rank
/// must call it then; the result is FSDP's full state dict, f32).
///
/// ```
/// use fsdp::nn::{load_state_dict, state_dict, InitKey, Linear};
/// let mut a = Linear::new(3, 2, true, &InitKey::new(1))?;
/// let mut b = Linear::new(3, 2, true, &InitKey::new(2))?;
/// let sd = state_dict(&mut a)?;
/// assert_eq!(sd.keys().collect::<Vec<_>>(), ["weight", "bias"]);
/// let skipped = load_state_dict(&mut b, &sd, true)?;
/// assert!(skipped.missing_keys.is_empty() && skipped.unexpected_keys.is_empty());
/// assert_eq!(b.weight.data()?.to_vec_f32()?, a.weight.data()?.to_vec_f32()?);
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
    visit_parameters(m, "", false, &mut |name, p| {
        tensors.push((name.to_string(), p.data()?.deep_clone()?));
        Ok(())
    })?;
    Ok(FullStateDict { tensors })
}

/// Copies `sd` into the parameters of `m` (`m.load_state_dict(sd, strict)`), converting
/// the dtype as PyTorch's `param.copy_(input)` does (a bf16 or f16 entry into an f32
/// parameter) and moving values to the parameter's device. Every entry is checked before
/// anything is written. A module that keeps its parameters elsewhere loads through
/// [`Module::load_state_dict_override`] (an FSDP root: every rank passes the whole dict and
/// keeps its shard of it).
///
/// # Errors
/// `StateDict` listing every problem: a shape that differs from the parameter's (PyTorch's `size
/// mismatch`), an integer entry, and with `strict` every missing and
/// unexpected key; nothing is written then. `NotMaterialized` for a parameter without data.
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

/// The load of [`load_state_dict`] over the parameters `m` visits.
fn load_visited(m: &mut dyn Module, sd: &FullStateDict, strict: bool) -> Result<IncompatibleKeys> {
    super::check_names(m)?;
    let mut params: Vec<(String, Vec<usize>)> = Vec::new();
    visit_parameters(m, "", false, &mut |name, p| {
        params.push((name.to_string(), p.shape().to_vec()));
        Ok(())
    })?;
    let (mut problems, mut missing) = (Vec::new(), Vec::new());
    for (name, shape) in &params {
        match sd.get(name) {
            None => missing.push(format!("'{name}' (expected shape {shape:?})")),
            Some(t) => problems.extend(entry_problems(name, t, shape, false)),
        }
    }
    let unexpected: Vec<String> = sd
        .keys()
        .filter(|k| !params.iter().any(|(n, _)| n == k))
        .map(str::to_string)
        .collect();
    let keys = load_verdict("state_dict", problems, missing, unexpected, strict)?;
    visit_parameters(m, "", false, &mut |name, p| match sd.get(name) {
        Some(t) => p.data()?.copy_from(t),
        None => Ok(()),
    })?;
    Ok(keys)
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
