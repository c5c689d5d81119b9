//! Causal multi-head self-attention (GPT-2's `CausalSelfAttention`).

use super::{ChildVisitor, Context, InitKey, Linear, Module};
use crate::backend::cpu::gemm::{matmul, Transpose};
use crate::backend::cpu::ops::exp;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Input `(B, T, C)` f32 -> output `(B, T, C)`. `c_attn: Linear(C, 3C)` makes q, k, v;
/// heads `H` of width `C / H`; scores scaled by `1 / sqrt(C / H)` with a causal mask
/// (position t sees 0..=t); `c_proj: Linear(C, C)`. Same math as
/// `F.scaled_dot_product_attention(q, k, v, is_causal=True)`.
pub struct CausalSelfAttention {
    /// Input projection `Linear(C, 3C)` producing q, k, v concatenated on the last dim
    /// (`attn.c_attn` in GPT-2); weight `(3C, C)`, bias `(3C)`.
    pub c_attn: Box<dyn Module>,
    /// Output projection `Linear(C, C)` applied after the heads are merged
    /// (`attn.c_proj` in GPT-2); weight `(C, C)`, bias `(C)`.
    pub c_proj: Box<dyn Module>,
    n_head: usize,
    n_embd: usize,
    /// q, k, v as (B, H, T, hd), probabilities (B, H, T, T), and (B, T).
    saved: Option<Saved>,
}

struct Saved {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    p: Vec<f32>,
    b: usize,
    t: usize,
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

impl Module for CausalSelfAttention {
    fn type_name(&self) -> &'static str {
        "CausalSelfAttention"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let (b, t) = self.dims(x, "CausalSelfAttention.forward")?;
        let (c, h) = (self.n_embd, self.n_head);
        let hd = c / h;
        let qkv = self.c_attn.forward(x, cx)?;
        let qkv = qkv.f32()?;
        // qkv (B, T, 3C) -> q, k, v (B, H, T, hd)
        let n = b * h * t * hd;
        let (mut q, mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        for bi in 0..b {
            for ti in 0..t {
                let row = &qkv[(bi * t + ti) * 3 * c..(bi * t + ti + 1) * 3 * c];
                for hi in 0..h {
                    let dst = ((bi * h + hi) * t + ti) * hd;
                    q[dst..dst + hd].copy_from_slice(&row[hi * hd..(hi + 1) * hd]);
                    k[dst..dst + hd].copy_from_slice(&row[c + hi * hd..c + (hi + 1) * hd]);
                    v[dst..dst + hd].copy_from_slice(&row[2 * c + hi * hd..2 * c + (hi + 1) * hd]);
                }
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut p = vec![0.0f32; b * h * t * t];
        let mut y = vec![0.0f32; b * t * c];
        let mut yh = vec![0.0f32; t * hd];
        for bh in 0..b * h {
            let (qs, ks, vs) = (
                &q[bh * t * hd..][..t * hd],
                &k[bh * t * hd..][..t * hd],
                &v[bh * t * hd..][..t * hd],
            );
            let ps = &mut p[bh * t * t..][..t * t];
            // scores (T, T) = q (T, hd) @ k^T
            matmul(ps, qs, ks, t, hd, t, Transpose::NT, false)?;
            for i in 0..t {
                let row = &mut ps[i * t..(i + 1) * t];
                let max = row[..=i]
                    .iter()
                    .fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
                let mut sum = 0.0f32;
                for s in row[..=i].iter_mut() {
                    *s = exp(*s * scale - max);
                    sum += *s;
                }
                let inv = 1.0 / sum;
                row[..=i].iter_mut().for_each(|s| *s *= inv);
                row[i + 1..].fill(0.0);
            }
            // y_h (T, hd) = P (T, T) @ v (T, hd)
            matmul(&mut yh, ps, vs, t, t, hd, Transpose::NN, false)?;
            let (bi, hi) = (bh / h, bh % h);
            for ti in 0..t {
                y[(bi * t + ti) * c + hi * hd..][..hd].copy_from_slice(&yh[ti * hd..(ti + 1) * hd]);
            }
        }
        if cx.grad_enabled {
            self.saved = Some(Saved { q, k, v, p, b, t });
        }
        let y = Tensor::from_vec(y, &[b, t, c])?;
        self.c_proj.forward(&y, cx)
    }

    fn backward(&mut self, dout: &Tensor, cx: &Context) -> Result<Tensor> {
        let s = self.saved.take().ok_or(Error::NoSavedForward {
            module: "CausalSelfAttention",
        })?;
        let (b, t) = (s.b, s.t);
        let (c, h) = (self.n_embd, self.n_head);
        let hd = c / h;
        let scale = 1.0 / (hd as f32).sqrt();
        let dy = self.c_proj.backward(dout, cx)?;
        let dy = dy.f32()?;
        let mut dqkv = vec![0.0f32; b * t * 3 * c];
        let (mut dyh, mut dp) = (vec![0.0f32; t * hd], vec![0.0f32; t * t]);
        let (mut dq, mut dk, mut dv) = (
            vec![0.0f32; t * hd],
            vec![0.0f32; t * hd],
            vec![0.0f32; t * hd],
        );
        for bh in 0..b * h {
            let (bi, hi) = (bh / h, bh % h);
            for ti in 0..t {
                dyh[ti * hd..(ti + 1) * hd]
                    .copy_from_slice(&dy[(bi * t + ti) * c + hi * hd..][..hd]);
            }
            let (qs, ks, vs) = (
                &s.q[bh * t * hd..][..t * hd],
                &s.k[bh * t * hd..][..t * hd],
                &s.v[bh * t * hd..][..t * hd],
            );
            let ps = &s.p[bh * t * t..][..t * t];
            // dP (T, T) = dy_h (T, hd) @ v^T ; dv (T, hd) = P^T @ dy_h
            matmul(&mut dp, &dyh, vs, t, hd, t, Transpose::NT, false)?;
            matmul(&mut dv, ps, &dyh, t, t, hd, Transpose::TN, false)?;
            // softmax backward, with the score scale folded in: dS = P * (dP - <P, dP>) * scale
            for i in 0..t {
                let (pr, dr) = (&ps[i * t..(i + 1) * t], &mut dp[i * t..(i + 1) * t]);
                let dot: f32 = pr[..=i]
                    .iter()
                    .zip(dr[..=i].iter())
                    .map(|(a, b)| a * b)
                    .sum();
                for j in 0..t {
                    dr[j] = if j <= i {
                        pr[j] * (dr[j] - dot) * scale
                    } else {
                        0.0
                    };
                }
            }
            // dq = dS @ k ; dk = dS^T @ q
            matmul(&mut dq, &dp, ks, t, t, hd, Transpose::NN, false)?;
            matmul(&mut dk, &dp, qs, t, t, hd, Transpose::TN, false)?;
            for ti in 0..t {
                let row = &mut dqkv[(bi * t + ti) * 3 * c..][..3 * c];
                row[hi * hd..][..hd].copy_from_slice(&dq[ti * hd..][..hd]);
                row[c + hi * hd..][..hd].copy_from_slice(&dk[ti * hd..][..hd]);
                row[2 * c + hi * hd..][..hd].copy_from_slice(&dv[ti * hd..][..hd]);
            }
        }
        let dqkv = Tensor::from_vec(dqkv, &[b, t, 3 * c])?;
        self.c_attn.backward(&dqkv, cx)
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("c_attn", &mut self.c_attn)?;
        f("c_proj", &mut self.c_proj)
    }
}
