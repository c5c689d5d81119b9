//! The C ABI on a CUDA device, driven from Rust through its `extern "C"` functions as a C
//! host would call them (a host that owns its CUDA stream and device memory, made with the
//! driver API): a model whose `fsdp_config.device` is `{kDLCUDA, 0}` hands out `kDLCUDA`
//! parameter and gradient views and takes device gradients, and after a few steps at
//! world size 1 and 2 (threads ranks sharing cuda:0, one on its own stream, one on the
//! legacy stream) its parameters equal the same host's run on a CPU model (f32, 1e-6),
//! in f32 and with bfloat16 views under mixed precision; the collectives on device
//! buffers; and the errors of tensors on the wrong device.
//!
//! The host computes on the CPU between copies on its own stream: it uploads gradients
//! with `cuMemcpyHtoDAsync` and reads views with `cuMemcpyDtoHAsync` on that stream. On
//! cuda-emu (scripts/cuda-emu.sh) stream work waits until something forces it, so a
//! missing event between the host's stream and fsdp's (`crates/fsdp-core/src/device.rs`) reads
//! stale memory (fresh device memory is `0xff`, NaN) and these tests fail.
//!
//! Every test ends in `_cuda` and prints "skipping <test> on CUDA: <why>" and passes
//! without a usable GPU.

#[path = "../../../tests/common/mod.rs"]
mod common;

#[cfg(feature = "cuda")]
#[path = "capi_cuda/host.rs"]
mod host;

/// The number of GPUs, or `None` after printing why `test` is skipped.
fn gpus(test: &str) -> Option<usize> {
    match fsdp::backend::cuda::detect() {
        Ok(d) if !d.is_empty() => Some(d.len()),
        Ok(_) => {
            eprintln!("skipping {test} on CUDA: no CUDA device");
            None
        }
        Err(e) => {
            eprintln!("skipping {test} on CUDA: {e}");
            None
        }
    }
}

#[test]
fn a_host_trains_through_the_abi_on_device_like_on_the_cpu_cuda() {
    let Some(_) = gpus("a_host_trains_through_the_abi_on_device_like_on_the_cpu") else {
        return;
    };
    #[cfg(feature = "cuda")]
    for world in [1, 2] {
        for bf16 in [false, true] {
            host::train_matches_cpu(world, bf16);
        }
    }
}

#[test]
fn collectives_write_into_the_hosts_device_buffers_cuda() {
    let Some(_) = gpus("collectives_write_into_the_hosts_device_buffers") else {
        return;
    };
    #[cfg(feature = "cuda")]
    host::collectives();
}

#[test]
fn tensors_on_the_wrong_device_are_named_errors_cuda() {
    let Some(_) = gpus("tensors_on_the_wrong_device_are_named_errors") else {
        return;
    };
    #[cfg(feature = "cuda")]
    host::wrong_devices();
}
