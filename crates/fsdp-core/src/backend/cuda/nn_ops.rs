//! Typed ops for the layer kernels of `nn.cu`, on f32 or f64 tensors (the `_f32` or `_f64`
//! instance of each kernel, by the tensors' dtype; every float tensor of one call has the
//! same). Each checks devices, dtypes and shapes, then launches on the stream. Scalar
//! arguments (`eps`, `scale`, `inv_n`) are f64, rounded to f32 for the f32 kernels. CPU
//! references: the functions of the same names in [`crate::backend::cpu::kernels`] (f32),
//! the f64 ops of `ops::double` (f64).

use super::launch::{self, Arg, Grid};
use super::ops::{check_device, check_dtype, check_numel, kname};
use super::{DeviceTensor, Stream};
use crate::backend::cpu::kernels::HeadDims;
use crate::error::{Error, Result};
use crate::tensor::DType;

/// The element type of a layer kernel's float tensors `ts`: f32 or f64, the same for all.
pub(super) fn floats(op: &'static str, s: &Stream, ts: &[&DeviceTensor]) -> Result<DType> {
    check_device(op, s, ts)?;
    let d = match ts.first().map(|t| t.dtype()) {
        Some(DType::F64) => DType::F64,
        _ => DType::F32,
    };
    for t in ts {
        check_dtype(op, t, d)?;
    }
    Ok(d)
}

/// Threads per block for a row kernel over rows of `c` elements: a warp per 32 elements,
/// 32 to 1024 (one pass over the row per thread at most sizes the GPT uses).
pub(super) fn row_block(c: usize) -> u32 {
    (c.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// `y = gelu(x)` (`gelu_fwd_{f32,f64}`, exact-erf GELU; bitwise equal to the CPU).
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`, [`Error::Cuda`].
pub fn gelu_fwd(s: &Stream, x: &DeviceTensor, y: &DeviceTensor) -> Result<()> {
    let dt = floats("gelu_fwd", s, &[x, y])?;
    check_numel("gelu_fwd", x.numel(), y)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x, y hold n elements of the dtype on this device.
    unsafe {
        launch::gelu_fwd(
            s,
            kname!("gelu_fwd", dt),
            Grid::elementwise(s, n),
            x.ptr(),
            y.ptr(),
            n as i64,
        )
    }
}

/// `dx = dy * gelu'(x)` (`gelu_bwd_{f32,f64}`).
///
/// # Errors
/// As [`gelu_fwd`].
pub fn gelu_bwd(s: &Stream, x: &DeviceTensor, dy: &DeviceTensor, dx: &DeviceTensor) -> Result<()> {
    let dt = floats("gelu_bwd", s, &[x, dy, dx])?;
    check_numel("gelu_bwd", x.numel(), dy)?;
    check_numel("gelu_bwd", x.numel(), dx)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: all hold n elements of the dtype.
    unsafe {
        launch::gelu_bwd(
            s,
            kname!("gelu_bwd", dt),
            Grid::elementwise(s, n),
            x.ptr(),
            dy.ptr(),
            dx.ptr(),
            n as i64,
        )
    }
}

/// The bias of a `Linear` and the GELU after it in one pass (`bias_gelu_fwd_{f32,f64}`):
/// `h[r, j] += b[j]` (in place: the GELU's input, which its backward reads) and
/// `y = gelu(h)`; the bits of [`bias_add`] then [`gelu_fwd`]. `h, y (rows, C)`, `b (C)`.
///
/// # Errors
/// `ShapeMismatch` when `h`'s size is not a multiple of `C` or `y`'s differs; as
/// [`gelu_fwd`].
pub fn bias_gelu_fwd(
    s: &Stream,
    h: &DeviceTensor,
    b: &DeviceTensor,
    y: &DeviceTensor,
) -> Result<()> {
    let dt = floats("bias_gelu_fwd", s, &[h, b, y])?;
    let rows = rows_of("bias_gelu_fwd", h, b.numel())?;
    check_numel("bias_gelu_fwd", h.numel(), y)?;
    if h.numel() == 0 {
        return Ok(());
    }
    // SAFETY: h and y hold rows * C, b C elements of the dtype.
    unsafe {
        launch::bias_gelu_fwd(
            s,
            kname!("bias_gelu_fwd", dt),
            Grid::elementwise(s, h.numel()),
            h.ptr(),
            b.ptr(),
            y.ptr(),
            rows as i64,
            b.numel() as i64,
        )
    }
}

/// GELU's backward and the bias gradient of the `Linear` before it in one launch
/// (`gelu_bwd_bias_grad_{f32,f64}`): `dx = dy gelu'(x)` (=) and `db[j] += sum_r dx[r, j]`
/// (+=, [`bias_grad`]'s order); the bits of [`gelu_bwd`] then [`bias_grad`].
/// `x, dy, dx (rows, C)`, `db (C)`.
///
/// # Errors
/// As [`bias_gelu_fwd`].
pub fn gelu_bwd_bias_grad(
    s: &Stream,
    x: &DeviceTensor,
    dy: &DeviceTensor,
    dx: &DeviceTensor,
    db: &DeviceTensor,
) -> Result<()> {
    let dt = floats("gelu_bwd_bias_grad", s, &[x, dy, dx, db])?;
    let rows = rows_of("gelu_bwd_bias_grad", x, db.numel())?;
    check_numel("gelu_bwd_bias_grad", x.numel(), dy)?;
    check_numel("gelu_bwd_bias_grad", x.numel(), dx)?;
    if x.numel() == 0 {
        return Ok(());
    }
    // SAFETY: x, dy, dx hold rows * C, db C elements of the dtype.
    unsafe {
        launch::gelu_bwd_bias_grad(
            s,
            kname!("gelu_bwd_bias_grad", dt),
            Grid::columns(db.numel()),
            x.ptr(),
            dy.ptr(),
            dx.ptr(),
            db.ptr(),
            rows as i64,
            db.numel() as i64,
        )
    }
}

/// `y = max(x, 0)` (`relu_fwd_{f32,f64}`; bitwise equal to the CPU).
///
/// # Errors
/// As [`gelu_fwd`].
pub fn relu_fwd(s: &Stream, x: &DeviceTensor, y: &DeviceTensor) -> Result<()> {
    let dt = floats("relu_fwd", s, &[x, y])?;
    check_numel("relu_fwd", x.numel(), y)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x, y hold n elements of the dtype on this device.
    unsafe {
        launch::relu_fwd(
            s,
            kname!("relu_fwd", dt),
            Grid::elementwise(s, n),
            x.ptr(),
            y.ptr(),
            n as i64,
        )
    }
}

/// `dx = dy * (x > 0 ? 1 : 0)` (`relu_bwd_{f32,f64}`).
///
/// # Errors
/// As [`gelu_fwd`].
pub fn relu_bwd(s: &Stream, x: &DeviceTensor, dy: &DeviceTensor, dx: &DeviceTensor) -> Result<()> {
    let dt = floats("relu_bwd", s, &[x, dy, dx])?;
    check_numel("relu_bwd", x.numel(), dy)?;
    check_numel("relu_bwd", x.numel(), dx)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: all hold n elements of the dtype.
    unsafe {
        launch::relu_bwd(
            s,
            kname!("relu_bwd", dt),
            Grid::elementwise(s, n),
            x.ptr(),
            dy.ptr(),
            dx.ptr(),
            n as i64,
        )
    }
}

pub(super) fn rows_of(op: &'static str, t: &DeviceTensor, c: usize) -> Result<usize> {
    if c == 0 || t.numel() % c != 0 {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![0, c],
            got: t.shape().to_vec(),
        });
    }
    Ok(t.numel() / c)
}

/// `y[r, j] += b[j]` over `y (rows, C)`, `b (C)` (`bias_add_{f32,f64}`).
///
/// # Errors
/// `ShapeMismatch` when `y`'s size is not a multiple of `C`; as [`gelu_fwd`].
pub fn bias_add(s: &Stream, y: &DeviceTensor, b: &DeviceTensor) -> Result<()> {
    let dt = floats("bias_add", s, &[y, b])?;
    let rows = rows_of("bias_add", y, b.numel())?;
    if y.numel() == 0 {
        return Ok(());
    }
    // SAFETY: y holds rows * C, b C elements of the dtype.
    unsafe {
        launch::bias(
            s,
            kname!("bias_add", dt),
            Grid::elementwise(s, y.numel()),
            y.ptr(),
            b.ptr(),
            rows as i64,
            b.numel() as i64,
        )
    }
}

/// `db[j] += sum_r dy[r, j]` (`bias_grad_{f32,f64}`: 32 columns per 1024-thread block, a fixed
/// summation order, so deterministic).
///
/// # Errors
/// As [`bias_add`].
pub fn bias_grad(s: &Stream, dy: &DeviceTensor, db: &DeviceTensor) -> Result<()> {
    let dt = floats("bias_grad", s, &[dy, db])?;
    let rows = rows_of("bias_grad", dy, db.numel())?;
    if db.numel() == 0 {
        return Ok(());
    }
    // SAFETY: dy holds rows * C, db C elements of the dtype.
    unsafe {
        launch::bias(
            s,
            kname!("bias_grad", dt),
            Grid::columns(db.numel()),
            dy.ptr(),
            db.ptr(),
            rows as i64,
            db.numel() as i64,
        )
    }
}

fn head_args(d: HeadDims) -> (i64, i64, i64, i64) {
    (d.b as i64, d.t as i64, d.h as i64, d.hd as i64)
}

/// `qkv (B, T, 3, H, hd)` -> `q, k, v (B, H, T, hd)` (`split_qkv_{f32,f64}`).
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
    let dt = floats("split_qkv", s, &[qkv, q, k, v])?;
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
            kname!("split_qkv", dt),
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

/// `dq, dk, dv (B, H, T, hd)` -> `dqkv (B, T, 3, H, hd)` (`merge_qkv_{f32,f64}`).
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
    let dt = floats("merge_qkv", s, &[dq, dk, dv, dqkv])?;
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
            kname!("merge_qkv", dt),
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

/// `yh (B, H, T, hd)` -> `y (B, T, H, hd)` (`merge_heads_{f32,f64}`); with `inverse`, the other
/// way (`split_heads_{f32,f64}`, `src` = y, `dst` = yh).
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
    let dt = floats("permute_heads", s, &[src, dst])?;
    check_numel("permute_heads", d.numel(), src)?;
    check_numel("permute_heads", d.numel(), dst)?;
    if d.numel() == 0 {
        return Ok(());
    }
    let name = if inverse {
        kname!("split_heads", dt)
    } else {
        kname!("merge_heads", dt)
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
/// (`softmax_causal_fwd_{f32,f64}`).
///
/// # Errors
/// `ShapeMismatch` when a size is not a multiple of `T`; as [`gelu_fwd`].
pub fn softmax_causal_fwd(
    st: &Stream,
    s: &DeviceTensor,
    p: &DeviceTensor,
    t: usize,
    scale: f64,
) -> Result<()> {
    let dt = floats("softmax_causal_fwd", st, &[s, p])?;
    let rows = rows_of("softmax_causal_fwd", s, t)?;
    check_numel("softmax_causal_fwd", s.numel(), p)?;
    if rows == 0 {
        return Ok(());
    }
    // SAFETY: sizes checked above.
    unsafe {
        launch::softmax_fwd(
            st,
            kname!("softmax_causal_fwd", dt),
            Grid::rows(st, rows, row_block(t)),
            s.ptr(),
            p.ptr(),
            rows as i64,
            t as i64,
            Arg::float_of(dt, scale),
        )
    }
}

/// Causal softmax backward `ds = p (dp - <p, dp>) scale` (`softmax_causal_bwd_{f32,f64}`);
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
    scale: f64,
) -> Result<()> {
    let dt = floats("softmax_causal_bwd", st, &[p, dp, ds])?;
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
            kname!("softmax_causal_bwd", dt),
            Grid::rows(st, rows, row_block(t)),
            p.ptr(),
            dp.ptr(),
            ds.ptr(),
            rows as i64,
            t as i64,
            Arg::float_of(dt, scale),
        )
    }
}

/// A one-element u64 flag set to `u64::MAX` on the stream (the kernels min an index in):
/// a slot of the thread's index checks (`checks`), no allocation.
pub(super) fn invalid_flag(s: &Stream) -> Result<u64> {
    super::checks::flag(s)
}

/// Cross-entropy of `logits (N, V)` against i32 `targets (N)`: per-row losses into
/// `losses (N)` and `dlogits = (softmax - onehot) * inv_n` (`cross_entropy_{f32,f64}`).
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
    inv_n: f64,
    losses: &DeviceTensor,
    dlogits: &DeviceTensor,
) -> Result<()> {
    let dt = floats("cross_entropy", s, &[logits, losses, dlogits])?;
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
            kname!("cross_entropy", dt),
            Grid::rows(s, n, row_block(v)),
            logits.ptr(),
            targets.ptr(),
            losses.ptr(),
            dlogits.ptr(),
            n as i64,
            v as i64,
            Arg::float_of(dt, inv_n),
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

/// The mean cross-entropy without a host read, `out` holding one element of `losses`'
/// dtype: f32 `out[0] = f32(sum_r f64(losses[r]) / n)` in row order (`mean_rows_f32`), f64
/// `out[0] = (sum_r losses[r]) * (1 / n)` (`mean_rows_f64`, as `ops::double`).
///
/// # Errors
/// Shape and dtype errors; [`Error::Cuda`].
pub fn mean_rows(s: &Stream, losses: &DeviceTensor, out: &DeviceTensor) -> Result<()> {
    let dt = floats("mean_rows", s, &[losses, out])?;
    check_numel("mean_rows", 1, out)?;
    let one = Grid {
        grid: (1, 1, 1),
        block: 1,
    };
    // SAFETY: losses holds n elements of the dtype, out one.
    unsafe {
        launch::mean_rows(
            s,
            kname!("mean_rows", dt),
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
    check_device("add_div", s, &[acc, x])?;
    check_dtype("add_div", acc, DType::F32)?;
    check_dtype("add_div", x, DType::F32)?;
    check_numel("add_div", 1, acc)?;
    check_numel("add_div", 1, x)?;
    let one = Grid {
        grid: (1, 1, 1),
        block: 1,
    };
    // SAFETY: one f32 each.
    unsafe { launch::add_div(s, "add_div_f32", one, acc.ptr(), x.ptr(), d) }
}

/// `out[i, :] = table (V, C)[ids[i], :]` (`embedding_fwd_{f32,f64}`). The ids are checked on the
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
    let dt = floats("embedding_fwd", s, &[table, out])?;
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
            kname!("embedding_fwd", dt),
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

/// `grad[ids[i], :] += dout[i, :]` (`embedding_bwd_{f32,f64}`, atomic adds: repeated ids add in
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
    let dt = floats("embedding_bwd", s, &[dout, grad])?;
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
            kname!("embedding_bwd", dt),
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
