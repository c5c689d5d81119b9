//! `Embedding`: a lookup table (`torch.nn.Embedding`) on the device of its weight, plus the
//! lookup and its gradient on host slices (the CPU reference the GPT's tied token embedding
//! was first written with).

use super::{Context, InitKey, Module, ParamVisitor, Parameter};
use crate::error::{Error, Result};
use crate::ops;
use crate::tensor::{DType, Tensor};

/// `out[.., :] = table[ids[..], :]`; `table: (V, C)` f32 on the host, `ids` i32 of any
/// shape. Device tensors: [`crate::ops::embedding()`].
///
/// # Errors
/// `InvalidArgument` naming the first id outside `0..V` (also for a table of width 0);
/// `DeviceMismatch` for a table on a device; `ShapeMismatch` for a table that is not 2-D.
pub fn embedding_lookup(table: &Tensor, ids: &[i32]) -> Result<Vec<f32>> {
    let n = ids.len();
    let out = ops::embedding(table, &Tensor::from_vec(ids.to_vec(), &[n])?)?;
    out.to_vec_f32()
}

/// `grad[ids[i], :] += dout[i, :]` (accumulate; repeated ids add up, in order; ids outside
/// the table are skipped).
pub fn embedding_backward(grad: &mut [f32], ids: &[i32], dout: &[f32], c: usize) {
    // Lengths agree by construction here; the reference only reports mismatches.
    let _ = crate::backend::cpu::kernels::embedding_bwd(ids, dout, c, grad);
}

/// Lookup table `weight: (num_embeddings, dim)`, init N(0, 1) as PyTorch. Input i32 ids of
/// any shape `S` on the weight's device; output `(S.., dim)` f32; backward returns an empty
/// tensor (ids have no gradient).
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
    fn type_name(&self) -> &str {
        "Embedding"
    }
    fn forward(&mut self, ids: &Tensor, cx: &Context) -> Result<Tensor> {
        let out = ops::embedding(self.weight.data()?, ids)?;
        if cx.grad_enabled {
            self.saved_ids = Some(ids.clone());
        }
        Ok(out)
    }
    fn backward(&mut self, dy: &Tensor, _cx: &Context) -> Result<Tensor> {
        let ids = self.saved_ids.take().ok_or(Error::NoSavedForward {
            module: "Embedding",
        })?;
        if let Some(g) = self.weight.grad_for_accumulate()? {
            ops::embedding_backward(&ids, dy, g)?;
        }
        Tensor::zeros_on(&[0], DType::F32, ids.device())
    }
    fn saved_tensors(&self, out: &mut Vec<Tensor>) {
        out.extend(self.saved_ids.clone());
    }

    fn for_each_param(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("weight", &mut self.weight)
    }
    fn for_each_child(&mut self, f: &mut super::ChildVisitor<'_>) -> Result<()> {
        super::no_children(f)
    }
}
