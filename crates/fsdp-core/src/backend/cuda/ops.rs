//! Typed ops over [`DeviceTensor`]s for `flat_param.cu`, `cast.cu` and `reduce_scatter.cu`:
//! check devices, dtypes and element counts, pick the grid, launch on the given stream
//! (asynchronously: results are ready for later work on that stream, and for the host
//! after [`Stream::synchronize`]). Empty tensors launch nothing. CPU references:
//! [`crate::backend::cpu::kernels`], [`crate::backend::cpu::ops::cast_slice`].

use super::launch::{self, Arg, Grid};
use super::memory::DeviceBuffer;
use super::{DeviceTensor, Stream};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::result as cu;

/// `{prefix}_{dtype}` as a static kernel name.
macro_rules! kname {
    ($p:literal, $d:expr) => {
        match $d {
            DType::F32 => concat!($p, "_f32"),
            DType::BF16 => concat!($p, "_bf16"),
            DType::F16 => concat!($p, "_f16"),
            DType::I32 => concat!($p, "_i32"),
            // f64: the flat_param.cu copies, reduce_ranks and the f32/f64 templates of nn.cu,
            // optim.cu and reduce_scatter.cu; i64: none. Looking up a kernel that does not
            // exist fails with a clear error.
            DType::F64 => concat!($p, "_f64"),
            DType::I64 => concat!($p, "_i64"),
        }
    };
}
pub(super) use kname;

/// Every tensor is on `s`'s device.
pub(crate) fn check_device(op: &'static str, s: &Stream, ts: &[&DeviceTensor]) -> Result<()> {
    for t in ts {
        if t.ordinal() != s.dev.ordinal() {
            return Err(Error::InvalidArgument(format!(
                "{op}: tensor on cuda:{} used on a stream of cuda:{}",
                t.ordinal(),
                s.dev.ordinal()
            )));
        }
    }
    Ok(())
}

pub(crate) fn check_dtype(op: &'static str, t: &DeviceTensor, expected: DType) -> Result<()> {
    if t.dtype() != expected {
        return Err(Error::DTypeMismatch {
            op,
            expected,
            got: t.dtype(),
        });
    }
    Ok(())
}

pub(crate) fn check_numel(op: &'static str, expected: usize, got: &DeviceTensor) -> Result<()> {
    if expected != got.numel() {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![expected],
            got: got.shape().to_vec(),
        });
    }
    Ok(())
}

pub(crate) fn float_only(op: &'static str, d: DType) -> Result<()> {
    if !d.is_float() {
        return Err(Error::DTypeMismatch {
            op,
            expected: DType::F32,
            got: d,
        });
    }
    Ok(())
}

/// Copies a host table of 8-byte values (pointers, offsets, descriptors) to the device.
pub(crate) fn upload_table<T: Copy>(s: &Stream, table: &[T]) -> Result<DeviceBuffer> {
    if super::graph::recording() {
        // A captured graph would copy from `table` at every replay, long after it is gone:
        // the table is written once, into a block of its own kept for the graph (graph.rs).
        let buf = s.alloc_graph_constant(std::mem::size_of_val(table))?;
        // SAFETY: `T` is a plain descriptor (Copy, repr(C) or a number): its bytes are
        // initialized and `table` covers `size_of_val(table)` of them.
        let bytes = unsafe {
            std::slice::from_raw_parts(table.as_ptr().cast::<u8>(), std::mem::size_of_val(table))
        };
        super::graph::write_once(s, buf.ptr(), bytes)?;
        return Ok(buf);
    }
    let buf = s.alloc_bytes(std::mem::size_of_val(table))?;
    if !table.is_empty() {
        // SAFETY: the buffer holds the whole table. cuMemcpyHtoDAsync from pageable memory
        // returns once the source was staged, so `table` may be dropped after it returns;
        // kernels reading the buffer are queued after the copy on the same stream.
        s.bind()?;
        unsafe { cu::memcpy_htod_async(buf.ptr(), table, s.inner.cu_stream()) }
            .map_err(|e| Error::cuda("cuMemcpyHtoDAsync (kernel argument table)", e))?;
    }
    Ok(buf)
}

/// `dst = src` (`copy_{dtype}`), same dtype and element count. The plain device copy the
/// benchmarks compare every other kernel with.
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch`, `InvalidArgument` (device), [`Error::Cuda`].
pub fn copy(s: &Stream, src: &DeviceTensor, dst: &DeviceTensor) -> Result<()> {
    check_device("copy", s, &[src, dst])?;
    check_dtype("copy", dst, src.dtype())?;
    check_numel("copy", src.numel(), dst)?;
    let n = src.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: both tensors hold n elements of the dtype on this device.
    unsafe {
        launch::copy(
            s,
            kname!("copy", src.dtype()),
            Grid::elementwise(s, n),
            src.ptr(),
            dst.ptr(),
            n as i64,
        )
    }
}

/// `dst[i] = value` (`fill_{dtype}`), `value` converted to the dtype (rounded to nearest
/// even; truncated toward zero for i32).
///
/// # Errors
/// `InvalidArgument` (device), [`Error::Cuda`].
pub fn fill(s: &Stream, dst: &DeviceTensor, value: f32) -> Result<()> {
    check_device("fill", s, &[dst])?;
    let n = dst.numel();
    if n == 0 {
        return Ok(());
    }
    let g = Grid::elementwise(s, n);
    let name = kname!("fill", dst.dtype());
    // SAFETY: dst holds n elements of its dtype on this device.
    unsafe {
        match dst.dtype() {
            DType::F32 => launch::fill32(s, name, g, dst.ptr(), value.to_bits() as i32, n as i64),
            DType::I32 => launch::fill32(s, name, g, dst.ptr(), value as i32, n as i64),
            DType::BF16 => launch::fill16(
                s,
                name,
                g,
                dst.ptr(),
                half::bf16::from_f32(value).to_bits(),
                n as i64,
            ),
            DType::F16 => launch::fill16(
                s,
                name,
                g,
                dst.ptr(),
                half::f16::from_f32(value).to_bits(),
                n as i64,
            ),
            DType::F64 => launch::fill64(
                s,
                name,
                g,
                dst.ptr(),
                f64::from(value).to_bits() as i64,
                n as i64,
            ),
            DType::I64 => Err(Error::Unsupported(
                "fill of an i64 tensor on a CUDA device (no kernel)".into(),
            )),
        }
    }
}

/// `dst[i] = src[i]` for `i < src.numel()`, zero after (`pad_copy_{dtype}`): a rank's
/// zero-padded FlatParameter shard, `src` a view of the valid part.
///
/// # Errors
/// `DTypeMismatch`; `ShapeMismatch` when `src` is longer than `dst`; [`Error::Cuda`].
pub fn pad_copy(s: &Stream, src: &DeviceTensor, dst: &DeviceTensor) -> Result<()> {
    check_device("pad_copy", s, &[src, dst])?;
    check_dtype("pad_copy", dst, src.dtype())?;
    if src.numel() > dst.numel() {
        return Err(Error::ShapeMismatch {
            op: "pad_copy",
            expected: vec![dst.numel()],
            got: vec![src.numel()],
        });
    }
    let n = dst.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: src holds src.numel() and dst n elements of the dtype.
    unsafe {
        launch::pad_copy(
            s,
            kname!("pad_copy", dst.dtype()),
            Grid::elementwise(s, n),
            src.ptr(),
            src.numel() as i64,
            dst.ptr(),
            n as i64,
        )
    }
}

fn segment_tables(
    op: &'static str,
    s: &Stream,
    parts: &[&DeviceTensor],
    flat: &DeviceTensor,
) -> Result<(Vec<u64>, Vec<i64>, usize)> {
    check_device(op, s, parts)?;
    check_device(op, s, &[flat])?;
    let mut offsets = vec![0i64];
    let mut longest = 0;
    for p in parts {
        check_dtype(op, p, flat.dtype())?;
        offsets.push(offsets[offsets.len() - 1] + p.numel() as i64);
        longest = longest.max(p.numel());
    }
    let total = offsets[offsets.len() - 1] as usize;
    if total > flat.numel() {
        return Err(Error::ShapeMismatch {
            op,
            expected: vec![flat.numel()],
            got: vec![total],
        });
    }
    Ok((parts.iter().map(|p| p.ptr()).collect(), offsets, longest))
}

/// Concatenates `srcs` into the front of `dst` (`flatten_{dtype}`): one launch for all
/// parameters of a unit, in order; elements of `dst` after their total are left alone.
///
/// # Errors
/// `DTypeMismatch` when dtypes differ; `ShapeMismatch` when `dst` is too short;
/// [`Error::Cuda`].
pub fn flatten(s: &Stream, srcs: &[&DeviceTensor], dst: &DeviceTensor) -> Result<()> {
    let (ptrs, offsets, longest) = segment_tables("flatten", s, srcs, dst)?;
    if longest == 0 {
        return Ok(());
    }
    let (p, o) = (upload_table(s, &ptrs)?, upload_table(s, &offsets)?);
    // SAFETY: the tables hold k pointers to tensors of offsets[s+1]-offsets[s] elements,
    // and dst holds at least offsets[k]; the tables live until the kernel ran (their
    // blocks are reused only by later work on this stream).
    unsafe {
        launch::flatten(
            s,
            kname!("flatten", dst.dtype()),
            Grid::segments(s, srcs.len(), longest),
            p.ptr(),
            o.ptr(),
            dst.ptr(),
            srcs.len() as i64,
        )
    }
}

/// Copies consecutive pieces of `src` out into `dsts` (`unflatten_{dtype}`).
///
/// # Errors
/// As [`flatten`], with `src` too short.
pub fn unflatten(s: &Stream, src: &DeviceTensor, dsts: &[&DeviceTensor]) -> Result<()> {
    let (ptrs, offsets, longest) = segment_tables("unflatten", s, dsts, src)?;
    if longest == 0 {
        return Ok(());
    }
    let (p, o) = (upload_table(s, &ptrs)?, upload_table(s, &offsets)?);
    // SAFETY: as in `flatten`, with the roles swapped.
    unsafe {
        launch::unflatten(
            s,
            kname!("unflatten", src.dtype()),
            Grid::segments(s, dsts.len(), longest),
            src.ptr(),
            p.ptr(),
            o.ptr(),
            dsts.len() as i64,
        )
    }
}

/// `dst = cast(src)` (`cast_{src}_{dst}`) between f32, bf16 and f16, and between f32 and
/// f64; the same dtype is a [`copy`].
///
/// # Errors
/// `DTypeMismatch` for i32, i64, or f64 with bf16/f16; `ShapeMismatch`; [`Error::Cuda`].
pub fn cast(s: &Stream, src: &DeviceTensor, dst: &DeviceTensor) -> Result<()> {
    if src.dtype() == dst.dtype() {
        return copy(s, src, dst);
    }
    check_device("cast", s, &[src, dst])?;
    float_only("cast", src.dtype())?;
    float_only("cast", dst.dtype())?;
    check_numel("cast", src.numel(), dst)?;
    let n = src.numel();
    if n == 0 {
        return Ok(());
    }
    use DType::*;
    let name = match (src.dtype(), dst.dtype()) {
        (F32, F16) => "cast_f32_f16",
        (F16, F32) => "cast_f16_f32",
        (F16, BF16) => "cast_f16_bf16",
        (BF16, F16) => "cast_bf16_f16",
        (F32, BF16) => "cast_f32_bf16",
        (BF16, F32) => "cast_bf16_f32",
        (F64, F32) => "cast_f64_f32",
        (F32, F64) => "cast_f32_f64",
        (a, b) => {
            return Err(Error::DTypeMismatch {
                op: "cast",
                expected: if a == F64 { F32 } else { a },
                got: b,
            })
        }
    };
    // SAFETY: both tensors hold n elements of their dtypes.
    unsafe {
        launch::cast(
            s,
            name,
            Grid::elementwise(s, n),
            src.ptr(),
            dst.ptr(),
            n as i64,
        )
    }
}

/// `out = cast(grad * scale)` (`pack_grad_{dtype}`, `pack_grad_{src}_{dtype}` for a
/// bf16/f16 gradient): predivide and cast to the reduce dtype of a flat gradient, the
/// reduce-scatter input.
///
/// # Errors
/// `DTypeMismatch` (grad or out not a float dtype); `ShapeMismatch`; [`Error::Cuda`].
pub fn pack_grad(s: &Stream, grad: &DeviceTensor, out: &DeviceTensor, scale: f32) -> Result<()> {
    check_device("pack_grad", s, &[grad, out])?;
    float_only("pack_grad", grad.dtype())?;
    float_only("pack_grad", out.dtype())?;
    check_numel("pack_grad", grad.numel(), out)?;
    let n = grad.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: both hold n elements of their dtypes.
    unsafe {
        launch::pack_grad(
            s,
            match grad.dtype() {
                DType::BF16 => kname!("pack_grad_bf16", out.dtype()),
                DType::F16 => kname!("pack_grad_f16", out.dtype()),
                _ => kname!("pack_grad", out.dtype()),
            },
            Grid::elementwise(s, n),
            grad.ptr(),
            out.ptr(),
            scale,
            n as i64,
        )
    }
}

/// `out = f32(cast(f32(x) * scale))` (`unpack_grad_{dtype}`): postdivide in the reduce
/// dtype and upcast of a reduced shard into f32.
///
/// # Errors
/// `DTypeMismatch` (x i32, out not f32); `ShapeMismatch`; [`Error::Cuda`].
pub fn unpack_grad(s: &Stream, x: &DeviceTensor, out: &DeviceTensor, scale: f32) -> Result<()> {
    check_device("unpack_grad", s, &[x, out])?;
    check_dtype("unpack_grad", out, DType::F32)?;
    float_only("unpack_grad", x.dtype())?;
    check_numel("unpack_grad", x.numel(), out)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: both hold n elements of their dtypes.
    unsafe {
        launch::pack_grad(
            s,
            kname!("unpack_grad", x.dtype()),
            Grid::elementwise(s, n),
            x.ptr(),
            out.ptr(),
            scale,
            n as i64,
        )
    }
}

/// `acc = cast(f32(acc) + f32(x))` (`sum_into_{dtype}`), the threads backend's reduction.
///
/// # Errors
/// `DTypeMismatch` (i32 or differing); `ShapeMismatch`; [`Error::Cuda`].
pub fn sum_into(s: &Stream, acc: &DeviceTensor, x: &DeviceTensor) -> Result<()> {
    check_device("sum_into", s, &[acc, x])?;
    float_only("sum_into", acc.dtype())?;
    check_dtype("sum_into", x, acc.dtype())?;
    check_numel("sum_into", acc.numel(), x)?;
    let n = acc.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: both hold n elements of the dtype.
    unsafe {
        launch::sum_into(
            s,
            kname!("sum_into", acc.dtype()),
            Grid::elementwise(s, n),
            acc.ptr(),
            x.ptr(),
            n as i64,
        )
    }
}

/// `out = a + b` elementwise, one rounding to the dtype as [`sum_into`] (`add_{dtype}`:
/// f32, f64, bf16, f16): `torch.add` in one launch.
///
/// # Errors
/// `DTypeMismatch`, `ShapeMismatch` (element counts), [`Error::Cuda`].
pub fn add(s: &Stream, a: &DeviceTensor, b: &DeviceTensor, out: &DeviceTensor) -> Result<()> {
    check_device("add", s, &[a, b, out])?;
    float_only("add", a.dtype())?;
    check_dtype("add", b, a.dtype())?;
    check_dtype("add", out, a.dtype())?;
    check_numel("add", a.numel(), b)?;
    check_numel("add", a.numel(), out)?;
    let n = a.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: all three hold n elements of the dtype.
    unsafe {
        launch::add(
            s,
            kname!("add", a.dtype()),
            Grid::elementwise(s, n),
            a.ptr(),
            b.ptr(),
            out.ptr(),
            n as i64,
        )
    }
}

/// `x = x * alpha` in place (`scale_f32`, or `scale_f64` with `alpha` widened), e.g. the
/// postdivide of an f32 shard.
///
/// # Errors
/// `DTypeMismatch` for a tensor neither f32 nor f64; [`Error::Cuda`].
pub fn scale(s: &Stream, x: &DeviceTensor, alpha: f32) -> Result<()> {
    check_device("scale", s, &[x])?;
    if x.dtype() != DType::F64 {
        check_dtype("scale", x, DType::F32)?;
    }
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: x holds n elements of its dtype; alpha is passed as that type.
    unsafe {
        launch::scale(
            s,
            kname!("scale", x.dtype()),
            Grid::elementwise(s, n),
            x.ptr(),
            Arg::float_of(x.dtype(), f64::from(alpha)),
            n as i64,
        )
    }
}

/// `out = x / factor` (`divide`) or `out = x * factor` on f64 tensors (`div_scale_f64`):
/// the f64 FlatParameter's predivide and postdivide (PyTorch reduces an f64 gradient in
/// f64, `div_` by the factor). `out` may be `x` itself.
///
/// # Errors
/// `DTypeMismatch` unless both are f64; `ShapeMismatch`; [`Error::Cuda`].
pub fn div_scale_f64(
    s: &Stream,
    x: &DeviceTensor,
    out: &DeviceTensor,
    factor: f64,
    divide: bool,
) -> Result<()> {
    check_device("div_scale_f64", s, &[x, out])?;
    check_dtype("div_scale_f64", x, DType::F64)?;
    check_dtype("div_scale_f64", out, DType::F64)?;
    check_numel("div_scale_f64", x.numel(), out)?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    // SAFETY: both hold n f64 (the kernel allows out == x).
    unsafe {
        launch::div_scale(
            s,
            "div_scale_f64",
            Grid::elementwise(s, n),
            x.ptr(),
            out.ptr(),
            factor,
            divide as i32,
            n as i64,
        )
    }
}

/// Blocks of the [`sum_squares`] first pass: fixed, so the f64 sum is deterministic.
const SUMSQ_BLOCKS: u32 = 256;

/// `sum_i f64(x[i])^2` of an f32 or f64 tensor (`sumsq_partial_{f32,f64}`, then the host
/// adds the 256 block partials in order). Synchronizes the stream. CPU reference:
/// [`crate::backend::cpu::ops::sum_squares`] (equal up to f64 summation order).
///
/// # Errors
/// `DTypeMismatch` for a tensor neither f32 nor f64; [`Error::Cuda`].
pub fn sum_squares(s: &Stream, x: &DeviceTensor) -> Result<f64> {
    check_device("sum_squares", s, &[x])?;
    if x.dtype() != DType::F64 {
        check_dtype("sum_squares", x, DType::F32)?;
    }
    let n = x.numel();
    if n == 0 {
        return Ok(0.0);
    }
    let partial = s.alloc_bytes(SUMSQ_BLOCKS as usize * 8)?;
    let g = Grid {
        grid: (SUMSQ_BLOCKS, 1, 1),
        block: 256,
    };
    let name = kname!("sumsq_partial", x.dtype());
    // SAFETY: x holds n elements of its dtype; partial holds one f64 per block.
    unsafe { launch::sumsq_partial(s, name, g, x.ptr(), partial.ptr(), n as i64)? };
    let mut v = vec![0f64; SUMSQ_BLOCKS as usize];
    // SAFETY: the buffer holds SUMSQ_BLOCKS f64; synchronized before `v` is read.
    s.bind()?;
    unsafe { cu::memcpy_dtoh_async(&mut v, partial.ptr(), s.inner.cu_stream()) }
        .map_err(|e| Error::cuda("cuMemcpyDtoHAsync", e))?;
    s.synchronize()?;
    Ok(v.iter().sum())
}
