// Device ops and storage dtypes: round to nearest even, special values, the CPU backend's ops.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/device/backend.h"
#include "core/device/device.h"
#include "kernels/common/dtype.h"
#include "kernels/cpu/convert.h"

namespace headroom {
namespace {

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(from_bits(0x3F808000u)), 0x3F80);
  // 1.0078125 + 2^-8 is halfway between two bf16 values whose lower has an odd mantissa: up.
  EXPECT_EQ(float_to_bf16(from_bits(0x3F818000u)), 0x3F82);
  EXPECT_EQ(float_to_bf16(from_bits(0x3F808001u)), 0x3F81);  // just above halfway: up
  EXPECT_EQ(float_to_bf16(-2.5f), 0xC020);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
  // The largest float rounds to infinity, as round-to-nearest requires.
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::max()))));
}

TEST(Dtype, F16NormalsSubnormalsAndOverflow) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);               // the largest half
  EXPECT_EQ(float_to_f16(65519.0f), 0x7BFF);               // below the midpoint to infinity
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);               // the midpoint: ties to even = infinity
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half of it: ties to even = 0
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: ties to even = 2
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // the smallest normal
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1).
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  EXPECT_EQ(f16_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_float(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_float(0x7C00)));
}

TEST(Dtype, EveryF16AndBf16ValueRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_float(uint16_t(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_f16(f), h) << std::hex << h;
    const float b = bf16_to_float(uint16_t(h));
    if (std::isnan(b)) continue;
    ASSERT_EQ(float_to_bf16(b), h) << std::hex << h;
  }
}

TEST(Dtype, F16RoundingMatchesNearestRepresentable) {
  // Against a brute-force nearest among the two neighbouring halves.
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = i % 2 ? u(rng) : u(rng) * 1e-5f;
    const uint16_t h = float_to_f16(x);
    const float got = f16_to_float(h);
    if (std::isinf(got)) {
      EXPECT_GE(std::fabs(x), 65520.0f);
      continue;
    }
    // No half value is strictly closer to x.
    const float up = f16_to_float(uint16_t(h + 1)), down = f16_to_float(uint16_t(h - 1));
    EXPECT_LE(std::fabs(got - x), std::fabs(up - x)) << x;
    EXPECT_LE(std::fabs(got - x), std::fabs(down - x)) << x;
  }
}

// The estimates size the naive attention's scratch without a device: as the CPU backend does.
// The CPU backend's vectorized conversions (kernels/cpu/convert.h) are the scalar ones of
// kernels/common/dtype.h bitwise: every bf16 and f16 value widened, and floats rounded over a
// sweep of bit patterns that crosses every exponent with both halves of a tie, infinities and
// NaNs (signalling and quiet, both signs); on several threads, past the parallel threshold.
TEST(Dtype, VectorizedConversionsAreTheScalarOnes) {
  const int before = cpu::threads_setting();
  cpu::set_threads(3);
  std::vector<uint16_t> every(65536);
  for (uint32_t i = 0; i < 65536; ++i)
    every[i] = uint16_t(i);
  std::vector<float> wide(every.size());
  cpu::widen_bf16(every.data(), wide.data(), every.size());
  for (uint32_t i = 0; i < 65536; ++i)
    ASSERT_EQ(float_bits(wide[i]), float_bits(bf16_to_float(uint16_t(i)))) << i;
  cpu::widen_f16(every.data(), wide.data(), every.size());
  for (uint32_t i = 0; i < 65536; ++i)
    ASSERT_EQ(float_bits(wide[i]), float_bits(f16_to_float(uint16_t(i)))) << i;
  std::vector<float> xs;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 0x10001ull)  // every high half, varied low halves
    for (const uint32_t low : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      xs.push_back(bits_float((uint32_t(u) & 0xFFFF0000u) | low));
  for (const uint32_t special : {0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFF800001u, 0x7FC00000u,
                                 0x7FFFFFFFu, 0x7F7FFFFFu, 0x00000001u, 0x80000000u})
    xs.push_back(bits_float(special));
  std::vector<uint16_t> low(xs.size());
  cpu::round_bf16(xs.data(), low.data(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i)
    ASSERT_EQ(low[i], float_to_bf16(xs[i])) << std::hex << float_bits(xs[i]);
  cpu::round_f16(xs.data(), low.data(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i)
    ASSERT_EQ(low[i], float_to_f16(xs[i])) << std::hex << float_bits(xs[i]);
  cpu::set_threads(before);
}

TEST(DeviceOps, AttentionScratchOfTheKindIsTheBackendsOwn) {
  auto device = Device::create(DeviceConfig{});
  for (const int T : {1, 17, 256})
    EXPECT_EQ(attention_scratch_numel("cpu", 3, T, 12),
              device->backend().attention_scratch_numel(3, T, 12));
}

TEST(DeviceOps, FillCastScaleAxpySumNonfinite) {
  auto device = Device::create(DeviceConfig{});
  std::vector<float> x(5), y(5, 1.0f);
  device->backend().fill(Dtype::kF32, x.data(), 5, 2.0);
  EXPECT_EQ(x[4], 2.0f);
  device->backend().axpy(Dtype::kF32, y.data(), x.data(), 5, -0.5);  // y = 1 - 0.5 * 2
  EXPECT_EQ(y[0], 0.0f);
  device->backend().scale(Dtype::kF32, x.data(), 5, 3.0);
  EXPECT_EQ(x[2], 6.0f);
  EXPECT_DOUBLE_EQ(device->backend().sum_squares(Dtype::kF32, x.data(), 5), 180.0);
  EXPECT_FALSE(device->backend().any_nonfinite(Dtype::kF32, x.data(), 5));
  x[3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(device->backend().any_nonfinite(Dtype::kF32, x.data(), 5));

  std::vector<uint16_t> h(3);
  const float src[3] = {1.0f, 1.0f + std::ldexp(1.0f, -8), -3.0f};
  device->backend().cast(h.data(), Dtype::kBF16, src, Dtype::kF32, 3);
  EXPECT_EQ(h[0], 0x3F80);
  EXPECT_EQ(h[1], 0x3F80);  // rounded to even
  std::vector<float> back(3);
  device->backend().cast(back.data(), Dtype::kF32, h.data(), Dtype::kBF16, 3);
  EXPECT_EQ(back[2], -3.0f);
  // accumulate: f32 += the widened bf16 (1, 1, -3), one rounded add an element.
  std::vector<float> acc = {0.5f, std::ldexp(1.0f, 24), 3.0f};
  device->backend().accumulate(acc.data(), h.data(), Dtype::kBF16, 3);
  EXPECT_EQ(acc[0], 1.5f);
  EXPECT_EQ(acc[1], std::ldexp(1.0f, 24));  // 2^24 + 1 rounds to even
  EXPECT_EQ(acc[2], 0.0f);
  EXPECT_THROW(device->backend().scale(Dtype(99), h.data(), 3, 1.0), OpError);
  EXPECT_THROW(device->backend().axpy(Dtype::kI32, h.data(), h.data(), 3, 1.0), OpError);
}

}  // namespace
}  // namespace headroom
