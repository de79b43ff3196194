// Residual connection and in-place accumulation (its backward, and gradient accumulation).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (N) = a (N) + b (N)
template <class T>
__global__ void residual_forward_kernel(T* out, const T* a, const T* b, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
  }
}

template <class T>
void residual_forward(T* out, const T* a, const T* b, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  const int block = 256;
  residual_forward_kernel<<<grid_for(N, block), block, 0, stream>>>(out, a, b, N);
  CUDA_CHECK_LAUNCH();
}

// dst (N) += src (N)
template <class T>
__global__ void add_inplace_kernel(T* dst, const T* src, size_t N) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < N;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = from_float<T>(to_float(dst[i]) + to_float(src[i]));
  }
}

template <class T>
void add_inplace(T* dst, const T* src, size_t N, cudaStream_t stream) {
  if (N == 0) return;
  const int block = 256;
  add_inplace_kernel<<<grid_for(N, block), block, 0, stream>>>(dst, src, N);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                          \
  template void residual_forward<T>(T*, const T*, const T*, size_t, cudaStream_t); \
  template void add_inplace<T>(T*, const T*, size_t, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
