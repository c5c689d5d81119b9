//! Saved-activation accounting: the bytes of the tensors a module tree holds for its
//! backward (what autograd's saved tensors take in PyTorch, `torch.cuda.memory_allocated`
//! minus parameters at the end of a forward).

use super::Module;
use crate::error::Result;
use crate::tensor::Tensor;

/// Bytes of the distinct tensors saved for backward below `m` (every module's
/// [`Module::saved_tensors`], FSDP units included; a tensor two modules hold counts once).
/// Saved activations peak at the end of a training forward, before backward consumes them:
/// that is when FSDP's root measures them ([`crate::fsdp::MemoryStats::activation_bytes`]).
/// Halved by a bf16/f16 `param_dtype`, whose layers save bf16/f16 tensors.
///
/// # Errors
/// None of its own; the `Result` carries a module's child-visiting error.
pub fn saved_activation_bytes(m: &mut dyn Module) -> Result<usize> {
    let mut all = Vec::new();
    collect(m, &mut all)?;
    let mut distinct: Vec<Tensor> = Vec::with_capacity(all.len());
    for t in all {
        if !distinct.iter().any(|d| d.same_view(&t)) {
            distinct.push(t);
        }
    }
    Ok(distinct.iter().map(Tensor::nbytes).sum())
}

fn collect(m: &mut dyn Module, out: &mut Vec<Tensor>) -> Result<()> {
    m.saved_tensors(out);
    m.for_each_child(&mut |_, c| collect(c.as_mut(), out))
}
