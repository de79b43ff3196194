// GELU (GPT-2 tanh approximation); the per-element math lives in kernels/common/elementwise.h so
// the CUDA backend computes the same function.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cstddef>
#include <vector>

#include "kernels/common/elementwise.h"
#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// out (N) = gelu(inp (N))
template <class T>
HEADROOM_CPU_CLONES void gelu_forward(T* out, const T* inp, size_t N) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
  for (size_t i = 0; i < N; i++) {
    out[i] = gelu_tanh(inp[i]);
  }
}

// dinp (N) += gelu'(inp) * dout; with !accumulate, dinp = 0 + gelu'(inp) * dout (its contents
// ignored: the bits a zero fill and then += would give).
template <class T>
HEADROOM_CPU_CLONES void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N,
                                       bool accumulate = true) {
  if (accumulate) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
    for (size_t i = 0; i < N; i++) {
      dinp[i] += gelu_tanh_grad(inp[i]) * dout[i];
    }
  } else {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
    for (size_t i = 0; i < N; i++) {
      dinp[i] = T(0) + gelu_tanh_grad(inp[i]) * dout[i];
    }
  }
}

// The column blocks of gelu_backward_bias: a multiple of `threads` blocks (so that none waits on
// another's extra block), each as wide as it can be up to 1024 columns, a multiple of 16. Narrow
// blocks cost more than the pass they save: each row's stretch becomes a short loop (at 64
// columns the fused kernel took twice the two ops' time; at 1024 a little less than they).
inline int gelu_bias_block(int OC, int threads) {
  const int per = threads * ((OC + threads * 1024 - 1) / (threads * 1024));
  return ((OC + per - 1) / per + 15) / 16 * 16;
}

// dinp (N,OC) = 0 + gelu'(inp) * dout (gelu_backward's written gradient) and dbias (OC) += its
// column sums, each column over the rows in order: matmul_backward's bias gradient of the layer
// whose output inp is, taken while dinp is in registers instead of in a second pass over it. By
// blocks of columns over the threads, each thread all the rows of its columns (the sums in a
// thread's buffer, in L1). dbias may be null.
template <class T>
HEADROOM_CPU_CLONES void gelu_backward_bias(T* dinp, T* dbias, const T* inp, const T* dout, int N,
                                            int OC) {
  if (dbias == nullptr) return gelu_backward(dinp, inp, dout, size_t(N) * OC, false);
  const int nt = threads_for(size_t(N) * OC);
  const int W = gelu_bias_block(OC, nt), blocks = (OC + W - 1) / W;
#pragma omp parallel num_threads(nt)
  {
    std::vector<T> sums(static_cast<size_t>(W));
    T* acc = sums.data();
#pragma omp for schedule(static)
    for (int blk = 0; blk < blocks; blk++) {
      const int o0 = blk * W, w = OC - o0 < W ? OC - o0 : W;
      for (int o = 0; o < w; o++)
        acc[o] = dbias[o0 + o];
      for (int n = 0; n < N; n++) {
        const size_t off = static_cast<size_t>(n) * OC + o0;
        const T* __restrict x = inp + off;
        const T* __restrict dy = dout + off;
        T* __restrict dx = dinp + off;
        for (int o = 0; o < w; o++) {
          const T d = T(0) + gelu_tanh_grad(x[o]) * dy[o];
          dx[o] = d;
          acc[o] += d;
        }
      }
      for (int o = 0; o < w; o++)
        dbias[o0 + o] = acc[o];
    }
  }
}

}  // namespace headroom::cpu
