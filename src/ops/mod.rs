//! Device-dispatching tensor ops: what layers, optimizers and FSDP call so that one piece of
//! code runs on the CPU and on CUDA (as `torch.*` functions dispatch on `tensor.device`).
//!
//! Each op takes [`Tensor`]s, checks they are on one device ([`same_device`]), and runs
//! either the CPU reference ([`crate::backend::cpu`]) or the CUDA kernel / cuBLAS call
//! ([`crate::backend::cuda`]) on the calling thread's current stream. CUDA ops are
//! asynchronous: results are ordered for later work on that stream, and a move to the host
//! ([`Tensor::to_device`], [`Tensor::to_vec_f32`]) waits for them.
//!
//! | file | ops |
//! |---|---|
//! | `elementwise.rs` | `add_`, `scale_`, `fill_`, `sum_squares` |
//! | `flat.rs` | FSDP's flat buffers: `pack_grad`, `unpack_grad`, `round_to_` |

pub mod elementwise;
pub mod flat;

pub use elementwise::{add_, fill_, scale_, sum_squares};

use crate::backend::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The device of `ts`, all on one device.
///
/// # Errors
/// `DeviceMismatch` naming `op` and the first tensor on another device than `ts[0]`;
/// `NotMaterialized` when they are on the meta device.
pub fn same_device(op: &'static str, ts: &[&Tensor]) -> Result<Device> {
    let Some(first) = ts.first() else {
        return Ok(Device::Cpu);
    };
    let d = first.device();
    for t in &ts[1..] {
        if t.device() != d {
            return Err(Error::DeviceMismatch {
                op,
                expected: d.to_string(),
                got: t.device().to_string(),
            });
        }
    }
    if d == Device::Meta {
        return Err(Error::NotMaterialized {
            name: format!("{op} input {first:?}"),
            state: "meta",
        });
    }
    Ok(d)
}

/// The calling thread's current stream on `cuda:ordinal` (see
/// [`crate::backend::cuda::current_stream`]).
#[cfg(feature = "cuda")]
pub(crate) fn stream(ordinal: usize) -> Result<std::sync::Arc<crate::backend::cuda::Stream>> {
    crate::backend::cuda::current_stream(ordinal)
}
