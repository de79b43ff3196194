// Memory-strategy plugin benchmark: peak bytes by category and step time, each plugin against the
// run without plugins.
//
//   build/bin/bench_plugins [CONFIG] [--set section.key=value]... [--steps N] [--warmup W]
//                           [--suite memory|model-state] [--only NAME]...
//
// --suite memory (the default): the activation and allocator strategies. --suite model-state: the
// model state's layouts (amp's grad_dtype, master_weights, state_dtype) and the optimizer plugins
// (adafactor, adam8bit), with the headline combinations, each against fp32 AdamW; its table adds
// the model state at rest (parameters + gradients + optimizer state after the run) in bytes a
// parameter.
//
// CONFIG defaults to bench/gpt2-124m.toml with model.seq_len=512 and train.micro_batch=4 (the
// --set overrides come after those, so they can change them). Each variant runs W + N optimizer
// steps of the same config through the real trainer, with the variant's [[plugins]] table
// appended to the config text, and measures the last N. The tracker's peak is over the whole run
// (warm-up included: the optimizer state is allocated in the first step and stays). Everything is
// measured in this one run, one variant after another, side by side, after one unmeasured step
// that warms up the process. --only keeps the variants whose name contains NAME (the first
// variant, the baseline, always runs: every ratio is against it). The table's "update" is the
// optimizer's step alone (MeasureWindow).

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/memory.h"
#include "core/run/trainer.h"

namespace {

using namespace headroom;
using Clock = std::chrono::steady_clock;

// Starts the clock when the first measured step begins, stops it at the end of training. In the
// measured steps it also sums the update: from OPTIMIZER_STEP to STEP_END as this listener (added
// after the plugins) sees them, which is the optimizer's step (the built-in AdamW's or a plugin's)
// and the STEP_END work of the plugins before it (amp's casts of the new weights).
class MeasureWindow final : public EventListener {
 public:
  explicit MeasureWindow(int64_t first_step) : first_step_(first_step) {}
  void on_event(const EventInfo& e) override {
    if (e.event == Event::kStepBegin && e.step == first_step_) {
      start_ = Clock::now();
    } else if (e.event == Event::kOptimizerStep && e.step >= first_step_) {
      update_start_ = Clock::now();
      in_update_ = true;
    } else if (e.event == Event::kStepEnd && in_update_) {
      update_ += std::chrono::duration<double>(Clock::now() - update_start_).count();
      in_update_ = false;
    } else if (e.event == Event::kTrainEnd) {
      elapsed_ = std::chrono::duration<double>(Clock::now() - start_).count();
    }
  }
  double elapsed() const { return elapsed_; }
  double update() const { return update_; }

 private:
  int64_t first_step_;
  Clock::time_point start_, update_start_;
  bool in_update_ = false;
  double elapsed_ = 0.0, update_ = 0.0;
};

struct Variant {
  std::string name;
  std::string plugins;  // TOML appended to the config; "" for the baseline
};

struct Result {
  ByCategory at_peak{};
  uint64_t peak_total = 0;
  uint64_t model_state = 0;  // parameters + gradients + optimizer state live after the run
  double step_s = 0.0;
  double update_s = 0.0;  // the optimizer's update a step (MeasureWindow)
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", double(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Memory-strategy plugins: peak bytes by category and step time against no plugins"};
  std::string file = "bench/gpt2-124m.toml";
  std::vector<std::string> sets;
  int steps = 2, warmup = 1;
  std::string suite = "memory";
  app.add_option("config", file, "the TOML config (default bench/gpt2-124m.toml)");
  app.add_option("--set", sets, "override a config key: --set section.key=value");
  app.add_option("--steps", steps, "measured optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "steps run before measuring")->check(CLI::NonNegativeNumber);
  app.add_option("--suite", suite, "which variants: memory (default) or model-state")
      ->check(CLI::IsMember({"memory", "model-state"}));
  std::vector<std::string> only;
  app.add_option("--only", only, "run only the variants whose name contains this (repeatable)");
  CLI11_PARSE(app, argc, argv);

  const std::string amp_bf16 = "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n";
  const std::string every = "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\"\n";
  const std::string selective = "[[plugins]]\nname = \"checkpoint\"\npolicy = \"selective\"\n";
  const std::string amp = "[[plugins]]\nname = \"amp\"\n";
  const std::string grad16 = amp + "grad_dtype = \"bf16\"\n";
  const std::string nomasters = amp + "master_weights = false\n";
  const std::string adam8 = "[[plugins]]\nname = \"adam8bit\"\n";
  const std::vector<Variant> model_state = {
      {"fp32 AdamW (no plugins)", ""},
      {"amp bf16, grad_dtype fp32", amp},
      {"amp bf16, grad_dtype bf16", grad16},
      {"amp, master_weights = false", nomasters},
      {"amp, master_weights = false, state_dtype bf16", nomasters + "state_dtype = \"bf16\"\n"},
      {"adafactor", "[[plugins]]\nname = \"adafactor\"\n"},
      {"adam8bit", adam8},
      {"amp grad bf16 + adam8bit + checkpoint every", grad16 + adam8 + every},
      {"amp no masters + adam8bit + checkpoint every", nomasters + adam8 + every},
      {"amp no masters + adafactor + checkpoint every",
       nomasters + "[[plugins]]\nname = \"adafactor\"\n" + every},
      {"amp no masters, bf16 state + checkpoint every",
       nomasters + "state_dtype = \"bf16\"\n" + every},
  };
  const std::vector<Variant> memory = {
      {"baseline (no plugins)", ""},
      {"checkpoint every", every},
      {"checkpoint sqrt", "[[plugins]]\nname = \"checkpoint\"\npolicy = \"sqrt\"\n"},
      {"checkpoint selective", selective},
      {"amp bf16", amp_bf16},
      {"amp fp16", "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n"},
      {"amp bf16 + checkpoint every", amp_bf16 + every},
      {"amp bf16 + checkpoint selective", amp_bf16 + selective},
      {"defrag_allocator", "[[plugins]]\nname = \"defrag_allocator\"\n"},
  };
  std::vector<Variant> variants;
  for (const Variant& v : suite == "memory" ? memory : model_state) {
    bool keep = variants.empty() || only.empty();
    for (const std::string& o : only)
      keep = keep || v.name.find(o) != std::string::npos;
    if (keep) variants.push_back(v);
  }

  try {
    // Our defaults first, so the caller's --set wins.
    std::vector<std::string> overrides = {"model.seq_len=512", "train.micro_batch=4"};
    overrides.insert(overrides.end(), sets.begin(), sets.end());
    overrides.push_back("train.steps=" + std::to_string(warmup + steps));
    overrides.push_back("train.warmup_steps=0");
    // The [[plugins]] tables go after everything else in the file: an array of tables can follow
    // any table, and a key after it would land in it.
    const std::string text = read_file(file) + "\n";

    // One unmeasured step of the baseline first: the first run in a process pays for faulting in
    // its heap (the device keeps freed blocks in it) and starting OpenBLAS's threads, which every
    // later run reuses. Without it the first variant measured, the baseline, is the slowest.
    {
      std::vector<std::string> once = overrides;
      once.push_back("train.steps=1");
      std::fprintf(stderr, "bench_plugins: warming up the process ...\n");
      Trainer warm(parse_config(text, file, once), TrainOptions{});
      warm.run();
    }

    std::vector<Result> results;
    Config shown;
    for (const Variant& v : variants) {
      const Config c = parse_config(text + v.plugins, file, overrides);
      shown = c;
      std::fprintf(stderr, "bench_plugins: %s ...\n", v.name.c_str());
      Trainer trainer(c, TrainOptions{});
      MeasureWindow window(warmup + 1);
      trainer.add_listener(&window);
      trainer.run();
      Result r;
      r.at_peak = trainer.device().tracker().live_at_peak();
      r.peak_total = trainer.device().tracker().peak_total();
      const ByCategory& live = trainer.device().tracker().live_by_category();
      r.model_state = live[size_t(Category::kParameters)] + live[size_t(Category::kGradients)] +
                      live[size_t(Category::kOptimizer)];
      r.step_s = window.elapsed() / steps;
      r.update_s = window.update() / steps;
      results.push_back(r);
    }

    const Config& c = shown;
    std::printf("config: %s  n_layer=%d n_head=%d n_embd=%d seq_len=%d vocab=%d\n", file.c_str(),
                c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.seq_len,
                c.model.vocab_size);
    std::printf("batch: micro_batch %d x grad_accum %d; %d measured steps after %d warm-up\n",
                c.train.micro_batch, c.train.grad_accum, steps, warmup);
    std::printf("peak: bytes live by category at the moment of the run's total peak, in MiB\n\n");

    // Only categories some variant holds at its peak get a column.
    std::vector<int> cats;
    for (int i = 0; i < kNumCategories; ++i)
      for (const Result& r : results)
        if (r.at_peak[size_t(i)] != 0) {
          cats.push_back(i);
          break;
        }
    std::printf("| variant |");
    for (int i : cats)
      std::printf(" %s |", category_name(category_at(i)));
    const uint64_t psi = gpt_num_params(c.model);
    const bool state_col = suite == "model-state";
    if (state_col) std::printf(" model state at rest | bytes / param |");
    std::printf(
        " peak total | peak vs baseline | step time | step vs baseline | update | update vs "
        "baseline |\n|---|");
    for (size_t i = 0; i < cats.size() + (state_col ? 2 : 0); ++i)
      std::printf("---:|");
    std::printf("---:|---:|---:|---:|---:|---:|\n");
    const Result& base = results.front();
    for (size_t k = 0; k < variants.size(); ++k) {
      const Result& r = results[k];
      std::printf("| %s |", variants[k].name.c_str());
      for (int i : cats)
        std::printf(" %s |", mib(r.at_peak[size_t(i)]).c_str());
      if (state_col)
        std::printf(" %s | %.2f |", mib(r.model_state).c_str(),
                    double(r.model_state) / double(psi));
      std::printf(" %s | %.3f | %.2f s | %.3f | %.3f s | %.3f |\n", mib(r.peak_total).c_str(),
                  double(r.peak_total) / double(base.peak_total), r.step_s, r.step_s / base.step_s,
                  r.update_s, r.update_s / base.update_s);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_plugins: %s\n", e.what());
    return 2;
  }
  return 0;
}
