// The CPU kernels fused or regrouped for issue 36, item 2, against the unfused ops, bitwise:
// LayerNorm by groups of rows against one row at a time (the code it replaced, kept here as the
// reference), the residual add fused with the next LayerNorm against add_inplace then
// layernorm_forward, GELU's backward fused with the bias gradient against gelu_backward then
// matmul_backward's bias gradient, in f32, f64, bf16 (kernels and backend) and f16 (backend), on 1
// and 3 threads, at row counts with group tails.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/device/backend.h"
#include "kernels/common/dtype.h"
#include "kernels/cpu/bf16_ops.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/residual.h"

#include "tests/cpu_threads.h"

namespace headroom {
namespace {

using U16 = std::vector<uint16_t>;

template <class T>
std::vector<T> random_vec(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (T& x : v)
    x = T(d(rng));
  return v;
}

U16 random_bf16(size_t n, uint32_t seed, float scale = 1.0f) {
  U16 v(n);
  const std::vector<float> f = random_vec<float>(n, seed, scale);
  for (size_t i = 0; i < n; ++i)
    v[i] = float_to_bf16(f[i]);
  return v;
}

template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(0, std::memcmp(&got[i], &want[i], sizeof(T)))
        << what << " differs at " << i << " of " << got.size() << ": " << double(got[i])
        << " != " << double(want[i]);
}

using Threads = test::CpuThreads;

// (N, C): row counts below, at and past a group of rows (4), with tails; widths with vector tails.
const int kShapes[][2] = {{1, 5}, {3, 17}, {8, 64}, {37, 77}, {64, 768}, {300, 100}};

// LayerNorm one row at a time, as layernorm.h computed it before the row groups: the reference.
template <class T>
void layernorm_forward_one_row(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                               const T* bias, int N, int C) {
  for (int n = 0; n < N; n++) {
    const T* x = inp + size_t(n) * C;
    T* y = out + size_t(n) * C;
    double sum = 0.0;
    for (int i = 0; i < C; i++)
      sum += x[i];
    const double m = sum / C;
    double sq = 0.0;
    for (int i = 0; i < C; i++) {
      const double d = x[i] - m;
      sq += d * d;
    }
    const double s = 1.0 / std::sqrt(sq / C + 1e-5);
    const T mT = T(m), sT = T(s);
    for (int i = 0; i < C; i++)
      y[i] = (x[i] - mT) * sT * weight[i] + bias[i];
    mean[n] = mT;
    rstd[n] = sT;
  }
}

// layernorm_backward's input gradient one row at a time (written over dres), the reference.
template <class T>
void layernorm_backward_dinp_one_row(T* dinp, const T* dout, const T* inp, const T* weight,
                                     const T* mean, const T* rstd, int N, int C, const T* dres) {
  for (int n = 0; n < N; n++) {
    const T* x = inp + size_t(n) * C;
    const T* dy = dout + size_t(n) * C;
    T* dx = dinp + size_t(n) * C;
    const T m = mean[n], s = rstd[n];
    double sum_dnorm = 0.0, sum_dnorm_norm = 0.0;
    for (int i = 0; i < C; i++) {
      const T norm = (x[i] - m) * s;
      const T dnorm = weight[i] * dy[i];
      sum_dnorm += dnorm;
      sum_dnorm_norm += static_cast<double>(dnorm) * norm;
    }
    const T mean_dnorm = T(sum_dnorm / C), mean_dnorm_norm = T(sum_dnorm_norm / C);
    for (int i = 0; i < C; i++) {
      const T norm = (x[i] - m) * s;
      const T dnorm = weight[i] * dy[i];
      dx[i] = dres[size_t(n) * C + i] + (dnorm - mean_dnorm - norm * mean_dnorm_norm) * s;
    }
  }
}

template <class T>
void check_layernorm_groups() {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nc : kShapes) {
      const int N = nc[0], C = nc[1];
      const size_t n = size_t(N) * C;
      const auto x = random_vec<T>(n, uint32_t(n) + 1, 3.0), w = random_vec<T>(C, 2),
                 b = random_vec<T>(C, 3), dy = random_vec<T>(n, 4, 0.1),
                 dres = random_vec<T>(n, 5, 0.1);
      std::vector<T> y(n), m(N), r(N), yr(n), mr(N), rr(N);
      cpu::layernorm_forward(y.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N, C);
      layernorm_forward_one_row(yr.data(), mr.data(), rr.data(), x.data(), w.data(), b.data(), N,
                                C);
      expect_same(y, yr, "layernorm_forward out");
      expect_same(m, mr, "layernorm_forward mean");
      expect_same(r, rr, "layernorm_forward rstd");
      std::vector<T> dx(n), dxr(n), dw(C), db(C);
      cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                              m.data(), r.data(), N, C, false, dres.data());
      layernorm_backward_dinp_one_row(dxr.data(), dy.data(), x.data(), w.data(), m.data(), r.data(),
                                      N, C, dres.data());
      expect_same(dx, dxr, "layernorm_backward dinp");
    }
  }
}

TEST(CpuFusedKernels, LayerNormRowGroupsAreOneRowAtATime) {
  check_layernorm_groups<float>();
  check_layernorm_groups<double>();
}

TEST(CpuFusedKernels, ResidualLayerNormIsAddThenLayerNormF32) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nc : kShapes) {
      const int N = nc[0], C = nc[1];
      const size_t n = size_t(N) * C;
      const auto res0 = random_vec<float>(n, uint32_t(n) + 6, 2.0),
                 x = random_vec<float>(n, 7, 2.0), w = random_vec<float>(C, 8),
                 b = random_vec<float>(C, 9);
      std::vector<float> res = res0, y(n), m(N), r(N);
      cpu::residual_layernorm_forward(y.data(), m.data(), r.data(), res.data(), x.data(), w.data(),
                                      b.data(), N, C);
      std::vector<float> rr = res0, yr(n), mr(N), rs(N);
      cpu::add_inplace(rr.data(), x.data(), n);
      cpu::layernorm_forward(yr.data(), mr.data(), rs.data(), rr.data(), w.data(), b.data(), N, C);
      expect_same(res, rr, "residual_layernorm_forward res");
      expect_same(y, yr, "residual_layernorm_forward out");
      expect_same(m, mr, "residual_layernorm_forward mean");
      expect_same(r, rs, "residual_layernorm_forward rstd");
    }
  }
}

TEST(CpuFusedKernels, ResidualLayerNormIsAddThenLayerNormBf16) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nc : kShapes) {
      const int N = nc[0], C = nc[1];
      const size_t n = size_t(N) * C;
      const U16 res0 = random_bf16(n, uint32_t(n) + 10, 2.0f), x = random_bf16(n, 11, 2.0f),
                w = random_bf16(C, 12), b = random_bf16(C, 13);
      U16 res = res0, y(n);
      std::vector<float> m(N), r(N);
      cpu::residual_layernorm_forward_bf16(y.data(), m.data(), r.data(), res.data(), x.data(),
                                           w.data(), b.data(), N, C);
      U16 rr = res0, yr(n);
      std::vector<float> mr(N), rs(N);
      cpu::add_inplace_bf16(rr.data(), x.data(), n);
      cpu::layernorm_forward_bf16(yr.data(), mr.data(), rs.data(), rr.data(), w.data(), b.data(), N,
                                  C);
      expect_same(res, rr, "residual_layernorm_forward_bf16 res");
      expect_same(y, yr, "residual_layernorm_forward_bf16 out");
      expect_same(m, mr, "residual_layernorm_forward_bf16 mean");
      expect_same(r, rs, "residual_layernorm_forward_bf16 rstd");
    }
  }
}

// The backend's op against its own add_inplace and layernorm_forward, in every float dtype.
TEST(CpuFusedKernels, BackendResidualLayerNormIsAddThenLayerNorm) {
  std::unique_ptr<Backend> be = make_cpu_backend(2);
  const int N = 37, C = 77;
  const size_t n = size_t(N) * C;
  for (Dtype dt : {Dtype::kF32, Dtype::kF64, Dtype::kBF16, Dtype::kF16}) {
    const size_t es = dtype_size(dt), ss = dtype_size(stat_dtype(dt));
    auto bytes = [&](size_t count, uint32_t seed, double scale) {
      const std::vector<double> d = random_vec<double>(count, seed, scale);
      std::vector<unsigned char> v(count * es);
      be->cast(v.data(), dt, d.data(), Dtype::kF64, count);
      return v;
    };
    const auto res0 = bytes(n, 20, 2.0), x = bytes(n, 21, 2.0), w = bytes(C, 22, 1.0),
               b = bytes(C, 23, 1.0);
    auto res = res0, rr = res0;
    std::vector<unsigned char> y(n * es), yr(n * es), m(N * ss), mr(N * ss), r(N * ss), rs(N * ss);
    be->residual_layernorm_forward(dt, y.data(), m.data(), r.data(), res.data(), x.data(), w.data(),
                                   b.data(), N, C);
    be->add_inplace(dt, rr.data(), x.data(), n);
    be->layernorm_forward(dt, yr.data(), mr.data(), rs.data(), rr.data(), w.data(), b.data(), N, C);
    const std::string name = dtype_name(dt);
    EXPECT_EQ(res, rr) << name << " res";
    EXPECT_EQ(y, yr) << name << " out";
    EXPECT_EQ(m, mr) << name << " mean";
    EXPECT_EQ(r, rs) << name << " rstd";
  }
}

// (N, OC): column counts below, at and past a block of columns (up to 1024), with vector tails.
const int kGeluShapes[][2] = {{1, 5}, {3, 17}, {37, 256}, {64, 300}, {300, 1030}, {40, 3072}};

TEST(CpuFusedKernels, GeluBackwardBiasIsGeluBackwardThenBiasGradF32) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nc : kGeluShapes) {
      const int N = nc[0], OC = nc[1];
      const size_t n = size_t(N) * OC;
      const auto x = random_vec<float>(n, uint32_t(n) + 30, 2.0),
                 dy = random_vec<float>(n, 31, 0.1), db0 = random_vec<float>(OC, 32, 0.1);
      std::vector<float> dx(n, -7.0f), db = db0;
      cpu::gelu_backward_bias(dx.data(), db.data(), x.data(), dy.data(), N, OC);
      std::vector<float> dxr(n, 3.0f), dbr = db0;
      cpu::gelu_backward(dxr.data(), x.data(), dy.data(), n, false);
      cpu::matmul_backward<float>(nullptr, nullptr, dbr.data(), dxr.data(), nullptr, nullptr, N, 1,
                                  OC);
      expect_same(dx, dxr, "gelu_backward_bias dinp");
      expect_same(db, dbr, "gelu_backward_bias dbias");
      std::vector<float> dxn(n);  // no bias gradient: gelu_backward alone
      cpu::gelu_backward_bias(dxn.data(), static_cast<float*>(nullptr), x.data(), dy.data(), N, OC);
      expect_same(dxn, dxr, "gelu_backward_bias dinp without dbias");
    }
  }
}

// The backend's op against its own gelu_backward and matmul_backward, in every float dtype.
TEST(CpuFusedKernels, BackendGeluBackwardBiasIsGeluBackwardThenBiasGrad) {
  std::unique_ptr<Backend> be = make_cpu_backend(2);
  const int N = 37, OC = 300;
  const size_t n = size_t(N) * OC;
  for (Dtype dt : {Dtype::kF32, Dtype::kF64, Dtype::kBF16, Dtype::kF16}) {
    const size_t es = dtype_size(dt);
    auto bytes = [&](size_t count, uint32_t seed, double scale) {
      const std::vector<double> d = random_vec<double>(count, seed, scale);
      std::vector<unsigned char> v(count * es);
      be->cast(v.data(), dt, d.data(), Dtype::kF64, count);
      return v;
    };
    const auto x = bytes(n, 40, 2.0), dy = bytes(n, 41, 0.1), db0 = bytes(OC, 42, 0.1);
    std::vector<unsigned char> dx(n * es), dxr(n * es);
    auto db = db0, dbr = db0;
    be->gelu_backward_bias(dt, dx.data(), db.data(), x.data(), dy.data(), N, OC);
    be->gelu_backward(dt, dxr.data(), x.data(), dy.data(), n, Grad::kWrite);
    be->matmul_backward(dt, nullptr, nullptr, dbr.data(), dxr.data(), nullptr, nullptr, N, 1, OC);
    const std::string name = dtype_name(dt);
    EXPECT_EQ(dx, dxr) << name << " dinp";
    EXPECT_EQ(db, dbr) << name << " dbias";
  }
}

}  // namespace
}  // namespace headroom
