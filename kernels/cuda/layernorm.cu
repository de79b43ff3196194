// LayerNorm over the last dimension (eps 1e-5, biased variance, like PyTorch).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// One warp per row of inp (N,C). Two passes (mean, then squared deviations), as on the CPU: no
// cancellation from E[x^2] - E[x]^2.
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const float* x = inp + static_cast<size_t>(n) * C;
  float* y = out + static_cast<size_t>(n) * C;
  float sum = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    sum += x[i];
  }
  const float m = warp_sum(sum) / C;
  float sq = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float d = x[i] - m;
    sq += d * d;
  }
  const float s = 1.0f / sqrtf(warp_sum(sq) / C + 1e-5f);
  for (int i = lane; i < C; i += kWarpSize) {
    y[i] = (x[i] - m) * s * weight[i] + bias[i];
  }
  if (lane == 0) {
    if (mean != nullptr) mean[n] = m;
    if (rstd != nullptr) rstd[n] = s;
  }
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, cudaStream_t stream) {
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  layernorm_forward_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                             stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  CUDA_CHECK_LAUNCH();
}

// dinp: one warp per row; the two row reductions, then one pass writing dinp.
__global__ void layernorm_backward_dinp_kernel(float* dinp, const float* dout, const float* inp,
                                               const float* weight, const float* mean,
                                               const float* rstd, int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const size_t off = static_cast<size_t>(n) * C;
  const float* x = inp + off;
  const float* dy = dout + off;
  float* dx = dinp + off;
  const float m = mean[n];
  const float s = rstd[n];
  float sum_dnorm = 0.0f;
  float sum_dnorm_norm = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float norm = (x[i] - m) * s;
    const float dnorm = weight[i] * dy[i];
    sum_dnorm += dnorm;
    sum_dnorm_norm += dnorm * norm;
  }
  const float mean_dnorm = warp_sum(sum_dnorm) / C;
  const float mean_dnorm_norm = warp_sum(sum_dnorm_norm) / C;
  for (int i = lane; i < C; i += kWarpSize) {
    const float norm = (x[i] - m) * s;
    const float dnorm = weight[i] * dy[i];
    dx[i] += (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s;
  }
}

// dweight, dbias: one thread per column, summing the rows in order (deterministic, coalesced).
__global__ void layernorm_backward_params_kernel(float* dweight, float* dbias, const float* dout,
                                                 const float* inp, const float* mean,
                                                 const float* rstd, int N, int C) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= C) return;
  float dw = 0.0f;
  float db = 0.0f;
  for (int n = 0; n < N; n++) {
    const size_t idx = static_cast<size_t>(n) * C + i;
    const float norm = (inp[idx] - mean[n]) * rstd[n];
    db += dout[idx];
    dw += norm * dout[idx];
  }
  dweight[i] += dw;
  dbias[i] += db;
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C, cudaStream_t stream) {
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  layernorm_backward_dinp_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                                   stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  CUDA_CHECK_LAUNCH();
  layernorm_backward_params_kernel<<<static_cast<unsigned>(ceil_div(C, block)), block, 0, stream>>>(
      dweight, dbias, dout, inp, mean, rstd, N, C);
  CUDA_CHECK_LAUNCH();
}

}  // namespace headroom::cuda
