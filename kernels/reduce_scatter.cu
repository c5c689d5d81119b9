// reduce_scatter.cu: the gradient side of FSDP's post-backward (FSDP1 _post_backward_hook,
// _reduce_grad). CPU references: backend::cpu::kernels::{pack_grad, unpack_grad, sum_into,
// scale}; the runtime's reduction (fsdp::runtime::issue_reduce) does the same steps.
//
// pack_grad_{dtype}(grad (n) f32, out (n) dtype, scale, n)
//   out[i] = cast<dtype>(grad[i] * scale)                                       (overwrites)
//   Fused predivide (scale = 1 / pre) and cast to reduce_dtype of the flat gradient, padded
//   to shard_numel * world: the reduce-scatter input, with no gather (the flat gradient
//   already has the FlatParameter's layout).
// pack_grad_{src}_{dtype}(grad (n) src, out (n) dtype, scale, n), src in {f16, bf16}
//   out[i] = cast<dtype>(f32(grad[i]) * scale)                                  (overwrites)
//   The same for the param_dtype gradient of low-precision compute: the cast to
//   reduce_dtype fused with the predivide.
// unpack_grad_{dtype}(in (n) dtype, out (n) f32, scale, n)
//   out[i] = f32(cast<dtype>(f32(in[i]) * scale))                               (overwrites)
//   Fused postdivide (scale = 1 / post) in reduce_dtype and upcast of the reduced shard.
// sum_into_{dtype}(acc (n), x (n), n)
//   acc[i] = cast<dtype>(f32(acc[i]) + f32(x[i]))                               (accumulates)
//   The threads backend's reduction on device buffers: one rounding per added rank.
//   sum_into_f64: acc[i] = acc[i] + x[i] in f64.
// add_{dtype}(a (n), b (n), out (n), n)
//   out[i] = cast<dtype>(f32(a[i]) + f32(b[i]))        (=; add_f64: a[i] + b[i] in f64)
//   `torch.add` of two tensors (ops::add): sum_into's rounding, out of place, so a
//   residual add is one launch rather than a copy and a sum_into.
// scale_{f32,f64}(x (n), alpha, n)      x[i] = x[i] * alpha                    (in place)
// div_scale_f64(x (n) f64, out (n) f64, factor, divide, n)
//   out[i] = divide ? x[i] / factor : x[i] * factor                    (=; out may be x)
//   The f64 FlatParameter's pack and unpack (ops::flat: PyTorch FSDP reduces an f64
//   gradient in f64, dividing by the divide factor).
// dtype in {f32, f16, bf16}; bf16 behind FSDP_BF16 (sm_80+). pack/unpack use 128-bit
// vector loads and stores where aligned (map_elementwise in common.cuh).
#include "common.cuh"

#define PACK_GRAD_KERNEL(NAME, DST)                                                      \
  extern "C" __global__ void NAME(const float* __restrict__ grad, DST* __restrict__ out, \
                                  float scale, int64_t n) {                              \
    map_elementwise(grad, out, n, [=](float g) { return from_f32<DST>(g * scale); });    \
  }

#define PACK_GRAD_LP_KERNEL(NAME, SRC, DST)                                             \
  extern "C" __global__ void NAME(const SRC* __restrict__ grad, DST* __restrict__ out,   \
                                  float scale, int64_t n) {                              \
    map_elementwise(grad, out, n,                                                        \
                    [=](SRC g) { return from_f32<DST>(to_f32(g) * scale); });            \
  }

#define UNPACK_GRAD_KERNEL(NAME, SRC)                                                   \
  extern "C" __global__ void NAME(const SRC* __restrict__ in, float* __restrict__ out,  \
                                  float scale, int64_t n) {                             \
    map_elementwise(in, out, n,                                                         \
                    [=](SRC v) { return to_f32(from_f32<SRC>(to_f32(v) * scale)); });   \
  }

#define SUM_INTO_KERNEL(NAME, T)                                                            \
  extern "C" __global__ void NAME(T* __restrict__ acc, const T* __restrict__ x, int64_t n) { \
    GRID_STRIDE_LOOP(i, n) { acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(x[i])); }          \
  }

#define ADD_KERNEL(NAME, T)                                                                  \
  extern "C" __global__ void NAME(const T* __restrict__ a, const T* __restrict__ b,         \
                                  T* __restrict__ out, int64_t n) {                         \
    GRID_STRIDE_LOOP(i, n) { out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i])); }            \
  }

PACK_GRAD_KERNEL(pack_grad_f32, float)
PACK_GRAD_KERNEL(pack_grad_f16, __half)
PACK_GRAD_LP_KERNEL(pack_grad_f16_f32, __half, float)
PACK_GRAD_LP_KERNEL(pack_grad_f16_f16, __half, __half)
UNPACK_GRAD_KERNEL(unpack_grad_f32, float)
UNPACK_GRAD_KERNEL(unpack_grad_f16, __half)
SUM_INTO_KERNEL(sum_into_f32, float)
SUM_INTO_KERNEL(sum_into_f16, __half)
ADD_KERNEL(add_f32, float)
ADD_KERNEL(add_f16, __half)
// f64: acc[i] = acc[i] + x[i] in f64 (Tensor.add_ of f64 tensors).
extern "C" __global__ void sum_into_f64(double* __restrict__ acc, const double* __restrict__ x,
                                        int64_t n) {
  GRID_STRIDE_LOOP(i, n) { acc[i] = acc[i] + x[i]; }
}
extern "C" __global__ void add_f64(const double* __restrict__ a, const double* __restrict__ b,
                                   double* __restrict__ out, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { out[i] = a[i] + b[i]; }
}
#if FSDP_BF16
PACK_GRAD_KERNEL(pack_grad_bf16, __nv_bfloat16)
PACK_GRAD_LP_KERNEL(pack_grad_bf16_f32, __nv_bfloat16, float)
PACK_GRAD_LP_KERNEL(pack_grad_bf16_bf16, __nv_bfloat16, __nv_bfloat16)
PACK_GRAD_LP_KERNEL(pack_grad_f16_bf16, __half, __nv_bfloat16)
PACK_GRAD_LP_KERNEL(pack_grad_bf16_f16, __nv_bfloat16, __half)
UNPACK_GRAD_KERNEL(unpack_grad_bf16, __nv_bfloat16)
SUM_INTO_KERNEL(sum_into_bf16, __nv_bfloat16)
ADD_KERNEL(add_bf16, __nv_bfloat16)
#endif

#define SCALE_KERNEL(S, T)                                                  \
  extern "C" __global__ void scale_##S(T* __restrict__ x, T alpha, int64_t n) { \
    GRID_STRIDE_LOOP(i, n) { x[i] = x[i] * alpha; }                          \
  }
SCALE_KERNEL(f32, float)
SCALE_KERNEL(f64, double)

// No __restrict__: out may be x (in place), each element read and written by one thread.
extern "C" __global__ void div_scale_f64(const double* x, double* out, double factor,
                                         int32_t divide, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { out[i] = divide ? x[i] / factor : x[i] * factor; }
}

// sumsq_partial_{f32,f64}(x (n), partial (gridDim.x) f64, n)
//   partial[b] = sum over the elements block b visits of f64(x[i])^2            (overwrites)
//   The first pass of clip_grad_norm_'s squared 2-norm: the host adds the per-block partials
//   in f64, in block order (deterministic for a fixed grid). Launch with 256 threads.
template <typename T>
__device__ inline void sumsq_partial_synced(const T* __restrict__ x, double* __restrict__ partial,
                                            int64_t n) {
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
#define SUMSQ_KERNEL(S, T)                                                              \
  extern "C" __global__ void sumsq_partial_##S(const T* __restrict__ x,                 \
                                               double* __restrict__ partial, int64_t n) { \
    sumsq_partial_synced<T>(x, partial, n);                                             \
  }
SUMSQ_KERNEL(f32, float)
SUMSQ_KERNEL(f64, double)

// The same over a list of tensors in one launch (clip_grad_norm_ over every unit's shard):
// sumsq_partial_multi_{f32,f64}(xs (k) Segment, k, partial (k * gridDim.x) f64)
//   partial[s * gridDim.x + b] = sumsq_partial of xs[s], block b       (overwrites)
//   blockIdx.y walks the tensors (stride gridDim.y): each tensor's partials are those of
//   its own sumsq_partial launch with gridDim.x blocks, bit for bit.
struct Segment {
  void* p;
  int64_t n;
};
template <typename T>
__device__ inline void sumsq_partial_multi_synced(const Segment* __restrict__ xs, int64_t k,
                                                  double* __restrict__ partial) {
  for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {
    sumsq_partial_synced<T>(static_cast<const T*>(xs[s].p), partial + s * gridDim.x, xs[s].n);
    // Before the next tensor's partial reuses the shared sums.
    __syncthreads();
  }
}
#define SUMSQ_MULTI_KERNEL(S, T)                                                              \
  extern "C" __global__ void sumsq_partial_multi_##S(const Segment* __restrict__ xs,          \
                                                     int64_t k, double* __restrict__ partial) { \
    sumsq_partial_multi_synced<T>(xs, k, partial);                                            \
  }
SUMSQ_MULTI_KERNEL(f32, float)
SUMSQ_MULTI_KERNEL(f64, double)

// sumsq_fold_multi_f64(partial (k * nblocks) f64, k, nblocks, acc (1) f64, out (1) f32)
//   a = 0; per tensor s in order: a += (((0 + partial[s, 0]) + partial[s, 1]) + ...);
//   acc[0] = a (overwrites); out[0] = f32(a) unless out is null. One thread: the order of
//   a zeroed acc folded with sumsq_fold_f64 once per tensor, then narrow_f64_f32.
extern "C" __global__ void sumsq_fold_multi_f64(const double* __restrict__ partial, int64_t k,
                                                int64_t nblocks, double* __restrict__ acc,
                                                float* __restrict__ out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double a = 0.0;
  for (int64_t s = 0; s < k; ++s) {
    double t = 0.0;
    for (int64_t b = 0; b < nblocks; ++b) t += partial[s * nblocks + b];
    a += t;
  }
  acc[0] = a;
  if (out != nullptr) out[0] = (float)a;
}

// The rest of clip_grad_norm_ on the device (PyTorch's way: no host read of the norm).
// sumsq_fold_f64(partial (nblocks) f64, nblocks, acc (1) f64)
//   acc[0] += (((0 + partial[0]) + partial[1]) + ...)        one thread; the host's order
extern "C" __global__ void sumsq_fold_f64(const double* __restrict__ partial, int64_t nblocks,
                                          double* __restrict__ acc) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) s += partial[b];
  acc[0] += s;
}

// narrow_f64_f32(x (1) f64, out (1) f32)      out[0] = f32(x[0])
// widen_f32_f64(x (1) f32, out (1) f64)       out[0] = f64(x[0])
extern "C" __global__ void narrow_f64_f32(const double* __restrict__ x, float* __restrict__ out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = (float)x[0];
}
extern "C" __global__ void widen_f32_f64(const float* __restrict__ x, double* __restrict__ out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) out[0] = (double)x[0];
}

// clip_coef_f32(sumsq (1) f64, total (1) f32, max_norm, norm (1) f32, coef (1) f32)
//   s = total ? f64(total[0]) : sumsq[0] (the all-reduced f32 sum read directly: no
//   widen_f32_f64 launch before this one);
//   norm[0] = f32(sqrt(s)); coef[0] = min(max_norm / (norm[0] + 1e-6), 1)           (f32)
extern "C" __global__ void clip_coef_f32(const double* __restrict__ sumsq,
                                         const float* __restrict__ total32, float max_norm,
                                         float* __restrict__ norm, float* __restrict__ coef) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const double s = total32 != nullptr ? (double)total32[0] : sumsq[0];
  const float total = (float)sqrt(s);
  norm[0] = total;
  coef[0] = fminf(max_norm / (total + 1e-6f), 1.0f);
}

// clip_coef_f64(sumsq (1) f64, total (1) f32, max_norm, norm (1) f32, coef (1) f64)
//   s as clip_coef_f32's; total = sqrt(s); norm[0] = f32(total);
//   coef[0] = min(max_norm / (total + 1e-6), 1) in f64 (fsdp::grad's host path for f64
//   gradients; max_norm the f64 it spells)
extern "C" __global__ void clip_coef_f64(const double* __restrict__ sumsq,
                                         const float* __restrict__ total32, double max_norm,
                                         float* __restrict__ norm, double* __restrict__ coef) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const double total = sqrt(total32 != nullptr ? (double)total32[0] : sumsq[0]);
  norm[0] = (float)total;
  coef[0] = fmin(max_norm / (total + 1e-6), 1.0);
}

// scale_by_{f32,f64}(x (n), alpha (1), n)      x[i] = x[i] * alpha[0]            (in place)
#define SCALE_BY_KERNEL(S, T)                                                             \
  extern "C" __global__ void scale_by_##S(T* __restrict__ x, const T* __restrict__ alpha, \
                                          int64_t n) {                                    \
    const T a = alpha[0];                                                                 \
    GRID_STRIDE_LOOP(i, n) { x[i] = x[i] * a; }                                           \
  }
SCALE_BY_KERNEL(f32, float)
SCALE_BY_KERNEL(f64, double)

// scale_by_multi_{f32,f64}(xs (k) Segment, k, alpha (1))
//   xs[s][i] = xs[s][i] * alpha[0] for every tensor (blockIdx.y walks them)   (in place)
#define SCALE_BY_MULTI_KERNEL(S, T)                                                        \
  extern "C" __global__ void scale_by_multi_##S(const Segment* __restrict__ xs, int64_t k, \
                                                const T* __restrict__ alpha) {             \
    const T a = alpha[0];                                                                  \
    for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {                                  \
      T* x = static_cast<T*>(xs[s].p);                                                     \
      GRID_STRIDE_LOOP(i, xs[s].n) { x[i] = x[i] * a; }                                    \
    }                                                                                      \
  }
SCALE_BY_MULTI_KERNEL(f32, float)
SCALE_BY_MULTI_KERNEL(f64, double)
