// Residual connection. Its backward is add_inplace twice (the gradient flows unchanged to both
// branches), which is also what gradient accumulation uses.
#pragma once

#include <cstddef>

#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// out (N) = a (N) + b (N)
template <class T>
HEADROOM_CPU_CLONES void residual_forward(T* out, const T* a, const T* b, size_t N) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
  for (size_t i = 0; i < N; i++) {
    out[i] = a[i] + b[i];
  }
}

// dst (N) += src (N)
template <class T>
HEADROOM_CPU_CLONES void add_inplace(T* dst, const T* src, size_t N) {
#pragma omp parallel for schedule(static) num_threads(threads_for(N))
  for (size_t i = 0; i < N; i++) {
    dst[i] += src[i];
  }
}

}  // namespace headroom::cpu
