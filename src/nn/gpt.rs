//! A GPT-2 style decoder: token + position embeddings, `n_layer` blocks, final LayerNorm,
//! and an output projection tied to the token embedding (nanoGPT / llm.c's `train_gpt2.c`),
//! on the device of its parameters (token ids on the same device).

use super::{Block, ChildVisitor, Context, InitKey, LayerNorm, Module, ParamVisitor, Parameter};
use crate::error::{Error, Result};
use crate::ops::{self, MatmulDims, Transpose};
use crate::tensor::{DType, Tensor};

/// Shape of a [`GPT`]. [`GptConfig::gpt2_124m`] is GPT-2 small.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Token vocabulary `V` (256 for bytes).
    pub vocab_size: usize,
    /// Longest sequence `T` (rows of the position embedding).
    pub block_size: usize,
    /// Number of transformer [`Block`]s.
    pub n_layer: usize,
    /// Attention heads per block `H`; must divide `n_embd`.
    pub n_head: usize,
    /// Width `C`.
    pub n_embd: usize,
}

impl GptConfig {
    /// GPT-2 small ("124M"): 12 layers, width 768, 12 heads, block size 1024 (OpenAI's
    /// `gpt2` checkpoint, nanoGPT's `gpt2` preset). `vocab_size` is the tokenizer's: 256 for
    /// bytes, 50257 for the GPT-2 BPE (124M parameters with the tied embedding counted once).
    pub fn gpt2_124m(vocab_size: usize) -> GptConfig {
        GptConfig {
            vocab_size,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
        }
    }
}

/// Input i32 token ids `(B, T)`, `T <= block_size`; output f32 logits `(B, T, V)`. An
/// empty batch (`B = 0` or `T = 0`) gives empty logits and leaves the gradients unchanged,
/// as nanoGPT's model does.
/// Parameters: `wte.weight (V, C)` (also the output projection), `wpe.weight (block_size,
/// C)`, `blocks.{i}.*`, `ln_f.*`. Embeddings and projections init N(0, 0.02^2).
pub struct GPT {
    /// The shape the model was built with.
    pub config: GptConfig,
    /// Token embedding `wte.weight (V, C)` f32, tied: also the output projection
    /// (`logits = h @ wte^T`).
    pub wte: Parameter,
    /// Learned position embedding `wpe.weight (block_size, C)` f32.
    pub wpe: Parameter,
    /// The `n_layer` transformer blocks, named `blocks.{i}`; each is boxed so auto-wrap can
    /// replace it with an FSDP unit (one unit per block under
    /// `transformer_auto_wrap_policy(["Block"])`).
    pub blocks: Vec<Box<dyn Module>>,
    /// Final [`LayerNorm`]`(C)` before the output projection (`ln_f`).
    pub ln_f: Box<dyn Module>,
    block_names: Vec<String>,
    /// (ids (B, T), final hidden (B*T, C))
    saved: Option<(Tensor, Tensor)>,
}

impl GPT {
    /// A model of `config` whose initial values depend only on `seed` (see [`InitKey`]).
    ///
    /// # Errors
    /// `InvalidArgument` for zero sizes or `n_embd` not divisible by `n_head`.
    pub fn new(config: GptConfig, seed: u64) -> Result<Self> {
        let GptConfig {
            vocab_size,
            block_size,
            n_layer,
            n_head,
            n_embd,
        } = config;
        if vocab_size == 0 || block_size == 0 || n_embd == 0 {
            crate::error::bail_arg!("GPT sizes must be positive: {config:?}");
        }
        let key = InitKey::new(seed);
        let blocks = (0..n_layer)
            .map(|i| {
                Block::new(n_embd, n_head, &key.child(&format!("blocks.{i}")))
                    .map(|b| Box::new(b) as Box<dyn Module>)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GPT {
            config,
            wte: Parameter::new(
                "wte.weight",
                key.normal("wte.weight", &[vocab_size, n_embd], 0.02)?,
            ),
            wpe: Parameter::new(
                "wpe.weight",
                key.normal("wpe.weight", &[block_size, n_embd], 0.02)?,
            ),
            blocks,
            ln_f: Box::new(LayerNorm::new(n_embd)?),
            block_names: (0..n_layer).map(|i| format!("blocks.{i}")).collect(),
            saved: None,
        })
    }
}

impl Module for GPT {
    fn type_name(&self) -> &str {
        "GPT"
    }

    fn forward(&mut self, ids: &Tensor, cx: &Context) -> Result<Tensor> {
        let GptConfig {
            vocab_size: v,
            block_size,
            n_embd: c,
            ..
        } = self.config;
        let (b, t) = match ids.shape() {
            [b, t] if ids.dtype() == DType::I32 && *t <= block_size => (*b, *t),
            s => {
                crate::error::bail_arg!(
                    "GPT.forward takes i32 token ids (B, T) with T <= {block_size}, got {s:?} {}",
                    ids.dtype()
                )
            }
        };
        let wte = self.wte.data()?;
        // x (B, T, C) = wte[ids] + wpe[0..T], the position rows added to every sequence.
        let x = ops::embedding(wte, ids)?;
        ops::bias_add_(
            &x.reshape(&[b, t * c])?,
            &self.wpe.data()?.view(0, &[t * c])?,
        )?;
        let mut h = x.reshape(&[b, t, c])?;
        for blk in &mut self.blocks {
            h = blk.forward(&h, cx)?;
        }
        let h = self.ln_f.forward(&h, cx)?;
        // logits (B*T, V) = h (B*T, C) @ wte^T, wte stored (V, C)
        let logits = ops::output_like(&[b, t, v], &h)?;
        ops::matmul(
            &logits,
            &h,
            self.wte.data()?,
            MatmulDims::new(b * t, c, v, Transpose::NT),
            false,
        )?;
        if cx.grad_enabled {
            self.saved = Some((ids.clone(), h));
        }
        Ok(logits)
    }

    fn backward(&mut self, dlogits: &Tensor, cx: &Context) -> Result<Tensor> {
        let (ids, h) = self
            .saved
            .take()
            .ok_or(Error::NoSavedForward { module: "GPT" })?;
        let GptConfig {
            vocab_size: v,
            n_embd: c,
            ..
        } = self.config;
        let (b, t) = (ids.shape()[0], ids.shape()[1]);
        if dlogits.shape() != [b, t, v] {
            return Err(Error::ShapeMismatch {
                op: "GPT.backward",
                expected: vec![b, t, v],
                got: dlogits.shape().to_vec(),
            });
        }
        let n = b * t;
        // dh (N, C) = dlogits (N, V) @ wte (V, C)
        let dh = ops::output_like(&[b, t, c], &h)?;
        ops::matmul(
            &dh,
            dlogits,
            self.wte.data()?,
            MatmulDims::new(n, v, c, Transpose::NN),
            false,
        )?;
        if let Some(g) = self.wte.grad_for_accumulate()? {
            // dwte (V, C) += dlogits^T (V, N) @ h (N, C)
            ops::matmul(
                g,
                dlogits,
                &h,
                MatmulDims::new(v, n, c, Transpose::TN),
                true,
            )?;
        }
        drop(h);
        let mut g = self.ln_f.backward(&dh, cx)?;
        for blk in self.blocks.iter_mut().rev() {
            g = blk.backward(&g, cx)?;
        }
        if let Some(gw) = self.wpe.grad_for_accumulate()? {
            // dwpe[0..T] += the position rows of dx summed over the batch
            ops::bias_grad(&g.reshape(&[b, t * c])?, &gw.view(0, &[t * c])?)?;
        }
        if let Some(gw) = self.wte.grad_for_accumulate()? {
            ops::embedding_backward(&ids, &g, gw)?;
        }
        Tensor::zeros_on(&[0], DType::F32, ids.device())
    }

    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        if let Some((ids, h)) = &self.saved {
            out.extend([ids.clone(), h.clone()]);
        }
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("wte.weight", &mut self.wte)?;
        f("wpe.weight", &mut self.wpe)
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        for (name, blk) in self.block_names.iter().zip(self.blocks.iter_mut()) {
            f(name, blk)?;
        }
        f("ln_f", &mut self.ln_f)
    }
}
