// Activation recomputation: the core mechanism (Gpt::drop_activations and the recomputation in
// backward) and the checkpoint plugin, loaded by the real plugin host from the TOML list.
// Gradients are bitwise those of a run without it, for every policy; the activation peaks of
// `every`, `sqrt` and `selective` equal their closed forms for a 12-layer model; `budget` stays
// under its budget and fails with the smallest achievable peak when it cannot; bad keys exit with
// code 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/events/events.h"
#include "core/model/model.h"
#include "core/plugin_host/plugin_host.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// 12 blocks; B = 2, T = 16, C = 32, NH = 2, V = 64.
constexpr int kLayers = 12, kB = 2, kT = 16, kC = 32, kNH = 2, kV = 64;

std::string model_toml() {
  return "[model]\nn_layer = " + std::to_string(kLayers) + "\nn_head = " + std::to_string(kNH) +
         "\nn_embd = " + std::to_string(kC) + "\nseq_len = " + std::to_string(kT) +
         "\nvocab_size = " + std::to_string(kV) + "\n";
}

std::string train_toml(int steps, int grad_accum) {
  return "[train]\nsteps = " + std::to_string(steps) + "\nmicro_batch = " + std::to_string(kB) +
         "\ngrad_accum = " + std::to_string(grad_accum) + "\nlr = 1e-3\nwarmup_steps = 0\n";
}

std::string plugin_toml(const std::string& keys) {
  return "[[plugins]]\nname = \"checkpoint\"\n" + keys;
}

// ---------------------------------------------------------------------------------------------
// Closed forms, from model.cpp's save() calls (es = 4 bytes, N = B·T):
//   embedding: out (B, T, C)                                          emb   = es·N·C
//   block:     attention out, residual, out (B, T, C) ×3; qkv (B, T, 3C); fc (B, T, 4C); four
//              (B, T) LayerNorm statistics; the tiled attention's row log-sum-exp (B, NH, T)
//              (ln_1, ln_2 and gelu are computed again in backward)  full  = es·10·N·C
//                                                                             + ss·(4·N + N·NH)
//   a dropped block keeps its output (B, T, C)                        out   = es·N·C
//   head:      ln_f (B, T, C), its mean and rstd (B, T), losses (B, T) (the chunked loss keeps no
//              logits)                                                head  = es·N·C + ss·3·N
// (core/report/advice.cpp's estimate uses the same terms.)
// With amp (bf16 or fp16 compute) the tensors have es = 2 bytes and the statistics — LayerNorm
// mean and rstd, the attention's log-sum-exp, the per-token losses — stay fp32 (ss = 4 bytes).
struct Forms {
  uint64_t emb, full, out, head, sel;  // as above; sel: see selective below
  uint64_t none, every, sqrt, selective;
};
constexpr uint64_t kN = uint64_t(kB) * kT;
constexpr int kSqrtN = 4, kSqrtKept = kLayers / kSqrtN;  // n = ceil(sqrt(12)) = 4
constexpr Forms forms(uint64_t es, uint64_t ss) {
  Forms f{};
  f.emb = es * kN * kC;
  f.full = es * 10 * kN * kC + ss * (4 * kN + kN * kNH);
  f.out = es * kN * kC;
  f.head = es * kN * kC + ss * 3 * kN;
  // selective: every block drops its cheap tensors (the attention's output (B, T, C) and lse
  // (B, NH, T)) at its FORWARD_END and keeps its GEMM outputs, its output and the LayerNorm
  // statistics: qkv 3·N·C + res1 N·C + fc 4·N·C + out N·C, and 4·N.
  f.sel = es * 9 * kN * kC + ss * 4 * kN;
  // No plugin: everything is live at the head's forward.
  f.none = f.emb + kLayers * f.full + f.head;
  // every: the peak is either the last block's forward (L-1 outputs kept, the last block whole,
  // not yet dropped) or the head's forward (L outputs kept and the head); backward's
  // recomputation of block l holds the outputs of blocks < l and block l whole, never more than
  // the first.
  f.every = f.emb + std::max((kLayers - 1) * f.out + f.full, kLayers * f.out + f.head);
  // sqrt: blocks b with b % 4 == 3 keep everything (3 of them), 9 keep their output only. At the
  // head's forward: emb + 3·full + 9·out + head; the last block's forward holds the same less the
  // head, and a recomputation (block 10 at most) less still.
  f.sqrt = f.emb + kSqrtKept * f.full + (kLayers - kSqrtKept) * f.out + f.head;
  // selective: the last block's forward holds L-1 kept blocks and itself whole; the head's
  // forward holds L kept blocks and the head. Backward's recomputation of block l frees its output
  // first and rebuilds the cheap set: full - out for that block, beside l-1 kept blocks, less
  // than the last block's forward. So the peak is the larger of the two forward points.
  f.selective = f.emb + std::max((kLayers - 1) * f.sel + f.full, kLayers * f.sel + f.head);
  return f;
}
constexpr Forms kF32 = forms(4, 4);
constexpr Forms kBf16 = forms(2, 4);
constexpr uint64_t kEmb = kF32.emb, kFull = kF32.full, kOut = kF32.out, kHead = kF32.head,
                   kSel = kF32.sel;
constexpr uint64_t kPeakNone = kF32.none, kPeakEvery = kF32.every, kPeakSqrt = kF32.sqrt,
                   kPeakSelective = kF32.selective;
// For this config the selective peak is the head's forward: 12·sel + head = 452992 > 11·sel +
// full = 452864.
static_assert(kPeakSelective == kEmb + kLayers * kSel + kHead, "the head's forward");

TEST(CheckpointClosedForm, MatchesTheModel) {
  ModelConfig m;
  m.n_layer = kLayers;
  m.n_head = kNH;
  m.n_embd = kC;
  m.seq_len = kT;
  m.vocab_size = kV;
  EXPECT_EQ(gpt_block_activation_bytes(m, kB, kT, Dtype::kF32), kFull);
  EXPECT_EQ(int(std::ceil(std::sqrt(double(kLayers)))), kSqrtN);
  EXPECT_EQ(gpt_block_activation_bytes(m, kB, kT, Dtype::kBF16), kBf16.full);
}

// ---------------------------------------------------------------------------------------------
// Runs: every parameter gradient at each GRADS_READY, and the activation peak.

struct GradRecorder final : EventListener {
  Trainer* trainer = nullptr;
  std::vector<std::vector<float>> grads;  // one per step: every gradient, concatenated
  void on_event(const EventInfo& e) override {
    if (e.event != Event::kGradsReady) return;
    std::vector<float> g;
    for (Param<float>* p : trainer->model().params())
      g.insert(g.end(), p->master().grad, p->master().grad + p->numel);
    grads.push_back(std::move(g));
  }
};

struct RunOutcome {
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<float>> params;  // after the run
  uint64_t peak_activations = 0;
};

RunOutcome run(const std::string& plugin, int steps = 2, int grad_accum = 2) {
  const Config c = test::config_from(model_toml() + train_toml(steps, grad_accum) + plugin);
  Trainer trainer(c, TrainOptions{});
  GradRecorder rec;
  rec.trainer = &trainer;
  trainer.add_listener(&rec);
  trainer.run();
  RunOutcome out;
  out.grads = std::move(rec.grads);
  for (Param<float>* p : trainer.model().params())
    out.params.emplace_back(p->master().value, p->master().value + p->numel);
  out.peak_activations = trainer.device().tracker().peak(Category::kActivations);
  EXPECT_EQ(trainer.device().tracker().live(Category::kActivations), 0u) << plugin;
  return out;
}

using test::bitwise_equal;

const RunOutcome& baseline() {
  static const RunOutcome b = run("");
  return b;
}

TEST(CheckpointPlugin, BaselinePeakIsEveryActivationAtOnce) {
  EXPECT_EQ(baseline().peak_activations, kPeakNone);
}

struct PolicyCase {
  const char* name;
  const char* keys;
};

class CheckpointPolicies : public ::testing::TestWithParam<PolicyCase> {};

TEST_P(CheckpointPolicies, GradientsAreBitwiseThoseWithoutIt) {
  const RunOutcome& base = baseline();
  const RunOutcome r = run(plugin_toml(GetParam().keys));
  ASSERT_EQ(r.grads.size(), base.grads.size());
  for (size_t s = 0; s < base.grads.size(); ++s)
    EXPECT_TRUE(bitwise_equal(r.grads[s], base.grads[s])) << "step " << s + 1;
  ASSERT_EQ(r.params.size(), base.params.size());
  for (size_t i = 0; i < base.params.size(); ++i)
    EXPECT_TRUE(bitwise_equal(r.params[i], base.params[i])) << "parameter " << i;
  // ...and it did save memory (every_n with n = 1 keeps everything: equal).
  if (std::string(GetParam().name) == "EveryN1")
    EXPECT_EQ(r.peak_activations, kPeakNone);
  else
    EXPECT_LT(r.peak_activations, kPeakNone);
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoint, CheckpointPolicies,
    ::testing::Values(PolicyCase{"Default", ""}, PolicyCase{"Every", "policy = \"every\"\n"},
                      PolicyCase{"EveryN3", "policy = \"every_n\"\nn = 3\n"},
                      PolicyCase{"EveryN5", "policy = \"every_n\"\nn = 5\n"},
                      PolicyCase{"EveryN1", "policy = \"every_n\"\nn = 1\n"},
                      PolicyCase{"Sqrt", "policy = \"sqrt\"\n"},
                      PolicyCase{"Selective", "policy = \"selective\"\n"},
                      PolicyCase{"Budget", "policy = \"budget\"\nbudget = \"400KiB\"\n"}),
    [](const auto& info) { return std::string(info.param.name); });

// One test per policy, so that each reports its own failure.
uint64_t expect_closed_form_peak(const char* policy, uint64_t closed_form) {
  const RunOutcome r = run(plugin_toml(std::string("policy = \"") + policy + "\"\n"));
  std::printf("%s: peak %llu bytes = closed form %llu (every: %llu, no plugin: %llu)\n", policy,
              (unsigned long long)r.peak_activations, (unsigned long long)closed_form,
              (unsigned long long)kPeakEvery, (unsigned long long)kPeakNone);
  EXPECT_EQ(r.peak_activations, closed_form);
  return r.peak_activations;
}

TEST(CheckpointPlugin, EveryPeakIsTheClosedForm) {
  expect_closed_form_peak("every", kPeakEvery);
}

TEST(CheckpointPlugin, SqrtPeakIsTheClosedForm) {
  expect_closed_form_peak("sqrt", kPeakSqrt);
}

TEST(CheckpointPlugin, SelectivePeakIsTheClosedForm) {
  EXPECT_GT(expect_closed_form_peak("selective", kPeakSelective), kPeakEvery)
      << "it keeps more than every";
}

// budget: the plan's bound for d dropped blocks is emb + head + (L-d)·full + d·out + full (one
// recomputation). A budget of exactly that bound for d = 7 gives the fewest drops, 7: blocks
// 0..6 drop (equal savings; the earliest first), 7..11 keep. Its real peak is the head's
// forward: emb + 5·full + 7·out + head, under the budget by one block.
TEST(CheckpointPlugin, BudgetKeepsThePeakUnderTheBudget) {
  constexpr int kDropped = 7;
  constexpr uint64_t kBudget =
      kEmb + kHead + (kLayers - kDropped) * kFull + kDropped * kOut + kFull;
  const RunOutcome r =
      run(plugin_toml("policy = \"budget\"\nbudget = " + std::to_string(kBudget) + "\n"));
  EXPECT_LE(r.peak_activations, kBudget);
  EXPECT_EQ(r.peak_activations, kEmb + (kLayers - kDropped) * kFull + kDropped * kOut + kHead);
  EXPECT_GT(r.peak_activations, kPeakEvery) << "the fewest drops: some blocks keep everything";
  // One byte less needs an eighth drop.
  const RunOutcome tighter =
      run(plugin_toml("policy = \"budget\"\nbudget = " + std::to_string(kBudget - 1) + "\n"));
  EXPECT_EQ(tighter.peak_activations,
            kEmb + (kLayers - kDropped - 1) * kFull + (kDropped + 1) * kOut + kHead);
  for (size_t s = 0; s < baseline().grads.size(); ++s)
    EXPECT_TRUE(bitwise_equal(r.grads[s], baseline().grads[s])) << "step " << s + 1;
}

TEST(CheckpointPlugin, ImpossibleBudgetFailsNamingTheSmallestPeak) {
  // Even with every block dropped the bound is emb + head + L·out + full.
  constexpr uint64_t kMinimum = kEmb + kHead + kLayers * kOut + kFull;
  static_assert(kMinimum > 64 * 1024, "the budget below cannot be met");
  const Config c = test::config_from(model_toml() + train_toml(2, 1) +
                                     plugin_toml("policy = \"budget\"\nbudget = \"64KiB\"\n"));
  Trainer trainer(c, TrainOptions{});
  try {
    trainer.run();
    FAIL() << "expected a PluginFailure";
  } catch (const PluginFailure& e) {
    const std::string m = e.what();
    EXPECT_TRUE(test::contains(m, "checkpoint")) << m;
    EXPECT_TRUE(test::contains(m, "budget 64.00 KiB (65536 bytes) cannot be met")) << m;
    EXPECT_TRUE(test::contains(m, "(" + std::to_string(kMinimum) + " bytes)")) << m;
  }
}

TEST(CheckpointPlugin, ImpossibleBudgetExitsWithCode1) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(
      dir, "tight.toml",
      model_toml() + train_toml(1, 1) + plugin_toml("policy = \"budget\"\nbudget = \"64KiB\"\n"));
  const auto r = test::run_headroom("train " + cfg + " -q");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(test::contains(r.output, "cannot be met")) << r.output;
}

// With amp: the same policies on bf16 and fp16 activations. Recomputation is bitwise there too
// (the same kernels, the same roundings), so the gradients equal amp's alone; the peaks are the
// closed forms with 2-byte tensors and 4-byte statistics.
const char* const kAmpBf16 = "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n";
const char* const kAmpFp16 = "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\ninit_scale = 1024.0\n";

TEST(CheckpointWithAmp, GradientsAreBitwiseThoseOfAmpAlone) {
  for (const char* amp : {kAmpBf16, kAmpFp16}) {
    const RunOutcome base = run(amp);
    EXPECT_EQ(base.peak_activations, kBf16.none) << amp;
    struct Case {
      const char* keys;
      uint64_t peak;
    };
    for (const Case& c :
         {Case{"policy = \"every\"\n", kBf16.every}, Case{"policy = \"sqrt\"\n", kBf16.sqrt},
          Case{"policy = \"selective\"\n", kBf16.selective},
          Case{"policy = \"every_n\"\nn = 5\n", 0}}) {
      const RunOutcome r = run(std::string(amp) + plugin_toml(c.keys));
      ASSERT_EQ(r.grads.size(), base.grads.size());
      for (size_t s = 0; s < base.grads.size(); ++s)
        EXPECT_TRUE(bitwise_equal(r.grads[s], base.grads[s])) << amp << c.keys << "step " << s + 1;
      for (size_t i = 0; i < base.params.size(); ++i)
        EXPECT_TRUE(bitwise_equal(r.params[i], base.params[i])) << amp << c.keys << i;
      if (c.peak) {
        EXPECT_EQ(r.peak_activations, c.peak) << amp << c.keys;
      }
      EXPECT_LT(r.peak_activations, base.peak_activations) << amp << c.keys;
    }
  }
}

TEST(CheckpointPlugin, BadKeysExit2NamingTheKey) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(1, 1);
  struct Bad {
    std::string keys, expect;
  };
  for (const Bad& bad :
       std::vector<Bad>{{"policy = \"often\"\n", "\"selective\" or \"budget\"; got \"often\""},
                        {"policy = 3\n", "policy"},
                        {"policy = \"every_n\"\n", "needs n"},
                        {"policy = \"every_n\"\nn = 0\n", "plugins.checkpoint.n"},
                        {"policy = \"sqrt\"\nn = 2\n", "every_n"},
                        {"policy = \"budget\"\n", "needs budget"},
                        {"policy = \"budget\"\nbudget = \"lots\"\n", "budget"},
                        {"policy = \"budget\"\nbudget = 0\n", "above zero"},
                        {"policy = \"every\"\nbudget = \"1MiB\"\n", "applies to policy"},
                        {"polcy = \"every\"\n", "unknown key 'polcy'"}}) {
    const std::string cfg = test::write_file(dir, "bad.toml", base + plugin_toml(bad.keys));
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the file: " << r.output;
  }
}

// Only hr_plugin_entry leaves an in-tree plugin's library (headroom_add_plugin's version script,
// cmake/headroom-plugin.map).
TEST(InTreePlugins, ExportOnlyTheEntryPoint) {
  const std::string bin = HEADROOM_BINARY;
  for (const char* name : {"checkpoint", "amp", "defrag_allocator", "dynamic_batch"}) {
    const std::string so =
        bin.substr(0, bin.rfind('/')) + "/../lib/headroom/plugins/" + name + ".so";
    const std::string cmd = "nm -D --defined-only '" + so + "'";
    const test::RunResult nm = test::run_command(cmd);
    const std::string& out = nm.output;
    ASSERT_EQ(nm.exit_code, 0) << cmd << "\n" << out;
    EXPECT_TRUE(test::contains(out, " T hr_plugin_entry\n")) << name << ": " << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << name << ": " << out;
  }
}

}  // namespace
}  // namespace headroom
