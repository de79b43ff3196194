// Rotary position embeddings in place on qkv's q and k heads, the CUDA side of kernels/cpu/rope.h:
// Hugging Face's rotate_half layout, pair i of a head being its elements i and i + hs/2, rotated
// by angle sign · t · inv_freq(i). The inverse frequencies (Llama 3's rope scaling included) are
// kernels/common/rope.h's rope_inv_freq, computed on the host by the function the CPU backend
// calls and passed to the kernel by value, so both backends rotate by the same angles; the angle's
// cos and sin are taken in double and rounded to fp32, as on the CPU, and the rotation is single
// fp32 roundings (__fmul_rn, __fsub_rn: no fused multiply-add the CPU does not do).
#include <stdexcept>
#include <string>

#include "kernels/common/rope.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

constexpr int kMaxRopePairs = 256;  // hs <= 512: 2 KiB of kernel parameters

struct RopeFreqs {
  double inv_freq[kMaxRopePairs];
};

}  // namespace

// x (B,T,W), W = (NH + 2·NKV)·hs, laid out [q (NH heads) | k (NKV) | v (NKV)]: one thread per
// (b, t, i), i < hs/2, rotating pair i of row (b, t)'s NH + NKV q and k heads; v untouched.
// sign +1 forward, -1 backward (dqkv, the same layout).
template <class T>
__global__ void rope_rotate_kernel(T* x, size_t pairs, int Tn, int NH, int NKV, int hs, RopeFreqs f,
                                   int sign) {
  const int half = hs / 2;
  const size_t W = static_cast<size_t>(NH + 2 * NKV) * hs;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < pairs;
       idx += size_t(gridDim.x) * blockDim.x) {
    const size_t bt = idx / half;
    const int i = static_cast<int>(idx % half);
    const int t = static_cast<int>(bt % Tn);
    const double a = sign * static_cast<double>(t) * f.inv_freq[i];
    const float c = static_cast<float>(cos(a)), s = static_cast<float>(sin(a));
    T* row = x + bt * W;
    for (int h = 0; h < NH + NKV; h++) {
      T* e = row + static_cast<size_t>(h) * hs;
      const float x1 = to_float(e[i]), x2 = to_float(e[i + half]);
      e[i] = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      e[i + half] = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
  }
}

namespace {

template <class T>
void rope_rotate(const char* op, T* x, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p,
                 int sign, cudaStream_t stream) {
  if (hs <= 0 || hs % 2 != 0 || hs / 2 > kMaxRopePairs)
    throw std::invalid_argument(std::string(op) + ": head size " + std::to_string(hs) +
                                " must be even and at most " + std::to_string(2 * kMaxRopePairs));
  if (NH <= 0 || NKV <= 0)
    throw std::invalid_argument(std::string(op) + ": NH and NKV must be positive");
  if (B <= 0 || Tn <= 0) return;
  RopeFreqs f{};
  for (int i = 0; i < hs / 2; i++) {
    f.inv_freq[i] = rope_inv_freq(i, hs, p);
  }
  const size_t pairs = static_cast<size_t>(B) * Tn * (hs / 2);
  const int block = 256;
  rope_rotate_kernel<<<grid_for(pairs, block), block, 0, stream>>>(x, pairs, Tn, NH, NKV, hs, f,
                                                                   sign);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

template <class T>
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p,
                  cudaStream_t stream) {
  rope_rotate("rope_forward", qkv, B, Tn, NH, NKV, hs, p, +1, stream);
}

template <class T>
void rope_backward(T* dqkv, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p,
                   cudaStream_t stream) {
  rope_rotate("rope_backward", dqkv, B, Tn, NH, NKV, hs, p, -1, stream);
}

#define HR_INSTANTIATE(T)                                                                      \
  template void rope_forward<T>(T*, int, int, int, int, int, const RopeParams&, cudaStream_t); \
  template void rope_backward<T>(T*, int, int, int, int, int, const RopeParams&, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
