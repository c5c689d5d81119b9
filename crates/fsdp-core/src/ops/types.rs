//! The plain argument and result types the ops share with their dtype paths (`lowp/`,
//! `double/`): a leaf that imports no op module, so those paths need none either. Each
//! type is re-exported where it was always named (`ops::MatmulDims` and
//! `ops::linalg::MatmulDims`, `ops::Pointwise` and `ops::activation::Pointwise`,
//! `ops::LayerNormSaved` and `ops::layernorm::LayerNormSaved`).

use crate::backend::cpu::gemm::Transpose;
use crate::tensor::Tensor;

/// Sizes of one product `out (m, n) = op(a) (m, k) @ op(b) (k, n)`: `a` is stored `(m, k)`,
/// or `(k, m)` when `trans.a`; `b` is stored `(k, n)`, or `(n, k)` when `trans.b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulDims {
    /// Rows of the output.
    pub m: usize,
    /// The summed dimension.
    pub k: usize,
    /// Columns of the output.
    pub n: usize,
    /// Which operands are stored transposed.
    pub trans: Transpose,
}

impl MatmulDims {
    /// `(m, k, n)` with the operands stored as `trans` says.
    pub fn new(m: usize, k: usize, n: usize, trans: Transpose) -> MatmulDims {
        MatmulDims { m, k, n, trans }
    }
}

/// Which pointwise function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pointwise {
    /// `max(x, 0)` (`F.relu`).
    Relu,
    /// `x Phi(x)`, exact erf (`F.gelu(approximate='none')`).
    Gelu,
}

impl Pointwise {
    /// `"ReLU"` or `"GELU"`.
    pub fn name(self) -> &'static str {
        match self {
            Pointwise::Relu => "ReLU",
            Pointwise::Gelu => "GELU",
        }
    }
}

/// What [`layer_norm_backward`](super::layer_norm_backward) needs from the forward, on the
/// input's device.
#[derive(Debug, Clone)]
pub struct LayerNormSaved {
    /// The normalized input `(x - mean) * rstd`, `(rows, C)`.
    pub xhat: Tensor,
    /// `1 / sqrt(var + eps)` per row, `(rows)`.
    pub rstd: Tensor,
    /// `None` for an f32 forward. After a bf16/f16 forward, the row means `(rows)` in that
    /// dtype, and then `xhat` holds the input `x` itself and `rstd` the rounded rstd: what
    /// PyTorch's `native_layer_norm` saves for a reduced-precision input (`input`, `mean`,
    /// `rstd` in the input's dtype); the backward recomputes `xhat` from them in f32.
    pub mean: Option<Tensor>,
}
