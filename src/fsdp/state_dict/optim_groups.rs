//! Parameter groups in FSDP optimizer state dicts: the optimizer's groups hold positions
//! of [`optimizer_params`](FullyShardedDataParallel::optimizer_params), which differ from
//! rank to rank and between world sizes; the state dict names the original parameters
//! instead (`param_groups[g]["params"]` as FQNs, FSDP1's `_optim_utils.py`), each rank
//! contributing the parameters it holds, and loading maps the names back to this rank's
//! positions.

use super::layout::UnitMeta;
use crate::distributed::fingerprint::Phase;
use crate::distributed::{staged, ReduceOp};
use crate::error::{Error, Result};
use crate::fsdp::FullyShardedDataParallel;
use crate::optim::ParamGroup;
use crate::tensor::Tensor;

/// A parameter group by original parameter names (`optim_state_dict`'s `param_groups`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NamedParamGroup {
    /// The names (as in the model's state dict) of the group's parameters, in model order.
    pub params: Vec<String>,
    /// The group's learning rate.
    pub lr: f32,
    /// The group's weight decay.
    pub weight_decay: f32,
}

/// Every trainable parameter's name, in model order: units' parameters (the first name of
/// a tied one), then ignored modules' ones.
fn all_names(metas: &[UnitMeta], ignored: &[(String, Vec<usize>, bool)]) -> Vec<String> {
    let mut out = Vec::new();
    for m in metas {
        for (k, info) in m.infos.iter().enumerate() {
            if info.requires_grad {
                if let Some((n, _)) = m.slots.iter().find(|(_, j)| *j == k) {
                    out.push(n.clone());
                }
            }
        }
    }
    out.extend(ignored.iter().filter(|i| i.2).map(|(n, _, _)| n.clone()));
    out
}

/// Names the positions of `groups` (`names[p]` is position `p`'s parameter) and merges
/// the ranks' memberships over the world: a collective (one all-reduce), taken by every
/// rank when the optimizer has groups.
///
/// # Errors
/// `StateDict` when ranks have different group counts or a position has no name; the
/// collective's errors.
pub(super) fn to_named(
    root: &mut FullyShardedDataParallel,
    metas: &[UnitMeta],
    ignored: &[(String, Vec<usize>, bool)],
    names: &[(String, Vec<usize>)],
    groups: &[ParamGroup],
) -> Result<Vec<NamedParamGroup>> {
    let all = all_names(metas, ignored);
    // Per parameter, the group holding this rank's elements of it (-1: none here), then
    // the group count and its negation (so one Max gives the largest and the smallest).
    let mut member: Vec<i32> = vec![-1; all.len() + 2];
    for (g, pg) in groups.iter().enumerate() {
        for &p in &pg.params {
            let name = names.get(p).map(|(n, _)| n.as_str()).unwrap_or("");
            let i = all.iter().position(|n| n == name).ok_or_else(|| {
                Error::StateDict(format!(
                    "parameter group {g} lists position {p}, which is no trainable parameter of this model"
                ))
            })?;
            member[i] = g as i32;
        }
    }
    let n = all.len();
    member[n] = groups.len() as i32;
    member[n + 1] = -(groups.len() as i32);
    let t = Tensor::from_vec(member, &[n + 2])?;
    {
        let _tag = root.fingerprint(Phase::StateDict);
        staged::all_reduce(root.process_group().as_ref(), &t, ReduceOp::Max)?;
    }
    let member = t.data::<i32>()?.to_vec();
    if member[n] != -member[n + 1] {
        return Err(Error::StateDict(format!(
            "ranks have between {} and {} parameter groups; every rank must set the same groups",
            -member[n + 1],
            member[n]
        )));
    }
    Ok(groups
        .iter()
        .enumerate()
        .map(|(g, pg)| NamedParamGroup {
            params: (0..n)
                .filter(|&i| member[i] == g as i32)
                .map(|i| all[i].clone())
                .collect(),
            lr: pg.lr,
            weight_decay: pg.weight_decay,
        })
        .collect())
}

/// The groups of `named` as positions of this rank's `names`.
///
/// # Errors
/// `StateDict` naming a parameter of this rank that is in no group.
pub(super) fn to_positions(
    named: &[NamedParamGroup],
    names: &[(String, Vec<usize>)],
) -> Result<Vec<ParamGroup>> {
    let mut out: Vec<ParamGroup> = named
        .iter()
        .map(|g| ParamGroup {
            params: Vec::new(),
            lr: g.lr,
            weight_decay: g.weight_decay,
        })
        .collect();
    for (p, (name, _)) in names.iter().enumerate() {
        let g = named
            .iter()
            .position(|g| g.params.iter().any(|n| n == name))
            .ok_or_else(|| {
                Error::StateDict(format!(
                    "parameter '{name}' is in none of the optimizer state's parameter groups"
                ))
            })?;
        out[g].params.push(p);
    }
    Ok(out)
}
