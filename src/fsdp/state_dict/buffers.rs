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
use crate::nn::state_dict::{plan_buffers as plan, BufferMeta, BufferPlan};
use crate::tensor::Tensor;

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

/// Checks the state dict's entry of every persistent buffer in `metas`, as
/// [`crate::nn::load_state_dict`] checks an unwrapped module's (one planner for both): a
/// full or local entry whole, a sharded one from the lowest rank's piece holding all of it.
pub(super) fn plan_buffers(sd: &StateDict, metas: &[BufferMeta]) -> BufferPlan {
    plan(metas, !matches!(sd, StateDict::Sharded(_)), |m| match sd {
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
    })
}
