//! `torch.distributed.new_subgroups`: a group split into equal subgroups of consecutive
//! ranks, and `get_process_group_ranks`.

use super::{Group, ProcessGroup};
use crate::error::{Error, Result};

/// World ranks of `group`'s members in group-rank order
/// (`torch.distributed.get_process_group_ranks`). Local: no collective.
pub fn get_process_group_ranks(group: &dyn ProcessGroup) -> Vec<usize> {
    group.ranks()
}

/// `torch.distributed.new_subgroups(group_size, group)`: splits `group` into
/// `group.size() / group_size` subgroups of consecutive members (group ranks
/// `[k * group_size, (k + 1) * group_size)`), and returns this rank's subgroup with the world
/// ranks of every subgroup, in order.
///
/// Every rank of `group` must call it (it creates every subgroup, as `new_group` requires),
/// in the same order relative to its other `new_group` calls.
///
/// # Errors
/// `InvalidArgument` when `group_size` is 0, exceeds the group size or does not divide it
/// (torch's checks); whatever [`ProcessGroup::new_group`] reports.
pub fn new_subgroups(
    group: &dyn ProcessGroup,
    group_size: usize,
) -> Result<(Group, Vec<Vec<usize>>)> {
    let n = group.size();
    if group_size == 0 {
        crate::error::bail_arg!("new_subgroups: group_size must be positive");
    }
    if group_size > n {
        crate::error::bail_arg!(
            "new_subgroups: group_size {group_size} exceeds the group size {n}"
        );
    }
    if n % group_size != 0 {
        crate::error::bail_arg!(
            "new_subgroups: the group size {n} is not divisible by group_size {group_size}"
        );
    }
    let members = group.ranks();
    let all: Vec<Vec<usize>> = members.chunks(group_size).map(<[usize]>::to_vec).collect();
    let mut mine = None;
    for ranks in &all {
        if let Some(g) = group.new_group(ranks)? {
            mine = Some(g);
        }
    }
    let mine = mine.ok_or_else(|| {
        Error::InvalidArgument(format!(
            "new_subgroups: rank {} is in none of the subgroups {all:?}",
            group.world_rank()
        ))
    })?;
    Ok((mine, all))
}
