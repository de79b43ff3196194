// arch = "llama" (issue 33): the presets' parameter counts against the published ones, the config's
// Llama keys and their errors, the whole model's gradient against central differences in double
// (grouped-query attention, untied and tied, with and without Llama 3's rope scaling), training
// lowering the loss, activation checkpointing bitwise, amp, the planner's closed forms against
// the tracker byte for byte, and structured pruning (SwiGLU units, whole KV groups) removing
// exactly what it names.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/device/device.h"
#include "core/events/events.h"
#include "core/model/model.h"
#include "core/plan/measure.h"
#include "core/plan/plan.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// ---------------------------------------------------------------------------------------------
// Presets and config

// The published counts (Hugging Face's model cards / num_parameters()), and the formula
// written out independently of model.cpp: V·C·(tied ? 1 : 2) + L·(2C + 2C² + 2·KV·C + 3·I·C) + C.
TEST(LlamaPresets, ParameterCountsAreThePublishedOnes) {
  struct Case {
    const char* preset;
    uint64_t published;
  };
  for (const Case& c : {Case{"smollm2-135m", 134515008}, Case{"tinyllama-1.1b", 1100048384},
                        Case{"llama-3.2-1b", 1235814400}, Case{"llama-3.1-8b", 8030261248}}) {
    const Config config =
        parse_config("[model]\npreset = \"" + std::string(c.preset) + "\"\n", "p");
    const ModelConfig& m = config.model;
    EXPECT_EQ(m.arch, "llama") << c.preset;
    const uint64_t V = m.vocab_size, C = m.n_embd, L = m.n_layer, I = m.intermediate_size;
    const uint64_t KV = uint64_t(m.kv_heads()) * (C / m.n_head);
    const uint64_t formula =
        V * C * (m.tie_embeddings ? 1 : 2) + L * (2 * C + 2 * C * C + 2 * KV * C + 3 * I * C) + C;
    EXPECT_EQ(formula, c.published) << c.preset;
    EXPECT_EQ(gpt_num_params(m), c.published) << c.preset;
    uint64_t shapes = 0;
    for (const ParamShape& p : gpt_param_shapes(m)) {
      uint64_t n = 1;
      for (int64_t d : p.shape)
        n *= uint64_t(d);
      shapes += n;
    }
    EXPECT_EQ(shapes, c.published) << c.preset;
    std::printf("%s: %llu parameters\n", c.preset, (unsigned long long)gpt_num_params(m));
  }
}

// `headroom plan` on the 8B shape is closed form: no allocation, and it names the count.
TEST(LlamaPresets, PlanOnLlama31_8bPrintsItsCountWithoutAllocating) {
  const Config c =
      test::config_from("[model]\npreset = \"llama-3.1-8b\"\n[train]\nmicro_batch = 1\n");
  const PlanResult r = plan(c);
  EXPECT_TRUE(test::contains(r.text, "8030261248 parameters")) << r.text;
  EXPECT_TRUE(test::contains(r.text, "arch llama")) << r.text;
  const ConfigEstimate e = estimate_config(c);
  // f32 masters and gradients, AdamW's two moments: 16 bytes a parameter at least.
  EXPECT_GE(e.peak.total(), 16 * uint64_t(8030261248));
}

// `headroom plan --measure` on the 8B shapes: the dry runs map their buffers without backing and
// write no values (core/device/dry_backend.h), so a host of a few GiB measures a model of 131 GiB,
// in seconds. The dry run's bytes by category are the closed form's, for "none", amp +
// checkpoint, adam8bit and adafactor; the child's peak resident memory (wait4's ru_maxrss) is far
// below them.
TEST(LlamaPresets, PlanMeasureOnLlama31_8bRunsDryInLittleHostMemoryAndIsTheClosedForm) {
  // ru_maxrss counts the test process's own pages at the spawn (the child starts as its copy):
  // meaningful only while those are few, as when ctest runs this test alone.
  const uint64_t limit = uint64_t(1) << 30;
  {
    std::ifstream status("/proc/self/status");
    std::string line;
    uint64_t rss_kb = 0;
    while (std::getline(status, line))
      if (line.rfind("VmRSS:", 0) == 0) rss_kb = std::stoull(line.substr(6));
    if (rss_kb * 1024 > limit / 2)
      GTEST_SKIP() << "this process already holds " << rss_kb
                   << " KiB: the child's peak would be ours (run the test alone)";
  }
  const std::string dir = test::temp_dir();
  const std::string model =
      "[model]\npreset = \"llama-3.1-8b\"\nseq_len = 2048\n[train]\nmicro_batch = 1\n";
  const std::pair<const char*, std::string> remedies[] = {
      {"none", ""},
      {"amp_checkpoint", "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"},
      // Optimizers whose update loops are their own: they skip them in a dry run (ABI 1.7,
      // hr_step_state.dry), or the run would write every page of the 8B model.
      {"adam8bit", "[[plugins]]\nname = \"adam8bit\"\n"},
      {"adafactor", "[[plugins]]\nname = \"adafactor\"\n"},
      // zero3's shards in the host ledger: a dry run reads no values back into them
      // (Sharding::to_rest), or it would write every page of the host's 137 GiB.
      {"amp_checkpoint_parameters_on_the_host",
       "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n[[plugins]]\nname = "
       "\"zero3\"\n[[plugins]]\nname = \"offload\"\noptimizer = \"host\"\nparameters = \"host\"\n"},
  };
  for (const auto& [name, plugins] : remedies) {
    const std::string cfg = test::write_file(dir, std::string(name) + ".toml", model + plugins);
    const std::string out = dir + "/" + name + ".json";
    posix_spawn_file_actions_t io;
    posix_spawn_file_actions_init(&io);
    posix_spawn_file_actions_addopen(&io, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&io, 1, 2);
    const char* argv[] = {HEADROOM_BINARY, "plan", cfg.c_str(), "--measure", "--json", nullptr};
    pid_t pid = 0;
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(posix_spawn(&pid, HEADROOM_BINARY, &io, nullptr, const_cast<char**>(argv), environ),
              0);
    posix_spawn_file_actions_destroy(&io);
    int status = 0;
    struct rusage ru {};
    ASSERT_EQ(wait4(pid, &status, 0, &ru), pid);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ifstream in(out);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // 3: the prediction does not fit this host (0 on one that holds it).
    ASSERT_TRUE(WIFEXITED(status) && (WEXITSTATUS(status) == 3 || WEXITSTATUS(status) == 0))
        << name << "\n"
        << text;
    const size_t at = text.find("{\"peak_bytes\":");
    ASSERT_NE(at, std::string::npos) << name << "\n" << text;
    const nlohmann::json j = nlohmann::json::parse(text.substr(at, text.find('\n', at) - at));
    const ConfigEstimate e = estimate_config(test::config_from(model + plugins));
    for (int i = 0; i < kNumCategories; ++i) {
      const char* c = category_name(category_at(i));
      EXPECT_EQ(j.at("by_category").at(c).get<uint64_t>(), e.peak.at_peak[i]) << name << ": " << c;
    }
    const uint64_t peak = j.at("peak_bytes").get<uint64_t>();
    EXPECT_EQ(peak, e.peak.total()) << name;
    // Every remedy here holds more than 64 GiB, on the device and the host together.
    const uint64_t host = j.value("host_peak_bytes", uint64_t(0));
    EXPECT_EQ(host, e.peak.host_total()) << name;
    EXPECT_GT(peak + host, uint64_t(64) << 30) << name;
    const uint64_t rss = uint64_t(ru.ru_maxrss) * 1024;
    EXPECT_LT(rss, limit) << name << ": peak RSS " << rss << " B for a dry run of " << peak << " B";
    EXPECT_LT(rss, (peak + host) / 100) << name;
    std::printf("%s: plan --measure: %llu B predicted, %.2f s, peak RSS %.1f MiB\n", name,
                static_cast<unsigned long long>(peak), seconds, double(rss) / (1 << 20));
  }
}

// docs/results/llama.md's tables (bench/llama/plan_table.sh): every single-rank remedy of both
// presets, run dry as the config itself in this process, is its closed form by category, to the
// byte (the zero rows are tests/mpi/plan_measure_test.cpp's, under mpirun).
TEST(LlamaPresets, EveryRemedyOfTheResultsTablesRunsDryAsItsClosedForm) {
  auto plugin = [](const char* name, const char* keys = "") {
    return std::string("[[plugins]]\nname = \"") + name + "\"\n" + keys;
  };
  const std::pair<const char*, std::string> remedies[] = {
      {"none", ""},
      {"amp bf16", plugin("amp")},
      {"amp, 8 bytes", plugin("amp", "master_weights = false\nstate_dtype = \"bf16\"\n")},
      {"checkpoint", plugin("checkpoint")},
      {"amp + checkpoint", plugin("amp") + plugin("checkpoint")},
      {"adam8bit + amp + checkpoint", plugin("amp") + plugin("checkpoint") + plugin("adam8bit")},
      {"adafactor + amp + checkpoint", plugin("amp") + plugin("checkpoint") + plugin("adafactor")},
  };
  for (const char* preset : {"llama-3.2-1b", "llama-3.1-8b"}) {
    for (const auto& [name, plugins] : remedies) {
      const Config c =
          test::config_from(std::string("[model]\npreset = \"") + preset +
                            "\"\nseq_len = 2048\n[train]\nmicro_batch = 1\n" + plugins);
      const Measured m = measure(c);
      EXPECT_EQ(m.method, Measured::Method::kDirect) << preset << ", " << name;
      const ConfigEstimate e = estimate_config(c);
      for (int i = 0; i < kNumCategories; ++i)
        EXPECT_EQ(m.by_category[i], e.peak.at_peak[i])
            << preset << ", " << name << ": " << category_name(category_at(i));
      EXPECT_EQ(m.peak, e.peak.total()) << preset << ", " << name;
    }
  }
}

const char* const kTiny =
    "[model]\narch = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 32\n"
    "seq_len = 16\nvocab_size = 64\nintermediate_size = 48\n";

TEST(LlamaConfig, KeysAndTheirErrors) {
  const Config c = test::config_from(kTiny);
  EXPECT_TRUE(c.model.llama());
  EXPECT_EQ(c.model.kv_heads(), 2);
  EXPECT_FALSE(c.model.tie_embeddings);
  // The resolved config reads back the same.
  const Config again = parse_config(format_config(c), "again");
  EXPECT_EQ(again.model.arch, "llama");
  EXPECT_EQ(again.model.kv_heads(), 2);
  EXPECT_EQ(again.model.intermediate_size, 48);

  std::string e = test::error_of([] { test::config_from(kTiny, {"model.n_kv_head=3"}); });
  EXPECT_TRUE(test::contains(e, "model.n_kv_head (3) must divide model.n_head (4)")) << e;
  e = test::error_of([] { test::config_from(kTiny, {"model.arch=\"gpt2\""}); });
  EXPECT_TRUE(test::contains(e, "model.n_kv_head is a key of arch = \"llama\"")) << e;
  EXPECT_TRUE(test::contains(e, "\"gpt2\"")) << e;
  e = test::error_of([] {
    test::config_from(
        "[model]\narch = \"llama\"\nn_layer = 1\nn_head = 2\nn_embd = 8\nseq_len = 4\n"
        "vocab_size = 16\n");
  });
  EXPECT_TRUE(test::contains(e, "needs intermediate_size")) << e;
  e = test::error_of([] { test::config_from(kTiny, {"model.rms_norm_eps=0"}); });
  EXPECT_TRUE(test::contains(e, "model.rms_norm_eps must be a finite number > 0")) << e;
  e = test::error_of([] { test::config_from(kTiny, {"model.rope_high_freq_factor=0.5"}); });
  EXPECT_TRUE(test::contains(e, "must be greater than model.rope_low_freq_factor")) << e;
  e = test::error_of([] { test::config_from(kTiny, {"model.rope_scaling_factor=0.5"}); });
  EXPECT_TRUE(test::contains(e, "0 (no scaling) or >= 1")) << e;
  e = test::error_of([] { test::config_from(kTiny, {"model.attention=\"naive\""}); });
  EXPECT_TRUE(test::contains(e, "takes \"tiled\"")) << e;
  e = test::error_of(
      [] { test::config_from("[model]\npreset = \"llama-3.2-1b\"\narch = \"gpt2\"\n"); });
  EXPECT_TRUE(test::contains(e, "contradicts preset \"llama-3.2-1b\"")) << e;
  e = test::error_of([] { test::config_from(kTiny, {"model.n_embd=24", "model.n_head=8"}); });
  EXPECT_TRUE(test::contains(e, "must be even")) << e;
}

// ---------------------------------------------------------------------------------------------
// The whole model against central differences, in double

ModelConfig tiny_llama(bool tied, double rope_scaling) {
  ModelConfig m;
  m.arch = "llama";
  m.n_layer = 2;
  m.n_head = 4;
  m.n_kv_head = 2;
  m.n_embd = 16;
  m.intermediate_size = 24;
  m.seq_len = 6;
  m.vocab_size = 11;
  m.tie_embeddings = tied;
  m.rms_norm_eps = 1e-5;
  m.rope_theta = 10000.0;
  // A short original context, so that the scaling's three bands all occur at head size 4.
  m.rope_scaling_factor = rope_scaling;
  m.rope_original_max_positions = 16;
  return m;
}

void expect_gradient_matches(const ModelConfig& m) {
  auto device = Device::create(DeviceConfig{});
  Gpt<double> model(m, *device, 7);
  ASSERT_EQ(model.num_params(), gpt_num_params(m));
  const std::vector<ParamShape> shapes = gpt_param_shapes(m);
  const std::vector<Param<double>*> params = model.params();
  ASSERT_EQ(params.size(), shapes.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i]->name, shapes[i].name);
    EXPECT_EQ(params[i]->shape, shapes[i].shape) << shapes[i].name;
  }
  std::mt19937_64 rng(3);
  test::perturb_params(model, rng);

  const int B = 2, T = 6;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    tokens[i] = int32_t(rng() % 11);
    targets[i] = int32_t(rng() % 11);
  }
  targets[4] = -1;  // ignored
  Batch batch;
  batch.tokens = tokens.data();
  batch.targets = targets.data();
  batch.B = B;
  batch.T = T;
  batch.dloss = 1.0 / (B * T - 1);

  model.zero_grad();
  model.forward(batch);
  model.backward(batch);
  std::vector<double> analytic, numeric;
  test::finite_differences(model, batch, 1e-5, &analytic, &numeric);
  ASSERT_EQ(analytic.size(), gpt_num_params(m));
  EXPECT_LT(test::relative_error(analytic, numeric), 1e-6);
  for (size_t i = 0; i < analytic.size(); ++i)
    ASSERT_NEAR(analytic[i], numeric[i], 1e-6 * std::max(std::abs(numeric[i]), 1e-3)) << i;
  EXPECT_EQ(device->tracker().live(Category::kActivations), 0u);
  EXPECT_EQ(device->tracker().live(Category::kWorkspace), 0u);
}

TEST(LlamaGradient, UntiedGqaMatchesCentralDifferencesInDouble) {
  expect_gradient_matches(tiny_llama(false, 0.0));
}

TEST(LlamaGradient, TiedWithRopeScalingMatchesCentralDifferencesInDouble) {
  expect_gradient_matches(tiny_llama(true, 4.0));
}

// ---------------------------------------------------------------------------------------------
// Training

struct GradRecorder final : EventListener {
  Trainer* trainer = nullptr;
  std::vector<std::vector<float>> grads;  // one per step
  void on_event(const EventInfo& e) override {
    if (e.event != Event::kGradsReady) return;
    std::vector<float> g;
    for (Param<float>* p : trainer->model().params())
      if (p->master().grad) g.insert(g.end(), p->master().grad, p->master().grad + p->numel);
    grads.push_back(std::move(g));
  }
};

struct Outcome {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  uint64_t peak_activations = 0;
};

Outcome train(const std::string& extra, const std::vector<std::string>& sets = {}) {
  std::vector<std::string> all = {"train.steps=6", "train.micro_batch=2", "train.grad_accum=2",
                                  "train.lr=3e-3", "train.warmup_steps=0"};
  all.insert(all.end(), sets.begin(), sets.end());
  const Config c = test::config_from(std::string(kTiny) + extra, all);
  Trainer trainer(c, TrainOptions{});
  GradRecorder rec;
  rec.trainer = &trainer;
  trainer.add_listener(&rec);
  trainer.run();
  Outcome out;
  for (const auto& h : trainer.history())
    out.losses.push_back(h.loss);
  out.grads = std::move(rec.grads);
  out.peak_activations = trainer.device().tracker().peak(Category::kActivations);
  EXPECT_EQ(trainer.device().tracker().live(Category::kActivations), 0u);
  return out;
}

using test::bitwise_equal;

TEST(LlamaTraining, TheLossFalls) {
  const Outcome r = train("", {"train.steps=40", "train.micro_batch=8", "train.grad_accum=1",
                               "train.lr=1e-2", "train.weight_decay=0.0"});
  ASSERT_EQ(r.losses.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += r.losses[size_t(i)] / 5;
    last += r.losses[r.losses.size() - 1 - size_t(i)] / 5;
  }
  std::printf("loss: first 5 steps %.4f, last 5 %.4f\n", first, last);
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, 0.8 * first);
}

TEST(LlamaTraining, CheckpointingIsBitwiseTheRunWithoutIt) {
  const Outcome base = train("");
  for (const char* policy : {"every", "selective", "sqrt"}) {
    const Outcome r =
        train(std::string("[[plugins]]\nname = \"checkpoint\"\npolicy = \"") + policy + "\"\n");
    ASSERT_EQ(r.losses.size(), base.losses.size()) << policy;
    for (size_t i = 0; i < base.losses.size(); ++i)
      EXPECT_EQ(r.losses[i], base.losses[i]) << policy << " step " << i + 1;
    ASSERT_EQ(r.grads.size(), base.grads.size()) << policy;
    for (size_t s = 0; s < base.grads.size(); ++s)
      EXPECT_TRUE(bitwise_equal(r.grads[s], base.grads[s])) << policy << " step " << s + 1;
    EXPECT_LT(r.peak_activations, base.peak_activations) << policy;
  }
}

TEST(LlamaTraining, AmpBf16TrainsAndTiedToo) {
  const Outcome amp = train("[[plugins]]\nname = \"amp\"\n");
  ASSERT_EQ(amp.losses.size(), 6u);
  for (double l : amp.losses)
    EXPECT_TRUE(std::isfinite(l));
  const Outcome f32 = train("");
  EXPECT_NEAR(amp.losses[0], f32.losses[0], 0.05 * f32.losses[0]);
  EXPECT_LT(amp.peak_activations, f32.peak_activations);
  const Outcome tied = train("", {"model.tie_embeddings=true"});
  EXPECT_TRUE(std::isfinite(tied.losses.back()));
}

// ---------------------------------------------------------------------------------------------
// The planner's closed forms against the tracker, byte for byte, by category

struct PeakCase {
  const char* name;
  std::string extra;
  std::vector<std::string> sets;
};

class LlamaPeakEstimate : public ::testing::TestWithParam<PeakCase> {};

TEST_P(LlamaPeakEstimate, MatchesTheTrackerByCategory) {
  std::vector<std::string> sets = {"train.steps=2"};
  sets.insert(sets.end(), GetParam().sets.begin(), GetParam().sets.end());
  const Config c = test::config_from(std::string(kTiny) + GetParam().extra, sets);
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  const ConfigEstimate e = estimate_config(c);
  for (const PluginEstimate& pe : e.plugins)
    EXPECT_TRUE(pe.ok()) << pe.plugin << " status " << pe.status;
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.peak.total(), mt.peak_total());
  EXPECT_EQ(t.model().num_params(), gpt_num_params(c.model));
}

INSTANTIATE_TEST_SUITE_P(
    Llama, LlamaPeakEstimate,
    ::testing::Values(PeakCase{"Untied1", "", {"train.micro_batch=1"}},
                      PeakCase{"Untied4", "", {"train.micro_batch=4"}},
                      PeakCase{"Tied4", "", {"train.micro_batch=4", "model.tie_embeddings=true"}},
                      PeakCase{"FullLoss", "", {"train.micro_batch=2", "model.loss=\"full\""}},
                      PeakCase{"NoGqa", "", {"train.micro_batch=2", "model.n_kv_head=4"}},
                      PeakCase{"AmpBf16", "[[plugins]]\nname = \"amp\"\n", {"train.micro_batch=4"}},
                      PeakCase{"CheckpointEvery",
                               "[[plugins]]\nname = \"checkpoint\"\n",
                               {"train.micro_batch=4"}},
                      PeakCase{"AmpAndCheckpoint",
                               "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n",
                               {"train.micro_batch=4"}}),
    [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Structured pruning (Gpt::resize_mlp, resize_heads) on Llama blocks

// Zeroes, in every parameter of `model` named `name`, the rows (axis 0) or columns (axis 1) that
// `drop` lists.
void zero_along(Gpt<double>& model, const std::string& name, int axis,
                const std::vector<int64_t>& drop) {
  for (Param<double>* p : model.params()) {
    if (p->name != name) continue;
    const int64_t rows = p->shape[0], cols = p->shape.size() > 1 ? p->shape[1] : 1;
    double* w = p->master().value;
    for (int64_t i : drop)
      for (int64_t k = 0; k < (axis == 0 ? cols : rows); ++k)
        (axis == 0 ? w[i * cols + k] : w[k * cols + i]) = 0.0;
    return;
  }
  ADD_FAILURE() << "no parameter " << name;
}

// The kept part of a parameter of `model` (its rows or columns `keep`), as a flat vector, from its
// values or its gradient.
std::vector<double> kept_part(const Gpt<double>& model, const std::string& name, int axis,
                              const std::vector<int64_t>& keep, bool grad) {
  for (Param<double>* p : model.params()) {
    if (p->name != name) continue;
    const int64_t rows = p->shape[0], cols = p->shape.size() > 1 ? p->shape[1] : 1;
    const double* w = grad ? p->master().grad : p->master().value;
    std::vector<double> out;
    if (axis == 0) {
      for (int64_t i : keep)
        out.insert(out.end(), w + i * cols, w + (i + 1) * cols);
    } else {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j : keep)
          out.push_back(w[r * cols + j]);
    }
    return out;
  }
  ADD_FAILURE() << "no parameter " << name;
  return {};
}

std::vector<double> whole(const Gpt<double>& model, const std::string& name, bool grad) {
  for (Param<double>* p : model.params())
    if (p->name == name) {
      const double* w = grad ? p->master().grad : p->master().value;
      return std::vector<double>(w, w + p->numel);
    }
  ADD_FAILURE() << "no parameter " << name;
  return {};
}

std::vector<int64_t> complement(const std::vector<int64_t>& keep, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i)
    if (std::find(keep.begin(), keep.end(), i) == keep.end()) out.push_back(i);
  return out;
}

// A pruned Llama computes what the unpruned one does with the pruned units' weights zeroed: block
// 0 keeps 10 of its 24 SwiGLU units (gate row j, up row I + j, down column j), block 1 the second
// of its two KV groups (query heads 2 and 3, KV head 1: their q rows, the KV head's k and v rows,
// the query heads' o_proj columns). The loss and the gradients of every kept weight agree in
// double to rounding (the GEMMs sum fewer zero terms), and the pruned shapes are the closed
// form's.
TEST(LlamaModel, PrunedModelIsTheUnprunedWithThePrunedUnitsZeroed) {
  const ModelConfig m = tiny_llama(false, 0.0);
  const int64_t C = m.n_embd, I = m.intermediate_size, hs = C / m.n_head;
  const int64_t KV = int64_t(m.kv_width());
  auto device = Device::create(DeviceConfig{});
  Gpt<double> pruned(m, *device, 7), zeroed(m, *device, 7);
  std::mt19937_64 rng(3), rng2(3);
  test::perturb_params(pruned, rng);
  test::perturb_params(zeroed, rng2);

  const std::vector<uint32_t> units = {0, 2, 3, 7, 8, 11, 15, 19, 20, 23};
  const std::vector<uint32_t> heads = {2, 3};  // KV group 1 of 2
  pruned.resize_mlp(1, units);
  pruned.resize_heads(2, heads);
  EXPECT_EQ(pruned.config().mlp_hidden, std::vector<int>({10, 24}));
  EXPECT_EQ(pruned.config().attn_heads, std::vector<int>({4, 2}));
  EXPECT_EQ(pruned.config().kv_heads(1), 1);
  EXPECT_EQ(pruned.num_params(), gpt_num_params(pruned.config()));
  const std::vector<ParamShape> shapes = gpt_param_shapes(pruned.config());
  const std::vector<Param<double>*> ps = pruned.params();
  ASSERT_EQ(shapes.size(), ps.size());
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_EQ(shapes[i].shape, ps[i]->shape) << ps[i]->name;

  // What stays, written from the units' definitions (not from model.cpp's lists).
  std::vector<int64_t> unit(units.begin(), units.end()), gu_rows = unit;
  for (int64_t j : unit)
    gu_rows.push_back(I + j);
  std::vector<int64_t> q_cols, qkv_rows;
  for (int64_t h : heads)
    for (int64_t e = 0; e < hs; ++e)
      q_cols.push_back(h * hs + e);
  qkv_rows = q_cols;
  for (int64_t e = 0; e < hs; ++e)
    qkv_rows.push_back(C + 1 * hs + e);  // k of KV head 1
  for (int64_t e = 0; e < hs; ++e)
    qkv_rows.push_back(C + KV + 1 * hs + e);  // v of KV head 1
  const std::string gu = "model.layers.0.mlp.gate_up_proj.weight",
                    down = "model.layers.0.mlp.down_proj.weight",
                    qkv = "model.layers.1.self_attn.qkv_proj.weight",
                    o = "model.layers.1.self_attn.o_proj.weight";
  zero_along(zeroed, gu, 0, complement(gu_rows, 2 * I));
  zero_along(zeroed, down, 1, complement(unit, I));
  zero_along(zeroed, qkv, 0, complement(qkv_rows, C + 2 * KV));
  zero_along(zeroed, o, 1, complement(q_cols, C));
  // The kept weights moved whole.
  EXPECT_EQ(whole(pruned, gu, false), kept_part(zeroed, gu, 0, gu_rows, false));
  EXPECT_EQ(whole(pruned, down, false), kept_part(zeroed, down, 1, unit, false));
  EXPECT_EQ(whole(pruned, qkv, false), kept_part(zeroed, qkv, 0, qkv_rows, false));
  EXPECT_EQ(whole(pruned, o, false), kept_part(zeroed, o, 1, q_cols, false));

  const int B = 2, T = 6;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    tokens[i] = int32_t(rng() % 11);
    targets[i] = int32_t(rng() % 11);
  }
  Batch batch;
  batch.tokens = tokens.data();
  batch.targets = targets.data();
  batch.B = B;
  batch.T = T;
  batch.dloss = 1.0 / (B * T);
  for (Gpt<double>* model : {&pruned, &zeroed}) {
    model->zero_grad();
    model->forward(batch);
    model->backward(batch);
  }
  EXPECT_NEAR(pruned.loss(), zeroed.loss(), 1e-13 * zeroed.loss());
  {  // and the pruned units did matter: the unpruned model's loss differs
    Gpt<double> full(m, *device, 7);
    std::mt19937_64 rng3(3);
    test::perturb_params(full, rng3);
    EXPECT_GT(std::fabs(full.evaluate(batch) - pruned.loss()), 1e-6);
  }
  auto expect_close = [](const std::vector<double>& a, const std::vector<double>& b,
                         const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    double scale = 0.0;
    for (double x : b)
      scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_NEAR(a[i], b[i], 1e-12 * std::max(scale, 1e-3)) << what << " [" << i << "]";
  };
  expect_close(whole(pruned, gu, true), kept_part(zeroed, gu, 0, gu_rows, true), gu);
  expect_close(whole(pruned, down, true), kept_part(zeroed, down, 1, unit, true), down);
  expect_close(whole(pruned, qkv, true), kept_part(zeroed, qkv, 0, qkv_rows, true), qkv);
  expect_close(whole(pruned, o, true), kept_part(zeroed, o, 1, q_cols, true), o);
  for (Param<double>* p : pruned.params())
    if (p->name != gu && p->name != down && p->name != qkv && p->name != o)
      expect_close(whole(pruned, p->name, true), whole(zeroed, p->name, true), p->name);
  EXPECT_EQ(device->tracker().live(Category::kActivations), 0u);
}

// The pruned widths' backward against central differences: blocks of other MLP widths (one
// below n_embd) and of one KV group.
TEST(LlamaGradient, PrunedWidthsMatchCentralDifferencesInDouble) {
  ModelConfig m = tiny_llama(false, 0.0);
  m.mlp_hidden = {10, 24};
  m.attn_heads = {2, 4};
  expect_gradient_matches(m);
}

// Heads go in whole KV groups: a list that splits one is refused, naming the rule, and nothing
// changes.
TEST(LlamaModel, ResizeHeadsRefusesAListThatSplitsAKvGroup) {
  auto device = Device::create(DeviceConfig{});
  Gpt<float> model(tiny_llama(false, 0.0), *device, 1);
  for (const std::vector<uint32_t>& keep :
       {std::vector<uint32_t>{0}, std::vector<uint32_t>{1, 2}, std::vector<uint32_t>{0, 1, 3}}) {
    try {
      model.resize_heads(1, keep);
      ADD_FAILURE() << "a list splitting a KV group was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_TRUE(test::contains(e.what(), "whole key/value groups")) << e.what();
    }
  }
  EXPECT_TRUE(model.config().attn_heads.empty());
  EXPECT_EQ(model.num_params(), gpt_num_params(tiny_llama(false, 0.0)));
}

// With one KV group (n_kv_head = 1) mode = "heads" could prune nothing: the plugin refuses before
// step 1, saying why.
TEST(LlamaModel, PruningHeadsWithOneKvGroupIsRefusedAtTrainBegin) {
  const Config c =
      test::config_from(std::string(kTiny) + "[[plugins]]\nname = \"pruning\"\nmode = \"heads\"\n",
                        {"train.steps=2", "model.n_kv_head=1"});
  Trainer t(c, TrainOptions{});
  try {
    t.run();
    ADD_FAILURE() << "pruning heads of one KV group ran";
  } catch (const std::exception& e) {
    EXPECT_TRUE(test::contains(e.what(), "TRAIN_BEGIN")) << e.what();
    EXPECT_TRUE(test::contains(e.what(), "n_kv_head = 1")) << e.what();
  }
  EXPECT_TRUE(t.history().empty());
}

}  // namespace
}  // namespace headroom
