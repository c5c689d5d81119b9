// nn.cu: the layer kernels of the GPT (src/nn/): GELU, bias, LayerNorm, the attention
// permutes and causal softmax, cross-entropy, embedding. f32 activations throughout (the
// GEMMs around them are cuBLAS's). CPU references: backend::cpu::kernels (same names),
// which reproduce the nn modules' loops. Row kernels take one block per row
// (blockDim.x a multiple of 32), rows walked with stride gridDim.x.
//
// gelu_fwd_f32(x (n), y (n), n)              y = x Phi(x), exact-erf GELU         (=)
// gelu_bwd_f32(x (n), dy (n), dx (n), n)      dx = dy GELU'(x)                    (=)
//   Same erf/exp polynomials as the CPU (common.cuh): bitwise equal.
// relu_fwd_f32(x (n), y (n), n)              y = max(x, 0)                       (=)
// relu_bwd_f32(x (n), dy (n), dx (n), n)      dx = dy * (x > 0 ? 1 : 0)           (=)
//   As nn::activation::{relu, relu_grad}: bitwise equal.
// bias_add_f32(y (rows, C), b (C), rows, C)   y[r, j] += b[j]                    (+=)
// bias_grad_f32(dy (rows, C), db (C), rows, C) db[j] += sum_r dy[r, j]           (+=)
//   Column sums (column_sums below): deterministic, in a fixed order of the rows.
// layernorm_fwd_f32(x, w (C), b (C), y, xhat, rstd (rows), rows, C, eps)
//   mean, biased var over the last dim; rstd = 1 / sqrt(var + eps);
//   xhat = (x - mean) rstd; y = xhat w + b          (y, xhat (rows, C), rstd: =; xhat may be null)
// layernorm_bwd_f32(dy, xhat, rstd, w, dx, rows, C)
//   dx = rstd (dy w - mean(dy w) - xhat mean(dy w xhat))                           (=)
// layernorm_bwd_params_f32(dy, xhat, dw, db, rows, C)
//   dw[j] += sum_r dy xhat; db[j] += sum_r dy   (column sums, deterministic)      (+=)
//
// Column sums (bias_grad_f32, layernorm_bwd_params_f32): 1024-thread blocks, block b
// owning columns 32b .. 32b+31. Thread t reads column 32b + t % 32 at rows t / 32,
// t / 32 + 32, ... (so each warp reads 128 contiguous bytes of a row), summing them in row
// order; the 32 partial sums of a column are then added in order of t / 32. The order
// depends only on the row count, never on the device: every run gives the same bits.
// Launch: grid (ceil(C / 32), 1, 1), block 1024 (COLUMN_TILE * COLUMN_ROWS).
// split_qkv_f32(qkv (B, T, 3, H, hd), q, k, v (B, H, T, hd), B, T, H, hd)          (=)
// merge_qkv_f32(dq, dk, dv (B, H, T, hd), dqkv (B, T, 3, H, hd), B, T, H, hd)     (=)
// merge_heads_f32(yh (B, H, T, hd), y (B, T, H, hd), B, T, H, hd)                  (=)
// split_heads_f32(y (B, T, H, hd), yh (B, H, T, hd), B, T, H, hd)                  (=)
// softmax_causal_fwd_f32(s (rows, T), p (rows, T), rows, T, scale)
//   row r is query t = r mod T: p[j] = exp(s[j] scale - max) / sum for j <= t, 0 after (=)
// softmax_causal_bwd_f32(p (rows, T), dp (rows, T), ds (rows, T), rows, T, scale)
//   ds[j] = p[j] (dp[j] - sum_i p[i] dp[i]) scale for j <= t, 0 after; ds may alias dp (=)
// cross_entropy_f32(logits (N, V), targets (N) i32, losses (N), dlogits (N, V), N, V,
//                   inv_n, invalid)
//   losses[r] = logsumexp(row) - row[y]; dlogits = (softmax - onehot(y)) inv_n        (=)
//   A target outside [0, V): its row is left unwritten and the smallest such r is
//   atomically min-ed into *invalid (the host sets it to u64::MAX first).
// embedding_fwd_f32(ids (N) i32, table (V, C), out (N, C), N, V, C, invalid)
//   out[i, :] = table[ids[i], :]; an id outside [0, V) writes zeros and min-s i into *invalid (=)
// embedding_bwd_f32(ids (N), dout (N, C), grad (V, C), N, V, C)
//   grad[ids[i], :] += dout[i, :] with atomicAdd: repeated ids add in any order     (+=)
//   ids outside [0, V) are skipped (the forward already reported them).
#include "common.cuh"

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

extern "C" __global__ void gelu_fwd_f32(const float* __restrict__ x, float* __restrict__ y,
                                        int64_t n) {
  GRID_STRIDE_LOOP(i, n) { y[i] = gelu_f(x[i]); }
}

extern "C" __global__ void gelu_bwd_f32(const float* __restrict__ x, const float* __restrict__ dy,
                                        float* __restrict__ dx, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { dx[i] = dy[i] * gelu_df(x[i]); }
}

extern "C" __global__ void relu_fwd_f32(const float* __restrict__ x, float* __restrict__ y,
                                        int64_t n) {
  GRID_STRIDE_LOOP(i, n) { y[i] = fmaxf(x[i], 0.0f); }
}

extern "C" __global__ void relu_bwd_f32(const float* __restrict__ x, const float* __restrict__ dy,
                                        float* __restrict__ dx, int64_t n) {
  GRID_STRIDE_LOOP(i, n) { dx[i] = dy[i] * (x[i] > 0.0f ? 1.0f : 0.0f); }
}

extern "C" __global__ void bias_add_f32(float* __restrict__ y, const float* __restrict__ b,
                                        int64_t rows, int64_t c) {
  GRID_STRIDE_LOOP(i, rows * c) { y[i] = y[i] + b[i % c]; }
}

#define COLUMN_TILE 32
#define COLUMN_ROWS 32

// sum_r a[r, j] (and sum_r a[r, j] b[r, j] when b is not null) for this block's columns,
// added into out_a[j] (and out_ab[j]). Every thread of the block must call it.
__device__ __forceinline__ void column_sums(const float* __restrict__ a,
                                            const float* __restrict__ b,
                                            float* __restrict__ out_a,
                                            float* __restrict__ out_ab, int64_t rows,
                                            int64_t c) {
  __shared__ float part_a[COLUMN_ROWS][COLUMN_TILE + 1];
  __shared__ float part_ab[COLUMN_ROWS][COLUMN_TILE + 1];
  const int x = threadIdx.x % COLUMN_TILE, y = threadIdx.x / COLUMN_TILE;
  const int64_t j = (int64_t)blockIdx.x * COLUMN_TILE + x;
  float sa = 0.0f, sab = 0.0f;
  if (j < c) {
    for (int64_t r = y; r < rows; r += COLUMN_ROWS) {
      float v = a[r * c + j];
      sa += v;
      if (b != nullptr) sab += v * b[r * c + j];
    }
  }
  part_a[y][x] = sa;
  part_ab[y][x] = sab;
  __syncthreads();
  if (y == 0 && j < c) {
    float ta = 0.0f, tab = 0.0f;
    for (int k = 0; k < COLUMN_ROWS; ++k) {
      ta += part_a[k][x];
      tab += part_ab[k][x];
    }
    out_a[j] = out_a[j] + ta;
    if (out_ab != nullptr) out_ab[j] = out_ab[j] + tab;
  }
}

extern "C" __global__ void ROW_KERNEL bias_grad_f32(const float* __restrict__ dy,
                                                    float* __restrict__ db, int64_t rows,
                                                    int64_t c) {
  column_sums(dy, nullptr, db, nullptr, rows, c);
}

extern "C" __global__ void ROW_KERNEL layernorm_fwd_f32(const float* __restrict__ x, const float* __restrict__ w,
                                             const float* __restrict__ b, float* __restrict__ y,
                                             float* __restrict__ xhat, float* __restrict__ rstd,
                                             int64_t rows, int64_t c, float eps) {
  __shared__ float shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = x + r * c;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) s += xr[j];
    float mean = block_sum(s, shared) / (float)c;
    float q = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      float d = xr[j] - mean;
      q += d * d;
    }
    float var = block_sum(q, shared) / (float)c;
    float rs = 1.0f / sqrtf(var + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      float nrm = (xr[j] - mean) * rs;
      if (xhat != nullptr) xhat[r * c + j] = nrm;
      y[r * c + j] = nrm * w[j] + b[j];
    }
  }
}

extern "C" __global__ void ROW_KERNEL layernorm_bwd_f32(const float* __restrict__ dy, const float* __restrict__ xhat,
                                             const float* __restrict__ rstd, const float* __restrict__ w,
                                             float* __restrict__ dx, int64_t rows, int64_t c) {
  __shared__ float shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* dyr = dy + r * c;
    const float* xr = xhat + r * c;
    float m1 = 0.0f, m2 = 0.0f;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      float d = dyr[j] * w[j];
      m1 += d;
      m2 += d * xr[j];
    }
    m1 = block_sum(m1, shared) / (float)c;
    m2 = block_sum(m2, shared) / (float)c;
    float rs = rstd[r];
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      dx[r * c + j] = rs * (dyr[j] * w[j] - m1 - xr[j] * m2);
    }
  }
}

extern "C" __global__ void ROW_KERNEL layernorm_bwd_params_f32(const float* __restrict__ dy,
                                                               const float* __restrict__ xhat,
                                                               float* __restrict__ dw,
                                                               float* __restrict__ db,
                                                               int64_t rows, int64_t c) {
  column_sums(dy, xhat, db, dw, rows, c);
}

// (B, T, 3, H, hd) <-> 3 x (B, H, T, hd); i walks the head-major layout.
extern "C" __global__ void split_qkv_f32(const float* __restrict__ qkv, float* __restrict__ q,
                                         float* __restrict__ k, float* __restrict__ v, int64_t B,
                                         int64_t T, int64_t H, int64_t hd) {
  GRID_STRIDE_LOOP(i, B * H * T * hd) {
    int64_t d = i % hd, t = (i / hd) % T, h = (i / (hd * T)) % H, b = i / (hd * T * H);
    int64_t src = ((b * T + t) * 3 * H + h) * hd + d;
    q[i] = qkv[src];
    k[i] = qkv[src + H * hd];
    v[i] = qkv[src + 2 * H * hd];
  }
}

extern "C" __global__ void merge_qkv_f32(const float* __restrict__ dq, const float* __restrict__ dk,
                                         const float* __restrict__ dv, float* __restrict__ dqkv,
                                         int64_t B, int64_t T, int64_t H, int64_t hd) {
  GRID_STRIDE_LOOP(i, B * H * T * hd) {
    int64_t d = i % hd, t = (i / hd) % T, h = (i / (hd * T)) % H, b = i / (hd * T * H);
    int64_t dst = ((b * T + t) * 3 * H + h) * hd + d;
    dqkv[dst] = dq[i];
    dqkv[dst + H * hd] = dk[i];
    dqkv[dst + 2 * H * hd] = dv[i];
  }
}

extern "C" __global__ void merge_heads_f32(const float* __restrict__ yh, float* __restrict__ y,
                                           int64_t B, int64_t T, int64_t H, int64_t hd) {
  GRID_STRIDE_LOOP(i, B * H * T * hd) {
    int64_t d = i % hd, t = (i / hd) % T, h = (i / (hd * T)) % H, b = i / (hd * T * H);
    y[((b * T + t) * H + h) * hd + d] = yh[i];
  }
}

extern "C" __global__ void split_heads_f32(const float* __restrict__ y, float* __restrict__ yh,
                                           int64_t B, int64_t T, int64_t H, int64_t hd) {
  GRID_STRIDE_LOOP(i, B * H * T * hd) {
    int64_t d = i % hd, t = (i / hd) % T, h = (i / (hd * T)) % H, b = i / (hd * T * H);
    yh[i] = y[((b * T + t) * H + h) * hd + d];
  }
}

extern "C" __global__ void ROW_KERNEL softmax_causal_fwd_f32(const float* __restrict__ s, float* __restrict__ p,
                                                  int64_t rows, int64_t T, float scale) {
  __shared__ float shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int64_t t = r % T;
    const float* sr = s + r * T;
    float* pr = p + r * T;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, sr[j] * scale);
    mx = block_max(mx, shared);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += fsdp_exp(sr[j] * scale - mx);
    float inv = 1.0f / block_sum(sum, shared);
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
      pr[j] = j <= t ? fsdp_exp(sr[j] * scale - mx) * inv : 0.0f;
    }
  }
}

// No __restrict__ on dp/ds: the runtime computes ds in place of dp.
extern "C" __global__ void ROW_KERNEL softmax_causal_bwd_f32(const float* __restrict__ p, const float* dp,
                                                  float* ds, int64_t rows, int64_t T, float scale) {
  __shared__ float shared[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    int64_t t = r % T;
    const float* pr = p + r * T;
    const float* dr = dp + r * T;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) dot += pr[j] * dr[j];
    dot = block_sum(dot, shared);  // ends with a barrier: every read of dp is done
    for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
      ds[r * T + j] = j <= t ? pr[j] * (dr[j] - dot) * scale : 0.0f;
    }
  }
}

extern "C" __global__ void ROW_KERNEL cross_entropy_f32(const float* __restrict__ logits,
                                             const int32_t* __restrict__ targets,
                                             float* __restrict__ losses, float* __restrict__ dlogits,
                                             int64_t n, int64_t V, float inv_n,
                                             unsigned long long* __restrict__ invalid) {
  __shared__ float shared[32];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    int32_t y = targets[r];
    if (y < 0 || (int64_t)y >= V) {
      if (threadIdx.x == 0) atomicMin(invalid, (unsigned long long)r);
      continue;  // uniform across the block: no barrier is skipped by part of it
    }
    const float* lr = logits + r * V;
    float* gr = dlogits + r * V;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, lr[j]);
    mx = block_max(mx, shared);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += fsdp_exp(lr[j] - mx);
    sum = block_sum(sum, shared);
    float inv = inv_n / sum;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float g = fsdp_exp(lr[j] - mx) * inv;
      gr[j] = j == y ? g - inv_n : g;
    }
    if (threadIdx.x == 0) losses[r] = logf(sum) + mx - lr[y];
  }
}

// mean_rows_f32(losses (n) f32, n, out (1) f32)
//   out[0] = f32((sum over r in order of f64(losses[r])) / n)     one thread: the host's sum
// add_div_f32(acc (1) f32, x (1) f32, d)      acc[0] = acc[0] + x[0] / d         (f32)
//   The loss on the device (no host read): a step's mean over micro-batches accumulates as
//   the host's `l += lk / K` did.
extern "C" __global__ void mean_rows_f32(const float* __restrict__ losses, int64_t n,
                                         float* __restrict__ out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double total = 0.0;
  for (int64_t r = 0; r < n; ++r) total += (double)losses[r];
  out[0] = (float)(total / (double)n);
}
extern "C" __global__ void add_div_f32(float* __restrict__ acc, const float* __restrict__ x,
                                       float d) {
  if (blockIdx.x == 0 && threadIdx.x == 0) acc[0] = acc[0] + x[0] / d;
}

extern "C" __global__ void embedding_fwd_f32(const int32_t* __restrict__ ids,
                                             const float* __restrict__ table, float* __restrict__ out,
                                             int64_t n, int64_t V, int64_t c,
                                             unsigned long long* __restrict__ invalid) {
  GRID_STRIDE_LOOP(i, n * c) {
    int64_t row = i / c, j = i % c;
    int32_t id = ids[row];
    if (id < 0 || (int64_t)id >= V) {
      out[i] = 0.0f;
      if (j == 0) atomicMin(invalid, (unsigned long long)row);
    } else {
      out[i] = table[(int64_t)id * c + j];
    }
  }
}

extern "C" __global__ void embedding_bwd_f32(const int32_t* __restrict__ ids,
                                             const float* __restrict__ dout, float* __restrict__ grad,
                                             int64_t n, int64_t V, int64_t c) {
  GRID_STRIDE_LOOP(i, n * c) {
    int64_t row = i / c, j = i % c;
    int32_t id = ids[row];
    if (id >= 0 && (int64_t)id < V) atomicAdd(&grad[(int64_t)id * c + j], dout[i]);
  }
}
