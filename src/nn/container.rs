//! `Sequential`: children run forward in order and backward in reverse (`torch.nn.Sequential`).

use super::{ChildVisitor, Context, Module};
use crate::error::Result;
use crate::tensor::Tensor;

/// Children named `"0"`, `"1"`, ... as in PyTorch.
pub struct Sequential {
    /// The children in call order; child `i` is named `"i"` in parameter names, and each
    /// is boxed so auto-wrap can replace it with an FSDP unit.
    pub layers: Vec<Box<dyn Module>>,
    names: Vec<String>,
}

impl Sequential {
    /// A sequential container of `layers`.
    pub fn new(layers: Vec<Box<dyn Module>>) -> Self {
        let names = (0..layers.len()).map(|i| i.to_string()).collect();
        Sequential { layers, names }
    }
}

impl Module for Sequential {
    fn type_name(&self) -> &str {
        "Sequential"
    }
    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &mut self.layers {
            h = l.forward(&h, cx)?;
        }
        Ok(h)
    }
    fn backward(&mut self, dy: &Tensor, cx: &Context) -> Result<Tensor> {
        let mut g = dy.clone();
        for l in self.layers.iter_mut().rev() {
            g = l.backward(&g, cx)?;
        }
        Ok(g)
    }
    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        for (name, l) in self.names.iter().zip(self.layers.iter_mut()) {
            f(name, l)?;
        }
        Ok(())
    }
    fn for_each_param(&mut self, f: &mut super::ParamVisitor<'_>) -> Result<()> {
        super::no_params(f)
    }
}
