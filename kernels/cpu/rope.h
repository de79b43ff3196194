// Rotary position embeddings, in place on the q and k columns of qkv: Hugging Face's layout
// (rotate_half), pair i of a head being its elements i and i + hs/2, rotated by t · inv_freq(i).
// Linear and orthogonal, so backward is the rotation by the opposite angle, in place on dqkv.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/common/rope.h"
#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// x (B,T,W) with row stride W = (NH + 2·NKV)·hs laid out [q (NH heads) | k (NKV) | v (NKV)]: the
// NH + NKV q and k heads of row (b, t) rotated by angle sign · t · inv_freq(i); v untouched.
// sign = +1 forward, -1 backward (dqkv in the same layout).
template <class T>
HEADROOM_CPU_CLONES void rope_rotate(T* x, int B, int Tn, int NH, int NKV, int hs,
                                     const RopeParams& p, int sign) {
  const int half = hs / 2, W = (NH + 2 * NKV) * hs;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(B) * Tn * W))
  for (int t = 0; t < Tn; t++) {
    for (int i = 0; i < half; i++) {
      const double a = sign * double(t) * rope_inv_freq(i, hs, p);
      const T c = T(std::cos(a)), s = T(std::sin(a));
      for (int b = 0; b < B; b++) {
        T* row = x + (static_cast<size_t>(b) * Tn + t) * W;
        for (int h = 0; h < NH + NKV; h++) {
          T* e = row + static_cast<size_t>(h) * hs;
          const T x1 = e[i], x2 = e[i + half];
          e[i] = x1 * c - x2 * s;
          e[i + half] = x2 * c + x1 * s;
        }
      }
    }
  }
}

template <class T>
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p) {
  rope_rotate(qkv, B, Tn, NH, NKV, hs, p, +1);
}
// dqkv += ... is not needed: the rotation maps the gradient in place (an orthogonal map's
// transpose is its inverse), so backward rewrites dqkv's q and k columns.
template <class T>
void rope_backward(T* dqkv, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p) {
  rope_rotate(dqkv, B, Tn, NH, NKV, hs, p, -1);
}

}  // namespace headroom::cpu
