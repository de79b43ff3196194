// Fully connected layer, weight stored (OC, C) as in PyTorch's nn.Linear / llm.c.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/common/dtype.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_lowp.h"

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

// ---------------------------------------------------------------------------------------------
// The same layers on 16-bit tensors (bf16, f16; uint16_t storage). Each GEMM goes to oneDNN's
// matmul in the 16-bit dtype with f32 accumulation where it has a fast implementation
// (gemm_lowp.h); otherwise that GEMM widens its operands to f32, runs gemm() and rounds its
// output, bitwise the CPU backend's widened path. The bias gradient is summed in f32 column by
// column, rows in order, as the f32 kernel sums it, and rounded once.

// gemm_lowp(), or the widened f32 GEMM where it returns false. C is contiguous by rows when
// ldc == N (the only use here); otherwise its rows are rounded one by one.
inline void gemm_lowp_or_widened(Lowp dt, bool trans_a, bool trans_b, int M, int N, int K,
                                 const uint16_t* A, int lda, const uint16_t* B, int ldb,
                                 const uint16_t* bias, bool accumulate, uint16_t* C, int ldc) {
  if (gemm_lowp(dt, trans_a, trans_b, M, N, K, A, lda, B, ldb, bias, accumulate, C, ldc)) return;
  auto widen = [dt](const uint16_t* x, size_t n) {
    std::unique_ptr<float[]> f(new float[n]);
    dt == Lowp::kBF16 ? widen_bf16(x, f.get(), n) : widen_f16(x, f.get(), n);
    return f;
  };
  const size_t na = size_t((trans_a ? K : M) - 1) * lda + (trans_a ? M : K);
  const size_t nb = size_t((trans_b ? N : K) - 1) * ldb + (trans_b ? K : N);
  const size_t nc = size_t(M - 1) * ldc + N;
  const std::unique_ptr<float[]> a = widen(A, na), b = widen(B, nb);
  std::unique_ptr<float[]> c =
      accumulate ? widen(C, nc) : std::unique_ptr<float[]>(new float[nc]());
  float beta = accumulate ? 1.0f : 0.0f;
  if (bias) {
    const std::unique_ptr<float[]> fb = widen(bias, size_t(N));
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(M) * N))
    for (int m = 0; m < M; m++)
      for (int n = 0; n < N; n++) {
        float& x = c[size_t(m) * ldc + n];
        x = accumulate ? x + fb[n] : fb[n];
      }
    beta = 1.0f;
  }
  gemm(trans_a, trans_b, M, N, K, 1.0f, a.get(), lda, b.get(), ldb, beta, c.get(), ldc);
  auto round = [dt](const float* f, uint16_t* h, size_t n) {
    dt == Lowp::kBF16 ? round_bf16(f, h, n) : round_f16(f, h, n);
  };
  if (ldc == N) {
    round(c.get(), C, nc);
  } else {
    for (int m = 0; m < M; m++)
      round(c.get() + size_t(m) * ldc, C + size_t(m) * ldc, size_t(N));
  }
}

// out (N,OC) = inp (N,C) · weight (OC,C)^T + bias (OC), 16-bit; bias may be null.
inline void matmul_forward_lowp(Lowp dt, uint16_t* out, const uint16_t* inp, const uint16_t* weight,
                                const uint16_t* bias, int N, int C, int OC) {
  gemm_lowp_or_widened(dt, false, true, N, OC, C, inp, C, weight, C, bias, false, out, OC);
}

// dbias (OC) += dout (N,OC) summed over its rows, 16-bit: each column summed in f32 in row order
// from the widened dbias and rounded once (the widened path's bits), by blocks of columns over the
// threads; compiled for AVX-512, AVX2 and the baseline.
HEADROOM_CPU_CLONES inline void bias_grad_lowp(Lowp dt, uint16_t* dbias, const uint16_t* dout,
                                               int N, int OC) {
  const bool bf = dt == Lowp::kBF16;
  constexpr int kCols = 64;
  const int blocks = (OC + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * OC))
  for (int blk = 0; blk < blocks; blk++) {
    const int o0 = blk * kCols, o1 = o0 + kCols < OC ? o0 + kCols : OC;
    float acc[kCols];
    for (int o = o0; o < o1; o++)
      acc[o - o0] = bf ? bf16_to_float(dbias[o]) : f16_to_float(dbias[o]);
    if (bf) {
      for (int n = 0; n < N; n++) {
        const uint16_t* dout_n = dout + static_cast<size_t>(n) * OC;
        for (int o = o0; o < o1; o++)
          acc[o - o0] += bits_float(uint32_t(dout_n[o]) << 16);
      }
    } else {
      for (int n = 0; n < N; n++) {
        const uint16_t* dout_n = dout + static_cast<size_t>(n) * OC;
        for (int o = o0; o < o1; o++)
          acc[o - o0] += f16_to_float(dout_n[o]);
      }
    }
    for (int o = o0; o < o1; o++)
      dbias[o] = bf ? float_to_bf16(acc[o - o0]) : float_to_f16(acc[o - o0]);
  }
}

// matmul_backward on 16-bit tensors: dinp written or accumulated, dweight and dbias accumulated.
inline void matmul_backward_lowp(Lowp dt, uint16_t* dinp, uint16_t* dweight, uint16_t* dbias,
                                 const uint16_t* dout, const uint16_t* inp, const uint16_t* weight,
                                 int N, int C, int OC, bool accumulate_dinp = true) {
  if (dinp != nullptr)
    gemm_lowp_or_widened(dt, false, false, N, C, OC, dout, OC, weight, C, nullptr, accumulate_dinp,
                         dinp, C);
  if (dweight != nullptr)
    gemm_lowp_or_widened(dt, true, false, OC, C, N, dout, OC, inp, C, nullptr, true, dweight, C);
  if (dbias != nullptr) bias_grad_lowp(dt, dbias, dout, N, OC);
}

}  // namespace headroom::cpu
