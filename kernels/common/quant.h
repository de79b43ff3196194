// Quantized storage of frozen weights (QLoRA, Dettmers et al. 2023), as bitsandbytes stores them:
// block-wise absmax quantization — NF4 (4-bit normal-float codes, blocks of 64) and 8-bit codes of
// bitsandbytes' dynamic map (blocks of 256) — with the block absmaxes optionally quantized again
// (double quantization: bitsandbytes' compress_statistics), and plain bf16. One layout, the tables
// and the dequantization of one element, shared by the CPU reference (kernels/cpu/quant.h) and the
// CUDA kernel (kernels/cuda/quant.cu), and the byte count the planner sums (quant_tensor_bytes).
//
// One tensor of n elements, in row-major order of its shape, at a 16-byte aligned offset:
//   bf16:              u16 values (n)
//   nf4 / int8:        f32 absmax (nb)                       | codes | padding to 16 bytes
//   ... double_quant:  f32 scales (ns), f32 mean (1)         | codes | u8 absmax codes (nb)
// nb = ceil(n / block) blocks, ns = ceil(nb / 256). nf4 packs two codes a byte, the earlier
// element in the high nibble (bitsandbytes' order); int8 codes index the dynamic map. The f32 parts
// come first so that every f32 is aligned.
#pragma once

#include <stdint.h>

#include "kernels/common/dtype.h"

namespace headroom {

enum class QuantKind : uint32_t { kNone = 0, kBF16 = 1, kInt8 = 2, kNF4 = 3 };

// bitsandbytes' blocks: 64 for NF4 (QLoRA's), 256 for the 8-bit codes (its quantize_blockwise
// with blocksize=256, the size its optimizers use) and for the absmaxes' second quantization.
constexpr uint64_t kNf4Block = 64;
constexpr uint64_t kInt8Block = 256;
constexpr uint64_t kStatBlock = 256;

HR_HD inline uint64_t quant_block(QuantKind k) {
  return k == QuantKind::kNF4 ? kNf4Block : kInt8Block;
}

// Where the parts of one quantized tensor are, in bytes from its start.
struct QuantLayout {
  uint64_t n = 0, blocks = 0, stat_blocks = 0;
  uint64_t absmax = 0;  // f32 (blocks), without double quantization
  uint64_t scales = 0;  // f32 (stat_blocks) then the mean (1), with it
  uint64_t codes = 0;   // u8: n (int8) or ceil(n / 2) (nf4)
  uint64_t acodes = 0;  // u8 (blocks), with double quantization
  uint64_t bytes = 0;   // the whole, a multiple of 16
};

HR_HD inline QuantLayout quant_layout(QuantKind k, uint64_t n, bool double_quant) {
  QuantLayout l;
  l.n = n;
  uint64_t end = 0;
  if (k == QuantKind::kBF16) {
    end = 2 * n;
  } else if (k == QuantKind::kNF4 || k == QuantKind::kInt8) {
    const uint64_t code_bytes = k == QuantKind::kNF4 ? (n + 1) / 2 : n;
    l.blocks = (n + quant_block(k) - 1) / quant_block(k);
    if (double_quant) {
      l.stat_blocks = (l.blocks + kStatBlock - 1) / kStatBlock;
      l.scales = 0;
      l.codes = 4 * (l.stat_blocks + 1);
      l.acodes = l.codes + code_bytes;
      end = l.acodes + l.blocks;
    } else {
      l.absmax = 0;
      l.codes = 4 * l.blocks;
      end = l.codes + code_bytes;
    }
  }
  l.bytes = (end + 15) / 16 * 16;
  return l;
}

// The bytes one tensor of n elements takes: the planner's closed form sums these.
HR_HD inline uint64_t quant_tensor_bytes(QuantKind k, uint64_t n, bool double_quant) {
  return quant_layout(k, n, double_quant).bytes;
}

// NF4's 16 values (bitsandbytes' get_4bit_type("nf4")): quantiles of N(0, 1) scaled to [-1, 1],
// with an exact zero.
struct Nf4Table {
  float v[16];
};
HR_HD inline Nf4Table nf4_table() {
  return {{-0x1.0p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f, -0x1.23449ap-2f,
           -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f, 0x1.45f5fep-4f, 0x1.4995c6p-3f, 0x1.f809bap-3f,
           0x1.5a0674p-2f, 0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f, 0x1.0p+0f}};
}

// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True): a dynamic exponent and
// fraction, Dettmers 2016), its 256 values ascending, from -0.99297 to 1.0 with one zero. Its
// quantize_blockwise's default code, for the int8 weights and the absmaxes' second quantization.
struct DynamicMap {
  float v[256];
};
HR_HD inline DynamicMap dynamic_map() {
  // The 127 positive values below 1 (ascending); the negative ones are their negations, and the
  // map is [-p(126) .. -p(0), 0, p(0) .. p(126), 1].
  const float p[127] = {
      0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f, 0x1.6f0068p-15f,
      0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f, 0x1.19ce0ap-12f, 0x1.8fc506p-12f,
      0x1.02de02p-11f, 0x1.3dd982p-11f, 0x1.78d5p-11f,   0x1.b3d07cp-11f, 0x1.eecbfep-11f,
      0x1.4fdf3ap-10f, 0x1.e353f8p-10f, 0x1.3b645ap-9f,  0x1.851eb8p-9f,  0x1.ced914p-9f,
      0x1.0c49bap-8f,  0x1.3126e8p-8f,  0x1.56041ap-8f,  0x1.7ae148p-8f,  0x1.9fbe76p-8f,
      0x1.c49ba6p-8f,  0x1.e978d4p-8f,  0x1.072b02p-7f,  0x1.19999ap-7f,  0x1.2c083p-7f,
      0x1.3e76c8p-7f,  0x1.75c29p-7f,   0x1.d1eb86p-7f,  0x1.170a3ep-6f,  0x1.451ebap-6f,
      0x1.733334p-6f,  0x1.a147aep-6f,  0x1.cf5c2ap-6f,  0x1.fd70a4p-6f,  0x1.15c29p-5f,
      0x1.2ccccep-5f,  0x1.43d70ap-5f,  0x1.5ae146p-5f,  0x1.71eb86p-5f,  0x1.88f5c2p-5f,
      0x1.ap-5f,       0x1.b70a3ep-5f,  0x1.ce147ap-5f,  0x1.e51ebap-5f,  0x1.fc28f6p-5f,
      0x1.09999ap-4f,  0x1.151ebap-4f,  0x1.20a3d6p-4f,  0x1.2c28f6p-4f,  0x1.37ae14p-4f,
      0x1.433334p-4f,  0x1.4eb854p-4f,  0x1.5a3d7p-4f,   0x1.65c29p-4f,   0x1.7147aep-4f,
      0x1.7ccccep-4f,  0x1.8851eep-4f,  0x1.93d70ap-4f,  0x1.b66668p-4f,  0x1.fp-4f,
      0x1.14ccccp-3f,  0x1.31999ap-3f,  0x1.4e6666p-3f,  0x1.6b3334p-3f,  0x1.88p-3f,
      0x1.a4ccccp-3f,  0x1.c1999ap-3f,  0x1.de6666p-3f,  0x1.fb3332p-3f,  0x1.0cp-2f,
      0x1.1a6668p-2f,  0x1.28ccccp-2f,  0x1.373334p-2f,  0x1.459998p-2f,  0x1.54p-2f,
      0x1.626666p-2f,  0x1.70ccccp-2f,  0x1.7f3334p-2f,  0x1.8d9998p-2f,  0x1.9cp-2f,
      0x1.aa6666p-2f,  0x1.b8ccccp-2f,  0x1.c73334p-2f,  0x1.d59998p-2f,  0x1.e4p-2f,
      0x1.f26664p-2f,  0x1.006666p-1f,  0x1.079998p-1f,  0x1.0eccccp-1f,  0x1.16p-1f,
      0x1.1d3334p-1f,  0x1.246668p-1f,  0x1.2b999ap-1f,  0x1.32ccccp-1f,  0x1.3ap-1f,
      0x1.413334p-1f,  0x1.486668p-1f,  0x1.4f999ap-1f,  0x1.56ccccp-1f,  0x1.5ep-1f,
      0x1.653334p-1f,  0x1.6c6668p-1f,  0x1.73999ap-1f,  0x1.7accccp-1f,  0x1.82p-1f,
      0x1.893334p-1f,  0x1.906666p-1f,  0x1.97999ap-1f,  0x1.9eccccp-1f,  0x1.a6p-1f,
      0x1.ad3334p-1f,  0x1.b46666p-1f,  0x1.bb999ap-1f,  0x1.c2ccccp-1f,  0x1.cap-1f,
      0x1.d13334p-1f,  0x1.d86666p-1f,  0x1.df999ap-1f,  0x1.e6ccccp-1f,  0x1.eep-1f,
      0x1.f53334p-1f,  0x1.fc6666p-1f};
  DynamicMap m;
  for (int i = 0; i < 127; ++i) {
    m.v[126 - i] = -p[i];
    m.v[128 + i] = p[i];
  }
  m.v[127] = 0.0f;
  m.v[255] = 1.0f;
  return m;
}

// Block b's absmax (f32), read from a tensor's bytes `q` laid out as `l`.
HR_HD inline float quant_absmax(const unsigned char* q, const QuantLayout& l, bool double_quant,
                                const float* dyn, uint64_t b) {
  if (!double_quant) {
    float a;
    memcpy(&a, q + l.absmax + 4 * b, 4);
    return a;
  }
  // bitsandbytes: dequantize_blockwise(qabsmax, state2) + offset, each an f32 operation.
  float scale, mean;
  memcpy(&scale, q + l.scales + 4 * (b / kStatBlock), 4);
  memcpy(&mean, q + l.scales + 4 * l.stat_blocks, 4);
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(dyn[q[l.acodes + b]], scale), mean);  // no fused multiply-add
#else
  return dyn[q[l.acodes + b]] * scale + mean;  // the CPU kernels build with -ffp-contract=off
#endif
}

// Element i of a quantized tensor, as f32: code value times its block's absmax (bf16: widened).
HR_HD inline float quant_element(QuantKind k, const unsigned char* q, const QuantLayout& l,
                                 bool double_quant, const float* nf4, const float* dyn,
                                 uint64_t i) {
  if (k == QuantKind::kBF16) {
    uint16_t h;
    memcpy(&h, q + 2 * i, 2);
    return bf16_to_float(h);
  }
  const float a = quant_absmax(q, l, double_quant, dyn, i / quant_block(k));
  if (k == QuantKind::kNF4) {
    const unsigned char byte = q[l.codes + i / 2];
    return nf4[(i & 1) ? (byte & 0xF) : (byte >> 4)] * a;
  }
  return dyn[q[l.codes + i]] * a;
}

}  // namespace headroom
