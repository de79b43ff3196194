// SwiGLU (Llama's MLP), the CUDA side of kernels/cpu/swiglu.h: h = silu(gate) * up, gate and up
// side by side in one GEMM's output row. The CPU kernel's operations in its order: sigmoid from
// exp in double rounded to fp32, then single fp32 roundings (__fmul_rn and friends: no fused
// multiply-add the CPU, built with -ffp-contract=off, does not do), so f32 matches it up to the
// last bit of exp.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

// sigmoid(x) = 1 / (1 + exp(-x)), the exp in double (cpu::silu_sigmoid).
__device__ inline float silu_sigmoid(float x) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, static_cast<float>(exp(-static_cast<double>(x)))));
}

}  // namespace

// out (N,H) = silu(gu[:, :H]) * gu[:, H:], gu (N,2H): one thread per output element.
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* gu, size_t NH, int H) {
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < NH;
       idx += size_t(gridDim.x) * blockDim.x) {
    const size_t n = idx / H, j = idx % H;
    const T* row = gu + n * 2 * H;
    const float g = to_float(row[j]), u = to_float(row[H + j]);
    out[idx] = from_float<T>(__fmul_rn(__fmul_rn(g, silu_sigmoid(g)), u));
  }
}

template <class T>
void swiglu_forward(T* out, const T* gu, int N, int H, cudaStream_t stream) {
  const size_t n = static_cast<size_t>(N) * H;
  if (N <= 0 || H <= 0) return;
  const int block = 256;
  swiglu_forward_kernel<<<grid_for(n, block), block, 0, stream>>>(out, gu, n, H);
  CUDA_CHECK_LAUNCH();
}

// dgu (N,2H) += [dout * up * silu'(gate) | dout * gate * sigmoid(gate)],
// silu'(g) = s (1 + g (1 - s)), s = sigmoid(g); !accumulate: dgu = 0 + that. One thread per
// (n, j), writing both halves' element j.
template <class T>
__global__ void swiglu_backward_kernel(T* dgu, const T* gu, const T* dout, size_t NH, int H,
                                       bool accumulate) {
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < NH;
       idx += size_t(gridDim.x) * blockDim.x) {
    const size_t n = idx / H, j = idx % H;
    const T* row = gu + n * 2 * H;
    T* drow = dgu + n * 2 * H;
    const float g = to_float(row[j]), u = to_float(row[H + j]), dy = to_float(dout[idx]);
    const float s = silu_sigmoid(g);
    const float dgate = __fmul_rn(__fmul_rn(__fmul_rn(dy, u), s),
                                  __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
    const float dup = __fmul_rn(__fmul_rn(dy, g), s);
    const float old_g = accumulate ? to_float(drow[j]) : 0.0f;
    const float old_u = accumulate ? to_float(drow[H + j]) : 0.0f;
    drow[j] = from_float<T>(__fadd_rn(old_g, dgate));
    drow[H + j] = from_float<T>(__fadd_rn(old_u, dup));
  }
}

template <class T>
void swiglu_backward(T* dgu, const T* gu, const T* dout, int N, int H, cudaStream_t stream,
                     bool accumulate) {
  const size_t n = static_cast<size_t>(N) * H;
  if (N <= 0 || H <= 0) return;
  const int block = 256;
  swiglu_backward_kernel<<<grid_for(n, block), block, 0, stream>>>(dgu, gu, dout, n, H, accumulate);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                \
  template void swiglu_forward<T>(T*, const T*, int, int, cudaStream_t); \
  template void swiglu_backward<T>(T*, const T*, const T*, int, int, cudaStream_t, bool);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
