// Fused softmax + cross-entropy loss + its backward, writing dlogits over the logits (the largest
// activation of GPT-2: nothing reads the logits after the loss).
#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// One block per row of logits (N,V). Same arithmetic as the CPU: max, sum of exp(x - max) in
// double, loss = log(sum) - (x_target - max), grad = exp(x - max) * (dloss / sum) - dloss onehot.
__global__ void crossentropy_forward_backward_kernel(float* logits, float* losses,
                                                     const int32_t* targets, int V, float dloss) {
  const int n = blockIdx.x;
  float* row = logits + static_cast<size_t>(n) * V;
  const int32_t target = targets[n];
  if (target < 0) {  // ignored row: zero gradient, zero loss
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      row[i] = 0.0f;
    }
    if (threadIdx.x == 0) losses[n] = 0.0f;
    return;
  }
  // Read before the first barrier: after it, other threads overwrite the row.
  const float x_target = row[target];
  float maxv = -INFINITY;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    maxv = fmaxf(maxv, row[i]);
  }
  maxv = block_max(maxv);
  double sum = 0.0;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    sum += static_cast<double>(exp_minus_abs(row[i] - maxv));
  }
  sum = block_sum(sum);
  const float scale = static_cast<float>(static_cast<double>(dloss) / sum);
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    row[i] = exp_minus_abs(row[i] - maxv) * scale;  // dloss * softmax
  }
  __syncthreads();  // row[target] was written by whichever thread owns it
  if (threadIdx.x == 0) {
    row[target] -= dloss;  // - dloss * onehot
    losses[n] = static_cast<float>(log(sum) - (static_cast<double>(x_target) - maxv));
  }
}

void crossentropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N,
                                   int V, float dloss, cudaStream_t stream) {
  if (N == 0) return;
  const int block = 512;
  crossentropy_forward_backward_kernel<<<static_cast<unsigned>(N), block, 0, stream>>>(
      logits, losses, targets, V, dloss);
  CUDA_CHECK_LAUNCH();
}

}  // namespace headroom::cuda
