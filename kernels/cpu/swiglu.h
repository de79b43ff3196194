// SwiGLU (Shazeer 2020; Llama's MLP): h = silu(gate) * up, with gate and up side by side in one
// GEMM's output row, so the MLP's two input projections are one GEMM.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// silu(x) = x * sigmoid(x), and its derivative sigmoid(x) (1 + x (1 - sigmoid(x))).
template <class T>
inline T silu_sigmoid(T x) {
  return T(1) / (T(1) + T(std::exp(-static_cast<double>(x))));
}

// out (N,H) = silu(gu[:, :H]) * gu[:, H:], gu (N,2H) = [gate | up] a row.
template <class T>
HEADROOM_CPU_CLONES void swiglu_forward(T* out, const T* gu, int N, int H) {
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * H))
  for (int n = 0; n < N; n++) {
    const T* g = gu + static_cast<size_t>(n) * 2 * H;
    const T* u = g + H;
    T* y = out + static_cast<size_t>(n) * H;
    for (int j = 0; j < H; j++) {
      y[j] = g[j] * silu_sigmoid(g[j]) * u[j];
    }
  }
}

// dgu (N,2H) += [dout * up * silu'(gate) | dout * silu(gate)]; with !accumulate, dgu = 0 + that
// (its contents ignored).
template <class T>
HEADROOM_CPU_CLONES void swiglu_backward(T* dgu, const T* gu, const T* dout, int N, int H,
                                         bool accumulate = true) {
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * H))
  for (int n = 0; n < N; n++) {
    const T* g = gu + static_cast<size_t>(n) * 2 * H;
    const T* u = g + H;
    const T* dy = dout + static_cast<size_t>(n) * H;
    T* dg = dgu + static_cast<size_t>(n) * 2 * H;
    T* du = dg + H;
    for (int j = 0; j < H; j++) {
      const T s = silu_sigmoid(g[j]);
      const T dgate = dy[j] * u[j] * s * (T(1) + g[j] * (T(1) - s));
      const T dup = dy[j] * g[j] * s;
      if (accumulate) {
        dg[j] += dgate;
        du[j] += dup;
      } else {
        dg[j] = T(0) + dgate;
        du[j] = T(0) + dup;
      }
    }
  }
}

}  // namespace headroom::cpu
