// Dropout's mask drawn again from its seed (kernels/common/dropout.h), the CPU reference's: a
// LoRA adapter's input in forward and its gradient in backward. Never run on a GPU yet: the op
// tests (tests/cuda_ops_test.cpp) skip without one.
#include "kernels/common/dropout.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (n) = inp (n) * (kept ? 1 / (1 - p) : 0): one thread an element, grid-stride. In place
// when out == inp.
template <class T>
__global__ void dropout_kernel(T* out, const T* inp, size_t n, float p, uint64_t seed) {
  const float s = dropout_scale(p);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(dropout_keep(seed, i, p) ? to_float(inp[i]) * s : 0.0f);
}

template <class T>
void dropout(T* out, const T* inp, size_t n, float p, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return;
  const int block = 256;
  dropout_kernel<<<grid_for(n, block), block, 0, stream>>>(out, inp, n, p, seed);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T) \
  template void dropout<T>(T*, const T*, size_t, float, uint64_t, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
