// Causal multi-head self-attention, tiled (FlashAttention, Dao et al. 2022): the scores are
// computed a (query tile, key tile) block at a time and folded into the output with an online
// softmax (Milakov & Gimelshein 2018), so no (T, T) matrix ever exists. Forward saves the output
// and each query row's log-sum-exp; backward recomputes the scores tile by tile from them.
// Tiles above the diagonal are all masked and are skipped: half of the naive kernel's work.
// The same qkv layout and conventions as attention.h (backward ACCUMULATES into dqkv).
//
// Per (batch, head) pair, one thread: the tile buffers are host memory standing for what a GPU
// keeps in shared memory and registers (kernels/cuda/attention_tiled.cu), a few tiles a thread.
#pragma once

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/common/elementwise.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/reduce.h"

namespace headroom::cpu {

// Rows and columns of one tile. 64 keeps a (64, 64) score tile and its gradient in L2 next to
// the head's q, k, v rows, and the tile GEMMs large enough for the GEMM library.
constexpr int kAttentionTile = 64;

namespace detail {

// One (batch, head) of attention_tiled_forward: q, k, v (T,hs) with row stride C3, out_bh (T,hs)
// with row stride C, lse_bh (T); s (tile, tile), m, l (tile) the thread's buffers.
template <class T>
HR_INLINE void attention_tiled_forward_head(T* out_bh, T* lse_bh, const T* q, const T* k,
                                            const T* v, int Tn, int C, int hs, int C3, int tile,
                                            T scale, T* s, T* m, T* l) {
  for (int r0 = 0; r0 < Tn; r0 += tile) {
    const int rows = std::min(tile, Tn - r0);
    T* o = out_bh + static_cast<size_t>(r0) * C;  // (rows, hs), row stride C
    // Key tiles 0 .. the diagonal one; key tile 0 holds key 0, which every row sees, so
    // each row's max is set by the first tile and no -inf is ever needed.
    for (int c0 = 0; c0 <= r0; c0 += tile) {
      const int cols = std::min(tile, Tn - c0);
      const bool first = c0 == 0;
      // s (rows, cols) = scale * q_tile · k_tile^T
      gemm(false, true, rows, cols, hs, scale, q + static_cast<size_t>(r0) * C3, C3,
           k + static_cast<size_t>(c0) * C3, C3, T(0), s, tile);
      for (int r = 0; r < rows; r++) {
        T* sr = s + static_cast<size_t>(r) * tile;
        // Keys c0 + j <= r0 + r: all of an off-diagonal tile, a prefix of a diagonal one.
        const int n = std::min(cols, r0 + r - c0 + 1);
        const T tmax = detail::max_of(sr, n);
        const T m_new = first ? tmax : std::max(m[r], tmax);
        for (int j = 0; j < n; j++) {
          sr[j] = headroom::detail::hr_exp_minus_abs(sr[j] - m_new);
        }
        for (int j = n; j < cols; j++) {
          sr[j] = T(0);
        }
        const T sum = T(detail::sum_of(sr, n));
        if (first) {
          l[r] = sum;
        } else {
          // What the row has summed so far was relative to the old max.
          const T alpha = online_softmax_rescale(m[r], m_new);
          l[r] = l[r] * alpha + sum;
          T* orow = o + static_cast<size_t>(r) * C;
          for (int d = 0; d < hs; d++) {
            orow[d] *= alpha;
          }
        }
        m[r] = m_new;
      }
      // o (rows, hs) (+)= p (rows, cols) · v_tile (cols, hs); the first tile writes it.
      gemm(false, false, rows, hs, cols, T(1), s, tile, v + static_cast<size_t>(c0) * C3, C3,
           first ? T(0) : T(1), o, C);
    }
    for (int r = 0; r < rows; r++) {
      const T inv = T(1) / l[r];
      T* orow = o + static_cast<size_t>(r) * C;
      for (int d = 0; d < hs; d++) {
        orow[d] *= inv;
      }
      lse_bh[r0 + r] = m[r] + T(std::log(static_cast<double>(l[r])));
    }
  }
}

// One (batch, head) of attention_tiled_backward: q, k, v and dq, dk, dv (T,hs) with row stride
// C3, o_bh and do_bh (T,hs) with row stride C, lse_bh (T); p, dp (tile, tile), dsum (tile) the
// thread's buffers.
template <class T>
HR_INLINE void attention_tiled_backward_head(T* dq, T* dk, T* dv, const T* do_bh, const T* q,
                                             const T* k, const T* v, const T* o_bh, const T* lse_bh,
                                             int Tn, int C, int hs, int C3, int tile, T scale, T* p,
                                             T* dp, T* dsum) {
  for (int r0 = 0; r0 < Tn; r0 += tile) {
    const int rows = std::min(tile, Tn - r0);
    for (int r = 0; r < rows; r++) {
      const size_t at = static_cast<size_t>(r0 + r) * C;
      dsum[r] = T(detail::dot_of(do_bh + at, o_bh + at, hs));
    }
    const T* q_i = q + static_cast<size_t>(r0) * C3;
    const T* do_i = do_bh + static_cast<size_t>(r0) * C;
    for (int c0 = 0; c0 <= r0; c0 += tile) {
      const int cols = std::min(tile, Tn - c0);
      const T* k_j = k + static_cast<size_t>(c0) * C3;
      const T* v_j = v + static_cast<size_t>(c0) * C3;
      // p (rows, cols) = exp(scale q_i k_j^T - lse), 0 above the diagonal
      gemm(false, true, rows, cols, hs, scale, q_i, C3, k_j, C3, T(0), p, tile);
      // dp (rows, cols) = dout_i · v_j^T
      gemm(false, true, rows, cols, hs, T(1), do_i, C, v_j, C3, T(0), dp, tile);
      for (int r = 0; r < rows; r++) {
        T* pr = p + static_cast<size_t>(r) * tile;
        T* dr = dp + static_cast<size_t>(r) * tile;
        const int n = std::min(cols, r0 + r - c0 + 1);
        const T lr = lse_bh[r0 + r], dr_sum = dsum[r];
        // scale q k - lse <= 0 up to rounding: exp(-|x|) is its exp.
        for (int j = 0; j < n; j++) {
          pr[j] = headroom::detail::hr_exp_minus_abs(pr[j] - lr);
          dr[j] = pr[j] * (dr[j] - dr_sum);
        }
        for (int j = n; j < cols; j++) {
          pr[j] = T(0);
          dr[j] = T(0);
        }
      }
      // dv_j (cols, hs) += p^T (cols, rows) · dout_i (rows, hs)
      gemm(true, false, cols, hs, rows, T(1), p, tile, do_i, C, T(1),
           dv + static_cast<size_t>(c0) * C3, C3);
      // dq_i (rows, hs) += scale * ds (rows, cols) · k_j (cols, hs)
      gemm(false, false, rows, hs, cols, scale, dp, tile, k_j, C3, T(1),
           dq + static_cast<size_t>(r0) * C3, C3);
      // dk_j (cols, hs) += scale * ds^T (cols, rows) · q_i (rows, hs)
      gemm(true, false, cols, hs, rows, scale, dp, tile, q_i, C3, T(1),
           dk + static_cast<size_t>(c0) * C3, C3);
    }
  }
}

}  // namespace detail

// qkv (B,T,3C) laid out [q | k | v] as attention_forward's; with NKV < NH key/value heads
// (grouped-query attention, NKV dividing NH) (B,T,C + 2C·NKV/NH), each k and v head shared by
// NH/NKV consecutive query heads (detail::QkvHead). NKV 0: NH.
// out (B,T,C): heads side by side. lse (B,NH,T): log sum_j exp(scale q_t · k_j) over j <= t.
// tile: the tile's rows and columns (tests use small ones to reach many tiles at small T).
template <class T>
HEADROOM_CPU_CLONES void attention_tiled_forward(T* out, T* lse, const T* qkv, int B, int Tn, int C,
                                                 int NH, int tile = kAttentionTile, int NKV = 0) {
  if (NKV == 0) NKV = NH;
  assert(C % NH == 0 && tile > 0 && NH % NKV == 0);
  const int hs = C / NH, group = NH / NKV;
  const int C3 = C + 2 * NKV * hs;  // qkv's row stride
  const T scale = T(1.0 / std::sqrt(static_cast<double>(hs)));
  const int nt = kGemmInParallel ? threads_for(size_t(B) * NH * Tn * Tn / 2) : 1;
#pragma omp parallel num_threads(nt)
  {
    // s (tile, tile): scores, then probabilities; m, l (tile): each row's running max and sum.
    std::vector<T> s(static_cast<size_t>(tile) * tile), m(tile), l(tile);
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
      for (int h = 0; h < NH; h++) {
        const detail::QkvHead<T> hd(qkv, nullptr, b, h, Tn, C, hs, group);
        detail::attention_tiled_forward_head(
            out + hd.o_off, lse + (static_cast<size_t>(b) * NH + h) * Tn, hd.q, hd.k, hd.v, Tn, C,
            hs, C3, tile, scale, s.data(), m.data(), l.data());
      }
    }
  }
}

// dqkv (B,T,3C) += gradient w.r.t. qkv, given dout (B,T,C), qkv, and the forward's out and lse.
// Per query tile: D = rowsum(dout * out) (softmax backward's dot), then per key tile up to the
// diagonal: p = exp(scale q k^T - lse), dv += p^T dout, dp = dout v^T, ds = p (dp - D),
// dq += scale ds k, dk += scale ds^T q. The query heads of one key/value group run in one thread,
// in order: they add into the same dk and dv.
template <class T>
HEADROOM_CPU_CLONES void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv,
                                                  const T* out, const T* lse, int B, int Tn, int C,
                                                  int NH, int tile = kAttentionTile, int NKV = 0) {
  if (NKV == 0) NKV = NH;
  assert(C % NH == 0 && tile > 0 && NH % NKV == 0);
  const int hs = C / NH, group = NH / NKV;
  const int C3 = C + 2 * NKV * hs;  // qkv's row stride
  const T scale = T(1.0 / std::sqrt(static_cast<double>(hs)));
  const int nt = kGemmInParallel ? threads_for(size_t(B) * NH * Tn * Tn / 2) : 1;
#pragma omp parallel num_threads(nt)
  {
    // p, dp (tile, tile): probabilities and their gradient (then the scores'); dsum (tile): D.
    std::vector<T> p(static_cast<size_t>(tile) * tile), dp(static_cast<size_t>(tile) * tile),
        dsum(tile);
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
      for (int kvh = 0; kvh < NKV; kvh++) {
        for (int h = kvh * group; h < (kvh + 1) * group; h++) {
          const detail::QkvHead<T> hd(qkv, dqkv, b, h, Tn, C, hs, group);
          detail::attention_tiled_backward_head(
              hd.dq, hd.dk, hd.dv, dout + hd.o_off, hd.q, hd.k, hd.v, out + hd.o_off,
              lse + (static_cast<size_t>(b) * NH + h) * Tn, Tn, C, hs, C3, tile, scale, p.data(),
              dp.data(), dsum.data());
        }
      }
    }
  }
}

}  // namespace headroom::cpu
