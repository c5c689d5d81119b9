// Kernels a captured CUDA graph needs so that a replayed step is not a copy of the
// captured one (src/backend/cuda/graph.rs; PyTorch's `capturable=True` Adam).
//
// adam_bias_f32(tensors (k) AdamTensor, k, step (1) int64, lrs (n_lrs) double, n_lrs, base,
//               lr_out (1) float, lr, beta1, beta2)
//   step[0] += 1 (=), then the step's learning rate: lrs[step - base] (the schedule's rate
//   of every step from the captured one on, base being the captured step's count; clamped
//   to the table's last entry), or the argument lr when lrs is null; lr_out = (float)rate
//   (=, the rate adam_f32 reads for its decoupled decay). Then every tensor's step_size
//   and bc2_sqrt (=) from that count, as src/backend/cuda/optim.rs computes them on the
//   host for an eager step: in double, bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (powi:
//   binary powering, the algorithm of the host's `f64::powi`), step_size =
//   (float)(rate / bc1), bc2_sqrt = (float)sqrt(bc2). The rates and the betas are the f32
//   settings widened to double. One thread.
// adam_bias_f64(tensors (k) AdamTensor64, k, step, lrs, n_lrs, base, lr_out (1) double, lr,
//               beta1, beta2)
//   The same for the f64 step, with pow(beta, step) (the host's `powf`) and no rounding to
//   float. One thread.
#include "common.cuh"

struct GraphAdamTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float step_size;
  float bc2_sqrt;
};

struct GraphAdamTensor64 {
  double* p;
  const double* g;
  double* m;
  double* v;
  int64_t n;
  double step_size;
  double bc2_sqrt;
};

// Rust's f64::powi (compiler-builtins' __powidf2): square-and-multiply over the bits of e.
__device__ inline double powi_host(double a, int32_t e) {
  bool recip = e < 0;
  uint32_t b = recip ? (uint32_t)(-(int64_t)e) : (uint32_t)e;
  double r = 1.0;
  while (true) {
    if (b & 1u) r *= a;
    b >>= 1;
    if (b == 0) break;
    a *= a;
  }
  return recip ? 1.0 / r : r;
}

// The learning rate of step count s: the table's entry (clamped to it), or `lr`.
__device__ inline double step_lr(const double* lrs, int64_t n_lrs, int64_t base, int64_t s,
                                 double lr) {
  if (lrs == nullptr || n_lrs <= 0) return lr;
  int64_t i = s - base;
  i = i < 0 ? 0 : (i >= n_lrs ? n_lrs - 1 : i);
  return lrs[i];
}

extern "C" __global__ void adam_bias_f32(GraphAdamTensor* __restrict__ tensors, int64_t k,
                                         int64_t* __restrict__ step,
                                         const double* __restrict__ lrs, int64_t n_lrs,
                                         int64_t base, float* __restrict__ lr_out, double lr,
                                         double beta1, double beta2) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int64_t s = step[0] + 1;
  step[0] = s;
  lr = step_lr(lrs, n_lrs, base, s, lr);
  lr_out[0] = (float)lr;
  const double bc1 = 1.0 - powi_host(beta1, (int32_t)s);
  const double bc2 = 1.0 - powi_host(beta2, (int32_t)s);
  const float step_size = (float)(lr / bc1);
  const float bc2_sqrt = (float)sqrt(bc2);
  for (int64_t i = 0; i < k; ++i) {
    tensors[i].step_size = step_size;
    tensors[i].bc2_sqrt = bc2_sqrt;
  }
}

extern "C" __global__ void adam_bias_f64(GraphAdamTensor64* __restrict__ tensors, int64_t k,
                                         int64_t* __restrict__ step,
                                         const double* __restrict__ lrs, int64_t n_lrs,
                                         int64_t base, double* __restrict__ lr_out, double lr,
                                         double beta1, double beta2) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int64_t s = step[0] + 1;
  step[0] = s;
  lr = step_lr(lrs, n_lrs, base, s, lr);
  lr_out[0] = lr;
  const double bc1 = 1.0 - pow(beta1, (double)s);
  const double step_size = lr / bc1;
  const double bc2_sqrt = sqrt(1.0 - pow(beta2, (double)s));
  for (int64_t i = 0; i < k; ++i) {
    tensors[i].step_size = step_size;
    tensors[i].bc2_sqrt = bc2_sqrt;
  }
}
