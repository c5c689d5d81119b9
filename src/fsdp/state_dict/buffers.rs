//! Module buffers in state dicts (FSDP1 `_state_dict_utils.py`: buffers are never
//! flattened, and every type of state dict carries the persistent ones whole, in their
//! original dtype, under their `model.state_dict()` names).
//!
//! | type | a buffer is |
//! |---|---|
//! | FULL | a whole tensor (a copy), on rank 0 only with `rank0_only` |
//! | SHARDED | one piece at offset 0 holding all of it, from every rank (a sharded checkpoint keeps rank 0's: [`ShardedStateDict::merge`](super::ShardedStateDict::merge) and the index keep one of equal pieces) |
//! | LOCAL | a whole tensor in [`LocalStateDict::buffers`](super::LocalStateDict::buffers) |
//!
//! Loading copies the value into the buffer on every rank (cast to the buffer's dtype, on
//! its device), so after a load every rank holds the state dict's value, as
//! `model.load_state_dict` does.

use super::layout::host_copy;
use super::StateDict;
use crate::error::Result;
use crate::fsdp::FullyShardedDataParallel;
use crate::nn::{join_name, Module};
use crate::tensor::{DType, Tensor};

/// A persistent buffer as a load checks it: name, shape, dtype.
#[derive(Debug, Clone)]
pub(super) struct BufferMeta {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

/// Every persistent buffer of the model (ignored modules' included, as `model.state_dict()`).
pub(super) fn buffer_metas(root: &mut FullyShardedDataParallel) -> Result<Vec<BufferMeta>> {
    Ok(crate::nn::named_buffers(root, true)?
        .into_iter()
        .map(|(name, t)| BufferMeta {
            name,
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
        })
        .collect())
}

/// Copies of every persistent buffer, in host memory with `host`, else on its device.
pub(super) fn buffer_copies(
    root: &mut FullyShardedDataParallel,
    host: bool,
) -> Result<Vec<(String, Tensor)>> {
    crate::nn::named_buffers(root, true)?
        .into_iter()
        .map(|(n, t)| {
            let c = if host {
                host_copy(&t)?
            } else {
                t.deep_clone()?
            };
            Ok((n, c))
        })
        .collect()
}

/// Every key of `model.state_dict()` in its order: module pre-order, each module's own
/// parameters, then its own persistent buffers, then its children
/// (`nn.Module._save_to_state_dict` then the recursion); FSDP units add no name.
pub(super) fn state_dict_keys(m: &mut dyn Module) -> Result<Vec<String>> {
    let mut out = Vec::new();
    walk_keys(m, "", &mut out)?;
    Ok(out)
}

fn walk_keys(m: &mut dyn Module, prefix: &str, out: &mut Vec<String>) -> Result<()> {
    m.for_each_param(&mut |n, _| {
        out.push(join_name(prefix, n));
        Ok(())
    })?;
    m.for_each_buffer(&mut |n, b| {
        if b.persistent {
            out.push(join_name(prefix, n));
        }
        Ok(())
    })?;
    m.for_each_child(&mut |n, c| walk_keys(c.as_mut(), &join_name(prefix, n), out))
}

/// What a load does with the buffers: the values to copy in, and what was wrong.
#[derive(Debug, Default)]
pub(super) struct BufferPlan {
    /// `(name, value)` per buffer found, checked.
    pub writes: Vec<(String, Tensor)>,
    /// Problems, in words (shape, dtype, pieces).
    pub problems: Vec<String>,
    /// Buffers the state dict lacks, in words.
    pub missing: Vec<String>,
    /// The names of all persistent buffers (keys a state dict may hold).
    pub names: Vec<String>,
}

/// Checks the state dict's entry of every persistent buffer in `metas`.
pub(super) fn plan_buffers(sd: &StateDict, metas: &[BufferMeta]) -> Result<BufferPlan> {
    let mut plan = BufferPlan::default();
    for m in metas {
        plan.names.push(m.name.clone());
        let what = format!("'{}' (buffer of shape {:?}, {})", m.name, m.shape, m.dtype);
        let found: Option<Result<Tensor, String>> = match sd {
            StateDict::Full(d) => d.get(&m.name).map(|t| Ok(t.clone())),
            StateDict::Local(d) => d
                .buffers
                .iter()
                .find(|(n, _)| *n == m.name)
                .map(|(_, t)| Ok(t.clone())),
            StateDict::Sharded(d) => d.get(&m.name).map(|s| {
                if s.global_shape != m.shape {
                    return Err(format!(
                        "'{}': expected shape {:?}, got {:?}",
                        m.name, m.shape, s.global_shape
                    ));
                }
                let n = s.global_numel();
                if n == 0 {
                    return Ok(Tensor::zeros(&m.shape, m.dtype));
                }
                // The lowest rank's whole piece (every rank saves all of a buffer).
                s.pieces
                    .iter()
                    .filter(|p| p.offset == 0 && p.data.numel() == n)
                    .min_by_key(|p| p.rank)
                    .map(|p| p.data.clone())
                    .ok_or_else(|| {
                        format!(
                            "'{}': no piece holds the whole buffer of {n} elements",
                            m.name
                        )
                    })
            }),
        };
        let t = match found {
            None => {
                plan.missing.push(what);
                continue;
            }
            Some(Err(p)) => {
                plan.problems.push(p);
                continue;
            }
            Some(Ok(t)) => t,
        };
        if t.numel() != m.shape.iter().product::<usize>()
            || (!matches!(sd, StateDict::Sharded(_)) && t.shape() != m.shape.as_slice())
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
    Ok(plan)
}

/// Copies each planned value into its buffer (cast to the buffer's dtype, on its device).
pub(super) fn write_buffers(
    root: &mut FullyShardedDataParallel,
    writes: &[(String, Tensor)],
) -> Result<()> {
    if writes.is_empty() {
        return Ok(());
    }
    crate::nn::visit_buffers(root, "", false, &mut |name, b| match writes
        .iter()
        .find(|(n, _)| n == name)
    {
        Some((_, t)) if b.persistent => b.data.copy_from(t),
        _ => Ok(()),
    })
}
