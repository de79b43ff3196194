// Element-wise and row-wise kernels on bf16 storage (issue 36, item 2): each reads its bf16
// tensors, widens in registers (or a row at a time into a thread's small float buffer), computes
// exactly the f32 kernel's arithmetic in float, and rounds to nearest even as it writes. One
// parallel region an op, where the widened path (core/device/backend_cpu.cpp's Widened) runs one
// to widen each input, one to zero each output, the f32 kernel's, and one to round each output
// back, through (B, T, C)-sized float copies in memory.
//
// Bitwise the widened path: the same float operations on the same values in the same order (the
// row sums in double stay serial, in their order), and the same rounding (convert.h's, branch-free
// so that the loops vectorize). The conversions are the integer ones, not AVX-512 BF16's
// VCVTNEPS2BF16: that instruction flushes denormal inputs and outputs to zero, so it would round
// differently from kernels/common/dtype.h (and the CUDA kernels) on tiny values; on these loops,
// bound by memory, the integer rounding costs the same few instructions per 16 lanes.
// Compiled for AVX-512, AVX2 and the baseline (HEADROOM_CPU_CLONES), the same bits on each.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "kernels/common/dtype.h"
#include "kernels/common/elementwise.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/reduce.h"

namespace headroom::cpu {

namespace bf16 {

// bf16 -> float, exact.
inline float widen(uint16_t h) {
  return bits_float(uint32_t(h) << 16);
}

// float -> bf16 to nearest even, NaN a quiet NaN: float_to_bf16 without its branch (convert.h).
inline uint16_t round(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x0040u;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

inline void widen_row(const uint16_t* in, float* out, int n) {
  for (int i = 0; i < n; i++)
    out[i] = widen(in[i]);
}

// rows x width elements, row strides in_stride and out_stride, widened (or rounded).
inline void widen_cols(const uint16_t* in, float* out, int rows, int width, int in_stride,
                       int out_stride) {
  for (int r = 0; r < rows; r++)
    widen_row(in + static_cast<size_t>(r) * in_stride, out + static_cast<size_t>(r) * out_stride,
              width);
}
inline void round_cols(const float* in, uint16_t* out, int rows, int width, int in_stride,
                       int out_stride) {
  for (int r = 0; r < rows; r++) {
    const float* x = in + static_cast<size_t>(r) * in_stride;
    uint16_t* y = out + static_cast<size_t>(r) * out_stride;
    for (int i = 0; i < width; i++)
      y[i] = round(x[i]);
  }
}

// A float buffer of at least n elements, kept by the calling thread between calls (the OpenMP
// pool's threads live on): its pages are not faulted in again every op.
inline float* thread_buffer(int which, size_t n) {
  static thread_local std::vector<float> bufs[4];
  std::vector<float>& b = bufs[which];
  if (b.size() < n) b.resize(n);
  return b.data();
}

}  // namespace bf16

// out (N) = gelu(inp (N)); out may be inp.
HEADROOM_CPU_CLONES inline void gelu_forward_bf16(uint16_t* out, const uint16_t* inp, size_t N) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
  for (size_t i = 0; i < N; i++)
    out[i] = bf16::round(gelu_tanh(bf16::widen(inp[i])));
}

// dinp (N) += gelu'(inp) * dout; with !accumulate, dinp = 0 + gelu'(inp) * dout (gelu.h).
HEADROOM_CPU_CLONES inline void gelu_backward_bf16(uint16_t* dinp, const uint16_t* inp,
                                                   const uint16_t* dout, size_t N,
                                                   bool accumulate) {
  if (accumulate) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
    for (size_t i = 0; i < N; i++)
      dinp[i] = bf16::round(bf16::widen(dinp[i]) +
                            gelu_tanh_grad(bf16::widen(inp[i])) * bf16::widen(dout[i]));
  } else {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
    for (size_t i = 0; i < N; i++)
      dinp[i] = bf16::round(0.0f + gelu_tanh_grad(bf16::widen(inp[i])) * bf16::widen(dout[i]));
  }
}

// dst (N) += src (N)
HEADROOM_CPU_CLONES inline void add_inplace_bf16(uint16_t* dst, const uint16_t* src, size_t N) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
  for (size_t i = 0; i < N; i++)
    dst[i] = bf16::round(bf16::widen(dst[i]) + bf16::widen(src[i]));
}

// The rows of layernorm_forward_bf16 and residual_layernorm_forward_bf16: by groups of
// detail::kLnRows rows (layernorm.h: independent chains of serial double sums), each group widened
// into the thread's float buffer (kLnRows, C) and normalised as the f32 kernel does it. With `res`,
// the rows are first res += add, rounded as add_inplace_bf16 rounds it, and the rounded sums are
// what is normalised: bitwise add_inplace_bf16 then layernorm_forward_bf16, one pass over res.
template <int R>
HEADROOM_CPU_CLONES void layernorm_forward_rows_bf16(uint16_t* out, float* mean, float* rstd,
                                                     uint16_t* res, const uint16_t* add,
                                                     const uint16_t* inp, const uint16_t* weight,
                                                     const uint16_t* bias, int N, int C) {
  std::unique_ptr<float[]> wb(new float[2 * size_t(C)]);
  float *w = wb.get(), *b = w + C;
  bf16::widen_row(weight, w, C);
  bf16::widen_row(bias, b, C);
  const int groups = (N + R - 1) / R;
#pragma omp parallel num_threads(threads_for(size_t(N) * C))
  {
    float* buf = bf16::thread_buffer(0, size_t(R) * C);
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
      const int n0 = g * R, rows = N - n0 < R ? N - n0 : R;
      const float* x[R];
      for (int r = 0; r < R; r++) {
        float* xr = buf + static_cast<size_t>(r < rows ? r : rows - 1) * C;
        x[r] = xr;
        if (r >= rows) continue;  // the tail group repeats its last row (detail::group_rows)
        const size_t off = static_cast<size_t>(n0 + r) * C;
        if (res != nullptr) {
          uint16_t* rr = res + off;
          const uint16_t* ar = add + off;
          for (int i = 0; i < C; i++) {
            const uint16_t v = bf16::round(bf16::widen(rr[i]) + bf16::widen(ar[i]));
            rr[i] = v;
            xr[i] = bf16::widen(v);
          }
        } else {
          bf16::widen_row(inp + off, xr, C);
        }
      }
      double m[R], s[R];
      detail::layernorm_stats<R>(x, C, m, s);
      for (int r = 0; r < rows; r++) {
        uint16_t* y = out + static_cast<size_t>(n0 + r) * C;
        const float mT = float(m[r]);
        const float sT = float(s[r]);
        for (int i = 0; i < C; i++) {
          y[i] = bf16::round((x[r][i] - mT) * sT * w[i] + b[i]);
        }
        if (mean != nullptr) mean[n0 + r] = mT;
        if (rstd != nullptr) rstd[n0 + r] = sT;
      }
    }
  }
}

// layernorm_forward (layernorm.h) on bf16 inp, weight, bias and out; mean and rstd (N) f32 (either
// may be null).
inline void layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, const uint16_t* inp,
                                   const uint16_t* weight, const uint16_t* bias, int N, int C) {
  if (!detail::fuse_enabled())
    return layernorm_forward_rows_bf16<1>(out, mean, rstd, nullptr, nullptr, inp, weight, bias, N,
                                          C);
  layernorm_forward_rows_bf16<detail::kLnRows>(out, mean, rstd, nullptr, nullptr, inp, weight, bias,
                                               N, C);
}

// residual_layernorm_forward (layernorm.h) on bf16: res (N,C) += x (N,C), out (N,C) =
// LayerNorm(res) * weight + bias; mean, rstd (N) f32.
inline void residual_layernorm_forward_bf16(uint16_t* out, float* mean, float* rstd, uint16_t* res,
                                            const uint16_t* x, const uint16_t* weight,
                                            const uint16_t* bias, int N, int C) {
  if (!detail::fuse_enabled())
    return layernorm_forward_rows_bf16<1>(out, mean, rstd, res, x, res, weight, bias, N, C);
  layernorm_forward_rows_bf16<detail::kLnRows>(out, mean, rstd, res, x, res, weight, bias, N, C);
}

// layernorm_backward (layernorm.h) on bf16 tensors; mean and rstd f32. dweight and dbias
// accumulate in float over every row and are rounded once, as the widened path's float copies;
// with !accumulate, dinp = dres + that (dres may be null: 0 + that). dweight and dbias may be
// null together (no parameter gradients).
template <int R>
HEADROOM_CPU_CLONES void layernorm_backward_rows_bf16(uint16_t* dinp, uint16_t* dweight,
                                                      uint16_t* dbias, const uint16_t* dout,
                                                      const uint16_t* inp, const uint16_t* weight,
                                                      const float* mean, const float* rstd, int N,
                                                      int C, bool accumulate,
                                                      const uint16_t* dres) {
  std::unique_ptr<float[]> params(new float[3 * size_t(C)]);
  float *w = params.get(), *dw = w + C, *db = dw + C;
  bf16::widen_row(weight, w, C);
  const bool params_grad = dweight != nullptr && dbias != nullptr;
  if (params_grad) {
    bf16::widen_row(dweight, dw, C);
    bf16::widen_row(dbias, db, C);
  }
  constexpr int kCols = 64;
  const int blocks = (C + kCols - 1) / kCols;
#pragma omp parallel num_threads(threads_for(size_t(N) * C))
  {
    std::unique_ptr<float[]> rows(new float[2 * size_t(R) * C]);
    const int groups = (N + R - 1) / R;
    // The input gradient, by groups of rows (layernorm.h) widened into the thread's buffer (nowait:
    // the parameter gradients below read only the inputs).
#pragma omp for schedule(static) nowait
    for (int g = 0; g < groups; g++) {
      const int n0 = g * R, rows_in = N - n0 < R ? N - n0 : R;
      const float *xs[R], *dys[R];
      float ms[R], ss[R];
      for (int r = 0; r < R; r++) {
        const int k = r < rows_in ? r : rows_in - 1;  // the tail repeats its last row
        float* xr = rows.get() + static_cast<size_t>(2 * k) * C;
        xs[r] = xr, dys[r] = xr + C;
        ms[r] = mean[n0 + k], ss[r] = rstd[n0 + k];
        if (r >= rows_in) continue;
        bf16::widen_row(inp + static_cast<size_t>(n0 + r) * C, xr, C);
        bf16::widen_row(dout + static_cast<size_t>(n0 + r) * C, xr + C, C);
      }
      double sum_dnorm[R], sum_dnorm_norm[R];
      detail::layernorm_dsums<R>(xs, dys, w, ms, ss, C, sum_dnorm, sum_dnorm_norm);
      for (int r = 0; r < rows_in; r++) {
        const int n = n0 + r;
        const float* x = xs[r];
        const float* dy = dys[r];
        uint16_t* dx = dinp + static_cast<size_t>(n) * C;
        const float m = ms[r];
        const float s = ss[r];
        const float mean_dnorm = float(sum_dnorm[r] / C);
        const float mean_dnorm_norm = float(sum_dnorm_norm[r] / C);
        if (accumulate) {
          for (int i = 0; i < C; i++) {
            const float norm = (x[i] - m) * s;
            const float dnorm = w[i] * dy[i];
            dx[i] =
                bf16::round(bf16::widen(dx[i]) + (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s);
          }
        } else {
          const uint16_t* dr = dres ? dres + static_cast<size_t>(n) * C : nullptr;
          for (int i = 0; i < C; i++) {
            const float norm = (x[i] - m) * s;
            const float dnorm = w[i] * dy[i];
            dx[i] = bf16::round((dr ? bf16::widen(dr[i]) : 0.0f) +
                                (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s);
          }
        }
      }
    }
    // The parameter gradients: each column summed over the rows in order, by column blocks.
#pragma omp for schedule(static)
    for (int blk = 0; blk < (params_grad ? blocks : 0); blk++) {
      const int i0 = blk * kCols, i1 = i0 + kCols < C ? i0 + kCols : C;
      for (int n = 0; n < N; n++) {
        const uint16_t* xr = inp + static_cast<size_t>(n) * C;
        const uint16_t* dyr = dout + static_cast<size_t>(n) * C;
        const float m = mean[n];
        const float s = rstd[n];
        for (int i = i0; i < i1; i++) {
          const float d = bf16::widen(dyr[i]);
          const float norm = (bf16::widen(xr[i]) - m) * s;
          db[i] += d;
          dw[i] += norm * d;
        }
      }
    }
  }
  for (int i = 0; params_grad && i < C; i++) {
    dweight[i] = bf16::round(dw[i]);
    dbias[i] = bf16::round(db[i]);
  }
}

// layernorm_backward_rows_bf16 by groups of detail::kLnRows rows (one at a time:
// HEADROOM_CPU_FUSE=0).
inline void layernorm_backward_bf16(uint16_t* dinp, uint16_t* dweight, uint16_t* dbias,
                                    const uint16_t* dout, const uint16_t* inp,
                                    const uint16_t* weight, const float* mean, const float* rstd,
                                    int N, int C, bool accumulate, const uint16_t* dres) {
  if (!detail::fuse_enabled())
    return layernorm_backward_rows_bf16<1>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N,
                                           C, accumulate, dres);
  layernorm_backward_rows_bf16<detail::kLnRows>(dinp, dweight, dbias, dout, inp, weight, mean, rstd,
                                                N, C, accumulate, dres);
}

// crossentropy_forward_backward (crossentropy.h) on bf16 logits (N,V), overwritten with their
// gradient; losses (N) f32. Each row is widened into a thread's float buffer, computed there as
// the f32 kernel computes it in place, and rounded back.
HEADROOM_CPU_CLONES inline void crossentropy_forward_backward_bf16(uint16_t* logits, float* losses,
                                                                   const int32_t* targets, int N,
                                                                   int V, float dloss) {
#pragma omp parallel num_threads(threads_for(size_t(N) * V))
  {
    std::unique_ptr<float[]> buf(new float[size_t(V)]);
    float* row = buf.get();
#pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
      uint16_t* r16 = logits + static_cast<size_t>(n) * V;
      const int32_t target = targets[n];
      if (target < 0) {
        for (int i = 0; i < V; i++) {
          r16[i] = 0;
        }
        losses[n] = 0.0f;
        continue;
      }
      bf16::widen_row(r16, row, V);
      const float maxv = detail::max_of(row, V);
      const double target_shifted = static_cast<double>(row[target]) - maxv;
      for (int i = 0; i < V; i++) {
        row[i] = headroom::detail::hr_exp_minus_abs(row[i] - maxv);
      }
      const double sum = detail::sum_of(row, V);
      losses[n] = float(std::log(sum) - target_shifted);
      const float scale = float(static_cast<double>(dloss) / sum);
      for (int i = 0; i < V; i++) {
        row[i] *= scale;
      }
      row[target] -= dloss;
      for (int i = 0; i < V; i++) {
        r16[i] = bf16::round(row[i]);
      }
    }
  }
}

// embedding_forward (embedding.h) on bf16 tables and output: out = wte[token] + wpe[t] (wpe null:
// wte[token]), added in float and rounded. Only the tokens' rows are read.
HEADROOM_CPU_CLONES inline void embedding_forward_bf16(uint16_t* out, const int32_t* tokens,
                                                       const uint16_t* wte, const uint16_t* wpe,
                                                       int B, int Tn, int C) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads_for(size_t(B) * Tn * C))
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < Tn; t++) {
      const size_t bt = static_cast<size_t>(b) * Tn + t;
      uint16_t* o = out + bt * C;
      const uint16_t* e = wte + static_cast<size_t>(tokens[bt]) * C;
      if (wpe == nullptr) {
        for (int i = 0; i < C; i++)
          o[i] = bf16::round(bf16::widen(e[i]));
        continue;
      }
      const uint16_t* p = wpe + static_cast<size_t>(t) * C;
      for (int i = 0; i < C; i++)
        o[i] = bf16::round(bf16::widen(e[i]) + bf16::widen(p[i]));
    }
  }
}

// embedding_backward (embedding.h) on bf16 tensors: each gradient row the batch touches is
// widened once, gets its dout rows added in float in (b, t) order (the order of the f32 kernel's
// additions to each element), and is rounded once; rows no token names are not touched (the
// widened path rounds them back unchanged). dwte or dwpe may be null.
HEADROOM_CPU_CLONES inline void embedding_backward_bf16(uint16_t* dwte, uint16_t* dwpe,
                                                        const uint16_t* dout, const int32_t* tokens,
                                                        int B, int Tn, int C) {
  const int N = B * Tn;
  // The positions in (b, t) order, grouped by token: each group is one dwte row's additions.
  std::vector<int> order(size_t(N), 0);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return tokens[x] < tokens[y]; });
  std::vector<int> starts;  // where each token's group begins in order, then N
  for (int k = 0; k < N; k++)
    if (k == 0 || tokens[order[size_t(k)]] != tokens[order[size_t(k) - 1]]) starts.push_back(k);
  starts.push_back(N);
  const int groups = dwte ? int(starts.size()) - 1 : 0;
  const int positions = dwpe ? Tn : 0;
#pragma omp parallel num_threads(threads_for(size_t(N) * C))
  {
    std::unique_ptr<float[]> buf(new float[size_t(C)]);
    float* acc = buf.get();
#pragma omp for schedule(static) nowait
    for (int g = 0; g < groups; g++) {
      uint16_t* row = dwte + static_cast<size_t>(tokens[order[size_t(starts[size_t(g)])]]) * C;
      bf16::widen_row(row, acc, C);
      for (int k = starts[size_t(g)]; k < starts[size_t(g) + 1]; k++) {
        const uint16_t* d = dout + static_cast<size_t>(order[size_t(k)]) * C;
        for (int i = 0; i < C; i++)
          acc[i] += bf16::widen(d[i]);
      }
      for (int i = 0; i < C; i++)
        row[i] = bf16::round(acc[i]);
    }
#pragma omp for schedule(static)
    for (int t = 0; t < positions; t++) {
      uint16_t* row = dwpe + static_cast<size_t>(t) * C;
      bf16::widen_row(row, acc, C);
      for (int b = 0; b < B; b++) {
        const uint16_t* d = dout + (static_cast<size_t>(b) * Tn + t) * C;
        for (int i = 0; i < C; i++)
          acc[i] += bf16::widen(d[i]);
      }
      for (int i = 0; i < C; i++)
        row[i] = bf16::round(acc[i]);
    }
  }
}

// attention_tiled_forward (attention_tiled.h) on bf16 qkv and out; lse f32. Each (batch, head)
// widens its q, k and v columns into the thread's float buffer (T, 3 hs), runs the f32 kernel's
// head on it, and rounds its output columns back. The buffers hold one head, so they stay small
// (and in cache) whatever the model's width.
HEADROOM_CPU_CLONES inline void attention_tiled_forward_bf16(uint16_t* out, float* lse,
                                                             const uint16_t* qkv, int B, int Tn,
                                                             int C, int NH,
                                                             int tile = kAttentionTile,
                                                             int NKV = 0) {
  if (NKV == 0) NKV = NH;
  const int hs = C / NH, group = NH / NKV;
  const int C3 = C + 2 * NKV * hs;
  const float scale = float(1.0 / std::sqrt(static_cast<double>(hs)));
  const int nt = kGemmInParallel ? threads_for(size_t(B) * NH * Tn * Tn / 2) : 1;
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> s(static_cast<size_t>(tile) * tile), m(tile), l(tile);
    // q | k | v of one head, row stride 3 hs; its output, row stride hs.
    float* fqkv = bf16::thread_buffer(0, static_cast<size_t>(Tn) * 3 * hs);
    float* fout = bf16::thread_buffer(1, static_cast<size_t>(Tn) * hs);
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
      for (int h = 0; h < NH; h++) {
        const detail::QkvHead<uint16_t> hd(qkv, nullptr, b, h, Tn, C, hs, group);
        bf16::widen_cols(hd.q, fqkv, Tn, hs, C3, 3 * hs);
        bf16::widen_cols(hd.k, fqkv + hs, Tn, hs, C3, 3 * hs);
        bf16::widen_cols(hd.v, fqkv + 2 * hs, Tn, hs, C3, 3 * hs);
        detail::attention_tiled_forward_head(fout, lse + (static_cast<size_t>(b) * NH + h) * Tn,
                                             fqkv, fqkv + hs, fqkv + 2 * hs, Tn, hs, hs, 3 * hs,
                                             tile, scale, s.data(), m.data(), l.data());
        bf16::round_cols(fout, out + hd.o_off, Tn, hs, hs, C);
      }
    }
  }
}

// attention_tiled_backward (attention_tiled.h) on bf16 tensors (dqkv accumulated); lse f32. Each
// (batch, key/value head) group widens its heads' q, k, v, their current gradients, dout and out
// into the thread's float buffers, laid out as the qkv of a model of those heads alone (G = group
// query heads of hs, one key/value head: rows of G hs + 2 hs), runs the f32 kernel's heads in
// order, and rounds its gradient columns back once.
HEADROOM_CPU_CLONES inline void attention_tiled_backward_bf16(
    uint16_t* dqkv, const uint16_t* dout, const uint16_t* qkv, const uint16_t* out,
    const float* lse, int B, int Tn, int C, int NH, int tile = kAttentionTile, int NKV = 0) {
  if (NKV == 0) NKV = NH;
  const int hs = C / NH, group = NH / NKV;
  const int C3 = C + 2 * NKV * hs;
  const int Cg = group * hs, W = Cg + 2 * hs;  // the group's own C and row stride
  const float scale = float(1.0 / std::sqrt(static_cast<double>(hs)));
  const int nt = kGemmInParallel ? threads_for(size_t(B) * NH * Tn * Tn / 2) : 1;
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> p(static_cast<size_t>(tile) * tile), dp(static_cast<size_t>(tile) * tile),
        dsum(tile);
    float* fqkv = bf16::thread_buffer(0, static_cast<size_t>(Tn) * W);
    float* fdqkv = bf16::thread_buffer(2, static_cast<size_t>(Tn) * W);
    float* fout = bf16::thread_buffer(1, static_cast<size_t>(Tn) * Cg);
    float* fdout = bf16::thread_buffer(3, static_cast<size_t>(Tn) * Cg);
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
      for (int kvh = 0; kvh < NKV; kvh++) {
        const int h0 = kvh * group;
        const detail::QkvHead<uint16_t> g0(qkv, dqkv, b, h0, Tn, C, hs, group);
        const detail::QkvHead<float> l0(fqkv, fdqkv, 0, 0, Tn, Cg, hs, group);
        bf16::widen_cols(g0.k, fqkv + (l0.k - fqkv), Tn, hs, C3, W);
        bf16::widen_cols(g0.v, fqkv + (l0.v - fqkv), Tn, hs, C3, W);
        bf16::widen_cols(g0.dk, l0.dk, Tn, hs, C3, W);
        bf16::widen_cols(g0.dv, l0.dv, Tn, hs, C3, W);
        for (int h = h0; h < h0 + group; h++) {
          const detail::QkvHead<uint16_t> hd(qkv, dqkv, b, h, Tn, C, hs, group);
          const detail::QkvHead<float> lf(fqkv, fdqkv, 0, h - h0, Tn, Cg, hs, group);
          bf16::widen_cols(hd.q, fqkv + (lf.q - fqkv), Tn, hs, C3, W);
          bf16::widen_cols(hd.dq, lf.dq, Tn, hs, C3, W);
          bf16::widen_cols(out + hd.o_off, fout + lf.o_off, Tn, hs, C, Cg);
          bf16::widen_cols(dout + hd.o_off, fdout + lf.o_off, Tn, hs, C, Cg);
        }
        for (int h = h0; h < h0 + group; h++) {
          const detail::QkvHead<float> lf(fqkv, fdqkv, 0, h - h0, Tn, Cg, hs, group);
          detail::attention_tiled_backward_head(
              lf.dq, lf.dk, lf.dv, fdout + lf.o_off, lf.q, lf.k, lf.v, fout + lf.o_off,
              lse + (static_cast<size_t>(b) * NH + h) * Tn, Tn, Cg, hs, W, tile, scale, p.data(),
              dp.data(), dsum.data());
        }
        for (int h = h0; h < h0 + group; h++) {
          const detail::QkvHead<uint16_t> hd(qkv, dqkv, b, h, Tn, C, hs, group);
          const detail::QkvHead<float> lf(fqkv, fdqkv, 0, h - h0, Tn, Cg, hs, group);
          bf16::round_cols(lf.dq, hd.dq, Tn, hs, W, C3);
        }
        bf16::round_cols(l0.dk, g0.dk, Tn, hs, W, C3);
        bf16::round_cols(l0.dv, g0.dv, Tn, hs, W, C3);
      }
    }
  }
}

}  // namespace headroom::cpu
