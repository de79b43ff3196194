// RMSNorm over the last dimension (Llama's norm), the CUDA side of kernels/cpu/rmsnorm.h: no mean
// subtracted, no bias, eps from [model] rms_norm_eps. The same operations as the CPU kernel in the
// same roundings where the order allows it: the row sums of squares accumulate in double, the
// element-wise products and differences are single fp32 roundings (__fmul_rn / __fsub_rn: no
// fused multiply-add the CPU, built with -ffp-contract=off, does not do). Only the order of the
// row sums (a warp's lanes, then the lanes added) and of dweight's column sums differs.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (N,C) = inp * rstd * weight (C), rstd (N) = 1 / sqrt(mean(inp^2) + eps) (may be null).
// One warp per row; block 256 threads = 8 rows.
template <class T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* weight, int N,
                                       int C, double eps) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const T* x = inp + static_cast<size_t>(n) * C;
  T* y = out + static_cast<size_t>(n) * C;
  double sq = 0.0;
  for (int i = lane; i < C; i += kWarpSize) {
    const double xi = to_float(x[i]);
    sq += xi * xi;  // exact: a float's square fits a double
  }
  sq = warp_sum(sq);
  const float s = static_cast<float>(1.0 / sqrt(sq / C + eps));
  for (int i = lane; i < C; i += kWarpSize) {
    y[i] = from_float<T>(__fmul_rn(__fmul_rn(to_float(x[i]), s), to_float(weight[i])));
  }
  if (lane == 0 && rstd != nullptr) rstd[n] = s;
}

template <class T>
void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int N, int C, double eps,
                     cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  rmsnorm_forward_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0, stream>>>(
      out, rstd, inp, weight, N, C, eps);
  CUDA_CHECK_LAUNCH();
}

// dinp (N,C) += rstd * (dnorm - norm * mean_i(dnorm * norm)), norm = inp * rstd, dnorm = dout *
// weight; !accumulate: dinp = (dres or 0) + that, its contents ignored. One warp per row.
template <class T>
__global__ void rmsnorm_backward_dinp_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                             const float* rstd, int N, int C, bool accumulate,
                                             const T* dres) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (n >= N) return;
  const size_t off = static_cast<size_t>(n) * C;
  const T* x = inp + off;
  const T* dy = dout + off;
  T* dx = dinp + off;
  const float s = rstd[n];
  double sum = 0.0;
  for (int i = lane; i < C; i += kWarpSize) {
    const float dnorm = __fmul_rn(to_float(weight[i]), to_float(dy[i]));
    const float norm = __fmul_rn(to_float(x[i]), s);
    sum += static_cast<double>(dnorm) * norm;
  }
  const float mean_dnorm_norm = static_cast<float>(warp_sum(sum) / C);
  for (int i = lane; i < C; i += kWarpSize) {
    const float dnorm = __fmul_rn(to_float(weight[i]), to_float(dy[i]));
    const float norm = __fmul_rn(to_float(x[i]), s);
    const float g = __fmul_rn(__fsub_rn(dnorm, __fmul_rn(norm, mean_dnorm_norm)), s);
    const float base = accumulate ? to_float(dx[i]) : dres ? to_float(dres[off + i]) : 0.0f;
    dx[i] = from_float<T>(__fadd_rn(base, g));
  }
}

// dweight (C) += sum_n dout * norm. A block is a tile of 32 columns (threadIdx.x) by 32 row lanes
// (threadIdx.y), as layernorm.cu's: lane y sums rows y, y+32, ... of its column, lane 0 adds the 32
// partial sums in lane order to the old value and stores once (deterministic, no atomics).
template <class T>
__global__ void rmsnorm_backward_dweight_kernel(T* dweight, const T* dout, const T* inp,
                                                const float* rstd, int N, int C) {
  __shared__ float partial[kWarpSize][kWarpSize + 1];  // [lane y][column x]
  const int i = blockIdx.x * kWarpSize + threadIdx.x;
  float dw = 0.0f;
  if (i < C) {
    for (int n = threadIdx.y; n < N; n += kWarpSize) {
      const size_t idx = static_cast<size_t>(n) * C + i;
      dw = __fadd_rn(dw, __fmul_rn(__fmul_rn(to_float(inp[idx]), rstd[n]), to_float(dout[idx])));
    }
  }
  partial[threadIdx.y][threadIdx.x] = dw;
  __syncthreads();
  if (threadIdx.y != 0 || i >= C) return;
  float acc = to_float(dweight[i]);
  for (int y = 0; y < kWarpSize; y++) {
    acc = __fadd_rn(acc, partial[y][threadIdx.x]);
  }
  dweight[i] = from_float<T>(acc);
}

template <class T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                      const float* rstd, int N, int C, cudaStream_t stream, bool accumulate,
                      const T* dres) {
  if (N <= 0 || C <= 0) return;
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  if (dinp != nullptr) {
    rmsnorm_backward_dinp_kernel<<<static_cast<unsigned>(ceil_div(N, rows_per_block)), block, 0,
                                   stream>>>(dinp, dout, inp, weight, rstd, N, C, accumulate, dres);
    CUDA_CHECK_LAUNCH();
  }
  if (dweight != nullptr) {
    const dim3 tile(kWarpSize, kWarpSize);
    rmsnorm_backward_dweight_kernel<<<static_cast<unsigned>(ceil_div(C, kWarpSize)), tile, 0,
                                      stream>>>(dweight, dout, inp, rstd, N, C);
    CUDA_CHECK_LAUNCH();
  }
}

#define HR_INSTANTIATE(T)                                                                         \
  template void rmsnorm_forward<T>(T*, float*, const T*, const T*, int, int, double,              \
                                   cudaStream_t);                                                 \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const float*, int, int, \
                                    cudaStream_t, bool, const T*);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
