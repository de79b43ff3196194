// LayerNorm over the last dimension, eps = 1e-5 and biased variance, like PyTorch.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// out (N,C) = (inp - mean) * rstd * weight (C) + bias (C); mean, rstd (N) are saved for backward
// (either may be null when no backward follows).
template <class T>
HEADROOM_CPU_CLONES void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                                           const T* bias, int N, int C) {
  const double eps = 1e-5;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int n = 0; n < N; n++) {
    const T* x = inp + static_cast<size_t>(n) * C;
    T* y = out + static_cast<size_t>(n) * C;
    // Two passes (mean, then squared deviations) with double accumulators: no cancellation from
    // E[x^2] - E[x]^2, and the row sums cost nothing next to the GEMMs around this layer.
    double sum = 0.0;
    for (int i = 0; i < C; i++) {
      sum += x[i];
    }
    const double m = sum / C;
    double sq = 0.0;
    for (int i = 0; i < C; i++) {
      const double d = x[i] - m;
      sq += d * d;
    }
    const double s = 1.0 / std::sqrt(sq / C + eps);
    const T mT = T(m);
    const T sT = T(s);
    for (int i = 0; i < C; i++) {
      y[i] = (x[i] - mT) * sT * weight[i] + bias[i];
    }
    if (mean != nullptr) mean[n] = mT;
    if (rstd != nullptr) rstd[n] = sT;
  }
}

// With norm = (inp - mean) * rstd and dnorm = dout * weight:
//   dbias (C) += sum_n dout,  dweight (C) += sum_n dout * norm
//   dinp (N,C) += rstd * (dnorm - mean_i(dnorm) - norm * mean_i(dnorm * norm))
// With !accumulate, dinp's contents are ignored: dinp = dres + that (dres (N,C) a residual
// path's gradient, the bits a copy of it and then += would give), or 0 + that when dres is null.
template <class T>
HEADROOM_CPU_CLONES void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout,
                                            const T* inp, const T* weight, const T* mean,
                                            const T* rstd, int N, int C, bool accumulate = true,
                                            const T* dres = nullptr) {
  // Rows in parallel for the input gradient; then the parameter gradients, sums over the rows,
  // split over columns so that each column is summed over its rows in order (parallel.h).
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int n = 0; n < N; n++) {
    const T* x = inp + static_cast<size_t>(n) * C;
    const T* dy = dout + static_cast<size_t>(n) * C;
    T* dx = dinp + static_cast<size_t>(n) * C;
    const T m = mean[n];
    const T s = rstd[n];
    // The two row reductions the input gradient needs.
    double sum_dnorm = 0.0;
    double sum_dnorm_norm = 0.0;
    for (int i = 0; i < C; i++) {
      const T norm = (x[i] - m) * s;
      const T dnorm = weight[i] * dy[i];
      sum_dnorm += dnorm;
      sum_dnorm_norm += static_cast<double>(dnorm) * norm;
    }
    const T mean_dnorm = T(sum_dnorm / C);
    const T mean_dnorm_norm = T(sum_dnorm_norm / C);
    // Then one contiguous, reduction-free pass.
    if (accumulate) {
      for (int i = 0; i < C; i++) {
        const T norm = (x[i] - m) * s;
        const T dnorm = weight[i] * dy[i];
        dx[i] += (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s;
      }
    } else {
      const T* dr = dres ? dres + static_cast<size_t>(n) * C : nullptr;
      for (int i = 0; i < C; i++) {
        const T norm = (x[i] - m) * s;
        const T dnorm = weight[i] * dy[i];
        dx[i] = (dr ? dr[i] : T(0)) + (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s;
      }
    }
  }
  // Frozen gains and biases (both null): the input gradient alone.
  if (dweight == nullptr && dbias == nullptr) return;
  constexpr int kCols = 64;  // a block of columns: contiguous, vectorizes over i
  const int blocks = (C + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int blk = 0; blk < blocks; blk++) {
    const int i0 = blk * kCols, i1 = i0 + kCols < C ? i0 + kCols : C;
    for (int n = 0; n < N; n++) {
      const T* x = inp + static_cast<size_t>(n) * C;
      const T* dy = dout + static_cast<size_t>(n) * C;
      const T m = mean[n];
      const T s = rstd[n];
      for (int i = i0; i < i1; i++) {
        const T norm = (x[i] - m) * s;
        if (dbias != nullptr) dbias[i] += dy[i];
        if (dweight != nullptr) dweight[i] += norm * dy[i];
      }
    }
  }
}

}  // namespace headroom::cpu
