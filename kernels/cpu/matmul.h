// Fully connected layer, weight stored (OC, C) as in PyTorch's nn.Linear / llm.c.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cstddef>

#include "kernels/cpu/gemm.h"

namespace headroom::cpu {

// out (N,OC) = inp (N,C) · weight (OC,C)^T + bias (OC). bias may be null.
template <class T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, int N, int C, int OC) {
  T beta = T(0);
  if (bias != nullptr) {
    // Broadcast the bias into out first and let the GEMM accumulate onto it: no second pass.
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * OC))
    for (int n = 0; n < N; n++) {
      T* out_n = out + static_cast<size_t>(n) * OC;
      for (int o = 0; o < OC; o++) {
        out_n[o] = bias[o];
      }
    }
    beta = T(1);
  }
  gemm(false, true, N, OC, C, T(1), inp, C, weight, C, beta, out, OC);
}

// dinp (N,C) += dout (N,OC) · weight (OC,C)   (= when !accumulate_dinp: its contents ignored)
// dweight (OC,C) += dout^T (OC,N) · inp (N,C)
// dbias (OC) += sum over rows of dout
// dinp and dbias may be null (first layer's input needs no gradient; layer without bias).
template <class T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                     int N, int C, int OC, bool accumulate_dinp = true) {
  if (dinp != nullptr)
    gemm(false, false, N, C, OC, T(1), dout, OC, weight, C, T(accumulate_dinp ? 1 : 0), dinp, C);
  if (dweight != nullptr) gemm(true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dweight, C);
  if (dbias != nullptr) {
    // Row by row within a block of columns so the inner loop is contiguous (vectorizes); the
    // blocks split over the threads, each column summed over the rows in order (parallel.h).
    constexpr int kCols = 64;
    const int blocks = (OC + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * OC))
    for (int blk = 0; blk < blocks; blk++) {
      const int o0 = blk * kCols, o1 = o0 + kCols < OC ? o0 + kCols : OC;
      for (int n = 0; n < N; n++) {
        const T* dout_n = dout + static_cast<size_t>(n) * OC;
        for (int o = o0; o < o1; o++) {
          dbias[o] += dout_n[o];
        }
      }
    }
  }
}

}  // namespace headroom::cpu
