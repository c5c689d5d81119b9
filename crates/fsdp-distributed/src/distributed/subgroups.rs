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

/// What every backend's `new_group` needs before it builds anything: the checked, sorted
/// member list and how many groups of exactly these members this rank created before (the
/// members' calls are matched in order by that count, as torch matches `new_group` calls).
#[derive(Debug, Default)]
pub(crate) struct NewGroupCounter {
    created: parking_lot::Mutex<std::collections::HashMap<Vec<usize>, usize>>,
}

impl NewGroupCounter {
    /// `(sorted members, nth group of these members)` for `ranks` of a world of
    /// `world_size`.
    ///
    /// # Errors
    /// `InvalidArgument` for an empty list, repeated ranks or ranks outside the world.
    pub(crate) fn next(&self, ranks: &[usize], world_size: usize) -> Result<(Vec<usize>, usize)> {
        let mut members = ranks.to_vec();
        members.sort_unstable();
        members.dedup();
        if members.is_empty()
            || members.len() != ranks.len()
            || members.iter().any(|&r| r >= world_size)
        {
            crate::error::bail_arg!(
                "new_group: ranks {ranks:?} must be distinct world ranks in 0..{world_size}, at least one"
            );
        }
        let mut created = self.created.lock();
        let n = created.entry(members.clone()).or_insert(0);
        *n += 1;
        Ok((members, *n - 1))
    }
}
