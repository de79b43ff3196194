// Widening 16-bit tensors to float and rounding floats back (the CPU backend computes bf16 and
// f16 tensors in f32: core/device/backend_cpu.cpp). Element-wise, so bitwise the conversions of
// kernels/common/dtype.h on any thread count; branch-free for bf16, so the loops vectorize, and
// compiled for AVX-512, AVX2 and the baseline (HEADROOM_CPU_CLONES: the same bits on each).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"
#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// (n,) bf16 -> (n,) f32, exact.
HEADROOM_CPU_CLONES inline void widen_bf16(const uint16_t* in, float* out, size_t n) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++)
    out[i] = bits_float(uint32_t(in[i]) << 16);
}

// f32 -> bf16, to nearest even; NaN stays a quiet NaN: float_to_bf16's bits, without its branch
// (a loop of it vectorizes).
inline uint16_t round_bf16_element(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x0040u;
  return uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// (n,) f32 -> (n,) bf16, to nearest even (round_bf16_element).
HEADROOM_CPU_CLONES inline void round_bf16(const float* in, uint16_t* out, size_t n) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++)
    out[i] = round_bf16_element(in[i]);
}

// y (n,) f32 += x (n,) bf16 widened: one rounded f32 add an element (amp's gradient
// accumulation).
HEADROOM_CPU_CLONES inline void accumulate_bf16(float* y, const uint16_t* x, size_t n) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++)
    y[i] += bits_float(uint32_t(x[i]) << 16);
}

// y (n,) f32 += x (n,) f32.
HEADROOM_CPU_CLONES inline void accumulate_f32(float* y, const float* x, size_t n) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++)
    y[i] += x[i];
}

// (n,) f16 <-> (n,) f32: the scalar conversions on the threads (their branches stay).
inline void widen_f16(const uint16_t* in, float* out, size_t n) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++)
    out[i] = f16_to_float(in[i]);
}
inline void round_f16(const float* in, uint16_t* out, size_t n) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (size_t i = 0; i < n; i++)
    out[i] = float_to_f16(in[i]);
}

}  // namespace headroom::cpu
