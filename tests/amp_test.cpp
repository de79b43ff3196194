// The amp plugin, loaded by the real plugin host from the TOML list, driving the core's precision
// mechanism (compute dtype, compute copies, loss scale; ABI 1.4):
//  - bf16 halves the activation peak (from the tracker) and holds the model state of its closed
//    form; its loss after 300 steps is within 2% of fp32's;
//  - fp16 with init_scale 2^40 vetoes its first steps, backs off, then trains, and no NaN ever
//    reaches the weights; skipped_steps counts the vetoes;
//  - the scaler's state survives a snapshot; bad keys exit with code 2.
// (Checkpoint with amp: tests/checkpoint_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/events/events.h"
#include "core/model/model.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

std::string model_toml() {
  return "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n";
}

std::string train_toml(int steps) {
  return "[train]\nsteps = " + std::to_string(steps) +
         "\nmicro_batch = 4\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 10\n";
}

std::string amp_toml(const std::string& keys) {
  return "[[plugins]]\nname = \"amp\"\n" + keys;
}

// Every parameter finite after every step: what "no NaN reaches the weights" means.
struct FiniteWatcher final : EventListener {
  Trainer* trainer = nullptr;
  int64_t bad_steps = 0;
  void on_event(const EventInfo& e) override {
    if (e.event != Event::kStepEnd) return;
    for (Param<float>* p : trainer->model().params())
      for (uint64_t i = 0; i < p->numel; ++i)
        if (!std::isfinite(p->master().value[i])) {
          ++bad_steps;
          return;
        }
  }
};

struct Outcome {
  std::vector<StepState> history;
  ByCategory peak{};  // each category's own peak
  int64_t skipped = 0;
  int64_t nonfinite_weight_steps = 0;
};

Outcome run(const std::string& toml, TrainOptions options = {}) {
  Trainer t(test::config_from(toml), std::move(options));
  FiniteWatcher w;
  w.trainer = &t;
  t.add_listener(&w);
  t.run();
  Outcome o;
  o.history = t.history();
  o.peak = t.device().tracker().peak_by_category();
  o.skipped = t.skipped_steps();
  o.nonfinite_weight_steps = w.bad_steps;
  return o;
}

uint64_t peak(const Outcome& o, Category c) {
  return o.peak[static_cast<int>(c)];
}

TEST(AmpBf16, HalvesTheActivationPeakAndHoldsTheClosedFormModelState) {
  const Outcome f32 = run(model_toml() + train_toml(3));
  const Outcome bf16 = run(model_toml() + train_toml(3) + amp_toml("dtype = \"bf16\"\n"));
  const double ratio =
      double(peak(bf16, Category::kActivations)) / double(peak(f32, Category::kActivations));
  std::printf("activation peak: fp32 %llu B, bf16 %llu B, ratio %.4f\n",
              (unsigned long long)peak(f32, Category::kActivations),
              (unsigned long long)peak(bf16, Category::kActivations), ratio);
  EXPECT_NEAR(ratio, 0.50, 0.03);

  // Model state, Ψ parameters, amp's default grad_dtype = "fp32": the bf16 compute copy 2Ψ beside
  // the fp32 master 4Ψ; the fp32 gradients 4Ψ, accumulated over the micro-steps, and at the
  // peak (a layer's backward) that layer's and the tied wte's bf16 gradients of one micro-step;
  // AdamW's m and v 8Ψ. 18Ψ at rest (tests/model_state_test.cpp has the other layouts).
  const Config c = test::config_from(model_toml());
  const uint64_t psi = gpt_num_params(c.model);
  uint64_t most_micro = 0;  // the largest layer's and the embedding's bf16 gradients
  const std::vector<ParamShape> shapes = gpt_param_shapes(c.model);
  std::vector<uint64_t> layer(size_t(c.model.n_layer) + 2, 0);
  for (const ParamShape& p : shapes) {
    uint64_t n = 1;
    for (int64_t d : p.shape)
      n *= uint64_t(d);
    layer[size_t(p.layer)] += n;
  }
  for (size_t l = 1; l < layer.size(); ++l)
    most_micro = std::max(most_micro, 2 * (layer[l] + layer[0]));
  const uint64_t params = 2 * psi + 4 * psi, optim = 8 * psi;
  std::printf(
      "model state, psi = %llu: parameters 2psi + 4psi = %llu B, gradients 4psi = %llu B (+ at "
      "most %llu B of one layer's and the tied wte's bf16 ones in a backward), AdamW 8psi = %llu "
      "B, total 18psi = %llu B (fp32 without amp: 16psi = %llu B)\n",
      (unsigned long long)psi, (unsigned long long)params, (unsigned long long)(4 * psi),
      (unsigned long long)most_micro, (unsigned long long)optim, (unsigned long long)(18 * psi),
      (unsigned long long)(16 * psi));
  EXPECT_EQ(peak(bf16, Category::kParameters), params);
  EXPECT_GT(peak(bf16, Category::kGradients), 4 * psi);
  EXPECT_LE(peak(bf16, Category::kGradients), 4 * psi + most_micro);
  EXPECT_EQ(peak(bf16, Category::kOptimizer), optim);
  EXPECT_EQ(peak(f32, Category::kParameters), 4 * psi);
  EXPECT_EQ(peak(f32, Category::kGradients), 4 * psi);
}

TEST(AmpBf16, LossAfter300StepsIsWithinTwoPercentOfFp32) {
#ifdef HEADROOM_SANITIZE_BUILD
  GTEST_SKIP() << "300 steps of the same code: a numerical result the release pass checks; the "
                  "sanitizer pass runs every amp path in the shorter amp tests";
#endif
  const Outcome f32 = run(model_toml() + train_toml(300));
  const Outcome bf16 = run(model_toml() + train_toml(300) + amp_toml("dtype = \"bf16\"\n"));
  const double a = f32.history.back().loss, b = bf16.history.back().loss;
  std::printf("loss after 300 steps: fp32 %.5f, bf16 %.5f (first step %.4f), relative %.4f\n", a, b,
              f32.history.front().loss, std::fabs(b - a) / a);
  EXPECT_LT(a, f32.history.front().loss * 0.9) << "it trained";
  EXPECT_LT(std::fabs(b - a) / a, 0.02);
  EXPECT_EQ(bf16.skipped, 0) << "bf16 never scales, never skips";
  EXPECT_EQ(bf16.history.back().loss_scale, 1.0);
}

TEST(AmpFp16, HugeInitScaleVetoesBacksOffThenTrains) {
  const std::string dir = test::temp_dir();
  TrainOptions o;
  o.metrics_path = dir + "/metrics.jsonl";
  const Outcome r = run(
      model_toml() + train_toml(60) + amp_toml("dtype = \"fp16\"\ninit_scale = 1099511627776.0\n"),
      std::move(o));
  ASSERT_EQ(r.history.size(), 60u);
  // 2^40: the logits' gradient overflows fp16 (max 65504) at once. With hysteresis 2 the first
  // overflow keeps the scale, every later one halves it, until a step passes.
  EXPECT_TRUE(r.history[0].skipped);
  EXPECT_TRUE(r.history[1].skipped);
  EXPECT_EQ(r.history[0].loss_scale, std::ldexp(1.0, 40));
  EXPECT_EQ(r.history[1].loss_scale, std::ldexp(1.0, 40)) << "hysteresis: kept once";
  EXPECT_EQ(r.history[2].loss_scale, std::ldexp(1.0, 39));
  int64_t first_good = -1, skipped = 0;
  for (size_t i = 0; i < r.history.size(); ++i) {
    skipped += r.history[i].skipped;
    if (!r.history[i].skipped && first_good < 0) first_good = int64_t(i);
  }
  ASSERT_GT(first_good, 2) << "it backed off for a while";
  for (size_t i = size_t(first_good); i < r.history.size(); ++i)
    EXPECT_FALSE(r.history[i].skipped) << "step " << i + 1;
  const double settled = r.history[size_t(first_good)].loss_scale;
  std::printf("fp16 from 2^40: %lld steps skipped, trained from step %lld at scale 2^%g\n",
              (long long)skipped, (long long)first_good + 1, std::log2(settled));
  EXPECT_EQ(settled, std::ldexp(1.0, 40 - int(first_good) + 1));
  EXPECT_EQ(r.skipped, skipped);
  EXPECT_EQ(r.nonfinite_weight_steps, 0) << "no NaN reaches the weights";
  EXPECT_LT(r.history.back().loss, r.history[size_t(first_good)].loss * 0.95) << "then trains";

  // The metrics carry loss_scale and skipped_steps.
  std::ifstream in(dir + "/metrics.jsonl");
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(in, line))
    rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 60u);
  EXPECT_EQ(rows[2]["loss_scale"].get<double>(), std::ldexp(1.0, 39));
  EXPECT_EQ(rows.back()["skipped_steps"].get<int64_t>(), skipped);
}

TEST(AmpFp16, OverflowAtTheMinimumScaleStopsTheRun) {
  // min_scale = init_scale: the first overflow past the hysteresis cannot back off.
  const Config c = test::config_from(
      model_toml() + train_toml(10) +
      amp_toml("dtype = \"fp16\"\ninit_scale = 1099511627776.0\nmin_scale = 1099511627776.0\n"));
  Trainer t(c, TrainOptions{});
  try {
    t.run();
    FAIL() << "expected a PluginFailure";
  } catch (const PluginFailure& e) {
    EXPECT_TRUE(test::contains(e.what(), "minimum loss scale 2^40")) << e.what();
  }
  EXPECT_EQ(t.skipped_steps(), 1) << "the first overflow was absorbed by the hysteresis";
}

// The scale and its counters are in the snapshot: stopping at step 10 and resuming gives the
// uninterrupted run's losses and scales exactly.
TEST(AmpFp16, ScalerStateSurvivesASnapshot) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(24) +
                           amp_toml(
                               "dtype = \"fp16\"\ninit_scale = 1099511627776.0\n"
                               "growth_interval = 4\n");
  const Outcome whole = run(base);
  const std::string snap = "[snapshot]\nevery = 10\ndir = \"" + dir + "/s\"\n";
  {
    Trainer t(test::config_from(base + snap), TrainOptions{});
    struct Stop {};
    struct StopAt11 final : EventListener {
      void on_event(const EventInfo& e) override {
        if (e.event == Event::kStepBegin && e.step == 11) throw Stop{};
      }
    } stop;
    t.add_listener(&stop);
    try {
      t.run();
    } catch (const Stop&) {
    }
  }
  TrainOptions o;
  o.resume_dir = dir + "/s";
  const Outcome resumed = run(base + snap, std::move(o));
  ASSERT_EQ(resumed.history.size(), 14u);
  for (size_t i = 0; i < 14; ++i) {
    EXPECT_EQ(resumed.history[i].loss, whole.history[10 + i].loss) << "step " << i + 11;
    EXPECT_EQ(resumed.history[i].loss_scale, whole.history[10 + i].loss_scale) << "step " << i + 11;
  }
  EXPECT_EQ(resumed.skipped, whole.skipped);
}

// The demo (scripts/demo, README): examples/demo.toml runs out of memory with no plugins, and
// examples/demo-plugins.toml — the same file plus amp and checkpoint — fits the same limit.
TEST(Demo, OutOfMemoryWithoutPluginsFitsWithAmpAndCheckpoint) {
  const std::string src = HEADROOM_SOURCE_DIR;
  const Config plain = load_config(src + "/examples/demo.toml", {"train.steps=2"});
  const Config with = load_config(src + "/examples/demo-plugins.toml", {"train.steps=2"});
  ASSERT_TRUE(plain.plugins.empty());
  ASSERT_EQ(with.plugins.size(), 2u);
  EXPECT_EQ(with.plugins[0].name, "amp");
  EXPECT_EQ(with.plugins[1].name, "checkpoint");
  // Nothing else differs: the resolved configs print the same without the plugin tables.
  Config stripped = with;
  stripped.plugins.clear();
  stripped.file = plain.file;
  EXPECT_EQ(format_config(stripped), format_config(plain));

  Trainer oom(plain, TrainOptions{});
  EXPECT_THROW(oom.run(), OutOfMemory);
  Trainer fits(with, TrainOptions{});
  fits.run();
  EXPECT_LE(fits.device().tracker().peak_total(), with.device.memory_limit);
  std::printf("demo: peak %llu bytes with amp + checkpoint under the %llu-byte limit\n",
              (unsigned long long)fits.device().tracker().peak_total(),
              (unsigned long long)with.device.memory_limit);
}

TEST(AmpPlugin, BadKeysExit2NamingTheKey) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(1);
  struct Bad {
    std::string keys, expect;
  };
  for (const Bad& bad : std::vector<Bad>{
           {"dtype = \"fp8\"\n", "\"bf16\" or \"fp16\"; got \"fp8\""},
           {"dtype = 16\n", "dtype"},
           {"dtype = \"fp16\"\nmaster_weights = false\n", "master_weights"},
           {"grad_dtype = \"fp16\"\n", "grad_dtype"},
           {"state_dtype = \"int8\"\n", "state_dtype"},
           {"dtype = \"bf16\"\ninit_scale = 1024.0\n", "applies to dtype = \"fp16\" only"},
           {"dtype = \"fp16\"\nbackoff_factor = 1.5\n", "backoff_factor"},
           {"dtype = \"fp16\"\ngrowth_factor = 1.0\n", "growth_factor"},
           {"dtype = \"fp16\"\ngrowth_interval = 0\n", "growth_interval"},
           {"dtype = \"fp16\"\nhysteresis = 0\n", "hysteresis"},
           {"dtype = \"fp16\"\ninit_scale = -1.0\n", "init_scale"},
           {"dtype = \"fp16\"\nmin_scale = 1e9\ninit_scale = 4.0\n", "min_scale"},
           {"dtpye = \"bf16\"\n", "unknown key 'dtpye'"}}) {
    const std::string cfg = test::write_file(dir, "bad.toml", base + amp_toml(bad.keys));
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the file: " << r.output;
  }
}

}  // namespace
}  // namespace headroom
