// Token + position embedding (GPT-2's wte and wpe).
// Convention (all CPU kernels): backward ACCUMULATES (+=) into its gradient outputs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace headroom::cpu {

// out (B,T,C) = wte[tokens[b,t]] + wpe[t];  tokens (B,T), wte (V,C), wpe (maxT,C) with maxT >= T.
template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn,
                       int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < Tn; t++) {
      const size_t bt = static_cast<size_t>(b) * Tn + t;
      T* out_bt = out + bt * C;
      const T* wte_ix = wte + static_cast<size_t>(tokens[bt]) * C;
      const T* wpe_t = wpe + static_cast<size_t>(t) * C;
      for (int i = 0; i < C; i++) {
        out_bt[i] = wte_ix[i] + wpe_t[i];
      }
    }
  }
}

// dwte (V,C) += scatter of dout rows by token; dwpe (maxT,C) += dout summed over the batch.
// Sequential over (b,t), so repeated tokens accumulate in a fixed order (deterministic).
// dwte or dwpe may be null (frozen table).
template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn,
                        int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < Tn; t++) {
      const size_t bt = static_cast<size_t>(b) * Tn + t;
      const T* dout_bt = dout + bt * C;
      if (dwte != nullptr) {
        T* dwte_ix = dwte + static_cast<size_t>(tokens[bt]) * C;
        for (int i = 0; i < C; i++) {
          dwte_ix[i] += dout_bt[i];
        }
      }
      if (dwpe != nullptr) {
        T* dwpe_t = dwpe + static_cast<size_t>(t) * C;
        for (int i = 0; i < C; i++) {
          dwpe_t[i] += dout_bt[i];
        }
      }
    }
  }
}

}  // namespace headroom::cpu
