// GELU (GPT-2's tanh approximation); the per-element math is kernels/common/elementwise.h, the
// same function the CPU backend computes.
#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (N) = gelu(inp (N))
template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = from_float<T>(gelu_tanh(to_float(inp[i])));
  }
}

template <class T>
void gelu_forward(T* out, const T* inp, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  const int block = 256;
  gelu_forward_kernel<<<grid_for(N, block), block, 0, stream>>>(out, inp, N);
  CUDA_CHECK_LAUNCH();
}

// dinp (N) += gelu'(inp) * dout
template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, size_t N,
                                     bool accumulate) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    const float old = accumulate ? to_float(dinp[i]) : 0.0f;
    dinp[i] = from_float<T>(old + gelu_tanh_grad(to_float(inp[i])) * to_float(dout[i]));
  }
}

template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N, cudaStream_t stream,
                   bool accumulate) {
  if (N == 0) return;
  const int block = 256;
  gelu_backward_kernel<<<grid_for(N, block), block, 0, stream>>>(dinp, inp, dout, N, accumulate);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                            \
  template void gelu_forward<T>(T*, const T*, size_t, cudaStream_t); \
  template void gelu_backward<T>(T*, const T*, const T*, size_t, cudaStream_t, bool);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
