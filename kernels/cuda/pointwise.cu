// headroom.ops/1's element-wise ops (headroom/ext/ops.h): binary, unary, lerp, affine over a
// storage type T (float, bf16, f16). Each element is kernels/common/pointwise.h's function of
// the widened inputs, the CPU backend's own, rounded to T to nearest even: bitwise the CPU's.
// Grid-stride loops; an output may be an input's very buffer (each thread reads element i before
// it writes it), so no pointer is __restrict__.
#include "kernels/common/pointwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

constexpr int kBlock = 256;

// z (n) = x op y
template <class T>
__global__ void binary_kernel(BinaryOp op, T* z, const T* x, const T* y, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    z[i] = from_float<T>(pointwise::binary(op, to_float(x[i]), to_float(y[i])));
  }
}

// y (n) = op(x)
template <class T>
__global__ void unary_kernel(UnaryOp op, T* y, const T* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] = from_float<T>(pointwise::unary(op, to_float(x[i])));
  }
}

// z (n) = x + w (y - x)
template <class T>
__global__ void lerp_kernel(T* z, const T* x, const T* y, float w, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    z[i] = from_float<T>(pointwise::lerp(to_float(x[i]), to_float(y[i]), w));
  }
}

// y (n) = a x + b
template <class T>
__global__ void affine_kernel(T* y, const T* x, float a, float b, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] = from_float<T>(pointwise::affine(to_float(x[i]), a, b));
  }
}

}  // namespace

template <class T>
void binary(BinaryOp op, T* z, const T* x, const T* y, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  binary_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(op, z, x, y, n);
  CUDA_CHECK_LAUNCH();
}

template <class T>
void unary(UnaryOp op, T* y, const T* x, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  unary_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(op, y, x, n);
  CUDA_CHECK_LAUNCH();
}

template <class T>
void lerp(T* z, const T* x, const T* y, float w, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  lerp_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(z, x, y, w, n);
  CUDA_CHECK_LAUNCH();
}

template <class T>
void affine(T* y, const T* x, float a, float b, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  affine_kernel<<<grid_for(n, kBlock), kBlock, 0, stream>>>(y, x, a, b, n);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                          \
  template void binary<T>(BinaryOp, T*, const T*, const T*, size_t, cudaStream_t); \
  template void unary<T>(UnaryOp, T*, const T*, size_t, cudaStream_t);             \
  template void lerp<T>(T*, const T*, const T*, float, size_t, cudaStream_t);      \
  template void affine<T>(T*, const T*, float, float, size_t, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
