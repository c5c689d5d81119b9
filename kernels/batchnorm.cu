// batchnorm.cu: BatchNorm1d (F.batch_norm) over x (N, C, L), an (N, C) input being L = 1:
// the batch or running statistics with the running-stats update, the output, and the
// backward. x[i, k, j] sits at (i C + k) L + j; m = N L values per channel. CPU references,
// the same operations in the same order (so results are theirs bit for bit):
// src/ops/batchnorm/host.rs (f32/f64) and src/ops/lowp/batchnorm.rs (bf16/f16, PyTorch's
// reduced-precision CPU kernel). No fused multiply-add but the explicit fmaf of the bf16/f16
// formulas (build.rs: --fmad=false).
//
// Channel kernels (batchnorm_stats_*, batchnorm_bwd_stats_*) run one thread per channel k,
// which walks its m values in the CPU's order (i, then j): C threads, each a strided walk
// over N L values, which is the shape of BatchNorm1d's inputs (C small next to N L) and
// keeps the CPU's summation order. Elementwise kernels (batchnorm_fwd_*, batchnorm_bwd_dx_*)
// run one thread per element. Optional tensors are null pointers: w, b (no affine: 1, 0),
// rm, rv (no running stats), count (momentum given), dw, db (frozen or absent).
//
// f32 / f64, T = float / double (every channel tensor of dtype T); statistics in f64:
// batchnorm_stats_{t}(x, rm, rv, count, factor, eps, stats (2, C) f64, n, c, l, batch)
//   batch: mean = sum x / m, var = sum (x - mean)^2 / m, and rm, rv (+ given) become
//   (1 - f) rm + f mean, (1 - f) rv + f var m / (m - 1) with f = 1 / *count or factor;
//   else mean = rm, var = rv.  stats = (mean, rstd = 1 / sqrt(var + eps))               (=)
// batchnorm_fwd_{t}(x, w, b, stats, y, n, c, l): y = (x - mean) rstd w + b             (=)
// batchnorm_bwd_stats_{t}(x, dy, stats, sums (2, C) f64, dw, db, n, c, l):
//   sums = (sum dy, sum dy xhat), xhat = (x - mean) rstd (=); dw += sum dy xhat,
//   db += sum dy (+=)
// batchnorm_bwd_dx_{t}(x, dy, w, stats, sums, dx, n, c, l, batch):
//   dx = w rstd (dy - sum dy / m - xhat sum(dy xhat) / m), or w rstd dy                 (=)
//
// bf16 / f16, T = the input's dtype, P = the weight's (T or f32), R = the running stats'
// (T or f32); f32 arithmetic, sums as lp_chan_sum; rp rounds to P, rs to the statistics'
// dtype (P for bf16, f32 for f16):
// batchnorm_stats_lp_{t}_{p}_{r}(x, rm, rv, count, factor, eps, stats (3, C) f32, n, c, l,
//   batch): stats = (saved mean, invstd, the backward's invstd), rm, rv updated (=)
// batchnorm_fwd_lp_{t}_{p}(x, w, b, stats, y, n, c, l): y = r(fma(x, alpha, beta))     (=)
// batchnorm_bwd_stats_lp_{t}_{p}(x, dy, stats, sums (2, C) f32, dw, db, n, c, l):
//   sums = (sum dy, sum (x - mean) dy) (=); dw += rp(dot invstd), db += rp(sum dy) (+=)
// batchnorm_bwd_dx_lp_{t}_{p}(x, dy, w, stats, sums, dx, n, c, l, batch)               (=)
//
// batchnorm_count_i64(count): *count += 1 (num_batches_tracked, one thread)            (+=)
#include "common.cuh"

// ---- f32 / f64 ----------------------------------------------------------------------------

template <typename T>
__device__ inline double bn_opt(const T* p, int64_t k, double fill) {
  return p ? (double)p[k] : fill;
}

template <typename T>
__device__ inline void bn_stats(const T* __restrict__ x, T* __restrict__ rm, T* __restrict__ rv,
                                const int64_t* __restrict__ count, double factor, double eps,
                                double* __restrict__ stats, int64_t n, int64_t c, int64_t l,
                                int batch) {
  const double m = (double)(n * l);
  GRID_STRIDE_LOOP(k, c) {
    double mean, var;
    if (batch) {
      double s = 0.0;
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < l; j++) s += (double)x[(i * c + k) * l + j];
      mean = s / m;
      double q = 0.0;
      for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < l; j++) {
          const double d = (double)x[(i * c + k) * l + j] - mean;
          q += d * d;
        }
      var = q / m;
      if (rm) {
        const double f = count ? 1.0 / (double)*count : factor;
        const double unbias = m / (m - 1.0);
        rm[k] = (T)((1.0 - f) * (double)rm[k] + f * mean);
        rv[k] = (T)((1.0 - f) * (double)rv[k] + f * var * unbias);
      }
    } else {
      mean = (double)rm[k];
      var = (double)rv[k];
    }
    stats[k] = mean;
    stats[c + k] = 1.0 / sqrt(var + eps);
  }
}

template <typename T>
__device__ inline void bn_fwd(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ b, const double* __restrict__ stats,
                              T* __restrict__ y, int64_t n, int64_t c, int64_t l) {
  GRID_STRIDE_LOOP(p, n * c * l) {
    const int64_t k = (p / l) % c;
    const double xhat = ((double)x[p] - stats[k]) * stats[c + k];
    y[p] = (T)(xhat * bn_opt(w, k, 1.0) + bn_opt(b, k, 0.0));
  }
}

template <typename T>
__device__ inline void bn_bwd_stats(const T* __restrict__ x, const T* __restrict__ dy,
                                    const double* __restrict__ stats, double* __restrict__ sums,
                                    T* __restrict__ dw, T* __restrict__ db, int64_t n,
                                    int64_t c, int64_t l) {
  GRID_STRIDE_LOOP(k, c) {
    const double mean = stats[k], rstd = stats[c + k];
    double sdy = 0.0, sdx = 0.0;
    for (int64_t i = 0; i < n; i++)
      for (int64_t j = 0; j < l; j++) {
        const int64_t p = (i * c + k) * l + j;
        const double g = (double)dy[p];
        sdy += g;
        sdx += g * (((double)x[p] - mean) * rstd);
      }
    sums[k] = sdy;
    sums[c + k] = sdx;
    if (dw) dw[k] = (T)((double)dw[k] + sdx);
    if (db) db[k] = (T)((double)db[k] + sdy);
  }
}

template <typename T>
__device__ inline void bn_bwd_dx(const T* __restrict__ x, const T* __restrict__ dy,
                                 const T* __restrict__ w, const double* __restrict__ stats,
                                 const double* __restrict__ sums, T* __restrict__ dx, int64_t n,
                                 int64_t c, int64_t l, int batch) {
  const double m = (double)(n * l);
  GRID_STRIDE_LOOP(p, n * c * l) {
    const int64_t k = (p / l) % c;
    const double g = bn_opt(w, k, 1.0) * stats[c + k];
    const double d = (double)dy[p];
    if (batch) {
      const double xhat = ((double)x[p] - stats[k]) * stats[c + k];
      dx[p] = (T)(g * (d - sums[k] / m - xhat * sums[c + k] / m));
    } else {
      dx[p] = (T)(g * d);
    }
  }
}

#define BN_WIDE(TN, T)                                                                       \
  extern "C" __global__ void batchnorm_stats_##TN(                                           \
      const T* x, T* rm, T* rv, const int64_t* count, double factor, double eps,             \
      double* stats, int64_t n, int64_t c, int64_t l, int batch) {                           \
    bn_stats<T>(x, rm, rv, count, factor, eps, stats, n, c, l, batch);                       \
  }                                                                                          \
  extern "C" __global__ void batchnorm_fwd_##TN(const T* x, const T* w, const T* b,          \
                                                const double* stats, T* y, int64_t n,        \
                                                int64_t c, int64_t l) {                      \
    bn_fwd<T>(x, w, b, stats, y, n, c, l);                                                   \
  }                                                                                          \
  extern "C" __global__ void batchnorm_bwd_stats_##TN(const T* x, const T* dy,               \
                                                      const double* stats, double* sums,     \
                                                      T* dw, T* db, int64_t n, int64_t c,    \
                                                      int64_t l) {                           \
    bn_bwd_stats<T>(x, dy, stats, sums, dw, db, n, c, l);                                    \
  }                                                                                          \
  extern "C" __global__ void batchnorm_bwd_dx_##TN(const T* x, const T* dy, const T* w,      \
                                                   const double* stats, const double* sums,  \
                                                   T* dx, int64_t n, int64_t c, int64_t l,   \
                                                   int batch) {                              \
    bn_bwd_dx<T>(x, dy, w, stats, sums, dx, n, c, l, batch);                                 \
  }

BN_WIDE(f32, float)
BN_WIDE(f64, double)

// ---- bf16 / f16 ---------------------------------------------------------------------------

// PyTorch's vector loads along L (AVX2 build): blocks of 16 values into an 8-lane f32
// accumulator, lanes added in order at the end (lowp/batchnorm.rs: BLOCK, LANES).
#define BN_BLOCK 16
#define BN_LANES 8

// The channel's sum of a b over its m values, each product fused into its addition
// (lowp/batchnorm.rs chan_sum); f(i, j, a, b) gives the pair of x[i, k, j]'s position.
template <typename F>
__device__ inline float lp_chan_sum(int64_t nn, int64_t ll, F f) {
  const int64_t vec_end = ll / BN_BLOCK * BN_BLOCK;
  float lanes[BN_LANES];
  for (int q = 0; q < BN_LANES; q++) lanes[q] = 0.0f;
  float s = 0.0f;
  for (int64_t i = 0; i < nn; i++) {
    for (int64_t j = 0; j < vec_end; j++) {
      float a, b;
      f(i, j, a, b);
      lanes[j % BN_LANES] = fmaf(a, b, lanes[j % BN_LANES]);
    }
    for (int64_t j = vec_end; j < ll; j++) {
      float a, b;
      f(i, j, a, b);
      s = fmaf(a, b, s);
    }
  }
  float t = lanes[0];
  for (int q = 1; q < BN_LANES; q++) t += lanes[q];
  return s + t;
}

// v rounded to P (float: unchanged).
template <typename P>
__device__ inline float lp_round(float v) {
  return to_f32(from_f32<P>(v));
}

// The statistics' dtype: f32 for an f16 input, P for bf16 (lowp/batchnorm.rs stats_dtype).
template <typename T, typename P>
struct LpStats {
  typedef P type;
};
template <typename P>
struct LpStats<__half, P> {
  typedef float type;
};

template <typename T>
__device__ inline float lp_opt(const T* p, int64_t k, float fill) {
  return p ? to_f32(p[k]) : fill;
}

template <typename T, typename P, typename R>
__device__ inline void lp_stats(const T* __restrict__ x, R* __restrict__ rm, R* __restrict__ rv,
                                const int64_t* __restrict__ count, double factor, double eps,
                                float* __restrict__ stats, int64_t n, int64_t c, int64_t l,
                                int batch) {
  typedef typename LpStats<T, P>::type S;
  const int64_t m = n * l;
  GRID_STRIDE_LOOP(k, c) {
    const T* xk = x + k * l;
    if (batch) {
      const float mean = lp_chan_sum(n, l, [&](int64_t i, int64_t j, float& a, float& b) {
                           a = to_f32(xk[i * c * l + j]);
                           b = 1.0f;
                         }) /
                         (float)m;
      const float mean_t = lp_round<S>(mean);
      const float mu = l > 1 ? mean : mean_t;
      const float var_sum =
          lp_round<S>(lp_chan_sum(n, l, [&](int64_t i, int64_t j, float& a, float& b) {
            a = to_f32(xk[i * c * l + j]) - mu;
            b = a;
          }));
      const float inv = lp_round<P>(
          1.0f / sqrtf(lp_round<S>(var_sum / lp_round<S>((float)m)) + (float)eps));
      if (rm) {
        const float f = lp_round<S>((float)(count ? 1.0 / (double)*count : factor));
        const float g = lp_round<S>(1.0f - f);
        const float r0 = to_f32(rm[k]), v0 = to_f32(rv[k]);
        rm[k] = from_f32<R>(
            lp_round<P>(lp_round<S>(lp_round<S>(f * mean_t) + lp_round<S>(g * r0))));
        const float unbiased = lp_round<S>(var_sum / lp_round<S>((float)(m - 1)));
        rv[k] = from_f32<R>(lp_round<P>(lp_round<S>(f * unbiased + lp_round<S>(g * v0))));
      }
      stats[k] = lp_round<P>(mean_t);
      stats[c + k] = inv;
      stats[2 * c + k] = inv;
    } else {
      const float v = to_f32(rv[k]);
      stats[k] = to_f32(rm[k]);
      stats[c + k] = 1.0f / sqrtf(v + (float)eps);
      stats[2 * c + k] = (float)(1.0 / sqrt((double)v + eps));
    }
  }
}

template <typename T, typename P>
__device__ inline void lp_fwd(const T* __restrict__ x, const P* __restrict__ w,
                              const P* __restrict__ b, const float* __restrict__ stats,
                              T* __restrict__ y, int64_t n, int64_t c, int64_t l) {
  GRID_STRIDE_LOOP(p, n * c * l) {
    const int64_t k = (p / l) % c;
    const float alpha = stats[c + k] * lp_opt(w, k, 1.0f);
    const float beta = lp_opt(b, k, 0.0f) - stats[k] * alpha;
    y[p] = from_f32<T>(fmaf(to_f32(x[p]), alpha, beta));
  }
}

template <typename T, typename P>
__device__ inline void lp_bwd_stats(const T* __restrict__ x, const T* __restrict__ dy,
                                    const float* __restrict__ stats, float* __restrict__ sums,
                                    P* __restrict__ dw, P* __restrict__ db, int64_t n,
                                    int64_t c, int64_t l) {
  GRID_STRIDE_LOOP(k, c) {
    const float mean = stats[k], inv = stats[2 * c + k];
    const T* xk = x + k * l;
    const T* gk = dy + k * l;
    const float s = lp_chan_sum(n, l, [&](int64_t i, int64_t j, float& a, float& b) {
      a = to_f32(gk[i * c * l + j]);
      b = 1.0f;
    });
    const float dot = lp_chan_sum(n, l, [&](int64_t i, int64_t j, float& a, float& b) {
      a = to_f32(xk[i * c * l + j]) - mean;
      b = to_f32(gk[i * c * l + j]);
    });
    sums[k] = s;
    sums[c + k] = dot;
    // dw += rp(dot invstd) as the host's f64 accumulation, rounded through f32.
    if (dw) dw[k] = from_f32<P>((float)((double)to_f32(dw[k]) + (double)lp_round<P>(dot * inv)));
    if (db) db[k] = from_f32<P>((float)((double)to_f32(db[k]) + (double)lp_round<P>(s)));
  }
}

template <typename T, typename P>
__device__ inline void lp_bwd_dx(const T* __restrict__ x, const T* __restrict__ dy,
                                 const P* __restrict__ w, const float* __restrict__ stats,
                                 const float* __restrict__ sums, T* __restrict__ dx, int64_t n,
                                 int64_t c, int64_t l, int batch) {
  const float m = (float)(n * l);
  GRID_STRIDE_LOOP(p, n * c * l) {
    const int64_t k = (p / l) % c;
    const float inv = stats[2 * c + k], wk = lp_opt(w, k, 1.0f), g = to_f32(dy[p]);
    float v;
    if (batch) {
      const float kk = sums[c + k] * inv * inv / m;
      const float gm = sums[k] / m;
      v = fmaf(-(to_f32(x[p]) - stats[k]), kk, g - gm) * inv * wk;
    } else {
      v = g * inv * wk;
    }
    dx[p] = from_f32<T>(v);
  }
}

#define BN_LP_STATS(TN, T, PN, P, RN, R)                                                     \
  extern "C" __global__ void batchnorm_stats_lp_##TN##_##PN##_##RN(                          \
      const T* x, R* rm, R* rv, const int64_t* count, double factor, double eps,             \
      float* stats, int64_t n, int64_t c, int64_t l, int batch) {                            \
    lp_stats<T, P, R>(x, rm, rv, count, factor, eps, stats, n, c, l, batch);                 \
  }

#define BN_LP(TN, T, PN, P)                                                                  \
  BN_LP_STATS(TN, T, PN, P, TN, T)                                                           \
  BN_LP_STATS(TN, T, PN, P, f32, float)                                                      \
  extern "C" __global__ void batchnorm_fwd_lp_##TN##_##PN(const T* x, const P* w,            \
                                                          const P* b, const float* stats,    \
                                                          T* y, int64_t n, int64_t c,        \
                                                          int64_t l) {                       \
    lp_fwd<T, P>(x, w, b, stats, y, n, c, l);                                                \
  }                                                                                          \
  extern "C" __global__ void batchnorm_bwd_stats_lp_##TN##_##PN(                             \
      const T* x, const T* dy, const float* stats, float* sums, P* dw, P* db, int64_t n,     \
      int64_t c, int64_t l) {                                                                \
    lp_bwd_stats<T, P>(x, dy, stats, sums, dw, db, n, c, l);                                 \
  }                                                                                          \
  extern "C" __global__ void batchnorm_bwd_dx_lp_##TN##_##PN(                                \
      const T* x, const T* dy, const P* w, const float* stats, const float* sums, T* dx,     \
      int64_t n, int64_t c, int64_t l, int batch) {                                          \
    lp_bwd_dx<T, P>(x, dy, w, stats, sums, dx, n, c, l, batch);                              \
  }

BN_LP(f16, __half, f16, __half)
BN_LP(f16, __half, f32, float)
#if FSDP_BF16
BN_LP(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
BN_LP(bf16, __nv_bfloat16, f32, float)
#endif

extern "C" __global__ void batchnorm_count_i64(int64_t* count) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *count += 1;
}
