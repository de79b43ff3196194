// CPU training-step benchmark: tokens/s, and where the step time goes.
//
//   build/bin/bench_cpu_step CONFIG [--set section.key=value]... [--steps N] [--warmup W] [--quick]
//
// Runs W + N optimizer steps of the config through the real trainer and measures the last N:
// tokens/s, the share of step time inside the GEMM library's calls (timed around each call made
// outside a parallel region: the linear layers' and the head's), and, for the rest, each
// non-GEMM kernel timed on its own at the same shapes, times the number of calls a step makes.
// Then every GEMM shape the step called is timed alone through the same library (best of 3 after
// a warm-up call): the library's own sgemm rate on the step's shapes, against what the step got
// from it. Everything is measured in this one run, side by side. With amp bf16 the linear
// layers' GEMMs are bf16 (kernels/cpu/gemm_lowp.h: the `bf` rows), timed alone in bf16 too
// (without the forward's bias input). And every backend op the measured steps called, timed call
// by call with the conversions around it (cpu::OpProfile): where the non-GEMM time goes in the step
// itself. --quick prints only the step, its GEMM time and the ops.
//
// The environment picks the "before" of a fusion, the same bits: HEADROOM_CPU_FUSE=0 (LayerNorm
// a row at a time, the CPU's fused ops as the pairs they replace), HEADROOM_FUSE_CAST=0 (amp's
// compute copies cast after the optimizer's update, the `cast` op, instead of written by it).

#include <sys/resource.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/run/trainer.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/profile.h"

namespace {

using namespace headroom;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// User + system CPU seconds of the whole process (all its threads) so far.
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// Starts the GEMM profile and the clock when the first measured step begins.
class MeasureWindow final : public EventListener {
 public:
  explicit MeasureWindow(int64_t first_step) : first_step_(first_step) {}
  void on_event(const EventInfo& e) override {
    if (e.event == Event::kStepBegin && e.step == first_step_) {
      cpu::gemm_profile().reset();
      cpu::gemm_profile().enabled = true;
      cpu::op_profile().reset();
      cpu::op_profile().enabled = true;
      start_ = Clock::now();
      cpu_start_ = process_cpu_seconds();
    } else if (e.event == Event::kTrainEnd) {
      elapsed_ = seconds_since(start_);
      cpu_ = process_cpu_seconds() - cpu_start_;
      cpu::gemm_profile().enabled = false;
      cpu::op_profile().enabled = false;
    }
  }
  double elapsed() const { return elapsed_; }
  // The process's CPU time over the same window: on a machine other processes load, the work
  // the step did (with OMP_WAIT_POLICY=passive, no spinning at the barriers), where its wall time
  // is mostly waiting for a core.
  double cpu() const { return cpu_; }

 private:
  int64_t first_step_;
  Clock::time_point start_;
  double elapsed_ = 0.0, cpu_start_ = 0.0, cpu_ = 0.0;
};

std::vector<float> random_vector(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v)
    x = d(rng);
  return v;
}

// Seconds for one call of `f`, best of `reps` after one warm-up call.
template <class F>
double time_call(F&& f, int reps = 3) {
  f();
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, seconds_since(t0));
  }
  return best;
}

struct Row {
  std::string what;
  double seconds_per_step;
};

// Each non-GEMM kernel at the step's shapes, times its calls per optimizer step.
std::vector<Row> non_gemm_kernels(const Config& c, uint64_t num_params) {
  const int B = c.train.micro_batch, T = c.model.seq_len, C = c.model.n_embd;
  const int NH = c.model.n_head, V = c.model.vocab_size, L = c.model.n_layer;
  const int A = c.train.grad_accum;
  const size_t N = size_t(B) * T;
  std::mt19937 rng(1);
  std::vector<Row> rows;

  {  // LayerNorm: ln_1, ln_2 per block and ln_f, forward and backward
    auto x = random_vector(N * C, rng), w = random_vector(C, rng), b = random_vector(C, rng);
    std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C), dw(C), db(C);
    auto dout = random_vector(N * C, rng);
    const double s = time_call([&] {
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(),
                             int(N), C);
      cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), int(N), C);
    });
    rows.push_back({"layernorm fwd+bwd", s * (2 * L + 1) * A});
  }
  {  // GELU over (B, T, 4C) per block
    auto x = random_vector(N * 4 * C, rng), dout = random_vector(N * 4 * C, rng);
    std::vector<float> out(N * 4 * C), dx(N * 4 * C);
    const double s = time_call([&] {
      cpu::gelu_forward(out.data(), x.data(), N * 4 * C);
      cpu::gelu_backward(dx.data(), x.data(), dout.data(), N * 4 * C);
    });
    rows.push_back({"gelu fwd+bwd", s * L * A});
  }
  {  // Attention, less the GEMMs the profile records (none where they run inside its parallel
     // region, as with oneDNN and BLIS: then its per-head GEMMs are in this row)
    auto qkv = random_vector(N * 3 * C, rng), dout = random_vector(N * C, rng);
    std::vector<float> out(N * C), att(size_t(B) * NH * T * T), dqkv(N * 3 * C),
        scratch(size_t(T) * T);
    cpu::GemmProfile& p = cpu::gemm_profile();
    p.reset();
    p.enabled = true;
    const int reps = 3;
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i) {
      cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
      cpu::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B,
                              T, C, NH);
    }
    const double total = seconds_since(t0);
    p.enabled = false;
    rows.push_back({cpu::kGemmInParallel ? "attention fwd+bwd" : "attention softmax fwd+bwd",
                    (total - p.seconds) / reps * L * A});
  }
  {  // Fused softmax + cross-entropy over (B, T, V)
    auto logits = random_vector(N * V, rng);
    std::vector<float> work(N * V), losses(N);
    std::vector<int32_t> targets(N);
    for (auto& t : targets)
      t = int32_t(rng() % V);
    double s = 1e300;
    for (int i = 0; i < 3; ++i) {
      work = logits;  // the kernel overwrites its input
      const auto t0 = Clock::now();
      cpu::crossentropy_forward_backward(work.data(), losses.data(), targets.data(), int(N), V,
                                         1.0f / float(N));
      s = std::min(s, seconds_since(t0));
    }
    rows.push_back({"softmax + cross-entropy", s * A});
  }
  {  // AdamW over every parameter, plus the gradient norm
    auto p = random_vector(num_params, rng, 0.02f), g = random_vector(num_params, rng, 1e-3f);
    std::vector<float> m(num_params), v(num_params);
    int64_t t = 0;
    const double s = time_call([&] {
      cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), num_params, 1e-4f, 0.9f, 0.95f,
                        1e-8f, 0.1f, ++t);
      volatile double n = cpu::sum_squares(g.data(), num_params);
      (void)n;
    });
    rows.push_back({"adamw + grad norm", s});
  }
  return rows;
}

// One GEMM shape alone through the library, as the step calls it: seconds per call. After a
// warm-up call, 5 batches of back-to-back calls (each batch at least 20 ms, so that a thread's
// wake-up or a time slice lost to another process weighs little); the best batch's mean.
double gemm_alone(const cpu::GemmShape& g, std::mt19937& rng) {
  const size_t a = size_t(g.trans_a ? g.K : g.M) * g.lda;
  const size_t b = size_t(g.trans_b ? g.N : g.K) * g.ldb;
  auto A = random_vector(a, rng), B = random_vector(b, rng);
  auto C = random_vector(size_t(g.M) * g.ldc, rng);
  auto bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      h[i] = float_to_bf16(v[i]);
    return h;
  };
  const std::vector<uint16_t> A16 = g.lowp ? bf16(A) : std::vector<uint16_t>();
  const std::vector<uint16_t> B16 = g.lowp ? bf16(B) : std::vector<uint16_t>();
  std::vector<uint16_t> C16 = g.lowp ? bf16(C) : std::vector<uint16_t>();
  auto call = [&] {
    if (g.lowp) {
      cpu::gemm_lowp_or_widened(cpu::Lowp::kBF16, g.trans_a, g.trans_b, g.M, g.N, g.K, A16.data(),
                                g.lda, B16.data(), g.ldb, nullptr, g.accumulate, C16.data(), g.ldc);
      return;
    }
    cpu::gemm(g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, A.data(), g.lda, B.data(), g.ldb,
              g.accumulate ? 1.0f : 0.0f, C.data(), g.ldc);
  };
  const double once = time_call(call, 1);
  const int reps = std::max(1, int(0.02 / std::max(once, 1e-7)));
  double best = 1e300;
  for (int batch = 0; batch < 5; ++batch) {
    const auto t0 = Clock::now();
    for (int i = 0; i < reps; ++i)
      call();
    best = std::min(best, seconds_since(t0) / reps);
  }
  return best;
}

// The step's backend ops, op by op (matmul_* include their GEMMs), most expensive first.
void backend_ops(const cpu::OpProfile& profile, int steps, double step_s, double gemm_s) {
  std::vector<std::pair<std::string, cpu::GemmShapeStats>> ops(profile.ops.begin(),
                                                               profile.ops.end());
  std::sort(ops.begin(), ops.end(),
            [](const auto& x, const auto& y) { return x.second.seconds > y.second.seconds; });
  std::printf("\nBackend ops in the step (wall time per step, conversions included):\n");
  double all = 0.0;
  for (const auto& [name, st] : ops) {
    const double s = st.seconds / steps;
    all += s;
    std::printf("%-38s %7.0f calls %10.1f ms  %5.1f%%\n", name.c_str(), double(st.calls) / steps,
                s * 1e3, 100 * s / step_s);
  }
  std::printf("%-38s %10.1f ms  %5.1f%%\n", "all backend ops", all * 1e3, 100 * all / step_s);
  std::printf("%-38s %10.1f ms  %5.1f%%\n", "outside the backend's ops", (step_s - all) * 1e3,
              100 * (step_s - all) / step_s);
  std::printf("%-38s %10.1f ms  (GEMM %.1f ms)\n", "non-GEMM (step time minus GEMM)",
              (step_s - gemm_s) * 1e3, gemm_s * 1e3);
}

// The step's GEMMs shape by shape: in the step, and alone.
void gemm_shapes(const cpu::GemmProfile& profile, int steps) {
  struct Line {
    cpu::GemmShape g;
    cpu::GemmShapeStats st;
    double alone_s;
  };
  std::vector<Line> lines;
  std::mt19937 rng(2);
  for (const auto& [g, st] : profile.shapes)
    lines.push_back({g, st, gemm_alone(g, rng)});
  std::sort(lines.begin(), lines.end(),
            [](const Line& x, const Line& y) { return x.st.seconds > y.st.seconds; });
  std::printf("\nGEMM shapes (row-major C (M,N) = op(A) op(B); +C accumulates), per step:\n");
  std::printf("%-3s %-3s %6s %6s %6s %5s %7s %10s %12s %12s %7s\n", "opA", "opB", "M", "N", "K",
              "+C", "calls", "ms", "GFLOP/s step", "GFLOP/s alone", "step/alone");
  double in_step = 0.0, at_alone = 0.0, flops = 0.0;
  for (const Line& l : lines) {
    const double f = 2.0 * l.g.M * l.g.N * l.g.K;
    const double calls = double(l.st.calls) / steps, s = l.st.seconds / steps;
    in_step += s;
    at_alone += calls * l.alone_s;
    flops += calls * f;
    std::printf("%-3s %-3s %6d %6d %6d %5s %7.0f %10.1f %12.1f %12.1f %6.0f%%\n",
                l.g.trans_a ? "T" : "N", l.g.trans_b ? "T" : "N", l.g.M, l.g.N, l.g.K,
                l.g.lowp ? (l.g.accumulate ? "bf+C" : "bf") : (l.g.accumulate ? "+C" : ""), calls,
                s * 1e3, calls * f / s / 1e9, f / l.alone_s / 1e9,
                100 * (calls * f / s) / (f / l.alone_s));
  }
  std::printf("%-38s %10.1f %12.1f %12.1f %6.0f%%\n", "all shapes, as the step weighs them",
              in_step * 1e3, flops / in_step / 1e9, flops / at_alone / 1e9,
              100 * at_alone / in_step);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU training-step benchmark: tokens/s and where the step time goes"};
  std::string file;
  std::vector<std::string> sets;
  int steps = 3, warmup = 1;
  app.add_option("config", file, "the TOML config")->required();
  app.add_option("--set", sets, "override a config key: --set section.key=value");
  app.add_option("--steps", steps, "measured optimizer steps")->check(CLI::PositiveNumber);
  bool quick = false;
  app.add_flag("--quick", quick, "skip timing the kernels and the GEMM shapes alone");
  app.add_option("--warmup", warmup, "steps run before measuring")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    sets.push_back("train.steps=" + std::to_string(warmup + steps));
    sets.push_back("train.warmup_steps=0");
    const Config c = load_config(file, sets);
    // The trainer is gone before the kernels are timed alone: its data loader's threads would
    // compete with the OpenMP team for the cores.
    double elapsed = 0.0, cpu_seconds = 0.0;
    uint64_t num_params = 0, peak = 0;
    {
      Trainer trainer(c, TrainOptions{});
      MeasureWindow window(warmup + 1);
      trainer.add_listener(&window);
      trainer.run();
      elapsed = window.elapsed();
      cpu_seconds = window.cpu();
      num_params = trainer.model().num_params();
      peak = trainer.device().tracker().peak_total();
    }

    const double step_s = elapsed / steps;
    const double tokens = double(c.train.micro_batch) * c.model.seq_len * c.train.grad_accum;
    const cpu::GemmProfile gemm = cpu::gemm_profile();
    const cpu::OpProfile op_profile = cpu::op_profile();
    const double gemm_s = gemm.seconds / steps;
    std::printf("config: %s  n_layer=%d n_head=%d n_embd=%d seq_len=%d vocab=%d  %llu params\n",
                file.c_str(), c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.seq_len,
                c.model.vocab_size, (unsigned long long)num_params);
    std::printf(
        "batch: micro_batch %d x grad_accum %d = %.0f tokens/step; %d measured steps "
        "after %d warm-up\n",
        c.train.micro_batch, c.train.grad_accum, tokens, steps, warmup);
    std::printf("%-26s %8.1f ms\n", "step time", step_s * 1e3);
    std::printf("%-26s %8.1f\n", "tokens/s", tokens / step_s);
    std::printf("%-26s %8.1f ms  (user + system, all threads)\n", "process CPU time a step",
                cpu_seconds / steps * 1e3);
    std::printf("%-26s %11s\n", "peak memory", format_bytes(peak).c_str());
    std::printf("%-26s %8.1f ms  %5.1f%%  (%llu calls/step, %.1f GFLOP/s)\n", "GEMM (library)",
                gemm_s * 1e3, 100 * gemm_s / step_s,
                (unsigned long long)(gemm.calls / uint64_t(steps)),
                gemm.flops / gemm.seconds / 1e9);

    double accounted = gemm_s;
    for (const Row& r : quick ? std::vector<Row>() : non_gemm_kernels(c, num_params)) {
      std::printf("%-26s %8.1f ms  %5.1f%%\n", r.what.c_str(), r.seconds_per_step * 1e3,
                  100 * r.seconds_per_step / step_s);
      accounted += r.seconds_per_step;
    }
    const double other = step_s - accounted;
    std::printf(
        "%-26s %8.1f ms  %5.1f%%  (step time minus all of the above: embedding, "
        "residual adds, zeroing and copying gradients, allocation, data)\n",
        "other", other * 1e3, 100 * other / step_s);
    backend_ops(op_profile, steps, step_s, gemm_s);
    if (!quick) gemm_shapes(gemm, steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cpu_step: %s\n", e.what());
    return 2;
  }
  return 0;
}
