// adam8bit's kernels on the host (the CPU backend, where device memory is host memory): the
// dynamic quantization maps, block-wise quantization, and one AdamW step over a tensor with 8-bit
// or fp32 moments. Plain loops, no state of their own, no allocation: the plugin (adam8bit.cpp)
// owns the buffers; tests/adam8bit_test.cpp calls these directly.
//
// Block-wise 8-bit state (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"):
// a tensor of n elements is cut into ceil(n / 256) blocks of 256 consecutive elements (the last
// one shorter). Each moment keeps one byte per element (an index into its map) and one fp32
// absmax per block; the element's value is map[q] * absmax. Quantizing a block stores its
// absmax = max |x| and, per element, the index of the map entry nearest to x / absmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/bf16.h"
#include "headroom/plugin.h"

namespace adam8bit {

constexpr uint64_t kBlock = 256;         // elements per block (bitsandbytes' optimizer blocks)
constexpr uint64_t kMapEntries = 256;    // 8 bits
constexpr uint64_t kMin8bitSize = 4096;  // bitsandbytes' min_8bit_size default

inline uint64_t num_blocks(uint64_t n) {
  return (n + kBlock - 1) / kBlock;
}

// The dynamic map (bitsandbytes' create_dynamic_map with 7 exponent bits, 8 bits in all): for
// each decade e = -6 .. 0, the midpoints of a linear split of [0.1, 1] into 2^(e+6) parts
// (signed: twice that many, unsigned), times 10^e; then 0 and 1; sorted ascending.
//  - signed (the first moment): 127 positive midpoints, 127 negative ones, 0 and 1. bitsandbytes'
//    signed map cannot represent -1 (its most negative entry is -0.99297); here its
//    smallest-magnitude negative entry (-5.5e-7, which then quantizes to 0) is replaced by -1 so
//    that a block's absmax element is exact whatever its sign. 127 entries < 0, map[127] = 0,
//    128 entries > 0, map[0] = -1, map[255] = 1.
//  - unsigned (the second moment): 254 positive midpoints, 0 and 1. map[0] = 0, map[255] = 1.
inline std::vector<float> dynamic_map(bool is_signed) {
  std::vector<double> data;
  const int kExponentBits = 7;
  for (int i = 0; i < kExponentBits; ++i) {
    const int parts = is_signed ? (1 << i) : (1 << (i + 1));
    const double scale = std::pow(10.0, double(-(kExponentBits - 1) + i));
    const double step = 0.9 / double(parts);
    for (int j = 0; j < parts; ++j) {
      const double mid = 0.1 + step * (double(j) + 0.5);
      data.push_back(scale * mid);
      if (is_signed) data.push_back(-scale * mid);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  std::sort(data.begin(), data.end());
  if (is_signed) {
    // The negative entry nearest zero sits just below 0 in the sorted order: replace it with -1.
    const auto zero = std::find(data.begin(), data.end(), 0.0);
    *(zero - 1) = -1.0;
    std::sort(data.begin(), data.end());
  }
  std::vector<float> out(data.size());
  for (size_t i = 0; i < data.size(); ++i)
    out[i] = float(data[i]);
  return out;
}

// The 255 decision thresholds of a sorted 256-entry map: the midpoints between neighbours. The
// nearest entry to x is the number of thresholds below x (a tie goes to the lower entry).
inline std::vector<float> thresholds(const std::vector<float>& map) {
  std::vector<float> t(kMapEntries - 1);
  for (size_t i = 0; i + 1 < kMapEntries; ++i)
    t[i] = float((double(map[i]) + double(map[i + 1])) * 0.5);
  return t;
}

// The index of the map entry nearest to x: a branch-free binary search over the thresholds (8
// comparisons). x outside [map[0], map[255]] gives the end entry; NaN gives 0.
inline uint8_t quantize(const float* thresh, float x) {
  uint32_t pos = 0;
  for (uint32_t s = 128; s >= 1; s >>= 1)
    pos += (thresh[pos + s - 1] < x) ? s : 0u;  // a conditional move, no branch
  return uint8_t(pos);
}

inline uint8_t zero_code(const float* map) {
  for (uint32_t i = 0; i < kMapEntries; ++i)
    if (map[i] == 0.0f) return uint8_t(i);
  return 0;
}

// Quantizes n <= kBlock values of one block into q[], returning the block's absmax.
inline float quantize_block(const float* map, const float* thresh, const float* x, uint64_t n,
                            uint8_t* q) {
  float absmax = 0.0f;
  for (uint64_t i = 0; i < n; ++i)
    absmax = std::max(absmax, std::fabs(x[i]));
  const uint8_t zq = zero_code(map);
  if (!(absmax > 0.0f)) {
    for (uint64_t i = 0; i < n; ++i)
      q[i] = zq;
    return 0.0f;
  }
  const float inv = 1.0f / absmax;
  for (uint64_t i = 0; i < n; ++i)
    q[i] = quantize(thresh, x[i] * inv);
  return absmax;
}

inline void dequantize_block(const float* map, const uint8_t* q, float absmax, uint64_t n,
                             float* x) {
  for (uint64_t i = 0; i < n; ++i)
    x[i] = map[q[i]] * absmax;
}

// The step's hyperparameters, as the host's AdamW takes them (f32, bias corrections computed in
// double once per step and rounded).
struct Hyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t
  // bf16 weights only: the stochastic rounding's stream (bf16::stream_key(seed, step, tensor)).
  uint64_t round_key = 0;
};

inline Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                        int64_t step) {
  Hyper h;
  h.lr = float(lr);
  h.beta1 = float(beta1);
  h.beta2 = float(beta2);
  h.eps = float(eps);
  h.weight_decay = float(weight_decay);
  h.bias_correction1 = float(1.0 - std::pow(beta1, double(step)));
  h.bias_correction2 = float(1.0 - std::pow(beta2, double(step)));
  return h;
}

// A parameter as the kernels see it: the weights (f32 masters or bf16) and the gradient (f32 or
// bf16), n elements each.
struct ParamRef {
  void* data = nullptr;
  uint32_t dtype = HR_DTYPE_F32;
  const void* grad = nullptr;
  uint32_t grad_dtype = HR_DTYPE_F32;
  uint64_t numel = 0;
};

inline bool supported(uint32_t dtype) {
  return dtype == HR_DTYPE_F32 || dtype == HR_DTYPE_BF16;
}

inline float load(const void* p, uint32_t dtype, uint64_t i) {
  if (dtype == HR_DTYPE_BF16)
    return headroom_plugin::bf16::load(static_cast<const uint16_t*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// The new weight: f32 as computed, bf16 stochastically rounded from the element's random bits.
inline void store(void* p, uint32_t dtype, uint64_t i, float x, uint64_t round_key) {
  if (dtype == HR_DTYPE_BF16) {
    static_cast<uint16_t*>(p)[i] = headroom_plugin::bf16::round_stochastic(
        x, headroom_plugin::bf16::random16_at(round_key, i));
  } else {
    static_cast<float*>(p)[i] = x;
  }
}

// One element of AdamW (torch.optim.AdamW: decoupled weight decay on the weight before this
// step, bias-corrected moments), the host's adamw_element in f32. Updates m and v.
inline float adamw(float param, float grad, float& m, float& v, const Hyper& h) {
  m = h.beta1 * m + (1.0f - h.beta1) * grad;
  v = h.beta2 * v + (1.0f - h.beta2) * grad * grad;
  const float mhat = m / h.bias_correction1;
  const float vhat = v / h.bias_correction2;
  return param - h.lr * (mhat / (std::sqrt(vhat) + h.eps) + h.weight_decay * param);
}

// fp32 moments (tensors under min_8bit_size).
inline void step_f32(const ParamRef& p, float* m, float* v, const Hyper& h) {
  for (uint64_t i = 0; i < p.numel; ++i) {
    const float w = adamw(load(p.data, p.dtype, i), load(p.grad, p.grad_dtype, i), m[i], v[i], h);
    store(p.data, p.dtype, i, w, h.round_key);
  }
}

// The 8-bit state of one tensor: codes and per-block absmax for each moment, and the maps (with
// their thresholds) they index.
struct State8 {
  uint8_t* qm = nullptr;      // numel codes into map_m (signed)
  uint8_t* qv = nullptr;      // numel codes into map_v (unsigned)
  float* absmax_m = nullptr;  // num_blocks(numel)
  float* absmax_v = nullptr;
  const float* map_m = nullptr;  // 256
  const float* map_v = nullptr;
  const float* thresh_m = nullptr;  // 255
  const float* thresh_v = nullptr;
};

// Block by block: dequantize m and v, the AdamW update in f32 from them (the weights get the
// update computed from the f32 moments of this step, as bitsandbytes' blockwise kernel does),
// then requantize both with the block's new absmax. Data and gradient dtypes are template
// parameters, so that the inner loop has no dtype branch.
template <uint32_t DataDtype, uint32_t GradDtype>
inline void step_8bit_typed(const ParamRef& p, const State8& s, const Hyper& h) {
  float m[kBlock], v[kBlock];
  const uint64_t blocks = num_blocks(p.numel);
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint64_t lo = b * kBlock, n = std::min(kBlock, p.numel - lo);
    dequantize_block(s.map_m, s.qm + lo, s.absmax_m[b], n, m);
    dequantize_block(s.map_v, s.qv + lo, s.absmax_v[b], n, v);
    for (uint64_t j = 0; j < n; ++j) {
      const uint64_t i = lo + j;
      const float w = adamw(load(p.data, DataDtype, i), load(p.grad, GradDtype, i), m[j], v[j], h);
      store(p.data, DataDtype, i, w, h.round_key);
    }
    s.absmax_m[b] = quantize_block(s.map_m, s.thresh_m, m, n, s.qm + lo);
    s.absmax_v[b] = quantize_block(s.map_v, s.thresh_v, v, n, s.qv + lo);
  }
}

inline void step_8bit(const ParamRef& p, const State8& s, const Hyper& h) {
  const bool bf16_data = p.dtype == HR_DTYPE_BF16, bf16_grad = p.grad_dtype == HR_DTYPE_BF16;
  if (bf16_data && bf16_grad) return step_8bit_typed<HR_DTYPE_BF16, HR_DTYPE_BF16>(p, s, h);
  if (bf16_data) return step_8bit_typed<HR_DTYPE_BF16, HR_DTYPE_F32>(p, s, h);
  if (bf16_grad) return step_8bit_typed<HR_DTYPE_F32, HR_DTYPE_BF16>(p, s, h);
  step_8bit_typed<HR_DTYPE_F32, HR_DTYPE_F32>(p, s, h);
}

// The state bytes of one tensor of n elements (the estimate's closed form and the allocation).
inline uint64_t state_bytes(uint64_t n, uint64_t min_8bit_size) {
  if (n < min_8bit_size) return 8 * n;  // fp32 m and v
  return 2 * n + 2 * sizeof(float) * num_blocks(n);
}

// The maps' bytes: two maps of 256 f32 entries and their 255 thresholds each.
constexpr uint64_t kMapBytes = 2 * (kMapEntries + (kMapEntries - 1)) * sizeof(float);

}  // namespace adam8bit
