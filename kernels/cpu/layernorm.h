// LayerNorm over the last dimension, eps = 1e-5 and biased variance, like PyTorch.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs, unless a
// flag says the input gradient is written.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdlib>

#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

namespace detail {

// LayerNorm's row sums are added in double, serially, element by element, so that they are the
// same bits on every ISA and thread count. One row at a time, each addition waits for the one
// before (a chain of 4-cycle latencies: C = 1024 takes ~8k cycles a pass, more than the row's
// memory traffic). kLnRows rows at a time: each row's sum is still its own serial chain in its
// own order (the same bits), but kLnRows independent chains keep the adders busy. 4 rather than
// 8: the backward's 8 rows (16 sums, 16 row pointers) spill registers and ran slower than 1 row
// (bench_cpu_fused_kernels; forward 1.7x, backward 1.3x at 4 on the AMX Xeon, one thread).
constexpr int kLnRows = 4;

// HEADROOM_CPU_FUSE=0 in the environment: LayerNorm a row at a time (and the CPU backend's fused
// ops as the pairs of ops they replace): a benchmark's "before" in the same binary, the same bits.
inline bool fuse_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("HEADROOM_CPU_FUSE");
    return !(e && e[0] == '0' && e[1] == 0);
  }();
  return on;
}

// mean and rstd (double) of the R rows x[r] (C): two passes, as layernorm_forward's.
template <int R, class T>
inline void layernorm_stats(const T* const* x, int C, double* mean, double* rstd) {
  const double eps = 1e-5;
  double sum[R] = {}, sq[R] = {};
  for (int i = 0; i < C; i++)
    for (int r = 0; r < R; r++)
      sum[r] += x[r][i];
  for (int r = 0; r < R; r++)
    mean[r] = sum[r] / C;
  for (int i = 0; i < C; i++)
    for (int r = 0; r < R; r++) {
      const double d = x[r][i] - mean[r];
      sq[r] += d * d;
    }
  for (int r = 0; r < R; r++)
    rstd[r] = 1.0 / std::sqrt(sq[r] / C + eps);
}

// The two row reductions of layernorm_backward's input gradient for the R rows x[r], dy[r]
// (C) with statistics m[r], s[r]: sum_i dnorm and sum_i dnorm * norm, each row serial in double.
template <int R, class T>
inline void layernorm_dsums(const T* const* x, const T* const* dy, const T* weight, const T* m,
                            const T* s, int C, double* sum_dnorm, double* sum_dnorm_norm) {
  for (int r = 0; r < R; r++)
    sum_dnorm[r] = sum_dnorm_norm[r] = 0.0;
  for (int i = 0; i < C; i++)
    for (int r = 0; r < R; r++) {
      const T norm = (x[r][i] - m[r]) * s[r];
      const T dnorm = weight[i] * dy[r][i];
      sum_dnorm[r] += dnorm;
      sum_dnorm_norm[r] += static_cast<double>(dnorm) * norm;
    }
}

// Rows n0 .. n0 + R - 1 of a (N, C) tensor at p; past row N - 1 the last row again (a
// group's tail computes it more than once and writes it once).
template <int R, class T>
inline void group_rows(T* p, int n0, int N, int C, T** rows) {
  for (int r = 0; r < R; r++)
    rows[r] = p + static_cast<size_t>(n0 + r < N ? n0 + r : N - 1) * C;
}

// out (N,C) = LayerNorm(inp) * weight + bias, and mean, rstd (either may be null); with `res`
// non-null, inp is first res (N,C) += add (N,C), row by row as add_inplace adds it.
template <int R, class T>
HEADROOM_CPU_CLONES void layernorm_forward_rows(T* out, T* mean, T* rstd, T* res, const T* add,
                                                const T* inp, const T* weight, const T* bias, int N,
                                                int C) {
  const int groups = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int g = 0; g < groups; g++) {
    const int n0 = g * R, rows = N - n0 < R ? N - n0 : R;
    const T* x[R];
    if (res != nullptr) {
      T* xr[R];
      group_rows<R>(res, n0, N, C, xr);
      for (int r = 0; r < rows; r++) {
        const T* a = add + static_cast<size_t>(n0 + r) * C;
        for (int i = 0; i < C; i++)
          xr[r][i] += a[i];
      }
      for (int r = 0; r < R; r++)
        x[r] = xr[r];
    } else {
      group_rows<R>(inp, n0, N, C, x);
    }
    double m[R], s[R];
    layernorm_stats<R>(x, C, m, s);
    for (int r = 0; r < rows; r++) {
      T* y = out + static_cast<size_t>(n0 + r) * C;
      const T mT = T(m[r]);
      const T sT = T(s[r]);
      for (int i = 0; i < C; i++) {
        y[i] = (x[r][i] - mT) * sT * weight[i] + bias[i];
      }
      if (mean != nullptr) mean[n0 + r] = mT;
      if (rstd != nullptr) rstd[n0 + r] = sT;
    }
  }
}

}  // namespace detail

// out (N,C) = (inp - mean) * rstd * weight (C) + bias (C); mean, rstd (N) are saved for backward
// (either may be null when no backward follows). Two passes (mean, then squared deviations) with
// double accumulators: no cancellation from E[x^2] - E[x]^2; rows by groups (detail::kLnRows).
template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                       int N, int C) {
  if (!detail::fuse_enabled())
    return detail::layernorm_forward_rows<1, T>(out, mean, rstd, nullptr, nullptr, inp, weight,
                                                bias, N, C);
  detail::layernorm_forward_rows<detail::kLnRows, T>(out, mean, rstd, nullptr, nullptr, inp, weight,
                                                     bias, N, C);
}

// res (N,C) += x (N,C), then out (N,C) = LayerNorm(res) as layernorm_forward: a residual add
// and the LayerNorm that reads its sum, in one pass over res (bitwise add_inplace then
// layernorm_forward).
template <class T>
void residual_layernorm_forward(T* out, T* mean, T* rstd, T* res, const T* x, const T* weight,
                                const T* bias, int N, int C) {
  if (!detail::fuse_enabled())
    return detail::layernorm_forward_rows<1, T>(out, mean, rstd, res, x, res, weight, bias, N, C);
  detail::layernorm_forward_rows<detail::kLnRows, T>(out, mean, rstd, res, x, res, weight, bias, N,
                                                     C);
}

// With norm = (inp - mean) * rstd and dnorm = dout * weight:
//   dbias (C) += sum_n dout,  dweight (C) += sum_n dout * norm
//   dinp (N,C) += rstd * (dnorm - mean_i(dnorm) - norm * mean_i(dnorm * norm))
// With !accumulate, dinp's contents are ignored: dinp = dres + that (dres (N,C) a residual
// path's gradient, the bits a copy of it and then += would give), or 0 + that when dres is null.
template <int R, class T>
HEADROOM_CPU_CLONES void layernorm_backward_rows(T* dinp, T* dweight, T* dbias, const T* dout,
                                                 const T* inp, const T* weight, const T* mean,
                                                 const T* rstd, int N, int C, bool accumulate,
                                                 const T* dres) {
  // Rows in parallel (by groups of R) for the input gradient; then the parameter gradients, sums
  // over the rows, split over columns so that each column is summed over its rows in order
  // (parallel.h).
  const int groups = (N + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * C))
  for (int g = 0; g < groups; g++) {
    const int n0 = g * R;
    const int rows = N - n0 < R ? N - n0 : R;
    const T *xs[R], *dys[R];
    T ms[R], ss[R];
    detail::group_rows<R>(inp, n0, N, C, xs);
    detail::group_rows<R>(dout, n0, N, C, dys);
    for (int r = 0; r < R; r++) {
      const int n = n0 + r < N ? n0 + r : N - 1;
      ms[r] = mean[n], ss[r] = rstd[n];
    }
    // The two row reductions the input gradient needs, for the group's rows at once.
    double sum_dnorm[R], sum_dnorm_norm[R];
    detail::layernorm_dsums<R>(xs, dys, weight, ms, ss, C, sum_dnorm, sum_dnorm_norm);
    for (int r = 0; r < rows; r++) {
      const int n = n0 + r;
      const T* x = xs[r];
      const T* dy = dys[r];
      T* dx = dinp + static_cast<size_t>(n) * C;
      const T m = ms[r];
      const T s = ss[r];
      const T mean_dnorm = T(sum_dnorm[r] / C);
      const T mean_dnorm_norm = T(sum_dnorm_norm[r] / C);
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

// layernorm_backward_rows by groups of detail::kLnRows rows (one at a time: HEADROOM_CPU_FUSE=0).
template <class T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int N, int C, bool accumulate = true,
                        const T* dres = nullptr) {
  if (!detail::fuse_enabled())
    return layernorm_backward_rows<1>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C,
                                      accumulate, dres);
  layernorm_backward_rows<detail::kLnRows>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N,
                                           C, accumulate, dres);
}

}  // namespace headroom::cpu
