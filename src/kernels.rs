//! The CUDA kernels of `kernels/*.cu`, compiled to PTX by build.rs when the `cuda` feature
//! is on and embedded here. The CUDA backend that loads them (cudarc, lazily per device)
//! lands with the CUDA runtime issue; until then this table is what the build produces.
//!
//! | file | kernels | CPU reference |
//! |---|---|---|
//! | `cast.cu` | `cast_{src}_{dst}` | [`cast_slice`](crate::backend::cpu::ops::cast_slice) |
//! | `reduce_scatter.cu` | `pack_grad_{dtype}`, `sum_into_{dtype}` | the FSDP unit's gradient reduction |

#[cfg(feature = "cuda")]
include!(concat!(env!("OUT_DIR"), "/kernels_ptx.rs"));

/// Names of the compiled kernel modules (empty without the `cuda` feature).
pub fn module_names() -> Vec<&'static str> {
    #[cfg(feature = "cuda")]
    {
        PTX.iter().map(|(n, _)| *n).collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}
