//! `FullyShardedDataParallel` as a [`Module`]: the hooks (`hooks.rs`) around the wrapped
//! module's forward and backward, with what only the module path does: rounding the
//! buffers to `buffer_dtype`, casting the input to `param_dtype` and the input gradient
//! back, and the root's end of backward (FSDP1 `_root_pre_forward`,
//! `_cast_forward_inputs`, `_post_backward_final_callback`).

use super::FullyShardedDataParallel;
use crate::error::Result;
use crate::nn::{ChildVisitor, Context, Module};
use crate::tensor::{DType, Tensor};

impl Module for FullyShardedDataParallel {
    fn type_name(&self) -> &str {
        "FullyShardedDataParallel"
    }

    fn forward(&mut self, x: &Tensor, cx: &Context) -> Result<Tensor> {
        self.cast_buffers()?;
        self.pre_forward(cx.grad_enabled)?;
        let y = self.cast_input(x).and_then(|cast| {
            // The cast is undone in backward (the gradient of `x.to(param_dtype)`).
            self.input_cast = cast.is_some() && cx.grad_enabled;
            self.module.forward(cast.as_ref().unwrap_or(x), cx)
        });
        self.post_forward(y.is_ok())?;
        if self.is_root && cx.grad_enabled && y.is_ok() {
            // Saved activations peak now, before backward consumes them, unless a
            // checkpointed module's recompute holds more ([Note: the recompute peak] in
            // `nn/saved.rs`; counted at the end of the backward).
            let bytes = crate::nn::track_saved_activations(self.module.as_mut())?;
            self.rs.mem.lock().on_activations(bytes);
        }
        y
    }

    fn backward(&mut self, grad_out: &Tensor, cx: &Context) -> Result<Tensor> {
        self.check_not_summoning("backward")?;
        let result = self.pre_backward().and_then(|()| {
            let dx = self.module.backward(grad_out, cx);
            self.post_backward(dx.is_ok())?;
            // The gradient of the input cast back to f32 (autograd's `ToCopyBackward`).
            match dx {
                Ok(d) if std::mem::take(&mut self.input_cast) && d.dtype() != DType::F32 => {
                    d.to_dtype(DType::F32)
                }
                other => other,
            }
        });
        if self.is_root {
            let peak = crate::nn::saved_activation_peak();
            self.rs.mem.lock().on_recompute_peak(peak);
            let fin = match &result {
                Ok(_) => self.finish_backward(),
                Err(e) => {
                    // Nothing may stay in flight after an error either.
                    self.abort_on_desync(e);
                    let fin = self.finalize_backward();
                    self.rs
                        .sched
                        .lock()
                        .progress
                        .end_backward(Some(format!("the backward failed: {e}")));
                    fin
                }
            };
            let dx = result?;
            fin?;
            return Ok(dx);
        }
        result
    }

    fn for_each_child(&mut self, f: &mut ChildVisitor<'_>) -> Result<()> {
        f("", &mut self.module)
    }

    fn is_fsdp_unit(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
    fn for_each_param(&mut self, f: &mut crate::nn::ParamVisitor<'_>) -> Result<()> {
        crate::nn::no_params(f)
    }

    /// FULL_STATE_DICT on every rank (a collective), on the device of the shards.
    fn state_dict_override(&mut self) -> Option<Result<crate::nn::FullStateDict>> {
        Some(self.full_state_dict(super::FullStateDictConfig::default()))
    }

    /// A full state dict, given whole on every rank; each keeps its shard.
    fn load_state_dict_override(
        &mut self,
        sd: &crate::nn::FullStateDict,
        strict: bool,
    ) -> Option<Result<crate::nn::IncompatibleKeys>> {
        Some(self.load_state_dict(&super::StateDict::Full(sd.clone()), strict))
    }
}

impl FullyShardedDataParallel {
    /// Rounds the f32 buffers of the modules this unit owns (ignored modules' excepted) to
    /// `buffer_dtype` before its forward (FSDP1 `_cast_buffers_to_dtype_and_device` in the
    /// root's pre-forward; here each unit its own, which covers the same buffers). Values
    /// stay in f32 storage, as every low-precision value of this crate; a state dict then
    /// returns them in f32, as FSDP1 restores the original dtype. Idempotent, so a running
    /// stat updated in f32 by the forward is rounded again at the next one.
    fn cast_buffers(&mut self) -> Result<()> {
        let Some(dtype) = self.rs.mp.buffer_dtype.filter(|d| *d != DType::F32) else {
            return Ok(());
        };
        let rs = self.rs.clone();
        crate::nn::round_buffers(self.module.as_mut(), &self.prefix, dtype, &|name| {
            rs.is_ignored(name)
        })
    }

    /// Casts an f32 input to `param_dtype` (FSDP1 `_cast_forward_inputs`): on the root
    /// with `cast_root_forward_inputs` (the default) or `cast_forward_inputs`, on a nested
    /// unit with `cast_forward_inputs` only (its input is normally the output of
    /// `param_dtype` layers already).
    fn cast_input(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let mp = self.rs.mp;
        let wanted = mp.cast_forward_inputs || (self.is_root && mp.cast_root_forward_inputs);
        if !mp.is_low_precision() || x.dtype() != DType::F32 || !wanted {
            return Ok(None);
        }
        x.to_dtype(mp.compute_dtype()).map(Some)
    }
}
