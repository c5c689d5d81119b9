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
//! | `optim.cu` | `sgd_{f32,f64}`, `adam_{f32,f64}` | `fsdp::optim` (`SGD`, `Adam`, `AdamW`) |
//! | `graph.cu` | `adam_bias_{f32,f64}` | Adam's step count in a captured CUDA graph (`backend::cuda`'s `graph.rs`) |
//! | `nn.cu` | `gelu_*`, `relu_*`, `layernorm_*`, `softmax_*`, `cross_entropy_*`, `embedding_*`, `bias_*` (each `_f32` and `_f64`) | [`crate::backend::cpu::kernels`], `fsdp::nn` (f64: `ops::double`) |
//! | `collective.cu` | `reduce_ranks_{dtype}` | the threads backend's host reduction (`distributed::threads`) |
//! | `sdpa.cu` | `sdpa_fwd_{f16,bf16}`, `sdpa_bwd_dq_{f16,bf16}`, `sdpa_bwd_dkv_{f16,bf16}` | `ops::sdpa_causal` (PyTorch's bf16/f16 `scaled_dot_product_attention`, bitwise) |
//! | `lowp.cu` | `layernorm_bwd_lp_*`, `layernorm_wgrad_lp_*`, `cross_entropy_lp_*` (each `_f16` and `_bf16`) | `ops::lowp` (the host loops of bf16/f16 LayerNorm and cross-entropy) |
//! | `batchnorm.cu` | `batchnorm_{stats,fwd,bwd_stats,bwd_dx}_{f32,f64}`, `_lp_{bf16,f16}_{param}`, `batchnorm_count_i64` | `ops::batchnorm` (host loops; bf16/f16: `reduced.rs`) |

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels_fatbin.rs"));
}

/// Names of the compiled kernel modules, one per `kernels/*.cu` file, sorted (empty
/// without the `cuda` feature).
pub fn module_names() -> Vec<&'static str> {
    embedded::FATBINS.iter().map(|(n, _)| *n).collect()
}

/// The fat binary image of module `name` (`"cast"` for `kernels/cast.cu`), `None` for an
/// unknown name or without the `cuda` feature.
pub fn fatbin(name: &str) -> Option<&'static [u8]> {
    embedded::FATBINS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
}

/// The architectures compiled into every module, e.g. `"sm_80,sm_90,compute_80"` (empty
/// without the `cuda` feature).
pub fn targets() -> &'static str {
    embedded::TARGETS
}

#[cfg(test)]
mod tests {
    /// Every `kernels/*.cu` file has its row in the table of this module's doc and in the
    /// CUDA page's (docs/cuda.md), and neither table names a file that is not there.
    #[test]
    fn the_kernel_tables_list_every_cu_file() {
        // The workspace root (this crate is crates/fsdp-core).
        let root = &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files: Vec<String> = std::fs::read_dir(root.join("kernels"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        files.sort();
        assert!(files.len() >= 9, "{files:?}");
        let rows = |text: &str, prefix: &str| {
            let mut v: Vec<String> = text
                .lines()
                .filter_map(|l| l.strip_prefix(prefix))
                .filter_map(|l| l.strip_prefix("| `"))
                .filter_map(|l| l.split_once(".cu` |"))
                .map(|(name, _)| format!("{name}.cu"))
                .collect();
            v.sort();
            v
        };
        let doc = std::fs::read_to_string(root.join("crates/fsdp-core/src/kernels.rs")).unwrap();
        assert_eq!(
            rows(&doc, "//! "),
            files,
            "crates/fsdp-core/src/kernels.rs's table"
        );
        let cuda_page = std::fs::read_to_string(root.join("docs/cuda.md")).unwrap();
        assert_eq!(rows(&cuda_page, ""), files, "docs/cuda.md's kernel table");
    }
}
