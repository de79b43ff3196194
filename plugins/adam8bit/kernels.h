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
#include <limits>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "../common/bf16.h"
#include "../common/cpu_clones.h"
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

// quantize() in one table load instead of 8 dependent ones, in a form that vectorizes (one
// gather): floats fall into buckets by their top 16 bits (sign, exponent, the mantissa's top 7
// bits). The number of thresholds below x never falls as x grows, so x's code lies between the
// codes of its bucket's smallest and largest value, which for these maps differ by at most one
// (buckets() checks it): at most one threshold t lies inside the bucket. Each bucket's 32-bit
// entry holds the lower code (high 16 bits) and t's low 16 bits: t and x share their top 16
// bits, so t < x compares the low halves, as integers (reversed where the sign is set). A bucket
// without t holds low bits no x passes (0xFFFF positive, 0 negative). Bitwise quantize()'s answer
// (tests/adam8bit_test.cpp holds them to it over every bucket). Infinity and NaN (exponent 255):
// +infinity's bucket gives 255, -infinity's 0, and NaN gives 0, as quantize() does.
constexpr uint32_t kBucketBits = 16;
constexpr uint32_t kBucketShift = 32 - kBucketBits;
struct Buckets {
  std::vector<uint32_t> entry;  // 2^16: lower code << 16 | the low 16 bits of t
};
using headroom_plugin::bf16::bits_f32;  // uint32 -> float, the same bits
using headroom_plugin::bf16::f32_bits;  // float -> uint32
// The buckets of a map's 255 thresholds. Throws std::logic_error where a bucket spans two codes
// or more (not for the two dynamic maps: Adam8bitQuant.BucketedQuantizeIsTheBinarySearch).
inline Buckets buckets(const float* thresh) {
  Buckets b;
  const uint32_t n = 1u << kBucketBits;
  b.entry.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t first = i << kBucketShift, last = first | ((1u << kBucketShift) - 1);
    const bool negative = (first >> 31) != 0;
    const uint32_t none = negative ? 0u : 0xFFFFu;
    if (((first >> 23) & 0xFFu) == 0xFFu) {
      b.entry[i] = (negative ? 0u : kMapEntries - 1) << 16 | none;
      continue;
    }
    const uint8_t a = quantize(thresh, bits_f32(first)), c = quantize(thresh, bits_f32(last));
    const uint32_t lo = std::min(a, c), hi = std::max(a, c);
    if (hi - lo > 1 || (hi > lo && f32_bits(thresh[lo]) >> kBucketShift != i))
      throw std::logic_error("adam8bit: a quantization bucket spans more than two codes");
    b.entry[i] = lo << 16 | (hi > lo ? f32_bits(thresh[lo]) & 0xFFFFu : none);
  }
  return b;
}
inline uint8_t quantize(const Buckets& b, float x) {
  const uint32_t bits = f32_bits(x);
  const uint32_t e = b.entry[bits >> kBucketShift];
  const uint32_t t = e & 0xFFFFu, xl = bits & 0xFFFFu;
  const uint32_t above = (bits >> 31) ? uint32_t(t > xl) : uint32_t(t < xl);  // t < x
  return x == x ? uint8_t((e >> 16) + above) : uint8_t(0);                    // NaN: 0
}

// The block's loops with AVX2's gathers (the compiler does not vectorize a table lookup): the
// same operations on 8 lanes, so the same bits as the scalar loops below, which do the tails and
// run where the CPU has no AVX2.
#if defined(__x86_64__) && defined(__GNUC__)
#define HR_ADAM8BIT_AVX2 1
__attribute__((target("avx2"))) inline uint64_t quantize_avx2(const Buckets& b, const float* x,
                                                              float inv, uint64_t n, uint8_t* q) {
  const int* table = reinterpret_cast<const int*>(b.entry.data());
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i e = _mm256_i32gather_epi32(table, _mm256_srli_epi32(bits, int(kBucketShift)), 4);
    const __m256i t = _mm256_and_si256(e, low), xl = _mm256_and_si256(bits, low);
    const __m256i negative = _mm256_srai_epi32(bits, 31);  // all ones where the sign is set
    const __m256i above = _mm256_blendv_epi8(_mm256_cmpgt_epi32(xl, t), _mm256_cmpgt_epi32(t, xl),
                                             negative);  // all ones where t < x
    __m256i pos = _mm256_sub_epi32(_mm256_srli_epi32(e, 16), above);
    pos = _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)), pos);
    const __m128i p16 =
        _mm_packus_epi32(_mm256_castsi256_si128(pos), _mm256_extracti128_si256(pos, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packus_epi16(p16, p16));
  }
  return i;
}
__attribute__((target("avx2"))) inline uint64_t dequantize_avx2(const float* map, const uint8_t* q,
                                                                float absmax, uint64_t n,
                                                                float* x) {
  const __m256 a = _mm256_set1_ps(absmax);
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i idx =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_i32gather_ps(map, idx, 4), a));
  }
  return i;
}
// The largest of the bit patterns |x| (NaN as 0) over the first multiple of 8 of n values.
__attribute__((target("avx2"))) inline uint32_t absmax_bits_avx2(const float* x, uint64_t n) {
  const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  __m256i m = _mm256_setzero_si256();
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    const __m256i bits =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), abs);
    m = _mm256_max_epu32(m, _mm256_andnot_si256(_mm256_cmpgt_epi32(bits, inf), bits));
  }
  uint32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t r = 0;
  for (const uint32_t l : lanes)
    r = std::max(r, l);
  return r;
}
inline bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

// The largest |x[i]| of n values, NaN left out (as std::max(absmax, |x|) leaves it): on the bit
// patterns, where the order of non-negative floats is the integers'.
inline float absmax_of(const float* x, uint64_t n) {
  uint32_t m = 0;
  uint64_t i = 0;
#ifdef HR_ADAM8BIT_AVX2
  if (have_avx2()) {
    m = absmax_bits_avx2(x, n);
    i = n / 8 * 8;
  }
#endif
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    bits &= 0x7FFFFFFFu;
    m = std::max(m, bits > 0x7F800000u ? 0u : bits);
  }
  return bits_f32(m);
}

// Quantizes n <= kBlock values of one block into q[], returning the block's absmax.
inline float quantize_block(const float* map, const Buckets& buckets, const float* x, uint64_t n,
                            uint8_t* q) {
  const float absmax = absmax_of(x, n);
  if (!(absmax > 0.0f)) {
    const uint8_t zq = zero_code(map);
    for (uint64_t i = 0; i < n; ++i)
      q[i] = zq;
    return 0.0f;
  }
  const float inv = 1.0f / absmax;
  uint64_t i = 0;
#ifdef HR_ADAM8BIT_AVX2
  if (have_avx2()) i = quantize_avx2(buckets, x, inv, n, q);
#endif
  for (; i < n; ++i)
    q[i] = quantize(buckets, x[i] * inv);
  return absmax;
}

inline void dequantize_block(const float* map, const uint8_t* q, float absmax, uint64_t n,
                             float* x) {
  uint64_t i = 0;
#ifdef HR_ADAM8BIT_AVX2
  if (have_avx2()) i = dequantize_avx2(map, q, absmax, n, x);
#endif
  for (; i < n; ++i)
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
  const int64_t n = int64_t(p.numel);
  // Under 2^14 elements (the default min_8bit_size is 4096) waking the threads costs more.
#pragma omp parallel for schedule(static) if (n >= (int64_t(1) << 14))
  for (int64_t i = 0; i < n; ++i) {
    const float w = adamw(load(p.data, p.dtype, i), load(p.grad, p.grad_dtype, i), m[i], v[i], h);
    store(p.data, p.dtype, i, w, h.round_key);
  }
}

// The 8-bit state of one tensor: codes and per-block absmax for each moment, and the maps (with
// their thresholds and buckets) they index.
struct State8 {
  uint8_t* qm = nullptr;      // numel codes into map_m (signed)
  uint8_t* qv = nullptr;      // numel codes into map_v (unsigned)
  float* absmax_m = nullptr;  // num_blocks(numel)
  float* absmax_v = nullptr;
  const float* map_m = nullptr;  // 256
  const float* map_v = nullptr;
  const Buckets* buckets_m = nullptr;  // buckets(thresholds(map_m))
  const Buckets* buckets_v = nullptr;
};

// Block by block: dequantize m and v, the AdamW update in f32 from them (the weights get the
// update computed from the f32 moments of this step, as bitsandbytes' blockwise kernel does),
// then requantize both with the block's new absmax. Data and gradient dtypes are template
// parameters, so that the inner loops have no dtype branch and vectorize (for AVX-512, AVX2 and the
// baseline: HR_PLUGIN_CPU_CLONES, the same bits on each). Blocks are independent:
// they run on the OpenMP threads the host's kernels use ([device] threads), each element computed
// as one thread alone would (bf16 rounding keyed by the element's index), so any thread count
// gives the same bits.
template <uint32_t DataDtype, uint32_t GradDtype>
HR_PLUGIN_CPU_CLONES void step_8bit_typed(const ParamRef& p, const State8& s, const Hyper& h) {
  const int64_t blocks = int64_t(num_blocks(p.numel));
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    float m[kBlock], v[kBlock];
    const uint64_t lo = uint64_t(b) * kBlock, n = std::min(kBlock, p.numel - lo);
    dequantize_block(s.map_m, s.qm + lo, s.absmax_m[b], n, m);
    dequantize_block(s.map_v, s.qv + lo, s.absmax_v[b], n, v);
    for (uint64_t j = 0; j < n; ++j) {
      const float w =
          adamw(load(p.data, DataDtype, lo + j), load(p.grad, GradDtype, lo + j), m[j], v[j], h);
      store(p.data, DataDtype, lo + j, w, h.round_key);
    }
    s.absmax_m[b] = quantize_block(s.map_m, *s.buckets_m, m, n, s.qm + lo);
    s.absmax_v[b] = quantize_block(s.map_v, *s.buckets_v, v, n, s.qv + lo);
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
