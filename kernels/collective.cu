// collective.cu: the reduction of the threads process group on device buffers (ranks are
// threads of one process whose tensors live on CUDA devices). CPU reference: the reduction
// of distributed::threads::kernels (`reduce`), which these kernels reproduce bit for bit.
//
// reduce_ranks_{dtype}(srcs (k ptrs), k, dsts (m ptrs), m, n, op)
//   for i in [0, n):  acc = f64(srcs[0][i]) (op) f64(srcs[1][i]) (op) ... (op) f64(srcs[k-1][i])
//                     (left to right, rank order; Avg divides acc by k afterwards)
//                     v = narrow<dtype>(acc)                       (one rounding, see below)
//                     dsts[d][i] = v  for every d in [0, m)         (overwrites, `=`)
//   op: 0 Sum, 1 Avg, 2 Max, 3 Min, 4 Product (distributed::ReduceOp, in that order).
//   narrow: f32 = (float)acc; bf16/f16 = round((float)acc), i.e. through f32 as
//   Element::from_f64 does; i32 = round half away from zero, saturating, NaN -> 0 (Rust's
//   `acc.round() as i32`); f64 = acc. Max/Min are IEEE maxNum/minNum like Rust's f64::max/min.
//   A destination may be one of the sources (in-place all-reduce and reduce-scatter): every
//   element is read from every source before it is written, by the same thread; so no
//   __restrict__ on these pointers.
//   The pointer tables live in device memory; every pointer addresses memory of the
//   launching device (sources of other devices are first copied to local scratch).
// dtype in {f32, bf16, f16, i32, f64}; the float conversions need no sm_80 arithmetic (bf16 is
// converted through f32 with the cuda_bf16.h intrinsics available on every target).
#include "common.cuh"

__device__ inline double widen(float v) { return (double)v; }
__device__ inline double widen(__half v) { return (double)__half2float(v); }
__device__ inline double widen(__nv_bfloat16 v) { return (double)__bfloat162float(v); }
__device__ inline double widen(int32_t v) { return (double)v; }
__device__ inline double widen(double v) { return v; }

template <typename T> __device__ inline T narrow(double v);
// (float)v on a double is round-to-nearest-even, as Rust's `v as f32`.
template <> __device__ inline float narrow<float>(double v) { return __double2float_rn(v); }
// f64: the f64 accumulator itself (no rounding), as the host reduction of f64 tensors.
template <> __device__ inline double narrow<double>(double v) { return v; }
template <> __device__ inline __half narrow<__half>(double v) {
  return __float2half_rn(__double2float_rn(v));
}
template <> __device__ inline __nv_bfloat16 narrow<__nv_bfloat16>(double v) {
  return __float2bfloat16_rn(__double2float_rn(v));
}
template <> __device__ inline int32_t narrow<int32_t>(double v) {
  if (isnan(v)) return 0;
  const double r = round(v);  // half away from zero, as f64::round
  if (r >= 2147483647.0) return 2147483647;
  if (r <= -2147483648.0) return (int32_t)(-2147483647 - 1);
  return (int32_t)r;
}

__device__ inline double combine(int op, double a, double b) {
  switch (op) {
    case 2: return fmax(a, b);
    case 3: return fmin(a, b);
    case 4: return a * b;
    default: return a + b;  // Sum, Avg
  }
}

#define REDUCE_RANKS_KERNEL(SUFFIX, T)                                                    \
  extern "C" __global__ void reduce_ranks_##SUFFIX(const uint64_t* __restrict__ srcs,     \
                                                   int64_t k,                             \
                                                   const uint64_t* __restrict__ dsts,     \
                                                   int64_t m, int64_t n, int32_t op) {    \
    GRID_STRIDE_LOOP(i, n) {                                                              \
      double acc = widen(reinterpret_cast<const T*>(srcs[0])[i]);                         \
      for (int64_t s = 1; s < k; ++s) {                                                   \
        acc = combine(op, acc, widen(reinterpret_cast<const T*>(srcs[s])[i]));            \
      }                                                                                   \
      if (op == 1) acc = acc / (double)k;                                                 \
      const T v = narrow<T>(acc);                                                         \
      for (int64_t d = 0; d < m; ++d) reinterpret_cast<T*>(dsts[d])[i] = v;               \
    }                                                                                     \
  }

REDUCE_RANKS_KERNEL(f32, float)
REDUCE_RANKS_KERNEL(bf16, __nv_bfloat16)
REDUCE_RANKS_KERNEL(f16, __half)
REDUCE_RANKS_KERNEL(i32, int32_t)
REDUCE_RANKS_KERNEL(f64, double)
