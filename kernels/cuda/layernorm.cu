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

// res (N,C) += x (N,C), then layernorm_forward_kernel on res: one warp per row, each lane adding
// and rounding the elements it then reads (lane i, i + 32, ...), so the sums it normalises are the
// values it stored: bitwise add_inplace_kernel then layernorm_forward_kernel, one pass over res
// fewer.
template <class T>
__global__ void residual_layernorm_forward_kernel(T* out, float* mean, float* rstd, T* res,
                                                  const T* add, const T* weight, const T* bias,
                                                  int N, int C) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  T* x = res + static_cast<size_t>(n) * C;
  const T* a = add + static_cast<size_t>(n) * C;
  T* y = out + static_cast<size_t>(n) * C;
  float sum = 0.0f;
  for (int i = lane; i < C; i += kWarpSize) {
    const T v = from_float<T>(to_float(x[i]) + to_float(a[i]));
    x[i] = v;
    sum += to_float(v);
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
void residual_layernorm_forward(T* out, float* mean, float* rstd, T* res, const T* x,
                                const T* weight, const T* bias, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  residual_layernorm_forward_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                                      stream>>>(out, mean, rstd, res, x, weight, bias, N, C);
  CUDA_CHECK_LAUNCH();
}

// dinp (N,C): one warp per row; the two row reductions, then one pass adding into dinp (or into
// dres, or 0, written to dinp: !accumulate).
template <class T>
__global__ void layernorm_backward_dinp_kernel(T* dinp, const T* dout, const T* inp,
                                               const T* weight, const float* mean,
                                               const float* rstd, int N, int C, bool accumulate,
                                               const T* dres) {
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
    const float base = accumulate ? to_float(dx[i]) : dres ? to_float(dres[off + i]) : 0.0f;
    dx[i] = from_float<T>(base + (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s);
  }
}

// dweight, dbias (C; either may be null). A block is a tile of 32 columns (threadIdx.x) by 32 row
// lanes (threadIdx.y): lane y sums rows y, y+32, ... of its column, then lane 0 adds the 32
// partial sums in lane order to the old values and stores once — a fixed order of additions
// (deterministic), coalesced reads of 32 consecutive columns per warp.
template <class T>
__global__ void layernorm_backward_params_kernel(T* dweight, T* dbias, const T* dout, const T* inp,
                                                 const float* mean, const float* rstd, int N,
                                                 int C) {
  __shared__ float partial_w[kWarpSize][kWarpSize + 1];  // [lane y][column x]
  __shared__ float partial_b[kWarpSize][kWarpSize + 1];
  const int i = blockIdx.x * kWarpSize + threadIdx.x;
  float dw = 0.0f, db = 0.0f;
  if (i < C) {
    for (int n = threadIdx.y; n < N; n += kWarpSize) {
      const size_t idx = static_cast<size_t>(n) * C + i;
      const float norm = (to_float(inp[idx]) - mean[n]) * rstd[n];
      const float dy = to_float(dout[idx]);
      db += dy;
      dw += norm * dy;
    }
  }
  partial_w[threadIdx.y][threadIdx.x] = dw;
  partial_b[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y != 0 || i >= C) return;
  float tw = dweight != nullptr ? to_float(dweight[i]) : 0.0f;
  float tb = dbias != nullptr ? to_float(dbias[i]) : 0.0f;
  for (int y = 0; y < kWarpSize; y++) {
    tw += partial_w[y][threadIdx.x];
    tb += partial_b[y][threadIdx.x];
  }
  if (dweight != nullptr) dweight[i] = from_float<T>(tw);
  if (dbias != nullptr) dbias[i] = from_float<T>(tb);
}

template <class T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const float* mean, const float* rstd, int N, int C, cudaStream_t stream,
                        bool accumulate, const T* dres) {
  if (N <= 0 || C <= 0) return;
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  if (dinp != nullptr) {
    layernorm_backward_dinp_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                                     stream>>>(dinp, dout, inp, weight, mean, rstd, N, C,
                                               accumulate, dres);
    CUDA_CHECK_LAUNCH();
  }
  if (dweight != nullptr || dbias != nullptr) {
    const dim3 tile(kWarpSize, kWarpSize);
    layernorm_backward_params_kernel<<<static_cast<unsigned>(ceil_div(C, kWarpSize)), tile, 0,
                                       stream>>>(dweight, dbias, dout, inp, mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  }
}

#define HR_INSTANTIATE(T)                                                                        \
  template void layernorm_forward<T>(T*, float*, float*, const T*, const T*, const T*, int, int, \
                                     cudaStream_t);                                              \
  template void residual_layernorm_forward<T>(T*, float*, float*, T*, const T*, const T*,        \
                                              const T*, int, int, cudaStream_t);                 \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const float*,    \
                                      const float*, int, int, cudaStream_t, bool, const T*);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
