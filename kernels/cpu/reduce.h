// Reductions for the softmax-shaped kernels (attention, cross-entropy) and the gradient norm.
//
// A plain `for (...) s += x[i]` is one dependent add per element (~4 cycles), and the compiler may
// not vectorize it without -ffast-math since that would reorder the sum. Eight fixed lanes (lane j
// takes elements i with i % 8 == j, combined in a fixed order at the end) break the dependency
// chain and let the compiler use SIMD, while the result stays a deterministic function of the
// input whatever the vector width (short of -ffast-math, which may reorder anything).
#pragma once

#include <cstddef>

namespace headroom::cpu::detail {

constexpr size_t kLanes = 8;

// max of x[0..n), n >= 1. NaNs are skipped (a NaN then propagates through the exps instead).
template <class T>
inline T max_of(const T* x, size_t n) {
  T m[kLanes];
  for (size_t j = 0; j < kLanes; j++) {
    m[j] = x[0];
  }
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; j++) {
      m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
    }
  }
  for (; i < n; i++) {
    m[0] = x[i] > m[0] ? x[i] : m[0];
  }
  T r = m[0];
  for (size_t j = 1; j < kLanes; j++) {
    r = m[j] > r ? m[j] : r;
  }
  return r;
}

// sum of x[0..n) accumulated in double.
template <class T>
inline double sum_of(const T* x, size_t n) {
  double s[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; j++) {
      s[j] += static_cast<double>(x[i + j]);
    }
  }
  for (; i < n; i++) {
    s[0] += static_cast<double>(x[i]);
  }
  double r = 0.0;
  for (size_t j = 0; j < kLanes; j++) {
    r += s[j];
  }
  return r;
}

// sum of a[i] * b[i] over [0..n) accumulated in double.
template <class T>
inline double dot_of(const T* a, const T* b, size_t n) {
  double s[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; j++) {
      s[j] += static_cast<double>(a[i + j]) * b[i + j];
    }
  }
  for (; i < n; i++) {
    s[0] += static_cast<double>(a[i]) * b[i];
  }
  double r = 0.0;
  for (size_t j = 0; j < kLanes; j++) {
    r += s[j];
  }
  return r;
}

}  // namespace headroom::cpu::detail
