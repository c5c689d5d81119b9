// reduce_scatter.cu: the gradient side of FSDP's post-backward (FSDP1 _post_backward_hook,
// _reduce_grad). CPU references: backend::cpu::kernels::{pack_grad, unpack_grad, sum_into,
// scale}; the runtime's reduction (fsdp::runtime::issue_reduce) does the same steps.
//
// pack_grad_{dtype}(grad (n) f32, out (n) dtype, scale, n)
//   out[i] = cast<dtype>(grad[i] * scale)                                       (overwrites)
//   Fused predivide (scale = 1 / pre) and cast to reduce_dtype of the flat gradient, padded
//   to shard_numel * world: the reduce-scatter input, with no gather (the flat gradient
//   already has the FlatParameter's layout).
// unpack_grad_{dtype}(in (n) dtype, out (n) f32, scale, n)
//   out[i] = f32(cast<dtype>(f32(in[i]) * scale))                               (overwrites)
//   Fused postdivide (scale = 1 / post) in reduce_dtype and upcast of the reduced shard.
// sum_into_{dtype}(acc (n), x (n), n)
//   acc[i] = cast<dtype>(f32(acc[i]) + f32(x[i]))                               (accumulates)
//   The threads backend's reduction on device buffers: one rounding per added rank.
// scale_f32(x (n), alpha, n)      x[i] = x[i] * alpha                          (in place)
// dtype in {f32, f16, bf16}; bf16 behind FSDP_BF16 (sm_80+).
#include "common.cuh"

#define PACK_GRAD_KERNEL(NAME, DST)                                                      \
  extern "C" __global__ void NAME(const float* __restrict__ grad, DST* __restrict__ out, \
                                  float scale, int64_t n) {                              \
    GRID_STRIDE_LOOP(i, n) { out[i] = from_f32<DST>(grad[i] * scale); }                  \
  }

#define UNPACK_GRAD_KERNEL(NAME, SRC)                                                   \
  extern "C" __global__ void NAME(const SRC* __restrict__ in, float* __restrict__ out,  \
                                  float scale, int64_t n) {                             \
    GRID_STRIDE_LOOP(i, n) { out[i] = to_f32(from_f32<SRC>(to_f32(in[i]) * scale)); }   \
  }

#define SUM_INTO_KERNEL(NAME, T)                                                            \
  extern "C" __global__ void NAME(T* __restrict__ acc, const T* __restrict__ x, int64_t n) { \
    GRID_STRIDE_LOOP(i, n) { acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(x[i])); }          \
  }

PACK_GRAD_KERNEL(pack_grad_f32, float)
PACK_GRAD_KERNEL(pack_grad_f16, __half)
UNPACK_GRAD_KERNEL(unpack_grad_f32, float)
UNPACK_GRAD_KERNEL(unpack_grad_f16, __half)
SUM_INTO_KERNEL(sum_into_f32, float)
SUM_INTO_KERNEL(sum_into_f16, __half)
#if FSDP_BF16
PACK_GRAD_KERNEL(pack_grad_bf16, __nv_bfloat16)
UNPACK_GRAD_KERNEL(unpack_grad_bf16, __nv_bfloat16)
SUM_INTO_KERNEL(sum_into_bf16, __nv_bfloat16)
#endif

extern "C" __global__ void scale_f32(float* __restrict__ x, float alpha, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { x[i] = x[i] * alpha; }
}

// sumsq_partial_f32(x (n) f32, partial (gridDim.x) f64, n)
//   partial[b] = sum over the elements block b visits of f64(x[i])^2            (overwrites)
//   The first pass of clip_grad_norm_'s squared 2-norm: the host adds the per-block partials
//   in f64, in block order (deterministic for a fixed grid). Launch with 256 threads.
extern "C" __global__ void sumsq_partial_f32(const float* __restrict__ x,
                                             double* __restrict__ partial, int64_t n) {
  __shared__ double acc[256];
  double s = 0.0;
  GRID_STRIDE_LOOP(i, n) {
    const double v = (double)x[i];
    s += v * v;
  }
  acc[threadIdx.x] = s;
  __syncthreads();
  for (unsigned int step = blockDim.x / 2; step > 0; step >>= 1) {
    if (threadIdx.x < step) acc[threadIdx.x] += acc[threadIdx.x + step];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = acc[0];
}
