// Prefetch benchmark: how long the loop waits for data with a deliberately slow source, inline
// (workers = 0) against prefetching workers, measured side by side in one run.
//
//   build/bin/bench_data_wait [--delay-ms D] [--steps N] [--workers W]
//
// The source is the synthetic Markov source with a sleep of D ms per batch, standing in for a
// slow disk or tokenizer. The model is sized so that a step computes for longer than D.

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include "core/run/trainer.h"

namespace {

using namespace headroom;

class SlowSource final : public DataSource {
 public:
  SlowSource(std::unique_ptr<DataSource> inner, int delay_ms)
      : inner_(std::move(inner)), delay_ms_(delay_ms) {}
  void next(int32_t* inputs, int32_t* targets, int B, int T) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    inner_->next(inputs, targets, B, T);
  }
  std::string describe() const override { return "slow " + inner_->describe(); }
  std::string state() const override { return inner_->state(); }
  void restore(const std::string& s) override { inner_->restore(s); }

 private:
  std::unique_ptr<DataSource> inner_;
  int delay_ms_;
};

struct Result {
  double wait_ms = 0, step_ms = 0;
};

Result measure(const Config& c, int workers, int delay_ms, int warmup) {
  Config cc = c;
  cc.data.workers = workers;
  TrainOptions o;
  o.data_source = std::make_unique<SlowSource>(
      make_data_source(cc.data, cc.model, cc.train.micro_batch, cc.model.seq_len), delay_ms);
  Trainer t(cc, std::move(o));
  t.run();
  Result r;
  int n = 0;
  for (const StepState& s : t.history()) {
    if (s.step <= warmup) continue;  // the queue fills during the first steps
    r.wait_ms += s.data_wait_ms;
    r.step_ms += s.step_ms;
    ++n;
  }
  r.wait_ms /= n;
  r.step_ms /= n;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"data_wait_ms with and without prefetching, on a deliberately slow source"};
  int delay_ms = 20, steps = 30, workers = 2, warmup = 3;
  app.add_option("--delay-ms", delay_ms, "sleep per batch in the source")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps, "optimizer steps per run")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "prefetch workers to compare with 0")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "first steps left out of the means")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (warmup >= steps) {
    std::fprintf(stderr, "bench_data_wait: --warmup must be below --steps\n");
    return 2;
  }

  const Config c = parse_config(
      "[model]\nn_layer = 4\nn_head = 4\nn_embd = 128\nseq_len = 128\nvocab_size = 256\n"
      "[train]\nsteps = " +
          std::to_string(steps) + "\nmicro_batch = 8\ngrad_accum = 2\n[data]\nprefetch = 4\n",
      "bench_data_wait");
  const Result inline_r = measure(c, 0, delay_ms, warmup);
  const Result prefetch_r = measure(c, workers, delay_ms, warmup);
  std::printf("source delay %d ms per batch, %d micro-batches per step, steps %d..%d measured\n",
              delay_ms, c.train.grad_accum, warmup + 1, steps);
  std::printf("%-22s %14s %14s\n", "", "data_wait_ms", "step_ms");
  std::printf("%-22s %14.2f %14.2f\n", "workers = 0 (inline)", inline_r.wait_ms, inline_r.step_ms);
  char label[32];
  std::snprintf(label, sizeof label, "workers = %d", workers);
  std::printf("%-22s %14.2f %14.2f\n", label, prefetch_r.wait_ms, prefetch_r.step_ms);
  std::printf("prefetching hides %.1f%% of the wait; steps are %.2fx faster\n",
              100.0 * (1.0 - prefetch_r.wait_ms / inline_r.wait_ms),
              inline_r.step_ms / prefetch_r.step_ms);
  return 0;
}
