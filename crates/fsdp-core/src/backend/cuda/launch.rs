//! Raw launchers: one `unsafe fn` per kernel family of `kernels/*.cu`, arguments in the C
//! order, the kernel picked by name (`copy_f32`, `cast_f32_bf16`). They check nothing: the
//! typed ops (`ops.rs`, `nn_ops.rs`, `optim.rs`) check lengths, dtypes and devices and
//! choose the grid, then call these.

use super::Stream;
use crate::error::{Error, Result};
use cudarc::driver::result as cu;
use std::ffi::c_void;

/// One kernel argument. Each is passed to `cuLaunchKernel` from its own 8-byte slot; the
/// driver reads the parameter's size from the start of the slot (little-endian).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device pointer (`T*`).
    Ptr(u64),
    /// `int64_t`.
    I64(i64),
    /// `int32_t`.
    I32(i32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// A 2-byte value (`__half`/`__nv_bfloat16` bits).
    U16(u16),
}

impl Arg {
    fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I64(v) => v as u64,
            Arg::I32(v) => v as u32 as u64,
            Arg::F32(v) => v.to_bits() as u64,
            Arg::F64(v) => v.to_bits(),
            Arg::U16(v) => v as u64,
        }
    }
}

impl From<u64> for Arg {
    fn from(p: u64) -> Arg {
        Arg::Ptr(p)
    }
}
impl From<i64> for Arg {
    fn from(v: i64) -> Arg {
        Arg::I64(v)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Arg {
        Arg::I32(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Arg {
        Arg::F32(v)
    }
}
impl From<f64> for Arg {
    fn from(v: f64) -> Arg {
        Arg::F64(v)
    }
}
impl Arg {
    /// A floating-point scalar argument of a kernel templated on its element type: `double`
    /// for the f64 instance, else `float` (`v` rounded to nearest).
    pub(crate) fn float_of(dtype: crate::tensor::DType, v: f64) -> Arg {
        match dtype {
            crate::tensor::DType::F64 => Arg::F64(v),
            _ => Arg::F32(v as f32),
        }
    }
}
impl From<u16> for Arg {
    fn from(v: u16) -> Arg {
        Arg::U16(v)
    }
}

/// Launch geometry: `grid` blocks of `block` threads (1-D blocks).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grid {
    pub grid: (u32, u32, u32),
    pub block: u32,
}

impl Grid {
    /// An elementwise launch over `n` elements: 256 threads per block (8 warps: enough
    /// loads in flight per SM at 32 blocks/SM, see `CudaDevice::grid_for`).
    pub fn elementwise(s: &Stream, n: usize) -> Grid {
        Grid {
            grid: (s.dev.grid_for(n, 256), 1, 1),
            block: 256,
        }
    }

    /// One block per row (rows walked with stride gridDim.x), `block` threads.
    pub fn rows(s: &Stream, rows: usize, block: u32) -> Grid {
        let cap = (s.dev.info().multiprocessors * 16).max(1);
        Grid {
            grid: (rows.clamp(1, cap) as u32, 1, 1),
            block,
        }
    }

    /// Column sums over `(rows, c)` (`column_sums` in `nn.cu`): one 1024-thread block per 32
    /// columns.
    pub fn columns(c: usize) -> Grid {
        Grid {
            grid: (c.div_ceil(32).clamp(1, i32::MAX as usize) as u32, 1, 1),
            block: 1024,
        }
    }

    /// Multi-tensor launch: `segments` along y (at most 65535; kernels stride over the
    /// rest), x sized for the longest segment.
    pub fn segments(s: &Stream, segments: usize, longest: usize) -> Grid {
        let x = s.dev.grid_for(longest, 256);
        let y = segments.clamp(1, 65535) as u32;
        // Keep the total near the elementwise cap: many segments need fewer x blocks each.
        let x = (x as usize).div_ceil(y as usize).max(1).min(x as usize) as u32;
        Grid {
            grid: (x.max(1), y, 1),
            block: 256,
        }
    }
}

/// Most arguments a kernel of `kernels/` takes (`sdpa.cu`'s backward kernels: 14).
const MAX_ARGS: usize = 16;

/// Launches `module`'s kernel `name` on `s`: no heap allocation and, once the kernel was
/// launched before on this device, no lock.
///
/// # Safety
/// `args` must match the kernel's C signature in number, order and size, and every pointer
/// must address device memory on `s`'s device that stays allocated until the kernel has
/// run and is large enough for every access the kernel makes (see the `.cu` header).
pub(crate) unsafe fn launch(
    s: &Stream,
    module: &'static str,
    name: &'static str,
    g: Grid,
    args: &[Arg],
) -> Result<()> {
    // Bind first: looking the kernel up (`cuModuleGetFunction` on a module that another
    // thread loaded) is a driver call too and needs this device's context current.
    s.dev
        .ctx
        .bind_to_thread()
        .map_err(|e| Error::cuda(format!("binding cuda:{}", s.dev.ordinal()), e))?;
    let f = s.dev.function(module, name)?;
    // Argument slots on the stack: a launch allocates nothing.
    if args.len() > MAX_ARGS {
        return Err(Error::Fsdp(format!(
            "internal: kernel {name} takes {} arguments, launchers pass at most {MAX_ARGS}",
            args.len()
        )));
    }
    let mut slots = [0u64; MAX_ARGS];
    for (slot, a) in slots.iter_mut().zip(args) {
        *slot = a.slot();
    }
    let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for (p, slot) in params.iter_mut().zip(slots.iter_mut()) {
        *p = slot as *mut u64 as *mut c_void;
    }
    // SAFETY: the caller guarantees the arguments match the kernel; `params` points into
    // `slots`, which outlive the call (the driver copies parameters at launch); `f` stays
    // valid while the device lives.
    crate::backend::counters::count_kernel_launch(name);
    unsafe {
        cu::launch_kernel(
            f,
            g.grid,
            (g.block, 1, 1),
            0,
            s.inner.cu_stream(),
            &mut params[..args.len()],
        )
    }
    .map_err(|e| {
        Error::cuda(
            format!(
                "launching {name} on cuda:{} (grid {:?}, block {})",
                s.dev.ordinal(),
                g.grid,
                g.block
            ),
            e,
        )
    })
}

/// Defines a raw launcher for a kernel family of `module` with the C parameter list.
macro_rules! raw_kernel {
    ($(#[$doc:meta])* $fn:ident, $module:literal, ($($a:ident : $t:ty),* $(,)?)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// Every pointer argument addresses device memory on `s`'s device that stays
        /// allocated until the kernel ran and covers every element the kernel touches (see
        /// the `.cu` header); no other work writes what it reads while it runs.
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $fn(s: &Stream, name: &'static str, g: Grid, $($a: $t),*) -> Result<()> {
            // SAFETY: forwarded from the caller.
            unsafe { launch(s, $module, name, g, &[$(Arg::from($a)),*]) }
        }
    };
}

raw_kernel!(/// `copy_{dtype}(src, dst, n)`.
    copy, "flat_param", (src: u64, dst: u64, n: i64));
raw_kernel!(/// `fill_{dtype}(dst, value, n)` for 4-byte dtypes (value bits as i32).
    fill32, "flat_param", (dst: u64, value: i32, n: i64));
raw_kernel!(/// `fill_{dtype}(dst, value, n)` for 8-byte dtypes (value bits as i64).
    fill64, "flat_param", (dst: u64, value: i64, n: i64));
raw_kernel!(/// `fill_{dtype}(dst, value, n)` for 2-byte dtypes (value bits).
    fill16, "flat_param", (dst: u64, value: u16, n: i64));
raw_kernel!(/// `pad_copy_{dtype}(src, src_n, dst, dst_n)`.
    pad_copy, "flat_param", (src: u64, src_n: i64, dst: u64, dst_n: i64));
raw_kernel!(/// `flatten_{dtype}(srcs, offsets, dst, k)`.
    flatten, "flat_param", (srcs: u64, offsets: u64, dst: u64, k: i64));
raw_kernel!(/// `unflatten_{dtype}(src, dsts, offsets, k)`.
    unflatten, "flat_param", (src: u64, dsts: u64, offsets: u64, k: i64));
raw_kernel!(/// `cast_{src}_{dst}(in, out, n)`.
    cast, "cast", (input: u64, out: u64, n: i64));
raw_kernel!(/// `pack_grad_{dtype}(grad, out, scale, n)` and `unpack_grad_{dtype}(in, out, scale, n)`.
    pack_grad, "reduce_scatter", (input: u64, out: u64, scale: f32, n: i64));
raw_kernel!(/// `sum_into_{dtype}(acc, x, n)`.
    sum_into, "reduce_scatter", (acc: u64, x: u64, n: i64));
raw_kernel!(/// `add_{dtype}(a, b, out, n)`.
    add, "reduce_scatter", (a: u64, b: u64, out: u64, n: i64));
raw_kernel!(/// `scale_{f32,f64}(x, alpha, n)`: `alpha` of the element type.
    scale, "reduce_scatter", (x: u64, alpha: Arg, n: i64));
raw_kernel!(/// `div_scale_f64(x, out, factor, divide, n)`.
    div_scale, "reduce_scatter", (x: u64, out: u64, factor: f64, divide: i32, n: i64));
raw_kernel!(/// `sumsq_partial_{f32,f64}(x, partial, n)`.
    sumsq_partial, "reduce_scatter", (x: u64, partial: u64, n: i64));
raw_kernel!(/// `sumsq_fold_f64(partial, nblocks, acc)`.
    sumsq_fold, "reduce_scatter", (partial: u64, nblocks: i64, acc: u64));
raw_kernel!(/// `sumsq_partial_multi_{f32,f64}(xs, k, partial)`: `xs` a table of `k` `Segment`s.
    sumsq_partial_multi, "reduce_scatter", (xs: u64, k: i64, partial: u64));
raw_kernel!(/// `sumsq_fold_multi_f64(partial, k, nblocks, acc, out)`: `out` may be null.
    sumsq_fold_multi, "reduce_scatter", (partial: u64, k: i64, nblocks: i64, acc: u64, out: u64));
raw_kernel!(/// `scale_by_multi_{f32,f64}(xs, k, alpha)`: `xs` a table of `k` `Segment`s.
    scale_by_multi, "reduce_scatter", (xs: u64, k: i64, alpha: u64));
raw_kernel!(/// `narrow_f64_f32(x, out)` and `widen_f32_f64(x, out)`: one element.
    convert1, "reduce_scatter", (x: u64, out: u64));
raw_kernel!(/// `clip_coef_{f32,f64}(sumsq, total, max_norm, norm, coef)`: `max_norm` of the coefficient's type, `total` null or one f32.
    clip_coef, "reduce_scatter", (sumsq: u64, total: u64, max_norm: Arg, norm: u64, coef: u64));
raw_kernel!(/// `scale_by_{f32,f64}(x, alpha, n)`: `alpha` is a device pointer to one element.
    scale_by, "reduce_scatter", (x: u64, alpha: u64, n: i64));
raw_kernel!(/// `sgd_{f32,f64}(tensors, k, lr, momentum, dampening, weight_decay, nesterov)`.
    sgd, "optim", (tensors: u64, k: i64, lr: Arg, momentum: Arg, dampening: Arg, weight_decay: Arg, nesterov: i32));
raw_kernel!(/// `adam_{f32,f64}(tensors, k, lr, beta1, beta2, eps, weight_decay, decoupled, lr_at)`
    /// (`lr_at`: 0, or the device scalar of `dt` that replaces `lr`).
    adam, "optim", (tensors: u64, k: i64, lr: Arg, beta1: Arg, beta2: Arg, eps: Arg, weight_decay: Arg, decoupled: i32, lr_at: u64));
raw_kernel!(/// `adam_bias_{f32,f64}(tensors, k, step, lrs, n_lrs, base, lr_out, lr, beta1, beta2)`
    /// (`graph.cu`).
    adam_bias, "graph", (tensors: u64, k: i64, step: u64, lrs: u64, n_lrs: i64, base: i64, lr_out: u64, lr: f64, beta1: f64, beta2: f64));
raw_kernel!(/// `gelu_fwd_{f32,f64}(x, y, n)` (the nn.cu launchers below take both instances; scalar
    /// arguments of the element type are [`Arg::float_of`]).
    gelu_fwd, "nn", (x: u64, y: u64, n: i64));
raw_kernel!(/// `gelu_bwd_{f32,f64}(x, dy, dx, n)`.
    gelu_bwd, "nn", (x: u64, dy: u64, dx: u64, n: i64));
raw_kernel!(/// `bias_gelu_fwd_{f32,f64}(h, b, y, rows, c)`.
    bias_gelu_fwd, "nn", (h: u64, b: u64, y: u64, rows: i64, c: i64));
raw_kernel!(/// `gelu_bwd_bias_grad_{f32,f64}(x, dy, dx, db, rows, c)`.
    gelu_bwd_bias_grad, "nn", (x: u64, dy: u64, dx: u64, db: u64, rows: i64, c: i64));
raw_kernel!(/// `relu_fwd_{f32,f64}(x, y, n)`.
    relu_fwd, "nn", (x: u64, y: u64, n: i64));
raw_kernel!(/// `relu_bwd_{f32,f64}(x, dy, dx, n)`.
    relu_bwd, "nn", (x: u64, dy: u64, dx: u64, n: i64));
raw_kernel!(/// `bias_add_{f32,f64}(y, b, rows, c)` and `bias_grad_{f32,f64}(dy, db, rows, c)`.
    bias, "nn", (y: u64, b: u64, rows: i64, c: i64));
raw_kernel!(/// `layernorm_fwd_{f32,f64}(x, res, w, b, sum, y, xhat, rstd, rows, c, eps)`.
    layernorm_fwd, "nn", (x: u64, res: u64, w: u64, b: u64, sum: u64, y: u64, xhat: u64, rstd: u64, rows: i64, c: i64, eps: Arg));
raw_kernel!(/// `layernorm_bwd_{f32,f64}(dy, xhat, rstd, w, res, dx, dw, db, res_sum, rows, c, row_blocks)`.
    layernorm_bwd, "nn", (dy: u64, xhat: u64, rstd: u64, w: u64, res: u64, dx: u64, dw: u64, db: u64, res_sum: u64, rows: i64, c: i64, row_blocks: i64));
raw_kernel!(/// `split_qkv_{f32,f64}(qkv, q, k, v, B, T, H, hd)` and `merge_qkv_{f32,f64}(dq, dk, dv, dqkv, B, T, H, hd)`.
    qkv, "nn", (a: u64, b: u64, c: u64, d: u64, bsz: i64, t: i64, h: i64, hd: i64));
raw_kernel!(/// `merge_heads_{f32,f64}(yh, y, B, T, H, hd)` and `split_heads_{f32,f64}(y, yh, B, T, H, hd)`.
    heads, "nn", (src: u64, dst: u64, bsz: i64, t: i64, h: i64, hd: i64));
raw_kernel!(/// `softmax_causal_fwd_{f32,f64}(s, p, rows, T, scale)`.
    softmax_fwd, "nn", (s_in: u64, p: u64, rows: i64, t: i64, scale: Arg));
raw_kernel!(/// `softmax_causal_bwd_{f32,f64}(p, dp, ds, rows, T, scale)`.
    softmax_bwd, "nn", (p: u64, dp: u64, ds: u64, rows: i64, t: i64, scale: Arg));
raw_kernel!(/// `layernorm_bwd_lp_{dtype}(x, dy, w, mean, rstd, dx, n, c)` (`lowp.cu`).
    layernorm_bwd_lp, "lowp", (x: u64, dy: u64, w: u64, mean: u64, rstd: u64, dx: u64, n: i64, c: i64));
raw_kernel!(/// `layernorm_wgrad_lp_{dtype}(x, dy, mean, rstd, dw, db, n, c)` (`lowp.cu`).
    layernorm_wgrad_lp, "lowp", (x: u64, dy: u64, mean: u64, rstd: u64, dw: u64, db: u64, n: i64, c: i64));
raw_kernel!(/// `cross_entropy_lp_{dtype}(logits, targets, losses, dlogits, n, V, w, invalid)` (`lowp.cu`).
    cross_entropy_lp, "lowp", (logits: u64, targets: u64, losses: u64, dlogits: u64, n: i64, v: i64, w: f32, invalid: u64));
raw_kernel!(/// `cross_entropy_{f32,f64}(logits, targets, losses, dlogits, n, V, inv_n, invalid)`.
    cross_entropy, "nn", (logits: u64, targets: u64, losses: u64, dlogits: u64, n: i64, v: i64, inv_n: Arg, invalid: u64));
raw_kernel!(/// `embedding_fwd_{f32,f64}(ids, table, out, n, V, c, invalid)`.
    embedding_fwd, "nn", (ids: u64, table: u64, out: u64, n: i64, v: i64, c: i64, invalid: u64));
raw_kernel!(/// `mean_rows_{f32,f64}(losses, n, out)`.
    mean_rows, "nn", (losses: u64, n: i64, out: u64));
raw_kernel!(/// `add_div_f32(acc, x, d)`.
    add_div, "nn", (acc: u64, x: u64, d: f32));
raw_kernel!(/// `embedding_bwd_{f32,f64}(ids, dout, grad, n, V, c)`.
    embedding_bwd, "nn", (ids: u64, dout: u64, grad: u64, n: i64, v: i64, c: i64));
raw_kernel!(/// `batchnorm_stats_{dtype}(x, rm, rv, count, factor, eps, stats, n, c, l, batch)` (`batchnorm.cu`).
    batchnorm_stats, "batchnorm", (x: u64, rm: u64, rv: u64, count: u64, factor: f64, eps: f64, stats: u64, n: i64, c: i64, l: i64, batch: i32));
raw_kernel!(/// `batchnorm_fwd_{dtype}(x, w, b, stats, y, n, c, l)` (`batchnorm.cu`).
    batchnorm_fwd, "batchnorm", (x: u64, w: u64, b: u64, stats: u64, y: u64, n: i64, c: i64, l: i64));
raw_kernel!(/// `batchnorm_bwd_stats_{dtype}(x, dy, stats, sums, dw, db, n, c, l)` (`batchnorm.cu`).
    batchnorm_bwd_stats, "batchnorm", (x: u64, dy: u64, stats: u64, sums: u64, dw: u64, db: u64, n: i64, c: i64, l: i64));
raw_kernel!(/// `batchnorm_bwd_dx_{dtype}(x, dy, w, stats, sums, dx, n, c, l, batch)` (`batchnorm.cu`).
    batchnorm_bwd_dx, "batchnorm", (x: u64, dy: u64, w: u64, stats: u64, sums: u64, dx: u64, n: i64, c: i64, l: i64, batch: i32));
raw_kernel!(/// `batchnorm_count_i64(count)` (`batchnorm.cu`).
    batchnorm_count, "batchnorm", (count: u64));
raw_kernel!(/// `sdpa_fwd_{dtype}(q, k, v, out, lse, BH, T, hd, qs, kvs, scale)` (`sdpa.cu`).
    sdpa_fwd, "sdpa", (q: u64, k: u64, v: u64, out: u64, lse: u64, bh: i64, t: i64, hd: i64, qs: i64, kvs: i64, scale: f32));
raw_kernel!(/// `sdpa_bwd_dq_{dtype}(q, k, v, out, lse, dout, dq, dsum, BH, T, hd, qs, kvs, scale)` (`sdpa.cu`).
    sdpa_bwd_dq, "sdpa", (q: u64, k: u64, v: u64, out: u64, lse: u64, dout: u64, dq: u64, dsum: u64, bh: i64, t: i64, hd: i64, qs: i64, kvs: i64, scale: f32));
raw_kernel!(/// `sdpa_bwd_dkv_{dtype}(q, k, v, lse, dout, dsum, dk, dv, BH, T, hd, qs, kvs, scale)` (`sdpa.cu`).
    sdpa_bwd_dkv, "sdpa", (q: u64, k: u64, v: u64, lse: u64, dout: u64, dsum: u64, dk: u64, dv: u64, bh: i64, t: i64, hd: i64, qs: i64, kvs: i64, scale: f32));
