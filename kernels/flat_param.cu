// flat_param.cu: the copies of FSDP's FlatParameter (FSDP1 flat_param.py): flattening
// parameters into one 1-D buffer, copying them back out, and the zero-padded shard copies.
// CPU references: backend::cpu::kernels::{copy, fill, pad_copy, flatten, unflatten}.
//
// copy_{dtype}(src (n), dst (n), n)            dst[i] = src[i]                  (overwrites)
//   Also the "plain device copy" the benchmarks measure every other kernel against.
// fill_{dtype}(dst (n), value, n)              dst[i] = value                   (overwrites)
// pad_copy_{dtype}(src (src_n), src_n, dst (dst_n), dst_n)
//   dst[i] = i < src_n ? src[i] : 0  for i in [0, dst_n)                       (overwrites)
//   A rank's shard: src = flat + c * rank, src_n = valid elements, dst_n = c.
// flatten_{dtype}(srcs (k ptrs), offsets (k + 1), dst, k)
//   dst[offsets[s] + j] = srcs[s][j]  for j < offsets[s+1] - offsets[s]          (overwrites)
// unflatten_{dtype}(src, dsts (k ptrs), offsets (k + 1), k)
//   dsts[s][j] = src[offsets[s] + j]                                            (overwrites)
// flatten/unflatten: blockIdx.y walks the segments (stride gridDim.y), x is grid-stride
// within one segment; pointer and offset tables live in device memory.
// dtype in {f32, bf16, f16, i32, f64}; kernels move bits, so bf16 needs no sm_80 guard here.
// copy, pad_copy, flatten and unflatten move 128-bit vectors where source and destination
// are both 16-byte aligned, with a scalar tail (map_elementwise in common.cuh).
#include "common.cuh"

// dst[i] = i < src_n ? src[i] : 0 for i in [0, dst_n): whole 128-bit vectors where both
// pointers are aligned (a vector that straddles src_n is filled element by element).
template <typename T>
__device__ inline void pad_copy_elements(const T* __restrict__ src, int64_t src_n,
                                         T* __restrict__ dst, int64_t dst_n) {
  constexpr int W = 16 / sizeof(T);
  T zero;
  memset(&zero, 0, sizeof(T));
  int64_t done = 0;
  if (is_aligned(src, 16) && is_aligned(dst, 16)) {
    const int64_t nv = dst_n / W;
    GRID_STRIDE_LOOP(j, nv) {
      const int64_t base = j * W;
      VecOf<T, W> b;
      if (base + W <= src_n) {
        b = reinterpret_cast<const VecOf<T, W>*>(src)[j];
      } else {
        for (int k = 0; k < W; ++k) b.v[k] = base + k < src_n ? src[base + k] : zero;
      }
      reinterpret_cast<VecOf<T, W>*>(dst)[j] = b;
    }
    done = nv * W;
  }
  GRID_STRIDE_LOOP(i, dst_n - done) {
    const int64_t k = done + i;
    dst[k] = k < src_n ? src[k] : zero;
  }
}

// The identity, for copies through map_elementwise.
template <typename T>
struct Same {
  __device__ T operator()(T v) const { return v; }
};

#define FLAT_PARAM_KERNELS(SUFFIX, T)                                                        \
  extern "C" __global__ void copy_##SUFFIX(const T* __restrict__ src, T* __restrict__ dst,  \
                                           int64_t n) {                                      \
    map_elementwise(src, dst, n, Same<T>());                                                 \
  }                                                                                          \
  extern "C" __global__ void fill_##SUFFIX(T* __restrict__ dst, T value, int64_t n) {       \
    GRID_STRIDE_LOOP(i, n) { dst[i] = value; }                                               \
  }                                                                                          \
  extern "C" __global__ void pad_copy_##SUFFIX(const T* __restrict__ src, int64_t src_n,    \
                                               T* __restrict__ dst, int64_t dst_n) {         \
    pad_copy_elements(src, src_n, dst, dst_n);                                               \
  }                                                                                          \
  extern "C" __global__ void flatten_##SUFFIX(const uint64_t* __restrict__ srcs,            \
                                              const int64_t* __restrict__ offsets,           \
                                              T* __restrict__ dst, int64_t k) {              \
    for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {                                    \
      const T* src = reinterpret_cast<const T*>(srcs[s]);                                    \
      int64_t base = offsets[s], len = offsets[s + 1] - base;                                \
      map_elementwise(src, dst + base, len, Same<T>());                                      \
    }                                                                                        \
  }                                                                                          \
  extern "C" __global__ void unflatten_##SUFFIX(const T* __restrict__ src,                  \
                                                const uint64_t* __restrict__ dsts,           \
                                                const int64_t* __restrict__ offsets,         \
                                                int64_t k) {                                 \
    for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {                                    \
      T* dst = reinterpret_cast<T*>(dsts[s]);                                                \
      int64_t base = offsets[s], len = offsets[s + 1] - base;                                \
      map_elementwise(src + base, dst, len, Same<T>());                                      \
    }                                                                                        \
  }

FLAT_PARAM_KERNELS(f32, float)
FLAT_PARAM_KERNELS(bf16, __nv_bfloat16)
FLAT_PARAM_KERNELS(f16, __half)
FLAT_PARAM_KERNELS(i32, int32_t)
FLAT_PARAM_KERNELS(f64, double)
