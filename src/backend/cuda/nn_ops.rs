//! Typed ops for the layer kernels of `nn.cu` (f32 activations). Each checks devices,
//! dtypes and shapes, then launches on the stream. CPU references: the functions of the
//! same names in [`crate::backend::cpu::kernels`].

use super::launch::{self, Grid};
use super::ops::{check_device, check_dtype, check_numel};
use super::{DeviceTensor, Stream};
use crate::backend::cpu::kernels::HeadDims;
use crate::error::{Error, Result};
use crate::tensor::DType;

fn f32s(op: &'static str, s: &Stream, ts: &[&DeviceTensor]) -> Result<()> {
    check_device(op, s, ts)?;
    for t in ts {
        check_dtype(op, t, DType::F32)?;
    }
    Ok(())
}

/// Threads per block for a row kernel over rows of `c` elements: a warp per 32 elements,
/// 32 to 1024 (one pass over the row per thread at most sizes the GPT uses).
fn row_block(c: usize) -> u32 {
    (c.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// `y = gelu(x)` (`gelu_fwd_f32`, exact-erf GELU; bitwise equal to the CPU).
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`, [`Error::Cuda`].
pub fn gelu_fwd(s: &Stream, x: &DeviceTensor, y: &DeviceTensor) -> Result<()> {
    f32s("gelu_fwd", s, &[x, y])?;
    check_numel("gelu_fwd", x.numel(), y)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x, y hold n f32 on this device.
    unsafe {
        launch::gelu_fwd(
            s,
            "gelu_fwd_f32",
            Grid::elementwise(s, n),
            x.ptr(),
            y.ptr(),
            n as i64,
        )
    }
}

/// `dx = dy * gelu'(x)` (`gelu_bwd_f32`).
///
/// # Errors
/// As [`gelu_fwd`].
pub fn gelu_bwd(s: &Stream, x: &DeviceTensor, dy: &DeviceTensor, dx: &DeviceTensor) -> Result<()> {
    f32s("gelu_bwd", s, &[x, dy, dx])?;
    check_numel("gelu_bwd", x.numel(), dy)?;
    check_numel("gelu_bwd", x.numel(), dx)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: all hold n f32.
    unsafe {
        launch::gelu_bwd(
            s,
            "gelu_bwd_f32",
            Grid::elementwise(s, n),
            x.ptr(),
            dy.ptr(),
            dx.ptr(),
            n as i64,
        )
    }
}

/// `y = max(x, 0)` (`relu_fwd_f32`; bitwise equal to the CPU).
///
/// # Errors
/// As [`gelu_fwd`].
pub fn relu_fwd(s: &Stream, x: &DeviceTensor, y: &DeviceTensor) -> Result<()> {
    f32s("relu_fwd", s, &[x, y])?;
    check_numel("relu_fwd", x.numel(), y)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x, y hold n f32 on this device.
    unsafe {
        launch::relu_fwd(
            s,
            "relu_fwd_f32",
            Grid::elementwise(s, n),
            x.ptr(),
            y.ptr(),
            n as i64,
        )
    }
}

/// `dx = dy * (x > 0 ? 1 : 0)` (`relu_bwd_f32`).
///
/// # Errors
/// As [`gelu_fwd`].
pub fn relu_bwd(s: &Stream, x: &DeviceTensor, dy: &DeviceTensor, dx: &DeviceTensor) -> Result<()> {
    f32s("relu_bwd", s, &[x, dy, dx])?;
    check_numel("relu_bwd", x.numel(), dy)?;
    check_numel("relu_bwd", x.numel(), dx)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: all hold n f32.
    unsafe {
        launch::relu_bwd(
            s,
            "relu_bwd_f32",
            Grid::elementwise(s, n),
            x.ptr(),
            dy.ptr(),
            dx.ptr(),
            n as i64,
        )
    }
}

fn rows_of(op: &'static str, t: &DeviceTensor, c: usize) -> Result<usize> {
    if c == 0 || t.numel() % c != 0 {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![0, c],
            got: t.shape().to_vec(),
        });
    }
    Ok(t.numel() / c)
}

/// `y[r, j] += b[j]` over `y (rows, C)`, `b (C)` (`bias_add_f32`).
///
/// # Errors
/// `ShapeMismatch` when `y`'s size is not a multiple of `C`; as [`gelu_fwd`].
pub fn bias_add(s: &Stream, y: &DeviceTensor, b: &DeviceTensor) -> Result<()> {
    f32s("bias_add", s, &[y, b])?;
    let rows = rows_of("bias_add", y, b.numel())?;
    if y.numel() == 0 {
        return Ok(());
    }
    // SAFETY: y holds rows * C, b C f32.
    unsafe {
        launch::bias(
            s,
            "bias_add_f32",
            Grid::elementwise(s, y.numel()),
            y.ptr(),
            b.ptr(),
            rows as i64,
            b.numel() as i64,
        )
    }
}

/// `db[j] += sum_r dy[r, j]` (`bias_grad_f32`: 32 columns per 1024-thread block, a fixed
/// summation order, so deterministic).
///
/// # Errors
/// As [`bias_add`].
pub fn bias_grad(s: &Stream, dy: &DeviceTensor, db: &DeviceTensor) -> Result<()> {
    f32s("bias_grad", s, &[dy, db])?;
    let rows = rows_of("bias_grad", dy, db.numel())?;
    if db.numel() == 0 {
        return Ok(());
    }
    // SAFETY: dy holds rows * C, db C f32.
    unsafe {
        launch::bias(
            s,
            "bias_grad_f32",
            Grid::columns(db.numel()),
            dy.ptr(),
            db.ptr(),
            rows as i64,
            db.numel() as i64,
        )
    }
}

/// LayerNorm forward over rows of `x (rows, C)`: writes `y`, `xhat` (same shape) and
/// `rstd (rows)` (`layernorm_fwd_f32`), as `nn::LayerNorm::forward`.
///
/// # Errors
/// `ShapeMismatch` when the sizes disagree; as [`gelu_fwd`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_fwd(
    s: &Stream,
    x: &DeviceTensor,
    w: &DeviceTensor,
    b: &DeviceTensor,
    eps: f32,
    y: &DeviceTensor,
    xhat: &DeviceTensor,
    rstd: &DeviceTensor,
) -> Result<()> {
    f32s("layernorm_fwd", s, &[x, w, b, y, xhat, rstd])?;
    let c = w.numel();
    check_numel("layernorm_fwd", c, b)?;
    let rows = rows_of("layernorm_fwd", x, c)?;
    check_numel("layernorm_fwd", x.numel(), y)?;
    check_numel("layernorm_fwd", x.numel(), xhat)?;
    check_numel("layernorm_fwd", rows, rstd)?;
    if rows == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::layernorm_fwd(
            s,
            "layernorm_fwd_f32",
            Grid::rows(s, rows, row_block(c)),
            x.ptr(),
            w.ptr(),
            b.ptr(),
            y.ptr(),
            xhat.ptr(),
            rstd.ptr(),
            rows as i64,
            c as i64,
            eps,
        )
    }
}

/// LayerNorm backward: `dx` (=), and `dw += sum dy xhat`, `db += sum dy` (+=)
/// (`layernorm_bwd_f32`, `layernorm_bwd_params_f32`).
///
/// # Errors
/// As [`layernorm_fwd`].
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
    f32s("layernorm_bwd", s, &[dy, xhat, rstd, w, dx, dw, db])?;
    let c = w.numel();
    let rows = rows_of("layernorm_bwd", dy, c)?;
    check_numel("layernorm_bwd", dy.numel(), xhat)?;
    check_numel("layernorm_bwd", dy.numel(), dx)?;
    check_numel("layernorm_bwd", rows, rstd)?;
    check_numel("layernorm_bwd", c, dw)?;
    check_numel("layernorm_bwd", c, db)?;
    if rows == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::layernorm_bwd(
            s,
            "layernorm_bwd_f32",
            Grid::rows(s, rows, row_block(c)),
            dy.ptr(),
            xhat.ptr(),
            rstd.ptr(),
            w.ptr(),
            dx.ptr(),
            rows as i64,
            c as i64,
        )?;
        launch::layernorm_bwd_params(
            s,
            "layernorm_bwd_params_f32",
            Grid::columns(c),
            dy.ptr(),
            xhat.ptr(),
            dw.ptr(),
            db.ptr(),
            rows as i64,
            c as i64,
        )
    }
}

fn head_args(d: HeadDims) -> (i64, i64, i64, i64) {
    (d.b as i64, d.t as i64, d.h as i64, d.hd as i64)
}

/// `qkv (B, T, 3, H, hd)` -> `q, k, v (B, H, T, hd)` (`split_qkv_f32`).
///
/// # Errors
/// `ShapeMismatch` when a size disagrees with `d`; as [`gelu_fwd`].
pub fn split_qkv(
    s: &Stream,
    qkv: &DeviceTensor,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    f32s("split_qkv", s, &[qkv, q, k, v])?;
    check_numel("split_qkv", 3 * d.numel(), qkv)?;
    for t in [q, k, v] {
        check_numel("split_qkv", d.numel(), t)?;
    }
    if d.numel() == 0 {
        return Ok(());
    }
    let (b, t, h, hd) = head_args(d);
    // SAFETY: sizes checked above.
    unsafe {
        launch::qkv(
            s,
            "split_qkv_f32",
            Grid::elementwise(s, d.numel()),
            qkv.ptr(),
            q.ptr(),
            k.ptr(),
            v.ptr(),
            b,
            t,
            h,
            hd,
        )
    }
}

/// `dq, dk, dv (B, H, T, hd)` -> `dqkv (B, T, 3, H, hd)` (`merge_qkv_f32`).
///
/// # Errors
/// As [`split_qkv`].
pub fn merge_qkv(
    s: &Stream,
    dq: &DeviceTensor,
    dk: &DeviceTensor,
    dv: &DeviceTensor,
    dqkv: &DeviceTensor,
    d: HeadDims,
) -> Result<()> {
    f32s("merge_qkv", s, &[dq, dk, dv, dqkv])?;
    check_numel("merge_qkv", 3 * d.numel(), dqkv)?;
    for t in [dq, dk, dv] {
        check_numel("merge_qkv", d.numel(), t)?;
    }
    if d.numel() == 0 {
        return Ok(());
    }
    let (b, t, h, hd) = head_args(d);
    // SAFETY: sizes checked above.
    unsafe {
        launch::qkv(
            s,
            "merge_qkv_f32",
            Grid::elementwise(s, d.numel()),
            dq.ptr(),
            dk.ptr(),
            dv.ptr(),
            dqkv.ptr(),
            b,
            t,
            h,
            hd,
        )
    }
}

/// `yh (B, H, T, hd)` -> `y (B, T, H, hd)` (`merge_heads_f32`); with `inverse`, the other
/// way (`split_heads_f32`, `src` = y, `dst` = yh).
///
/// # Errors
/// As [`split_qkv`].
pub fn permute_heads(
    s: &Stream,
    src: &DeviceTensor,
    dst: &DeviceTensor,
    d: HeadDims,
    inverse: bool,
) -> Result<()> {
    f32s("permute_heads", s, &[src, dst])?;
    check_numel("permute_heads", d.numel(), src)?;
    check_numel("permute_heads", d.numel(), dst)?;
    if d.numel() == 0 {
        return Ok(());
    }
    let name = if inverse {
        "split_heads_f32"
    } else {
        "merge_heads_f32"
    };
    let (b, t, h, hd) = head_args(d);
    // SAFETY: sizes checked above.
    unsafe {
        launch::heads(
            s,
            name,
            Grid::elementwise(s, d.numel()),
            src.ptr(),
            dst.ptr(),
            b,
            t,
            h,
            hd,
        )
    }
}

/// Causal softmax of attention scores `s (rows, T)`, row `r` the query `r mod T`
/// (`softmax_causal_fwd_f32`).
///
/// # Errors
/// `ShapeMismatch` when a size is not a multiple of `T`; as [`gelu_fwd`].
pub fn softmax_causal_fwd(
    st: &Stream,
    s: &DeviceTensor,
    p: &DeviceTensor,
    t: usize,
    scale: f32,
) -> Result<()> {
    f32s("softmax_causal_fwd", st, &[s, p])?;
    let rows = rows_of("softmax_causal_fwd", s, t)?;
    check_numel("softmax_causal_fwd", s.numel(), p)?;
    if rows == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::softmax_fwd(
            st,
            "softmax_causal_fwd_f32",
            Grid::rows(st, rows, row_block(t)),
            s.ptr(),
            p.ptr(),
            rows as i64,
            t as i64,
            scale,
        )
    }
}

/// Causal softmax backward `ds = p (dp - <p, dp>) scale` (`softmax_causal_bwd_f32`);
/// `ds` may be `dp` itself.
///
/// # Errors
/// As [`softmax_causal_fwd`].
pub fn softmax_causal_bwd(
    st: &Stream,
    p: &DeviceTensor,
    dp: &DeviceTensor,
    ds: &DeviceTensor,
    t: usize,
    scale: f32,
) -> Result<()> {
    f32s("softmax_causal_bwd", st, &[p, dp, ds])?;
    let rows = rows_of("softmax_causal_bwd", p, t)?;
    check_numel("softmax_causal_bwd", p.numel(), dp)?;
    check_numel("softmax_causal_bwd", p.numel(), ds)?;
    if rows == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::softmax_bwd(
            st,
            "softmax_causal_bwd_f32",
            Grid::rows(st, rows, row_block(t)),
            p.ptr(),
            dp.ptr(),
            ds.ptr(),
            rows as i64,
            t as i64,
            scale,
        )
    }
}

/// A one-element u64 flag set to `u64::MAX` on the stream (the kernels min an index in):
/// a slot of the thread's index checks (`checks`), no allocation.
pub(super) fn invalid_flag(s: &Stream) -> Result<u64> {
    super::checks::flag(s)
}

/// Cross-entropy of `logits (N, V)` against i32 `targets (N)`: per-row losses into
/// `losses (N)` and `dlogits = (softmax - onehot) * inv_n` (`cross_entropy_f32`).
/// The targets are checked on the device; a target outside `0..V` is reported by the
/// calling thread's next host read (`checks`), with no synchronization here.
///
/// # Errors
/// Shape and dtype errors as [`gelu_fwd`]; the next host read's `InvalidArgument` names
/// the first target outside `0..V`.
pub fn cross_entropy(
    s: &Stream,
    logits: &DeviceTensor,
    targets: &DeviceTensor,
    inv_n: f32,
    losses: &DeviceTensor,
    dlogits: &DeviceTensor,
) -> Result<()> {
    f32s("cross_entropy", s, &[logits, losses, dlogits])?;
    check_device("cross_entropy", s, &[targets])?;
    check_dtype("cross_entropy", targets, DType::I32)?;
    let n = targets.numel();
    check_numel("cross_entropy", n, losses)?;
    check_numel("cross_entropy", logits.numel(), dlogits)?;
    if n == 0 {
        return Ok(());
    }
    let v = rows_of("cross_entropy", logits, n)?; // V = numel / N
    if v == 0 {
        return Err(Error::ShapeMismatch {
            op: "cross_entropy",
            expected: vec![n, 0],
            got: logits.shape().to_vec(),
        });
    }
    let flag = invalid_flag(s)?;
    // SAFETY: sizes checked above; the flag holds one u64.
    unsafe {
        launch::cross_entropy(
            s,
            "cross_entropy_f32",
            Grid::rows(s, n, row_block(v)),
            logits.ptr(),
            targets.ptr(),
            losses.ptr(),
            dlogits.ptr(),
            n as i64,
            v as i64,
            inv_n,
            flag,
        )?;
    }
    super::checks::defer(
        s,
        Box::new(move |r| {
            Error::InvalidArgument(format!(
                "cross_entropy: the target at position {r} is outside 0..{v}"
            ))
        }),
    )
}

/// `out[0] = f32(sum_r f64(losses[r]) / n)` in row order (`mean_rows_f32`): the mean
/// cross-entropy without a host read. `out` holds one f32.
///
/// # Errors
/// Shape and dtype errors; [`Error::Cuda`].
pub fn mean_rows(s: &Stream, losses: &DeviceTensor, out: &DeviceTensor) -> Result<()> {
    f32s("mean_rows", s, &[losses, out])?;
    check_numel("mean_rows", 1, out)?;
    let one = Grid {
        grid: (1, 1, 1),
        block: 1,
    };
    // SAFETY: losses holds n f32, out one.
    unsafe {
        launch::mean_rows(
            s,
            "mean_rows_f32",
            one,
            losses.ptr(),
            losses.numel() as i64,
            out.ptr(),
        )
    }
}

/// `acc[0] = acc[0] + x[0] / d` on one-element f32 tensors (`add_div_f32`).
///
/// # Errors
/// Shape and dtype errors; [`Error::Cuda`].
pub fn add_div(s: &Stream, acc: &DeviceTensor, x: &DeviceTensor, d: f32) -> Result<()> {
    f32s("add_div", s, &[acc, x])?;
    check_numel("add_div", 1, acc)?;
    check_numel("add_div", 1, x)?;
    let one = Grid {
        grid: (1, 1, 1),
        block: 1,
    };
    // SAFETY: one f32 each.
    unsafe { launch::add_div(s, "add_div_f32", one, acc.ptr(), x.ptr(), d) }
}

/// `out[i, :] = table (V, C)[ids[i], :]` (`embedding_fwd_f32`). The ids are checked on the
/// device; one outside `0..V` is reported by the calling thread's next host read
/// (`checks`), with no synchronization here (PyTorch's device-side assert, named).
///
/// # Errors
/// Shape and dtype errors; the next host read's `InvalidArgument` names the first id
/// outside `0..V`.
pub fn embedding_fwd(
    s: &Stream,
    ids: &DeviceTensor,
    table: &DeviceTensor,
    out: &DeviceTensor,
) -> Result<()> {
    f32s("embedding_fwd", s, &[table, out])?;
    check_device("embedding_fwd", s, &[ids])?;
    check_dtype("embedding_fwd", ids, DType::I32)?;
    let (v, c) = table_dims("embedding_fwd", table)?;
    check_numel("embedding_fwd", ids.numel() * c, out)?;
    if out.numel() == 0 {
        return Ok(());
    }
    let flag = invalid_flag(s)?;
    // SAFETY: sizes checked above.
    unsafe {
        launch::embedding_fwd(
            s,
            "embedding_fwd_f32",
            Grid::elementwise(s, out.numel()),
            ids.ptr(),
            table.ptr(),
            out.ptr(),
            ids.numel() as i64,
            v as i64,
            c as i64,
            flag,
        )?;
    }
    super::checks::defer(
        s,
        Box::new(move |i| {
            Error::InvalidArgument(format!(
                "embedding: the token id at position {i} is outside the vocabulary 0..{v}"
            ))
        }),
    )
}

/// `grad[ids[i], :] += dout[i, :]` (`embedding_bwd_f32`, atomic adds: repeated ids add in
/// any order, so results may differ from the CPU in the last bits).
///
/// # Errors
/// Shape and dtype errors as [`embedding_fwd`].
pub fn embedding_bwd(
    s: &Stream,
    ids: &DeviceTensor,
    dout: &DeviceTensor,
    grad: &DeviceTensor,
) -> Result<()> {
    f32s("embedding_bwd", s, &[dout, grad])?;
    check_device("embedding_bwd", s, &[ids])?;
    check_dtype("embedding_bwd", ids, DType::I32)?;
    let (v, c) = table_dims("embedding_bwd", grad)?;
    check_numel("embedding_bwd", ids.numel() * c, dout)?;
    if dout.numel() == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above; out-of-range ids are skipped by the kernel.
    unsafe {
        launch::embedding_bwd(
            s,
            "embedding_bwd_f32",
            Grid::elementwise(s, dout.numel()),
            ids.ptr(),
            dout.ptr(),
            grad.ptr(),
            ids.numel() as i64,
            v as i64,
            c as i64,
        )
    }
}

fn table_dims(op: &'static str, t: &DeviceTensor) -> Result<(usize, usize)> {
    match t.shape() {
        [v, c] => Ok((*v, *c)),
        s => Err(Error::ShapeMismatch {
            op,
            expected: vec![0, 0],
            got: s.to_vec(),
        }),
    }
}
