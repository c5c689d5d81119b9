//! The gradient op of loss scaling: [`non_finite_check_and_unscale_`], PyTorch's
//! `torch._amp_foreach_non_finite_check_and_unscale_` (what `GradScaler.unscale_` runs on
//! each device's gradients).
//!
//! | gradients | the check | the unscale |
//! |---|---|---|
//! | host, any float dtype | a loop over the values | [`scale_`](super::scale_) |
//! | CUDA f32 | their squares summed in f64 on the device (`NormAccumulator`, as `clip_grad_norm_`), one read per device | `scale_f32` on the current stream |
//! | CUDA f64, bf16, f16 | the values read to the host | [`scale_`](super::scale_) |
//!
//! A sum of f64 squares of f32 values is finite exactly when every value is: the largest
//! square is below 2^256 and no sum of fewer than 2^768 of them reaches f64's range, so the
//! device check needs no kernel of its own. (f64 values could square beyond it, so f64
//! device gradients are checked on the host.)

use super::same_device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// Multiplies every tensor of `grads` in place by `inv_scale` and returns whether any of
/// them held an infinite or NaN value before (`found_inf`), as
/// `torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`: the
/// check reads the values as they were (a finite value that `inv_scale > 1` makes overflow
/// does not count), and every tensor is multiplied whatever it holds (f32 arithmetic for
/// f32 values, f64 for f64 ones, f32 rounded once for bf16/f16 ones; a factor of 1 changes
/// nothing). Empty tensors are skipped; the tensors may lie on different devices. On CUDA
/// the multiplications are queued on the current stream and the check reads one f64 per
/// device back to the host (a synchronization, as PyTorch's `GradScaler.step` reads its
/// `found_inf`); f64, bf16 and f16 device gradients are read to the host whole.
///
/// # Errors
/// `DTypeMismatch` for a tensor of an integer dtype; `NotMaterialized` on meta;
/// [`Error::Cuda`].
pub fn non_finite_check_and_unscale_(grads: &[&Tensor], inv_scale: f32) -> Result<bool> {
    let mut found = false;
    let mut on_device = device_check::Sums::default();
    for g in grads.iter().filter(|g| g.numel() > 0) {
        let device = same_device("non_finite_check_and_unscale_", &[g])?;
        let dtype = g.dtype();
        if !matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
            return Err(Error::DTypeMismatch {
                op: "non_finite_check_and_unscale_",
                expected: DType::F32,
                got: dtype,
            });
        }
        let queued = match device {
            crate::backend::Device::Cuda(i) if dtype == DType::F32 => {
                on_device.add(i, g)?;
                true
            }
            _ => false,
        };
        if !queued {
            found |= holds_non_finite(g)?;
        }
        if inv_scale != 1.0 {
            super::scale_(g, inv_scale)?;
        }
    }
    found |= on_device.any_non_finite()?;
    Ok(found)
}

/// Whether `t` (any float dtype, any device) holds an infinite or NaN value, read on the
/// host.
fn holds_non_finite(t: &Tensor) -> Result<bool> {
    match (t.dtype(), t.device().is_cuda()) {
        (DType::F64, _) => Ok(t.to_vec_f64()?.iter().any(|v| !v.is_finite())),
        (DType::F32, false) => Ok(t.f32()?.iter().any(|v| !v.is_finite())),
        // bf16/f16 widen exactly: inf and NaN stay what they are.
        _ => Ok(t.to_vec_f32()?.iter().any(|v| !v.is_finite())),
    }
}

/// The device half of the check: one running sum of squares per device.
mod device_check {
    use crate::backend::cuda::{current_stream, NormAccumulator};
    use crate::backend::Device;
    use crate::error::Result;
    use crate::tensor::{DType, Tensor};

    /// `(ordinal, sum of squares)` of every device seen.
    #[derive(Default)]
    pub(super) struct Sums(Vec<(usize, NormAccumulator)>);

    impl Sums {
        /// Adds the squares of `g` (f32 on `cuda:ordinal`), queued on the current stream
        /// before anything later changes `g`.
        pub(super) fn add(&mut self, ordinal: usize, g: &Tensor) -> Result<()> {
            let s = current_stream(ordinal)?;
            if !self.0.iter().any(|(o, _)| *o == ordinal) {
                self.0.push((ordinal, NormAccumulator::zeros(&s)?));
            }
            let acc = self.0.iter().find(|(o, _)| *o == ordinal).map(|(_, a)| a);
            match acc {
                Some(acc) => acc.add_squares(&s, &g.as_device_tensor()?),
                None => Ok(()),
            }
        }

        /// Whether some device's sum is infinite or NaN (reads one f64 per device).
        pub(super) fn any_non_finite(&self) -> Result<bool> {
            let mut found = false;
            for (ordinal, acc) in &self.0 {
                let s = current_stream(*ordinal)?;
                let out = Tensor::zeros_on(&[1], DType::F64, Device::Cuda(*ordinal))?;
                acc.store(&s, &out.as_device_tensor()?)?;
                found |= !out.to_vec_f64()?[0].is_finite();
            }
            Ok(found)
        }
    }
}
