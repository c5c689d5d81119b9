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
// adam_f32(tensors (k) AdamTensor, k, lr, beta1, beta2, eps, weight_decay, decoupled)
//   decoupled (AdamW): p = p (1 - lr wd);  else g = g + wd p  (when wd != 0)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
//   p = p - step_size m / (sqrt(v) / bc2_sqrt + eps)
//   step_size = lr / (1 - b1^t) and bc2_sqrt = sqrt(1 - b2^t) per tensor, computed on the
//   host in f64 as the CPU optimizer does    (p, m, v updated in place; g read only)
#include "common.cuh"

struct SgdTensor {
  float* p;
  const float* g;
  float* buf;     // momentum buffer, null without momentum
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

extern "C" __global__ void sgd_f32(const SgdTensor* __restrict__ tensors, int64_t k, float lr,
                                   float momentum, float dampening, float weight_decay,
                                   int32_t nesterov) {
  for (int64_t s = blockIdx.y; s < k; s += gridDim.y) {
    SgdTensor t = tensors[s];
    GRID_STRIDE_LOOP(i, t.n) {
      float p = t.p[i];
      float d = t.g[i] + weight_decay * p;
      if (t.buf != nullptr) {
        float b = t.first ? d : momentum * t.buf[i] + (1.0f - dampening) * d;
        t.buf[i] = b;
        d = nesterov ? d + momentum * b : b;
      }
      t.p[i] = p - lr * d;
    }
  }
}

extern "C" __global__ void adam_f32(const AdamTensor* __restrict__ tensors, int64_t k,
                                    float lr, float beta1, float beta2, float eps,
                                    float weight_decay, int32_t decoupled) {
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
