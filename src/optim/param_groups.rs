//! Parameter groups (`optimizer.param_groups` of `torch.optim.Optimizer`): tensors of the
//! step list with their own learning rate and weight decay, and the checks every
//! hyperparameter goes through (PyTorch's `ValueError`s of `torch/optim/sgd.py`,
//! `adam.py`, `adamw.py`, plus: nothing non-finite).
//!
//! nanoGPT's `configure_optimizers` puts every parameter with 2 or more dimensions (matmul
//! weights, embeddings) in a group with weight decay and the others (biases, norm scales and
//! shifts) in one without: [`no_decay_groups`] builds those two groups from the original
//! shapes of the list's tensors ([`super::parameter_names`] for a plain module,
//! [`FullyShardedDataParallel::optimizer_param_names`](crate::fsdp::FullyShardedDataParallel::optimizer_param_names)
//! under FSDP).

use crate::error::{Error, Result};

/// One parameter group: the positions of its tensors in the list given to
/// [`Optimizer::step`](super::Optimizer::step) (PyTorch's `params`), and its options.
/// Options not listed (betas, eps, momentum, ...) are the optimizer's own.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// Positions in the step list; each position is in exactly one group.
    pub params: Vec<usize>,
    /// Learning rate of this group (`param_groups[g]["lr"]`), finite and >= 0.
    pub lr: f32,
    /// Weight decay of this group (`param_groups[g]["weight_decay"]`), finite and >= 0:
    /// L2 for SGD and Adam, decoupled for AdamW.
    pub weight_decay: f32,
}

/// The learning rate and weight decay a tensor is stepped with, and its group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TensorHyper {
    pub group: usize,
    pub lr: f32,
    pub weight_decay: f32,
}

/// Each of `n` tensors' group and options: from `groups`, or all in one group with `lr`
/// and `weight_decay` when there are none.
///
/// # Errors
/// `InvalidArgument` when a position is `>= n`, in two groups, or in none.
pub(crate) fn resolve(
    groups: Option<&[ParamGroup]>,
    n: usize,
    lr: f32,
    weight_decay: f32,
) -> Result<Vec<TensorHyper>> {
    let Some(groups) = groups else {
        return Ok(vec![
            TensorHyper {
                group: 0,
                lr,
                weight_decay
            };
            n
        ]);
    };
    let mut out: Vec<Option<TensorHyper>> = vec![None; n];
    for (g, pg) in groups.iter().enumerate() {
        for &i in &pg.params {
            let slot = out.get_mut(i).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "parameter group {g} lists tensor {i}, but the step list has {n} tensors"
                ))
            })?;
            if let Some(other) = slot {
                return Err(Error::InvalidArgument(format!(
                    "tensor {i} of the step list is in parameter groups {} and {g}",
                    other.group
                )));
            }
            *slot = Some(TensorHyper {
                group: g,
                lr: pg.lr,
                weight_decay: pg.weight_decay,
            });
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, h)| {
            h.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "tensor {i} of the step list is in no parameter group"
                ))
            })
        })
        .collect()
}

/// Checks that no position is in two of `groups` (coverage of the step list is checked at
/// each step, when its length is known).
///
/// # Errors
/// `InvalidArgument` naming the position and both groups.
pub(crate) fn resolve_positions(groups: &[ParamGroup]) -> Result<()> {
    let mut seen: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    for (g, pg) in groups.iter().enumerate() {
        for &i in &pg.params {
            if let Some(other) = seen.insert(i, g) {
                return Err(Error::InvalidArgument(format!(
                    "tensor {i} of the step list is in parameter groups {other} and {g}"
                )));
            }
        }
    }
    Ok(())
}

/// Sets each group's lr from `lrs` (or the default lr without groups), all or nothing.
///
/// # Errors
/// `InvalidArgument` for a count that is not the group count, or a bad value.
pub(crate) fn set_group_lrs(
    kind: &str,
    default_lr: &mut f32,
    groups: &mut Option<Vec<ParamGroup>>,
    lrs: &[f32],
) -> Result<()> {
    let count = groups.as_ref().map_or(1, Vec::len);
    if lrs.len() != count {
        return Err(Error::InvalidArgument(format!(
            "{kind}: {} learning rates for {count} parameter groups",
            lrs.len()
        )));
    }
    for (g, &lr) in lrs.iter().enumerate() {
        check_non_negative(kind, &format!("param_groups[{g}] lr"), lr)?;
    }
    match groups {
        Some(gs) => gs.iter_mut().zip(lrs).for_each(|(g, &lr)| g.lr = lr),
        None => *default_lr = lrs[0],
    }
    Ok(())
}

/// `value` must be finite and `>= 0` (PyTorch: `Invalid learning rate: nan`).
///
/// # Errors
/// `InvalidArgument` naming the optimizer, the hyperparameter and the value.
pub(crate) fn check_non_negative(kind: &str, name: &str, value: f32) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "{kind}: {name} {value} must be finite and >= 0"
        )))
    }
}

/// Checks the options of every group of `groups` (see [`check_non_negative`]).
pub(crate) fn check_groups(kind: &str, groups: &[ParamGroup]) -> Result<()> {
    for (g, pg) in groups.iter().enumerate() {
        check_non_negative(kind, &format!("param_groups[{g}] lr"), pg.lr)?;
        check_non_negative(
            kind,
            &format!("param_groups[{g}] weight_decay"),
            pg.weight_decay,
        )?;
    }
    Ok(())
}

/// nanoGPT's two groups over a step list whose tensors come from parameters of the given
/// `shapes` (by position): group 0 holds the tensors of parameters with 2 or more
/// dimensions, which decay with `weight_decay`; group 1 the others (biases, LayerNorm
/// weights and biases), which do not. Both have learning rate `lr`, and both are there even
/// when one is empty, so every FSDP rank has the same groups whatever parameters its shard
/// holds.
///
/// ```
/// use fsdp::nn::{InitKey, LayerNorm, Linear, Module, Sequential};
/// use fsdp::optim::{no_decay_groups, parameter_names, AdamConfig, AdamW, Optimizer};
///
/// let mut model = Sequential::new(vec![
///     Box::new(Linear::new(4, 4, true, &InitKey::new(0)).unwrap()),
///     Box::new(LayerNorm::new(4).unwrap()),
/// ]);
/// let names = parameter_names(&mut model); // weight, bias, ln weight, ln bias
/// let groups = no_decay_groups(&names.iter().map(|(_, s)| s.clone()).collect::<Vec<_>>(), 1e-3, 0.1);
/// assert_eq!(groups[0].params, vec![0]); // 0.weight decays
/// assert_eq!(groups[1].params, vec![1, 2, 3]); // biases and norms do not
/// let mut opt = AdamW::new(AdamConfig::adamw());
/// opt.set_param_groups(groups).unwrap();
/// ```
pub fn no_decay_groups(shapes: &[Vec<usize>], lr: f32, weight_decay: f32) -> Vec<ParamGroup> {
    let (decay, no_decay): (Vec<usize>, Vec<usize>) =
        (0..shapes.len()).partition(|&i| shapes[i].len() >= 2);
    [(decay, weight_decay), (no_decay, 0.0)]
        .into_iter()
        .map(|(params, weight_decay)| ParamGroup {
            params,
            lr,
            weight_decay,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(params: Vec<usize>, lr: f32) -> ParamGroup {
        ParamGroup {
            params,
            lr,
            weight_decay: 0.5,
        }
    }

    #[test]
    fn resolve_covers_every_tensor_once() {
        let h = resolve(Some(&[g(vec![2, 0], 0.1), g(vec![1], 0.2)]), 3, 9.0, 9.0).unwrap();
        assert_eq!(h.iter().map(|h| h.group).collect::<Vec<_>>(), vec![0, 1, 0]);
        assert_eq!(h[1].lr, 0.2);
        assert_eq!(resolve(None, 2, 0.3, 0.0).unwrap()[1].lr, 0.3);
        let e = |gs: &[ParamGroup]| resolve(Some(gs), 2, 0.0, 0.0).unwrap_err().to_string();
        assert!(e(&[g(vec![0], 0.1)]).contains("tensor 1 of the step list is in no"));
        assert!(e(&[g(vec![0, 1], 0.1), g(vec![1], 0.1)]).contains("groups 0 and 1"));
        assert!(e(&[g(vec![0, 1, 2], 0.1)]).contains("has 2 tensors"));
    }

    #[test]
    fn non_finite_and_negative_values_are_refused() {
        for bad in [f32::NAN, f32::INFINITY, -1e-3] {
            assert!(check_non_negative("SGD", "lr", bad).is_err(), "{bad}");
        }
        assert!(check_non_negative("SGD", "lr", 0.0).is_ok());
        let e = check_groups("AdamW", &[g(vec![0], 0.1), g(vec![1], f32::NAN)]).unwrap_err();
        assert!(e.to_string().contains("param_groups[1] lr NaN"), "{e}");
    }

    #[test]
    fn no_decay_splits_by_dimension() {
        let shapes = vec![vec![3, 4], vec![3], vec![5, 2, 2], vec![], vec![7]];
        let gs = no_decay_groups(&shapes, 0.01, 0.1);
        assert_eq!(gs.len(), 2);
        assert_eq!(
            (gs[0].params.clone(), gs[0].weight_decay),
            (vec![0, 2], 0.1)
        );
        assert_eq!(
            (gs[1].params.clone(), gs[1].weight_decay),
            (vec![1, 3, 4], 0.0)
        );
        let only_bias = no_decay_groups(&[vec![2]], 0.01, 0.1);
        assert_eq!(only_bias.len(), 2);
        assert!(only_bias[0].params.is_empty());
    }
}
