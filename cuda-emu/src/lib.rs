//! `cuda-emu`: a CPU stand-in for the three CUDA libraries fsdp loads at run time
//! (`libcuda`, `libcublas`, `libnccl`), so that the CUDA code paths of fsdp (its device
//! tensors, caching allocator, streams and events, kernel launches, cuBLAS GEMMs, the threads
//! backend on device buffers, NCCL at world size 1, `train --device cuda`) run in CI on a
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
//! What it cannot show: anything about concurrency. Every copy, kernel and collective runs
//! to completion, synchronously, when it is issued, so a missing event wait is invisible
//! here. Results are the kernels' own arithmetic with the host's libm (`logf`, `expf`),
//! not the device's ulp errors. NCCL runs one rank per communicator.

mod blas;
mod driver;
mod memory;
mod nccl;
