// Quantized frozen weights (kernels/common/quant.h, kernels/cpu/quant.h, Backend::dequantize):
// against bitsandbytes' own CPU functions on a (1024, 1024) N(0, 1) tensor (tests/hf/
// quant_reference.py; skipped, saying so, without .venv-test) — the tables bit for bit, NF4's
// codes, absmaxes and dequantized values bit for bit, the 8-bit dequantization bit for bit on
// bitsandbytes' own codes, every round-trip error against bitsandbytes' — and, always, the layout's
// sizes, ragged and zero blocks, requantization of dequantized values, and the CPU backend's op
// against the host reference in every compute dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/model.h"
#include "kernels/common/quant.h"
#include "kernels/cpu/quant.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

template <class V>
std::vector<V> read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<V> v(bytes.size() / sizeof(V));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(V));
  return v;
}

std::vector<float> dequantized(QuantKind k, const std::vector<unsigned char>& q, uint64_t n,
                               bool dq) {
  std::vector<float> out(n);
  cpu::dequantize_tensor(k, q.data(), n, dq, [&](uint64_t i, float v) { out[i] = v; });
  return out;
}

std::vector<unsigned char> quantized(QuantKind k, const std::vector<float>& x, bool dq) {
  std::vector<unsigned char> q(quant_tensor_bytes(k, x.size(), dq));
  cpu::quantize_tensor(k, x.data(), x.size(), dq, q.data());
  return q;
}

double mean_abs_error(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i)
    s += std::fabs(double(a[i]) - double(b[i]));
  return s / double(a.size());
}

std::vector<float> randn(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> x(n);
  for (float& v : x)
    v = d(rng);
  return x;
}

class BitsandbytesParity : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
#ifdef HEADROOM_SANITIZE_BUILD
    return;  // SetUp skips every case: no reference to make
#endif
    dir_ = new std::string(test::process_temp_dir() + "/bnb");
    const std::string python = std::string(HEADROOM_SOURCE_DIR) + "/.venv-test/bin/python";
    const test::RunResult r = test::run_command(python + " " + HEADROOM_SOURCE_DIR +
                                                "/tests/hf/quant_reference.py " + *dir_);
    if (r.exit_code != 0) {
      skip_ = new std::string("no bitsandbytes reference (" + python +
                              " tests/hf/quant_reference.py exited " + std::to_string(r.exit_code) +
                              "): " + r.output);
      return;
    }
    std::ifstream f(*dir_ + "/errors.json");
    errors_ = new nlohmann::json(nlohmann::json::parse(f));
  }
  void SetUp() override {
    HEADROOM_REFERENCE_IN_RELEASE_PASS("QuantKernels.*, QuantLayout.*");
    if (skip_) GTEST_SKIP() << *skip_;
    x_ = read_raw<float>(*dir_ + "/x.f32");
    ASSERT_EQ(x_.size(), 1024u * 1024u);
  }
  static std::string path(const char* name) {
    return *dir_ + "/" + name;
  }
  static std::string* dir_;
  static std::string* skip_;
  static nlohmann::json* errors_;
  std::vector<float> x_;
};
std::string* BitsandbytesParity::dir_ = nullptr;
std::string* BitsandbytesParity::skip_ = nullptr;
nlohmann::json* BitsandbytesParity::errors_ = nullptr;

TEST_F(BitsandbytesParity, TablesAreBitsandbytesOwn) {
  const std::vector<float> dyn = read_raw<float>(path("dynamic.f32"));
  const std::vector<float> nf4 = read_raw<float>(path("nf4.f32"));
  ASSERT_EQ(dyn.size(), 256u);
  ASSERT_EQ(nf4.size(), 16u);
  const DynamicMap m = dynamic_map();
  const Nf4Table t = nf4_table();
  EXPECT_EQ(std::memcmp(dyn.data(), m.v, sizeof m.v), 0);
  EXPECT_EQ(std::memcmp(nf4.data(), t.v, sizeof t.v), 0);
}

// NF4 (blocks of 64): the same codes and absmaxes as quantize_4bit, the same values as
// dequantize_4bit, and so its round-trip error.
TEST_F(BitsandbytesParity, Nf4IsBitForBit) {
  const std::vector<unsigned char> q = quantized(QuantKind::kNF4, x_, false);
  const QuantLayout l = quant_layout(QuantKind::kNF4, x_.size(), false);
  const std::vector<unsigned char> codes = read_raw<unsigned char>(path("nf4.codes"));
  const std::vector<float> absmax = read_raw<float>(path("nf4.absmax"));
  ASSERT_EQ(codes.size(), x_.size() / 2);
  ASSERT_EQ(absmax.size(), l.blocks);
  EXPECT_EQ(std::memcmp(q.data() + l.codes, codes.data(), codes.size()), 0);
  EXPECT_EQ(std::memcmp(q.data() + l.absmax, absmax.data(), 4 * absmax.size()), 0);
  const std::vector<float> y = dequantized(QuantKind::kNF4, q, x_.size(), false);
  EXPECT_TRUE(test::bitwise_equal(y, read_raw<float>(path("nf4.deq"))));
  const double err = mean_abs_error(x_, y), theirs = (*errors_)["nf4"].get<double>();
  std::cout << "nf4 mean abs error " << err << " (bitsandbytes " << theirs << ")\n";
  EXPECT_NEAR(err, theirs, 1e-6 * theirs);
}

// Double quantization: the absmaxes less their mean (summed in f64 here, in f32 by torch), as
// 8-bit codes; the error is bitsandbytes' to 0.1%.
TEST_F(BitsandbytesParity, Nf4DoubleQuantMatches) {
  const std::vector<float> y =
      dequantized(QuantKind::kNF4, quantized(QuantKind::kNF4, x_, true), x_.size(), true);
  const std::vector<float> theirs = read_raw<float>(path("nf4dq.deq"));
  // The absmaxes' 8-bit codes are the nearest here, not always bitsandbytes' (its CPU library's
  // pick, as for the int8 weights below): a block whose code differs has every value scaled by a
  // neighbouring absmax. The others' values are bitsandbytes'.
  uint64_t differ = 0;
  for (size_t i = 0; i < y.size(); ++i)
    differ += std::memcmp(&y[i], &theirs[i], 4) != 0;
  std::cout << "nf4 + double quant values differing from bitsandbytes': " << differ << " of "
            << y.size() << "\n";
  EXPECT_LT(double(differ), 0.01 * double(y.size()));
  const double err = mean_abs_error(x_, y), ref = (*errors_)["nf4dq"].get<double>();
  std::cout << "nf4 + double quant mean abs error " << err << " (bitsandbytes " << ref << ")\n";
  EXPECT_NEAR(err, ref, 1e-3 * ref);
}

// 8-bit (blocks of 256): the same absmaxes; the dequantization of bitsandbytes' own codes is
// dequantize_blockwise's, bit for bit; the codes are the nearest of the map, which bitsandbytes'
// CPU library picks for all but a few elements, and never worse.
TEST_F(BitsandbytesParity, Int8DequantizesBitForBitAndRoundsToNearest) {
  const QuantLayout l = quant_layout(QuantKind::kInt8, x_.size(), false);
  const std::vector<unsigned char> codes = read_raw<unsigned char>(path("int8.codes"));
  const std::vector<float> absmax = read_raw<float>(path("int8.absmax"));
  ASSERT_EQ(codes.size(), x_.size());
  ASSERT_EQ(absmax.size(), l.blocks);
  std::vector<unsigned char> theirs(l.bytes, 0);
  std::memcpy(theirs.data() + l.absmax, absmax.data(), 4 * absmax.size());
  std::memcpy(theirs.data() + l.codes, codes.data(), codes.size());
  EXPECT_TRUE(test::bitwise_equal(dequantized(QuantKind::kInt8, theirs, x_.size(), false),
                                  read_raw<float>(path("int8.deq"))));

  const std::vector<unsigned char> q = quantized(QuantKind::kInt8, x_, false);
  EXPECT_EQ(std::memcmp(q.data() + l.absmax, absmax.data(), 4 * absmax.size()), 0);
  uint64_t differ = 0;
  for (size_t i = 0; i < codes.size(); ++i)
    differ += q[l.codes + i] != codes[i];
  std::cout << "int8 codes differing from bitsandbytes' CPU library: " << differ << " of "
            << codes.size() << "\n";
  EXPECT_LT(double(differ), 0.005 * double(codes.size()));
  const double err = mean_abs_error(x_, dequantized(QuantKind::kInt8, q, x_.size(), false));
  const double ref = (*errors_)["int8"].get<double>();
  std::cout << "int8 mean abs error " << err << " (bitsandbytes " << ref << ")\n";
  EXPECT_LE(err, ref);
  EXPECT_GT(err, 0.99 * ref);

  const double dq = mean_abs_error(
      x_, dequantized(QuantKind::kInt8, quantized(QuantKind::kInt8, x_, true), x_.size(), true));
  const double dq_ref = (*errors_)["int8dq"].get<double>();
  std::cout << "int8 + double quant mean abs error " << dq << " (bitsandbytes " << dq_ref << ")\n";
  EXPECT_LE(dq, dq_ref * 1.001);
  EXPECT_GT(dq, 0.99 * dq_ref);
}

// --- without bitsandbytes --------------------------------------------------------------------

TEST(QuantLayout, SizesAreTheClosedForms) {
  // nf4: n / 2 code bytes and an f32 absmax per 64; double-quantized, a byte per 64 and an f32
  // scale per 256 blocks and the mean; each tensor padded to 16 bytes.
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kNF4, 4096, false), 2048u + 4 * 64);
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kNF4, 4096, true), 2048u + 64 + 16);
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kInt8, 4096, false), 4096u + 4 * 16);
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kInt8, 4096, true), 4096u + 16 + 16);
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kBF16, 4096, false), 8192u);
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kNF4, 65, false), 48u);  // 33 + 8, padded
  // 768 x 2304 (GPT-2's c_attn): 27648 blocks of 64.
  const uint64_t n = 768 * 2304;
  EXPECT_EQ(quant_tensor_bytes(QuantKind::kNF4, n, true),
            (n / 2 + 27648 + 4 * (108 + 1) + 15) / 16 * 16);
}

// Every kind round-trips within its step; ragged last blocks, odd lengths and zero blocks too.
TEST(QuantKernels, RoundTripsRaggedAndZeroBlocks) {
  for (QuantKind k : {QuantKind::kBF16, QuantKind::kInt8, QuantKind::kNF4})
    for (bool dq : {false, true}) {
      if (k == QuantKind::kBF16 && dq) continue;
      for (uint64_t n : {1u, 63u, 65u, 257u, 1001u}) {
        std::vector<float> x = randn(n, n);
        for (uint64_t i = 0; i < std::min<uint64_t>(n, 64); ++i)
          x[i] = 0.0f;  // the first NF4 block all zeros
        const std::vector<float> y = dequantized(k, quantized(k, x, dq), n, dq);
        for (uint64_t i = 0; i < std::min<uint64_t>(n, 64); ++i)
          EXPECT_EQ(y[i], 0.0f) << quant_kind_name(k) << " n " << n;
        const double step = k == QuantKind::kNF4 ? 0.17 : k == QuantKind::kInt8 ? 0.01 : 0.004;
        for (uint64_t i = 0; i < n; ++i)
          ASSERT_NEAR(y[i], x[i], step * 4.5 + 1e-6) << quant_kind_name(k) << " n " << n;
      }
    }
}

// Dequantized NF4 and bf16 values quantize to the same bytes again (each block's absmax is one
// of its values: NF4 has +-1); the model keeps codes whose values are unchanged anyway.
TEST(QuantKernels, Nf4AndBf16RequantizeToTheSameBytes) {
  const std::vector<float> x = randn(4096, 7);
  for (QuantKind k : {QuantKind::kBF16, QuantKind::kNF4}) {
    const std::vector<unsigned char> q = quantized(k, x, false);
    EXPECT_EQ(quantized(k, dequantized(k, q, x.size(), false), false), q) << quant_kind_name(k);
  }
}

// The CPU backend's op is the host reference's values, rounded once to the compute dtype.
TEST(QuantKernels, BackendOpIsTheReference) {
  std::unique_ptr<Device> d = Device::create(DeviceConfig{});
  Backend& o = d->backend();
  const uint64_t n = 3000;
  const std::vector<float> x = randn(n, 3);
  for (QuantKind k : {QuantKind::kBF16, QuantKind::kInt8, QuantKind::kNF4})
    for (bool dq : {false, true}) {
      const std::vector<unsigned char> q = quantized(k, x, dq);
      const std::vector<float> ref = dequantized(k, q, n, dq);
      Buffer qb(*d, q.size(), Category::kParameters, "q");
      o.upload(qb.as<void>(), q.data(), q.size());
      for (Dtype dt : {Dtype::kF32, Dtype::kBF16}) {
        Buffer out(*d, n * dtype_size(dt), Category::kWorkspace, "out");
        o.dequantize(dt, out.as<void>(), qb.as<void>(), k, dq, n);
        std::vector<float> got(n);
        o.cast(got.data(), Dtype::kF32, out.as<void>(), dt, n);
        for (uint64_t i = 0; i < n; ++i) {
          const float want = dt == Dtype::kF32 ? ref[i] : bf16_to_float(float_to_bf16(ref[i]));
          ASSERT_EQ(got[i], want) << quant_kind_name(k) << " " << dtype_name(dt) << " at " << i;
        }
      }
    }
}

}  // namespace
}  // namespace headroom
