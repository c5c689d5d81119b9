// cast.cu: elementwise dtype conversion, the mixed-precision casts of FSDP's
// MixedPrecision(param_dtype) and of gradients to reduce_dtype.
//   out[i] = cast(in[i])   for i in [0, n); in, out: (n)              (overwrites, `=`)
// Conversions go through f32, round-to-nearest-even when narrowing. 128-bit vector loads
// and stores where both pointers are aligned (map_elementwise in common.cuh).
// CPU reference: backend::cpu::ops::cast_slice (and kernels::cast).
// Kernels: cast_{src}_{dst} for src, dst in {f32, f16, bf16}, src != dst; the ones that
// touch bf16 behind FSDP_BF16 (sm_80+); cast_f64_f32 (round to nearest even, as Rust's
// `as f32`) and cast_f32_f64 (exact).
#include "common.cuh"

#define CAST_KERNEL(NAME, SRC, DST)                                                    \
  extern "C" __global__ void NAME(const SRC* __restrict__ in, DST* __restrict__ out,   \
                                  int64_t n) {                                         \
    map_elementwise(in, out, n, [](SRC v) { return from_f32<DST>(to_f32(v)); });      \
  }

CAST_KERNEL(cast_f32_f16, float, __half)
CAST_KERNEL(cast_f64_f32, double, float)
CAST_KERNEL(cast_f32_f64, float, double)
CAST_KERNEL(cast_f16_f32, __half, float)
#if FSDP_BF16
CAST_KERNEL(cast_f16_bf16, __half, __nv_bfloat16)
CAST_KERNEL(cast_bf16_f16, __nv_bfloat16, __half)
CAST_KERNEL(cast_f32_bf16, float, __nv_bfloat16)
CAST_KERNEL(cast_bf16_f32, __nv_bfloat16, float)
#endif
