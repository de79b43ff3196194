// Token + position embedding, forward and backward.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// out (B,T,C) = wte[tokens[b,t]] + wpe[t]: one thread per output element. wpe null (Llama: no
// position table): out = wte[tokens[b,t]], a copy (as the CPU kernel, no + 0 that would turn -0
// into +0).
template <class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe,
                                         size_t BT, int Tn, int C) {
  const size_t total = BT * C;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const size_t bt = idx / C;
    const int i = static_cast<int>(idx % C);
    const int t = static_cast<int>(bt % Tn);
    const T w = wte[static_cast<size_t>(tokens[bt]) * C + i];
    out[idx] = wpe == nullptr
                   ? w
                   : from_float<T>(to_float(w) + to_float(wpe[static_cast<size_t>(t) * C + i]));
  }
}

template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn,
                       int C, cudaStream_t stream) {
  const size_t BT = static_cast<size_t>(B) * Tn;
  if (BT == 0 || C == 0) return;
  const int block = 256;
  embedding_forward_kernel<<<grid_for(BT * C, block), block, 0, stream>>>(out, tokens, wte, wpe, BT,
                                                                          Tn, C);
  CUDA_CHECK_LAUNCH();
}

// dwte (V,C) += dout (B*T,C) rows scattered by token. Grid (BT, ceil(C / blockDim)): block (bt, y)
// covers columns y*blockDim.. of position bt. The block of a token's first position in the batch
// (its "leader") sums dout over every position holding that token, in (b,t) order, in fp32 from
// the row's old value, and stores once; the blocks of later positions exit. So there are no
// atomics, each element is rounded once, and for float the additions are the CPU kernel's, in its
// order (bitwise equal). Finding the leader costs O(bt) token reads per block, the sums
// O(BT) per leader: fine for GPT-2 batches (B*T of a few thousand), quadratic beyond.
template <class T>
__global__ void embedding_backward_wte_kernel(T* dwte, const T* dout, const int32_t* tokens, int BT,
                                              int C) {
  const int bt = blockIdx.x;
  const int32_t token = tokens[bt];
  int seen = 0;
  for (int j = threadIdx.x; j < bt; j += blockDim.x) {
    seen |= tokens[j] == token;
  }
  if (__syncthreads_or(seen)) return;  // not the leader: every thread of the block leaves
  const int i = blockIdx.y * blockDim.x + threadIdx.x;
  if (i >= C) return;
  T* row = dwte + static_cast<size_t>(token) * C;
  float acc = to_float(row[i]);
  for (int j = bt; j < BT; j++) {
    if (tokens[j] == token) acc += to_float(dout[static_cast<size_t>(j) * C + i]);
  }
  row[i] = from_float<T>(acc);
}

// dwpe (T,C) += dout summed over the batch: one thread per (t, i), b in order from the old value.
template <class T>
__global__ void embedding_backward_wpe_kernel(T* dwpe, const T* dout, int B, int Tn, int C) {
  const size_t total = static_cast<size_t>(Tn) * C;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    float acc = to_float(dwpe[idx]);
    for (int b = 0; b < B; b++) {
      acc += to_float(dout[static_cast<size_t>(b) * total + idx]);
    }
    dwpe[idx] = from_float<T>(acc);
  }
}

template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn,
                        int C, cudaStream_t stream) {
  const size_t BT = static_cast<size_t>(B) * Tn;
  if (BT == 0 || C == 0) return;
  if (BT > 0x7FFFFFFFu) throw std::invalid_argument("embedding_backward: B*T exceeds 2^31 - 1");
  if (dwte != nullptr) {
    // Threads per block: the columns, rounded up to whole warps, at most 256.
    const int block = C >= 256 ? 256 : static_cast<int>(ceil_div(C, kWarpSize)) * kWarpSize;
    const dim3 grid(static_cast<unsigned>(BT), static_cast<unsigned>(ceil_div(C, block)));
    embedding_backward_wte_kernel<<<grid, block, 0, stream>>>(dwte, dout, tokens,
                                                              static_cast<int>(BT), C);
    CUDA_CHECK_LAUNCH();
  }
  if (dwpe != nullptr) {
    const int block = 256;
    embedding_backward_wpe_kernel<<<grid_for(static_cast<size_t>(Tn) * C, block), block, 0,
                                    stream>>>(dwpe, dout, B, Tn, C);
    CUDA_CHECK_LAUNCH();
  }
}

#define HR_INSTANTIATE(T)                                                                   \
  template void embedding_forward<T>(T*, const int32_t*, const T*, const T*, int, int, int, \
                                     cudaStream_t);                                         \
  template void embedding_backward<T>(T*, T*, const T*, const int32_t*, int, int, int,      \
                                      cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
