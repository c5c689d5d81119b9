//! `Embedding`: a lookup table (`torch.nn.Embedding`), plus the lookup and its gradient as
//! free functions that the GPT uses on its tied token embedding.

use super::{Context, InitKey, Module, Parameter};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `out[.., :] = table[ids[..], :]`; `table: (V, C)` f32, `ids` i32 of any shape.
///
/// # Errors
/// `InvalidArgument` naming the first id outside `0..V`.
pub fn embedding_lookup(table: &Tensor, ids: &[i32]) -> Result<Vec<f32>> {
    let (v, c) = (table.shape()[0], table.shape()[1]);
    let t = table.f32()?;
    let mut out = vec![0.0f32; ids.len() * c];
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= v {
            crate::error::bail_arg!(
                "embedding: token id {id} at position {i} is outside the vocabulary 0..{v}"
            );
        }
        let id = id as usize;
        out[i * c..(i + 1) * c].copy_from_slice(&t[id * c..(id + 1) * c]);
    }
    Ok(out)
}

/// `grad[ids[i], :] += dout[i, :]` (accumulate; repeated ids add up).
pub fn embedding_backward(grad: &mut [f32], ids: &[i32], dout: &[f32], c: usize) {
    for (i, &id) in ids.iter().enumerate() {
        let g = &mut grad[id as usize * c..(id as usize + 1) * c];
        crate::backend::cpu::ops::add_(g, &dout[i * c..(i + 1) * c]);
    }
}

/// Lookup table `weight: (num_embeddings, dim)`, init N(0, 1) as PyTorch. Input i32 ids of
/// any shape `S`; output `(S.., dim)` f32; backward returns an empty tensor (ids have no
/// gradient).
pub struct Embedding {
    /// The table `(num_embeddings, dim)` f32 (`nn.Embedding.weight`); row `i` is the
    /// vector of id `i`.
    pub weight: Parameter,
    saved_ids: Option<Tensor>,
}

impl Embedding {
    /// `Embedding(num_embeddings, dim)` with N(0, std^2) init (PyTorch default std 1).
    pub fn new(num_embeddings: usize, dim: usize, std: f32, key: &InitKey) -> Result<Self> {
        Ok(Embedding {
            weight: Parameter::new("weight", key.normal("weight", &[num_embeddings, dim], std)?),
            saved_ids: None,
        })
    }
}

impl Module for Embedding {
    fn type_name(&self) -> &'static str {
        "Embedding"
    }
    fn forward(&mut self, ids: &Tensor, cx: &Context) -> Result<Tensor> {
        let w = self.weight.data()?;
        let out = embedding_lookup(w, &ids.data::<i32>()?)?;
        let mut shape = ids.shape().to_vec();
        shape.push(w.shape()[1]);
        if cx.grad_enabled {
            self.saved_ids = Some(ids.clone());
        }
        Tensor::from_vec(out, &shape)
    }
    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let ids = self.saved_ids.take().ok_or(Error::NoSavedForward {
            module: "Embedding",
        })?;
        let c = self.weight.shape()[1];
        if let Some(g) = self.weight.grad_for_accumulate() {
            embedding_backward(&mut g.f32_mut()?, &ids.data::<i32>()?, &dy.f32()?, c);
        }
        Ok(Tensor::zeros(&[0], crate::tensor::DType::F32))
    }
    fn for_each_param(&mut self, f: &mut dyn FnMut(&str, &mut Parameter)) {
        f("weight", &mut self.weight);
    }
}
