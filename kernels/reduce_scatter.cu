// reduce_scatter.cu: the gradient side of FSDP's post-backward.
//
// pack_grad_{dtype}: fused cast to the reduce dtype and predivide of a flat gradient into
//   the reduce-scatter input:   out[i] = cast<dtype>(grad[i] * scale)   (overwrites, `=`)
//   grad: (n) f32 flat gradient, padded to shard_numel * world; out: (n) reduce dtype.
//   CPU reference: fsdp unit's reduce_grad (scale_ then cast).
// sum_into_{dtype}: the threads backend's reduction on device buffers:
//   acc[i] = cast<dtype>(to_f32(acc[i]) + to_f32(x[i]))   (accumulates, `+=`)
#include "common.cuh"

#define PACK_GRAD_KERNEL(NAME, DST)                                                      \
  extern "C" __global__ void NAME(const float* __restrict__ grad, DST* __restrict__ out, \
                                  float scale, int64_t n) {                              \
    GRID_STRIDE_LOOP(i, n) { out[i] = from_f32<DST>(grad[i] * scale); }                  \
  }

#define SUM_INTO_KERNEL(NAME, T)                                                            \
  extern "C" __global__ void NAME(T* __restrict__ acc, const T* __restrict__ x, int64_t n) { \
    GRID_STRIDE_LOOP(i, n) { acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(x[i])); }          \
  }

PACK_GRAD_KERNEL(pack_grad_f32, float)
PACK_GRAD_KERNEL(pack_grad_f16, __half)
PACK_GRAD_KERNEL(pack_grad_bf16, __nv_bfloat16)
SUM_INTO_KERNEL(sum_into_f32, float)
SUM_INTO_KERNEL(sum_into_f16, __half)
SUM_INTO_KERNEL(sum_into_bf16, __nv_bfloat16)
