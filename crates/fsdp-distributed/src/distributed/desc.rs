//! What a rank called, compared across the ranks of a group before any data moves: shared
//! by the `threads` and `tcp` backends so that both check the same fields and word a
//! mismatch the same way.

use super::fingerprint::Fingerprint;
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

/// One rank's call: op, dtype, element counts, argument, and what the caller says it is for.
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
    /// What the call is for (the [`fingerprint::current`](super::fingerprint::current) of
    /// the calling thread when it entered the collective).
    pub(crate) tag: Option<Fingerprint>,
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
        f.write_str(if self.cuda { ", on cuda)" } else { ")" })?;
        match &self.tag {
            Some(fp) => write!(f, " for {fp}"),
            None => Ok(()),
        }
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

/// The local argument checks of `all_gather_into_tensor` (torch's): the output holds `w`
/// inputs of the same dtype.
///
/// # Errors
/// `InvalidArgument` naming the rank, shapes and dtypes.
pub(crate) fn check_all_gather(
    rank: usize,
    w: usize,
    output: &crate::tensor::Tensor,
    input: &crate::tensor::Tensor,
) -> crate::error::Result<()> {
    if output.numel() != w * input.numel() || output.dtype() != input.dtype() {
        crate::error::bail_arg!(
            "all_gather_into_tensor on rank {rank}: output {:?} {} must hold {w} x input {:?} {}",
            output.shape(),
            output.dtype(),
            input.shape(),
            input.dtype()
        );
    }
    Ok(())
}

/// The local argument checks of `reduce_scatter_tensor`: the input holds `w` outputs of the
/// same dtype, and the op is `Sum` or `Avg`.
///
/// # Errors
/// `InvalidArgument` naming the rank, shapes, dtypes or op.
pub(crate) fn check_reduce_scatter(
    rank: usize,
    w: usize,
    output: &crate::tensor::Tensor,
    input: &crate::tensor::Tensor,
    op: ReduceOp,
) -> crate::error::Result<()> {
    if input.numel() != w * output.numel() || output.dtype() != input.dtype() {
        crate::error::bail_arg!(
            "reduce_scatter_tensor on rank {rank}: input {:?} {} must hold {w} x output {:?} {}",
            input.shape(),
            input.dtype(),
            output.shape(),
            output.dtype()
        );
    }
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        crate::error::bail_arg!("reduce_scatter_tensor supports Sum and Avg, got {op:?}");
    }
    Ok(())
}

/// Calls `$self.$f::<T>(args)` with `T` the Rust type of `$dtype`: the typed body of a
/// collective, picked by the tensors' dtype (both host backends).
macro_rules! dispatch {
    ($dtype:expr, $self:ident . $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            $crate::tensor::DType::F32 => $self.$f::<f32>($($arg),*),
            $crate::tensor::DType::BF16 => $self.$f::<half::bf16>($($arg),*),
            $crate::tensor::DType::F16 => $self.$f::<half::f16>($($arg),*),
            $crate::tensor::DType::I32 => $self.$f::<i32>($($arg),*),
            $crate::tensor::DType::F64 => $self.$f::<f64>($($arg),*),
            $crate::tensor::DType::I64 => $self.$f::<i64>($($arg),*),
        }
    };
}
pub(crate) use dispatch;
