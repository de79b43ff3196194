// The offload plugin's `activations = true` (headroom.offload/1 set_activation_place,
// Gpt::set_activation_place): each layer's output waits in the host ledger between the next
// layer's forward and its backward. Training is bitwise the run without it (with checkpoint,
// amp, a selective drop, no checkpoint at all, LoRA, the optimizer on the host too); the device's
// bytes by category at its peak and the host ledger's are the closed form's
// (core/report/advice.cpp), and the device's activations are lower by the outputs the host holds.
// `pin_memory = false` (pageable host memory: set_host_page_locked) trains the same on the CPU
// backend, where the host place is plain memory either way.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "core/report/advice.h"
#include "tests/offload_outcome.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// Six blocks: the backward holds two outputs and the host the other five of the seven it saved.
std::string model_toml() {
  return "[model]\nn_layer = 6\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n"
         "[train]\nsteps = 3\nmicro_batch = 4\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 2\n"
         "grad_clip = 0.5\n";
}

std::string plugin(const std::string& name, const std::string& keys = "") {
  return "[[plugins]]\nname = \"" + name + "\"\n" + keys;
}

uint64_t at(const ByCategory& b, Category c) {
  return b[int(c)];
}

struct Case {
  const char* name;
  std::string plugins;    // before the offload plugin
  std::string optimizer;  // the offload plugin's optimizer key
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class OffloadActivations : public ::testing::TestWithParam<Case> {};

TEST_P(OffloadActivations, IsBitwiseAndMovesTheOutputsToTheHostAsPlanned) {
  const std::string base = model_toml() + GetParam().plugins;
  const std::string with = base + plugin("offload", "optimizer = \"" + GetParam().optimizer +
                                                        "\"\nactivations = true\n");
  const std::string without =
      base + plugin("offload", "optimizer = \"" + GetParam().optimizer + "\"\n");
  const test::Outcome a = test::train_outcome(without, true);
  const test::Outcome b = test::train_outcome(with, true);
  test::expect_same_training(a, b);

  // Each ledger as its closed form, category by category at the peak (the host's: its peak by
  // category, which it reaches once the first forward is done).
  const PeakEstimate e = estimate_config(test::config_from(with)).peak;
  for (int i = 0; i < kNumCategories; ++i) {
    EXPECT_EQ(b.device_at_peak[i], e.at_peak[i]) << "device " << category_name(category_at(i));
    EXPECT_EQ(b.host_peak[i], e.host[i]) << "host " << category_name(category_at(i));
  }
  EXPECT_EQ(b.device_peak_total, e.total());
  // Without: the same closed form has no activations on the host.
  EXPECT_EQ(at(estimate_config(test::config_from(without)).peak.host, Category::kActivations), 0u);
  EXPECT_EQ(at(a.host_peak, Category::kActivations), 0u);
  // The host holds every output but the head's input: the embedding's and five blocks'.
  const uint64_t out =
      uint64_t(4) * 32 * 64 * (GetParam().plugins.find("amp") != std::string::npos ? 2 : 4);
  EXPECT_EQ(at(b.host_peak, Category::kActivations), 6 * out);
  EXPECT_LT(at(b.device_at_peak, Category::kActivations),
            at(a.device_at_peak, Category::kActivations));
  std::printf(
      "%s: device activations at the peak %llu -> %llu B, host %llu B; peak %llu -> %llu B\n",
      GetParam().name, (unsigned long long)at(a.device_at_peak, Category::kActivations),
      (unsigned long long)at(b.device_at_peak, Category::kActivations),
      (unsigned long long)at(b.host_peak, Category::kActivations),
      (unsigned long long)a.device_peak_total, (unsigned long long)b.device_peak_total);
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, OffloadActivations,
    ::testing::Values(
        Case{"Checkpoint", plugin("checkpoint"), "none"},
        Case{"AmpCheckpoint", plugin("amp") + plugin("checkpoint"), "none"},
        Case{"SelectiveCheckpoint", plugin("checkpoint", "policy = \"selective\"\n"), "none"},
        Case{"NoCheckpoint", "", "none"},
        Case{"LoraAmpCheckpoint",
             plugin("lora", "r = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\n") + plugin("amp") +
                 plugin("checkpoint"),
             "none"},
        Case{"CheckpointOptimizerOnTheHost", plugin("checkpoint"), "host"},
        Case{"AmpCheckpointMastersOnTheHost", plugin("amp") + plugin("checkpoint"), "host"}),
    [](const auto& info) { return std::string(info.param.name); });

// `plan` says what the plugin moves, and plan --measure's dry run holds the closed form's bytes.
TEST(OffloadActivationsPlan, TheDryRunIsTheClosedForm) {
  const std::string toml = model_toml() + plugin("amp") + plugin("checkpoint") +
                           plugin("offload", "optimizer = \"host\"\nactivations = true\n");
  const uint64_t planned = estimate_config(test::config_from(toml)).peak.total();
  const std::string cfg = test::write_file(test::temp_dir(), "plan.toml", toml);
  const auto p = test::run_headroom("plan " + cfg);
  EXPECT_EQ(p.exit_code, 0) << p.output;
  EXPECT_TRUE(test::contains(p.output, "layer outputs in host memory")) << p.output;
  const auto m = test::run_headroom("plan " + cfg + " --measure");
  EXPECT_EQ(m.exit_code, 0) << m.output;
  EXPECT_TRUE(test::contains(m.output, "(" + std::to_string(planned) + " bytes)")) << m.output;
}

// pin_memory = false: the host place is pageable (on CUDA; plain memory on the CPU backend either
// way): the same training, the same bytes.
TEST(OffloadPinMemory, FalseTrainsTheSame) {
  const std::string base = model_toml() + plugin("amp") + plugin("checkpoint");
  const test::Outcome a = test::train_outcome(
      base + plugin("offload", "optimizer = \"host\"\nactivations = true\n"), true);
  const test::Outcome b = test::train_outcome(
      base + plugin("offload", "optimizer = \"host\"\nactivations = true\npin_memory = false\n"),
      true);
  test::expect_same_training(a, b);
  for (int i = 0; i < kNumCategories; ++i) {
    EXPECT_EQ(a.host_peak[i], b.host_peak[i]) << category_name(category_at(i));
    EXPECT_EQ(a.device_at_peak[i], b.device_at_peak[i]) << category_name(category_at(i));
  }
}

}  // namespace
}  // namespace headroom
