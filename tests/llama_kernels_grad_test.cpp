// The Llama ops' CPU kernels (RMSNorm, SwiGLU, rotary embeddings): every backward against central
// finite differences in double, as tests/kernels_grad_test.cpp checks the GPT-2 ops. The gradient
// buffers are pre-filled with random values and the fill subtracted afterwards, which also checks
// that backward accumulates; the written (Grad::kWrite) variants are checked against it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/rope.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace {

namespace cpu = headroom::cpu;
using Vec = std::vector<double>;

constexpr double kFdStep = 1e-5;
constexpr double kRelTol = 1e-6;
constexpr double kAbsFloor = 1e-9;

Vec random_vec(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (auto& x : v)
    x = dist(rng);
  return v;
}

double weighted_sum(const Vec& a, const Vec& w) {
  long double s = 0.0L;
  for (size_t i = 0; i < a.size(); i++)
    s += static_cast<long double>(a[i]) * w[i];
  return static_cast<double>(s);
}

Vec numeric_grad(Vec& x, const std::function<double()>& loss) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double x0 = x[i];
    x[i] = x0 + kFdStep;
    const double lp = loss();
    x[i] = x0 - kFdStep;
    const double lm = loss();
    x[i] = x0;
    g[i] = (lp - lm) / (2.0 * kFdStep);
  }
  return g;
}

Vec added(const Vec& after, const Vec& before) {
  Vec d(after.size());
  for (size_t i = 0; i < after.size(); i++)
    d[i] = after[i] - before[i];
  return d;
}

double norm(const Vec& v) {
  double s = 0.0;
  for (double x : v)
    s += x * x;
  return std::sqrt(s);
}

void expect_grad_close(const Vec& analytic, const Vec& numeric, const std::string& what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  EXPECT_GT(norm(numeric), 1e-3) << what << ": numeric gradient is (nearly) zero";
  int bad = 0;
  for (size_t i = 0; i < analytic.size(); i++) {
    const double a = analytic[i], n = numeric[i];
    const double tol = kRelTol * std::max(std::fabs(a), std::fabs(n)) + kAbsFloor;
    if (std::fabs(a - n) > tol && bad++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << a << " numeric " << n;
  }
  EXPECT_EQ(bad, 0) << what << ": elements out of tolerance";
}

constexpr int kB = 2, kT = 5, kC = 8;

TEST(LlamaKernelsGrad, Rmsnorm) {
  std::mt19937_64 rng(1);
  const int N = kB * kT;
  const double eps = 1e-5;
  Vec inp = random_vec(rng, N * kC), weight = random_vec(rng, kC, 0.5, 1.5);
  const Vec W = random_vec(rng, N * kC);
  Vec out(N * kC), rstd(N);
  auto loss = [&] {
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, kC, eps);
    return weighted_sum(out, W);
  };
  loss();
  const Vec rstd0 = rstd;
  for (int n = 0; n < N; n++) {  // rstd is what its definition says
    double sq = 0.0;
    for (int i = 0; i < kC; i++)
      sq += inp[n * kC + i] * inp[n * kC + i];
    EXPECT_NEAR(rstd0[n], 1.0 / std::sqrt(sq / kC + eps), 1e-12);
  }
  const Vec dinp0 = random_vec(rng, inp.size()), dw0 = random_vec(rng, kC);
  Vec dinp = dinp0, dw = dw0;
  cpu::rmsnorm_backward(dinp.data(), dw.data(), W.data(), inp.data(), weight.data(), rstd0.data(),
                        N, kC);
  const Vec analytic = added(dinp, dinp0);
  expect_grad_close(analytic, numeric_grad(inp, loss), "dinp");
  expect_grad_close(added(dw, dw0), numeric_grad(weight, loss), "dweight");
  // Written with a residual gradient: dres + the same gradient.
  const Vec dres = random_vec(rng, inp.size());
  Vec written(inp.size(), 1e300), dw2(kC, 0.0);
  cpu::rmsnorm_backward(written.data(), dw2.data(), W.data(), inp.data(), weight.data(),
                        rstd0.data(), N, kC, false, dres.data());
  for (size_t i = 0; i < written.size(); i++)
    EXPECT_NEAR(written[i], dres[i] + analytic[i], 1e-12) << i;
}

TEST(LlamaKernelsGrad, Swiglu) {
  std::mt19937_64 rng(2);
  const int N = kB * kT, H = 6;
  Vec gu = random_vec(rng, size_t(N) * 2 * H, -3.0, 3.0);
  const Vec W = random_vec(rng, size_t(N) * H);
  Vec out(size_t(N) * H);
  auto loss = [&] {
    cpu::swiglu_forward(out.data(), gu.data(), N, H);
    return weighted_sum(out, W);
  };
  loss();
  for (int n = 0; n < N; n++)  // silu(gate) * up, by its definition
    for (int j = 0; j < H; j++) {
      const double g = gu[n * 2 * H + j], u = gu[n * 2 * H + H + j];
      EXPECT_NEAR(out[n * H + j], g / (1.0 + std::exp(-g)) * u, 1e-12);
    }
  const Vec dgu0 = random_vec(rng, gu.size());
  Vec dgu = dgu0;
  cpu::swiglu_backward(dgu.data(), gu.data(), W.data(), N, H);
  const Vec analytic = added(dgu, dgu0);
  expect_grad_close(analytic, numeric_grad(gu, loss), "dgate_up");
  Vec written(gu.size(), 1e300);
  cpu::swiglu_backward(written.data(), gu.data(), W.data(), N, H, false);
  for (size_t i = 0; i < written.size(); i++)
    EXPECT_NEAR(written[i], analytic[i], 1e-12) << i;
}

// Llama 3's scaling with a short original context, so that a head of 8 has a pair in each band:
// wavelengths 6.3 and 63 kept (< 250), 628 interpolated, 6283 divided by the factor (> 1000).
headroom::RopeParams scaled_rope() {
  headroom::RopeParams p;
  p.theta = 10000.0;
  p.factor = 8.0;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  p.original_max_position_embeddings = 1000.0;
  return p;
}

TEST(LlamaKernels, RopeScalingBands) {
  const headroom::RopeParams p = scaled_rope();
  EXPECT_DOUBLE_EQ(headroom::rope_inv_freq(0, 8, p), 1.0);
  EXPECT_DOUBLE_EQ(headroom::rope_inv_freq(1, 8, p), 0.1);
  const double inv = 0.01, smooth = (1000.0 / (2.0 * M_PI / inv) - 1.0) / 3.0;
  EXPECT_NEAR(headroom::rope_inv_freq(2, 8, p), (1.0 - smooth) * inv / 8.0 + smooth * inv, 1e-15);
  EXPECT_NEAR(headroom::rope_inv_freq(3, 8, p), 0.001 / 8.0, 1e-15);
  headroom::RopeParams plain;
  EXPECT_NEAR(headroom::rope_inv_freq(3, 8, plain), 0.001, 1e-15);
}

// The point of rotary embeddings: q_t · k_s depends on t - s only.
TEST(LlamaKernels, RopeScoresDependOnRelativePosition) {
  std::mt19937_64 rng(3);
  const int T = 7, NH = 1, NKV = 1, hs = 8, W = (NH + 2 * NKV) * hs;
  const Vec q = random_vec(rng, hs), k = random_vec(rng, hs);
  Vec x(size_t(T) * W);
  for (int t = 0; t < T; t++)
    for (int i = 0; i < hs; i++) {
      x[t * W + i] = q[i];
      x[t * W + hs + i] = k[i];
    }
  cpu::rope_forward(x.data(), 1, T, NH, NKV, hs, scaled_rope());
  auto score = [&](int t, int s) {
    double d = 0.0;
    for (int i = 0; i < hs; i++)
      d += x[t * W + i] * x[s * W + hs + i];
    return d;
  };
  EXPECT_NEAR(score(3, 1), score(6, 4), 1e-12);
  EXPECT_NEAR(score(2, 2), score(0, 0), 1e-12);
  EXPECT_GT(std::fabs(score(3, 1) - score(3, 3)), 1e-6);  // but it does depend on t - s
}

TEST(LlamaKernelsGrad, Rope) {
  std::mt19937_64 rng(4);
  const int NH = 4, NKV = 2, hs = 8, W = (NH + 2 * NKV) * hs;  // grouped-query layout
  Vec x = random_vec(rng, size_t(kB) * kT * W);
  const Vec Wt = random_vec(rng, x.size());
  Vec y(x.size());
  auto loss = [&] {
    y = x;
    cpu::rope_forward(y.data(), kB, kT, NH, NKV, hs, scaled_rope());
    return weighted_sum(y, Wt);
  };
  Vec dx = Wt;  // the gradient is the upstream one rotated back: v's columns pass unchanged
  cpu::rope_backward(dx.data(), kB, kT, NH, NKV, hs, scaled_rope());
  expect_grad_close(dx, numeric_grad(x, loss), "dqkv");
}

// Grouped-query attention in the tiled kernels: 4 query heads over 2 key/value heads, small tiles
// (many tiles, a diagonal one split), against central differences; and the forward against the
// naive kernel on the same heads with k and v repeated for each query head (what GQA means).
TEST(LlamaKernelsGrad, AttentionTiledGroupedQuery) {
  std::mt19937_64 rng(5);
  const int NH = 4, NKV = 2, hs = 2, C = NH * hs, KV = NKV * hs, Wd = C + 2 * KV, tile = 2;
  const int N = kB * kT;
  Vec qkv = random_vec(rng, size_t(N) * Wd);
  const Vec Wt = random_vec(rng, size_t(N) * C);
  Vec out(size_t(N) * C), lse(size_t(kB) * NH * kT);
  auto loss = [&] {
    cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), kB, kT, C, NH, tile, NKV);
    return weighted_sum(out, Wt);
  };
  loss();
  const Vec out0 = out, lse0 = lse;
  // The reference: k and v of group h / 2 copied to head h, a (B, T, 3C) qkv.
  Vec full(size_t(N) * 3 * C), ref(size_t(N) * C), att(size_t(kB) * NH * kT * kT);
  for (int n = 0; n < N; n++)
    for (int h = 0; h < NH; h++)
      for (int d = 0; d < hs; d++) {
        const double* row = qkv.data() + size_t(n) * Wd;
        double* f = full.data() + size_t(n) * 3 * C;
        f[h * hs + d] = row[h * hs + d];
        f[C + h * hs + d] = row[C + (h / 2) * hs + d];
        f[2 * C + h * hs + d] = row[C + KV + (h / 2) * hs + d];
      }
  cpu::attention_forward(ref.data(), att.data(), full.data(), kB, kT, C, NH);
  for (size_t i = 0; i < ref.size(); i++)
    EXPECT_NEAR(out0[i], ref[i], 1e-12) << i;
  const Vec dqkv0 = random_vec(rng, qkv.size());
  Vec dqkv = dqkv0;
  cpu::attention_tiled_backward(dqkv.data(), Wt.data(), qkv.data(), out0.data(), lse0.data(), kB,
                                kT, C, NH, tile, NKV);
  expect_grad_close(added(dqkv, dqkv0), numeric_grad(qkv, loss), "dqkv");
}

}  // namespace
