// Causal multi-head self-attention, GEMM-based: per (batch, head) two GEMMs forward and four
// backward, reading the head's q, k, v straight out of qkv through the row stride (3C), so there
// are no copies. Only the softmax and its backward are hand-written loops.
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs.
#pragma once

#include <cassert>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/common/elementwise.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/reduce.h"

namespace headroom::cpu {

namespace detail {

// Head h of batch row b: its q, k and v, (T, hs) views of qkv (B, T, W) = [q | k | v] with row
// stride W; the same views of the gradient dqkv when there is one; and where its columns start
// in a (B, T, C) tensor (out, dout; row stride C). The naive and the tiled kernels' one layout.
// Grouped-query attention (`group` query heads a key/value head): q is C wide, k and v C / group
// each, so W = C + 2C / group, and head h reads key/value head h / group. group 1: W = 3C.
template <class T>
struct QkvHead {
  const T *q, *k, *v;
  T *dq = nullptr, *dk = nullptr, *dv = nullptr;
  size_t o_off;
  QkvHead(const T* qkv, T* dqkv, int b, int h, int Tn, int C, int hs, int group = 1)
      : o_off(static_cast<size_t>(b) * Tn * C + static_cast<size_t>(h) * hs) {
    const size_t KV = static_cast<size_t>(C / group), W = C + 2 * KV;
    const size_t row = static_cast<size_t>(b) * Tn * W;
    const size_t kv = static_cast<size_t>(h / group) * hs;
    q = qkv + row + static_cast<size_t>(h) * hs;
    k = qkv + row + C + kv;
    v = qkv + row + C + KV + kv;
    if (dqkv != nullptr) {
      dq = dqkv + row + static_cast<size_t>(h) * hs;
      dk = dqkv + row + C + kv;
      dv = dqkv + row + C + KV + kv;
    }
  }
};

// In place over one row of preatt (T): softmax over the first n entries (positions 0..t, n = t+1)
// and exact zeros after them, which is what makes the following att · v GEMM causal.
// Separate passes so that each vectorizes; row - max <= 0, so exp(-|row - max|) is its exp.
template <class T>
inline void causal_softmax_row(T* row, int n, int Tn) {
  const T maxv = max_of(row, n);
  for (int j = 0; j < n; j++) {
    row[j] = headroom::detail::hr_exp_minus_abs(row[j] - maxv);
  }
  const T inv = T(1.0 / sum_of(row, n));
  for (int j = 0; j < n; j++) {
    row[j] *= inv;
  }
  for (int j = n; j < Tn; j++) {
    row[j] = T(0);
  }
}

}  // namespace detail

// qkv (B,T,3C) laid out [q | k | v], each C wide; head h uses columns h*hs..(h+1)*hs, hs = C/NH.
// att (B,NH,T,T): softmax probabilities, saved for backward (zero above the diagonal).
// out (B,T,C): heads side by side in the same column order.
template <class T>
HEADROOM_CPU_CLONES void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C,
                                           int NH) {
  assert(C % NH == 0);
  const int hs = C / NH;
  const int C3 = 3 * C;
  const T scale = T(1.0 / std::sqrt(static_cast<double>(hs)));
  // (batch, head) pairs in parallel where the GEMM library runs inside a parallel region
  // (gemm.h): each pair writes its own att and out columns.
  const int nt = kGemmInParallel ? threads_for(size_t(B) * NH * Tn * Tn) : 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const detail::QkvHead<T> hd(qkv, nullptr, b, h, Tn, C, hs);
      const T *q = hd.q, *k = hd.k, *v = hd.v;                        // (T,hs), row stride 3C
      T* att_bh = att + (static_cast<size_t>(b) * NH + h) * Tn * Tn;  // (T,T)
      T* out_bh = out + hd.o_off;                                     // (T,hs)
      // preatt (T,T) = scale * q · k^T. The whole square is computed (one GEMM is cheaper than
      // T small ones); the softmax overwrites the masked upper triangle with zeros.
      gemm(false, true, Tn, Tn, hs, scale, q, C3, k, C3, T(0), att_bh, Tn);
      for (int t = 0; t < Tn; t++) {
        detail::causal_softmax_row(att_bh + static_cast<size_t>(t) * Tn, t + 1, Tn);
      }
      // out (T,hs) = att (T,T) · v (T,hs)
      gemm(false, false, Tn, hs, Tn, T(1), att_bh, Tn, v, C3, T(0), out_bh, C);
    }
  }
}

// dqkv (B,T,3C) += gradient w.r.t. qkv, given dout (B,T,C) and the forward's qkv and att.
// scratch: caller-provided workspace of T*T elements (contents undefined on entry and exit); it
// holds datt and then dpreatt for one (b,h) at a time.
template <class T>
HEADROOM_CPU_CLONES void attention_backward(T* dqkv, T* scratch, const T* dout, const T* qkv,
                                            const T* att, int B, int Tn, int C, int NH) {
  assert(C % NH == 0);
  const int hs = C / NH;
  const int C3 = 3 * C;
  const T scale = T(1.0 / std::sqrt(static_cast<double>(hs)));
  // (batch, head) pairs in parallel, as forward. Thread 0 uses the caller's scratch, the others
  // a (T,T) buffer of their own: host memory standing for what a GPU keeps in shared memory, as
  // the CPU backend's widened copies stand for registers.
  const int nt = kGemmInParallel ? threads_for(size_t(B) * NH * Tn * Tn) : 1;
  std::vector<std::vector<T>> extra(nt > 1 ? nt - 1 : 0);
#pragma omp parallel num_threads(nt)
  {
    const int tid = thread_num();
    T* my_scratch = scratch;
    if (tid > 0) {
      extra[tid - 1].resize(static_cast<size_t>(Tn) * Tn);
      my_scratch = extra[tid - 1].data();
    }
#pragma omp for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
      for (int h = 0; h < NH; h++) {
        const detail::QkvHead<T> hd(qkv, dqkv, b, h, Tn, C, hs);
        const T *q = hd.q, *k = hd.k, *v = hd.v;  // (T,hs), row stride 3C; likewise dq, dk, dv
        T *dq = hd.dq, *dk = hd.dk, *dv = hd.dv;
        const T* att_bh = att + (static_cast<size_t>(b) * NH + h) * Tn * Tn;  // (T,T)
        const T* dout_bh = dout + hd.o_off;
        // dv (T,hs) += att^T (T,T) · dout (T,hs)
        gemm(true, false, Tn, hs, Tn, T(1), att_bh, Tn, dout_bh, C, T(1), dv, C3);
        // datt (T,T) = dout (T,hs) · v^T
        T* d = my_scratch;
        gemm(false, true, Tn, Tn, hs, T(1), dout_bh, C, v, C3, T(0), d, Tn);
        // Softmax backward, row by row, in place: dpreatt = att * (datt - sum_j att_j datt_j).
        // Masked entries have att = 0, so their gradient is exactly 0 (written, not computed, since
        // datt there is whatever the GEMM produced).
        for (int t = 0; t < Tn; t++) {
          const T* a = att_bh + static_cast<size_t>(t) * Tn;
          T* dr = d + static_cast<size_t>(t) * Tn;
          const T dotT = T(detail::dot_of(a, dr, t + 1));
          for (int j = 0; j <= t; j++) {
            dr[j] = a[j] * (dr[j] - dotT);
          }
          for (int j = t + 1; j < Tn; j++) {
            dr[j] = T(0);
          }
        }
        // preatt = scale * q · k^T, so with the scale folded into alpha:
        // dq (T,hs) += scale * dpreatt (T,T) · k (T,hs);  dk (T,hs) += scale * dpreatt^T · q
        gemm(false, false, Tn, hs, Tn, scale, d, Tn, k, C3, T(1), dq, C3);
        gemm(true, false, Tn, hs, Tn, scale, d, Tn, q, C3, T(1), dk, C3);
      }
    }
  }
}

// One new query against a KV cache (generation): qkv (T,3C) holds positions 0..T-1 of one
// sequence, and the last row's q attends over every row's k and v (all at or before it).
// out (C): the heads side by side, as attention_forward's row T-1. O(T C) where attention_forward
// over the cache is O(T^2 C). The same softmax as the forward's row.
template <class T>
void attention_decode(T* out, const T* qkv, int Tn, int C, int NH) {
  assert(C % NH == 0 && Tn > 0);
  const int hs = C / NH;
  const size_t C3 = static_cast<size_t>(3) * C;
  const T scale = T(1.0 / std::sqrt(static_cast<double>(hs)));
  std::vector<T> p(static_cast<size_t>(Tn));
  const T* q_row = qkv + static_cast<size_t>(Tn - 1) * C3;
  for (int h = 0; h < NH; h++) {
    const T* q = q_row + static_cast<size_t>(h) * hs;
    for (int j = 0; j < Tn; j++) {
      const T* k = qkv + static_cast<size_t>(j) * C3 + C + static_cast<size_t>(h) * hs;
      T dot = T(0);
      for (int d = 0; d < hs; d++)
        dot += q[d] * k[d];
      p[static_cast<size_t>(j)] = scale * dot;
    }
    detail::causal_softmax_row(p.data(), Tn, Tn);
    T* o = out + static_cast<size_t>(h) * hs;
    for (int d = 0; d < hs; d++)
      o[d] = T(0);
    for (int j = 0; j < Tn; j++) {
      const T* v = qkv + static_cast<size_t>(j) * C3 + 2 * static_cast<size_t>(C) +
                   static_cast<size_t>(h) * hs;
      const T pj = p[static_cast<size_t>(j)];
      for (int d = 0; d < hs; d++)
        o[d] += pj * v[d];
    }
  }
}

}  // namespace headroom::cpu
