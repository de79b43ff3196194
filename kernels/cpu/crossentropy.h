// Fused softmax + cross-entropy loss + its backward. The logits buffer (N,V) is the largest
// activation of GPT-2 (V = 50257), so the gradient is written over it instead of into a second
// (N,V) buffer: nothing reads the logits after the loss.
#pragma once

#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/common/elementwise.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/reduce.h"

namespace headroom::cpu {

// in:  logits (N,V), targets (N) with values in [0,V) or < 0 for rows to ignore
// out: losses (N) = -log softmax(logits)[target], 0 for ignored rows;
//      logits overwritten with d(dloss * sum(losses))/dlogits = dloss * (softmax - onehot(target)),
//      all zeros for ignored rows.
// dloss is the upstream gradient of each row's loss (1/N for a mean over N rows).
// Numerically stable: the row max is subtracted before exp, and the sums are in double.
template <class T>
HEADROOM_CPU_CLONES void crossentropy_forward_backward(T* logits, T* losses, const int32_t* targets,
                                                       int N, int V, T dloss) {
  // Rows in parallel: each row's sums stay on one thread, in its order.
#pragma omp parallel for schedule(static) num_threads(threads_for(size_t(N) * V))
  for (int n = 0; n < N; n++) {
    T* row = logits + static_cast<size_t>(n) * V;
    const int32_t target = targets[n];
    if (target < 0) {
      for (int i = 0; i < V; i++) {
        row[i] = T(0);
      }
      losses[n] = T(0);
      continue;
    }
    assert(target < V);
    const T maxv = detail::max_of(row, V);
    const double target_shifted = static_cast<double>(row[target]) - maxv;
    // exp(x - max) replaces the logit in place, so the gradient pass needs no second exp.
    // Separate passes (exp, sum, scale) so each vectorizes; x - max <= 0, so exp(-|x - max|).
    for (int i = 0; i < V; i++) {
      row[i] = headroom::detail::hr_exp_minus_abs(row[i] - maxv);
    }
    const double sum = detail::sum_of(row, V);
    // loss = -log(exp(x_t - max) / sum) = log(sum) - (x_t - max)
    losses[n] = T(std::log(sum) - target_shifted);
    const T scale = T(static_cast<double>(dloss) / sum);
    for (int i = 0; i < V; i++) {
      row[i] *= scale;  // dloss * softmax
    }
    row[target] -= dloss;  // - dloss * onehot
  }
}

}  // namespace headroom::cpu
