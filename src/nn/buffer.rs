//! Module buffers: named, non-trainable tensors a module registers beside its parameters
//! (`torch.nn.Module.register_buffer(name, tensor, persistent=True)`), such as
//! BatchNorm's running statistics.
//!
//! A buffer is visited by [`Module::for_each_buffer`] and, over a whole tree, by
//! [`visit_buffers`] in `named_buffers()` order (module pre-order: a module's own buffers,
//! then its children's). Persistent buffers are part of state dicts and checkpoints under
//! their fully qualified names; non-persistent ones are not (`persistent=False`). FSDP
//! never shards or flattens buffers: every rank holds each whole.

use super::{join_name, Module};
use crate::backend::Device;
use crate::error::Result;
use crate::tensor::{DType, Tensor};

/// One registered buffer: its tensor and whether state dicts carry it.
#[derive(Debug, Clone)]
pub struct ModuleBuffer {
    /// The values, any dtype, on the module's device.
    pub data: Tensor,
    /// Saved in state dicts and checkpoints (`persistent=True`, PyTorch's default).
    pub persistent: bool,
}

impl ModuleBuffer {
    /// A persistent buffer (`register_buffer(name, t)`).
    pub fn new(data: Tensor) -> Self {
        ModuleBuffer {
            data,
            persistent: true,
        }
    }

    /// A buffer left out of state dicts (`register_buffer(name, t, persistent=False)`).
    pub fn non_persistent(data: Tensor) -> Self {
        ModuleBuffer {
            data,
            persistent: false,
        }
    }
}

/// The callback of [`Module::for_each_buffer`] and [`visit_buffers`]: `(name, buffer)`;
/// an error stops the walk and is returned by it.
pub type BufferVisitor<'a> = dyn FnMut(&str, &mut ModuleBuffer) -> Result<()> + 'a;

/// Visits every buffer below `m` in module pre-order with fully qualified names, as
/// `torch.nn.Module.named_buffers()` (FSDP units are transparent in names). With
/// `stop_at_units` the subtrees of nested FSDP units (not `m` itself) are skipped: the
/// buffers a unit owns.
///
/// # Errors
/// The first error `f` (or a module's own walk) returns; the walk stops there.
pub fn visit_buffers(
    m: &mut dyn Module,
    prefix: &str,
    stop_at_units: bool,
    f: &mut BufferVisitor<'_>,
) -> Result<()> {
    m.for_each_buffer(&mut |name, b| f(&join_name(prefix, name), b))?;
    m.for_each_child(&mut |name, child| {
        if stop_at_units && child.is_fsdp_unit() {
            return Ok(());
        }
        visit_buffers(child.as_mut(), &join_name(prefix, name), stop_at_units, f)
    })
}

/// `(fully qualified name, tensor)` of every buffer below `m` in `named_buffers()` order;
/// with `persistent_only`, those a state dict holds. The tensors are the buffers
/// themselves (not copies).
///
/// # Errors
/// A module's walk error.
pub fn named_buffers(m: &mut dyn Module, persistent_only: bool) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    visit_buffers(m, "", false, &mut |n, b| {
        if b.persistent || !persistent_only {
            out.push((n.to_string(), b.data.clone()));
        }
        Ok(())
    })?;
    Ok(out)
}

/// Moves every buffer below `m` to `device` (the buffer half of `model.to(device)`).
///
/// # Errors
/// [`crate::Error::Cuda`] when the device is unavailable; `NotMaterialized` for a meta
/// buffer without an initializer.
pub(crate) fn buffers_to_device(
    m: &mut dyn Module,
    prefix: &str,
    stop_at_units: bool,
    device: Device,
) -> Result<()> {
    visit_buffers(m, prefix, stop_at_units, &mut |_, b| {
        if b.data.device() != device {
            b.data = b.data.to_device(device)?;
        }
        Ok(())
    })
}

/// Rounds every f32 buffer below `m` (nested units' excepted with `stop_at_units`, and
/// those `skip` names) to `dtype` in place: FSDP's `buffer_dtype` cast at forward, with
/// values kept in f32 storage as the rest of the mixed-precision path (see
/// `fsdp::mixed_precision`). Integer buffers are left alone, as PyTorch casts only
/// floating-point buffers.
///
/// # Errors
/// A rounding error ([`crate::ops::flat::round_to_`]).
pub(crate) fn round_buffers(
    m: &mut dyn Module,
    prefix: &str,
    dtype: DType,
    skip: &dyn Fn(&str) -> bool,
) -> Result<()> {
    visit_buffers(m, prefix, true, &mut |name, b| {
        if b.data.dtype() == DType::F32 && !skip(name) {
            crate::ops::flat::round_to_(&b.data, dtype)?;
        }
        Ok(())
    })
}
