//! The GPT-2 transformer block: `x + attn(ln_1(x))`, then `+ mlp(ln_2(.))`, on any device.

use super::{CausalSelfAttention, ChildVisitor, Context, InitKey, LayerNorm, Linear, Module, GELU};
use crate::error::Result;
use crate::ops::add;
use crate::tensor::Tensor;

/// `c_fc: Linear(C, 4C)` -> GELU -> `c_proj: Linear(4C, C)`; input and output `(.., C)`.
pub struct MLP {
    /// Expansion `Linear(C, 4C)` (`mlp.c_fc` in GPT-2).
    pub c_fc: Box<dyn Module>,
    /// The exact (erf) [`GELU`] between the projections (`nn.GELU()`, `approximate='none'`).
    pub gelu: Box<dyn Module>,
    /// Contraction `Linear(4C, C)` (`mlp.c_proj` in GPT-2).
    pub c_proj: Box<dyn Module>,
}

impl MLP {
    /// Weights N(0, 0.02^2), zero biases.
    pub fn new(n_embd: usize, key: &InitKey) -> Result<Self> {
        Ok(MLP {
            c_fc: Box::new(Linear::new_normal(
                n_embd,
                4 * n_embd,
                true,
                0.02,
                &key.child("c_fc"),
            )?),
            gelu: Box::new(GELU::new()),
            c_proj: Box::new(Linear::new_normal(
                4 * n_embd,
                n_embd,
                true,
                0.02,
                &key.child("c_proj"),
            )?),
        })
    }
}

impl MLP {
    /// `gelu` and `c_fc` when they are a plain [`GELU`] and [`Linear`] (not wrapped), whose
    /// passes the MLP can fuse.
    fn plain_gelu_fc(&mut self) -> Option<(&mut GELU, &mut Linear)> {
        let gelu = self.gelu.as_any_mut()?.downcast_mut::<GELU>()?;
        let fc = self.c_fc.as_any_mut()?.downcast_mut::<Linear>()?;
        Some((gelu, fc))
    }

    /// GELU's backward and `c_fc`'s bias gradient in one pass
    /// ([`crate::ops::gelu_backward_bias_grad`]), then the rest of `c_fc`'s backward, when
    /// `gelu` is a [`GELU`], `c_fc` a [`Linear`] with a bias that takes a gradient, and the
    /// fused pass applies (CPU, f32, one intra-op thread; CUDA, f32 or f64: one kernel).
    /// `None`, with nothing changed, otherwise. Same bits as the two modules' backwards.
    fn fused_gelu_fc_backward(&mut self, g: &Tensor) -> Result<Option<Tensor>> {
        let Some((gelu, fc)) = self.plain_gelu_fc() else {
            return Ok(None);
        };
        let (Some(x), Some(bias)) = (gelu.saved_input(), fc.bias.as_mut()) else {
            return Ok(None);
        };
        let Some(db) = bias.grad_for_accumulate()? else {
            return Ok(None);
        };
        let Some(dh) = crate::ops::gelu_backward_bias_grad(x, g, db)? else {
            return Ok(None);
        };
        gelu.clear_saved();
        fc.backward_inner(&dh, false).map(Some)
    }
}

impl MLP {
    /// `c_fc`'s product, then its bias and the GELU in one pass ([`crate::ops::bias_gelu_`],
    /// one kernel), when `gelu` is a [`GELU`], `c_fc` a [`Linear`] with a bias and the
    /// tensors qualify ([`crate::ops::bias_gelu_fusable`]: CUDA, f32 or f64). `None`, with
    /// nothing run, otherwise. Same bits as the two modules' forwards.
    fn fused_fc_gelu_forward(&mut self, x: &Tensor, cx: &Context) -> Result<Option<Tensor>> {
        let Some((gelu, fc)) = self.plain_gelu_fc() else {
            return Ok(None);
        };
        let Some(bias) = fc.bias.as_ref() else {
            return Ok(None);
        };
        let b = bias.data()?.clone();
        if !crate::ops::bias_gelu_fusable(x, fc.weight.data()?, &b) {
            return Ok(None);
        }
        let h = fc.forward_inner(x, cx, false)?;
        let y = crate::ops::bias_gelu_(&h, &b)?;
        gelu.save_input(&h, cx);
        Ok(Some(y))
    }
}

impl MLP {
    /// [`Module::backward`] without `c_proj`'s bias gradient when `c_proj` is a plain
    /// [`Linear`] with a bias that takes one: returns the input gradient and that bias's
    /// gradient tensor, to which the caller must add the column sums of `dy`
    /// ([`crate::ops::bias_grad`]; the GPT block adds them in its `ln_2`'s backward kernel).
    pub(crate) fn backward_deferring_proj_bias(
        &mut self,
        dy: &Tensor,
        cx: &Context,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (g, db) = super::linear::backward_deferring_bias(&mut self.c_proj, dy, cx)?;
        Ok((self.backward_from_proj(&g, cx)?, db))
    }

    /// The backward from `c_proj`'s input gradient `g`.
    fn backward_from_proj(&mut self, g: &Tensor, cx: &Context) -> Result<Tensor> {
        if let Some(dx) = self.fused_gelu_fc_backward(g)? {
            return Ok(dx);
        }
        let g = self.gelu.backward(g, cx)?;
        self.c_fc.backward(&g, cx)
    }
}

impl Module for MLP {
    fn type_name(&self) -> &str {
        "MLP"
    }
    /// Itself: the GPT block reaches it to defer `c_proj`'s bias gradient
    /// (`MLP::backward_deferring_proj_bias`).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let h = match self.fused_fc_gelu_forward(x, cx)? {
            Some(h) => h,
            None => {
                let h = self.c_fc.forward(x, cx)?;
                self.gelu.forward(&h, cx)?
            }
        };
        self.c_proj.forward(&h, cx)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        let g = self.c_proj.backward(dy, cx)?;
        self.backward_from_proj(&g, cx)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("c_fc", &mut self.c_fc)?;
        f("gelu", &mut self.gelu)?;
        f("c_proj", &mut self.c_proj)
    }
    fn for_each_param(&mut self, f: &mut super::ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }
}

/// Pre-norm transformer block (GPT-2). Input and output `(B, T, C)` f32. Its type name
/// `"Block"` is what `transformer_auto_wrap_policy` matches in `fsdp train`.
pub struct Block {
    /// [`LayerNorm`]`(C)` applied before attention.
    pub ln_1: Box<dyn Module>,
    /// [`CausalSelfAttention`] with `n_head` heads; its output is added to the input.
    pub attn: Box<dyn Module>,
    /// [`LayerNorm`]`(C)` applied before the MLP.
    pub ln_2: Box<dyn Module>,
    /// The [`MLP`] `C -> 4C -> C`; its output is added to the residual stream.
    pub mlp: Box<dyn Module>,
}

impl Block {
    /// A block of width `n_embd` with `n_head` heads.
    pub fn new(n_embd: usize, n_head: usize, key: &InitKey) -> Result<Self> {
        Ok(Block {
            ln_1: Box::new(LayerNorm::new(n_embd)?),
            attn: Box::new(CausalSelfAttention::new(
                n_embd,
                n_head,
                &key.child("attn"),
            )?),
            ln_2: Box::new(LayerNorm::new(n_embd)?),
            mlp: Box::new(MLP::new(n_embd, &key.child("mlp"))?),
        })
    }
}

/// `m` as a plain [`LayerNorm`] (not wrapped by hooks, checkpointing or FSDP), whose
/// residual adds the block can fuse in.
fn plain_layer_norm(m: &mut Box<dyn Module>) -> Option<&mut LayerNorm> {
    m.as_any_mut().and_then(|a| a.downcast_mut::<LayerNorm>())
}

impl Module for Block {
    fn type_name(&self) -> &str {
        "Block"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let h = self.ln_1.forward(x, cx)?;
        let a = self.attn.forward(&h, cx)?;
        // x1 = x + a and ln_2(x1): one kernel on CUDA when ln_2 is a plain LayerNorm.
        let (x1, h) = match plain_layer_norm(&mut self.ln_2) {
            Some(ln) => ln.forward_add(x, &a, cx)?,
            None => {
                let x1 = add(x, &a)?;
                let h = self.ln_2.forward(&x1, cx)?;
                (x1, h)
            }
        };
        add(&x1, &self.mlp.forward(&h, cx)?)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        // y = x1 + mlp(ln_2(x1)); x1 = x + attn(ln_1(x)). Each norm's backward adds the
        // residual stream's gradient, and the bias gradient of the c_proj whose output
        // gradient that is (deferred from the MLP's and the attention's backward): one
        // kernel on CUDA for a plain LayerNorm (`LayerNorm::backward_add`).
        let (g, mlp_db) = match self.mlp.as_any_mut().and_then(|a| a.downcast_mut::<MLP>()) {
            Some(m) => m.backward_deferring_proj_bias(dy, cx)?,
            None => (self.mlp.backward(dy, cx)?, None),
        };
        let dx1 = match plain_layer_norm(&mut self.ln_2) {
            Some(ln) => ln.backward_add(&g, dy, mlp_db.as_ref())?,
            None => {
                if let Some(db) = &mlp_db {
                    crate::ops::bias_grad(dy, db)?;
                }
                add(dy, &self.ln_2.backward(&g, cx)?)?
            }
        };
        let attn = self.attn.as_any_mut();
        let (g, attn_db) = match attn.and_then(|a| a.downcast_mut::<CausalSelfAttention>()) {
            Some(a) => a.backward_deferring_proj_bias(&dx1, cx)?,
            None => (self.attn.backward(&dx1, cx)?, None),
        };
        match plain_layer_norm(&mut self.ln_1) {
            Some(ln) => ln.backward_add(&g, &dx1, attn_db.as_ref()),
            None => {
                if let Some(db) = &attn_db {
                    crate::ops::bias_grad(&dx1, db)?;
                }
                add(&dx1, &self.ln_1.backward(&g, cx)?)
            }
        }
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("ln_1", &mut self.ln_1)?;
        f("attn", &mut self.attn)?;
        f("ln_2", &mut self.ln_2)?;
        f("mlp", &mut self.mlp)
    }
    fn for_each_param(&mut self, f: &mut super::ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::parallel::with_num_threads;

    fn wave(n: usize, k: f32) -> Vec<f32> {
        (0..n).map(|i| (0.37 * i as f32 + k).sin()).collect()
    }

    fn linear(m: &mut dyn Module) -> &mut Linear {
        m.as_any_mut()
            .and_then(|a| a.downcast_mut::<Linear>())
            .expect("a Linear")
    }

    /// One forward and backward of an MLP (C = 12, with a nonzero bias gradient already
    /// held, so the fused pass must add to it) under `threads` intra-op threads: the input
    /// gradient, then every parameter gradient, as bits.
    fn run(threads: usize) -> Vec<Vec<u32>> {
        with_num_threads(threads, || {
            let mut mlp = MLP::new(12, &InitKey::new(7)).unwrap();
            let held = Tensor::from_vec(wave(48, 0.5), &[48]).unwrap();
            linear(mlp.c_fc.as_mut())
                .bias
                .as_mut()
                .unwrap()
                .set_grad(Some(held));
            let cx = Context::train();
            let x = Tensor::from_vec(wave(3 * 5 * 12, 0.1), &[3, 5, 12]).unwrap();
            let y = mlp.forward(&x, &cx).unwrap();
            let dy = Tensor::from_vec(wave(y.numel(), 1.3), y.shape()).unwrap();
            let dx = mlp.backward(&dy, &cx).unwrap();
            let bits = |t: &Tensor| {
                t.to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            let mut out = vec![bits(&dx)];
            for m in [&mut mlp.c_fc, &mut mlp.c_proj] {
                let l = linear(m.as_mut());
                out.push(bits(l.weight.grad().unwrap()));
                out.push(bits(l.bias.as_ref().unwrap().grad().unwrap()));
            }
            out
        })
    }

    #[test]
    fn fused_gelu_and_bias_gradient_give_the_bits_of_the_two_passes() {
        // One intra-op thread takes the fused pass, two the two separate ops.
        let (fused, separate) = (run(1), run(2));
        assert_eq!(fused.len(), 5);
        for (i, (a, b)) in fused.iter().zip(&separate).enumerate() {
            assert_eq!(
                a, b,
                "gradient {i} differs between the fused and the two passes"
            );
        }
        // The fused op runs at one thread and declines at two.
        let x = Tensor::from_vec(wave(24, 0.2), &[2, 12]).unwrap();
        let db = Tensor::from_vec(vec![0.0f32; 12], &[12]).unwrap();
        let one = with_num_threads(1, || crate::ops::gelu_backward_bias_grad(&x, &x, &db));
        assert!(one.unwrap().is_some());
        let two = with_num_threads(2, || crate::ops::gelu_backward_bias_grad(&x, &x, &db));
        assert!(two.unwrap().is_none());
    }
}
