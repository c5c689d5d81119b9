//! `Parameter`: a named tensor with a gradient slot, whose storage FSDP can swap.

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::{numel_of, DType, Tensor};

/// A trainable (or frozen) tensor of a module (`torch.nn.Parameter`).
///
/// Under FSDP its `data` is a view into the unit's FlatParameter while the unit is
/// unsharded, and absent (`NotMaterialized` on access) while it is sharded; its `grad` is a
/// view into the unit's flat gradient buffer during backward. Outside FSDP it owns both.
#[derive(Debug)]
pub struct Parameter {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    /// Device of the data, kept while the data is sharded away.
    device: Device,
    data: Option<Tensor>,
    grad: Option<Tensor>,
    /// False for a frozen parameter: backward leaves its gradient untouched.
    pub requires_grad: bool,
}

impl Parameter {
    /// A trainable parameter owning `data`. `name` is its local name (`"weight"`); fully
    /// qualified names are given by the module tree.
    pub fn new(name: &str, data: Tensor) -> Parameter {
        Parameter {
            name: name.to_string(),
            shape: data.shape().to_vec(),
            dtype: data.dtype(),
            device: data.device(),
            data: Some(data),
            grad: None,
            requires_grad: true,
        }
    }

    /// Name given at creation or last set by [`Parameter::set_name`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Renames (FSDP sets the fully qualified name so errors can name the parameter).
    pub fn set_name(&mut self, name: &str) {
        self.name = name.to_string();
    }

    /// Shape, known even while the data is sharded away.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        numel_of(&self.shape)
    }

    /// Element type of the data.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device of the data (of the last data set, while it is sharded away).
    pub fn device(&self) -> Device {
        self.device
    }

    /// The values.
    ///
    /// # Errors
    /// `NotMaterialized` while the owning FSDP unit is sharded.
    pub fn data(&self) -> Result<&Tensor> {
        self.data.as_ref().ok_or_else(|| Error::NotMaterialized {
            name: self.name.clone(),
            state: "sharded",
        })
    }

    /// True when the data is present.
    pub fn is_materialized(&self) -> bool {
        self.data.is_some()
    }

    /// Points the parameter at new storage (`None` frees it).
    ///
    /// # Errors
    /// `ShapeMismatch` when the new tensor's element count differs from the parameter's.
    pub fn set_data(&mut self, data: Option<Tensor>) -> Result<()> {
        if let Some(d) = &data {
            if d.numel() != self.numel() {
                return Err(Error::ShapeMismatch {
                    op: "Parameter::set_data",
                    expected: self.shape.clone(),
                    got: d.shape().to_vec(),
                });
            }
            self.dtype = d.dtype();
            self.device = d.device();
        }
        self.data = data;
        Ok(())
    }

    /// Makes this parameter the same tensor as `source` (PyTorch's weight tying,
    /// `head.weight = emb.weight`): both names then read and write the same elements.
    /// Under FSDP the two must be in one unit, which flattens the tensor once and gives
    /// both names the same parameter and gradient views, so their gradients add up.
    /// Outside FSDP each holder keeps its own gradient slot; plain SGD then applies both,
    /// which is the summed update, but stateful optimizers should see one parameter (keep
    /// a tied weight in one module, as [`GPT`](super::GPT) does).
    ///
    /// # Errors
    /// `ShapeMismatch` when the shapes differ; `NotMaterialized` when `source` has no data.
    pub fn tie_to(&mut self, source: &Parameter) -> Result<()> {
        if source.shape != self.shape {
            return Err(Error::ShapeMismatch {
                op: "Parameter::tie_to",
                expected: self.shape.clone(),
                got: source.shape.clone(),
            });
        }
        self.set_data(Some(source.data()?.clone()))
    }

    /// The accumulated gradient, if any.
    pub fn grad(&self) -> Option<&Tensor> {
        self.grad.as_ref()
    }

    /// Replaces the gradient slot (`None` is `zero_grad(set_to_none=True)`).
    pub fn set_grad(&mut self, grad: Option<Tensor>) {
        self.grad = grad;
    }

    /// The gradient to accumulate into, created as zeros of the parameter's dtype (f32;
    /// f64, bf16 or f16 for a parameter of that dtype) on the parameter's
    /// [`device`](Self::device) when absent; `None` for a frozen parameter (callers then
    /// skip the weight gradient). A gradient set by [`set_grad`](Self::set_grad) is used as
    /// it is, wherever it lives (the ops then check it is on the data's device).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the zeros cannot be allocated on the device.
    pub fn grad_for_accumulate(&mut self) -> Result<Option<&Tensor>> {
        if !self.requires_grad {
            return Ok(None);
        }
        if self.grad.is_none() {
            // Gradients have the parameter's floating dtype (a bf16 parameter gets bf16
            // gradients, as in PyTorch).
            let dtype = match self.dtype {
                d @ (DType::F64 | DType::BF16 | DType::F16) => d,
                _ => DType::F32,
            };
            self.grad = Some(Tensor::zeros_on(&self.shape, dtype, self.device)?);
        }
        Ok(self.grad.as_ref())
    }
}
