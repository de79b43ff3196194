// RMSNorm over the last dimension (Zhang & Sennrich 2019; Llama's norm): no mean subtracted, no
// bias, eps from [model] rms_norm_eps.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// out (N,C) = inp * rstd * weight (C), rstd (N) = 1 / sqrt(mean(inp^2) + eps), saved for backward
// (null when no backward follows). The sum of squares accumulates in double.
template <class T>
HEADROOM_CPU_CLONES void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int N,
                                         int C, double eps) {
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int n = 0; n < N; n++) {
    const T* x = inp + static_cast<size_t>(n) * C;
    T* y = out + static_cast<size_t>(n) * C;
    double sq = 0.0;
    for (int i = 0; i < C; i++) {
      sq += static_cast<double>(x[i]) * x[i];
    }
    const T s = T(1.0 / std::sqrt(sq / C + eps));
    for (int i = 0; i < C; i++) {
      y[i] = x[i] * s * weight[i];
    }
    if (rstd != nullptr) rstd[n] = s;
  }
}

// With norm = inp * rstd and dnorm = dout * weight:
//   dweight (C) += sum_n dout * norm
//   dinp (N,C) += rstd * (dnorm - norm * mean_i(dnorm * norm))
// With !accumulate, dinp's contents are ignored: dinp = dres + that (dres (N,C) a residual
// path's gradient, may be null: 0 + that).
template <class T>
HEADROOM_CPU_CLONES void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp,
                                          const T* weight, const T* rstd, int N, int C,
                                          bool accumulate = true, const T* dres = nullptr) {
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int n = 0; n < N; n++) {
    const T* x = inp + static_cast<size_t>(n) * C;
    const T* dy = dout + static_cast<size_t>(n) * C;
    T* dx = dinp + static_cast<size_t>(n) * C;
    const T s = rstd[n];
    double sum_dnorm_norm = 0.0;
    for (int i = 0; i < C; i++) {
      sum_dnorm_norm += static_cast<double>(weight[i] * dy[i]) * (x[i] * s);
    }
    const T mean_dnorm_norm = T(sum_dnorm_norm / C);
    const T* dr = dres ? dres + static_cast<size_t>(n) * C : nullptr;
    for (int i = 0; i < C; i++) {
      const T g = (weight[i] * dy[i] - x[i] * s * mean_dnorm_norm) * s;
      if (accumulate) {
        dx[i] += g;
      } else {
        dx[i] = (dr ? dr[i] : T(0)) + g;
      }
    }
  }
  // The weight's gradient, a sum over the rows: split over columns, each summed in row order.
  // None for a frozen weight (null).
  if (dweight == nullptr) return;
  constexpr int kCols = 64;
  const int blocks = (C + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int blk = 0; blk < blocks; blk++) {
    const int i0 = blk * kCols, i1 = i0 + kCols < C ? i0 + kCols : C;
    for (int n = 0; n < N; n++) {
      const T* x = inp + static_cast<size_t>(n) * C;
      const T* dy = dout + static_cast<size_t>(n) * C;
      const T s = rstd[n];
      for (int i = i0; i < i1; i++) {
        dweight[i] += x[i] * s * dy[i];
      }
    }
  }
}

}  // namespace headroom::cpu
