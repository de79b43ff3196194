// GELU (GPT-2's tanh approximation); the per-element math is kernels/common/elementwise.h, the
// same function the CPU backend computes.
#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (N) = gelu(inp (N))
__global__ void gelu_forward_kernel(float* out, const float* inp, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = gelu_tanh(inp[i]);
  }
}

void gelu_forward(float* out, const float* inp, size_t N, cudaStream_t stream) {
  const int block = 256;
  gelu_forward_kernel<<<grid_for(N, block), block, 0, stream>>>(out, inp, N);
  CUDA_CHECK_LAUNCH();
}

// dinp (N) += gelu'(inp) * dout
__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    dinp[i] += gelu_tanh_grad(inp[i]) * dout[i];
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N,
                   cudaStream_t stream) {
  const int block = 256;
  gelu_backward_kernel<<<grid_for(N, block), block, 0, stream>>>(dinp, inp, dout, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace headroom::cuda
