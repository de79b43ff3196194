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

#include "../common/bf16.h"
#include "../common/cpu_clones.h"
#include "../common/x86_intrinsics.h"
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
// (buckets() checks it): at most one threshold t lies inside the bucket. t and x share their top
// 16 bits, so t < x compares their low halves, as integers, reversed where the sign is set: on
// keys, the low 16 bits flipped where the sign is set (key(f) = bits ^ 0xFFFF for f < 0), t < x
// is key(t) < key(x) in every bucket. Each bucket's 32-bit entry holds key(t) (high 16 bits) and
// the lower code (low 16 bits); a bucket without t holds the key 0xFFFF, which no x passes. So
// the code is the entry's low half, plus one where entry < key(x) << 16 (no masking needed: the
// low half of key(x) << 16 is 0). Bitwise quantize()'s answer (tests/adam8bit_test.cpp holds
// them to it over every bucket). Infinity and NaN (exponent 255): +infinity's bucket gives 255,
// -infinity's 0, and NaN gives 0, as quantize() does.
constexpr uint32_t kBucketBits = 16;
constexpr uint32_t kBucketShift = 32 - kBucketBits;
struct Buckets {
  std::vector<uint32_t> entry;  // 2^16: key(t) << 16 | the lower code
};
using headroom_plugin::bf16::bits_f32;  // uint32 -> float, the same bits
using headroom_plugin::bf16::f32_bits;  // float -> uint32
// The low 16 bits of a float's bit pattern, flipped where its sign is set.
inline uint32_t bucket_key(uint32_t bits) {
  return (bits ^ ((bits >> 31) ? 0xFFFFu : 0u)) & 0xFFFFu;
}
// The buckets of a map's 255 thresholds. Throws std::logic_error where a bucket spans two codes
// or more (not for the two dynamic maps: Adam8bitQuant.BucketedQuantizeIsTheBinarySearch).
inline Buckets buckets(const float* thresh) {
  Buckets b;
  const uint32_t n = 1u << kBucketBits;
  b.entry.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t first = i << kBucketShift, last = first | ((1u << kBucketShift) - 1);
    const bool negative = (first >> 31) != 0;
    const uint32_t none = 0xFFFFu << 16;
    if (((first >> 23) & 0xFFu) == 0xFFu) {
      b.entry[i] = none | (negative ? 0u : kMapEntries - 1);
      continue;
    }
    const uint8_t a = quantize(thresh, bits_f32(first)), c = quantize(thresh, bits_f32(last));
    const uint32_t lo = std::min(a, c), hi = std::max(a, c);
    if (hi - lo > 1 || (hi > lo && f32_bits(thresh[lo]) >> kBucketShift != i))
      throw std::logic_error("adam8bit: a quantization bucket spans more than two codes");
    b.entry[i] = (hi > lo ? bucket_key(f32_bits(thresh[lo])) << 16 : none) | lo;
  }
  return b;
}
inline uint8_t quantize(const Buckets& b, float x) {
  const uint32_t bits = f32_bits(x);
  const uint32_t e = b.entry[bits >> kBucketShift];
  const uint32_t above = uint32_t(e < bucket_key(bits) << 16);  // t < x
  return x == x ? uint8_t((e & 0xFFFFu) + above) : uint8_t(0);  // NaN: 0
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
  const __m256i low = _mm256_set1_epi32(0xFFFF), flip = _mm256_set1_epi32(int(0x80000000u));
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i e = _mm256_i32gather_epi32(table, _mm256_srli_epi32(bits, int(kBucketShift)), 4);
    // key(x) << 16: the low half flipped where the sign is set, moved up.
    const __m256i key = _mm256_slli_epi32(_mm256_xor_si256(bits, _mm256_srai_epi32(bits, 31)), 16);
    // t < x: entry < key(x) << 16, unsigned (the entries' top bit flipped for a signed compare).
    const __m256i above =
        _mm256_cmpgt_epi32(_mm256_xor_si256(key, flip), _mm256_xor_si256(e, flip));
    __m256i pos = _mm256_sub_epi32(_mm256_and_si256(e, low), above);
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

// One block of step_8bit (elements b kBlock .. + n, n <= kBlock): dequantize m and v, the AdamW
// update in f32 from them (the weights get the update computed from the f32 moments of this
// step, as bitsandbytes' blockwise kernel does), then requantize both with the block's new
// absmax.
template <uint32_t DataDtype, uint32_t GradDtype>
inline void step_block(const ParamRef& p, const State8& s, const Hyper& h, uint64_t b) {
  float m[kBlock], v[kBlock];
  const uint64_t lo = b * kBlock, n = std::min(kBlock, p.numel - lo);
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

// The step's block on AVX-512 with VBMI (Intel Ice Lake, Sapphire Rapids and later; AMD Zen 4
// and later), where the CPU has it: one pass over a full block of 256 elements, no gather to
// dequantize. The same operations as the scalar loops, element by element, in the same order and
// without fused multiply-adds, so the same bits (Adam8bitKernel.Avx512BlockIsTheScalarBlock):
//  - dequantize: the map's 256 floats as 4 byte planes (byte k of every entry), 64 codes at a
//    time: each plane is a 256-entry byte table, two vpermi2b over its halves and a blend on the
//    code's top bit; the 4 planes are interleaved back into 64 floats (the codes permuted first,
//    so that the interleave leaves them in order);
//  - the AdamW update of adamw() on 16 lanes, the new moments kept in the block's buffers and
//    their absmax taken on the way;
//  - quantize: the bucket table of quantize(const Buckets&, float) by one 16-lane gather.
#if defined(__x86_64__) && defined(__GNUC__)
#define HR_ADAM8BIT_AVX512 1
#define HR_ADAM8BIT_AVX512_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi")))

inline bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vbmi");
  return yes;
}

// A map's 256 floats as 4 byte planes: b[k][i] is byte k (little-endian) of map[i].
struct Planes {
  alignas(64) uint8_t b[4][kMapEntries];
};
inline Planes planes_of(const float* map) {
  Planes p;
  for (uint32_t i = 0; i < kMapEntries; ++i) {
    const uint32_t bits = f32_bits(map[i]);
    for (uint32_t k = 0; k < 4; ++k)
      p.b[k][i] = uint8_t(bits >> (8 * k));
  }
  return p;
}

// 64 codes q[0..63] -> map[q] * absmax in out[0..3] (16 floats each, in order).
HR_ADAM8BIT_AVX512_TARGET inline void dequantize64(const Planes& pl, const uint8_t* q,
                                                   __m512 absmax, __m512* out) {
  // Byte 16 l + 4 c + i of the permuted codes is code 16 c + 4 l + i: the unpacks below put
  // byte 16 l + 4 c + i of the planes into float 4 l + i of out[c].
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
      22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
      56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i codes = _mm512_permutexvar_epi8(_mm512_load_si512(kOrder), _mm512_loadu_si512(q));
  const __mmask64 upper = _mm512_movepi8_mask(codes);  // codes 128..255
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const uint8_t* t = pl.b[k];
    const __m512i lo =
        _mm512_permutex2var_epi8(_mm512_load_si512(t), codes, _mm512_load_si512(t + 64));
    const __m512i hi =
        _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), codes, _mm512_load_si512(t + 192));
    b[k] = _mm512_mask_blend_epi8(upper, lo, hi);
  }
  const __m512i w01lo = _mm512_unpacklo_epi8(b[0], b[1]), w01hi = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i w23lo = _mm512_unpacklo_epi8(b[2], b[3]), w23hi = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01lo, w23lo)), absmax);
  out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01lo, w23lo)), absmax);
  out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(w01hi, w23hi)), absmax);
  out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(w01hi, w23hi)), absmax);
}

// The codes of 16 values x[0..15] times inv, quantize(const Buckets&, float)'s, in the low byte
// of each lane; no x inv may be NaN (requantize_plan sees to it).
HR_ADAM8BIT_AVX512_TARGET inline __m512i codes16(const int* table, const float* x, __m512 inv) {
  const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(x), inv));
  const __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(bits, int(kBucketShift)), table, 4);
  const __m512i key = _mm512_slli_epi32(_mm512_xor_si512(bits, _mm512_srai_epi32(bits, 31)), 16);
  return _mm512_mask_add_epi32(e, _mm512_cmplt_epu32_mask(e, key), e, _mm512_set1_epi32(1));
}

// The low bytes of codes[0..3]'s lanes into q[0..63].
HR_ADAM8BIT_AVX512_TARGET inline void store_codes64(const __m512i* codes, uint8_t* q) {
  // Byte 0 of each lane of codes[0], codes[1] into bytes 0..31, of codes[2], codes[3] into
  // bytes 32..63.
  alignas(64) static constexpr uint8_t kPack[64] = {
      0,  4,  8,  12, 16, 20, 24, 28, 32, 36,  40,  44,  48,  52,  56,  60,
      64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124,
      0,  4,  8,  12, 16, 20, 24, 28, 32, 36,  40,  44,  48,  52,  56,  60,
      64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124};
  const __m512i pack = _mm512_load_si512(kPack);
  _mm512_storeu_si512(q,
                      _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull,
                                             _mm512_permutex2var_epi8(codes[0], pack, codes[1]),
                                             _mm512_permutex2var_epi8(codes[2], pack, codes[3])));
}

// quantize(const Buckets&, float) of 64 values x[0..63] times inv into q[0..63].
HR_ADAM8BIT_AVX512_TARGET inline void quantize64(const int* table, const float* x, __m512 inv,
                                                 uint8_t* q) {
  __m512i codes[4];
  for (int k = 0; k < 4; ++k)
    codes[k] = codes16(table, x + 16 * k, inv);
  store_codes64(codes, q);
}

// quantize64 over the first multiple of 64 of n values (none NaN, none infinite after the
// scaling), returning how many it did: for the tests, against quantize().
HR_ADAM8BIT_AVX512_TARGET inline uint64_t quantize_avx512(const Buckets& b, const float* x,
                                                          float inv, uint64_t n, uint8_t* q) {
  alignas(64) float in[64];
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    std::memcpy(in, x + i, sizeof in);
    quantize64(reinterpret_cast<const int*>(b.entry.data()), in, _mm512_set1_ps(inv), q + i);
  }
  return i;
}

// How a full block's requantization goes, from the largest bit pattern of its values with the
// sign cleared: on quantize64 (the common case: fast, with inv = 1 / absmax), or done here (all
// zero: the zero code; infinity or NaN in it, or an absmax whose reciprocal overflows:
// quantize_block(), as the scalar step does). Returns whether quantize64 is to do it.
HR_ADAM8BIT_AVX512_TARGET inline bool requantize_plan(const float* map, const Buckets& b,
                                                      const float* x, uint32_t absmax_bits,
                                                      uint8_t* q, float* absmax, float* inv) {
  *absmax = bits_f32(absmax_bits);
  if (absmax_bits == 0) {
    std::memset(q, zero_code(map), kBlock);
    *absmax = 0.0f;
    return false;
  }
  *inv = 1.0f / *absmax;
  if (absmax_bits < 0x7F800000u && *inv < std::numeric_limits<float>::infinity()) return true;
  *absmax = quantize_block(map, b, x, kBlock, q);
  return false;
}

// What the update of a run of full blocks shares.
struct Avx512Step {
  const Planes* pm;
  const Planes* pv;
  const int* table_m;  // buckets_m's entries
  const int* table_v;
};

// How far ahead update64 prefetches the weights and gradients (a prefetch never faults, past the
// end of an array included).
constexpr uint64_t kPrefetchBytes = 4096;

// 64 values of the previous block to requantize alongside (where qm, qv are set): its m, v and
// the reciprocals of their absmax, and where their codes go.
struct Requant {
  const float* m = nullptr;
  const float* v = nullptr;
  __m512 inv_m, inv_v;
  uint8_t* qm = nullptr;
  uint8_t* qv = nullptr;
};

// 64 elements of a full block (i: the first's index, c: its offset in the block): dequantize m and
// v, adamw() on 16 lanes at a time, the weights stored, the new moments into m[c..], v[c..], the
// largest |m|, |v| bit patterns into mmax, vmax.
template <uint32_t DataDtype, uint32_t GradDtype>
HR_ADAM8BIT_AVX512_TARGET inline void update64(const ParamRef& p, const State8& s, const Hyper& h,
                                               const Avx512Step& a, uint64_t i, __m512 am,
                                               __m512 av, float* m, float* v, float* w,
                                               __m512i& mmax, __m512i& vmax, const Requant& r) {
  const __m512 beta1 = _mm512_set1_ps(h.beta1), take1 = _mm512_set1_ps(1.0f - h.beta1);
  const __m512 beta2 = _mm512_set1_ps(h.beta2), take2 = _mm512_set1_ps(1.0f - h.beta2);
  const __m512 bc1 = _mm512_set1_ps(h.bias_correction1), bc2 = _mm512_set1_ps(h.bias_correction2);
  const __m512 lr = _mm512_set1_ps(h.lr), eps = _mm512_set1_ps(h.eps);
  const __m512 wd = _mm512_set1_ps(h.weight_decay);
  const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 mv[4], vv[4];
  __m512i codes_m[4], codes_v[4];
  // The streams kPrefetchBytes ahead (the codes a quarter of that): the hardware prefetcher alone
  // left the step under the memory bandwidth AdamW's update reaches (measured on 16M elements,
  // one thread: 1.05-1.1 times AdamW's time without, 0.8-0.95 with).
  constexpr uint64_t kData = DataDtype == HR_DTYPE_BF16 ? 2 : 4;
  constexpr uint64_t kGrad = GradDtype == HR_DTYPE_BF16 ? 2 : 4;
  for (uint64_t l = 0; l < 64 * kData; l += 64)
    _mm_prefetch(static_cast<const char*>(p.data) + i * kData + kPrefetchBytes + l, _MM_HINT_T0);
  for (uint64_t l = 0; l < 64 * kGrad; l += 64)
    _mm_prefetch(static_cast<const char*>(p.grad) + i * kGrad + kPrefetchBytes + l, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s.qm + i) + kPrefetchBytes / 4, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(s.qv + i) + kPrefetchBytes / 4, _MM_HINT_T0);
  dequantize64(*a.pm, s.qm + i, am, mv);
  dequantize64(*a.pv, s.qv + i, av, vv);
  for (uint64_t k = 0; k < 4; ++k) {
    const uint64_t e = i + 16 * k;
    __m512 param, grad;
    if constexpr (DataDtype == HR_DTYPE_BF16) {
      param = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.data) + e))),
          16));
    } else {
      param = _mm512_loadu_ps(static_cast<const float*>(p.data) + e);
    }
    if constexpr (GradDtype == HR_DTYPE_BF16) {
      grad = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.grad) + e))),
          16));
    } else {
      grad = _mm512_loadu_ps(static_cast<const float*>(p.grad) + e);
    }
    // adamw(), operation by operation.
    const __m512 mn = _mm512_add_ps(_mm512_mul_ps(beta1, mv[k]), _mm512_mul_ps(take1, grad));
    const __m512 vn =
        _mm512_add_ps(_mm512_mul_ps(beta2, vv[k]), _mm512_mul_ps(_mm512_mul_ps(take2, grad), grad));
    const __m512 mhat = _mm512_div_ps(mn, bc1), vhat = _mm512_div_ps(vn, bc2);
    const __m512 step = _mm512_add_ps(_mm512_div_ps(mhat, _mm512_add_ps(_mm512_sqrt_ps(vhat), eps)),
                                      _mm512_mul_ps(wd, param));
    const __m512 out = _mm512_sub_ps(param, _mm512_mul_ps(lr, step));
    if constexpr (DataDtype == HR_DTYPE_BF16) {
      _mm512_store_ps(w + 16 * k, out);
    } else {
      _mm512_storeu_ps(static_cast<float*>(p.data) + e, out);
    }
    _mm512_store_ps(m + 16 * k, mn);
    _mm512_store_ps(v + 16 * k, vn);
    mmax = _mm512_max_epu32(mmax, _mm512_and_si512(_mm512_castps_si512(mn), abs));
    vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(vn), abs));
    if (r.qm) codes_m[k] = codes16(a.table_m, r.m + 16 * k, r.inv_m);
    if (r.qv) codes_v[k] = codes16(a.table_v, r.v + 16 * k, r.inv_v);
  }
  if (r.qm) store_codes64(codes_m, r.qm);
  if (r.qv) store_codes64(codes_v, r.qv);
}

// Full blocks b0 .. b1 - 1 of step_8bit: each dequantized and updated, then requantized. The
// requantization of a block waits for its absmax, that is for the whole update; it is done
// interleaved with the next block's update, 64 elements of each in turn, so that the one's
// table lookups overlap the other's divisions (the update alone is bound by the divider).
template <uint32_t DataDtype, uint32_t GradDtype>
HR_ADAM8BIT_AVX512_TARGET void step_blocks_avx512(const ParamRef& p, const State8& s,
                                                  const Hyper& h, const Avx512Step& a, uint64_t b0,
                                                  uint64_t b1) {
  alignas(64) float m[2][kBlock], v[2][kBlock], w[kBlock];
  bool fast_m = false, fast_v = false;  // the previous block's requantization by quantize64
  float inv_m = 0.0f, inv_v = 0.0f;
  for (uint64_t b = b0; b <= b1; ++b) {
    const uint64_t cur = b & 1, prev = cur ^ 1, lo = b * kBlock, before = lo - kBlock;
    if (b < b1) {
      const __m512 am = _mm512_set1_ps(s.absmax_m[b]), av = _mm512_set1_ps(s.absmax_v[b]);
      __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512();
      for (uint64_t c = 0; c < kBlock; c += 64) {
        Requant r;
        r.m = m[prev] + c;
        r.v = v[prev] + c;
        r.inv_m = _mm512_set1_ps(inv_m);
        r.inv_v = _mm512_set1_ps(inv_v);
        r.qm = fast_m ? s.qm + before + c : nullptr;
        r.qv = fast_v ? s.qv + before + c : nullptr;
        update64<DataDtype, GradDtype>(p, s, h, a, lo + c, am, av, m[cur] + c, v[cur] + c, w + c,
                                       mmax, vmax, r);
      }
      if constexpr (DataDtype == HR_DTYPE_BF16) {
        for (uint64_t j = 0; j < kBlock; ++j)
          store(p.data, DataDtype, lo + j, w[j], h.round_key);
      }
      fast_m = requantize_plan(s.map_m, *s.buckets_m, m[cur], _mm512_reduce_max_epu32(mmax),
                               s.qm + lo, s.absmax_m + b, &inv_m);
      fast_v = requantize_plan(s.map_v, *s.buckets_v, v[cur], _mm512_reduce_max_epu32(vmax),
                               s.qv + lo, s.absmax_v + b, &inv_v);
    } else {
      for (uint64_t c = 0; c < kBlock; c += 64) {
        if (fast_m) quantize64(a.table_m, m[prev] + c, _mm512_set1_ps(inv_m), s.qm + before + c);
        if (fast_v) quantize64(a.table_v, v[prev] + c, _mm512_set1_ps(inv_v), s.qv + before + c);
      }
    }
  }
}
#endif

// Block by block (step_block). Data and gradient dtypes are template parameters, so that the
// inner loops have no dtype branch and vectorize (for AVX-512, AVX2 and the baseline:
// HR_PLUGIN_CPU_CLONES, the same bits on each; full blocks by step_blocks_avx512 where the CPU has
// AVX-512 VBMI). Blocks are independent: they run on the OpenMP threads the host's kernels use
// ([device] threads), each element computed as one thread alone would (bf16 rounding keyed by the
// element's index), so any thread count gives the same bits.
template <uint32_t DataDtype, uint32_t GradDtype>
HR_PLUGIN_CPU_CLONES void step_8bit_typed(const ParamRef& p, const State8& s, const Hyper& h) {
  const int64_t blocks = int64_t(num_blocks(p.numel));
#ifdef HR_ADAM8BIT_AVX512
  if (have_avx512()) {
    const Planes pm = planes_of(s.map_m), pv = planes_of(s.map_v);
    const Avx512Step a{&pm, &pv, reinterpret_cast<const int*>(s.buckets_m->entry.data()),
                       reinterpret_cast<const int*>(s.buckets_v->entry.data())};
    // Runs of kRun full blocks (the requantization interleaved inside a run), then the partial
    // last block.
    constexpr int64_t kRun = 64;
    const int64_t full = int64_t(p.numel / kBlock), runs = (full + kRun - 1) / kRun;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < runs; ++r)
      step_blocks_avx512<DataDtype, GradDtype>(p, s, h, a, uint64_t(r * kRun),
                                               uint64_t(std::min(full, (r + 1) * kRun)));
    if (full < blocks) step_block<DataDtype, GradDtype>(p, s, h, uint64_t(full));
    return;
  }
#endif
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    step_block<DataDtype, GradDtype>(p, s, h, uint64_t(b));
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
