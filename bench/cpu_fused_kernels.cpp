// The CPU kernels regrouped or fused for issue 36, item 2, against what they replace, kernel by
// kernel at a GPT-2 block's shapes (docs/results/cpu.md):
//
//   build/bin/bench_cpu_fused_kernels [--rows N] [--width C] [--reps R]
//
// LayerNorm a row at a time against by groups of rows (kernels/cpu/layernorm.h), add_inplace
// then LayerNorm against residual_layernorm_forward, gelu_backward then the bias gradient against
// gelu_backward_bias (f32; bf16 takes the two ops). On one thread, timed in the thread's CPU
// time (best of --reps after a warm-up call): on a machine other processes load, the CPU time a
// kernel needs is what stays comparable, where its wall time does not.

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <random>
#include <vector>

#include "kernels/common/dtype.h"
#include "kernels/cpu/bf16_ops.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/residual.h"

namespace {

using namespace headroom;

double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// CPU seconds of one call of f, best of reps after one warm-up call.
template <class F>
double best_of(int reps, F&& f) {
  f();
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    const double t0 = thread_seconds();
    f();
    best = std::min(best, thread_seconds() - t0);
  }
  return best;
}

std::vector<float> random_f32(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v)
    x = d(rng);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& f) {
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < f.size(); ++i)
    h[i] = float_to_bf16(f[i]);
  return h;
}

void row(const char* what, double before, double after) {
  std::printf("%-52s %9.3f ms %9.3f ms %6.2fx\n", what, before * 1e3, after * 1e3, before / after);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the CPU's fused and regrouped kernels against the ops they replace"};
  int N = 1024, C = 768, reps = 5;
  app.add_option("--rows", N, "rows (B T)")->check(CLI::PositiveNumber);
  app.add_option("--width", C, "the model's width C (the MLP's is 4 C)")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed calls, the best kept")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  cpu::set_threads(1);
  constexpr int R = cpu::detail::kLnRows;
  const size_t n = size_t(N) * C, n4 = 4 * n;
  const auto xf = random_f32(n, 1, 2.0f), af = random_f32(n, 2, 1.0f), wf = random_f32(C, 3, 1.0f),
             bf = random_f32(C, 4, 1.0f), dyf = random_f32(n, 5, 0.1f);
  const auto hf = random_f32(n4, 6, 2.0f), dhf = random_f32(n4, 7, 0.1f);
  const auto x = to_bf16(xf), a = to_bf16(af), w = to_bf16(wf), b = to_bf16(bf), dy = to_bf16(dyf);
  std::vector<uint16_t> y(n), res(n), dx(n), dw(C), db(C);
  std::vector<float> mean(N), rstd(N), yf(n), resf(n), dxf(n), dwf(C), dbf(C), dhf_out(n4),
      dbiasf(4 * size_t(C));

  std::printf("(N, C) = (%d, %d), MLP width %d; one thread, CPU time a call, best of %d\n", N, C,
              4 * C, reps);
  std::printf("%-52s %12s %12s %7s\n", "kernel", "before", "after", "ratio");
  // LayerNorm, bf16 and f32: a row at a time, then by groups of rows.
  row("bf16 layernorm_forward: 1 row / 4 rows at a time",
      best_of(reps,
              [&] {
                cpu::layernorm_forward_rows_bf16<1>(y.data(), mean.data(), rstd.data(), nullptr,
                                                    nullptr, x.data(), w.data(), b.data(), N, C);
              }),
      best_of(reps, [&] {
        cpu::layernorm_forward_rows_bf16<R>(y.data(), mean.data(), rstd.data(), nullptr, nullptr,
                                            x.data(), w.data(), b.data(), N, C);
      }));
  row("bf16 layernorm_backward: 1 row / 4 rows at a time",
      best_of(reps,
              [&] {
                cpu::layernorm_backward_rows_bf16<1>(dx.data(), dw.data(), db.data(), dy.data(),
                                                     x.data(), w.data(), mean.data(), rstd.data(),
                                                     N, C, false, a.data());
              }),
      best_of(reps, [&] {
        cpu::layernorm_backward_rows_bf16<R>(dx.data(), dw.data(), db.data(), dy.data(), x.data(),
                                             w.data(), mean.data(), rstd.data(), N, C, false,
                                             a.data());
      }));
  row("f32 layernorm_forward: 1 row / 4 rows at a time",
      best_of(reps,
              [&] {
                cpu::detail::layernorm_forward_rows<1, float>(yf.data(), mean.data(), rstd.data(),
                                                              nullptr, nullptr, xf.data(),
                                                              wf.data(), bf.data(), N, C);
              }),
      best_of(reps, [&] {
        cpu::detail::layernorm_forward_rows<R, float>(yf.data(), mean.data(), rstd.data(), nullptr,
                                                      nullptr, xf.data(), wf.data(), bf.data(), N,
                                                      C);
      }));
  row("f32 layernorm_backward: 1 row / 4 rows at a time",
      best_of(reps,
              [&] {
                cpu::layernorm_backward_rows<1, float>(
                    dxf.data(), dwf.data(), dbf.data(), dyf.data(), xf.data(), wf.data(),
                    mean.data(), rstd.data(), N, C, false, af.data());
              }),
      best_of(reps, [&] {
        cpu::layernorm_backward_rows<R, float>(dxf.data(), dwf.data(), dbf.data(), dyf.data(),
                                               xf.data(), wf.data(), mean.data(), rstd.data(), N, C,
                                               false, af.data());
      }));
  // The residual add and ln_2 (res is made again from x before each call: not timed apart, the
  // same copy on both sides).
  row("bf16 add_inplace + layernorm_forward / fused",
      best_of(reps,
              [&] {
                res = x;
                cpu::add_inplace_bf16(res.data(), a.data(), n);
                cpu::layernorm_forward_rows_bf16<R>(y.data(), mean.data(), rstd.data(), nullptr,
                                                    nullptr, res.data(), w.data(), b.data(), N, C);
              }),
      best_of(reps, [&] {
        res = x;
        cpu::layernorm_forward_rows_bf16<R>(y.data(), mean.data(), rstd.data(), res.data(),
                                            a.data(), res.data(), w.data(), b.data(), N, C);
      }));
  row("f32 add_inplace + layernorm_forward / fused",
      best_of(reps,
              [&] {
                resf = xf;
                cpu::add_inplace(resf.data(), af.data(), n);
                cpu::detail::layernorm_forward_rows<R, float>(yf.data(), mean.data(), rstd.data(),
                                                              nullptr, nullptr, resf.data(),
                                                              wf.data(), bf.data(), N, C);
              }),
      best_of(reps, [&] {
        resf = xf;
        cpu::detail::layernorm_forward_rows<R, float>(yf.data(), mean.data(), rstd.data(),
                                                      resf.data(), af.data(), resf.data(),
                                                      wf.data(), bf.data(), N, C);
      }));
  // GELU's backward over (N, 4C) and the fc layer's bias gradient.
  row("f32 gelu_backward + bias gradient / fused",
      best_of(reps,
              [&] {
                cpu::gelu_backward(dhf_out.data(), hf.data(), dhf.data(), n4, false);
                cpu::matmul_backward<float>(nullptr, nullptr, dbiasf.data(), dhf_out.data(),
                                            nullptr, nullptr, N, 1, 4 * C);
              }),
      best_of(reps, [&] {
        cpu::gelu_backward_bias(dhf_out.data(), dbiasf.data(), hf.data(), dhf.data(), N, 4 * C);
      }));
  return 0;
}
