// Rotary position embeddings' frequencies (Su et al. 2021), with Llama 3's rope scaling
// (Hugging Face's rope_type "llama3"): one host-and-device function, so every backend rotates by
// the same angles.
#pragma once

#include <cmath>

namespace headroom {

// [model] rope_theta and, when factor > 0, Llama 3's scaling ([model] rope_scaling).
struct RopeParams {
  double theta = 10000.0;
  double factor = 0.0;  // 0: no scaling
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192.0;
};

// The inverse frequency of pair i (0 .. hs/2 - 1) of a head of size hs: theta^(-2i/hs), and with
// scaling Hugging Face's _compute_llama3_parameters: long wavelengths divided by factor, short
// ones kept, the band between interpolated.
inline double rope_inv_freq(int i, int hs, const RopeParams& p) {
  const double inv = 1.0 / std::pow(p.theta, double(2 * i) / hs);
  if (p.factor <= 0.0) return inv;
  const double old_len = p.original_max_position_embeddings;
  const double low_wavelen = old_len / p.low_freq_factor;
  const double high_wavelen = old_len / p.high_freq_factor;
  const double wavelen = 2.0 * M_PI / inv;
  if (wavelen < high_wavelen) return inv;
  if (wavelen > low_wavelen) return inv / p.factor;
  const double smooth =
      (old_len / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
  return (1.0 - smooth) * inv / p.factor + smooth * inv;
}

}  // namespace headroom
