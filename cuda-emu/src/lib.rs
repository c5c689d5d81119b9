//! `cuda-emu`: a CPU stand-in for the three CUDA libraries fsdp loads at run time
//! (`libcuda`, `libcublas`, `libnccl`), so that the CUDA code paths of fsdp (its device
//! tensors, caching allocator, streams and events, kernel launches, cuBLAS GEMMs, the threads
//! backend on device buffers, NCCL communicators of any size, `train --device cuda`) run in CI on a
//! machine without a GPU, against the real kernels of `kernels/*.cu` compiled as host C++.
//!
//! Build it with `cargo build -p cuda-emu`, then put a directory holding `libcuda.so`,
//! `libcublas.so` and `libnccl.so` (links to `libcuda_emu.so`) first on `LD_LIBRARY_PATH`:
//! `scripts/cuda-emu.sh` does both and runs the CUDA tests.
//!
//! What it checks, as the driver would refuse it (the returned `CUresult` names it):
//! - a call that needs a context with none current on the thread (`CUDA_ERROR_INVALID_CONTEXT`);
//! - a launch on a stream, or of a kernel, of another device than the current context's
//!   (`CUDA_ERROR_INVALID_HANDLE`); a block over 1024 threads or a grid over the limits;
//! - a copy or a memset outside a live allocation, a pointer argument of a kernel that is
//!   not null and not in a live allocation, a double free (`CUDA_ERROR_INVALID_VALUE`).
//!
//! And what the device does but a host library would hide: fresh allocations are filled with
//! `0xff` bytes (NaN, -1), not zeros; each allocation ends at an inaccessible page, so a
//! kernel that runs past the end of a buffer faults (the runtime names the kernel).
//!
//! And the device's asynchrony (`queue.rs`): every kernel, copy, memset, GEMM and
//! collective waits in its stream's queue until a host synchronization or an event wait
//! forces it, so a missing event wait between two streams (or ranks) reads stale memory and
//! the tests fail. Copies to and from page-locked host memory (`cuMemHostAlloc`) wait too,
//! so a host that reads a pinned buffer before synchronizing with the copy that fills it
//! reads what was there before. `CUDA_EMU_SCHEDULE=eager` runs each operation when issued instead.
//!
//! Its environment variables (`CUDA_EMU_DEVICES`, `CUDA_EMU_SCHEDULE`, `CUDA_EMU_SEED`) are
//! listed in `env.rs`; a bad value is named in one warning line on stderr.
//!
//! What it cannot show: true concurrency (forced work runs one operation at a time, under one
//! lock), the device's own rounding of `logf`/`expf` (the host libm is used), performance,
//! and NCCL's transports and reduction order (`nccl/`: ranks meet through files and reduce
//! in rank order). The kernel sources are compiled for the host, so a construct nvcc
//! rejects but g++ accepts is only caught by the nvcc build of CI.

mod blas;
mod capture;
mod driver;
mod env;
mod memory;
mod nccl;
mod queue;

#[cfg(test)]
mod tests {
    //! The 16-bit conversions of `cpp/cuda_emu.h` against the `half` crate (what the CPU
    //! reference of fsdp uses), over every 16-bit pattern and a sweep of f32 values.
    use half::{bf16, f16};

    extern "C" {
        fn emu_test_f32_to_f16(v: f32) -> u16;
        fn emu_test_f16_to_f32(h: u16) -> f32;
        fn emu_test_f32_to_bf16(v: f32) -> u16;
        fn emu_test_bf16_to_f32(h: u16) -> f32;
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn every_16_bit_pattern_widens_like_the_half_crate() {
        for h in 0..=u16::MAX {
            let (x, y) = unsafe { (emu_test_f16_to_f32(h), emu_test_bf16_to_f32(h)) };
            assert!(same(x, f16::from_bits(h).to_f32()), "f16 {h:#06x}: {x}");
            assert!(same(y, bf16::from_bits(h).to_f32()), "bf16 {h:#06x}: {y}");
        }
    }

    #[test]
    fn f32_values_narrow_like_the_half_crate() {
        // Every 16th f32 bit pattern covers each exponent, both signs, subnormals of both
        // formats, the rounding boundaries (ties included: their low bits are zero), inf, NaN.
        for bits in (0..=u32::MAX).step_by(16) {
            let v = f32::from_bits(bits);
            let (h, b) = unsafe { (emu_test_f32_to_f16(v), emu_test_f32_to_bf16(v)) };
            let (wh, wb) = (f16::from_f32(v), bf16::from_f32(v));
            if v.is_nan() {
                assert!(
                    f16::from_bits(h).is_nan() && bf16::from_bits(b).is_nan(),
                    "NaN {bits:#x}"
                );
            } else {
                assert_eq!(h, wh.to_bits(), "f16 of {v:e} ({bits:#x})");
                assert_eq!(b, wb.to_bits(), "bf16 of {v:e} ({bits:#x})");
            }
        }
    }
}
