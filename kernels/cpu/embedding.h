// Token + position embedding (GPT-2's wte and wpe).
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// out (B,T,C) = wte[tokens[b,t]] + wpe[t];  tokens (B,T), wte (V,C), wpe (maxT,C) with maxT >= T.
// wpe null: no position table (Llama's rotary positions), out = wte[tokens[b,t]].
template <class T>
HEADROOM_CPU_CLONES void embedding_forward(T* out, const int32_t* tokens, const T* wte,
                                           const T* wpe, int B, int Tn, int C) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads_for(size_t(B) * Tn * C))
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < Tn; t++) {
      const size_t bt = static_cast<size_t>(b) * Tn + t;
      T* out_bt = out + bt * C;
      const T* wte_ix = wte + static_cast<size_t>(tokens[bt]) * C;
      if (wpe == nullptr) {
        for (int i = 0; i < C; i++) {
          out_bt[i] = wte_ix[i];
        }
        continue;
      }
      const T* wpe_t = wpe + static_cast<size_t>(t) * C;
      for (int i = 0; i < C; i++) {
        out_bt[i] = wte_ix[i] + wpe_t[i];
      }
    }
  }
}

// dwte (V,C) += scatter of dout rows by token; dwpe (maxT,C) += dout summed over the batch.
// Sequential over (b,t) within each block of columns, the blocks split over the threads, so
// repeated tokens accumulate in a fixed order (deterministic, whatever the thread count).
// dwte or dwpe may be null (frozen table).
template <class T>
HEADROOM_CPU_CLONES void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens,
                                            int B, int Tn, int C) {
  constexpr int kCols = 64;
  const int blocks = (C + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(B) * Tn * C))
  for (int blk = 0; blk < blocks; blk++) {
    const int i0 = blk * kCols, i1 = i0 + kCols < C ? i0 + kCols : C;
    for (int b = 0; b < B; b++) {
      for (int t = 0; t < Tn; t++) {
        const size_t bt = static_cast<size_t>(b) * Tn + t;
        const T* dout_bt = dout + bt * C;
        if (dwte != nullptr) {
          T* dwte_ix = dwte + static_cast<size_t>(tokens[bt]) * C;
          for (int i = i0; i < i1; i++) {
            dwte_ix[i] += dout_bt[i];
          }
        }
        if (dwpe != nullptr) {
          T* dwpe_t = dwpe + static_cast<size_t>(t) * C;
          for (int i = i0; i < i1; i++) {
            dwpe_t[i] += dout_bt[i];
          }
        }
      }
    }
  }
}

}  // namespace headroom::cpu
