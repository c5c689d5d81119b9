// common.cuh: helpers shared by every kernel file.
// - ceil_div, the grid-stride loop macro, FSDP_BF16 (bf16 kernels only for sm_80+)
// - bf16/f16 <-> f32 conversions with round-to-nearest-even (cuda_bf16.h / cuda_fp16.h)
// - fsdp_exp / fsdp_erf: the same polynomials as the CPU reference
//   (backend::cpu::ops::exp, nn::activation::erf), so GELU and softmax match it bitwise
//   (build.rs compiles with --fmad=false: no a*b+c contraction, like Rust)
// - ROW_KERNEL: the launch bound of the one-block-per-row kernels
// - warp/block sum and max reductions (blockDim.x a multiple of 32, at most 1024)
// - map_elementwise: an elementwise map with 128-bit vector loads and stores where aligned
// - the per-dtype math of the kernels templated on the element type T (float, double):
//   k_exp/k_log/k_sqrt/k_max, is_f64<T>
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// bf16 arithmetic and conversions are native from sm_80 (A100) on; every target build.rs
// compiles for is >= sm_80, and the host pass (__CUDA_ARCH__ undefined) sees them too.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define FSDP_BF16 1
#else
#define FSDP_BF16 0
#endif

// Row kernels (one block per row) are launched with up to 1024 threads (row_block in
// src/backend/cuda/nn_ops.rs): promise the compiler that bound, so it keeps to the 64
// registers per thread a 1024-thread block may use instead of failing the launch with
// CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (ptxas reports 24 to 30 today).
#define ROW_KERNEL __launch_bounds__(1024)

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid-stride loop over [0, n): each thread visits i, i + gridDim.x * blockDim.x, ...
#define GRID_STRIDE_LOOP(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n); \
       i += (int64_t)gridDim.x * blockDim.x)

// ---- 128-bit vector access ------------------------------------------------------------
// VecOf<T, W>: W elements of T that move as one aligned load or store (W * sizeof(T) is 16
// bytes or less, so one ld/st.global.v4/v2 instruction instead of W scalar ones).
template <typename T, int W>
struct alignas(sizeof(T) * W) VecOf {
  T v[W];
};

// Elements per vector of an elementwise map from SRC to DST: 16 bytes of the wider type.
template <typename SRC, typename DST>
struct VecWidth {
  static constexpr int value = 16 / (sizeof(SRC) > sizeof(DST) ? sizeof(SRC) : sizeof(DST));
};

__host__ __device__ inline bool is_aligned(const void* p, uint64_t bytes) {
  return ((uint64_t)(uintptr_t)p % bytes) == 0;
}

// out[i] = f(in[i]) for i in [0, n), grid-stride over the launch. When `in` and `out` are
// both aligned to their vector size, whole vectors of VecWidth elements move with one load
// and one store each and the last n % W elements one by one; otherwise (a view at an odd
// element offset, such as a rank's shard of a flat parameter) every element one by one.
// f sees each element alone, so the results are the same bits either way.
template <typename SRC, typename DST, typename F>
__device__ inline void map_elementwise(const SRC* __restrict__ in, DST* __restrict__ out,
                                       int64_t n, F f) {
  constexpr int W = VecWidth<SRC, DST>::value;
  if (is_aligned(in, sizeof(SRC) * W) && is_aligned(out, sizeof(DST) * W)) {
    const int64_t nv = n / W;
    const VecOf<SRC, W>* vin = reinterpret_cast<const VecOf<SRC, W>*>(in);
    VecOf<DST, W>* vout = reinterpret_cast<VecOf<DST, W>*>(out);
    GRID_STRIDE_LOOP(j, nv) {
      const VecOf<SRC, W> a = vin[j];
      VecOf<DST, W> b;
      for (int k = 0; k < W; ++k) b.v[k] = f(a.v[k]);
      vout[j] = b;
    }
    const int64_t done = nv * W;
    GRID_STRIDE_LOOP(i, n - done) { out[done + i] = f(in[done + i]); }
  } else {
    GRID_STRIDE_LOOP(i, n) { out[i] = f(in[i]); }
  }
}

// Widening/narrowing conversions used by the macros that stamp out each dtype.
__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__half v) { return __half2float(v); }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_f32(double v) { return __double2float_rn(v); }

template <typename T> __device__ inline T from_f32(float v);
template <> __device__ inline float from_f32<float>(float v) { return v; }
template <> __device__ inline __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ inline __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ inline double from_f32<double>(float v) { return (double)v; }

// e^x as backend::cpu::ops::exp (Cephes expf): clamp, x = n ln2 + r, degree-6 polynomial,
// 2^n from the exponent bits. Same operations in the same order as the Rust reference.
__device__ inline float fsdp_exp(float x) {
  const float LOG2E = 1.44269504088896340736f;
  const float C1 = 0.6933594f;
  const float C2 = -2.1219444e-4f;
  const float MAGIC = 12582912.0f;  // 1.5 * 2^23: rounds to an integer in the low bits
  x = fminf(fmaxf(x, -87.3f), 88.3f);
  float z = x * LOG2E + MAGIC;
  float n = z - MAGIC;
  int k = __float_as_int(z) - __float_as_int(MAGIC);
  float r = x - n * C1 - n * C2;
  // Literals spelled as in the Rust reference, so both round to the same f32 values.
  float p = 1.9875691e-4f;
  p = p * r + 1.3981999e-3f;
  p = p * r + 8.333452e-3f;
  p = p * r + 4.1665796e-2f;
  p = p * r + 1.6666665e-1f;
  p = p * r + 0.5f;
  float y = p * r * r + r + 1.0f;
  return y * __int_as_float((k + 127) << 23);
}

// erf(x) as nn::activation::erf (Abramowitz & Stegun 7.1.26).
__device__ inline float fsdp_erf(float x) {
  const float P = 0.3275911f;  // literals as in the Rust reference
  float ax = fabsf(x);
  float t = 1.0f / (1.0f + P * ax);
  float poly = t * (0.2548296f + t * (-0.28449674f + t * (1.4214137f + t * (-1.4531521f + t * 1.0614054f))));
  float y = 1.0f - poly * fsdp_exp(-ax * ax);
  return copysignf(y, x);
}

// ---- math of the kernels templated on T in {float, double} -----------------------------
// f32: the CPU reference's polynomials (bitwise equal to it). f64: the C library's double
// functions, as the CPU's f64 ops call them (ops::double: Rust's f64::exp/ln and libm's
// erf): on the emulator the host's libm, on a GPU CUDA's (within 2 ulp). PyTorch computes
// float64 tensors in float64.
template <typename T>
constexpr bool is_f64 = sizeof(T) == 8;
__device__ inline float k_exp(float x) { return fsdp_exp(x); }
__device__ inline double k_exp(double x) { return exp(x); }
__device__ inline float k_erf(float x) { return fsdp_erf(x); }
__device__ inline double k_erf(double x) { return erf(x); }
__device__ inline float k_log(float x) { return logf(x); }
__device__ inline double k_log(double x) { return log(x); }
__device__ inline float k_sqrt(float x) { return sqrtf(x); }
__device__ inline double k_sqrt(double x) { return sqrt(x); }
__device__ inline float k_max(float a, float b) { return fmaxf(a, b); }
__device__ inline double k_max(double a, double b) { return fmax(a, b); }

template <typename T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ inline T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = k_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of v over the block, returned to every thread. `shared` holds 32 values. Ends with a
// barrier, so the caller may reuse `shared` right after.
template <typename T>
__device__ inline T block_sum(T v, T* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T t = lane < nwarps ? shared[lane] : (T)0;
  t = warp_sum(t);
  __syncthreads();
  return t;
}

// Max of v over the block, returned to every thread; as block_sum.
template <typename T>
__device__ inline T block_max(T v, T* shared) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T t = lane < nwarps ? shared[lane] : (T)-INFINITY;
  t = warp_max(t);
  __syncthreads();
  return t;
}
