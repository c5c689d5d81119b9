// sdpa.cu: causal scaled-dot-product attention of bf16/f16 heads, rounded as PyTorch 2.11's
// CPU flash-attention kernel rounds it. The CPU reference is src/backend/cpu/sdpa.rs ([Note:
// PyTorch's flash-attention rounding]) with the scalar pieces of src/backend/cpu/sdpa_math.rs
// (fexp_u20, sleef_expf_u10, tree16, dot_rows): the same operations in the same order, so
// cuda-emu (the host's expf/logf) gives the CPU's bits. One thread per query row (forward,
// dq) or per key (dk, dv); plain f32 math, explicit fmaf where PyTorch's vector code has an
// FMA (--fmad=false elsewhere). Tensors (BH, T, hd) contiguous, lse and dsum (BH, T) f32.
// qs, kvs: the query and key block sizes (sdpa_math::q_split, kv_split); scale: 1/sqrt(hd)
// as PyTorch rounds it. hd <= SDPA_MAX_HD (checked by the host).
//
// sdpa_fwd_{dtype}(q, k, v, out, lse, BH, T, hd, qs, kvs, scale)
//   out = round(sum_j p_j v_j / l) with p_j = round(exp(x_j - M)) (=); lse = M + log(l) (=)
// sdpa_bwd_dq_{dtype}(q, k, v, out, lse, dout, dq, dsum, BH, T, hd, qs, kvs, scale)
//   dsum_i = dout_i . out_i (=); dq_i = round(dq_i + scale sum_j round(g_ij) k_j) per key
//   block, from 0 (=)
// sdpa_bwd_dkv_{dtype}(q, k, v, lse, dout, dsum, dk, dv, BH, T, hd, qs, kvs, scale)
//   per query block in order: dv_j = round(dv_j + sum_i round(a_ij) dout_i),
//   dk_j = round(dk_j + scale sum_i round(g_ij) q_i), from 0 (=); reads dsum of sdpa_bwd_dq
#include "common.cuh"

#define SDPA_MAX_HD 256
#define SDPA_LANES 16

__device__ inline float sdpa_round_f32(float x, const __half*) { return to_f32(from_f32<__half>(x)); }
__device__ inline float sdpa_round_f32(float x, const __nv_bfloat16*) {
  return to_f32(from_f32<__nv_bfloat16>(x));
}

// _mm512_fexp_u20_ps (sdpa_math::fexp_u20).
__device__ inline float sdpa_fexp_u20(float x) {
  const float C0 = 0.00010703434948458272f;
  const float C1 = 0.30354260500649682f;
  const float C2 = (float)-0.22433836478672356;
  const float C3 = (float)-0.079204240219773236;
  const float LOG2E = __int_as_float(0x3fb8aa3b);
  const float LN_MIN = __int_as_float((int)0xc2aeac50u);
  const float LN_MAX = __int_as_float(0x42b17218);
  const float A = 8388608.0f, B = 1065353216.0f;
  float s = x * LOG2E;
  float f = s - floorf(s);
  float r = fmaf(f, C3, C2);
  r = fmaf(f, r, C1);
  r = fmaf(f, r, C0);
  if (x < LN_MIN) return 0.0f;
  if (x > LN_MAX) return INFINITY;
  return __int_as_float((int)fmaf(A, s - r, B));
}

// SLEEF's expf, 1 ulp, with FMA (sdpa_math::sleef_expf_u10).
__device__ inline float sdpa_sleef_expf(float d) {
  if (d < -104.0f) return 0.0f;
  if (d > 1e38f) return INFINITY;
  const float R_LN2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const float L2U = 0.693145751953125f, L2L = 1.428606765330187045e-06f;
  float qf = rintf(d * R_LN2);
  int q = (int)qf;
  float s = fmaf(qf, -L2U, d);
  s = fmaf(qf, -L2L, s);
  float u = 0.000198527617612853646278381f;
  u = fmaf(u, s, 0.00139304355252534151077271f);
  u = fmaf(u, s, 0.00833336077630519866943359f);
  u = fmaf(u, s, 0.0416664853692054748535156f);
  u = fmaf(u, s, 0.166666671633720397949219f);
  u = fmaf(u, s, 0.5f);
  u = 1.0f + fmaf(s * s, u, s);
  int h = q >> 1;
  u = u * __int_as_float((h + 0x7f) << 23);
  return u * __int_as_float((q - h + 0x7f) << 23);
}

// vec_reduce_all of 16 lanes (sdpa_math::tree16); overwrites v.
__device__ inline float sdpa_tree16(float* v) {
  for (int sh = 8; sh >= 1; sh >>= 1) {
    float w[SDPA_LANES];
    for (int i = 0; i < SDPA_LANES; i++) w[i] = v[i] + v[i ^ sh];
    for (int i = 0; i < SDPA_LANES; i++) v[i] = w[i];
  }
  return v[0];
}

// map2_reduce_all of a[i] b[i] over a row of n (sdpa_math::dot_rows).
template <typename T>
__device__ inline float sdpa_dot_rows(const T* a, const T* b, int64_t n) {
  float lo[SDPA_LANES], hi[SDPA_LANES];
  for (int i = 0; i < SDPA_LANES; i++) lo[i] = hi[i] = 0.0f;
  if (n < 2 * SDPA_LANES) {
    int64_t m = n < SDPA_LANES ? n : SDPA_LANES;
    for (int64_t i = 0; i < m; i++) lo[i] = to_f32(a[i]) * to_f32(b[i]);
    int64_t cnt = n;
    if (n > SDPA_LANES) {
      for (int64_t i = 0; i < n - SDPA_LANES; i++)
        lo[i] += to_f32(a[SDPA_LANES + i]) * to_f32(b[SDPA_LANES + i]);
      cnt = SDPA_LANES;
    }
    float s = lo[0];
    for (int64_t i = 1; i < cnt; i++) s += lo[i];
    return s;
  }
  for (int i = 0; i < SDPA_LANES; i++) {
    lo[i] = to_f32(a[i]) * to_f32(b[i]);
    hi[i] = to_f32(a[SDPA_LANES + i]) * to_f32(b[SDPA_LANES + i]);
  }
  int64_t full = n - n % (2 * SDPA_LANES), d = 2 * SDPA_LANES;
  for (; d < full; d += 2 * SDPA_LANES)
    for (int i = 0; i < SDPA_LANES; i++) {
      lo[i] += to_f32(a[d + i]) * to_f32(b[d + i]);
      hi[i] += to_f32(a[d + SDPA_LANES + i]) * to_f32(b[d + SDPA_LANES + i]);
    }
  int64_t rest = n - d;
  for (int64_t i = 0; i < rest && i < SDPA_LANES; i++) lo[i] += to_f32(a[d + i]) * to_f32(b[d + i]);
  for (int64_t i = 0; i + SDPA_LANES < rest; i++)
    hi[i] += to_f32(a[d + SDPA_LANES + i]) * to_f32(b[d + SDPA_LANES + i]);
  for (int i = 0; i < SDPA_LANES; i++) lo[i] += hi[i];
  return sdpa_tree16(lo);
}

// a . b over hd, in order, from 0 (the GEMMs' sums of exact products).
template <typename T>
__device__ inline float sdpa_dot(const T* a, const T* b, int64_t hd) {
  float s = 0.0f;
  for (int64_t l = 0; l < hd; l++) s += to_f32(a[l]) * to_f32(b[l]);
  return s;
}

// Keys 0..live of key block n.. (at most ncol) that query i sees.
__device__ inline int64_t sdpa_live(int64_t i, int64_t n, int64_t ncol) {
  int64_t l = i + 1 - n;
  if (l < 0) l = 0;
  return l < ncol ? l : ncol;
}

#define SDPA_FWD(NAME, T)                                                                   \
  extern "C" __global__ void NAME(const T* __restrict__ q, const T* __restrict__ k,        \
                                  const T* __restrict__ v, T* __restrict__ out,             \
                                  float* __restrict__ lse, int64_t bh, int64_t t,          \
                                  int64_t hd, int64_t qs, int64_t kvs, float scale) {      \
    GRID_STRIDE_LOOP(row, bh * t) {                                                         \
      const int64_t head = row / t, i = row % t;                                            \
      const T* qi = q + row * hd;                                                           \
      const T* kh = k + head * t * hd;                                                      \
      const T* vh = v + head * t * hd;                                                      \
      const int64_t m = i / qs * qs;                                                        \
      const int64_t qb = qs < t - m ? qs : t - m;                                           \
      const int64_t num_keys = m + qb < t ? m + qb : t;                                     \
      float dst[SDPA_MAX_HD], acc[SDPA_MAX_HD];                                             \
      for (int64_t e = 0; e < hd; e++) dst[e] = 0.0f;                                       \
      float mx = -INFINITY, sm = 0.0f;                                                      \
      for (int64_t n = 0; n < num_keys; n += kvs) {                                         \
        const int64_t kvb = kvs < t - n ? kvs : t - n;                                      \
        const int64_t ncol = kvb < num_keys - n ? kvb : num_keys - n;                       \
        const int64_t nv = SDPA_LANES * (kvb / SDPA_LANES);                                 \
        const int64_t lv = sdpa_live(i, n, ncol);                                           \
        float tmax = -INFINITY;                                                             \
        for (int64_t c = 0; c < lv; c++)                                                    \
          tmax = fmaxf(tmax, sdpa_dot(qi, kh + (n + c) * hd, hd) * scale);                  \
        if (mx > tmax) tmax = mx;                                                           \
        if (tmax == -INFINITY) continue;                                                    \
        float* a = n == 0 ? dst : acc;                                                      \
        if (n > 0)                                                                          \
          for (int64_t e = 0; e < hd; e++) acc[e] = 0.0f;                                   \
        float lanes[SDPA_LANES];                                                            \
        for (int l = 0; l < SDPA_LANES; l++) lanes[l] = 0.0f;                               \
        float sum = 0.0f;                                                                   \
        bool reduced = false;                                                               \
        for (int64_t c = 0; c < lv; c++) {                                                  \
          const float x = sdpa_dot(qi, kh + (n + c) * hd, hd) * scale - tmax;               \
          float ex;                                                                         \
          if (c < nv) {                                                                     \
            ex = sdpa_fexp_u20(x);                                                          \
            lanes[c % SDPA_LANES] += ex;                                                    \
          } else {                                                                          \
            if (!reduced) {                                                                 \
              sum = sdpa_tree16(lanes);                                                     \
              reduced = true;                                                               \
            }                                                                               \
            ex = expf(x);                                                                   \
            sum += ex;                                                                      \
          }                                                                                 \
          const float p = sdpa_round_f32(ex, q);                                            \
          const T* vj = vh + (n + c) * hd;                                                  \
          for (int64_t e = 0; e < hd; e++) a[e] += p * to_f32(vj[e]);                       \
        }                                                                                   \
        if (!reduced) sum = sdpa_tree16(lanes);                                             \
        const float et = expf(mx - tmax);                                                   \
        sm = sum + et * sm;                                                                 \
        mx = tmax;                                                                          \
        if (n > 0)                                                                          \
          for (int64_t e = 0; e < hd; e++) dst[e] = acc[e] + dst[e] * et;                   \
      }                                                                                     \
      const float mr = mx == -INFINITY ? 0.0f : mx;                                         \
      const float lr = sm == 0.0f ? 1.0f : sm;                                              \
      const float rec = 1.0f / lr;                                                          \
      for (int64_t e = 0; e < hd; e++) out[row * hd + e] = from_f32<T>(dst[e] * rec);       \
      lse[row] = mr + logf(lr);                                                             \
    }                                                                                       \
  }

// a_ij and round(g_ij) of query i and key j (both rounded to T's precision for the products).
#define SDPA_PAIR(T)                                                                        \
  const float a_ij = sdpa_sleef_expf(sdpa_dot(qi, kj, hd) * scale - lse_i);                 \
  const float g_ij = sdpa_round_f32(a_ij * (sdpa_dot(gi, vj, hd) - dsum_i), q);

#define SDPA_BWD_DQ(NAME, T)                                                                \
  extern "C" __global__ void NAME(const T* __restrict__ q, const T* __restrict__ k,        \
                                  const T* __restrict__ v, const T* __restrict__ out,      \
                                  const float* __restrict__ lse, const T* __restrict__ dout, \
                                  T* __restrict__ dq, float* __restrict__ dsum, int64_t bh, \
                                  int64_t t, int64_t hd, int64_t qs, int64_t kvs,          \
                                  float scale) {                                            \
    GRID_STRIDE_LOOP(row, bh * t) {                                                         \
      const int64_t head = row / t, i = row % t;                                            \
      const T* qi = q + row * hd;                                                           \
      const T* gi = dout + row * hd;                                                        \
      const T* kh = k + head * t * hd;                                                      \
      const T* vh = v + head * t * hd;                                                      \
      const float lse_i = lse[row];                                                         \
      const float dsum_i = sdpa_dot_rows(gi, out + row * hd, hd);                           \
      dsum[row] = dsum_i;                                                                   \
      const int64_t m = i / qs * qs;                                                        \
      const int64_t qb = qs < t - m ? qs : t - m;                                           \
      const int64_t num_keys = m + qb < t ? m + qb : t;                                     \
      float d[SDPA_MAX_HD], acc[SDPA_MAX_HD];                                               \
      for (int64_t e = 0; e < hd; e++) d[e] = 0.0f;                                         \
      for (int64_t n = 0; n < num_keys; n += kvs) {                                         \
        const int64_t kvb = kvs < t - n ? kvs : t - n;                                      \
        const int64_t ncol = kvb < num_keys - n ? kvb : num_keys - n;                       \
        const int64_t lv = sdpa_live(i, n, ncol);                                           \
        for (int64_t e = 0; e < hd; e++) acc[e] = 0.0f;                                     \
        for (int64_t c = 0; c < lv; c++) {                                                  \
          const T* kj = kh + (n + c) * hd;                                                  \
          const T* vj = vh + (n + c) * hd;                                                  \
          SDPA_PAIR(T)                                                                      \
          for (int64_t e = 0; e < hd; e++) acc[e] += g_ij * to_f32(kj[e]);                  \
        }                                                                                   \
        for (int64_t e = 0; e < hd; e++) d[e] = sdpa_round_f32(acc[e] * scale + d[e], q);   \
      }                                                                                     \
      for (int64_t e = 0; e < hd; e++) dq[row * hd + e] = from_f32<T>(d[e]);                \
    }                                                                                       \
  }

#define SDPA_BWD_DKV(NAME, T)                                                               \
  extern "C" __global__ void NAME(const T* __restrict__ q, const T* __restrict__ k,        \
                                  const T* __restrict__ v, const float* __restrict__ lse,  \
                                  const T* __restrict__ dout, const float* __restrict__ dsum, \
                                  T* __restrict__ dk, T* __restrict__ dv, int64_t bh,      \
                                  int64_t t, int64_t hd, int64_t qs, int64_t kvs,          \
                                  float scale) {                                            \
    GRID_STRIDE_LOOP(key, bh * t) {                                                         \
      const int64_t head = key / t, j = key % t;                                            \
      const T* kj = k + key * hd;                                                           \
      const T* vj = v + key * hd;                                                           \
      float dkj[SDPA_MAX_HD], dvj[SDPA_MAX_HD], ak[SDPA_MAX_HD], av[SDPA_MAX_HD];           \
      for (int64_t e = 0; e < hd; e++) dkj[e] = dvj[e] = 0.0f;                              \
      for (int64_t m = 0; m < t; m += qs) {                                                 \
        const int64_t end = m + qs < t ? m + qs : t;                                        \
        if (j >= end) continue;                                                             \
        for (int64_t e = 0; e < hd; e++) ak[e] = av[e] = 0.0f;                              \
        for (int64_t i = j > m ? j : m; i < end; i++) {                                     \
          const int64_t row = head * t + i;                                                 \
          const T* qi = q + row * hd;                                                       \
          const T* gi = dout + row * hd;                                                    \
          const float lse_i = lse[row], dsum_i = dsum[row];                                 \
          SDPA_PAIR(T)                                                                      \
          const float ar = sdpa_round_f32(a_ij, q);                                         \
          for (int64_t e = 0; e < hd; e++) {                                                \
            av[e] += ar * to_f32(gi[e]);                                                    \
            ak[e] += g_ij * to_f32(qi[e]);                                                  \
          }                                                                                 \
        }                                                                                   \
        for (int64_t e = 0; e < hd; e++) {                                                  \
          dvj[e] = sdpa_round_f32(av[e] + dvj[e], q);                                       \
          dkj[e] = sdpa_round_f32(ak[e] * scale + dkj[e], q);                               \
        }                                                                                   \
      }                                                                                     \
      for (int64_t e = 0; e < hd; e++) {                                                    \
        dk[key * hd + e] = from_f32<T>(dkj[e]);                                             \
        dv[key * hd + e] = from_f32<T>(dvj[e]);                                             \
      }                                                                                     \
    }                                                                                       \
  }

SDPA_FWD(sdpa_fwd_f16, __half)
SDPA_BWD_DQ(sdpa_bwd_dq_f16, __half)
SDPA_BWD_DKV(sdpa_bwd_dkv_f16, __half)
#if FSDP_BF16
SDPA_FWD(sdpa_fwd_bf16, __nv_bfloat16)
SDPA_BWD_DQ(sdpa_bwd_dq_bf16, __nv_bfloat16)
SDPA_BWD_DKV(sdpa_bwd_dkv_bf16, __nv_bfloat16)
#endif
