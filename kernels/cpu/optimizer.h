// Optimizer updates and the reductions around them (gradient norm for clipping, scaling).
// The per-element update math is shared with CUDA (kernels/common/elementwise.h).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"
#include "kernels/common/elementwise.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/reduce.h"

namespace headroom::cpu {

// What an update writes beside each new weight: nothing (NoCopy, the default), or the f32 weight's
// compute-dtype copy (amp's bf16 / f16 compute copies beside f32 masters) rounded to nearest even
// with exactly the bits a cast writes (round_bf16_element, float_to_f16; Backend::cast): the
// update and the cast after it in one pass over the weights.
struct NoCopy {
  template <class V>
  void operator()(size_t, V) const {}
};
struct Bf16Copy {
  uint16_t* out;
  void operator()(size_t i, float w) const { out[i] = round_bf16_element(w); }
};
struct F16Copy {
  uint16_t* out;
  void operator()(size_t i, float w) const { out[i] = float_to_f16(w); }
};

// AdamW, torch.optim.AdamW semantics, over n parameters; m and v (n) are the moment buffers
// (zero-initialized by the caller before step 1). t is the 1-based step, for bias correction:
//   m = beta1 m + (1-beta1) g;  v = beta2 v + (1-beta2) g^2
//   param -= lr * (m/(1-beta1^t) / (sqrt(v/(1-beta2^t)) + eps) + weight_decay * param)
// `copy`: NoCopy, or (T float) where each new weight's compute-dtype copy goes.
template <class T, class Copy = NoCopy>
HEADROOM_CPU_CLONES void adamw_update(T* param, const T* grad, T* m, T* v, size_t n, float lr,
                                      float beta1, float beta2, float eps, float weight_decay,
                                      int64_t t, T grad_scale = T(1), Copy copy = {}) {
  const double td = static_cast<double>(t);
  const T bc1 = T(1.0 - std::pow(static_cast<double>(beta1), td));
  const T bc2 = T(1.0 - std::pow(static_cast<double>(beta2), td));
  const T lrT = T(lr), b1 = T(beta1), b2 = T(beta2), epsT = T(eps), wd = T(weight_decay);
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++) {
    // grad_scale: clipping folded in (x 1 is exact: unclipped steps are unchanged).
    const T w =
        adamw_element(param[i], grad[i] * grad_scale, m[i], v[i], lrT, b1, b2, epsT, wd, bc1, bc2);
    param[i] = w;
    copy(i, w);
  }
}

// SGD, torch.optim.SGD semantics (dampening 0, no Nesterov):
//   g = grad + weight_decay * param;  buf = momentum * buf + g;  param -= lr * buf
// momentum_buf (n) is zero-initialized by the caller; it is null when momentum == 0, and then
// there is no state: param -= lr * g. `copy` as adamw_update's.
template <class T, class Copy = NoCopy>
HEADROOM_CPU_CLONES void sgd_update(T* param, const T* grad, T* momentum_buf, size_t n, float lr,
                                    float momentum, float weight_decay, T grad_scale = T(1),
                                    Copy copy = {}) {
  const T lrT = T(lr), mu = T(momentum), wd = T(weight_decay);
  if (momentum_buf != nullptr && momentum != 0.0f) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
    for (size_t i = 0; i < n; i++) {
      const T w =
          sgd_momentum_element(param[i], grad[i] * grad_scale, momentum_buf[i], lrT, mu, wd);
      param[i] = w;
      copy(i, w);
    }
  } else {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
    for (size_t i = 0; i < n; i++) {
      const T w = sgd_element(param[i], grad[i] * grad_scale, lrT, wd);
      param[i] = w;
      copy(i, w);
    }
  }
}

// AdamW over stored operands (weights W, gradients G, state S: float, or uint16_t bf16 bits that
// are rounded stochastically from `seed`, kernels/common/elementwise.h adamw_stored). `copy` as
// adamw_update's (NoCopy unless W is float).
template <class W, class G, class S, class Copy = NoCopy>
HEADROOM_CPU_CLONES void adamw_update_stored(W* param, const G* grad, S* m, S* v, size_t n,
                                             float lr, float beta1, float beta2, float eps,
                                             float weight_decay, int64_t t, uint32_t seed,
                                             Copy copy = {}) {
  const double td = static_cast<double>(t);
  const float bc1 = float(1.0 - std::pow(static_cast<double>(beta1), td));
  const float bc2 = float(1.0 - std::pow(static_cast<double>(beta2), td));
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++) {
    adamw_stored(param[i], grad[i], m[i], v[i], i, seed, lr, beta1, beta2, eps, weight_decay, bc1,
                 bc2);
    copy(i, param[i]);
  }
}

// SGD over stored operands, as adamw_update_stored; momentum_buf null (or momentum 0): no state.
template <class W, class G, class S, class Copy = NoCopy>
HEADROOM_CPU_CLONES void sgd_update_stored(W* param, const G* grad, S* momentum_buf, size_t n,
                                           float lr, float momentum, float weight_decay,
                                           uint32_t seed, Copy copy = {}) {
  const bool with_buf = momentum_buf != nullptr && momentum != 0.0f;
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++) {
    sgd_stored(param[i], grad[i], with_buf ? momentum_buf + i : static_cast<S*>(nullptr), i, seed,
               lr, momentum, weight_decay);
    copy(i, param[i]);
  }
}

// sum of x[i]^2, accumulated in double (the squared norm of ~1e8 float gradients). The lanes of
// dot_of fix the order, so the AVX-512 clone is the baseline's bits at a quarter fewer cycles.
template <class T>
HEADROOM_CPU_CLONES double sum_squares(const T* x, size_t n) {
  return detail::dot_of(x, x, n);
}

// x (n) *= s
template <class T>
HEADROOM_CPU_CLONES void scale_inplace(T* x, size_t n, T s) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++) {
    x[i] *= s;
  }
}

}  // namespace headroom::cpu
