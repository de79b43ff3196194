// The element-wise ops that headroom.ops/1 offers plugins (headroom/ext/ops.h): binary, unary,
// lerp, affine, one element in f32. Shared by the CPU backend (core/device/backend_cpu.cpp) and
// the CUDA kernels (kernels/cuda/pointwise.cu), so that one source is tested on both.
//
// Every f32 operation is rounded on its own, as written: the CPU build has no contraction
// (-ffp-contract=off) and device code uses the _rn intrinsics, which nvcc never fuses into a
// multiply-add. Division and the square root are IEEE's (correctly rounded) on both. A NaN that
// max / min produce is the canonical quiet NaN, so the two backends agree on its bits too.
#pragma once

#include <stdint.h>

#include "kernels/common/dtype.h"  // HR_HD, float_bits / bits_float

namespace headroom {

// binary()'s ops, the values of headroom/ext/ops.h's HR_OP_ADD .. HR_OP_MIN.
enum class BinaryOp : uint32_t { kAdd = 0, kSub = 1, kMul = 2, kDiv = 3, kMax = 4, kMin = 5 };
// unary()'s ops, the values of HR_OP_SIGN .. HR_OP_RECIPROCAL.
enum class UnaryOp : uint32_t { kSign = 0, kSqrt = 1, kAbs = 2, kNeg = 3, kReciprocal = 4 };

namespace pointwise {

HR_HD inline float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
HR_HD inline float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
HR_HD inline float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
HR_HD inline float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
HR_HD inline float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}
HR_HD inline bool is_nan(float a) {
  return (float_bits(a) & 0x7FFFFFFFu) > 0x7F800000u;
}
HR_HD inline float canonical_nan() {
  return bits_float(0x7FC00000u);
}

// z = x op y
HR_HD inline float binary(BinaryOp op, float x, float y) {
  switch (op) {
    case BinaryOp::kAdd:
      return add(x, y);
    case BinaryOp::kSub:
      return sub(x, y);
    case BinaryOp::kMul:
      return mul(x, y);
    case BinaryOp::kDiv:
      return div(x, y);
    case BinaryOp::kMax:
      return is_nan(x) || is_nan(y) ? canonical_nan() : (x > y ? x : y);
    case BinaryOp::kMin:
      return is_nan(x) || is_nan(y) ? canonical_nan() : (x < y ? x : y);
  }
  return canonical_nan();
}

// y = op(x). sqrt of a negative number is the canonical NaN (x86's sqrtss would give the
// negative one); sign keeps +-0 and a NaN's bits.
HR_HD inline float unary(UnaryOp op, float x) {
  switch (op) {
    case UnaryOp::kSign:
      return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x);
    case UnaryOp::kSqrt:
      return x < 0.0f ? canonical_nan() : sqrt(x);
    case UnaryOp::kAbs:
      return bits_float(float_bits(x) & 0x7FFFFFFFu);
    case UnaryOp::kNeg:
      return bits_float(float_bits(x) ^ 0x80000000u);
    case UnaryOp::kReciprocal:
      return div(1.0f, x);
  }
  return canonical_nan();
}

// z = x + w (y - x): the difference, the product, the sum, each rounded.
HR_HD inline float lerp(float x, float y, float w) {
  return add(x, mul(w, sub(y, x)));
}

// y = a x + b: the product, then the sum.
HR_HD inline float affine(float x, float a, float b) {
  return add(mul(a, x), b);
}

}  // namespace pointwise
}  // namespace headroom
