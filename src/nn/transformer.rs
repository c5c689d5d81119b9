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

impl Module for MLP {
    fn type_name(&self) -> &str {
        "MLP"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let h = self.c_fc.forward(x, cx)?;
        let h = self.gelu.forward(&h, cx)?;
        self.c_proj.forward(&h, cx)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        let g = self.c_proj.backward(dy, cx)?;
        let g = self.gelu.backward(&g, cx)?;
        self.c_fc.backward(&g, cx)
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

impl Module for Block {
    fn type_name(&self) -> &str {
        "Block"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let h = self.ln_1.forward(x, cx)?;
        let x1 = add(x, &self.attn.forward(&h, cx)?)?;
        let h = self.ln_2.forward(&x1, cx)?;
        add(&x1, &self.mlp.forward(&h, cx)?)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        // y = x1 + mlp(ln_2(x1)); x1 = x + attn(ln_1(x))
        let g = self.mlp.backward(dy, cx)?;
        let dx1 = add(dy, &self.ln_2.backward(&g, cx)?)?;
        let g = self.attn.backward(&dx1, cx)?;
        add(&dx1, &self.ln_1.backward(&g, cx)?)
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
