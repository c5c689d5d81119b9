//! What a rank called, compared across the ranks of a group before any data moves: shared
//! by the `threads` and `tcp` backends so that both check the same fields and word a
//! mismatch the same way.

use super::ReduceOp;
use crate::tensor::DType;

/// The argument that tells calls of one op apart (compared across ranks like the rest of
/// the descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arg {
    None,
    Op(ReduceOp),
    Src(usize),
}

/// One rank's call: op, dtype, element counts and argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub(crate) op: &'static str,
    pub(crate) dtype: DType,
    pub(crate) in_numel: usize,
    pub(crate) out_numel: usize,
    pub(crate) arg: Arg,
    /// Whether the tensors are on CUDA devices (a rank on the host and one on a GPU in one
    /// collective is a mismatch).
    pub(crate) cuda: bool,
}

impl std::fmt::Display for Desc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}({}, {} -> {} elements",
            self.op, self.dtype, self.in_numel, self.out_numel
        )?;
        match self.arg {
            Arg::None => {}
            Arg::Op(op) => write!(f, ", {op:?}")?,
            Arg::Src(src) => write!(f, ", src={src}")?,
        }
        f.write_str(if self.cuda { ", on cuda)" } else { ")" })
    }
}

/// Compares every member's descriptor (`desc(r)` for group rank `r` of `n`, `None` for one
/// not known) with the first member's; `Err` with the mismatch text, ranks named by world
/// rank (`members`). Allocates only to word a mismatch.
pub(crate) fn check_descs(
    n: usize,
    desc: impl Fn(usize) -> Option<Desc>,
    members: &[usize],
) -> std::result::Result<(), String> {
    let Some(first) = desc(0) else {
        return Err("internal: rank 0 did not arrive".into());
    };
    let differs = |r: usize| desc(r).is_some_and(|d| d != first);
    if !(0..n).any(differs) {
        return Ok(());
    }
    let differing: Vec<String> = (0..n)
        .filter(|&r| differs(r))
        .filter_map(|r| desc(r).map(|d| format!("rank {} called {d}", members[r])))
        .collect();
    Err(format!(
        "rank {} called {first} but {}",
        members[0],
        differing.join(", ")
    ))
}
