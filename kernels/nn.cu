// nn.cu: the layer kernels of the GPT (src/nn/): GELU, bias, LayerNorm, the attention
// permutes and causal softmax, cross-entropy, embedding (the GEMMs around them are
// cuBLAS's). Each is a template on the element type T, stamped out as `<name>_f32` (float)
// and `<name>_f64` (double): f64 tensors compute in f64 throughout, scalar arguments
// (eps, scale, inv_n) included. CPU references: backend::cpu::kernels (same names) for
// f32, which reproduce the nn modules' loops; ops::double for f64 (same formulas, the
// libm functions in double: see k_exp in common.cuh). Row kernels take one block per row
// (blockDim.x a multiple of 32), rows walked with stride gridDim.x. The signatures below
// say f32; the f64 kernels take double where they take float.
//
// gelu_fwd_f32(x (n), y (n), n)              y = x Phi(x), exact-erf GELU         (=)
// gelu_bwd_f32(x (n), dy (n), dx (n), n)      dx = dy GELU'(x)                    (=)
//   f32: same erf/exp polynomials as the CPU (common.cuh): bitwise equal. f64: ops::double's
//   x (Phi(x)) and Phi(x) + x phi(x), erf/exp in double.
// relu_fwd_f32(x (n), y (n), n)              y = max(x, 0)                       (=)
// relu_bwd_f32(x (n), dy (n), dx (n), n)      dx = dy * (x > 0 ? 1 : 0)           (=)
//   As nn::activation::{relu, relu_grad}: bitwise equal.
// bias_add_f32(y (rows, C), b (C), rows, C)   y[r, j] += b[j]                    (+=)
// bias_grad_f32(dy (rows, C), db (C), rows, C) db[j] += sum_r dy[r, j]           (+=)
//   Column sums (column_sums below): deterministic, in a fixed order of the rows.
// bias_gelu_fwd_f32(h (rows, C), b (C), y (rows, C), rows, C)
//   h[r, j] += b[j]; y = gelu(h)       (h +=, y =): bias_add then gelu_fwd, one pass, same bits
//   (the MLP's c_fc bias and GELU; h, with its bias, is what the GELU's backward reads)
// gelu_bwd_bias_grad_f32(x (rows, C), dy (rows, C), dx (rows, C), db (C), rows, C)
//   dx = dy GELU'(x) (=); db[j] += sum_r dx[r, j] (+=): gelu_bwd then bias_grad in one
//   launch, same bits (each column block computes the dx it sums). Launch as bias_grad.
// layernorm_fwd_f32(x, r, w (C), b (C), sum, y, xhat, rstd (rows), rows, C, eps)
//   u = x, or with a residual r (not null) u = x + r, written to sum (the residual add
//   fused in front: sum = x + r as add_f32 rounds it, then the LayerNorm of it);
//   mean, biased var of u over the last dim; rstd = 1 / sqrt(var + eps);
//   xhat = (u - mean) rstd; y = xhat w + b
//                          (sum, y, xhat (rows, C), rstd: =; xhat may be null, sum null without r)
// layernorm_bwd_f32(dy, xhat, rstd, w, res, dx, dw, db, res_sum, rows, C, row_blocks)
//   dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat)), plus res when not null (the
//   residual stream's gradient added after the rounding, as add_f32 would)       (=)
//   dw[j] += sum_r dy xhat; db[j] += sum_r dy   (column sums, deterministic)      (+=)
//   res_sum[j] += sum_r res[r, j] when both are not null (+=): the bias gradient of the
//   Linear whose output gradient the residual is (the GPT block's c_proj), as bias_grad.
//   One launch, two kinds of block: blocks [0, row_blocks) walk the rows (stride
//   row_blocks) for dx, the next ceil(C / 32) blocks each own 32 columns of dw, db. Both
//   read only dy and xhat, and write disjoint outputs.
//
// Column sums (bias_grad_f32, layernorm_bwd_f32's column blocks): blocks of any multiple
// of 32 threads (1024 for bias_grad), block b owning columns 32b .. 32b+31. Lane y in
// 0 .. 31 reads column 32b + t % 32 at rows y, y + 32, ... (so each warp reads 128
// contiguous bytes of a row), summing them in row order; thread t serves the lanes
// t / 32, t / 32 + blockDim / 32, ... The 32 lane sums of a column are then added in lane
// order. The order depends only on the row count, never on the device or the block size:
// every run gives the same bits.
// Launch (bias_grad): grid (ceil(C / 32), 1, 1), block 1024 (COLUMN_TILE * COLUMN_ROWS).
// split_qkv_f32(qkv (B, T, 3, H, hd), q, k, v (B, H, T, hd), B, T, H, hd)          (=)
// merge_qkv_f32(dq, dk, dv (B, H, T, hd), dqkv (B, T, 3, H, hd), B, T, H, hd)     (=)
// merge_heads_f32(yh (B, H, T, hd), y (B, T, H, hd), B, T, H, hd)                  (=)
// split_heads_f32(y (B, T, H, hd), yh (B, H, T, hd), B, T, H, hd)                  (=)
// softmax_causal_fwd_f32(s (rows, T), p (rows, T), rows, T, scale)
//   row r is query t = r mod T: p[j] = exp(s[j] scale - max) / sum for j <= t, 0 after (=)
//   (f32 multiplies by 1 / sum as the CPU's f32 loop; f64 divides as ops::double)
// softmax_causal_bwd_f32(p (rows, T), dp (rows, T), ds (rows, T), rows, T, scale)
//   ds[j] = p[j] (dp[j] - sum_i p[i] dp[i]) scale for j <= t, 0 after; ds may alias dp (=)
// cross_entropy_f32(logits (N, V), targets (N) i32, losses (N), dlogits (N, V), N, V,
//                   inv_n, invalid)
//   losses[r] = logsumexp(row) - row[y]; dlogits = (softmax - onehot(y)) inv_n        (=)
//   f32: dlogits = exp(x - max) (inv_n / sum) [- inv_n], loss log(sum) + max - x[y] (the
//   CPU's f32 loop); f64: lse = max + log(sum), dlogits = (exp(x - lse) - onehot) inv_n,
//   loss lse - x[y] (ops::double).
//   A target outside [0, V): its row is left unwritten and the smallest such r is
//   atomically min-ed into *invalid (the host sets it to u64::MAX first).
// embedding_fwd_f32(ids (N) i32, table (V, C), out (N, C), N, V, C, invalid)
//   out[i, :] = table[ids[i], :]; an id outside [0, V) writes zeros and min-s i into *invalid (=)
// embedding_bwd_f32(ids (N), dout (N, C), grad (V, C), N, V, C)
//   grad[ids[i], :] += dout[i, :] with atomicAdd: repeated ids add in any order     (+=)
//   (double atomicAdd: sm_60 and later)
//   ids outside [0, V) are skipped (the forward already reported them).
// mean_rows_f32(losses (n) f32, n, out (1) f32)
//   out[0] = f32((sum over r in order of f64(losses[r])) / n)     one thread: the host's sum
// mean_rows_f64(losses (n) f64, n, out (1) f64)
//   out[0] = (sum over r in order of losses[r]) * (1 / n)   as ops::double::cross_entropy
// add_div_f32(acc (1) f32, x (1) f32, d)      acc[0] = acc[0] + x[0] / d         (f32)
//   The loss on the device (no host read): a step's mean over micro-batches accumulates as
//   the host's `l += lk / K` did.
//
// Templated bodies whose threads meet at a barrier are named `*_synced`: the emulator
// (cuda-emu/build.rs) runs a kernel as fibers when its body names a barrier, and the
// extern "C" wrapper's body only names the template.
#include "common.cuh"

// The f32 and f64 instances of a kernel: M(suffix, element type).
#define F32_F64(M) M(f32, float) M(f64, double)

__device__ inline float gelu_f(float x) {
  const float FRAC_1_SQRT_2 = 0.70710678118654752440f;
  return 0.5f * x * (1.0f + fsdp_erf(x * FRAC_1_SQRT_2));
}

__device__ inline float gelu_df(float x) {
  const float FRAC_1_SQRT_2 = 0.70710678118654752440f;
  const float INV_SQRT_2PI = 0.3989423f;  // as nn::activation's constant
  float cdf = 0.5f * (1.0f + fsdp_erf(x * FRAC_1_SQRT_2));
  float pdf = INV_SQRT_2PI * fsdp_exp(-0.5f * x * x);
  return cdf + x * pdf;
}

// f64: ops::double's `act`, in its order (Rust's FRAC_1_SQRT_2 and FRAC_2_SQRT_PI).
__device__ inline double gelu_f(double x) {
  const double FRAC_1_SQRT_2 = 0.707106781186547524400844362104849039;
  return x * (0.5 * (1.0 + erf(x * FRAC_1_SQRT_2)));
}

__device__ inline double gelu_df(double x) {
  const double FRAC_1_SQRT_2 = 0.707106781186547524400844362104849039;
  const double FRAC_2_SQRT_PI = 1.12837916709551257389615890312154517;
  const double k = FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * 0.5;  // 1 / sqrt(2 pi)
  double cdf = 0.5 * (1.0 + erf(x * FRAC_1_SQRT_2));
  double pdf = exp(-0.5 * x * x) * k;
  return cdf + x * pdf;
}

#define POINTWISE_KERNELS(S, T)                                                             \
  extern "C" __global__ void gelu_fwd_##S(const T* __restrict__ x, T* __restrict__ y,      \
                                          int64_t n) {                                     \
    GRID_STRIDE_LOOP(i, n) { y[i] = gelu_f(x[i]); }                                        \
  }                                                                                        \
  extern "C" __global__ void gelu_bwd_##S(const T* __restrict__ x, const T* __restrict__ dy, \
                                          T* __restrict__ dx, int64_t n) {                 \
    GRID_STRIDE_LOOP(i, n) { dx[i] = dy[i] * gelu_df(x[i]); }                              \
  }                                                                                        \
  extern "C" __global__ void relu_fwd_##S(const T* __restrict__ x, T* __restrict__ y,      \
                                          int64_t n) {                                     \
    GRID_STRIDE_LOOP(i, n) { y[i] = k_max(x[i], (T)0); }                                   \
  }                                                                                        \
  extern "C" __global__ void relu_bwd_##S(const T* __restrict__ x, const T* __restrict__ dy, \
                                          T* __restrict__ dx, int64_t n) {                 \
    GRID_STRIDE_LOOP(i, n) { dx[i] = dy[i] * (x[i] > (T)0 ? (T)1 : (T)0); }                \
  }                                                                                        \
  extern "C" __global__ void bias_add_##S(T* __restrict__ y, const T* __restrict__ b,      \
                                          int64_t rows, int64_t c) {                       \
    GRID_STRIDE_LOOP(i, rows * c) { y[i] = y[i] + b[i % c]; }                              \
  }                                                                                        \
  extern "C" __global__ void bias_gelu_fwd_##S(T* __restrict__ h, const T* __restrict__ b, \
                                               T* __restrict__ y, int64_t rows, int64_t c) { \
    GRID_STRIDE_LOOP(i, rows * c) {                                                        \
      const T v = h[i] + b[i % c];                                                         \
      h[i] = v;                                                                            \
      y[i] = gelu_f(v);                                                                    \
    }                                                                                      \
  }
F32_F64(POINTWISE_KERNELS)

#define COLUMN_TILE 32
#define COLUMN_ROWS 32

// sum_r a(r c + j) (and sum_r a(r c + j) b[r, j] when b is not null) for the columns of
// tile `tile`, added into out_a[j] (and out_ab[j]); `a` is called once per element, in
// row order within a lane. Every thread of the block must call it.
template <typename T, typename A>
__device__ __forceinline__ void column_sums_of(A a, const T* __restrict__ b,
                                               T* __restrict__ out_a, T* __restrict__ out_ab,
                                               int64_t rows, int64_t c, int64_t tile) {
  __shared__ T part_a[COLUMN_ROWS][COLUMN_TILE + 1];
  __shared__ T part_ab[COLUMN_ROWS][COLUMN_TILE + 1];
  const int x = threadIdx.x % COLUMN_TILE;
  const int64_t j = tile * COLUMN_TILE + x;
  // Fewer than 1024 threads: each serves several lanes, each lane summed as its own.
  for (int y = threadIdx.x / COLUMN_TILE; y < COLUMN_ROWS; y += blockDim.x / COLUMN_TILE) {
    T sa = 0, sab = 0;
    if (j < c) {
      for (int64_t r = y; r < rows; r += COLUMN_ROWS) {
        T v = a(r * c + j);
        sa += v;
        if (b != nullptr) sab += v * b[r * c + j];
      }
    }
    part_a[y][x] = sa;
    part_ab[y][x] = sab;
  }
  __syncthreads();
  if (threadIdx.x < COLUMN_TILE && j < c) {
    T ta = 0, tab = 0;
    for (int k = 0; k < COLUMN_ROWS; ++k) {
      ta += part_a[k][x];
      tab += part_ab[k][x];
    }
    out_a[j] = out_a[j] + ta;
    if (out_ab != nullptr) out_ab[j] = out_ab[j] + tab;
  }
}

// column_sums_of over the elements of a.
template <typename T>
__device__ __forceinline__ void column_sums(const T* __restrict__ a, const T* __restrict__ b,
                                            T* __restrict__ out_a, T* __restrict__ out_ab,
                                            int64_t rows, int64_t c, int64_t tile) {
  column_sums_of<T>([=](int64_t i) { return a[i]; }, b, out_a, out_ab, rows, c, tile);
}

#define COLUMN_KERNELS(S, T)                                                                \
  extern "C" __global__ void ROW_KERNEL bias_grad_##S(const T* __restrict__ dy,             \
                                                      T* __restrict__ db, int64_t rows,     \
                                                      int64_t c) {                          \
    column_sums<T>(dy, nullptr, db, nullptr, rows, c, blockIdx.x);                          \
  }                                                                                         \
  extern "C" __global__ void ROW_KERNEL gelu_bwd_bias_grad_##S(                             \
      const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,                \
      T* __restrict__ db, int64_t rows, int64_t c) {                                        \
    auto d = [=](int64_t i) {                                                               \
      const T v = dy[i] * gelu_df(x[i]);                                                    \
      dx[i] = v;                                                                            \
      return v;                                                                             \
    };                                                                                      \
    column_sums_of<T>(d, nullptr, db, nullptr, rows, c, blockIdx.x);                        \
  }
F32_F64(COLUMN_KERNELS)

template <typename T>
__device__ inline void layernorm_fwd_synced(const T* __restrict__ x, const T* __restrict__ res,
                                            const T* __restrict__ w, const T* __restrict__ b,
                                            T* __restrict__ sum, T* __restrict__ y,
                                            T* __restrict__ xhat, T* __restrict__ rstd,
                                            int64_t rows, int64_t c, T eps) {
  __shared__ T shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * c;
    const T* rr = res == nullptr ? nullptr : res + r * c;
    // The input: x, or x + res rounded to T (each thread recomputes its own elements).
    auto u = [=](int64_t j) { return rr == nullptr ? xr[j] : xr[j] + rr[j]; };
    T s = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const T v = u(j);
      if (rr != nullptr) sum[r * c + j] = v;
      s += v;
    }
    T mean = block_sum(s, shared) / (T)c;
    T q = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      T d = u(j) - mean;
      q += d * d;
    }
    T var = block_sum(q, shared) / (T)c;
    T rs = (T)1 / k_sqrt(var + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      T nrm = (u(j) - mean) * rs;
      if (xhat != nullptr) xhat[r * c + j] = nrm;
      y[r * c + j] = nrm * w[j] + b[j];
    }
  }
}

template <typename T>
__device__ inline void layernorm_bwd_synced(const T* __restrict__ dy, const T* __restrict__ xhat,
                                            const T* __restrict__ rstd, const T* __restrict__ w,
                                            const T* __restrict__ res, T* __restrict__ dx,
                                            T* __restrict__ dw, T* __restrict__ db,
                                            T* __restrict__ res_sum, int64_t rows, int64_t c,
                                            int64_t row_blocks) {
  if ((int64_t)blockIdx.x >= row_blocks) {
    // A column block: dw, db (and res_sum) for its 32 columns.
    const int64_t tile = (int64_t)blockIdx.x - row_blocks;
    column_sums<T>(dy, xhat, db, dw, rows, c, tile);
    if (res != nullptr && res_sum != nullptr) {
      // The first sums' last reads of the shared partials are done.
      __syncthreads();
      column_sums<T>(res, nullptr, res_sum, nullptr, rows, c, tile);
    }
    return;
  }
  __shared__ T shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += row_blocks) {
    const T* dyr = dy + r * c;
    const T* xr = xhat + r * c;
    T m1 = 0, m2 = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      T d = dyr[j] * w[j];
      m1 += d;
      m2 += d * xr[j];
    }
    m1 = block_sum(m1, shared) / (T)c;
    m2 = block_sum(m2, shared) / (T)c;
    T rs = rstd[r];
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const T v = rs * (dyr[j] * w[j] - m1 - xr[j] * m2);
      dx[r * c + j] = res == nullptr ? v : res[r * c + j] + v;
    }
  }
}

#define LAYERNORM_KERNELS(S, T)                                                              \
  extern "C" __global__ void ROW_KERNEL layernorm_fwd_##S(                                   \
      const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,           \
      const T* __restrict__ b, T* __restrict__ sum, T* __restrict__ y, T* __restrict__ xhat, \
      T* __restrict__ rstd, int64_t rows, int64_t c, T eps) {                                \
    layernorm_fwd_synced<T>(x, res, w, b, sum, y, xhat, rstd, rows, c, eps);                 \
  }                                                                                          \
  extern "C" __global__ void ROW_KERNEL layernorm_bwd_##S(                                   \
      const T* __restrict__ dy, const T* __restrict__ xhat, const T* __restrict__ rstd,      \
      const T* __restrict__ w, const T* __restrict__ res, T* __restrict__ dx,                \
      T* __restrict__ dw, T* __restrict__ db, T* __restrict__ res_sum, int64_t rows,         \
      int64_t c, int64_t row_blocks) {                                                       \
    layernorm_bwd_synced<T>(dy, xhat, rstd, w, res, dx, dw, db, res_sum, rows, c, row_blocks); \
  }
F32_F64(LAYERNORM_KERNELS)

// (B, T, 3, H, hd) <-> 3 x (B, H, T, hd); i walks the head-major layout.
#define HEAD_KERNELS(S, T)                                                                   \
  extern "C" __global__ void split_qkv_##S(const T* __restrict__ qkv, T* __restrict__ q,     \
                                           T* __restrict__ k, T* __restrict__ v, int64_t B,  \
                                           int64_t Tn, int64_t H, int64_t hd) {              \
    GRID_STRIDE_LOOP(i, B * H * Tn * hd) {                                                   \
      int64_t d = i % hd, t = (i / hd) % Tn, h = (i / (hd * Tn)) % H, b = i / (hd * Tn * H); \
      int64_t src = ((b * Tn + t) * 3 * H + h) * hd + d;                                     \
      q[i] = qkv[src];                                                                       \
      k[i] = qkv[src + H * hd];                                                              \
      v[i] = qkv[src + 2 * H * hd];                                                          \
    }                                                                                        \
  }                                                                                          \
  extern "C" __global__ void merge_qkv_##S(const T* __restrict__ dq, const T* __restrict__ dk, \
                                           const T* __restrict__ dv, T* __restrict__ dqkv,   \
                                           int64_t B, int64_t Tn, int64_t H, int64_t hd) {   \
    GRID_STRIDE_LOOP(i, B * H * Tn * hd) {                                                   \
      int64_t d = i % hd, t = (i / hd) % Tn, h = (i / (hd * Tn)) % H, b = i / (hd * Tn * H); \
      int64_t dst = ((b * Tn + t) * 3 * H + h) * hd + d;                                     \
      dqkv[dst] = dq[i];                                                                     \
      dqkv[dst + H * hd] = dk[i];                                                            \
      dqkv[dst + 2 * H * hd] = dv[i];                                                        \
    }                                                                                        \
  }                                                                                          \
  extern "C" __global__ void merge_heads_##S(const T* __restrict__ yh, T* __restrict__ y,    \
                                             int64_t B, int64_t Tn, int64_t H, int64_t hd) { \
    GRID_STRIDE_LOOP(i, B * H * Tn * hd) {                                                   \
      int64_t d = i % hd, t = (i / hd) % Tn, h = (i / (hd * Tn)) % H, b = i / (hd * Tn * H); \
      y[((b * Tn + t) * H + h) * hd + d] = yh[i];                                            \
    }                                                                                        \
  }                                                                                          \
  extern "C" __global__ void split_heads_##S(const T* __restrict__ y, T* __restrict__ yh,    \
                                             int64_t B, int64_t Tn, int64_t H, int64_t hd) { \
    GRID_STRIDE_LOOP(i, B * H * Tn * hd) {                                                   \
      int64_t d = i % hd, t = (i / hd) % Tn, h = (i / (hd * Tn)) % H, b = i / (hd * Tn * H); \
      yh[i] = y[((b * Tn + t) * H + h) * hd + d];                                            \
    }                                                                                        \
  }
F32_F64(HEAD_KERNELS)

// p = e / sum: the f32 CPU loop multiplies by the reciprocal, ops::double divides.
__device__ inline float normalize(float e, float sum) { return e * (1.0f / sum); }
__device__ inline double normalize(double e, double sum) { return e / sum; }

template <typename T>
__device__ inline void softmax_causal_fwd_synced(const T* __restrict__ s, T* __restrict__ p,
                                                 int64_t rows, int64_t Tn, T scale) {
  __shared__ T shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int64_t t = r % Tn;
    const T* sr = s + r * Tn;
    T* pr = p + r * Tn;
    T mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) mx = k_max(mx, sr[j] * scale);
    mx = block_max(mx, shared);
    T sum = 0;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += k_exp(sr[j] * scale - mx);
    sum = block_sum(sum, shared);
    for (int64_t j = threadIdx.x; j < Tn; j += blockDim.x) {
      pr[j] = j <= t ? normalize(k_exp(sr[j] * scale - mx), sum) : (T)0;
    }
  }
}

// No __restrict__ on dp/ds: the runtime computes ds in place of dp.
template <typename T>
__device__ inline void softmax_causal_bwd_synced(const T* __restrict__ p, const T* dp, T* ds,
                                                 int64_t rows, int64_t Tn, T scale) {
  __shared__ T shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int64_t t = r % Tn;
    const T* pr = p + r * Tn;
    const T* dr = dp + r * Tn;
    T dot = 0;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) dot += pr[j] * dr[j];
    dot = block_sum(dot, shared);  // ends with a barrier: every read of dp is done
    for (int64_t j = threadIdx.x; j < Tn; j += blockDim.x) {
      ds[r * Tn + j] = j <= t ? pr[j] * (dr[j] - dot) * scale : (T)0;
    }
  }
}

#define SOFTMAX_KERNELS(S, T)                                                                \
  extern "C" __global__ void ROW_KERNEL softmax_causal_fwd_##S(                              \
      const T* __restrict__ s, T* __restrict__ p, int64_t rows, int64_t Tn, T scale) {       \
    softmax_causal_fwd_synced<T>(s, p, rows, Tn, scale);                                     \
  }                                                                                          \
  extern "C" __global__ void ROW_KERNEL softmax_causal_bwd_##S(                              \
      const T* __restrict__ p, const T* dp, T* ds, int64_t rows, int64_t Tn, T scale) {      \
    softmax_causal_bwd_synced<T>(p, dp, ds, rows, Tn, scale);                                \
  }
F32_F64(SOFTMAX_KERNELS)

template <typename T>
__device__ inline void cross_entropy_synced(const T* __restrict__ logits,
                                            const int32_t* __restrict__ targets,
                                            T* __restrict__ losses, T* __restrict__ dlogits,
                                            int64_t n, int64_t V, T inv_n,
                                            unsigned long long* __restrict__ invalid) {
  __shared__ T shared[32];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    int32_t y = targets[r];
    if (y < 0 || (int64_t)y >= V) {
      if (threadIdx.x == 0) atomicMin(invalid, (unsigned long long)r);
      continue;  // uniform across the block: no barrier is skipped by part of it
    }
    const T* lr = logits + r * V;
    T* gr = dlogits + r * V;
    T mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = k_max(mx, lr[j]);
    mx = block_max(mx, shared);
    T sum = 0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += k_exp(lr[j] - mx);
    sum = block_sum(sum, shared);
    if constexpr (is_f64<T>) {
      const T lse = mx + k_log(sum);
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        gr[j] = (k_exp(lr[j] - lse) - (j == y ? (T)1 : (T)0)) * inv_n;
      }
      if (threadIdx.x == 0) losses[r] = lse - lr[y];
    } else {
      T inv = inv_n / sum;
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        T g = k_exp(lr[j] - mx) * inv;
        gr[j] = j == y ? g - inv_n : g;
      }
      if (threadIdx.x == 0) losses[r] = k_log(sum) + mx - lr[y];
    }
  }
}

#define CROSS_ENTROPY_KERNEL(S, T)                                                          \
  extern "C" __global__ void ROW_KERNEL cross_entropy_##S(                                  \
      const T* __restrict__ logits, const int32_t* __restrict__ targets,                    \
      T* __restrict__ losses, T* __restrict__ dlogits, int64_t n, int64_t V, T inv_n,       \
      unsigned long long* __restrict__ invalid) {                                           \
    cross_entropy_synced<T>(logits, targets, losses, dlogits, n, V, inv_n, invalid);        \
  }
F32_F64(CROSS_ENTROPY_KERNEL)

extern "C" __global__ void mean_rows_f32(const float* __restrict__ losses, int64_t n,
                                         float* __restrict__ out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double total = 0.0;
  for (int64_t r = 0; r < n; ++r) total += (double)losses[r];
  out[0] = (float)(total / (double)n);
}
extern "C" __global__ void mean_rows_f64(const double* __restrict__ losses, int64_t n,
                                         double* __restrict__ out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double total = 0.0;
  for (int64_t r = 0; r < n; ++r) total += losses[r];
  out[0] = total * (1.0 / (double)n);
}
extern "C" __global__ void add_div_f32(float* __restrict__ acc, const float* __restrict__ x,
                                       float d) {
  if (blockIdx.x == 0 && threadIdx.x == 0) acc[0] = acc[0] + x[0] / d;
}

#define EMBEDDING_KERNELS(S, T)                                                             \
  extern "C" __global__ void embedding_fwd_##S(const int32_t* __restrict__ ids,             \
                                               const T* __restrict__ table,                 \
                                               T* __restrict__ out, int64_t n, int64_t V,   \
                                               int64_t c,                                   \
                                               unsigned long long* __restrict__ invalid) {  \
    GRID_STRIDE_LOOP(i, n * c) {                                                            \
      int64_t row = i / c, j = i % c;                                                       \
      int32_t id = ids[row];                                                                \
      if (id < 0 || (int64_t)id >= V) {                                                     \
        out[i] = (T)0;                                                                      \
        if (j == 0) atomicMin(invalid, (unsigned long long)row);                            \
      } else {                                                                              \
        out[i] = table[(int64_t)id * c + j];                                                \
      }                                                                                     \
    }                                                                                       \
  }                                                                                         \
  extern "C" __global__ void embedding_bwd_##S(const int32_t* __restrict__ ids,             \
                                               const T* __restrict__ dout,                  \
                                               T* __restrict__ grad, int64_t n, int64_t V,  \
                                               int64_t c) {                                 \
    GRID_STRIDE_LOOP(i, n * c) {                                                            \
      int64_t row = i / c, j = i % c;                                                       \
      int32_t id = ids[row];                                                                \
      if (id >= 0 && (int64_t)id < V) atomicAdd(&grad[(int64_t)id * c + j], dout[i]);      \
    }                                                                                       \
  }
F32_F64(EMBEDDING_KERNELS)
