// The adam8bit plugin (plugins/adam8bit): AdamW with block-wise 8-bit moments, the optimizer role.
//  - its kernels directly (plugins/adam8bit/kernels.h): the dynamic maps, block-wise quantization
//    with a stated error bound, 50 steps against an fp32 AdamW reference written here from the
//    formula (bitsandbytes' own test as the model), the bf16 weights' stochastic rounding
//    (plugins/common/bf16.h) against a double-precision emulation;
//  - the plugin loaded by the real host: the loss falls close to the built-in AdamW's, a resumed
//    run is bitwise the uninterrupted one, bad keys exit 2 naming them, a damaged or mismatched
//    state is a clear error, and the tracker's optimizer bytes are the closed form.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/report/advice.h"
#include "core/run/snapshot.h"
#include "core/run/trainer.h"
#include "headroom/ext/estimate.h"
#include "plugins/adam8bit/kernels.h"
#include "plugins/common/bf16.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace bf = headroom_plugin::bf16;

// ---------------------------------------------------------------------------------------------
// 1. The maps and block-wise quantization

TEST(Adam8bitQuant, MapsAreSortedSignedUnsignedWithZeroAndOne) {
  const std::vector<float> s = adam8bit::dynamic_map(true), u = adam8bit::dynamic_map(false);
  ASSERT_EQ(s.size(), 256u);
  ASSERT_EQ(u.size(), 256u);
  for (size_t i = 1; i < 256; ++i) {
    EXPECT_LT(s[i - 1], s[i]) << "signed map strictly ascending at " << i;
    EXPECT_LT(u[i - 1], u[i]) << "unsigned map strictly ascending at " << i;
  }
  EXPECT_EQ(s[0], -1.0f);
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_EQ(s[255], 1.0f);
  EXPECT_EQ(std::count_if(s.begin(), s.end(), [](float x) { return x < 0; }), 127);
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_EQ(u[255], 1.0f);
  EXPECT_EQ(adam8bit::zero_code(s.data()), 127);
  EXPECT_EQ(adam8bit::zero_code(u.data()), 0);
  // bitsandbytes' entries: the top decade's midpoints, 0.1 + 0.9 (j + 1/2) / 64 (signed) and
  // / 128 (unsigned), the smallest 10^-6 (0.1 + 0.45 / 2) (unsigned).
  EXPECT_FLOAT_EQ(s[254], 0.1f + 0.9f * 63.5f / 64.0f);
  EXPECT_FLOAT_EQ(u[254], 0.1f + 0.9f * 127.5f / 128.0f);
  EXPECT_FLOAT_EQ(u[1], 1e-6f * (0.1f + 0.45f / 2.0f));
  EXPECT_FLOAT_EQ(s[128], 1e-6f * 0.55f);
  EXPECT_FLOAT_EQ(s[126], -1e-5f * (0.1f + 0.45f / 2.0f)) << "-5.5e-7 gave its place to -1";

  // The binary search is the nearest entry (brute force), ties aside.
  const std::vector<float> ts = adam8bit::thresholds(s), tu = adam8bit::thresholds(u);
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> any(-1.0f, 1.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    float x = any(rng);
    if (trial % 4 == 1) x = std::ldexp(x, -int(rng() % 20));  // small magnitudes too
    for (int sig = 0; sig < 2; ++sig) {
      const std::vector<float>& m = sig ? s : u;
      const float xx = sig ? x : std::fabs(x);
      const uint8_t q = adam8bit::quantize(sig ? ts.data() : tu.data(), xx);
      float best = 1e30f;
      for (float e : m)
        best = std::min(best, std::fabs(e - xx));
      EXPECT_LE(std::fabs(m[q] - xx), best * (1 + 1e-6f) + 1e-12f) << xx;
    }
  }
  for (int sig = 0; sig < 2; ++sig)
    for (int i = 0; i < 256; ++i) {
      const std::vector<float>& m = sig ? s : u;
      EXPECT_EQ(adam8bit::quantize(sig ? ts.data() : tu.data(), m[i]), i) << "entries are exact";
    }
}

// The bucketed quantize() is the binary search's, bitwise: at both ends and the middle of every
// bucket of floats, on random values in [-1, 1] and on the specials (zeros, subnormals, the map's
// entries and thresholds, infinities, NaN).
TEST(Adam8bitQuant, BucketedQuantizeIsTheBinarySearch) {
  for (const bool sig : {true, false}) {
    const std::vector<float> map = adam8bit::dynamic_map(sig);
    const std::vector<float> th = adam8bit::thresholds(map);
    const adam8bit::Buckets b = adam8bit::buckets(th.data());
    std::vector<float> xs = {0.0f,
                             -0.0f,
                             1e-45f,
                             -1e-45f,
                             1.0f,
                             -1.0f,
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN(),
                             -std::numeric_limits<float>::quiet_NaN()};
    for (const float v : map)
      xs.insert(xs.end(), {v, std::nextafter(v, 2.0f), std::nextafter(v, -2.0f)});
    for (const float t : th)
      xs.insert(xs.end(), {t, std::nextafter(t, 2.0f), std::nextafter(t, -2.0f)});
    for (uint32_t i = 0; i < (1u << adam8bit::kBucketBits); ++i) {
      const uint32_t first = i << adam8bit::kBucketShift;
      for (const uint32_t bits : {first, first | (1u << (adam8bit::kBucketShift - 1)),
                                  first | ((1u << adam8bit::kBucketShift) - 1)})
        xs.push_back(adam8bit::bits_f32(bits));
    }
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (int i = 0; i < 200000; ++i)
      xs.push_back(uniform(rng) * std::ldexp(1.0f, -int(rng() % 24)));
    int wrong = 0;
    for (const float x : xs)
      if (adam8bit::quantize(b, x) != adam8bit::quantize(th.data(), x) && ++wrong < 5)
        ADD_FAILURE() << (sig ? "signed" : "unsigned") << " map, x = " << x;
    EXPECT_EQ(wrong, 0) << "of " << xs.size() << " values";
#ifdef HR_ADAM8BIT_AVX2
    // The AVX2 loops, where the CPU has it: the same codes, the same dequantized values, the same
    // absmax as the scalar ones, on every value above (x 1: the scaling is exact).
    if (adam8bit::have_avx2()) {
      std::vector<uint8_t> q(xs.size());
      const uint64_t done = adam8bit::quantize_avx2(b, xs.data(), 1.0f, xs.size(), q.data());
      EXPECT_EQ(done, xs.size() / 8 * 8);
      int differ = 0;
      for (uint64_t i = 0; i < done; ++i)
        differ += q[i] != adam8bit::quantize(th.data(), xs[i]);
      EXPECT_EQ(differ, 0) << "AVX2 quantize, of " << done << " values";
      std::vector<float> fast(done), slow(done);
      const float absmax = 0.37f;
      EXPECT_EQ(adam8bit::dequantize_avx2(map.data(), q.data(), absmax, done, fast.data()), done);
      for (uint64_t i = 0; i < done; ++i)
        slow[i] = map[q[i]] * absmax;
      EXPECT_EQ(0, std::memcmp(fast.data(), slow.data(), done * sizeof(float)));
      uint32_t scalar = 0;
      for (uint64_t i = 0; i < done; ++i) {
        const uint32_t bits = adam8bit::f32_bits(xs[i]) & 0x7FFFFFFFu;
        scalar = std::max(scalar, bits > 0x7F800000u ? 0u : bits);
      }
      EXPECT_EQ(adam8bit::absmax_bits_avx2(xs.data(), done), scalar);
    } else {
      std::printf("no AVX2 on this CPU: the scalar loops alone run\n");
    }
#endif
#ifdef HR_ADAM8BIT_AVX512
    // The AVX-512 quantization (step_blocks_avx512's), where the CPU has AVX-512 VBMI: the same
    // codes on every finite value above.
    if (adam8bit::have_avx512()) {
      std::vector<float> finite;
      for (const float x : xs)
        if (std::isfinite(x)) finite.push_back(x);
      std::vector<uint8_t> q(finite.size());
      const uint64_t done =
          adam8bit::quantize_avx512(b, finite.data(), 1.0f, finite.size(), q.data());
      EXPECT_EQ(done, finite.size() / 64 * 64);
      int differ = 0;
      for (uint64_t i = 0; i < done; ++i)
        differ += q[i] != adam8bit::quantize(th.data(), finite[i]);
      EXPECT_EQ(differ, 0) << "AVX-512 quantize, of " << done << " values";
    }
#endif
  }
}

// The bound: an element of a block with absmax A comes back within half the widest gap of the
// map times A: 0.9 / 64 / 2 = 0.00703 A (signed, the top decade's 64 steps) and 0.9 / 128 / 2 =
// 0.00352 A (unsigned); the block's absmax element exactly.
TEST(Adam8bitQuant, BlockRoundTripErrorIsBounded) {
  const std::vector<float> s = adam8bit::dynamic_map(true), u = adam8bit::dynamic_map(false);
  const std::vector<float> ts = adam8bit::thresholds(s), tu = adam8bit::thresholds(u);
  const adam8bit::Buckets bs = adam8bit::buckets(ts.data()), bu = adam8bit::buckets(tu.data());
  double gap_s = 0, gap_u = 0;
  for (size_t i = 1; i < 256; ++i) {
    gap_s = std::max(gap_s, double(s[i]) - s[i - 1]);
    gap_u = std::max(gap_u, double(u[i]) - u[i - 1]);
  }
  EXPECT_NEAR(gap_s / 2, 0.9 / 128, 1e-6);
  EXPECT_NEAR(gap_u / 2, 0.9 / 256, 1e-6);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double worst_s = 0, worst_u = 0, sum_err_s = 0, sum_abs_s = 0, sum_err_u = 0, sum_abs_u = 0;
  for (int block = 0; block < 400; ++block) {
    const uint64_t n = block % 7 == 3 ? 1 + rng() % 255 : 256;  // short last blocks too
    const float scale = std::ldexp(1.0f, int(rng() % 40) - 30);
    std::vector<float> x(n), y(n), back(n);
    for (uint64_t i = 0; i < n; ++i) {
      x[i] = normal(rng) * scale;
      y[i] = x[i] * x[i];  // a second moment: non-negative, heavy-tailed
    }
    std::vector<uint8_t> q(n);
    for (int sig = 0; sig < 2; ++sig) {
      const std::vector<float>& in = sig ? x : y;
      const float a = adam8bit::quantize_block(sig ? s.data() : u.data(), sig ? bs : bu, in.data(),
                                               n, q.data());
      adam8bit::dequantize_block(sig ? s.data() : u.data(), q.data(), a, n, back.data());
      float amax = 0;
      for (float v : in)
        amax = std::max(amax, std::fabs(v));
      EXPECT_EQ(a, amax);
      for (uint64_t i = 0; i < n; ++i) {
        const double err = std::fabs(double(back[i]) - in[i]) / amax;
        if (std::fabs(in[i]) == amax) {
          EXPECT_EQ(std::fabs(back[i]), amax) << "absmax exact";
        }
        (sig ? worst_s : worst_u) = std::max(sig ? worst_s : worst_u, err);
        (sig ? sum_err_s : sum_err_u) += std::fabs(double(back[i]) - in[i]);
        (sig ? sum_abs_s : sum_abs_u) += std::fabs(in[i]);
      }
    }
  }
  std::printf(
      "block round trip: max |error| / absmax signed %.5f (bound %.5f), unsigned %.5f (bound "
      "%.5f); sum|error| / sum|x| signed %.5f, unsigned %.5f\n",
      worst_s, gap_s / 2, worst_u, gap_u / 2, sum_err_s / sum_abs_s, sum_err_u / sum_abs_u);
  EXPECT_LE(worst_s, gap_s / 2 * (1 + 1e-5));
  EXPECT_LE(worst_u, gap_u / 2 * (1 + 1e-5));
  // All-zero blocks stay zero, with absmax 0.
  std::vector<float> zeros(256, 0.0f), back(256, 1.0f);
  std::vector<uint8_t> q(256);
  EXPECT_EQ(adam8bit::quantize_block(s.data(), bs, zeros.data(), 256, q.data()), 0.0f);
  adam8bit::dequantize_block(s.data(), q.data(), 0.0f, 256, back.data());
  for (float b : back)
    EXPECT_EQ(b, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// 2. Following fp32 AdamW

struct Maps {
  std::vector<float> s = adam8bit::dynamic_map(true), u = adam8bit::dynamic_map(false);
  std::vector<float> ts = adam8bit::thresholds(s), tu = adam8bit::thresholds(u);
  adam8bit::Buckets bs = adam8bit::buckets(ts.data()), bu = adam8bit::buckets(tu.data());
};

// One tensor's 8-bit state in host vectors, as the plugin lays it out.
struct Q8 {
  explicit Q8(const Maps& maps, uint64_t n)
      : qm(n, adam8bit::zero_code(maps.s.data())),
        qv(n, adam8bit::zero_code(maps.u.data())),
        am(adam8bit::num_blocks(n), 0.0f),
        av(adam8bit::num_blocks(n), 0.0f) {
    st.qm = qm.data();
    st.qv = qv.data();
    st.absmax_m = am.data();
    st.absmax_v = av.data();
    st.map_m = maps.s.data();
    st.map_v = maps.u.data();
    st.buckets_m = &maps.bs;
    st.buckets_v = &maps.bu;
  }
  std::vector<float> m(const Maps& maps) const { return deq(maps.s, qm, am); }
  std::vector<float> v(const Maps& maps) const { return deq(maps.u, qv, av); }
  static std::vector<float> deq(const std::vector<float>& map, const std::vector<uint8_t>& q,
                                const std::vector<float>& a) {
    std::vector<float> out(q.size());
    for (size_t b = 0; b < a.size(); ++b) {
      const uint64_t lo = b * adam8bit::kBlock, n = std::min<uint64_t>(256, q.size() - lo);
      adam8bit::dequantize_block(map.data(), q.data() + lo, a[b], n, out.data() + lo);
    }
    return out;
  }
  std::vector<uint8_t> qm, qv;
  std::vector<float> am, av;
  adam8bit::State8 st;
};

// 50 steps on the same random gradients (each block at its own scale, as a network's layers
// are): the kernel's dequantized moments against fp32 AdamW's (in double, from the formula).
TEST(Adam8bitKernel, FollowsFp32AdamWFor50Steps) {
  const uint64_t n = 64 * 256;
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  Maps maps;
  Q8 q(maps, n);
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> p(n), g(n), block_scale(n / 256);
  std::vector<double> pr(n), mr(n, 0.0), vr(n, 0.0);
  for (uint64_t i = 0; i < n; ++i)
    pr[i] = p[i] = float(0.02 * normal(rng));
  for (float& s : block_scale)
    s = float(std::exp(2.0 * normal(rng)) * 1e-3);
  for (int t = 1; t <= 50; ++t) {
    for (uint64_t i = 0; i < n; ++i)
      g[i] = float(normal(rng) * block_scale[i / 256] + 0.3 * block_scale[i / 256]);
    adam8bit::ParamRef ref;
    ref.data = p.data();
    ref.grad = g.data();
    ref.numel = n;
    adam8bit::step_8bit(ref, q.st, adam8bit::make_hyper(lr, b1, b2, eps, wd, t));
    const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
    for (uint64_t i = 0; i < n; ++i) {
      mr[i] = b1 * mr[i] + (1 - b1) * g[i];
      vr[i] = b2 * vr[i] + (1 - b2) * double(g[i]) * g[i];
      pr[i] -= lr * ((mr[i] / c1) / (std::sqrt(vr[i] / c2) + eps) + wd * pr[i]);
    }
  }
  const std::vector<float> m = q.m(maps), v = q.v(maps);
  double em = 0, am = 0, ev = 0, av = 0, ep = 0, ep_max = 0, rel_m = 0, rel_v = 0;
  for (uint64_t i = 0; i < n; ++i) {
    em += std::fabs(m[i] - mr[i]);
    am += std::fabs(mr[i]);
    ev += std::fabs(v[i] - vr[i]);
    av += std::fabs(vr[i]);
    rel_m += std::fabs(m[i] - mr[i]) / (std::fabs(mr[i]) + 1e-12);
    rel_v += std::fabs(v[i] - vr[i]) / (std::fabs(vr[i]) + 1e-20);
    ep += std::fabs(p[i] - pr[i]);
    ep_max = std::max(ep_max, std::fabs(p[i] - pr[i]));
  }
  const double mean_rel_m = em / am, mean_rel_v = ev / av;
  std::printf(
      "50 steps against fp32 AdamW: m: sum|err|/sum|m| %.3e (element-wise mean %.3e); v: "
      "sum|err|/sum|v| %.3e (element-wise mean %.3e); weights: mean |err| %.3e, max %.3e "
      "(lr %.0e, 50 lr = %.1e)\n",
      mean_rel_m, rel_m / n, mean_rel_v, rel_v / n, ep / n, ep_max, lr, 50 * lr);
  // The brief asked for a mean relative error under 1e-3: NOT met. An 8-bit dynamic map's top
  // decade has 64 (signed) and 128 (unsigned) steps over [0.1, 1] of a block's absmax, so a
  // single round trip is off by ~1% of a typical element
  // (Adam8bitQuant.BlockRoundTripErrorIsBounded prints it), and the requantization error of every
  // step is carried on by the moments' averaging. Measured on this data: m 2.04e-2, v 1.20e-2 (20x
  // and 12x the 1e-3 asked for). The bounds below are those figures with a margin, to catch a
  // regression, not the brief's.
  EXPECT_LT(mean_rel_m, 2.5e-2) << "measured 2.04e-2; the brief's 1e-3 is not reachable";
  EXPECT_LT(mean_rel_v, 1.5e-2) << "measured 1.20e-2; the brief's 1e-3 is not reachable";
  // The weights: every step moves a weight by about lr (Adam's normalized step); the 8-bit
  // moments change a step by a fraction of that. Bound: mean |err| under 1% of the 50 lr the
  // weights could have travelled (measured 0.32%), the worst element under 5% (measured 1.9%).
  EXPECT_LT(ep / n, 0.01 * 50 * lr);
  EXPECT_LT(ep_max, 0.05 * 50 * lr);
}

// The step runs its blocks on the OpenMP threads: 1 and 3 threads give the same bits (weights,
// codes and absmax), f32 and bf16 weights, over 5 steps of a tensor whose last block is partial.
TEST(Adam8bitKernel, SameBitsOnAnyThreadCount) {
  const uint64_t n = 37 * 256 + 101;
  Maps maps;
  for (const uint32_t dtype : {uint32_t(HR_DTYPE_F32), uint32_t(HR_DTYPE_BF16)}) {
    struct Run {
      std::vector<float> p32;
      std::vector<uint16_t> p16;
      Q8 q;
    };
    auto run = [&](int threads) {
      std::mt19937_64 rng(11);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      Run r{std::vector<float>(n), std::vector<uint16_t>(n), Q8(maps, n)};
      for (uint64_t i = 0; i < n; ++i) {
        r.p32[i] = 0.02f * normal(rng);
        r.p16[i] = bf::round_nearest_even(r.p32[i]);
      }
      const int before = omp_get_max_threads();
      omp_set_num_threads(threads);
      std::vector<float> g(n);
      for (int t = 1; t <= 5; ++t) {
        for (float& x : g)
          x = 1e-3f * normal(rng);
        adam8bit::ParamRef ref;
        ref.data = dtype == HR_DTYPE_BF16 ? static_cast<void*>(r.p16.data()) : r.p32.data();
        ref.dtype = dtype;
        ref.grad = g.data();
        ref.numel = n;
        adam8bit::Hyper h = adam8bit::make_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t);
        h.round_key = bf::stream_key(5, uint64_t(t), 0);
        adam8bit::step_8bit(ref, r.q.st, h);
      }
      omp_set_num_threads(before);
      return r;
    };
    const Run one = run(1), three = run(3);
    EXPECT_EQ(0, std::memcmp(one.p32.data(), three.p32.data(), n * sizeof(float))) << dtype;
    EXPECT_EQ(one.p16, three.p16) << dtype;
    EXPECT_EQ(one.q.qm, three.q.qm) << dtype;
    EXPECT_EQ(one.q.qv, three.q.qv) << dtype;
    EXPECT_EQ(0, std::memcmp(one.q.am.data(), three.q.am.data(), one.q.am.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(one.q.av.data(), three.q.av.data(), one.q.av.size() * sizeof(float)));
  }
}

// Where the CPU has AVX-512 VBMI, step_8bit does its full blocks in step_blocks_avx512 (byte-plane
// dequantization, the requantization of a block interleaved with the next one's update): the same
// bits as the scalar / AVX2 block (step_block) on every dtype, over 8 steps of a tensor with a
// partial last block, blocks at scales from 2^-40 to 2^19, all-zero blocks (absmax 0), tiny ones
// (1e-30: an absmax whose reciprocal overflows), and a NaN and an infinite gradient (the blocks
// quantize_block does): weights (NaN as NaN), codes and absmax.
template <uint32_t Data, uint32_t Grad>
void expect_avx512_is_scalar_block() {
  const uint64_t n = 37 * 256 + 101;
  Maps maps;
  struct Run {
    std::vector<float> p32;
    std::vector<uint16_t> p16;
    Q8 q;
  };
  std::mt19937_64 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p0(n);
  for (float& x : p0)
    x = 0.02f * normal(rng);
  auto start = [&] {  // a prvalue: the state's pointers stay its own
    Run r{p0, std::vector<uint16_t>(n), Q8(maps, n)};
    for (uint64_t i = 0; i < n; ++i)
      r.p16[i] = bf::round_nearest_even(p0[i]);
    return r;
  };
  Run fast = start(), slow = start();
  std::vector<float> g(n);
  std::vector<uint16_t> g16(n);
  int differ = 0;
  for (int t = 1; t <= 8; ++t) {
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t b = i / 256, j = i % 256;
      g[i] = normal(rng) * std::ldexp(1.0f, int((b * 7919 + uint64_t(t)) % 60) - 40);
      if (b % 11 == 3) g[i] = 0.0f;
      if (b % 13 == 5 && t == 3 && j == 17) g[i] = std::numeric_limits<float>::quiet_NaN();
      if (b % 17 == 6 && t == 4 && j == 33) g[i] = std::numeric_limits<float>::infinity();
      if (b % 19 == 7 && t == 5) g[i] = 1e-30f * normal(rng);
      g16[i] = bf::round_nearest_even(g[i]);
    }
    adam8bit::Hyper h = adam8bit::make_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, t);
    h.round_key = bf::stream_key(5, uint64_t(t), 0);
    for (Run* r : {&fast, &slow}) {
      adam8bit::ParamRef ref;
      ref.data = Data == HR_DTYPE_BF16 ? static_cast<void*>(r->p16.data()) : r->p32.data();
      ref.dtype = Data;
      ref.grad = Grad == HR_DTYPE_BF16 ? static_cast<const void*>(g16.data()) : g.data();
      ref.grad_dtype = Grad;
      ref.numel = n;
      if (r == &fast) {
        adam8bit::step_8bit(ref, r->q.st, h);
      } else {
        for (uint64_t b = 0; b < adam8bit::num_blocks(n); ++b)
          adam8bit::step_block<Data, Grad>(ref, r->q.st, h, b);
      }
    }
    for (uint64_t i = 0; i < n; ++i) {
      const float a = fast.p32[i], b = slow.p32[i];
      differ += !(std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b)));
    }
    differ += fast.p16 != slow.p16;
    differ += fast.q.qm != slow.q.qm;
    differ += fast.q.qv != slow.q.qv;
    differ += std::memcmp(fast.q.am.data(), slow.q.am.data(), fast.q.am.size() * 4) != 0;
    differ += std::memcmp(fast.q.av.data(), slow.q.av.data(), fast.q.av.size() * 4) != 0;
  }
  EXPECT_EQ(differ, 0) << "data dtype " << Data << ", gradient dtype " << Grad;
}

TEST(Adam8bitKernel, Avx512BlocksAreTheScalarBlock) {
#ifdef HR_ADAM8BIT_AVX512
  if (!adam8bit::have_avx512()) GTEST_SKIP() << "no AVX-512 VBMI on this CPU";
  expect_avx512_is_scalar_block<HR_DTYPE_F32, HR_DTYPE_F32>();
  expect_avx512_is_scalar_block<HR_DTYPE_BF16, HR_DTYPE_F32>();
  expect_avx512_is_scalar_block<HR_DTYPE_F32, HR_DTYPE_BF16>();
  expect_avx512_is_scalar_block<HR_DTYPE_BF16, HR_DTYPE_BF16>();
#else
  GTEST_SKIP() << "not an x86-64 GCC build";
#endif
}

// bitsandbytes' test_optimizer8bit as written (weights randn * 0.1, gradients randn * 0.01, lr
// 1e-3, no weight decay, 50 steps; every 10 steps the reference takes the 8-bit run's weights and
// dequantized state, "so the parameters stay close together"): its bounds for fp32 gradients on
// the weights after every step: the mean absolute error under 6e-5 (tighter than its 1.2e-4). Its
// other bound, the mean relative error relerr = |p - p_ref| / (|p_ref| + 1e-9) under 1.2e-3, is
// NOT met here: measured 1e-6 to 2.4e-3 in the first 8 steps of a window and up to 3.9e-2 when a
// weight crosses zero (one element's |p_ref| ~ 1e-9 dominates the mean); it is printed, not
// asserted. The moments' own mean relative error is ~1e-2 (FollowsFp32AdamWFor50Steps).
TEST(Adam8bitKernel, MeetsBitsandbytesWeightBound) {
  const uint64_t n = 64 * 256;
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  Maps maps;
  Q8 q(maps, n);
  std::mt19937_64 rng(6);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> p(n), g(n);
  std::vector<double> pr(n), mr(n, 0.0), vr(n, 0.0);
  for (uint64_t i = 0; i < n; ++i)
    pr[i] = p[i] = float(0.1 * normal(rng));
  double worst = 0, worst_rel = 0;
  for (int t = 1; t <= 50; ++t) {
    for (float& x : g)
      x = float(0.01 * normal(rng));
    adam8bit::ParamRef ref;
    ref.data = p.data();
    ref.grad = g.data();
    ref.numel = n;
    adam8bit::step_8bit(ref, q.st, adam8bit::make_hyper(lr, b1, b2, eps, 0.0, t));
    const double c1 = 1 - std::pow(b1, t), c2 = 1 - std::pow(b2, t);
    double err = 0, rel = 0;
    for (uint64_t i = 0; i < n; ++i) {
      mr[i] = b1 * mr[i] + (1 - b1) * g[i];
      vr[i] = b2 * vr[i] + (1 - b2) * double(g[i]) * g[i];
      pr[i] -= lr * ((mr[i] / c1) / (std::sqrt(vr[i] / c2) + eps));
      err += std::fabs(p[i] - pr[i]);
      rel += std::fabs(p[i] - pr[i]) / (std::fabs(pr[i]) + 1e-9);
    }
    worst = std::max(worst, err / n);
    worst_rel = std::max(worst_rel, rel / n);
    EXPECT_LT(err / n, 6e-5) << "step " << t;
    if (t % 10 == 0) {
      const std::vector<float> m = q.m(maps), v = q.v(maps);
      for (uint64_t i = 0; i < n; ++i) {
        pr[i] = p[i];
        mr[i] = m[i];
        vr[i] = v[i];
      }
    }
  }
  std::printf(
      "bitsandbytes' setup: worst mean |weight error| over 50 steps %.3e (bound 6e-5), worst mean "
      "relative weight error %.3e (bitsandbytes' 1.2e-3 not met; see above)\n",
      worst, worst_rel);
}

// Tensors under min_8bit_size: fp32 moments, the host's AdamW element exactly (in float).
TEST(Adam8bitKernel, Fp32PathIsTheBuiltinFormula) {
  const uint64_t n = 1000;
  std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f), pe(n), me(n, 0.0f), ve(n, 0.0f);
  std::mt19937_64 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint64_t i = 0; i < n; ++i)
    pe[i] = p[i] = normal(rng);
  for (int t = 1; t <= 5; ++t) {
    for (float& x : g)
      x = normal(rng);
    const adam8bit::Hyper h = adam8bit::make_hyper(1e-3, 0.9, 0.95, 1e-8, 0.1, t);
    adam8bit::ParamRef ref;
    ref.data = p.data();
    ref.grad = g.data();
    ref.numel = n;
    adam8bit::step_f32(ref, m.data(), v.data(), h);
    for (uint64_t i = 0; i < n; ++i) {  // kernels/common/elementwise.h adamw_element
      me[i] = h.beta1 * me[i] + (1.0f - h.beta1) * g[i];
      ve[i] = h.beta2 * ve[i] + (1.0f - h.beta2) * g[i] * g[i];
      pe[i] = pe[i] - h.lr * ((me[i] / h.bias_correction1) /
                                  (std::sqrt(ve[i] / h.bias_correction2) + h.eps) +
                              h.weight_decay * pe[i]);
    }
  }
  EXPECT_EQ(std::memcmp(p.data(), pe.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), me.data(), n * 4), 0);
}

// ---------------------------------------------------------------------------------------------
// 5. Stochastic rounding (plugins/common/bf16.h)

// The double-precision emulation: the bf16 values below and above x (towards and away from zero),
// and rounding away from zero when the random fraction r / 2^16 is at least 1 - frac, frac being
// x's distance from the lower one over their spacing.
float emulate_stochastic(float x, uint32_t r) {
  const double ax = std::fabs(double(x));
  const float lo_f = bf::load(uint16_t(bf::f32_bits(std::fabs(x)) >> 16));  // truncated
  const double lo = lo_f;
  int e = 0;
  std::frexp(lo, &e);                         // lo = f 2^e, f in [0.5, 1)
  const double ulp = std::ldexp(1.0, e - 8);  // bf16: 8 significant bits
  const double frac = (ax - lo) / ulp;
  const bool up = double(r & 0xFFFF) / 65536.0 >= 1.0 - frac && frac > 0;
  const double out = up ? lo + ulp : lo;
  return float(std::copysign(out, double(x)));
}

TEST(Bf16Rounding, StochasticMatchesTheDoubleEmulationAndIsUnbiased) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> any(-4.0f, 4.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(any(rng), int(rng() % 60) - 30);
    const uint32_t r = uint32_t(rng());
    ASSERT_EQ(bf::load(bf::round_stochastic(x, r)), emulate_stochastic(x, r)) << x << " " << r;
  }
  // Unbiased: over N trials (element indices of one stream) the mean of the rounded value is x
  // within 5 standard errors, sigma = ulp sqrt(p (1 - p)) / sqrt(N).
  const int kTrials = 200000;
  for (float x : {1.0f + 1.0f / 1024, -3.14159f, 1e-20f * 1.2345f, 0.1f, 65504.123f}) {
    const uint64_t key = bf::stream_key(7, 3, 11);
    double sum = 0;
    for (int i = 0; i < kTrials; ++i)
      sum += bf::load(bf::round_stochastic(x, bf::random16_at(key, uint64_t(i))));
    const float lo = bf::load(uint16_t(bf::f32_bits(x) >> 16));
    const float hi = bf::load(uint16_t((bf::f32_bits(x) >> 16) + 1));
    const double ulp = std::fabs(double(hi) - lo), p = std::fabs(double(x) - lo) / ulp;
    const double se = ulp * std::sqrt(p * (1 - p) / kTrials);
    const double mean = sum / kTrials;
    std::printf("stochastic rounding of %.9g: mean %.9g, |bias| %.3g, standard error %.3g\n", x,
                mean, std::fabs(mean - x), se);
    EXPECT_LE(std::fabs(mean - double(x)), 5 * se + 1e-12 * std::fabs(x)) << x;
  }
  // Representable values, infinity and NaN are kept.
  EXPECT_EQ(bf::round_stochastic(1.5f, 0xFFFF), bf::round_nearest_even(1.5f));
  EXPECT_EQ(bf::round_stochastic(INFINITY, 0xFFFF), 0x7F80u);
  EXPECT_TRUE(std::isnan(bf::load(bf::round_stochastic(NAN, 0xFFFF))));
  // Counter-based: the same four numbers give the same bits, any of them changed others.
  EXPECT_EQ(bf::random16(1, 2, 3, 4), bf::random16_at(bf::stream_key(1, 2, 3), 4));
  int same = 0;
  for (uint64_t i = 0; i < 1000; ++i)
    same += bf::random16(1, 2, 3, i) == bf::random16(2, 2, 3, i);
  EXPECT_LT(same, 10) << "another seed, other bits";
}

// The bf16 weights path: bf16 weights and gradients, the update computed in f32 from the widened
// weights and stochastically rounded with the bits of (seed, step, tensor, element); the same
// seed gives bitwise the same weights, and updates far below a bf16 ulp still move the weights on
// average (round to nearest would leave them where they are).
TEST(Adam8bitKernel, Bf16WeightsAreStochasticallyRoundedAndSeeded) {
  const uint64_t n = 65536;
  Maps maps;
  auto run = [&](uint64_t seed, std::vector<float>* f32_next) {
    Q8 q(maps, n);
    std::vector<uint16_t> w(n, bf::round_nearest_even(1.0f)), g(n);
    for (uint64_t i = 0; i < n; ++i)
      g[i] = bf::round_nearest_even(i % 2 ? 0.5f : -0.25f);
    for (int t = 1; t <= 3; ++t) {
      std::vector<float> before(n);
      for (uint64_t i = 0; i < n; ++i)
        before[i] = bf::load(w[i]);
      adam8bit::ParamRef ref;
      ref.data = w.data();
      ref.dtype = HR_DTYPE_BF16;
      ref.grad = g.data();
      ref.grad_dtype = HR_DTYPE_BF16;
      ref.numel = n;
      adam8bit::Hyper h = adam8bit::make_hyper(1e-4, 0.9, 0.999, 1e-8, 0.0, t);
      h.round_key = bf::stream_key(seed, uint64_t(t), 0);
      // The same step in f32 on a copy: what the bf16 weights are a rounding of.
      Q8 qf(maps, n);
      qf.qm = q.qm;
      qf.qv = q.qv;
      qf.am = q.am;
      qf.av = q.av;
      std::vector<float> wf = before, gf(n);
      for (uint64_t i = 0; i < n; ++i)
        gf[i] = bf::load(g[i]);
      adam8bit::ParamRef rf;
      rf.data = wf.data();
      rf.grad = gf.data();
      rf.numel = n;
      adam8bit::step_8bit(rf, qf.st, h);
      adam8bit::step_8bit(ref, q.st, h);
      for (uint64_t i = 0; i < n; ++i)
        EXPECT_EQ(bf::load(w[i]), emulate_stochastic(wf[i], bf::random16(seed, t, 0, i)))
            << "step " << t << " element " << i;
      if (t == 3 && f32_next) *f32_next = wf;
    }
    return w;
  };
  std::vector<float> exact;
  const std::vector<uint16_t> a = run(42, &exact), b = run(42, nullptr), c = run(43, nullptr);
  EXPECT_EQ(a, b) << "same seed, bitwise the same weights";
  EXPECT_NE(a, c) << "another seed, other roundings";
  // Adam's first steps with a constant gradient move each weight by exactly lr = 1e-4 (m / sqrt(v)
  // = 1 after bias correction), 1/78 of bf16's ulp at 1 (2^-7): nearest rounding would keep every
  // weight at 1; stochastic rounding moves their mean to 1 + 3e-4, within 1e-4 (the standard
  // error over 32768 weights is about 2.5e-5).
  double mean_sr = 0, mean_f32 = 0;
  for (uint64_t i = 0; i < n; i += 2) {
    mean_sr += bf::load(a[i]);
    mean_f32 += 1.0 + 3e-4;  // even elements: gradient -0.25, three steps of lr upwards
  }
  mean_sr /= double(n / 2);
  mean_f32 /= double(n / 2);
  std::printf(
      "bf16 weights after 3 steps of +1e-4: mean %.6f (exact 1.0003; nearest rounding "
      "1.0)\n",
      mean_sr);
  EXPECT_NEAR(mean_sr, mean_f32, 1e-4);
}

// ---------------------------------------------------------------------------------------------
// 3. Training runs with the plugin

std::string model_toml(int n_layer = 2) {
  return "[model]\nn_layer = " + std::to_string(n_layer) +
         "\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n";
}

// AdamW's hyperparameters as adam8bit's defaults, so that the built-in AdamW is the reference.
std::string train_toml(int steps) {
  return "[train]\nsteps = " + std::to_string(steps) +
         "\nmicro_batch = 4\ngrad_accum = 1\nlr = 3e-3\nwarmup_steps = 5\n"
         "beta1 = 0.9\nbeta2 = 0.999\neps = 1e-8\nweight_decay = 0.01\n";
}

std::string plugin_toml(const std::string& keys = "") {
  return "[[plugins]]\nname = \"adam8bit\"\n" + keys;
}

struct Outcome {
  std::vector<StepState> history;
  std::vector<std::vector<float>> weights;
  std::vector<uint64_t> numels;  // every parameter tensor's
  std::vector<std::string> names;
  std::vector<uint32_t> decay;
  uint64_t optimizer_live = 0, optimizer_peak = 0;
};

Outcome run(const std::string& toml, TrainOptions options = {}) {
  Trainer t(test::config_from(toml), std::move(options));
  t.run();
  Outcome o;
  o.history = t.history();
  for (Param<float>* p : t.model().params()) {
    o.weights.emplace_back(p->master().value, p->master().value + p->numel);
    o.numels.push_back(p->numel);
    o.names.push_back(p->name);
    o.decay.push_back(p->decay ? 1u : 0u);
  }
  o.optimizer_live = t.device().tracker().live(Category::kOptimizer);
  o.optimizer_peak =
      t.device().tracker().peak_by_category()[static_cast<int>(Category::kOptimizer)];
  return o;
}

TEST(Adam8bitTrain, LossFallsCloseToFp32AdamW) {
  const Outcome f32 = run(model_toml() + train_toml(20));
  const Outcome q8 = run(model_toml() + train_toml(20) + plugin_toml("min_8bit_size = 1024\n"));
  ASSERT_EQ(q8.history.size(), 20u);
  const double a = f32.history.back().loss, b = q8.history.back().loss;
  std::printf("loss after 20 steps: AdamW %.5f, adam8bit %.5f (first %.4f), relative %.5f\n", a, b,
              q8.history.front().loss, std::fabs(b - a) / a);
  EXPECT_LT(b, q8.history.front().loss * 0.9) << "it trains";
  EXPECT_LT(std::fabs(b - a) / a, 0.01) << "within 1% of fp32 AdamW's loss after 20 steps";
}

// 2N steps = N, a snapshot, and N more from it: losses and weights bitwise.
TEST(Adam8bitTrain, ResumeIsBitwise) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(8) + plugin_toml("min_8bit_size = 1024\n");
  const Outcome whole = run(base);
  const std::string snap = "[snapshot]\nevery = 4\ndir = \"" + dir + "/s\"\n";
  run(model_toml() + train_toml(8) + plugin_toml("min_8bit_size = 1024\n") + snap,
      TrainOptions{});  // writes step 4 and step 8
  // Resume from step 4: keep only its snapshot.
  const SnapshotData d4 = read_snapshot(snapshot_file(dir + "/s", 4));
  ASSERT_TRUE(d4.plugins.count("adam8bit"));
  write_snapshot(dir + "/r", d4, 1);
  TrainOptions o;
  o.resume_dir = dir + "/r";
  const Outcome resumed =
      run(base + "[snapshot]\nevery = 100\ndir = \"" + dir + "/r\"\n", std::move(o));
  ASSERT_EQ(resumed.history.size(), 4u);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_EQ(resumed.history[i].loss, whole.history[4 + i].loss) << "step " << i + 5;
  ASSERT_EQ(resumed.weights.size(), whole.weights.size());
  for (size_t k = 0; k < whole.weights.size(); ++k)
    EXPECT_EQ(resumed.weights[k], whole.weights[k]) << "tensor " << k;
}

TEST(Adam8bitTrain, DamagedOrMismatchedStateIsAClearError) {
  const std::string dir = test::temp_dir();
  run(model_toml() + train_toml(2) + plugin_toml() + "[snapshot]\nevery = 2\ndir = \"" + dir +
      "/s\"\n");
  const SnapshotData good = read_snapshot(snapshot_file(dir + "/s", 2));
  struct Case {
    std::string name, keys, expect;
    std::function<void(std::vector<uint8_t>&)> damage;
  };
  const std::vector<Case> cases = {
      {"flipped", "", "is damaged: its checksum does not match",
       [](std::vector<uint8_t>& b) { b[b.size() / 2] ^= 0x40; }},
      {"truncated", "", "adam8bit: the snapshot's optimizer state",
       [](std::vector<uint8_t>& b) { b.resize(b.size() - 100); }},
      {"short", "", "shorter than its header", [](std::vector<uint8_t>& b) { b.resize(8); }},
      {"mismatched", "min_8bit_size = 100000\n", "was written with min_8bit_size = 4096",
       [](std::vector<uint8_t>&) {}},
  };
  for (const Case& c : cases) {
    SnapshotData d = good;
    c.damage(d.plugins.at("adam8bit"));
    write_snapshot(dir + "/" + c.name, d, 1);
    TrainOptions o;
    o.resume_dir = dir + "/" + c.name;
    try {
      Trainer t(test::config_from(model_toml() + train_toml(3) + plugin_toml(c.keys)),
                std::move(o));
      t.run();
      ADD_FAILURE() << c.name << ": expected a ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(test::contains(e.what(), c.expect)) << c.name << ": " << e.what();
      EXPECT_TRUE(test::contains(e.what(), "adam8bit")) << e.what();
    }
  }
}

TEST(Adam8bitPlugin, BadKeysExit2NamingTheKey) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(1);
  struct Bad {
    std::string keys, expect;
  };
  for (const Bad& bad : std::vector<Bad>{{"beta1 = 1.0\n", "beta1"},
                                         {"beta2 = -0.1\n", "beta2"},
                                         {"eps = 0.0\n", "eps"},
                                         {"weight_decay = -1.0\n", "weight_decay"},
                                         {"min_8bit_size = -5\n", "min_8bit_size"},
                                         {"block_size = 128\n", "must be 256"},
                                         {"seed = -1\n", "seed"},
                                         {"beta1 = \"high\"\n", "beta1"},
                                         {"betas = 0.9\n", "unknown key 'betas'"}}) {
    const std::string cfg = test::write_file(dir, "bad.toml", base + plugin_toml(bad.keys));
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the file: " << r.output;
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Bytes: the tracker's optimizer bytes after the first step are the closed form.

// Per tensor of n >= 4096 elements 2n bytes of codes and two fp32 absmax per 256-block; smaller
// ones fp32 m and v (8n); the two maps with their thresholds, 2 (256 + 255) f32.
uint64_t closed_form(const std::vector<uint64_t>& numels, uint64_t min8 = 4096) {
  uint64_t bytes = 2 * (256 + 255) * 4;
  for (uint64_t n : numels)
    bytes += n < min8 ? 8 * n : 2 * n + 2 * 4 * ((n + 255) / 256);
  return bytes;
}

// The plugin's own estimate (headroom.estimate/1, proposal mode: instance NULL), called directly
// from the built library with the run's parameter list (what the host's
// hr_estimate_model.param_tensors will carry) and a peak() that hands optimizer_bytes back.
uint64_t plugin_estimate(const Outcome& o) {
  const std::string bin = HEADROOM_BINARY;  // build/bin/headroom
  const std::string so = bin.substr(0, bin.rfind('/')) + "/../lib/headroom/plugins/adam8bit.so";
  void* lib = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    ADD_FAILURE() << "cannot load " << so << ": " << dlerror();
    return 0;
  }
  auto entry = reinterpret_cast<hr_plugin_entry_fn>(dlsym(lib, HR_PLUGIN_ENTRY_SYMBOL));
  char error[256] = "";
  hr_entry_args args{};
  args.struct_size = sizeof args;
  args.host_abi_min = HR_ABI_MAKE_VERSION(1, 0);
  args.host_abi_max = HR_ABI_VERSION;
  args.error = error;
  args.error_size = sizeof error;
  uint64_t out = 0;
  if (entry && entry(&args) == HR_OK) {
    const auto* ext =
        static_cast<const hr_ext_estimate*>(args.descriptor->get_extension(HR_EXT_ESTIMATE));
    std::vector<hr_estimate_param> params(o.numels.size());
    for (size_t i = 0; i < params.size(); ++i) {
      params[i] = hr_estimate_param{};
      params[i].struct_size = sizeof params[i];
      params[i].name = o.names[i].c_str();
      params[i].ndim = 1;
      params[i].shape[0] = int64_t(o.numels[i]);
      params[i].numel = o.numels[i];
      params[i].weight_decay = o.decay[i];
    }
    hr_estimate_model model{};
    model.struct_size = sizeof model;
    model.device_kind = "cpu";
    model.num_param_tensors = int32_t(params.size());
    model.param_tensors = params.data();
    hr_mechanisms before{};
    before.struct_size = sizeof before;
    before.optimizer_bytes = HR_OPTIMIZER_BYTES_BUILTIN;
    hr_mechanisms after = before;
    hr_estimate_query q{};
    q.struct_size = sizeof q;
    q.model = &model;
    q.before = &before;
    q.peak = [](void*, const hr_mechanisms* m, uint64_t* bytes) -> hr_status {
      bytes[HR_MEM_OPTIMIZER] = m->optimizer_bytes;
      return HR_OK;
    };
    hr_estimate_result r{};
    r.struct_size = sizeof r;
    r.after = &after;
    r.step_time_factor = 1.0;
    EXPECT_EQ(ext->estimate(nullptr, &q, &r), HR_OK);
    EXPECT_EQ(r.bytes[HR_MEM_OPTIMIZER], after.optimizer_bytes);
    out = after.optimizer_bytes;
  } else {
    ADD_FAILURE() << "hr_plugin_entry failed: " << error;
  }
  dlclose(lib);
  return out;
}

TEST(Adam8bitBytes, TrackerIsTheClosedFormOnA12LayerToy) {
  const std::string toml = model_toml(12) + train_toml(1) + plugin_toml();
  const Outcome o = run(toml);
  const uint64_t expect = closed_form(o.numels);
  const uint64_t psi = gpt_num_params(test::config_from(toml).model);
  std::printf(
      "12-layer toy: %llu parameters, adam8bit state %llu B (%.3f B per parameter; "
      "AdamW 8)\n",
      (unsigned long long)psi, (unsigned long long)o.optimizer_live,
      double(o.optimizer_live) / double(psi));
  EXPECT_EQ(o.optimizer_live, expect);
  EXPECT_EQ(o.optimizer_peak, expect);
  EXPECT_EQ(plugin_estimate(o), expect) << "the plugin's estimate";
}

TEST(Adam8bitBytes, TrackerIsTheClosedFormOnGpt2_124mShapes) {
#ifdef HEADROOM_SANITIZE_BUILD
  GTEST_SKIP() << "124M parameters: the release pass runs this, the sanitizer pass the toy";
#endif
  const std::string toml =
      "[model]\nn_layer = 12\nn_head = 12\nn_embd = 768\nseq_len = 32\nvocab_size = 50257\n"
      "[train]\nsteps = 1\nmicro_batch = 1\ngrad_accum = 1\n" +
      plugin_toml();
  const Outcome o = run(toml);
  const uint64_t expect = closed_form(o.numels);
  const uint64_t psi = gpt_num_params(test::config_from(toml).model);
  std::printf(
      "gpt2-124m shapes: %llu parameters, adam8bit state %llu B (%.4f B per parameter; "
      "AdamW %llu B)\n",
      (unsigned long long)psi, (unsigned long long)o.optimizer_live,
      double(o.optimizer_live) / double(psi), (unsigned long long)(8 * psi));
  EXPECT_EQ(o.optimizer_live, expect);
}

}  // namespace
}  // namespace headroom

namespace headroom {
namespace {

// The host's closed form with adam8bit's estimate (hr_mechanisms.optimizer_bytes from the
// parameter tensors) is the tracker's peak by category, beside amp's bf16 gradients, over two
// steps (the second's backward holds the state).
TEST(Adam8bitBytes, HostEstimateIsTheTrackersPeakWithAmp) {
  const std::string toml = model_toml(12) + train_toml(2) +
                           "[[plugins]]\nname = \"amp\"\ngrad_dtype = \"bf16\"\n" + plugin_toml();
  const Config c = test::config_from(toml);
  Trainer t(c, TrainOptions{});
  t.run();
  const ConfigEstimate e = estimate_config(c);
  ASSERT_EQ(e.plugins.size(), 2u);
  for (const PluginEstimate& pe : e.plugins)
    ASSERT_TRUE(pe.ok()) << pe.plugin << " status " << pe.status;
  const MemoryTracker& mt = t.device().tracker();
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.peak.total(), mt.peak_total());
}

// Where AdamW's state is what does not fit, the advice offers adam8bit (its proposal, estimated
// by the host's closed form with its bytes) and it fits as estimated.
TEST(Adam8bitBytes, ProposedWhenAdamWStateDoesNotFit) {
  const std::string model = model_toml(4) + "[train]\nsteps = 2\nmicro_batch = 2\n";
  const uint64_t with = estimate_config(test::config_from(model + plugin_toml())).peak.total();
  const uint64_t without = estimate_config(test::config_from(model)).peak.total();
  ASSERT_LT(with, without);
  // A quarter of what AdamW's state costs more as the margin: the arena needs holes that fit, not
  // just bytes.
  const std::string limit = "device.memory_limit=" + std::to_string(with + (without - with) / 4);
  const Config c = test::config_from(model, {limit});
  const Advice a = advise(c);
  ASSERT_FALSE(a.fits);
  const Remedy* r = nullptr;
  for (const Remedy& x : a.remedies)
    if (x.plugins == std::vector<std::string>{"adam8bit"}) r = &x;
  ASSERT_NE(r, nullptr) << format_remedies(a);
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->peak_after, with);
  Trainer t(test::config_from(model + plugin_toml(), {limit}), TrainOptions{});
  t.run();  // fits, as estimated
  EXPECT_EQ(t.device().tracker().peak_total(), with);
}

// Without fp32 masters (amp master_weights = false: bf16 weights and gradients) the plugin
// rounds its updates into the bf16 weights stochastically; 8 steps = 4, a snapshot and 4 more,
// bitwise, and the loss falls.
TEST(Adam8bitTrain, Bf16WeightsWithoutMastersResumeBitwise) {
  const std::string base = model_toml() + train_toml(8) +
                           "[[plugins]]\nname = \"amp\"\nmaster_weights = false\n" +
                           plugin_toml("min_8bit_size = 1024\n");
  Trainer whole(test::config_from(base), TrainOptions{});
  whole.run();
  EXPECT_LT(whole.history().back().loss, whole.history().front().loss);
  test::expect_resume_is_bitwise(base, whole);
}

}  // namespace
}  // namespace headroom
