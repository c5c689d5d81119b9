//! Stand-ins of the typed ops (`ops.rs`, `nn_ops.rs`, `layernorm.rs`, `lowp.rs`,
//! `batchnorm.rs`, `optim.rs`, `clip.rs`, `blas.rs`, `sdpa.rs`): each takes a [`Stream`],
//! which no build without the `cuda` feature can make, so none can be called.

#![allow(unused_variables)] // the stand-ins keep the real parameter names

use super::{DeviceTensor, Stream, TensorList};
use crate::backend::cpu::kernels::HeadDims;
use crate::backend::cuda::{AdamHyper, AdamSlot, BnDims, BnRunning, BnTypes, GemmShape};
use crate::backend::cuda::{SgdHyper, SgdSlot};
use crate::error::Result;

/// Stand-in (see the module docs).
pub fn adam_step(s: &Stream, slots: &[AdamSlot<'_>], h: &AdamHyper) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn add(s: &Stream, a: &DeviceTensor, b: &DeviceTensor, out: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn add_div(s: &Stream, acc: &DeviceTensor, x: &DeviceTensor, d: f32) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn add_layernorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    r: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    eps: f64,
    sum: &DeviceTensor,
    y: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_bwd_dx(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    w: Option<&DeviceTensor>,
    stats: &DeviceTensor,
    sums: &DeviceTensor,
    dx: &DeviceTensor,
    dims: BnDims,
    types: BnTypes,
    batch: bool,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_bwd_stats(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    stats: &DeviceTensor,
    sums: &DeviceTensor,
    dw: Option<&DeviceTensor>,
    db: Option<&DeviceTensor>,
    dims: BnDims,
    types: BnTypes,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn batchnorm_count(s: &Stream, count: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    w: Option<&DeviceTensor>,
    b: Option<&DeviceTensor>,
    stats: &DeviceTensor,
    y: &DeviceTensor,
    dims: BnDims,
    types: BnTypes,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn batchnorm_stats(
    s: &Stream,
    x: &DeviceTensor,
    dims: BnDims,
    types: BnTypes,
    running: Option<BnRunning<'_>>,
    eps: f64,
    batch: bool,
    stats: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn bias_add(s: &Stream, y: &DeviceTensor, b: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn bias_gelu_fwd(
    s: &Stream,
    h: &DeviceTensor,
    b: &DeviceTensor,
    y: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn bias_grad(s: &Stream, dy: &DeviceTensor, db: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn cast(s: &Stream, src: &DeviceTensor, dst: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn cross_entropy(
    s: &Stream,
    logits: &DeviceTensor,
    targets: &DeviceTensor,
    inv_n: f64,
    losses: &DeviceTensor,
    dlogits: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn cross_entropy_lp(
    s: &Stream,
    logits: &DeviceTensor,
    targets: &DeviceTensor,
    w: f32,
    losses: &DeviceTensor,
    dlogits: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn div_scale_f64(
    s: &Stream,
    x: &DeviceTensor,
    out: &DeviceTensor,
    factor: f64,
    divide: bool,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn embedding_bwd(
    s: &Stream,
    ids: &DeviceTensor,
    dout: &DeviceTensor,
    grad: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn embedding_fwd(
    s: &Stream,
    ids: &DeviceTensor,
    table: &DeviceTensor,
    out: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn fill(s: &Stream, dst: &DeviceTensor, value: f32) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn gelu_bwd(s: &Stream, x: &DeviceTensor, dy: &DeviceTensor, dx: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn gelu_bwd_bias_grad(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    dx: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn gelu_fwd(s: &Stream, x: &DeviceTensor, y: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn gemm_strided_batched(
    s: &Stream,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &DeviceTensor,
    g: GemmShape,
    batch: usize,
    beta: f32,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_bwd(
    s: &Stream,
    dy: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
    w: &DeviceTensor,
    dx: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_bwd_add(
    s: &Stream,
    dy: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
    w: &DeviceTensor,
    res: &DeviceTensor,
    res_sum: Option<&DeviceTensor>,
    dx: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn layernorm_bwd_lp(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    w: &DeviceTensor,
    mean: &DeviceTensor,
    rstd: &DeviceTensor,
    dx: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    eps: f64,
    y: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn layernorm_wgrad_lp(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    mean: &DeviceTensor,
    rstd: &DeviceTensor,
    dw: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn mean_rows(s: &Stream, losses: &DeviceTensor, out: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn merge_qkv(
    s: &Stream,
    dq: &DeviceTensor,
    dk: &DeviceTensor,
    dv: &DeviceTensor,
    dqkv: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn pack_grad(s: &Stream, grad: &DeviceTensor, out: &DeviceTensor, scale: f32) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn permute_heads(
    s: &Stream,
    src: &DeviceTensor,
    dst: &DeviceTensor,
    d: HeadDims,
    inverse: bool,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn relu_bwd(s: &Stream, x: &DeviceTensor, dy: &DeviceTensor, dx: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn relu_fwd(s: &Stream, x: &DeviceTensor, y: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn scale(s: &Stream, x: &DeviceTensor, alpha: f32) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn scale_all_by(s: &Stream, list: &TensorList, alpha: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn scale_by(s: &Stream, x: &DeviceTensor, alpha: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn sdpa_backward(
    s: &Stream,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    dout: &DeviceTensor,
    (dq, dk, dv): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    dsum: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn sdpa_forward(
    s: &Stream,
    (q, k, v): (&DeviceTensor, &DeviceTensor, &DeviceTensor),
    out: &DeviceTensor,
    lse: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn sgd_step(s: &Stream, slots: &[SgdSlot<'_>], h: &SgdHyper) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn split_qkv(
    s: &Stream,
    qkv: &DeviceTensor,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn sum_into(s: &Stream, acc: &DeviceTensor, x: &DeviceTensor) -> Result<()> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn sum_squares(s: &Stream, x: &DeviceTensor) -> Result<f64> {
    match s.never {}
}
/// Stand-in (see the module docs).
pub fn unpack_grad(s: &Stream, x: &DeviceTensor, out: &DeviceTensor, scale: f32) -> Result<()> {
    match s.never {}
}

/// Stand-in (see the module docs).
pub fn softmax_causal_bwd(
    st: &Stream,
    p: &DeviceTensor,
    dp: &DeviceTensor,
    ds: &DeviceTensor,
    t: usize,
    scale: f64,
) -> Result<()> {
    match st.never {}
}

/// Stand-in (see the module docs).
pub fn softmax_causal_fwd(
    st: &Stream,
    s: &DeviceTensor,
    p: &DeviceTensor,
    t: usize,
    scale: f64,
) -> Result<()> {
    match st.never {}
}
