// CPU reference kernels: every backward against central finite differences in double precision,
// plus the properties the gradient check cannot see (causality, stability, optimizer semantics,
// float vs double agreement).
//
// Gradient check method: for an op with output `out`, pick a random upstream gradient W with out's
// shape and let L = sum(out * W). backward(dout = W) must give dL/dx for every input and parameter
// x; the numeric gradient is (L(x + h) - L(x - h)) / 2h for every element of x. The gradient
// buffers are pre-filled with random values and the fill is subtracted afterwards, which also
// checks that backward ACCUMULATES (+=) rather than overwrites.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/elementwise.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/residual.h"

namespace {

namespace cpu = headroom::cpu;
using Vec = std::vector<double>;
using FVec = std::vector<float>;

constexpr double kFdStep = 1e-5;    // central-difference step
constexpr double kRelTol = 1e-6;    // norm-wise and per-element relative tolerance
constexpr double kAbsFloor = 1e-9;  // per-element absolute floor for entries near zero

Vec random_vec(std::mt19937_64& rng, size_t n, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (auto& x : v) {
    x = dist(rng);
  }
  return v;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, size_t n, int V) {
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) {
    x = dist(rng);
  }
  return v;
}

FVec to_float(const Vec& v) {
  return FVec(v.begin(), v.end());
}
Vec to_double(const FVec& v) {
  return Vec(v.begin(), v.end());
}

// sum(a * w), accumulated in long double so the sum's own rounding stays far below what the
// finite differences resolve.
double weighted_sum(const Vec& a, const Vec& w) {
  long double s = 0.0L;
  for (size_t i = 0; i < a.size(); i++) {
    s += static_cast<long double>(a[i]) * w[i];
  }
  return static_cast<double>(s);
}

// Central differences of loss() with respect to every element of x (x is restored afterwards).
Vec numeric_grad(Vec& x, const std::function<double()>& loss, double h = kFdStep) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    g[i] = (lp - lm) / (2.0 * h);
  }
  return g;
}

// after - before: what a backward added into a pre-filled gradient buffer.
Vec added(const Vec& after, const Vec& before) {
  Vec d(after.size());
  for (size_t i = 0; i < after.size(); i++) {
    d[i] = after[i] - before[i];
  }
  return d;
}

double norm(const Vec& v) {
  double s = 0.0;
  for (double x : v) {
    s += x * x;
  }
  return std::sqrt(s);
}

double rel_error(const Vec& a, const Vec& b) {
  double d = 0.0;
  for (size_t i = 0; i < a.size(); i++) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
  }
  return std::sqrt(d) / std::max(norm(b), 1e-12);
}

// Analytic vs numeric: norm-wise ||a - n|| / max(||n||, 1e-12) < 1e-6, and per element
// |a - n| <= 1e-6 max(|a|, |n|) + 1e-9. The numeric gradient must not be trivially zero, or the
// comparison would prove nothing.
void expect_grad_close(const Vec& analytic, const Vec& numeric, const std::string& what) {
  ASSERT_EQ(analytic.size(), numeric.size()) << what;
  EXPECT_GT(norm(numeric), 1e-3) << what << ": numeric gradient is (nearly) zero";
  EXPECT_LT(rel_error(analytic, numeric), kRelTol) << what;
  int bad = 0;
  for (size_t i = 0; i < analytic.size(); i++) {
    const double a = analytic[i], n = numeric[i];
    const double tol = kRelTol * std::max(std::fabs(a), std::fabs(n)) + kAbsFloor;
    if (std::fabs(a - n) > tol && bad++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: analytic " << a << " numeric " << n;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": elements out of tolerance";
}

void expect_rel_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_GT(norm(want), 0.0) << what;
  EXPECT_LT(rel_error(got, want), tol) << what;
}

// Shapes shared by the tests: small enough for a full finite-difference sweep.
constexpr int kB = 2, kT = 5, kC = 8, kNH = 2, kV = 11, kMaxT = 7;

// --- Gradient checks ---------------------------------------------------------------------------

TEST(CpuKernelsGrad, Embedding) {
  std::mt19937_64 rng(1);
  const int N = kB * kT;
  auto tokens = random_tokens(rng, N, kV);
  tokens[7] = tokens[2];  // a repeated token: its wte row must accumulate both contributions
  Vec wte = random_vec(rng, kV * kC), wpe = random_vec(rng, kMaxT * kC);
  const Vec W = random_vec(rng, N * kC);
  Vec out(N * kC);
  auto loss = [&] {
    cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), kB, kT, kC);
    return weighted_sum(out, W);
  };
  const Vec dwte0 = random_vec(rng, wte.size()), dwpe0 = random_vec(rng, wpe.size());
  Vec dwte = dwte0, dwpe = dwpe0;
  cpu::embedding_backward(dwte.data(), dwpe.data(), W.data(), tokens.data(), kB, kT, kC);
  expect_grad_close(added(dwte, dwte0), numeric_grad(wte, loss), "dwte");
  expect_grad_close(added(dwpe, dwpe0), numeric_grad(wpe, loss), "dwpe");
}

TEST(CpuKernelsGrad, Layernorm) {
  std::mt19937_64 rng(2);
  const int N = kB * kT;
  Vec inp = random_vec(rng, N * kC), weight = random_vec(rng, kC, 0.5, 1.5),
      bias = random_vec(rng, kC);
  const Vec W = random_vec(rng, N * kC);
  Vec out(N * kC), mean(N), rstd(N);
  auto loss = [&] {
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                           bias.data(), N, kC);
    return weighted_sum(out, W);
  };
  loss();  // fills mean, rstd at the unperturbed point
  const Vec mean0 = mean, rstd0 = rstd;
  const Vec dinp0 = random_vec(rng, inp.size()), dw0 = random_vec(rng, kC),
            db0 = random_vec(rng, kC);
  Vec dinp = dinp0, dw = dw0, db = db0;
  cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), W.data(), inp.data(), weight.data(),
                          mean0.data(), rstd0.data(), N, kC);
  expect_grad_close(added(dinp, dinp0), numeric_grad(inp, loss), "dinp");
  expect_grad_close(added(dw, dw0), numeric_grad(weight, loss), "dweight");
  expect_grad_close(added(db, db0), numeric_grad(bias, loss), "dbias");
}

TEST(CpuKernelsGrad, Matmul) {
  std::mt19937_64 rng(3);
  const int N = kB * kT, OC = 12;
  Vec inp = random_vec(rng, N * kC), weight = random_vec(rng, OC * kC), bias = random_vec(rng, OC);
  const Vec W = random_vec(rng, N * OC);
  Vec out(N * OC);
  auto loss = [&] {
    cpu::matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, kC, OC);
    return weighted_sum(out, W);
  };
  const Vec dinp0 = random_vec(rng, inp.size()), dw0 = random_vec(rng, weight.size()),
            db0 = random_vec(rng, OC);
  Vec dinp = dinp0, dw = dw0, db = db0;
  cpu::matmul_backward(dinp.data(), dw.data(), db.data(), W.data(), inp.data(), weight.data(), N,
                       kC, OC);
  expect_grad_close(added(dinp, dinp0), numeric_grad(inp, loss), "dinp");
  expect_grad_close(added(dw, dw0), numeric_grad(weight, loss), "dweight");
  expect_grad_close(added(db, db0), numeric_grad(bias, loss), "dbias");
}

TEST(CpuKernelsGrad, Attention) {
  std::mt19937_64 rng(4);
  for (int Tn : {kT, 10}) {  // 10: rows longer than the 8-lane reductions, with a tail
    const int C3 = 3 * kC;
    Vec qkv = random_vec(rng, kB * Tn * C3, -2.0, 2.0);  // wide enough for peaked softmax rows
    const Vec W = random_vec(rng, kB * Tn * kC);
    Vec out(kB * Tn * kC), att(kB * kNH * Tn * Tn);
    auto loss = [&] {
      cpu::attention_forward(out.data(), att.data(), qkv.data(), kB, Tn, kC, kNH);
      return weighted_sum(out, W);
    };
    loss();
    const Vec att0 = att;
    const Vec dqkv0 = random_vec(rng, qkv.size());
    Vec dqkv = dqkv0;
    // The scratch contents are documented as undefined on entry: NaNs must not leak through.
    Vec scratch(Tn * Tn, std::numeric_limits<double>::quiet_NaN());
    cpu::attention_backward(dqkv.data(), scratch.data(), W.data(), qkv.data(), att0.data(), kB, Tn,
                            kC, kNH);
    expect_grad_close(added(dqkv, dqkv0), numeric_grad(qkv, loss), "dqkv T=" + std::to_string(Tn));
  }
}

TEST(CpuKernelsGrad, Gelu) {
  std::mt19937_64 rng(5);
  const size_t N = 37;
  Vec inp = random_vec(rng, N, -4.0, 4.0);  // both tails and the curved middle
  const Vec W = random_vec(rng, N);
  Vec out(N);
  auto loss = [&] {
    cpu::gelu_forward(out.data(), inp.data(), N);
    return weighted_sum(out, W);
  };
  const Vec dinp0 = random_vec(rng, N);
  Vec dinp = dinp0;
  cpu::gelu_backward(dinp.data(), inp.data(), W.data(), N);
  expect_grad_close(added(dinp, dinp0), numeric_grad(inp, loss), "dinp");
}

TEST(CpuKernelsGrad, Residual) {
  std::mt19937_64 rng(6);
  const size_t N = 23;
  Vec a = random_vec(rng, N), b = random_vec(rng, N);
  const Vec W = random_vec(rng, N);
  Vec out(N);
  auto loss = [&] {
    cpu::residual_forward(out.data(), a.data(), b.data(), N);
    return weighted_sum(out, W);
  };
  // The residual's backward is the upstream gradient added into both branches.
  const Vec da0 = random_vec(rng, N), db0 = random_vec(rng, N);
  Vec da = da0, db = db0;
  cpu::add_inplace(da.data(), W.data(), N);
  cpu::add_inplace(db.data(), W.data(), N);
  expect_grad_close(added(da, da0), numeric_grad(a, loss), "da");
  expect_grad_close(added(db, db0), numeric_grad(b, loss), "db");
}

TEST(CpuKernelsGrad, CrossEntropy) {
  std::mt19937_64 rng(7);
  const int N = kB * kT;
  const double dloss = 0.37;  // not 1, so a missing dloss factor fails
  Vec logits = random_vec(rng, N * kV, -3.0, 3.0);
  auto targets = random_tokens(rng, N, kV);
  targets[1] = -1;  // ignored rows
  targets[6] = -100;
  Vec losses(N);
  auto loss = [&] {
    Vec work = logits;  // the kernel overwrites its input
    cpu::crossentropy_forward_backward(work.data(), losses.data(), targets.data(), N, kV, dloss);
    long double s = 0.0L;
    for (double l : losses) {
      s += l;
    }
    return static_cast<double>(dloss * s);
  };
  Vec dlogits = logits;
  cpu::crossentropy_forward_backward(dlogits.data(), losses.data(), targets.data(), N, kV, dloss);
  expect_grad_close(dlogits, numeric_grad(logits, loss), "dlogits");
  for (int n : {1, 6}) {
    EXPECT_EQ(losses[n], 0.0);
    for (int i = 0; i < kV; i++) {
      EXPECT_EQ(dlogits[n * kV + i], 0.0) << "ignored row " << n;
    }
  }
}

// --- Forward properties --------------------------------------------------------------------

// Straightforward triple-loop attention (llm.c's reference CPU version).
Vec naive_attention(const Vec& qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  Vec out(static_cast<size_t>(B) * Tn * C, 0.0);
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      for (int t = 0; t < Tn; t++) {
        const double* q = &qkv[(b * Tn + t) * 3 * C + h * hs];
        std::vector<double> w(t + 1);
        double maxv = -1e300;
        for (int j = 0; j <= t; j++) {
          const double* k = &qkv[(b * Tn + j) * 3 * C + C + h * hs];
          double s = 0.0;
          for (int i = 0; i < hs; i++) {
            s += q[i] * k[i];
          }
          w[j] = s / std::sqrt(static_cast<double>(hs));
          maxv = std::max(maxv, w[j]);
        }
        double sum = 0.0;
        for (int j = 0; j <= t; j++) {
          sum += (w[j] = std::exp(w[j] - maxv));
        }
        for (int j = 0; j <= t; j++) {
          const double* v = &qkv[(b * Tn + j) * 3 * C + 2 * C + h * hs];
          for (int i = 0; i < hs; i++) {
            out[(b * Tn + t) * C + h * hs + i] += w[j] / sum * v[i];
          }
        }
      }
    }
  }
  return out;
}

TEST(CpuKernelsAttention, ForwardMatchesNaive) {
  std::mt19937_64 rng(10);
  for (int Tn : {kT, 19}) {  // 19: rows longer than the 8-lane reductions, with a tail
    const int C = 12, NH = 3;
    const Vec qkv = random_vec(rng, kB * Tn * 3 * C, -2.0, 2.0);
    Vec out(kB * Tn * C), att(kB * NH * Tn * Tn);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), kB, Tn, C, NH);
    expect_rel_close(out, naive_attention(qkv, kB, Tn, C, NH), 1e-13, "attention out");
  }
}

TEST(CpuKernelsAttention, ProbabilitiesCausalAndNormalized) {
  std::mt19937_64 rng(11);
  const Vec qkv = random_vec(rng, kB * kT * 3 * kC, -2.0, 2.0);
  Vec out(kB * kT * kC);
  Vec att(kB * kNH * kT * kT, std::numeric_limits<double>::quiet_NaN());  // must be overwritten
  cpu::attention_forward(out.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
  for (int bh = 0; bh < kB * kNH; bh++) {
    for (int t = 0; t < kT; t++) {
      const double* row = &att[(bh * kT + t) * kT];
      double sum = 0.0;
      for (int j = 0; j <= t; j++) {
        EXPECT_GT(row[j], 0.0);
        sum += row[j];
      }
      EXPECT_NEAR(sum, 1.0, 1e-14) << "row " << t;
      for (int j = t + 1; j < kT; j++) {
        EXPECT_EQ(row[j], 0.0) << "bh " << bh << " t " << t;
      }
    }
  }
}

TEST(CpuKernelsAttention, FutureTokensDoNotChangePastOutputs) {
  std::mt19937_64 rng(12);
  const int C3 = 3 * kC, t0 = 3, b0 = 1;
  Vec qkv = random_vec(rng, kB * kT * C3, -2.0, 2.0);
  Vec out1(kB * kT * kC), out2(kB * kT * kC), att(kB * kNH * kT * kT);
  cpu::attention_forward(out1.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
  for (int i = 0; i < C3; i++) {  // q, k and v of one position
    qkv[(b0 * kT + t0) * C3 + i] += 0.5 + i * 0.01;
  }
  cpu::attention_forward(out2.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
  for (int b = 0; b < kB; b++) {
    for (int t = 0; t < kT; t++) {
      int changed = 0;
      for (int i = 0; i < kC; i++) {
        const size_t ix = (b * kT + t) * kC + i;
        if (b != b0 || t < t0) {
          EXPECT_EQ(out1[ix], out2[ix]) << "b " << b << " t " << t << " i " << i;
        }
        changed += out1[ix] != out2[ix];
      }
      // Non-tautology: the perturbation does reach the present and the future.
      if (b == b0 && t >= t0) {
        EXPECT_GT(changed, 0) << "t " << t;
      }
    }
  }
}

TEST(CpuKernelsCrossEntropy, LossMatchesDirectLogSoftmax) {
  std::mt19937_64 rng(13);
  const int N = 9, V = 17;
  const Vec logits = random_vec(rng, N * V, -4.0, 4.0);
  auto targets = random_tokens(rng, N, V);
  targets[4] = -1;
  Vec work = logits, losses(N);
  cpu::crossentropy_forward_backward(work.data(), losses.data(), targets.data(), N, V, 1.0);
  for (int n = 0; n < N; n++) {
    if (targets[n] < 0) {
      EXPECT_EQ(losses[n], 0.0);
      continue;
    }
    double z = 0.0;  // no max shift needed at these magnitudes
    for (int i = 0; i < V; i++) {
      z += std::exp(logits[n * V + i]);
    }
    const double want = -(logits[n * V + targets[n]] - std::log(z));
    EXPECT_NEAR(losses[n], want, 1e-13 * std::max(1.0, want)) << "row " << n;
    // The gradient with dloss = 1 is softmax - onehot.
    for (int i = 0; i < V; i++) {
      const double p = std::exp(logits[n * V + i]) / z - (i == targets[n] ? 1.0 : 0.0);
      EXPECT_NEAR(work[n * V + i], p, 1e-14) << "row " << n << " col " << i;
    }
  }
}

// Logits around 100 overflow exp() in float (max ~88.7) unless the row max is subtracted.
TEST(CpuKernelsCrossEntropy, StableForLargeFloatLogits) {
  std::mt19937_64 rng(14);
  const int N = 6, V = 50;
  const Vec base = random_vec(rng, N * V, -3.0, 3.0);
  FVec logits(N * V);
  for (size_t i = 0; i < logits.size(); i++) {
    logits[i] = static_cast<float>(100.0 + base[i]);
  }
  const auto targets = random_tokens(rng, N, V);
  const Vec exact_in = to_double(logits);  // the float inputs, exactly, in double
  FVec losses(N);
  cpu::crossentropy_forward_backward(logits.data(), losses.data(), targets.data(), N, V, 1.0f);
  Vec want_work = exact_in, want_losses(N);
  cpu::crossentropy_forward_backward(want_work.data(), want_losses.data(), targets.data(), N, V,
                                     1.0);
  for (int n = 0; n < N; n++) {
    ASSERT_TRUE(std::isfinite(losses[n]));
    EXPECT_NEAR(losses[n], want_losses[n], 1e-5 * std::max(1.0, want_losses[n]));
  }
  for (float g : logits) {
    ASSERT_TRUE(std::isfinite(g));
  }
  expect_rel_close(to_double(logits), want_work, 1e-5, "float dlogits vs double");
}

TEST(CpuKernelsEmbedding, ForwardIsTokenRowPlusPositionRow) {
  std::mt19937_64 rng(16);
  const auto tokens = random_tokens(rng, kB * kT, kV);
  const Vec wte = random_vec(rng, kV * kC), wpe = random_vec(rng, kMaxT * kC);
  Vec out(kB * kT * kC);
  cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), kB, kT, kC);
  for (int b = 0; b < kB; b++) {
    for (int t = 0; t < kT; t++) {
      for (int i = 0; i < kC; i++) {
        EXPECT_EQ(out[(b * kT + t) * kC + i], wte[tokens[b * kT + t] * kC + i] + wpe[t * kC + i]);
      }
    }
  }
}

TEST(CpuKernelsLayernorm, ForwardMatchesDirect) {
  std::mt19937_64 rng(15);
  const int N = 4, C = 16;
  const Vec inp = random_vec(rng, N * C, -3.0, 5.0), weight = random_vec(rng, C),
            bias = random_vec(rng, C);
  Vec out(N * C), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                         bias.data(), N, C);
  for (int n = 0; n < N; n++) {
    double m = 0.0, v = 0.0;
    for (int i = 0; i < C; i++) {
      m += inp[n * C + i] / C;
    }
    for (int i = 0; i < C; i++) {
      v += (inp[n * C + i] - m) * (inp[n * C + i] - m) / C;
    }
    const double s = 1.0 / std::sqrt(v + 1e-5);
    EXPECT_NEAR(mean[n], m, 1e-14);
    EXPECT_NEAR(rstd[n], s, 1e-13 * s);
    for (int i = 0; i < C; i++) {
      EXPECT_NEAR(out[n * C + i], (inp[n * C + i] - m) * s * weight[i] + bias[i], 1e-13);
    }
  }
}

TEST(CpuKernelsElementwise, ExpMinusAbsMatchesLibm) {
  // Dense sweep over the whole normal range, both signs.
  double worst = 0.0;
  for (int i = -880000; i <= 880000; i++) {
    const float x = static_cast<float>(i * 1e-4);
    const double want = std::exp(-std::fabs(static_cast<double>(x)));
    const float got = headroom::exp_minus_abs(x);
    if (std::fabs(x) <= 87.33f) {
      worst = std::max(worst, std::fabs(got - want) / want);
    } else {
      EXPECT_GT(got, 0.0f) << x;  // clamped at FLT_MIN, never 0, never garbage
      EXPECT_LE(got, 1.2e-38f) << x;
    }
  }
  EXPECT_LT(worst, 1.5e-7);                        // about 1 ulp (measured 8.3e-8)
  EXPECT_EQ(headroom::exp_minus_abs(0.0f), 1.0f);  // the row max gets exactly 1
  EXPECT_EQ(headroom::exp_minus_abs(-0.0f), 1.0f);
  EXPECT_LE(headroom::exp_minus_abs(-std::numeric_limits<float>::infinity()), 1.2e-38f);
  EXPECT_LE(headroom::exp_minus_abs(std::numeric_limits<float>::max()), 1.2e-38f);
  EXPECT_TRUE(std::isnan(headroom::exp_minus_abs(std::numeric_limits<float>::quiet_NaN())));
}

TEST(CpuKernelsGelu, MatchesFormula) {
  // Reference values from the formula in long double; gelu(0) = 0 and gelu(x) -> x, 0 in the tails.
  for (double x : {-6.0, -1.5, -0.3, 0.0, 0.2, 1.0, 3.0, 8.0}) {
    const long double xl = x;
    const long double u =
        std::sqrt(2.0L / 3.14159265358979323846L) * (xl + 0.044715L * xl * xl * xl);
    const double want = static_cast<double>(0.5L * xl * (1.0L + std::tanh(u)));
    EXPECT_NEAR(headroom::gelu_tanh(x), want, 1e-15) << x;
    EXPECT_NEAR(headroom::gelu_tanh(static_cast<float>(x)), want, 2e-6 * std::max(1.0, x)) << x;
  }
}

// --- GEMM and matmul -----------------------------------------------------------------------

template <class T>
void check_gemm_all_transposes(double tol) {
  std::mt19937_64 rng(20);
  const int M = 5, N = 7, K = 6, pad = 3;
  const T alpha = T(0.5), beta = T(2.0);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // Stored shapes with padded row strides, as when slicing heads out of qkv.
      const int a_rows = ta ? K : M, a_cols = ta ? M : K;
      const int b_rows = tb ? N : K, b_cols = tb ? K : N;
      const int lda = a_cols + pad, ldb = b_cols + pad, ldc = N + pad;
      const Vec A = random_vec(rng, a_rows * lda), Bm = random_vec(rng, b_rows * ldb);
      const Vec C0 = random_vec(rng, M * ldc);
      std::vector<T> At(A.begin(), A.end()), Bt(Bm.begin(), Bm.end()), Ct(C0.begin(), C0.end());
      cpu::gemm(ta, tb, M, N, K, alpha, At.data(), lda, Bt.data(), ldb, beta, Ct.data(), ldc);
      for (int i = 0; i < M; i++) {
        for (int j = 0; j < ldc; j++) {
          double want = C0[i * ldc + j];  // padding columns must stay untouched
          if (j < N) {
            double s = 0.0;
            for (int k = 0; k < K; k++) {
              const double a = ta ? A[k * lda + i] : A[i * lda + k];
              const double b = tb ? Bm[j * ldb + k] : Bm[k * ldb + j];
              s += a * b;
            }
            want = static_cast<double>(alpha) * s + static_cast<double>(beta) * want;
          }
          EXPECT_NEAR(static_cast<double>(Ct[i * ldc + j]), want, tol)
              << "ta " << ta << " tb " << tb << " (" << i << "," << j << ")";
        }
      }
    }
  }
}

TEST(CpuKernelsGemm, AllTransposesWithStridesDouble) {
  check_gemm_all_transposes<double>(1e-13);
}
TEST(CpuKernelsGemm, AllTransposesWithStridesFloat) {
  check_gemm_all_transposes<float>(1e-5);
}

TEST(CpuKernelsMatmul, ForwardMatchesNaive) {
  std::mt19937_64 rng(21);
  const int N = 6, C = 9, OC = 5;
  const Vec inp = random_vec(rng, N * C), weight = random_vec(rng, OC * C),
            bias = random_vec(rng, OC);
  Vec out(N * OC, std::numeric_limits<double>::quiet_NaN()), out_nb(N * OC);
  cpu::matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  cpu::matmul_forward<double>(out_nb.data(), inp.data(), weight.data(), nullptr, N, C, OC);
  for (int n = 0; n < N; n++) {
    for (int o = 0; o < OC; o++) {
      double s = 0.0;
      for (int c = 0; c < C; c++) {
        s += inp[n * C + c] * weight[o * C + c];
      }
      EXPECT_NEAR(out[n * OC + o], s + bias[o], 1e-14);
      EXPECT_NEAR(out_nb[n * OC + o], s, 1e-14);
    }
  }
}

TEST(CpuKernelsMatmul, BackwardSkipsNullGradients) {
  std::mt19937_64 rng(22);
  const int N = 6, C = 9, OC = 5;
  const Vec inp = random_vec(rng, N * C), weight = random_vec(rng, OC * C),
            dout = random_vec(rng, N * OC);
  Vec dinp(N * C, 0.0), dw_all(OC * C, 0.0), db(OC, 0.0), dw_only(OC * C, 0.0);
  cpu::matmul_backward(dinp.data(), dw_all.data(), db.data(), dout.data(), inp.data(),
                       weight.data(), N, C, OC);
  cpu::matmul_backward<double>(nullptr, dw_only.data(), nullptr, dout.data(), inp.data(),
                               weight.data(), N, C, OC);
  EXPECT_EQ(dw_only, dw_all);
  EXPECT_GT(norm(dw_only), 0.0);
}

TEST(CpuKernelsMatmul, FloatMatchesDouble) {
  std::mt19937_64 rng(23);
  const int N = 64, C = 96, OC = 80;
  const Vec inp = random_vec(rng, N * C), weight = random_vec(rng, OC * C),
            bias = random_vec(rng, OC), dout = random_vec(rng, N * OC);
  // Round the inputs to float first so both precisions see identical values.
  const FVec inp_f = to_float(inp), w_f = to_float(weight), b_f = to_float(bias),
             dout_f = to_float(dout);
  const Vec inp_d = to_double(inp_f), w_d = to_double(w_f), b_d = to_double(b_f),
            dout_d = to_double(dout_f);
  FVec out_f(N * OC);
  Vec out_d(N * OC);
  cpu::matmul_forward(out_f.data(), inp_f.data(), w_f.data(), b_f.data(), N, C, OC);
  cpu::matmul_forward(out_d.data(), inp_d.data(), w_d.data(), b_d.data(), N, C, OC);
  expect_rel_close(to_double(out_f), out_d, 1e-5, "matmul_forward float vs double");

  FVec dinp_f(N * C, 0.f), dw_f(OC * C, 0.f), db_f(OC, 0.f);
  Vec dinp_d(N * C, 0.0), dw_d(OC * C, 0.0), db_d(OC, 0.0);
  cpu::matmul_backward(dinp_f.data(), dw_f.data(), db_f.data(), dout_f.data(), inp_f.data(),
                       w_f.data(), N, C, OC);
  cpu::matmul_backward(dinp_d.data(), dw_d.data(), db_d.data(), dout_d.data(), inp_d.data(),
                       w_d.data(), N, C, OC);
  expect_rel_close(to_double(dinp_f), dinp_d, 1e-5, "dinp float vs double");
  expect_rel_close(to_double(dw_f), dw_d, 1e-5, "dweight float vs double");
  expect_rel_close(to_double(db_f), db_d, 1e-5, "dbias float vs double");
}

// Every other op in float against the same op in double on identical (float-rounded) inputs: the
// float instantiations compile and compute the same function.
TEST(CpuKernelsFloat, OpsMatchDouble) {
  std::mt19937_64 rng(24);
  const int N = kB * kT, C3 = 3 * kC;
  const double tol = 1e-5;
  auto f_and_d = [&](size_t n, double lo, double hi) {
    const FVec f = to_float(random_vec(rng, n, lo, hi));
    return std::make_pair(f, to_double(f));
  };
  const auto [dout_f, dout_d] = f_and_d(N * kC, -1, 1);
  {  // layernorm
    const auto [x_f, x_d] = f_and_d(N * kC, -2, 2);
    const auto [w_f, w_d] = f_and_d(kC, 0.5, 1.5);
    const auto [b_f, b_d] = f_and_d(kC, -1, 1);
    FVec y_f(N * kC), m_f(N), r_f(N), dx_f(N * kC, 0.f), dw_f(kC, 0.f), db_f(kC, 0.f);
    Vec y_d(N * kC), m_d(N), r_d(N), dx_d(N * kC, 0.0), dw_d(kC, 0.0), db_d(kC, 0.0);
    cpu::layernorm_forward(y_f.data(), m_f.data(), r_f.data(), x_f.data(), w_f.data(), b_f.data(),
                           N, kC);
    cpu::layernorm_forward(y_d.data(), m_d.data(), r_d.data(), x_d.data(), w_d.data(), b_d.data(),
                           N, kC);
    cpu::layernorm_backward(dx_f.data(), dw_f.data(), db_f.data(), dout_f.data(), x_f.data(),
                            w_f.data(), m_f.data(), r_f.data(), N, kC);
    cpu::layernorm_backward(dx_d.data(), dw_d.data(), db_d.data(), dout_d.data(), x_d.data(),
                            w_d.data(), m_d.data(), r_d.data(), N, kC);
    expect_rel_close(to_double(y_f), y_d, tol, "layernorm out");
    expect_rel_close(to_double(dx_f), dx_d, tol, "layernorm dinp");
    expect_rel_close(to_double(dw_f), dw_d, tol, "layernorm dweight");
    expect_rel_close(to_double(db_f), db_d, tol, "layernorm dbias");
  }
  {  // attention
    const auto [qkv_f, qkv_d] = f_and_d(N * C3, -2, 2);
    FVec o_f(N * kC), a_f(kB * kNH * kT * kT), s_f(kT * kT), dq_f(N * C3, 0.f);
    Vec o_d(N * kC), a_d(kB * kNH * kT * kT), s_d(kT * kT), dq_d(N * C3, 0.0);
    cpu::attention_forward(o_f.data(), a_f.data(), qkv_f.data(), kB, kT, kC, kNH);
    cpu::attention_forward(o_d.data(), a_d.data(), qkv_d.data(), kB, kT, kC, kNH);
    cpu::attention_backward(dq_f.data(), s_f.data(), dout_f.data(), qkv_f.data(), a_f.data(), kB,
                            kT, kC, kNH);
    cpu::attention_backward(dq_d.data(), s_d.data(), dout_d.data(), qkv_d.data(), a_d.data(), kB,
                            kT, kC, kNH);
    expect_rel_close(to_double(o_f), o_d, tol, "attention out");
    expect_rel_close(to_double(a_f), a_d, tol, "attention att");
    expect_rel_close(to_double(dq_f), dq_d, tol, "attention dqkv");
  }
  {  // embedding
    const auto tokens = random_tokens(rng, N, kV);
    const auto [wte_f, wte_d] = f_and_d(kV * kC, -1, 1);
    const auto [wpe_f, wpe_d] = f_and_d(kMaxT * kC, -1, 1);
    FVec o_f(N * kC), dwte_f(kV * kC, 0.f), dwpe_f(kMaxT * kC, 0.f);
    Vec o_d(N * kC), dwte_d(kV * kC, 0.0), dwpe_d(kMaxT * kC, 0.0);
    cpu::embedding_forward(o_f.data(), tokens.data(), wte_f.data(), wpe_f.data(), kB, kT, kC);
    cpu::embedding_forward(o_d.data(), tokens.data(), wte_d.data(), wpe_d.data(), kB, kT, kC);
    cpu::embedding_backward(dwte_f.data(), dwpe_f.data(), dout_f.data(), tokens.data(), kB, kT, kC);
    cpu::embedding_backward(dwte_d.data(), dwpe_d.data(), dout_d.data(), tokens.data(), kB, kT, kC);
    expect_rel_close(to_double(o_f), o_d, tol, "embedding out");
    expect_rel_close(to_double(dwte_f), dwte_d, tol, "embedding dwte");
    expect_rel_close(to_double(dwpe_f), dwpe_d, tol, "embedding dwpe");
  }
  {  // gelu, residual
    const auto [x_f, x_d] = f_and_d(N * kC, -4, 4);
    FVec y_f(N * kC), dx_f(N * kC, 0.f), r_f(N * kC);
    Vec y_d(N * kC), dx_d(N * kC, 0.0), r_d(N * kC);
    cpu::gelu_forward(y_f.data(), x_f.data(), y_f.size());
    cpu::gelu_forward(y_d.data(), x_d.data(), y_d.size());
    cpu::gelu_backward(dx_f.data(), x_f.data(), dout_f.data(), dx_f.size());
    cpu::gelu_backward(dx_d.data(), x_d.data(), dout_d.data(), dx_d.size());
    cpu::residual_forward(r_f.data(), x_f.data(), dout_f.data(), r_f.size());
    cpu::residual_forward(r_d.data(), x_d.data(), dout_d.data(), r_d.size());
    cpu::add_inplace(r_f.data(), y_f.data(), r_f.size());
    cpu::add_inplace(r_d.data(), y_d.data(), r_d.size());
    expect_rel_close(to_double(y_f), y_d, tol, "gelu out");
    expect_rel_close(to_double(dx_f), dx_d, tol, "gelu dinp");
    expect_rel_close(to_double(r_f), r_d, tol, "residual + add_inplace");
  }
}

// --- Optimizers and reductions -------------------------------------------------------------

struct AdamHyper {
  float lr, beta1, beta2, eps, wd;
};

// Scalar AdamW written as torch.optim.AdamW does it (decay first, then the step with the bias
// corrections folded into step size and denominator), independent of the kernel's arrangement.
void reference_adamw(Vec& p, const Vec& g, Vec& m, Vec& v, const AdamHyper& hp, int64_t t) {
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.wd;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
  for (size_t i = 0; i < p.size(); i++) {
    p[i] *= 1.0 - lr * wd;
    m[i] = b1 * m[i] + (1.0 - b1) * g[i];
    v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
    const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + eps;
    p[i] -= (lr / bc1) * m[i] / denom;
  }
}

TEST(CpuKernelsOptimizer, AdamWMatchesScalarReference) {
  std::mt19937_64 rng(30);
  const size_t n = 13;
  const AdamHyper hp{1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f};
  Vec p_ref = random_vec(rng, n), m_ref(n, 0.0), v_ref(n, 0.0);
  Vec p_d = p_ref, m_d(n, 0.0), v_d(n, 0.0);
  FVec p_f = to_float(p_ref), m_f(n, 0.f), v_f(n, 0.f);
  p_ref = p_d = to_double(p_f);  // identical starting point for all three
  for (int64_t t = 1; t <= 3; t++) {
    const FVec g_f = to_float(random_vec(rng, n, -2.0, 2.0));
    const Vec g = to_double(g_f);
    reference_adamw(p_ref, g, m_ref, v_ref, hp, t);
    cpu::adamw_update(p_d.data(), g.data(), m_d.data(), v_d.data(), n, hp.lr, hp.beta1, hp.beta2,
                      hp.eps, hp.wd, t);
    cpu::adamw_update(p_f.data(), g_f.data(), m_f.data(), v_f.data(), n, hp.lr, hp.beta1, hp.beta2,
                      hp.eps, hp.wd, t);
    for (size_t i = 0; i < n; i++) {
      EXPECT_NEAR(p_d[i], p_ref[i], 1e-14) << "step " << t << " i " << i;
      EXPECT_NEAR(m_d[i], m_ref[i], 1e-15);
      EXPECT_NEAR(v_d[i], v_ref[i], 1e-15);
      EXPECT_NEAR(p_f[i], p_ref[i], 2e-6) << "float step " << t << " i " << i;
    }
  }
}

TEST(CpuKernelsOptimizer, AdamWFirstStepIsBiasCorrected) {
  // With bias correction the first step is lr * sign(g) (up to eps) plus decay; without it, it
  // would be ~lr * 3.16. Pins down that t is used and that it is 1-based.
  double p = 0.5, g = -0.25, m = 0.0, v = 0.0;
  cpu::adamw_update(&p, &g, &m, &v, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  EXPECT_NEAR(p, 0.5 + static_cast<double>(0.1f), 1e-7);
}

void reference_sgd(Vec& p, const Vec& g, Vec* buf, double lr, double mu, double wd) {
  for (size_t i = 0; i < p.size(); i++) {
    double d = g[i] + wd * p[i];
    if (buf != nullptr) {
      (*buf)[i] = mu * (*buf)[i] + d;
      d = (*buf)[i];
    }
    p[i] -= lr * d;
  }
}

TEST(CpuKernelsOptimizer, SgdMatchesScalarReference) {
  for (bool with_momentum : {true, false}) {
    std::mt19937_64 rng(31);
    const size_t n = 11;
    const float lr = 0.1f, wd = 0.01f, mu = with_momentum ? 0.9f : 0.0f;
    const FVec p0 = to_float(random_vec(rng, n));
    Vec p_ref = to_double(p0), buf_ref(n, 0.0), p_d = p_ref, buf_d(n, 0.0);
    FVec p_f = p0, buf_f(n, 0.f);
    for (int step = 1; step <= 3; step++) {
      const FVec g_f = to_float(random_vec(rng, n, -2.0, 2.0));
      const Vec g = to_double(g_f);
      reference_sgd(p_ref, g, with_momentum ? &buf_ref : nullptr, lr, mu, wd);
      cpu::sgd_update(p_d.data(), g.data(), with_momentum ? buf_d.data() : nullptr, n, lr, mu, wd);
      cpu::sgd_update(p_f.data(), g_f.data(), with_momentum ? buf_f.data() : nullptr, n, lr, mu,
                      wd);
      for (size_t i = 0; i < n; i++) {
        EXPECT_NEAR(p_d[i], p_ref[i], 1e-14) << "momentum " << with_momentum << " step " << step;
        EXPECT_NEAR(p_f[i], p_ref[i], 2e-6) << "float, momentum " << with_momentum;
        if (with_momentum) {
          EXPECT_NEAR(buf_d[i], buf_ref[i], 1e-14);
        }
      }
    }
  }
}

TEST(CpuKernelsOptimizer, SumSquaresAccumulatesInDouble) {
  // 1e8 + 1000 * 1: a float accumulator would stay at 1e8 (float spacing there is 8).
  FVec x(1001, 1.0f);
  x[0] = 1e4f;
  EXPECT_EQ(cpu::sum_squares(x.data(), x.size()), 1e8 + 1000.0);
  const Vec y = {3.0, -4.0};
  EXPECT_EQ(cpu::sum_squares(y.data(), y.size()), 25.0);
}

TEST(CpuKernelsOptimizer, ScaleInplace) {
  FVec x = {1.0f, -2.0f, 0.5f};
  cpu::scale_inplace(x.data(), x.size(), 0.25f);
  EXPECT_EQ(x, (FVec{0.25f, -0.5f, 0.125f}));
}

}  // namespace
