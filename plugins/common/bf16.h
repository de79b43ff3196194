// For in-tree plugins written in C++: bf16 loads and stores on the host (the CPU backend's device
// memory is host memory), and deterministic stochastic rounding from f32 to bf16.
//
// bf16 is the upper 16 bits of an IEEE f32: same sign and 8-bit exponent, 7 mantissa bits.
//  - load():               widen to f32, exact.
//  - round_nearest_even(): f32 -> bf16 rounding to nearest, ties to even (what the host's op_cast
//                          does); NaN stays a quiet NaN of the same sign.
//  - round_stochastic():   f32 -> bf16 rounding up with probability (distance to the lower bf16)
//                          / (bf16 spacing), so that E[round(x)] = x for every finite x inside a
//                          binade: the 16 random low bits are added to the f32 bit pattern and the
//                          sum is truncated (llm.c's stochastic_rounding, stated as an addition).
//                          Infinity and NaN are truncated (never turned into one another); a value
//                          within one bf16 ulp of FLT_MAX may round up to infinity, as it should.
//  - random16():           the 16 random bits for element `index` of tensor `tensor` at step
//                          `step` under `seed`: a counter-based hash (SplitMix64's finalizer
//                          chained over the four counters), so the bits depend only on those four
//                          numbers — the same seed gives bitwise the same rounding on any run,
//                          any thread count, and after a resume. stream_key() hoists the first
//                          three out of a loop over a tensor's elements: random16(seed, step,
//                          tensor, i) == random16_at(stream_key(seed, step, tensor), i).
//
// Header-only, no state, no allocation; every function is a pure function of its arguments and
// safe to call from any thread.
#pragma once

#include <cstdint>
#include <cstring>

namespace headroom_plugin {
namespace bf16 {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// bf16 bits -> f32, exact.
inline float load(uint16_t b) {
  return bits_f32(uint32_t(b) << 16);
}

inline bool is_inf_or_nan(uint32_t bits) {
  return (bits & 0x7F800000u) == 0x7F800000u;
}

// f32 -> bf16, round to nearest even.
inline uint16_t round_nearest_even(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  const uint32_t lsb = (u >> 16) & 1u;
  return uint16_t((u + 0x7FFFu + lsb) >> 16);
}

// f32 -> bf16 with the 16 random bits `rnd` (only its low 16 bits are used): add and truncate.
inline uint16_t round_stochastic(float f, uint32_t rnd) {
  const uint32_t u = f32_bits(f);
  if (is_inf_or_nan(u)) return uint16_t(u >> 16);  // inf stays inf; NaN keeps its quiet bit
  return uint16_t((u + (rnd & 0xFFFFu)) >> 16);
}

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijection of 64-bit words with good
// avalanche; the increment is the golden-ratio constant of the generator.
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The key of one tensor's stream at one step.
inline uint64_t stream_key(uint64_t seed, uint64_t step, uint64_t tensor) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ step);
  return splitmix64(h ^ tensor);
}

// 16 random bits (the hash's top 16) for element `index` of a stream.
inline uint32_t random16_at(uint64_t key, uint64_t index) {
  return uint32_t(splitmix64(key ^ index) >> 48);
}

inline uint32_t random16(uint64_t seed, uint64_t step, uint64_t tensor, uint64_t index) {
  return random16_at(stream_key(seed, step, tensor), index);
}

}  // namespace bf16
}  // namespace headroom_plugin
