//! A GPT-2 style decoder: token + position embeddings, `n_layer` blocks, final LayerNorm,
//! and an output projection tied to the token embedding (nanoGPT / llm.c's `train_gpt2.c`).

use super::embedding::{embedding_backward, embedding_lookup};
use super::{Block, ChildVisitor, Context, InitKey, LayerNorm, Module, Parameter};
use crate::backend::cpu::gemm::{matmul, Transpose};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Shape of a [`GPT`].
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

/// Input i32 token ids `(B, T)`, `T <= block_size`; output f32 logits `(B, T, V)`.
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
    fn type_name(&self) -> &'static str {
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
            [b, t] if ids.dtype() == DType::I32 && *t <= block_size && *t > 0 => (*b, *t),
            s => {
                crate::error::bail_arg!(
                    "GPT.forward takes i32 token ids (B, T) with 0 < T <= {block_size}, got {s:?} {}",
                    ids.dtype()
                )
            }
        };
        let idv = ids.data::<i32>()?;
        let mut x = embedding_lookup(self.wte.data()?, &idv)?;
        drop(idv);
        {
            let wpe = self.wpe.data()?.f32()?;
            for (i, row) in x.chunks_exact_mut(c).enumerate() {
                crate::backend::cpu::ops::add_(row, &wpe[(i % t) * c..(i % t + 1) * c]);
            }
        }
        let mut h = Tensor::from_vec(x, &[b, t, c])?;
        for blk in &mut self.blocks {
            h = blk.forward(&h, cx)?;
        }
        let h = self.ln_f.forward(&h, cx)?;
        // logits (B*T, V) = h (B*T, C) @ wte^T, wte stored (V, C)
        let mut logits = vec![0.0f32; b * t * v];
        matmul(
            &mut logits,
            &h.f32()?,
            &self.wte.data()?.f32()?,
            b * t,
            c,
            v,
            Transpose::NT,
            false,
        )?;
        if cx.grad_enabled {
            self.saved = Some((ids.clone(), h));
        }
        Tensor::from_vec(logits, &[b, t, v])
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
        let dl = dlogits.f32()?;
        // dh (N, C) = dlogits (N, V) @ wte (V, C)
        let mut dh = vec![0.0f32; n * c];
        matmul(
            &mut dh,
            &dl,
            &self.wte.data()?.f32()?,
            n,
            v,
            c,
            Transpose::NN,
            false,
        )?;
        if let Some(g) = self.wte.grad_for_accumulate() {
            // dwte (V, C) += dlogits^T (V, N) @ h (N, C)
            matmul(
                &mut g.f32_mut()?,
                &dl,
                &h.f32()?,
                v,
                n,
                c,
                Transpose::TN,
                true,
            )?;
        }
        drop(dl);
        let mut g = self.ln_f.backward(&Tensor::from_vec(dh, &[b, t, c])?, cx)?;
        for blk in self.blocks.iter_mut().rev() {
            g = blk.backward(&g, cx)?;
        }
        let dx = g.f32()?;
        if let Some(gw) = self.wpe.grad_for_accumulate() {
            let mut gw = gw.f32_mut()?;
            for (i, row) in dx.chunks_exact(c).enumerate() {
                crate::backend::cpu::ops::add_(&mut gw[(i % t) * c..(i % t + 1) * c], row);
            }
        }
        if let Some(gw) = self.wte.grad_for_accumulate() {
            embedding_backward(&mut gw.f32_mut()?, &ids.data::<i32>()?, &dx, c);
        }
        Ok(Tensor::zeros(&[0], DType::F32))
    }

    fn for_each_param(&mut self, f: &mut dyn FnMut(&str, &mut Parameter)) {
        f("wte.weight", &mut self.wte);
        f("wpe.weight", &mut self.wpe);
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        for (name, blk) in self.block_names.iter().zip(self.blocks.iter_mut()) {
            f(name, blk)?;
        }
        f("ln_f", &mut self.ln_f)
    }
}
