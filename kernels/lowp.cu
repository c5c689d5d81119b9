// lowp.cu: the bf16/f16 layer steps whose rounding points PyTorch fixes beyond "compute in
// f32, round the output once" (ops::lowp; CPU references in src/ops/lowp/{layernorm,loss}.rs,
// same formulas in the same order). One thread per row or per column, plain f32 math.
//
// layernorm_bwd_lp_{dtype}(x, dy, w, mean, rstd (n) dtype, dx (n, c) dtype, n, c)
//   Per row, with a = rstd[r], m = mean[r] (the ROUNDED saved statistics):
//   ds = sum_j dy x w, db = sum_j dy w, bb = (db m - ds) a^3 / c, cc = -bb m - db a / c,
//   dx = round(a dy w + bb x + cc)                                              (=)
// layernorm_wgrad_lp_{dtype}(x, dy, mean, rstd, dw (c), db (c), n, c)
//   Per column j, rows in order from zero, rounding after every row (PyTorch's CPU kernel
//   accumulates in a param_dtype buffer): dw = round(dw + dy (a x - a m)),
//   db = round(db + dy)                                                          (=)
// cross_entropy_lp_{dtype}(logits (n, V) dtype, targets (n) i32, losses (n) f32,
//                          dlogits (n, V) dtype, n, V, w, invalid)
//   Per row: lse = max + log(sum exp(x - max)); ls = round(x - lse) (log_softmax's output);
//   losses[r] = -ls[y]; dlogits = round(exp(ls) w - [j = y] w) with w = round(1 / N)
//   (nll_loss_backward then log_softmax's backward). A target outside [0, V): the row is
//   left unwritten and r is min-ed into *invalid (as cross_entropy_f32).
#include "common.cuh"

#define LAYERNORM_BWD_LP(NAME, T)                                                          \
  extern "C" __global__ void NAME(const T* __restrict__ x, const T* __restrict__ dy,       \
                                  const T* __restrict__ w, const T* __restrict__ mean,     \
                                  const T* __restrict__ rstd, T* __restrict__ dx,          \
                                  int64_t n, int64_t c) {                                  \
    const float scale = 1.0f / (float)c;                                                   \
    GRID_STRIDE_LOOP(r, n) {                                                               \
      const T* xr = x + r * c;                                                             \
      const T* gr = dy + r * c;                                                            \
      const float a = to_f32(rstd[r]), m = to_f32(mean[r]);                                \
      float ds = 0.0f, dbs = 0.0f;                                                         \
      for (int64_t j = 0; j < c; j++) {                                                    \
        const float g = to_f32(gr[j]), wj = to_f32(w[j]);                                  \
        ds += g * to_f32(xr[j]) * wj;                                                      \
        dbs += g * wj;                                                                     \
      }                                                                                    \
      const float bb = (dbs * m - ds) * a * a * a * scale;                                 \
      const float cc = -bb * m - dbs * a * scale;                                          \
      for (int64_t j = 0; j < c; j++)                                                      \
        dx[r * c + j] =                                                                    \
            from_f32<T>(a * to_f32(gr[j]) * to_f32(w[j]) + bb * to_f32(xr[j]) + cc);       \
    }                                                                                      \
  }

#define LAYERNORM_WGRAD_LP(NAME, T)                                                        \
  extern "C" __global__ void NAME(const T* __restrict__ x, const T* __restrict__ dy,       \
                                  const T* __restrict__ mean, const T* __restrict__ rstd,  \
                                  T* __restrict__ dw, T* __restrict__ db, int64_t n,       \
                                  int64_t c) {                                             \
    GRID_STRIDE_LOOP(j, c) {                                                               \
      float aw = 0.0f, ab = 0.0f;                                                          \
      for (int64_t r = 0; r < n; r++) {                                                    \
        const float a = to_f32(rstd[r]), m = to_f32(mean[r]);                              \
        const float g = to_f32(dy[r * c + j]);                                             \
        aw = to_f32(from_f32<T>(aw + g * (a * to_f32(x[r * c + j]) - a * m)));             \
        ab = to_f32(from_f32<T>(ab + g));                                                  \
      }                                                                                    \
      dw[j] = from_f32<T>(aw);                                                             \
      db[j] = from_f32<T>(ab);                                                             \
    }                                                                                      \
  }

#define CROSS_ENTROPY_LP(NAME, T)                                                          \
  extern "C" __global__ void NAME(const T* __restrict__ logits,                            \
                                  const int32_t* __restrict__ targets,                     \
                                  float* __restrict__ losses, T* __restrict__ dlogits,     \
                                  int64_t n, int64_t V, float w,                           \
                                  unsigned long long* __restrict__ invalid) {              \
    GRID_STRIDE_LOOP(r, n) {                                                               \
      const int32_t y = targets[r];                                                        \
      if (y < 0 || (int64_t)y >= V) {                                                      \
        atomicMin(invalid, (unsigned long long)r);                                         \
        continue;                                                                          \
      }                                                                                    \
      const T* lr = logits + r * V;                                                        \
      float mx = -INFINITY;                                                                \
      for (int64_t j = 0; j < V; j++) mx = fmaxf(mx, to_f32(lr[j]));                       \
      float s = 0.0f;                                                                      \
      for (int64_t j = 0; j < V; j++) s += expf(to_f32(lr[j]) - mx);                       \
      const float lse = mx + logf(s);                                                      \
      for (int64_t j = 0; j < V; j++) {                                                    \
        const float ls = to_f32(from_f32<T>(to_f32(lr[j]) - lse));                         \
        if (j == y) losses[r] = -ls;                                                       \
        const float hot = j == y ? w : 0.0f;                                               \
        dlogits[r * V + j] = from_f32<T>(expf(ls) * w - hot);                              \
      }                                                                                    \
    }                                                                                      \
  }

LAYERNORM_BWD_LP(layernorm_bwd_lp_f16, __half)
LAYERNORM_WGRAD_LP(layernorm_wgrad_lp_f16, __half)
CROSS_ENTROPY_LP(cross_entropy_lp_f16, __half)
#if FSDP_BF16
LAYERNORM_BWD_LP(layernorm_bwd_lp_bf16, __nv_bfloat16)
LAYERNORM_WGRAD_LP(layernorm_wgrad_lp_bf16, __nv_bfloat16)
CROSS_ENTROPY_LP(cross_entropy_lp_bf16, __nv_bfloat16)
#endif
