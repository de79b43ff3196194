// Fused softmax + cross-entropy loss + its backward, writing dlogits over the logits (the largest
// activation of GPT-2: nothing reads the logits after the loss).
#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// One block per row of logits (N,V). Same arithmetic as the CPU: max, sum of exp(x - max) in
// double, loss = log(sum) - (x_target - max), grad = exp(x - max) * (dloss / sum) - dloss onehot,
// the product and the difference rounded to fp32 separately (no fused multiply-add, as the CPU)
// and the result stored once.
template <class T>
__global__ void crossentropy_forward_backward_kernel(T* logits, float* losses,
                                                     const int32_t* targets, int V, float dloss) {
  const int n = blockIdx.x;
  T* row = logits + static_cast<size_t>(n) * V;
  const int32_t target = targets[n];
  if (target < 0) {  // ignored row: zero gradient, zero loss
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      row[i] = from_float<T>(0.0f);
    }
    if (threadIdx.x == 0) losses[n] = 0.0f;
    return;
  }
  // Read before the first barrier: after the last one, threads overwrite the row.
  const float x_target = to_float(row[target]);
  float maxv = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    maxv = fmaxf(maxv, to_float(row[i]));
  }
  maxv = block_max(maxv);
  double sum = 0.0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    sum += static_cast<double>(exp_minus_abs(to_float(row[i]) - maxv));
  }
  sum = block_sum(sum);
  const float scale = static_cast<float>(static_cast<double>(dloss) / sum);
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    float g = __fmul_rn(exp_minus_abs(to_float(row[i]) - maxv), scale);  // dloss * softmax
    if (i == target) g = __fsub_rn(g, dloss);                            // - dloss * onehot
    row[i] = from_float<T>(g);
  }
  if (threadIdx.x == 0) {
    losses[n] = static_cast<float>(log(sum) - (static_cast<double>(x_target) - maxv));
  }
}

template <class T>
void crossentropy_forward_backward(T* logits, float* losses, const int32_t* targets, int N, int V,
                                   float dloss, cudaStream_t stream) {
  if (N <= 0) return;
  const int block = 512;
  crossentropy_forward_backward_kernel<<<static_cast<unsigned>(N), block, 0, stream>>>(
      logits, losses, targets, V, dloss);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                                     \
  template void crossentropy_forward_backward<T>(T*, float*, const int32_t*, int, int, float, \
                                                 cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
