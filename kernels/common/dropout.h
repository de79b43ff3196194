// Dropout with a mask nobody stores: element i of a tensor is kept with probability 1 - p (and
// scaled by 1 / (1 - p), PyTorch's inverted dropout) when a counter-based hash of (seed, i) says
// so. The CPU reference (core/device/backend_cpu.cpp) and the CUDA kernel (kernels/cuda/dropout.cu)
// draw the same mask, and backward draws it again from the same seed instead of keeping it from
// forward (a LoRA adapter's input is (N, in): keeping it would cost as much as the input itself).
#pragma once

#include <stdint.h>

#include "kernels/common/dtype.h"

namespace headroom {

// SplitMix64's finalizer (Steele et al. 2014): a bijection of 64 bits whose outputs for
// consecutive inputs pass BigCrush.
HR_HD inline uint64_t dropout_mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element i survives when its uniform draw in [0, 1), 24 bits of the hash, is at least p.
HR_HD inline bool dropout_keep(uint64_t seed, uint64_t i, float p) {
  const uint64_t h = dropout_mix(seed + (i + 1) * 0x9e3779b97f4a7c15ull);
  return float(uint32_t(h >> 40)) * (1.0f / 16777216.0f) >= p;
}

// The survivors' factor, rounded once to f32.
HR_HD inline float dropout_scale(float p) {
  return 1.0f / (1.0f - p);
}

}  // namespace headroom
