// cuda_emu.h: what kernels/*.cu need from CUDA, for compiling them as host C++ (g++) and
// running them on the CPU through the emulated driver of this crate. Included through the
// stand-in <cuda_fp16.h>/<cuda_bf16.h> of this directory, so the kernel sources are compiled
// unchanged.
//
// Execution model (runtime.cpp): a launch runs its blocks one after another on the calling
// thread; within a block each CUDA thread is a fiber (our own stack switch, runtime.cpp) that runs until it reaches
// a barrier (__syncthreads, or a warp shuffle, which exchanges through the block) or ends.
// A kernel whose body has no barrier (build.rs reads it) runs each thread as a plain call. `__shared__` variables are `static thread_local`: one copy per
// OS thread, shared by the fibers of the block that thread is running.
//
// Semantics kept from the device: f32 arithmetic without contraction (compiled with
// -ffp-contract=off, as build.rs passes --fmad=false to nvcc), round-to-nearest-even
// conversions to bf16/f16 (any NaN becomes the canonical 0x7fff, overflow goes to
// infinity), atomics.
// Not kept: the device's ulp errors of logf/expf (the host libm's are used), and any
// concurrency between threads or streams (everything is sequential).
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <cmath>

using std::isnan;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct dim3 {
  unsigned int x, y, z;
};

// The running CUDA thread's coordinates: one small plain struct (no TLS init wrapper).
// Kernels read these in every loop; build.rs compiles with TLS descriptors
// (-mtls-dialect=gnu2), so glibc can place it in static TLS even though the library is
// dlopen'ed, and a read costs no __tls_get_addr call.
struct EmuCoords {
  dim3 thread, block, block_dim, grid_dim;
};
extern thread_local EmuCoords emu_coords;
#define threadIdx (emu_coords.thread)
#define blockIdx (emu_coords.block)
#define blockDim (emu_coords.block_dim)
#define gridDim (emu_coords.grid_dim)

extern "C" void emu_barrier(void);

inline void __syncthreads() { emu_barrier(); }

// ---- 16-bit floats: bit containers with round-to-nearest-even conversions --------------
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

inline uint32_t emu_f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float emu_u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

inline float __bfloat162float(__nv_bfloat16 h) { return emu_u2f((uint32_t)h.bits << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = emu_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};  // the device's canonical NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}

inline float __half2float(__half h) {
  uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu;
  if (exp == 0x1f) return emu_u2f(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return emu_u2f(sign);
    float v = (float)man * (1.0f / 16777216.0f);  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return emu_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

inline __half __float2half_rn(float f) {
  uint32_t u = emu_f2u(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return __half{0x7fff};  // the device's canonical NaN
  if (a >= 0x477ff000u) return __half{(uint16_t)(sign | 0x7c00u)};  // rounds to >= 65536: inf
  if (a < 0x38800000u) {  // below 2^-14: subnormal half (or zero), round to nearest even
    float v = emu_u2f(a) * 16777216.0f;  // in units of 2^-24, exact (power-of-two scale)
    float r = nearbyintf(v);              // default rounding mode: nearest even
    return __half{(uint16_t)(sign | (uint16_t)r)};
  }
  uint32_t e = (a >> 23) - 112u, m = a & 0x7fffffu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // may carry into exponent
  return __half{(uint16_t)(sign | h)};
}

inline float __double2float_rn(double d) { return (float)d; }
inline int __float_as_int(float f) { return (int)emu_f2u(f); }
inline float __int_as_float(int i) { return emu_u2f((uint32_t)i); }

// ---- warp shuffles: exchanged through per-block slots, one barrier per shuffle -----------
// Two slot arrays, alternating with each thread's shuffle count: a lane can only write the
// array of shuffle k again at shuffle k + 2, after the barrier of shuffle k + 1, which every
// lane reaches only after reading shuffle k.
extern "C" uint64_t* emu_shuffle_slots(void);  // the slots of this thread's next shuffle
// Aborts naming the kernel: a full-mask shuffle in a block with a partial warp names lanes
// that do not exist (undefined on the device).
extern "C" void emu_partial_warp_shuffle(void);

template <typename T>
inline T __shfl_xor_sync(unsigned int /*mask*/, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  if (blockDim.x % 32 != 0) emu_partial_warp_shuffle();
  uint64_t* slots = emu_shuffle_slots();
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  slots[threadIdx.x] = bits;
  emu_barrier();
  unsigned int src = threadIdx.x ^ (unsigned int)lane_mask;
  T r = v;  // a lane outside the block keeps its own value
  if (src < blockDim.x) memcpy(&r, &slots[src], sizeof(T));
  return r;
}

// ---- atomics (other OS threads may run kernels at the same time) --------------------------
inline float atomicAdd(float* p, float v) {
  uint32_t* u = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(u, &old, emu_f2u(emu_u2f(old) + v), false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return emu_u2f(old);
}
inline double atomicAdd(double* p, double v) {
  uint64_t* u = reinterpret_cast<uint64_t*>(p);
  uint64_t old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    double o, r;
    memcpy(&o, &old, 8);
    r = o + v;
    uint64_t nu;
    memcpy(&nu, &r, 8);
    if (__atomic_compare_exchange_n(u, &old, nu, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return o;
  }
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  unsigned long long old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
