// Residual connection. Its backward is add_inplace twice (the gradient flows unchanged to both
// branches), which is also what gradient accumulation uses.
#pragma once

#include <cstddef>

namespace headroom::cpu {

// out (N) = a (N) + b (N)
template <class T>
void residual_forward(T* out, const T* a, const T* b, size_t N) {
  for (size_t i = 0; i < N; i++) {
    out[i] = a[i] + b[i];
  }
}

// dst (N) += src (N)
template <class T>
void add_inplace(T* dst, const T* src, size_t N) {
  for (size_t i = 0; i < N; i++) {
    dst[i] += src[i];
  }
}

}  // namespace headroom::cpu
