// Quantizing a frozen weight once, on the host (the exact reference), and dequantizing it into a
// compute-dtype transient before each GEMM that reads it (the CPU backend's op; CUDA's is
// kernels/cuda/quant.cu). The layout, the tables and the per-element math are
// kernels/common/quant.h's.
//
// How the codes are chosen, against bitsandbytes 0.50 (tests/quant_test.cpp checks both):
//   - NF4 as its quantize_4bit: absmax per block of 64, x · (1 / absmax) clamped to [-1, 1], the
//     code whose interval between the f32 midpoints of the table holds it (a value on a midpoint
//     takes the lower code: torch.bucketize's rule). The same codes and absmaxes, bit for bit.
//   - 8-bit: absmax per block of 256 and the nearest value of the dynamic map to x / absmax (the
//     lower on a tie). bitsandbytes' CPU library picks a neighbour of the nearest for ~0.15% of
//     elements; the nearest is never worse, and the dequantization is the same function.
//   - double quantization (compress_statistics): the absmaxes less their mean (in f64, rounded to
//     f32; torch's f32 mean may differ in the last bit), 8-bit quantized as above in blocks of 256.
//   - a block of zeros stores absmax 0 and the code of 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/common/quant.h"
#include "kernels/cpu/parallel.h"

namespace headroom::cpu {

// The index of the value of `map` (n ascending) nearest to v; the lower one on a tie.
inline unsigned char nearest_code(const float* map, int n, float v) {
  const float* hi = std::lower_bound(map, map + n, v);  // first >= v
  if (hi == map) return 0;
  if (hi == map + n) return static_cast<unsigned char>(n - 1);
  const float* lo = hi - 1;
  return static_cast<unsigned char>((v - *lo <= *hi - v) ? lo - map : hi - map);
}

// x (n) blockwise into the dynamic map's codes (n) with one absmax a block of `block` (f32).
inline void quantize_dynamic(const float* x, uint64_t n, uint64_t block, unsigned char* codes,
                             float* absmax) {
  const DynamicMap dyn = dynamic_map();
  const uint64_t blocks = (n + block - 1) / block;
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (int64_t b = 0; b < int64_t(blocks); ++b) {
    const uint64_t i0 = uint64_t(b) * block, i1 = std::min(n, i0 + block);
    float a = 0;
    for (uint64_t i = i0; i < i1; ++i)
      a = std::max(a, std::fabs(x[i]));
    absmax[b] = a;
    for (uint64_t i = i0; i < i1; ++i)
      codes[i] = a == 0 ? 127 : nearest_code(dyn.v, 256, std::clamp(x[i] / a, -1.0f, 1.0f));
  }
}

// x (n) f32 -> the bytes of one quantized tensor (quant_layout(k, n, double_quant).bytes, the
// padding zero).
inline void quantize_tensor(QuantKind k, const float* x, uint64_t n, bool double_quant,
                            unsigned char* out) {
  const QuantLayout l = quant_layout(k, n, double_quant);
  std::memset(out, 0, l.bytes);
  if (k == QuantKind::kBF16) {
    for (uint64_t i = 0; i < n; ++i) {
      const uint16_t h = float_to_bf16(x[i]);
      std::memcpy(out + 2 * i, &h, 2);
    }
    return;
  }
  std::vector<float> absmax(l.blocks);
  if (k == QuantKind::kInt8) {
    quantize_dynamic(x, n, kInt8Block, out + l.codes, absmax.data());
  } else {
    const Nf4Table t = nf4_table();
    float mid[15];
    for (int j = 0; j < 15; ++j)
      mid[j] = (t.v[j] + t.v[j + 1]) / 2;  // f32, as bitsandbytes' bounds
    unsigned char* codes = out + l.codes;
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
    for (int64_t b = 0; b < int64_t(l.blocks); ++b) {
      const uint64_t i0 = uint64_t(b) * kNf4Block, i1 = std::min(n, i0 + kNf4Block);
      float a = 0;
      for (uint64_t i = i0; i < i1; ++i)
        a = std::max(a, std::fabs(x[i]));
      absmax[size_t(b)] = a;
      const float inv = 1.0f / std::max(a, 1e-38f);
      for (uint64_t i = i0; i < i1; ++i) {
        const float s = std::clamp(x[i] * inv, -1.0f, 1.0f);
        // bucketize: the number of bounds strictly below s.
        const unsigned char c =
            static_cast<unsigned char>(std::lower_bound(mid, mid + 15, s) - mid);
        // Two codes a byte, the earlier element high; each block starts on a byte (64 is even).
        if ((i & 1) == 0) {
          codes[i / 2] = static_cast<unsigned char>(c << 4);
        } else {
          codes[i / 2] = static_cast<unsigned char>(codes[i / 2] | c);
        }
      }
    }
  }
  if (!double_quant) {
    std::memcpy(out + l.absmax, absmax.data(), 4 * l.blocks);
    return;
  }
  double sum = 0;
  for (float a : absmax)
    sum += a;
  const float mean = l.blocks ? float(sum / double(l.blocks)) : 0.0f;
  std::vector<float> centred(l.blocks), scales(l.stat_blocks);
  for (uint64_t b = 0; b < l.blocks; ++b)
    centred[b] = absmax[b] - mean;
  quantize_dynamic(centred.data(), l.blocks, kStatBlock, out + l.acodes, scales.data());
  std::memcpy(out + l.scales, scales.data(), 4 * l.stat_blocks);
  std::memcpy(out + l.scales + 4 * l.stat_blocks, &mean, 4);
}

// One quantized tensor's bytes `q` -> out (n) in the compute dtype, each element rounded once
// from its f32 value (`store` writes one: f32 as is, bf16/f16 to nearest even).
template <class Store>
inline void dequantize_tensor(QuantKind k, const unsigned char* q, uint64_t n, bool double_quant,
                              Store store) {
  const QuantLayout l = quant_layout(k, n, double_quant);
  const Nf4Table t = nf4_table();
  const DynamicMap dyn = dynamic_map();
  if (k == QuantKind::kBF16) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
    for (int64_t i = 0; i < int64_t(n); ++i)
      store(uint64_t(i), quant_element(k, q, l, double_quant, t.v, dyn.v, uint64_t(i)));
    return;
  }
  // Block by block: its absmax once, then its codes (the loop the compiler vectorizes).
  const uint64_t block = quant_block(k);
#pragma omp parallel for schedule(static) num_threads(threads_for(n))
  for (int64_t b = 0; b < int64_t(l.blocks); ++b) {
    const float a = quant_absmax(q, l, double_quant, dyn.v, uint64_t(b));
    const uint64_t i0 = uint64_t(b) * block, i1 = std::min(n, i0 + block);
    if (k == QuantKind::kNF4) {
      for (uint64_t i = i0; i < i1; ++i) {
        const unsigned char byte = q[l.codes + i / 2];
        store(i, t.v[(i & 1) ? (byte & 0xF) : (byte >> 4)] * a);
      }
    } else {
      for (uint64_t i = i0; i < i1; ++i)
        store(i, dyn.v[q[l.codes + i]] * a);
    }
  }
}

}  // namespace headroom::cpu
