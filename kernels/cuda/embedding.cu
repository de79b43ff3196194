// Token + position embedding, forward and backward.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

// One thread per output element of out (B,T,C).
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte,
                                         const float* wpe, size_t BT, int T, int C) {
  const size_t total = BT * C;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const size_t bt = idx / C;
    const int i = static_cast<int>(idx % C);
    const int t = static_cast<int>(bt % T);
    out[idx] = wte[static_cast<size_t>(tokens[bt]) * C + i] + wpe[static_cast<size_t>(t) * C + i];
  }
}

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, cudaStream_t stream) {
  const size_t BT = static_cast<size_t>(B) * T;
  const int block = 256;
  embedding_forward_kernel<<<grid_for(BT * C, block), block, 0, stream>>>(out, tokens, wte, wpe, BT,
                                                                          T, C);
  CUDA_CHECK_LAUNCH();
}

// dwte: one thread per column i walks all (b,t) in order and adds dout into its token's row.
// Rows of repeated tokens are touched by the same thread only, so no atomics and the sum order is
// the CPU's (bitwise identical). Parallel over C only: simple and deterministic, not fast.
__global__ void embedding_backward_wte_kernel(float* dwte, const float* dout, const int32_t* tokens,
                                              size_t BT, int C) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= C) return;
  for (size_t bt = 0; bt < BT; bt++) {
    dwte[static_cast<size_t>(tokens[bt]) * C + i] += dout[bt * C + i];
  }
}

// dwpe: one thread per (t, i), summing over the batch in order.
__global__ void embedding_backward_wpe_kernel(float* dwpe, const float* dout, int B, int T, int C) {
  const size_t total = static_cast<size_t>(T) * C;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    float acc = dwpe[idx];
    for (int b = 0; b < B; b++) {
      acc += dout[static_cast<size_t>(b) * total + idx];
    }
    dwpe[idx] = acc;
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C, cudaStream_t stream) {
  const int block = 256;
  if (dwte != nullptr) {
    const size_t BT = static_cast<size_t>(B) * T;
    embedding_backward_wte_kernel<<<static_cast<unsigned>(ceil_div(C, block)), block, 0, stream>>>(
        dwte, dout, tokens, BT, C);
    CUDA_CHECK_LAUNCH();
  }
  if (dwpe != nullptr) {
    embedding_backward_wpe_kernel<<<grid_for(static_cast<size_t>(T) * C, block), block, 0,
                                    stream>>>(dwpe, dout, B, T, C);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace headroom::cuda
