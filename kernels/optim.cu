// optim.cu: fused multi-tensor optimizer steps on FSDP shards: one launch updates every
// tensor of a list (a unit's trainable runs, or all units' shards). Same arithmetic, in the
// same order, as the CPU optimizers (src/optim/sgd.rs, src/optim/adam.rs, PyTorch's
// single-tensor update rules), so with --fmad=false the results are bitwise equal.
// blockIdx.y walks the tensors (stride gridDim.y), x is a grid-stride loop within one.
// The descriptor tables live in device memory; layouts match backend::cuda::optim.
//
// sgd_f32(tensors (k) SgdTensor, k, lr, momentum, dampening, weight_decay, nesterov)
//   d = g + wd p
//   if buf: buf = first ? d : momentum buf + (1 - dampening) d;  d = nesterov ? d + momentum buf : buf
//   p = p - lr d                                 (p, buf updated in place; g read only)
// adam_f32(tensors (k) AdamTensor, k, lr, beta1, beta2, eps, weight_decay, decoupled, lr_at)
//   lr = *lr_at when lr_at is not null (a CUDA graph's step: the rate adam_bias_f32 of
//   graph.cu wrote for this replay), else the argument
//   decoupled (AdamW): p = p (1 - lr wd);  else g = g + wd p  (when wd != 0)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
//   p = p - step_size m / (sqrt(v) / bc2_sqrt + eps)
//   step_size = lr / (1 - b1^t) and bc2_sqrt = sqrt(1 - b2^t) per tensor, computed on the
//   host in f64 as the CPU optimizer does    (p, m, v updated in place; g read only)
// sgd_f64: sgd_f32's template on double tensors and hyperparameters (the f64 SGD of
//   src/optim/sgd.rs, `step_f64`).
// adam_f64(tensors (k) AdamTensor64, k, lr, beta1, beta2, eps, weight_decay, decoupled, lr_at)
//   The f64 update of src/optim/adam.rs (`adam_update_f64`, PyTorch's single-tensor order):
//   decay as adam_f32; w = 1 - b1; m = w < 0.5 ? m + w (g - m) : g - (g - m)(1 - w) (lerp);
//   v = v b2 + g g (1 - b2); p = p - step_size (m / (sqrt(v) / bc2_sqrt + eps)), all in f64,
//   step_size and bc2_sqrt per tensor from the host (C pow, as Python's `beta ** step`).
#include "common.cuh"

template <typename T>
struct SgdTensor {
  T* p;
  const T* g;
  T* buf;         // momentum buffer, null without momentum
  int64_t n;
  int32_t first;  // 1 on the buffer's first step: buf = d, undamped
  int32_t pad;
};

struct AdamTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float step_size;
  float bc2_sqrt;
};

template <typename T>
__device__ inline void sgd_update(const SgdTensor<T>* __restrict__ tensors, int64_t k, T lr,
                                  T momentum, T dampening, T weight_decay, int32_t nesterov) {
  for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {
    SgdTensor<T> t = tensors[s];
    GRID_STRIDE_LOOP(i, t.n) {
      T p = t.p[i];
      T d = t.g[i] + weight_decay * p;
      if (t.buf != nullptr) {
        T b = t.first ? d : momentum * t.buf[i] + ((T)1 - dampening) * d;
        t.buf[i] = b;
        d = nesterov ? d + momentum * b : b;
      }
      t.p[i] = p - lr * d;
    }
  }
}

#define SGD_KERNEL(S, T)                                                                   \
  extern "C" __global__ void sgd_##S(const SgdTensor<T>* __restrict__ tensors, int64_t k,  \
                                     T lr, T momentum, T dampening, T weight_decay,        \
                                     int32_t nesterov) {                                   \
    sgd_update<T>(tensors, k, lr, momentum, dampening, weight_decay, nesterov);            \
  }
SGD_KERNEL(f32, float)
SGD_KERNEL(f64, double)

extern "C" __global__ void adam_f32(const AdamTensor* __restrict__ tensors, int64_t k,
                                    float lr, float beta1, float beta2, float eps,
                                    float weight_decay, int32_t decoupled,
                                    const float* __restrict__ lr_at) {
  if (lr_at != nullptr) lr = lr_at[0];
  for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {
    AdamTensor t = tensors[s];
    GRID_STRIDE_LOOP(i, t.n) {
      float p = t.p[i];
      float g = t.g[i];
      if (decoupled) {
        p = p * (1.0f - lr * weight_decay);
      } else if (weight_decay != 0.0f) {
        g = g + weight_decay * p;
      }
      float m = beta1 * t.m[i] + (1.0f - beta1) * g;
      float v = beta2 * t.v[i] + (1.0f - beta2) * g * g;
      t.m[i] = m;
      t.v[i] = v;
      float denom = sqrtf(v) / t.bc2_sqrt + eps;
      t.p[i] = p - t.step_size * m / denom;
    }
  }
}

struct AdamTensor64 {
  double* p;
  const double* g;
  double* m;
  double* v;
  int64_t n;
  double step_size;
  double bc2_sqrt;
};

extern "C" __global__ void adam_f64(const AdamTensor64* __restrict__ tensors, int64_t k,
                                    double lr, double beta1, double beta2, double eps,
                                    double weight_decay, int32_t decoupled,
                                    const double* __restrict__ lr_at) {
  if (lr_at != nullptr) lr = lr_at[0];
  const double w = 1.0 - beta1;
  for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {
    AdamTensor64 t = tensors[s];
    GRID_STRIDE_LOOP(i, t.n) {
      double p = t.p[i];
      double g = t.g[i];
      if (decoupled) {
        p = p * (1.0 - lr * weight_decay);
      } else if (weight_decay != 0.0) {
        g = g + weight_decay * p;
      }
      const double m0 = t.m[i];
      const double m = w < 0.5 ? m0 + w * (g - m0) : g - (g - m0) * (1.0 - w);
      const double v = t.v[i] * beta2 + g * g * (1.0 - beta2);
      t.m[i] = m;
      t.v[i] = v;
      const double denom = sqrt(v) / t.bc2_sqrt + eps;
      t.p[i] = p - t.step_size * (m / denom);
    }
  }
}
