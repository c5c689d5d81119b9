//! [`ReduceOp`]: what a collective does with the ranks' values
//! (`torch.distributed.ReduceOp`). A leaf module: the process groups take it and the CUDA
//! backend's rank-order reduction kernel implements it, so it sits below both.

/// Reduction applied elementwise across ranks (`torch.distributed.ReduceOp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum (`ReduceOp.SUM`); what FSDP uses for gradients.
    Sum,
    /// Sum divided by the group size.
    Avg,
    /// Elementwise maximum (`ReduceOp.MAX`); `all_reduce` only.
    Max,
    /// Elementwise minimum (`ReduceOp.MIN`); `all_reduce` only.
    Min,
    /// Elementwise product (`ReduceOp.PRODUCT`); `all_reduce` only.
    Product,
}
