// Optimizer updates on float parameters, gradients and state. The per-element update math is
// kernels/common/elementwise.h, shared with the CPU backend. (The gradient-norm reduction and the
// dtype-generic scale live in elementwise.cu.)
#include <cmath>

#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, size_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay,
                             float bc1, float bc2) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    float mi = m[i];
    float vi = v[i];
    param[i] =
        adamw_element(param[i], grad[i], mi, vi, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
    m[i] = mi;
    v[i] = vi;
  }
}

void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t,
                  cudaStream_t stream) {
  // Bias corrections once per step in double, exactly as the CPU backend does.
  const double td = static_cast<double>(t);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), td));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), td));
  const int block = 256;
  adamw_kernel<<<grid_for(n, block), block, 0, stream>>>(param, grad, m, v, n, lr, beta1, beta2,
                                                         eps, weight_decay, bc1, bc2);
  CUDA_CHECK_LAUNCH();
}

__global__ void sgd_kernel(float* param, const float* grad, size_t n, float lr,
                           float weight_decay) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    param[i] = sgd_element(param[i], grad[i], lr, weight_decay);
  }
}

__global__ void sgd_momentum_kernel(float* param, const float* grad, float* buf, size_t n, float lr,
                                    float momentum, float weight_decay) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    float b = buf[i];
    param[i] = sgd_momentum_element(param[i], grad[i], b, lr, momentum, weight_decay);
    buf[i] = b;
  }
}

void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, float lr,
                float momentum, float weight_decay, cudaStream_t stream) {
  const int block = 256;
  if (momentum_buf != nullptr && momentum != 0.0f) {
    sgd_momentum_kernel<<<grid_for(n, block), block, 0, stream>>>(param, grad, momentum_buf, n, lr,
                                                                  momentum, weight_decay);
  } else {
    sgd_kernel<<<grid_for(n, block), block, 0, stream>>>(param, grad, n, lr, weight_decay);
  }
  CUDA_CHECK_LAUNCH();
}

// x (n) *= s: the float case of the dtype-generic scale (elementwise.cu).
void scale_inplace(float* x, size_t n, float s, cudaStream_t stream) {
  scale<float>(x, n, static_cast<double>(s), stream);
}

}  // namespace headroom::cuda
