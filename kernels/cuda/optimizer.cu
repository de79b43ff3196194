// Optimizer updates on float parameters, gradients and state. The per-element update math is
// kernels/common/elementwise.h, shared with the CPU backend. (The gradient-norm reduction and the
// dtype-generic scale live in elementwise.cu.)
#include <cmath>

#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// Element i's compute-dtype copy of the new weight w, when the update writes one (CopyOut): the
// bits cast_kernel writes (from_float's float_to_bf16 / float_to_f16).
__device__ inline void write_copy(CopyOut copy, size_t i, float w) {
  if (copy.data == nullptr) return;
  copy.data[i] = copy.f16 ? float_to_f16(w) : float_to_bf16(w);
}
// Weights stored as bf16 bits have no copy (the backend refuses one).
__device__ inline void write_copy(CopyOut, size_t, uint16_t) {}

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, size_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay,
                             float bc1, float bc2, float grad_scale, CopyOut copy) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    float mi = m[i];
    float vi = v[i];
    const float w = adamw_element(param[i], __fmul_rn(grad[i], grad_scale), mi, vi, lr, beta1,
                                  beta2, eps, weight_decay, bc1, bc2);
    param[i] = w;
    write_copy(copy, i, w);
    m[i] = mi;
    v[i] = vi;
  }
}

void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t,
                  float grad_scale, CopyOut copy, cudaStream_t stream) {
  // Bias corrections once per step in double, exactly as the CPU backend does.
  const double td = static_cast<double>(t);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), td));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), td));
  const int block = 256;
  adamw_kernel<<<grid_for(n, block), block, 0, stream>>>(
      param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale, copy);
  CUDA_CHECK_LAUNCH();
}

__global__ void sgd_kernel(float* param, const float* grad, size_t n, float lr, float weight_decay,
                           float grad_scale, CopyOut copy) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float w = sgd_element(param[i], __fmul_rn(grad[i], grad_scale), lr, weight_decay);
    param[i] = w;
    write_copy(copy, i, w);
  }
}

__global__ void sgd_momentum_kernel(float* param, const float* grad, float* buf, size_t n, float lr,
                                    float momentum, float weight_decay, float grad_scale,
                                    CopyOut copy) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    float b = buf[i];
    const float w = sgd_momentum_element(param[i], __fmul_rn(grad[i], grad_scale), b, lr, momentum,
                                         weight_decay);
    param[i] = w;
    write_copy(copy, i, w);
    buf[i] = b;
  }
}

void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, float lr,
                float momentum, float weight_decay, float grad_scale, CopyOut copy,
                cudaStream_t stream) {
  const int block = 256;
  if (momentum_buf != nullptr && momentum != 0.0f) {
    sgd_momentum_kernel<<<grid_for(n, block), block, 0, stream>>>(
        param, grad, momentum_buf, n, lr, momentum, weight_decay, grad_scale, copy);
  } else {
    sgd_kernel<<<grid_for(n, block), block, 0, stream>>>(param, grad, n, lr, weight_decay,
                                                         grad_scale, copy);
  }
  CUDA_CHECK_LAUNCH();
}

// AdamW and SGD on stored operands (float, or uint16_t bf16 bits rounded stochastically): the
// element math is kernels/common/elementwise.h's adamw_stored / sgd_stored, the CPU's own.
template <class W, class G, class S>
__global__ void adamw_stored_kernel(W* param, const G* grad, S* m, S* v, size_t n, float lr,
                                    float beta1, float beta2, float eps, float weight_decay,
                                    float bc1, float bc2, uint32_t seed, CopyOut copy) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    adamw_stored(param[i], grad[i], m[i], v[i], i, seed, lr, beta1, beta2, eps, weight_decay, bc1,
                 bc2);
    write_copy(copy, i, param[i]);
  }
}

template <class W, class G, class S>
void adamw_update_stored(W* param, const G* grad, S* m, S* v, size_t n, float lr, float beta1,
                         float beta2, float eps, float weight_decay, int64_t t, uint32_t seed,
                         CopyOut copy, cudaStream_t stream) {
  const double td = static_cast<double>(t);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), td));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2), td));
  const int block = 256;
  adamw_stored_kernel<<<grid_for(n, block), block, 0, stream>>>(
      param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, bc1, bc2, seed, copy);
  CUDA_CHECK_LAUNCH();
}

template <class W, class G, class S>
__global__ void sgd_stored_kernel(W* param, const G* grad, S* buf, size_t n, float lr,
                                  float momentum, float weight_decay, uint32_t seed, CopyOut copy) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    sgd_stored(param[i], grad[i], buf ? buf + i : static_cast<S*>(nullptr), i, seed, lr, momentum,
               weight_decay);
    write_copy(copy, i, param[i]);
  }
}

template <class W, class G, class S>
void sgd_update_stored(W* param, const G* grad, S* momentum_buf, size_t n, float lr, float momentum,
                       float weight_decay, uint32_t seed, CopyOut copy, cudaStream_t stream) {
  const int block = 256;
  S* buf = momentum != 0.0f ? momentum_buf : nullptr;
  sgd_stored_kernel<<<grid_for(n, block), block, 0, stream>>>(param, grad, buf, n, lr, momentum,
                                                              weight_decay, seed, copy);
  CUDA_CHECK_LAUNCH();
}

#define HR_STORED(W, G, S)                                                                      \
  template void adamw_update_stored<W, G, S>(W*, const G*, S*, S*, size_t, float, float, float, \
                                             float, float, int64_t, uint32_t, CopyOut,          \
                                             cudaStream_t);                                     \
  template void sgd_update_stored<W, G, S>(W*, const G*, S*, size_t, float, float, float,       \
                                           uint32_t, CopyOut, cudaStream_t);
HR_STORED(float, float, float)
HR_STORED(float, float, uint16_t)
HR_STORED(float, uint16_t, float)
HR_STORED(float, uint16_t, uint16_t)
HR_STORED(uint16_t, float, float)
HR_STORED(uint16_t, float, uint16_t)
HR_STORED(uint16_t, uint16_t, float)
HR_STORED(uint16_t, uint16_t, uint16_t)
#undef HR_STORED

// x (n) *= s: the float case of the dtype-generic scale (elementwise.cu).
void scale_inplace(float* x, size_t n, float s, cudaStream_t stream) {
  scale<float>(x, n, static_cast<double>(s), stream);
}

}  // namespace headroom::cuda
