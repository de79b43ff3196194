// Residual connection and in-place accumulation (its backward, and gradient accumulation).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (N) = a (N) + b (N)
__global__ void residual_forward_kernel(float* out, const float* a, const float* b, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

void residual_forward(float* out, const float* a, const float* b, size_t N, cudaStream_t stream) {
  const int block = 256;
  residual_forward_kernel<<<grid_for(N, block), block, 0, stream>>>(out, a, b, N);
  CUDA_CHECK_LAUNCH();
}

// dst (N) += src (N)
__global__ void add_inplace_kernel(float* dst, const float* src, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] += src[i];
  }
}

void add_inplace(float* dst, const float* src, size_t N, cudaStream_t stream) {
  const int block = 256;
  add_inplace_kernel<<<grid_for(N, block), block, 0, stream>>>(dst, src, N);
  CUDA_CHECK_LAUNCH();
}

}  // namespace headroom::cuda
