// LayerNorm over the last dimension (eps 1e-5, biased variance, like PyTorch). Statistics in fp32
// (float mean and rstd) whatever the storage type.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// One warp per row of inp (N,C). Two passes (mean, then squared deviations), as on the CPU: no
// cancellation from E[x^2] - E[x]^2.
template <class T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                         const T* weight, const T* bias, int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const T* x = inp + static_cast<size_t>(n) * C;
  T* y = out + static_cast<size_t>(n) * C;
  float sum = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    sum += to_float(x[i]);
  }
  const float m = warp_sum(sum) / C;
  float sq = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float d = to_float(x[i]) - m;
    sq += d * d;
  }
  const float s = 1.0f / sqrtf(warp_sum(sq) / C + 1e-5f);
  for (int i = lane; i < C; i += kWarpSize) {
    y[i] = from_float<T>((to_float(x[i]) - m) * s * to_float(weight[i]) + to_float(bias[i]));
  }
  if (lane == 0) {
    if (mean != nullptr) mean[n] = m;
    if (rstd != nullptr) rstd[n] = s;
  }
}

template <class T>
void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                       const T* bias, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  layernorm_forward_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                             stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  CUDA_CHECK_LAUNCH();
}

// dinp (N,C): one warp per row; the two row reductions, then one pass adding into dinp.
template <class T>
__global__ void layernorm_backward_dinp_kernel(T* dinp, const T* dout, const T* inp,
                                               const T* weight, const float* mean,
                                               const float* rstd, int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const size_t off = static_cast<size_t>(n) * C;
  const T* x = inp + off;
  const T* dy = dout + off;
  T* dx = dinp + off;
  const float m = mean[n];
  const float s = rstd[n];
  float sum_dnorm = 0.0f;
  float sum_dnorm_norm = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const float norm = (to_float(x[i]) - m) * s;
    const float dnorm = to_float(weight[i]) * to_float(dy[i]);
    sum_dnorm += dnorm;
    sum_dnorm_norm += dnorm * norm;
  }
  const float mean_dnorm = warp_sum(sum_dnorm) / C;
  const float mean_dnorm_norm = warp_sum(sum_dnorm_norm) / C;
  for (int i = lane; i < C; i += kWarpSize) {
    const float norm = (to_float(x[i]) - m) * s;
    const float dnorm = to_float(weight[i]) * to_float(dy[i]);
    dx[i] = from_float<T>(to_float(dx[i]) + (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s);
  }
}

// dweight, dbias (C; either may be null): one thread per column, the rows in order from the old
// values, stored once (deterministic, coalesced; the CPU's order of additions).
template <class T>
__global__ void layernorm_backward_params_kernel(T* dweight, T* dbias, const T* dout, const T* inp,
                                                 const float* mean, const float* rstd, int N,
                                                 int C) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= C) return;
  float dw = dweight != nullptr ? to_float(dweight[i]) : 0.0f;
  float db = dbias != nullptr ? to_float(dbias[i]) : 0.0f;
  for (int n = 0; n < N; n++) {
    const size_t idx = static_cast<size_t>(n) * C + i;
    const float norm = (to_float(inp[idx]) - mean[n]) * rstd[n];
    const float dy = to_float(dout[idx]);
    db += dy;
    dw += norm * dy;
  }
  if (dweight != nullptr) dweight[i] = from_float<T>(dw);
  if (dbias != nullptr) dbias[i] = from_float<T>(db);
}

template <class T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const float* mean, const float* rstd, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  if (dinp != nullptr) {
    layernorm_backward_dinp_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                                     stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  }
  if (dweight != nullptr || dbias != nullptr) {
    layernorm_backward_params_kernel<<<static_cast<unsigned>(ceil_div(C, block)), block, 0,
                                       stream>>>(dweight, dbias, dout, inp, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  }
}

#define HR_INSTANTIATE(T)                                                                        \
  template void layernorm_forward<T>(T*, float*, float*, const T*, const T*, const T*, int, int, \
                                     cudaStream_t);                                              \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const float*,    \
                                      const float*, int, int, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
