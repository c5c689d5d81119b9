//! Collectives built from the primitive ones of [`ProcessGroup`], so every backend has them:
//! `reduce`, `all_gather` (list), `gather`, `scatter`, `all_to_all_single`, with the
//! semantics of `torch.distributed`. They move more data than a dedicated implementation
//! would (each goes through an all-gather, all-reduce or broadcast); FSDP's hot path uses
//! only the primitives.

use super::{ProcessGroup, ReduceOp};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

fn same_layout(op: &str, want: &Tensor, got: &Tensor, what: &str) -> Result<()> {
    if want.numel() != got.numel() || want.dtype() != got.dtype() {
        return Err(Error::InvalidArgument(format!(
            "{op}: {what} is {:?} {}, expected {} elements of {}",
            got.shape(),
            got.dtype(),
            want.numel(),
            want.dtype()
        )));
    }
    Ok(())
}

fn list_len(op: &str, list: &[Tensor], world: usize) -> Result<()> {
    if list.len() != world {
        return Err(Error::InvalidArgument(format!(
            "{op}: the list has {} tensors for a group of {world} ranks",
            list.len()
        )));
    }
    Ok(())
}

/// Extension methods available on every [`ProcessGroup`].
pub trait CollectivesExt: ProcessGroup {
    /// `torch.distributed.reduce`: rank `dst`'s `tensor` becomes the reduction over ranks;
    /// the other ranks' tensors are left unchanged.
    fn reduce(&self, tensor: &Tensor, dst: usize, op: ReduceOp) -> Result<()> {
        if dst >= self.size() {
            crate::error::bail_arg!(
                "reduce: dst rank {dst} is not in a group of {} ranks",
                self.size()
            );
        }
        let tmp = tensor.deep_clone()?;
        self.all_reduce(&tmp, op)?;
        if self.rank() == dst {
            tensor.copy_from(&tmp)?;
        }
        Ok(())
    }

    /// `torch.distributed.all_gather`: `outputs[r]` becomes rank `r`'s `input`; `outputs`
    /// has one tensor per rank, each with `input`'s element count and dtype.
    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<()> {
        let w = self.size();
        list_len("all_gather", outputs, w)?;
        for o in outputs {
            same_layout("all_gather", input, o, "an output")?;
        }
        let flat = Tensor::zeros_on(&[w * input.numel()], input.dtype(), input.device())?;
        self.all_gather_into_tensor(&flat, input)?;
        for (r, o) in outputs.iter().enumerate() {
            o.copy_from(&flat.view(r * input.numel(), &[input.numel()])?)?;
        }
        Ok(())
    }

    /// `torch.distributed.gather`: on rank `dst`, `outputs[r]` becomes rank `r`'s `input`;
    /// the other ranks pass `None`.
    fn gather(&self, input: &Tensor, outputs: Option<&[Tensor]>, dst: usize) -> Result<()> {
        if dst >= self.size() {
            crate::error::bail_arg!(
                "gather: dst rank {dst} is not in a group of {} ranks",
                self.size()
            );
        }
        let w = self.size();
        let flat = Tensor::zeros_on(&[w * input.numel()], input.dtype(), input.device())?;
        self.all_gather_into_tensor(&flat, input)?;
        if self.rank() == dst {
            let outputs = outputs.ok_or_else(|| {
                Error::InvalidArgument("gather: the dst rank must pass the output list".into())
            })?;
            list_len("gather", outputs, w)?;
            for (r, o) in outputs.iter().enumerate() {
                same_layout("gather", input, o, "an output")?;
                o.copy_from(&flat.view(r * input.numel(), &[input.numel()])?)?;
            }
        }
        Ok(())
    }

    /// `torch.distributed.scatter`: every rank's `output` becomes `inputs[rank]` of rank
    /// `src`; the other ranks pass `None`.
    fn scatter(&self, output: &Tensor, inputs: Option<&[Tensor]>, src: usize) -> Result<()> {
        let w = self.size();
        if src >= w {
            crate::error::bail_arg!("scatter: src rank {src} is not in a group of {w} ranks");
        }
        let n = output.numel();
        let flat = Tensor::zeros_on(&[w * n], output.dtype(), output.device())?;
        if self.rank() == src {
            let inputs = inputs.ok_or_else(|| {
                Error::InvalidArgument("scatter: the src rank must pass the input list".into())
            })?;
            list_len("scatter", inputs, w)?;
            for (r, i) in inputs.iter().enumerate() {
                same_layout("scatter", output, i, "an input")?;
                flat.view(r * n, &[n])?.copy_from(i)?;
            }
        }
        self.broadcast(&flat, src)?;
        output.copy_from(&flat.view(self.rank() * n, &[n])?)
    }

    /// `torch.distributed.all_to_all_single` with equal splits: `input` and `output` hold
    /// `size * n` elements; chunk `j` of `output` becomes chunk `rank` of rank `j`'s input.
    fn all_to_all_single(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        let w = self.size();
        same_layout("all_to_all_single", input, output, "the output")?;
        if input.numel() % w != 0 {
            crate::error::bail_arg!(
                "all_to_all_single: {} elements do not split into {w} equal chunks",
                input.numel()
            );
        }
        let n = input.numel() / w;
        let all = Tensor::zeros_on(&[w * input.numel()], input.dtype(), input.device())?;
        self.all_gather_into_tensor(&all, input)?;
        let me = self.rank();
        for j in 0..w {
            output
                .view(j * n, &[n])?
                .copy_from(&all.view(j * w * n + me * n, &[n])?)?;
        }
        Ok(())
    }
}

impl<T: ProcessGroup + ?Sized> CollectivesExt for T {}
