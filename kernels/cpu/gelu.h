// GELU (GPT-2 tanh approximation); the per-element math lives in kernels/common/elementwise.h so
// the CUDA backend computes the same function.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cstddef>

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

}  // namespace headroom::cpu
