//! Causal multi-head self-attention (GPT-2's `CausalSelfAttention`), on the device of its
//! parameters: two projections, per-head products without the masked half
//! ([`crate::ops::causal`]) and a causal softmax ([`crate::ops::attention`]).

use super::{ChildVisitor, Context, InitKey, Linear, Module};
use crate::error::{Error, Result};
use crate::ops::{self, CausalProduct, HeadDims};
use crate::tensor::Tensor;

/// Input `(B, T, C)` f32 -> output `(B, T, C)`. `c_attn: Linear(C, 3C)` makes q, k, v;
/// heads `H` of width `C / H`; scores scaled by `1 / sqrt(C / H)` with a causal mask
/// (position t sees 0..=t); `c_proj: Linear(C, C)`. Same math as
/// `F.scaled_dot_product_attention(q, k, v, is_causal=True)`; in bf16/f16 (a `param_dtype`
/// module under mixed precision) the attention is one op, [`ops::sdpa_causal`], rounded as
/// PyTorch's CPU flash-attention kernel rounds it.
pub struct CausalSelfAttention {
    /// Input projection `Linear(C, 3C)` producing q, k, v concatenated on the last dim
    /// (`attn.c_attn` in GPT-2); weight `(3C, C)`, bias `(3C)`.
    pub c_attn: Box<dyn Module>,
    /// Output projection `Linear(C, C)` applied after the heads are merged
    /// (`attn.c_proj` in GPT-2); weight `(C, C)`, bias `(C)`.
    pub c_proj: Box<dyn Module>,
    n_head: usize,
    n_embd: usize,
    /// What backward needs, on the input's device.
    saved: Option<Saved>,
}

/// What backward needs: q, k, v `(B, H, T, hd)` (op by op) or the projection `qkv (B, T,
/// 3C)` (the CPU's per-head path), the probabilities `(B, H, T, T)`, and the dims; or, in
/// bf16/f16, what [`ops::sdpa_causal_backward`] needs.
enum Saved {
    Heads {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        p: Tensor,
        d: HeadDims,
    },
    Fused {
        qkv: Tensor,
        p: Tensor,
        d: HeadDims,
    },
    /// bf16/f16 ([`ops::sdpa_causal`]): the heads, the output and its row log-sum-exps.
    Sdpa {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        d: HeadDims,
    },
}

/// Whether the bf16/f16 attention of `qkv` runs as one op ([`ops::sdpa_causal`], PyTorch's
/// `scaled_dot_product_attention` rounding): a 16-bit `qkv` (a `param_dtype` module) of
/// heads the device's kernel takes.
fn one_op(qkv: &Tensor, d: HeadDims) -> bool {
    matches!(
        qkv.dtype(),
        crate::tensor::DType::BF16 | crate::tensor::DType::F16
    ) && ops::sdpa_supported(qkv.device(), d)
}

/// Whether the CPU's per-head attention ([`crate::backend::cpu::attention`], the same bits
/// as the op-by-op path) runs on `qkv`: f32 on the CPU outside autocast (whose operands are
/// rounded copies).
fn fused(qkv: &Tensor) -> bool {
    qkv.device() == crate::backend::Device::Cpu
        && qkv.dtype() == crate::tensor::DType::F32
        && ops::gemm_dtype().is_none()
}

impl CausalSelfAttention {
    /// `n_embd` must be divisible by `n_head`. Projections init N(0, 0.02^2), zero bias.
    pub fn new(n_embd: usize, n_head: usize, key: &InitKey) -> Result<Self> {
        if n_head == 0 || n_embd % n_head != 0 {
            crate::error::bail_arg!(
                "n_embd {n_embd} must be a positive multiple of n_head {n_head}"
            );
        }
        Ok(CausalSelfAttention {
            c_attn: Box::new(Linear::new_normal(
                n_embd,
                3 * n_embd,
                true,
                0.02,
                &key.child("c_attn"),
            )?),
            c_proj: Box::new(Linear::new_normal(
                n_embd,
                n_embd,
                true,
                0.02,
                &key.child("c_proj"),
            )?),
            n_head,
            n_embd,
            saved: None,
        })
    }

    fn head_dims(&self, b: usize, t: usize) -> HeadDims {
        HeadDims {
            b,
            t,
            h: self.n_head,
            hd: self.n_embd / self.n_head,
        }
    }

    /// `1 / sqrt(hd)`, the score scale.
    fn scale(&self) -> f32 {
        1.0 / ((self.n_embd / self.n_head) as f32).sqrt()
    }

    /// `1 / sqrt(hd)` in f64 (a float64 module's score scale).
    fn scale_f64(&self) -> f64 {
        1.0 / ((self.n_embd / self.n_head) as f64).sqrt()
    }

    fn dims(&self, x: &Tensor, op: &'static str) -> Result<(usize, usize)> {
        match x.shape() {
            [b, t, c] if *c == self.n_embd => Ok((*b, *t)),
            s => Err(Error::ShapeMismatch {
                op,
                expected: vec![0, 0, self.n_embd],
                got: s.to_vec(),
            }),
        }
    }
}

impl CausalSelfAttention {
    /// The backward; with `defer`, `c_proj`'s bias gradient is left to the caller when
    /// `c_proj` is a plain [`Linear`](super::Linear) with a bias that takes one: its gradient
    /// tensor is returned, for the caller to add the column sums of `dout` into.
    fn backward_inner(
        &mut self,
        dout: &Tensor,
        cx: &Context,
        defer: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let saved = self.saved.take().ok_or(Error::NoSavedForward {
            module: "CausalSelfAttention",
        })?;
        let (dy, db) = match defer {
            true => super::linear::backward_deferring_bias(&mut self.c_proj, dout, cx)?,
            false => (self.c_proj.backward(dout, cx)?, None),
        };
        self.backward_heads(saved, dy, cx).map(|dx| (dx, db))
    }

    /// [`Module::backward`] without `c_proj`'s bias gradient, when it can be deferred
    /// (see `backward_inner`): returns the input gradient and that bias's gradient
    /// tensor, to which the caller must add the column sums of `dout`
    /// ([`crate::ops::bias_grad`]; the GPT block adds them in its `ln_1`'s backward kernel).
    pub(crate) fn backward_deferring_proj_bias(
        &mut self,
        dout: &Tensor,
        cx: &Context,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.backward_inner(dout, cx, true)
    }

    /// The backward from `c_proj`'s input gradient `dy` to the block input's.
    fn backward_heads(&mut self, saved: Saved, dy: Tensor, cx: &Context) -> Result<Tensor> {
        let (q, k, v, p, d) = match saved {
            Saved::Heads { q, k, v, p, d } => (q, k, v, p, d),
            Saved::Sdpa {
                q,
                k,
                v,
                out,
                lse,
                d,
            } => {
                let dyh = ops::split_heads(&dy, d)?;
                drop(dy);
                let [dq, dk, dv] = ops::sdpa_causal_backward((&q, &k, &v), &out, &lse, &dyh, d)?;
                drop((q, k, v, out, lse, dyh));
                let dqkv = ops::merge_qkv(&dq, &dk, &dv, d)?;
                return self.c_attn.backward(&dqkv, cx);
            }
            Saved::Fused { qkv, p, d } => {
                let dqkv = ops::output(qkv.shape(), qkv.device())?;
                crate::backend::cpu::attention::backward(
                    &qkv.f32()?,
                    &p.f32()?,
                    &dy.f32()?,
                    &mut dqkv.f32_mut()?,
                    d,
                    self.scale(),
                )?;
                drop((qkv, p, dy));
                return self.c_attn.backward(&dqkv, cx);
            }
        };
        let (t, hd) = (d.t, d.hd);
        let dyh = ops::split_heads(&dy, d)?;
        drop(dy);
        // dP (T, T) = dy_h (T, hd) @ v^T ; dv (T, hd) = P^T @ dy_h
        let dp = ops::output_like(&[d.b, d.h, t, t], &dyh)?;
        ops::causal_matmul(&dp, &dyh, &v, CausalProduct::Scores, d)?;
        let dv = ops::output_like(&[d.b, d.h, t, hd], &dyh)?;
        ops::causal_matmul(&dv, &p, &dyh, CausalProduct::LowerT, d)?;
        // softmax backward, with the score scale folded in: dS = P * (dP - <P, dP>) * scale
        if p.dtype() == crate::tensor::DType::F64 {
            ops::attention::softmax_causal_backward_f64_(&p, &dp, t, self.scale_f64())?;
        } else {
            ops::softmax_causal_backward_(&p, &dp, t, self.scale())?;
        }
        // dq = dS @ k ; dk = dS^T @ q
        let dq = ops::output_like(&[d.b, d.h, t, hd], &dyh)?;
        ops::causal_matmul(&dq, &dp, &k, CausalProduct::Lower, d)?;
        let dk = ops::output_like(&[d.b, d.h, t, hd], &dyh)?;
        ops::causal_matmul(&dk, &dp, &q, CausalProduct::LowerT, d)?;
        let dqkv = ops::merge_qkv(&dq, &dk, &dv, d)?;
        self.c_attn.backward(&dqkv, cx)
    }
}

impl Module for CausalSelfAttention {
    fn type_name(&self) -> &str {
        "CausalSelfAttention"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let (b, t) = self.dims(x, "CausalSelfAttention.forward")?;
        let d = self.head_dims(b, t);
        let qkv = self.c_attn.forward(x, cx)?;
        if fused(&qkv) {
            let y = ops::output(&[b, t, self.n_embd], x.device())?;
            let p = ops::output(&[b, self.n_head, t, t], x.device())?;
            crate::backend::cpu::attention::forward(
                &qkv.f32()?,
                &mut y.f32_mut()?,
                &mut p.f32_mut()?,
                d,
                self.scale(),
            )?;
            if cx.grad_enabled {
                self.saved = Some(Saved::Fused { qkv, p, d });
            }
            return self.c_proj.forward(&y, cx);
        }
        let [q, k, v] = ops::split_qkv(&qkv, d)?;
        if one_op(&qkv, d) {
            drop(qkv);
            let (yh, lse) = ops::sdpa_causal(&q, &k, &v, d)?;
            let y = ops::merge_heads(&yh, d)?;
            if cx.grad_enabled {
                self.saved = Some(Saved::Sdpa {
                    q,
                    k,
                    v,
                    out: yh,
                    lse,
                    d,
                });
            }
            return self.c_proj.forward(&y, cx);
        }
        drop(qkv);
        // Per head (B*H products): scores (T, T) = q (T, hd) @ k^T; P = causal softmax;
        // y_h (T, hd) = P @ v.
        let scores = ops::output_like(&[b, self.n_head, t, t], &q)?;
        ops::causal_matmul(&scores, &q, &k, CausalProduct::Scores, d)?;
        let p = if scores.dtype() == crate::tensor::DType::F64 {
            // A float64 module scales by 1 / sqrt(hd) in f64.
            ops::attention::softmax_causal_f64(&scores, t, self.scale_f64())?
        } else {
            ops::softmax_causal(&scores, t, self.scale())?
        };
        drop(scores);
        let yh = ops::output_like(&[b, self.n_head, t, d.hd], &p)?;
        ops::causal_matmul(&yh, &p, &v, CausalProduct::Lower, d)?;
        let y = ops::merge_heads(&yh, d)?;
        if cx.grad_enabled {
            self.saved = Some(Saved::Heads { q, k, v, p, d });
        }
        self.c_proj.forward(&y, cx)
    }

    fn backward(&mut self, dout: &Tensor, cx: &Context) -> Result<Tensor> {
        self.backward_inner(dout, cx, false).map(|(dx, _)| dx)
    }

    /// Itself: the GPT block reaches it to defer `c_proj`'s bias gradient
    /// (`backward_deferring_proj_bias`).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        match &self.saved {
            Some(Saved::Heads { q, k, v, p, .. }) => {
                out.extend([q.clone(), k.clone(), v.clone(), p.clone()])
            }
            Some(Saved::Fused { qkv, p, .. }) => out.extend([qkv.clone(), p.clone()]),
            Some(Saved::Sdpa {
                q,
                k,
                v,
                out: o,
                lse,
                ..
            }) => out.extend([q.clone(), k.clone(), v.clone(), o.clone(), lse.clone()]),
            None => {}
        }
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("c_attn", &mut self.c_attn)?;
        f("c_proj", &mut self.c_proj)
    }
    fn for_each_param(&mut self, f: &mut super::ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }
}
