//! Tests written once for every backend: [`backend_test!`] makes `<name>_cpu` and
//! `<name>_cuda` tests from one body `fn(&Backend) -> fsdp::Result<()>`; the CUDA one prints
//! a skip notice and passes when the build has no `cuda` feature or the machine no driver
//! or device. [`Backend`] runs each kernel on host slices: on the CPU through its reference
//! (`backend::cpu::kernels`), on CUDA by uploading, launching, and downloading.
#![allow(dead_code)]

use fsdp::backend::cpu::kernels as cpu;
use fsdp::backend::cpu::kernels::HeadDims;
use fsdp::tensor::Element;
use fsdp::Result;

/// Makes `$name_cpu` and `$name_cuda` from `$body: fn(&Backend) -> fsdp::Result<()>`.
#[macro_export]
macro_rules! backend_test {
    ($name:ident, $body:expr) => {
        pastey::paste! {
            #[test]
            fn [<$name _cpu>]() {
                let f: fn(&$crate::backend::Backend) -> fsdp::Result<()> = $body;
                f(&$crate::backend::Backend::Cpu).unwrap();
            }
            #[test]
            fn [<$name _cuda>]() {
                let f: fn(&$crate::backend::Backend) -> fsdp::Result<()> = $body;
                match $crate::backend::Backend::cuda() {
                    Ok(b) => f(&b).unwrap(),
                    Err(why) => eprintln!("skipping {} on CUDA: {why}", stringify!($name)),
                }
            }
        }
    };
}

/// Where a test's kernels run.
pub enum Backend {
    /// The CPU references.
    Cpu,
    /// CUDA device 0, on a fresh stream.
    #[cfg(feature = "cuda")]
    Cuda(fsdp::backend::cuda::Stream),
}

#[cfg(feature = "cuda")]
use fsdp::backend::cuda as cu;
#[cfg(feature = "cuda")]
use fsdp::backend::cuda::DeviceTensor as D;

impl Backend {
    /// CUDA device 0, or why not (no feature, driver or device).
    pub fn cuda() -> std::result::Result<Backend, String> {
        #[cfg(feature = "cuda")]
        {
            let dev = cu::CudaDevice::get(0).map_err(|e| e.to_string())?;
            let s = cu::Stream::new(&dev, cu::MemAccount::new()).map_err(|e| e.to_string())?;
            Ok(Backend::Cuda(s))
        }
        #[cfg(not(feature = "cuda"))]
        {
            Err(fsdp::backend::cuda::no_cuda_build().to_string())
        }
    }

    /// `"cpu"` or `"cuda"`, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "cuda",
        }
    }

    /// Whether results may differ from the CPU in rounding of reductions.
    pub fn is_cuda(&self) -> bool {
        !matches!(self, Backend::Cpu)
    }
}

thread_local! {
    /// Elements every device buffer of a test starts past its allocation (0 normally), so a
    /// kernel sees pointers at any alignment; see [`with_shift`].
    static SHIFT: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` with every device buffer that `up`/`out` make starting `shift` elements into its
/// allocation (a view), as a rank's shard of a flat parameter does: kernels that move 128-bit
/// vectors where aligned must fall back to their scalar path and give the same bits. The
/// CPU backend ignores it.
pub fn with_shift<R>(shift: usize, f: impl FnOnce() -> R) -> R {
    let old = SHIFT.with(|c| c.replace(shift));
    let r = f();
    SHIFT.with(|c| c.set(old));
    r
}

#[cfg(feature = "cuda")]
pub(crate) fn up<T: Element>(s: &cu::Stream, x: &[T]) -> Result<D> {
    let shift = SHIFT.with(std::cell::Cell::get);
    if shift == 0 {
        return D::from_slice(s, x, &[x.len()]);
    }
    let mut padded = vec![T::zero(); shift];
    padded.extend_from_slice(x);
    D::from_slice(s, &padded, &[padded.len()])?.view(shift, &[x.len()])
}

#[cfg(feature = "cuda")]
pub(crate) fn out<T: Element>(s: &cu::Stream, n: usize) -> Result<D> {
    // Poisoned with all-ones bytes (NaN for floats) so unwritten elements show.
    let mut poison = vec![T::zero(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut poison).fill(0xff);
    up(s, &poison)
}

#[cfg(feature = "cuda")]
pub(crate) fn down<T: Element>(s: &cu::Stream, t: &D) -> Result<Vec<T>> {
    t.to_vec::<T>(s)
}

/// Runs `$cpu` on the CPU backend or `$cuda` (given the stream) on CUDA.
#[macro_export]
macro_rules! on {
    ($self:expr, $cpu:block, |$s:ident| $cuda:block) => {
        match $self {
            $crate::backend::Backend::Cpu => $cpu,
            #[cfg(feature = "cuda")]
            $crate::backend::Backend::Cuda($s) => $cuda,
        }
    };
}

impl Backend {
    /// `copy_{dtype}`.
    pub fn copy<T: Element>(&self, x: &[T]) -> Result<Vec<T>> {
        on!(self, { Ok(x.to_vec()) }, |s| {
            let (a, b) = (up(s, x)?, out::<T>(s, x.len())?);
            cu::copy(s, &a, &b)?;
            down(s, &b)
        })
    }

    /// `fill_{dtype}`.
    pub fn fill<T: Element>(&self, n: usize, v: f32) -> Result<Vec<T>> {
        on!(self, { Ok(vec![T::from_f32(v); n]) }, |s| {
            let b = out::<T>(s, n)?;
            cu::fill(s, &b, v)?;
            down(s, &b)
        })
    }

    /// `pad_copy_{dtype}` of `src` into `dst_len` elements.
    pub fn pad_copy<T: Element>(&self, src: &[T], dst_len: usize) -> Result<Vec<T>> {
        on!(
            self,
            {
                let mut d = vec![T::zero(); dst_len];
                cpu::pad_copy(src, &mut d)?;
                Ok(d)
            },
            |s| {
                let (a, b) = (up(s, src)?, out::<T>(s, dst_len)?);
                cu::pad_copy(s, &a, &b)?;
                down(s, &b)
            }
        )
    }

    /// `flatten_f32` of `parts` into `total` elements starting from `init`.
    pub fn flatten(&self, parts: &[Vec<f32>], init: &[f32]) -> Result<Vec<f32>> {
        on!(
            self,
            {
                let mut d = init.to_vec();
                let refs: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
                cpu::flatten(&refs, &mut d)?;
                Ok(d)
            },
            |s| {
                let ts = parts.iter().map(|p| up(s, p)).collect::<Result<Vec<_>>>()?;
                let refs: Vec<&D> = ts.iter().collect();
                let d = up(s, init)?;
                cu::flatten(s, &refs, &d)?;
                down(s, &d)
            }
        )
    }

    /// `unflatten_f32` of `flat` into pieces of `lens`.
    pub fn unflatten(&self, flat: &[f32], lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        on!(
            self,
            {
                let mut outs: Vec<Vec<f32>> = lens.iter().map(|&l| vec![0.0; l]).collect();
                let mut refs: Vec<&mut [f32]> = outs.iter_mut().map(|v| v.as_mut_slice()).collect();
                cpu::unflatten(flat, &mut refs)?;
                Ok(outs)
            },
            |s| {
                let src = up(s, flat)?;
                let ts = lens
                    .iter()
                    .map(|&l| out::<f32>(s, l))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&D> = ts.iter().collect();
                cu::unflatten(s, &src, &refs)?;
                ts.iter().map(|t| down(s, t)).collect()
            }
        )
    }

    /// `cast_{S}_{T}`.
    pub fn cast<S: Element, T: Element>(&self, x: &[S]) -> Result<Vec<T>> {
        on!(
            self,
            {
                let mut d = vec![T::zero(); x.len()];
                fsdp::backend::cpu::ops::cast_slice(x, &mut d);
                Ok(d)
            },
            |s| {
                let (a, b) = (up(s, x)?, out::<T>(s, x.len())?);
                cu::cast(s, &a, &b)?;
                down(s, &b)
            }
        )
    }

    /// `pack_grad_{T}`.
    pub fn pack_grad<T: Element>(&self, g: &[f32], scale: f32) -> Result<Vec<T>> {
        on!(
            self,
            {
                let mut d = vec![T::zero(); g.len()];
                cpu::pack_grad(g, &mut d, scale)?;
                Ok(d)
            },
            |s| {
                let (a, b) = (up(s, g)?, out::<T>(s, g.len())?);
                cu::pack_grad(s, &a, &b, scale)?;
                down(s, &b)
            }
        )
    }

    /// `unpack_grad_{T}`.
    pub fn unpack_grad<T: Element>(&self, x: &[T], scale: f32) -> Result<Vec<f32>> {
        on!(
            self,
            {
                let mut d = vec![0.0; x.len()];
                cpu::unpack_grad(x, &mut d, scale)?;
                Ok(d)
            },
            |s| {
                let (a, b) = (up(s, x)?, out::<f32>(s, x.len())?);
                cu::unpack_grad(s, &a, &b, scale)?;
                down(s, &b)
            }
        )
    }

    /// `sum_into_{T}`: returns `acc + x`.
    pub fn sum_into<T: Element>(&self, acc: &[T], x: &[T]) -> Result<Vec<T>> {
        on!(
            self,
            {
                let mut a = acc.to_vec();
                cpu::sum_into(&mut a, x)?;
                Ok(a)
            },
            |s| {
                let (a, b) = (up(s, acc)?, up(s, x)?);
                cu::sum_into(s, &a, &b)?;
                down(s, &a)
            }
        )
    }

    /// `gelu_fwd_f32`.
    pub fn gelu_fwd(&self, x: &[f32]) -> Result<Vec<f32>> {
        on!(
            self,
            {
                let mut y = vec![0.0; x.len()];
                cpu::gelu_fwd(x, &mut y)?;
                Ok(y)
            },
            |s| {
                let (a, b) = (up(s, x)?, out::<f32>(s, x.len())?);
                cu::gelu_fwd(s, &a, &b)?;
                down(s, &b)
            }
        )
    }

    /// `gelu_bwd_f32`.
    pub fn gelu_bwd(&self, x: &[f32], dy: &[f32]) -> Result<Vec<f32>> {
        on!(
            self,
            {
                let mut dx = vec![0.0; x.len()];
                cpu::gelu_bwd(x, dy, &mut dx)?;
                Ok(dx)
            },
            |s| {
                let (a, g, b) = (up(s, x)?, up(s, dy)?, out::<f32>(s, x.len())?);
                cu::gelu_bwd(s, &a, &g, &b)?;
                down(s, &b)
            }
        )
    }

    /// `bias_add_f32` then `bias_grad_f32` (into `db0`): returns `(y + b, db0 + colsum(y))`.
    pub fn bias(&self, y: &[f32], b: &[f32], db0: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        on!(
            self,
            {
                let (mut yy, mut db) = (y.to_vec(), db0.to_vec());
                cpu::bias_add(&mut yy, b)?;
                cpu::bias_grad(y, &mut db)?;
                Ok((yy, db))
            },
            |s| {
                let (ty, tb, tdb, ty0) = (up(s, y)?, up(s, b)?, up(s, db0)?, up(s, y)?);
                cu::bias_add(s, &ty, &tb)?;
                cu::bias_grad(s, &ty0, &tdb)?;
                Ok((down(s, &ty)?, down(s, &tdb)?))
            }
        )
    }

    /// `layernorm_fwd_f32`: `(y, xhat, rstd)`.
    pub fn layernorm_fwd(
        &self,
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let rows = x.len() / w.len().max(1);
        on!(
            self,
            {
                let (mut y, mut xh, mut rs) =
                    (vec![0.0; x.len()], vec![0.0; x.len()], vec![0.0; rows]);
                cpu::layernorm_fwd(x, w, b, eps, &mut y, &mut xh, &mut rs)?;
                Ok((y, xh, rs))
            },
            |s| {
                let (tx, tw, tb) = (up(s, x)?, up(s, w)?, up(s, b)?);
                let (y, xh, rs) = (
                    out::<f32>(s, x.len())?,
                    out::<f32>(s, x.len())?,
                    out::<f32>(s, rows)?,
                );
                cu::layernorm_fwd(s, &tx, &tw, &tb, eps.into(), &y, &xh, &rs)?;
                Ok((down(s, &y)?, down(s, &xh)?, down(s, &rs)?))
            }
        )
    }

    /// `layernorm_bwd_f32` + params (dw, db from zero): `(dx, dw, db)`.
    pub fn layernorm_bwd(
        &self,
        dy: &[f32],
        xhat: &[f32],
        rstd: &[f32],
        w: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let c = w.len();
        on!(
            self,
            {
                let (mut dx, mut dw, mut db) = (vec![0.0; dy.len()], vec![0.0; c], vec![0.0; c]);
                cpu::layernorm_bwd(dy, xhat, rstd, w, &mut dx)?;
                cpu::layernorm_bwd_params(dy, xhat, &mut dw, &mut db)?;
                Ok((dx, dw, db))
            },
            |s| {
                let (tdy, txh, trs, tw) = (up(s, dy)?, up(s, xhat)?, up(s, rstd)?, up(s, w)?);
                let (dx, dw, db) = (
                    out::<f32>(s, dy.len())?,
                    up(s, &vec![0.0f32; c])?,
                    up(s, &vec![0.0f32; c])?,
                );
                cu::layernorm_bwd(s, &tdy, &txh, &trs, &tw, &dx, &dw, &db)?;
                Ok((down(s, &dx)?, down(s, &dw)?, down(s, &db)?))
            }
        )
    }

    /// `split_qkv_f32` then `merge_qkv_f32` of the pieces: `([q, k, v], merged)`.
    pub fn qkv(&self, qkv: &[f32], d: HeadDims) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
        let n = d.numel();
        on!(
            self,
            {
                let (mut q, mut k, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
                cpu::split_qkv(qkv, &mut q, &mut k, &mut v, d)?;
                let mut m = vec![0.0; 3 * n];
                cpu::merge_qkv(&q, &k, &v, &mut m, d)?;
                Ok((vec![q, k, v], m))
            },
            |s| {
                let t = up(s, qkv)?;
                let (q, k, v) = (out::<f32>(s, n)?, out::<f32>(s, n)?, out::<f32>(s, n)?);
                cu::split_qkv(s, &t, &q, &k, &v, d)?;
                let m = out::<f32>(s, 3 * n)?;
                cu::merge_qkv(s, &q, &k, &v, &m, d)?;
                Ok((vec![down(s, &q)?, down(s, &k)?, down(s, &v)?], down(s, &m)?))
            }
        )
    }

    /// `merge_heads_f32` then `split_heads_f32`: `(merged, split back)`.
    pub fn heads(&self, yh: &[f32], d: HeadDims) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = d.numel();
        on!(
            self,
            {
                let (mut y, mut back) = (vec![0.0; n], vec![0.0; n]);
                cpu::merge_heads(yh, &mut y, d)?;
                cpu::split_heads(&y, &mut back, d)?;
                Ok((y, back))
            },
            |s| {
                let (a, y, back) = (up(s, yh)?, out::<f32>(s, n)?, out::<f32>(s, n)?);
                cu::permute_heads(s, &a, &y, d, false)?;
                cu::permute_heads(s, &y, &back, d, true)?;
                Ok((down(s, &y)?, down(s, &back)?))
            }
        )
    }

    /// Causal softmax forward, then backward of `dp` in place: `(p, ds)`.
    pub fn softmax(
        &self,
        sc: &[f32],
        dp: &[f32],
        t: usize,
        scale: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        on!(
            self,
            {
                let mut p = vec![0.0; sc.len()];
                cpu::softmax_causal_fwd(sc, &mut p, t, scale)?;
                let mut ds = dp.to_vec();
                cpu::softmax_causal_bwd(&p, &mut ds, t, scale)?;
                Ok((p, ds))
            },
            |s| {
                let (a, p, g) = (up(s, sc)?, out::<f32>(s, sc.len())?, up(s, dp)?);
                cu::softmax_causal_fwd(s, &a, &p, t, scale.into())?;
                cu::softmax_causal_bwd(s, &p, &g, &g, t, scale.into())?;
                Ok((down(s, &p)?, down(s, &g)?))
            }
        )
    }

    /// `cross_entropy_f32`: `(per-row losses, dlogits)`.
    pub fn cross_entropy(
        &self,
        logits: &[f32],
        targets: &[i32],
        inv_n: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        on!(
            self,
            {
                let (mut l, mut g) = (vec![0.0; targets.len()], vec![0.0; logits.len()]);
                cpu::cross_entropy(logits, targets, inv_n, &mut l, &mut g)?;
                Ok((l, g))
            },
            |s| {
                let (a, y) = (up(s, logits)?, up(s, targets)?);
                let (l, g) = (out::<f32>(s, targets.len())?, out::<f32>(s, logits.len())?);
                cu::cross_entropy(s, &a, &y, inv_n.into(), &l, &g)?;
                Ok((down(s, &l)?, down(s, &g)?))
            }
        )
    }

    /// `embedding_fwd_f32` with `table (V, C)`, then `embedding_bwd_f32` of `dout` into
    /// `grad0`: `(out, grad)`.
    pub fn embedding(
        &self,
        ids: &[i32],
        table: &[f32],
        c: usize,
        dout: &[f32],
        grad0: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        on!(
            self,
            {
                let mut o = vec![0.0; ids.len() * c];
                cpu::embedding_fwd(ids, table, c, &mut o)?;
                let mut g = grad0.to_vec();
                cpu::embedding_bwd(ids, dout, c, &mut g)?;
                Ok((o, g))
            },
            |s| {
                let v = table.len() / c.max(1);
                let (i, t) = (up(s, ids)?, D::from_slice(s, table, &[v, c])?);
                let o = out::<f32>(s, ids.len() * c)?;
                cu::embedding_fwd(s, &i, &t, &o)?;
                let (g, d) = (D::from_slice(s, grad0, &[v, c])?, up(s, dout)?);
                cu::embedding_bwd(s, &i, &d, &g)?;
                Ok((down(s, &o)?, down(s, &g)?))
            }
        )
    }
}
