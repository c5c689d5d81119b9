//! The CUDA kernels of `kernels/*.cu`, compiled by build.rs with nvcc when the `cuda`
//! feature is on and embedded here: one fat binary per file, holding cubins for sm_80 and
//! sm_90 and PTX for compute_80 (or what `CUDA_COMPUTE_CAP` asked for, see [`targets`]).
//! The CUDA backend loads each module lazily, once per device
//! (`backend::cuda::CudaDevice::function`).
//!
//! | file | kernels | CPU reference |
//! |---|---|---|
//! | `flat_param.cu` | `copy_{dtype}`, `fill_{dtype}`, `pad_copy_{dtype}` | [`crate::backend::cpu::kernels`] |
//! | `reduce_scatter.cu` | `pack_grad_{dtype}`, `sum_into_{dtype}`, `scale_{f32,f64}`, `div_scale_f64`, `sumsq_partial_{f32,f64}`, `clip_coef_{f32,f64}` | [`crate::backend::cpu::kernels`] |
//! | `cast.cu` | `cast_{src}_{dst}` | [`cast_slice`](crate::backend::cpu::ops::cast_slice) |
//! | `optim.cu` | `sgd_{f32,f64}`, `adam_{f32,f64}` | [`crate::optim`] (`SGD`, `Adam`, `AdamW`) |
//! | `nn.cu` | `gelu_*`, `relu_*`, `layernorm_*`, `softmax_*`, `cross_entropy_*`, `embedding_*`, `bias_*` (each `_f32` and `_f64`) | [`crate::backend::cpu::kernels`], [`crate::nn`] (f64: `ops::double`) |
//! | `collective.cu` | `reduce_ranks_{dtype}` | the threads backend's host reduction (`distributed::threads`) |
//! | `batchnorm.cu` | `batchnorm_{stats,fwd,bwd_stats,bwd_dx}_{f32,f64}`, `_lp_{bf16,f16}_{param}`, `batchnorm_count_i64` | `ops::batchnorm` (host loops), `ops::lowp::batchnorm` |

#[cfg(feature = "cuda")]
mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels_fatbin.rs"));
}

/// Names of the compiled kernel modules, one per `kernels/*.cu` file, sorted (empty
/// without the `cuda` feature).
pub fn module_names() -> Vec<&'static str> {
    #[cfg(feature = "cuda")]
    {
        embedded::FATBINS.iter().map(|(n, _)| *n).collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Vec::new()
    }
}

/// The fat binary image of module `name` (`"cast"` for `kernels/cast.cu`), `None` for an
/// unknown name or without the `cuda` feature.
pub fn fatbin(name: &str) -> Option<&'static [u8]> {
    #[cfg(feature = "cuda")]
    {
        embedded::FATBINS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, b)| *b)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = name;
        None
    }
}

/// The architectures compiled into every module, e.g. `"sm_80,sm_90,compute_80"` (empty
/// without the `cuda` feature).
pub fn targets() -> &'static str {
    #[cfg(feature = "cuda")]
    {
        embedded::TARGETS
    }
    #[cfg(not(feature = "cuda"))]
    {
        ""
    }
}
