// Storage dtypes: float <-> bf16 / fp16 conversions, round to nearest even, shared by the CPU and
// CUDA backends so that both round identically.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define HR_HD __host__ __device__
#else
#define HR_HD
#endif

namespace headroom {

HR_HD inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
HR_HD inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// bf16 is the top half of a float: round the dropped 16 bits to nearest, ties to even.
HR_HD inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}
HR_HD inline float bf16_to_float(uint16_t h) {
  return bits_float(uint32_t(h) << 16);
}

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits; overflow goes to infinity,
// underflow through the subnormals to zero, all rounded to nearest even.
HR_HD inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u);   // NaN
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520: infinity
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal half
    // Scale so the half subnormal's unit (2^-24) becomes 1, and let the float adder round.
    const float scaled = bits_float(a) * 16777216.0f;    // exact: a power of two
    const float r = scaled + 12582912.0f - 12582912.0f;  // round to an integer, ties to even
    return uint16_t(sign | uint16_t(r));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebased = a - 0x38000000u;  // exponent bias 127 -> 15
  const uint32_t rounding = 0x0FFFu + ((rebased >> 13) & 1u);
  return uint16_t(sign | ((rebased + rounding) >> 13));
}
HR_HD inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = float(man) * (1.0f / 16777216.0f);
    return bits_float(sign | float_bits(v));
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (man << 13));  // inf / NaN
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

}  // namespace headroom
