// `headroom plan --measure` (core/plan/measure.h) and `--search` (core/plan/search.h): dry runs of
// cheap variants, fitted and extrapolated, against the closed form where it is exact, against the
// full run's tracker, and against a plugin the closed form cannot know.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/plan/measure.h"
#include "core/plan/search.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

const char* kModel =
    "[model]\nn_layer = 5\nn_head = 4\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
    "[train]\nsteps = 2\nmicro_batch = 6\n";

// The full run's tracker at its peak, by category.
struct FullRun {
  ByCategory at_peak{};
  uint64_t peak = 0;
};
FullRun full_run(const Config& c) {
  Trainer t(c, TrainOptions{});
  t.run();
  return {t.device().tracker().live_at_peak(), t.device().tracker().peak_total()};
}

struct MeasureCase {
  const char* name;
  const char* plugins;
};
class PlanMeasureTest : public ::testing::TestWithParam<MeasureCase> {};

// Where the closed form is exact, the fit is the closed form, byte for byte, category by category,
// and both are the full run's tracker.
TEST_P(PlanMeasureTest, TheFitIsTheClosedFormAndTheFullRun) {
  const Config c = test::config_from(std::string(kModel) + GetParam().plugins);
  const Measured m = measure(c, Arithmetic::kDry, 0);  // the extrapolation
  EXPECT_EQ(m.method, Measured::Method::kBlocks);
  const ConfigEstimate e = estimate_config(c);
  const FullRun f = full_run(c);
  for (int i = 0; i < kNumCategories; ++i) {
    EXPECT_EQ(m.by_category[i], e.peak.at_peak[i]) << category_name(category_at(i));
    EXPECT_EQ(m.by_category[i], f.at_peak[i]) << category_name(category_at(i));
  }
  EXPECT_EQ(m.peak, f.peak);
  EXPECT_EQ(m.reserved, m.peak);  // no allocator plugin, no limit: nothing cached
  EXPECT_EQ(m.fragmentation, 0u);
  ASSERT_EQ(m.runs.size(), 5u);  // the 2x2 grid and the check point (3 x 3)
  EXPECT_EQ(m.check_b, 3);
  EXPECT_EQ(m.check_l, 3);
  EXPECT_EQ(m.check_peak_error, 0);
  EXPECT_FALSE(m.phase.empty());
  // Where the host holds the config, it runs itself, dry: the same bytes.
  const Measured d = measure(c);
  EXPECT_EQ(d.method, Measured::Method::kDirect) << d.why_extrapolated;
  ASSERT_EQ(d.runs.size(), 1u);
  EXPECT_EQ(d.peak, f.peak);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(d.by_category[i], f.at_peak[i]) << category_name(category_at(i));
  EXPECT_EQ(d.phase, m.phase);
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, PlanMeasureTest,
    ::testing::Values(MeasureCase{"None", ""},
                      MeasureCase{"AmpBf16", "[[plugins]]\nname = \"amp\"\n"},
                      MeasureCase{"CheckpointEvery", "[[plugins]]\nname = \"checkpoint\"\n"},
                      MeasureCase{"AmpAndCheckpoint",
                                  "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = "
                                  "\"checkpoint\"\n"}),
    [](const auto& info) { return std::string(info.param.name); });

// The host ledger (the offload plugin's optimizer on the host, or its state on the NVMe tier with
// two staging buffers on the host) is measured by the same dry runs: the config itself and the
// extrapolation both equal the closed form to the byte, category by category, fp32 and amp, with
// LoRA's adapters the only parameters it updates too, and the full run's host tracker. The device's
// prediction stays the full run's.
struct HostCase {
  const char* name;
  bool nvme, amp;
  const char* extra = "";  // more [[plugins]]
};
constexpr const char* kLoraTable =
    "[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\n";
class PlanMeasureHostTest : public ::testing::TestWithParam<HostCase> {};

TEST_P(PlanMeasureHostTest, TheHostLedgerIsTheClosedFormAndTheFullRun) {
  const std::string dir = test::temp_dir();
  const std::string offload =
      GetParam().nvme
          ? "[[plugins]]\nname = \"offload\"\noptimizer = \"nvme\"\nnvme_path = \"" + dir + "\"\n"
          : std::string("[[plugins]]\nname = \"offload\"\noptimizer = \"host\"\n");
  const std::string amp = GetParam().amp ? "[[plugins]]\nname = \"amp\"\n" : "";
  const Config c = test::config_from(std::string(kModel) + amp + offload + GetParam().extra);
  const PeakEstimate e = estimate_config(c).peak;
  ASSERT_GT(e.host_total(), 0u);
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& host = t.device().host_place()->tracker();
  for (const Measured& m : {measure(c), measure(c, Arithmetic::kDry, 0)}) {
    SCOPED_TRACE(m.method == Measured::Method::kDirect ? "the config itself" : "extrapolated");
    for (int i = 0; i < kNumCategories; ++i) {
      EXPECT_EQ(m.host_by_category[i], e.host[i]) << category_name(category_at(i));
      EXPECT_EQ(m.host_by_category[i], host.live_at_peak()[i]) << category_name(category_at(i));
    }
    EXPECT_EQ(m.host_peak, e.host_total());
    EXPECT_EQ(m.host_peak, host.peak_total());
    EXPECT_EQ(m.peak, t.device().tracker().peak_total());
    EXPECT_EQ(m.by_category[int(Category::kOptimizer)], 0u);  // none of it on the device
    // Printed beside the closed form, off by nothing.
    const std::string text = format_measured(c, m);
    EXPECT_TRUE(test::contains(text, "host ledger (measured; the closed form beside it):")) << text;
    EXPECT_TRUE(test::contains(text, "(measured - closed form: 0 bytes)")) << text;
    EXPECT_TRUE(test::contains(measured_json(m),
                               "\"host_peak_bytes\":" + std::to_string(e.host_total()) + ","));
  }
}

INSTANTIATE_TEST_SUITE_P(Offload, PlanMeasureHostTest,
                         ::testing::Values(HostCase{"Host", false, false},
                                           HostCase{"HostAmp", false, true},
                                           HostCase{"Nvme", true, false},
                                           HostCase{"NvmeAmp", true, true},
                                           HostCase{"HostAmpLora", false, true, kLoraTable},
                                           HostCase{"NvmeLora", true, false, kLoraTable}),
                         [](const auto& info) { return std::string(info.param.name); });

// The resident set of this process, from /proc/self/status (0 where it cannot be read).
uint64_t resident_bytes() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmRSS: %lu kB", &kib) == 1) break;
  std::fclose(f);
  return kib * 1024;
}

// A dry run with offload commits no host memory for the host copies: the host optimizer's
// downloads into them are skipped on a dry device (they wrote the unbacked mappings, 8 bytes a
// parameter: an 8B model's plan --measure was killed on a 24 GiB host).
TEST(PlanMeasure, ADryRunWithOffloadCommitsNoHostCopies) {
  const Config c = test::config_from(
      "[model]\nn_layer = 6\nn_head = 8\nn_embd = 512\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 2\nmicro_batch = 1\n[[plugins]]\nname = \"offload\"\n");
  const uint64_t host_copies = 8 * gpt_num_params(c.model);  // f32 weights and gradients
  ASSERT_GT(host_copies, 100u << 20);
  const uint64_t before = resident_bytes();
  if (before == 0) GTEST_SKIP() << "no /proc/self/status here";
  TrainOptions options;
  options.dry = true;
  Trainer t(c, std::move(options));
  t.run();
  ASSERT_EQ(t.device().host_place()->tracker().peak(Category::kParameters), host_copies / 2);
  const uint64_t after = resident_bytes();
  EXPECT_LT(after, before + host_copies / 4)
      << "the dry run committed " << (after - before) << " bytes";
}

// Without offload the host ledger is empty, and the output says nothing of it.
TEST(PlanMeasure, WithoutOffloadTheHostLedgerIsEmpty) {
  const Config c = test::config_from(kModel);
  const Measured m = measure(c);
  EXPECT_EQ(m.host_peak, 0u);
  EXPECT_FALSE(test::contains(format_measured(c, m), "host ledger")) << format_measured(c, m);
}

// A checkpoint of every 2nd block is not affine in blocks 1 and 2: the check point misses, and the
// grid widens to blocks 2 and 4 (whole periods), whose fit is the full run's again.
TEST(PlanMeasure, APolicyRepeatingOverBlocksWidensTheGrid) {
  const Config c = test::config_from(
      std::string(kModel) + "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every_n\"\nn = 2\n",
      {"model.n_layer=6"});
  const Measured m = measure(c, Arithmetic::kDry, 0);
  EXPECT_EQ(m.grid_blocks[0], 2);
  EXPECT_EQ(m.grid_blocks[1], 4);
  EXPECT_EQ(m.check_peak_error, 0);
  const FullRun f = full_run(c);
  EXPECT_EQ(m.peak, f.peak);
  EXPECT_EQ(m.peak, estimate_config(c).peak.total());
}

std::string per_block(uint64_t bytes) {
  const std::string lib = std::string(HEADROOM_TEST_PLUGIN_DIR) + "/per_block.so";
  return "[[plugins]]\nname = \"per_block\"\npath = \"" + lib +
         "\"\nbytes = " + std::to_string(bytes) + "\n";
}

// A plugin that offers no estimate and takes 12345 bytes of optimizer state per block: the closed
// form misses them, the measurement predicts them to the byte.
TEST(PlanMeasure, AnOutOfTreePluginsBytesPerBlockArePredictedToTheByte) {
  const uint64_t k = 12345;
  const Config c = test::config_from(std::string(kModel) + per_block(k));
  const Measured m = measure(c, Arithmetic::kDry, 0);
  const ConfigEstimate e = estimate_config(c);
  ASSERT_EQ(e.plugins.size(), 1u);
  EXPECT_FALSE(e.plugins[0].offered);
  const FullRun f = full_run(c);
  const int opt = static_cast<int>(Category::kOptimizer);
  EXPECT_EQ(m.by_category[opt], e.peak.at_peak[opt] + 5 * k);
  EXPECT_EQ(m.peak, e.peak.total() + 5 * k);
  EXPECT_EQ(m.peak, f.peak);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(m.by_category[i], f.at_peak[i]) << category_name(category_at(i));
}

// A plugin's own memory (HR_MEM_PLUGIN, ABI 1.7) is its own category in the closed form (its
// estimate's hr_mechanisms.plugin_bytes), the dry run and the full run's tracker, all three equal
// by category; weight_ema holds an f32 shadow of every parameter, and nothing else moves.
TEST(PlanMeasure, APluginsOwnMemoryIsItsOwnCategoryInEveryPrediction) {
  const std::string lib = std::string(HEADROOM_TEST_PLUGIN_DIR) + "/weight_ema.so";
  const std::string ema = "[[plugins]]\nname = \"weight_ema\"\npath = \"" + lib + "\"\nout = \"" +
                          test::temp_dir() + "/ema.txt\"\n";
  const Config plain = test::config_from(kModel);
  const Config c = test::config_from(std::string(kModel) + ema);
  const int plug = static_cast<int>(Category::kPlugin);
  const uint64_t shadow = 4 * gpt_num_params(c.model);
  const ConfigEstimate e = estimate_config(c);
  ASSERT_EQ(e.plugins.size(), 1u);
  EXPECT_TRUE(e.plugins[0].offered);
  EXPECT_EQ(e.peak.at_peak[plug], shadow);
  const ConfigEstimate without = estimate_config(plain);
  for (int i = 0; i < kNumCategories; ++i) {
    if (i == plug) continue;
    EXPECT_EQ(e.peak.at_peak[i], without.peak.at_peak[i]) << category_name(category_at(i));
  }
  const FullRun f = full_run(c);
  const Measured d = measure(c);
  EXPECT_EQ(d.method, Measured::Method::kDirect) << d.why_extrapolated;
  for (int i = 0; i < kNumCategories; ++i) {
    EXPECT_EQ(f.at_peak[i], e.peak.at_peak[i]) << category_name(category_at(i));
    EXPECT_EQ(d.by_category[i], e.peak.at_peak[i]) << category_name(category_at(i));
  }
  EXPECT_EQ(d.peak, e.peak.total());
  EXPECT_EQ(f.peak, e.peak.total());
}

// Every policy and mode of every plugin that runs on one rank, at several block counts, each way
// the planner measures: the config itself, dry, is its full run to the byte; so is the fit over
// micro_batch at the configured blocks (what a host too small for the config itself gets), but
// for a recomputation budget, whose choices follow the micro-batch (its output says so). The fit
// over blocks (a host too small for even one micro-batch of the config's blocks) is exact where
// the policy is affine in the blocks; checkpoint's every_n, sqrt and budget are not, and its
// output says so whenever it is used. The table is docs/results/planner.md's ("Every policy");
// zero1/2/3 are tests/mpi/plan_measure_test.cpp's, under mpirun.
TEST(PlanMeasure, EveryPolicyAndModeAtSeveralBlockCounts) {
  std::vector<std::pair<std::string, std::string>> setups = {{"no plugin", ""}};
  // offload's parameters on the host need zero3 listed too: that mode is measured with it.
  for (const PluginMode& m : plugin_modes())
    setups.push_back({m.what, m.toml.find("parameters = \"host\"") == std::string::npos
                                  ? m.toml
                                  : "[[plugins]]\nname = \"zero3\"\n" + m.toml});
  const std::pair<std::string, std::string> more[] = {
      {"checkpoint (policy every_n, n = 3)",
       "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every_n\"\nn = 3\n"},
      {"checkpoint (policy budget 300KiB)",
       "[[plugins]]\nname = \"checkpoint\"\npolicy = \"budget\"\nbudget = \"300KiB\"\n"},
      {"adafactor", "[[plugins]]\nname = \"adafactor\"\n"},
      {"adam8bit", "[[plugins]]\nname = \"adam8bit\"\n"},
      {"dynamic_batch", "[[plugins]]\nname = \"dynamic_batch\"\n"},
      {"pruning (mode mlp)",
       "[[plugins]]\nname = \"pruning\"\nfinal_sparsity = 0.5\nstart_step = 1\nend_step = 2\n"
       "every = 1\n"},
      {"pruning (mode heads)",
       "[[plugins]]\nname = \"pruning\"\nmode = \"heads\"\nfinal_sparsity = 0.5\n"
       "start_step = 1\nend_step = 2\nevery = 1\n"},
      {"pruning (mode unstructured)",
       "[[plugins]]\nname = \"pruning\"\nmode = \"unstructured\"\nfinal_sparsity = 0.5\n"
       "start_step = 1\nend_step = 2\nevery = 1\n"}};
  for (const auto& m : more)
    setups.push_back(m);
  ASSERT_GE(setups.size(), 15u) << "the checkpoint, amp and defrag_allocator modes are listed";
  std::printf(
      "| setup | blocks | full run peak (bytes) | the config itself, dry | fit over micro_batch "
      "| fit over micro_batch and blocks | its error | its check point |\n"
      "|---|---|---|---|---|---|---|---|\n");
  int inexact = 0, runs = 0;
  for (const auto& [what, toml] : setups) {
    for (const int L : {2, 3, 5, 8}) {
      const Config c =
          test::config_from(std::string(kModel) + toml, {"model.n_layer=" + std::to_string(L)});
      const FullRun f = full_run(c);
      const Measured d = measure(c);
      EXPECT_EQ(d.method, Measured::Method::kDirect) << what << " L=" << L << d.why_extrapolated;
      EXPECT_EQ(d.peak, f.peak) << what << " L=" << L;
      // A host that holds micro_batch 2 of the configured blocks but not the config.
      const uint64_t two = estimate_config(variant_of(c, 2, L), {}, 1).peak.total();
      const Measured b = measure(c, Arithmetic::kDry, two + two / 4 + 1);
      EXPECT_EQ(b.method, Measured::Method::kMicroBatch) << what << " L=" << L;
      EXPECT_TRUE(test::contains(format_measured(c, b), "exact unless a plugin's choices follow"));
      // A recomputation budget drops more blocks as the micro-batch grows: the one policy here
      // whose bytes follow the micro-batch otherwise than linearly.
      if (what.find("budget") == std::string::npos) {
        EXPECT_EQ(b.peak, f.peak) << what << " L=" << L;
        EXPECT_EQ(b.check_peak_error, 0) << what << " L=" << L;
      }
      const Measured x = measure(c, Arithmetic::kDry, 0);
      EXPECT_EQ(x.method, Measured::Method::kBlocks);
      EXPECT_TRUE(test::contains(format_measured(c, x), "can miss by tens of percent"));
      ++runs;
      if (x.peak != f.peak) ++inexact;
      std::printf("| %s | %d | %llu | %+.3f%% | %+.3f%% | %llu | %+.3f%% | %s |\n", what.c_str(), L,
                  static_cast<unsigned long long>(f.peak),
                  100 * (double(d.peak) - double(f.peak)) / double(f.peak),
                  100 * (double(b.peak) - double(f.peak)) / double(f.peak),
                  static_cast<unsigned long long>(x.peak),
                  100 * (double(x.peak) - double(f.peak)) / double(f.peak),
                  !x.check_b           ? "-"
                  : x.check_peak_error ? ("missed by " + std::to_string(x.check_peak_error)).c_str()
                                       : "held");
    }
  }
  std::printf("fit over blocks: %d of %d inexact\n", inexact, runs);
}

// The dry runs compute nothing (core/device/dry_backend.h): a variant's bytes by category, its
// peak, its reserved bytes and its phase are those of the same variant computing, with every kind
// of plugin — an allocator, precision, recomputation, a batch policy, pruning, an optimizer, and
// one the planner knows nothing of, and LoRA on quantized bases.
struct DryCase {
  const char* name;
  std::string extra;
};
class PlanDryRun : public ::testing::TestWithParam<DryCase> {};

TEST_P(PlanDryRun, HoldsTheBytesOfTheRunThatComputes) {
  const Config c = test::config_from(std::string(kModel) + GetParam().extra);
  for (const int b : {1, 3}) {
    const VariantRun dry = run_variant(c, b, 2, 2, 3, Arithmetic::kDry);
    const VariantRun real = run_variant(c, b, 2, 2, 3, Arithmetic::kCompute);
    ASSERT_TRUE(dry.ran) << dry.refused;
    ASSERT_TRUE(real.ran) << real.refused;
    for (int i = 0; i < kNumCategories; ++i)
      EXPECT_EQ(dry.at_peak[i], real.at_peak[i]) << category_name(category_at(i)) << " b=" << b;
    EXPECT_EQ(dry.peak, real.peak) << "b=" << b;
    EXPECT_EQ(dry.reserved, real.reserved) << "b=" << b;
    EXPECT_EQ(dry.step1_peak, real.step1_peak) << "b=" << b;
    EXPECT_EQ(dry.peak_phase.str(), real.peak_phase.str()) << "b=" << b;
    EXPECT_EQ(dry.step_ms, 0.0);  // a dry step's time says nothing
    EXPECT_GT(real.step_ms, 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, PlanDryRun,
    ::testing::Values(
        DryCase{"None", ""}, DryCase{"ArenaLimit", "[device]\nmemory_limit = \"8MiB\"\n"},
        DryCase{"DefragAllocator",
                "[device]\nmemory_limit = \"8MiB\"\n[[plugins]]\nname = \"defrag_allocator\"\n"},
        DryCase{"AmpF16AndCheckpoint",
                "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n[[plugins]]\nname = "
                "\"checkpoint\"\npolicy = \"selective\"\n"},
        DryCase{"Adam8bit", "[[plugins]]\nname = \"adam8bit\"\n"},
        DryCase{"Pruning",
                "[[plugins]]\nname = \"pruning\"\nfinal_sparsity = 0.5\nstart_step = 1\n"
                "end_step = 2\nevery = 1\n"},
        DryCase{"DynamicBatch", "[[plugins]]\nname = \"dynamic_batch\"\n"},
        DryCase{"OutOfTreePerBlock", per_block(12345)},
        // A quantized LoRA base: a dry run quantizes nothing, its bytes are the same.
        DryCase{"LoraNf4DoubleQuant",
                "[[plugins]]\nname = \"lora\"\ntarget_modules = [\"c_attn\", \"c_proj\", "
                "\"c_fc\"]\nbase_dtype = \"nf4\"\ndouble_quant = true\n"},
        DryCase{"LoraInt8WithAmp",
                "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"lora\"\n"
                "target_modules = \"c_fc\"\nbase_dtype = \"int8\"\n"}),
    [](const auto& info) { return std::string(info.param.name); });

// Under a memory_limit the variants run under it too: the smallest that cannot is refused before
// anything is allocated, saying why.
TEST(PlanMeasure, EvenTheSmallestVariantThatDoesNotFitIsRefusedSayingWhy) {
  const Config c = test::config_from(std::string(kModel), {"device.memory_limit=\"64KiB\""});
  try {
    measure(c);
    ADD_FAILURE() << "expected PlanRefused";
  } catch (const PlanRefused& e) {
    EXPECT_TRUE(test::contains(e.what(), "even the smallest variant cannot run")) << e.what();
    EXPECT_TRUE(test::contains(e.what(), "over memory_limit 64.00 KiB")) << e.what();
  }
}

TEST(PlanMeasure, BadFlagsExit2) {
  const std::string demo = std::string(HEADROOM_SOURCE_DIR) + "/examples/demo.toml";
  struct Case {
    std::string args, says;
  } cases[] = {
      {"plan " + demo + " --search", "--search needs --measure"},
      {"plan " + demo + " --write x.toml", "--write needs --search"},
      {"plan " + demo + " --json", "--json needs --measure"},
      {"plan " + demo + " --budget 1GiB --measure", "--budget needs --search"},
      {"plan " + demo + " --measure --search --budget lots", "--budget"},
  };
  for (const Case& k : cases) {
    const test::RunResult r = test::run_headroom(k.args);
    EXPECT_EQ(r.exit_code, 2) << k.args << "\n" << r.output;
    EXPECT_TRUE(test::contains(r.output, k.says)) << k.args << "\n" << r.output;
  }
}

TEST(PlanMeasure, JsonIsOneObjectWithThePrediction) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(dir, "p.toml", kModel);
  const test::RunResult r = test::run_headroom("plan " + cfg + " --measure --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Measured m = measure(test::config_from(kModel));
  EXPECT_TRUE(test::contains(r.output, "{\"peak_bytes\":" + std::to_string(m.peak) + ","))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"by_category\":{\"parameters\":")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"reserved_bytes\":")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"fragmentation\":")) << r.output;
}

// --search --json: one object with every candidate, its predicted peak and step-time ratio.
TEST(PlanSearch, JsonListsTheCandidatesWithPeakAndRatio) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(dir, "p.toml", kModel);
  const test::RunResult r =
      test::run_headroom("plan " + cfg + " --measure --search --budget 64MiB --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::starts_with(r.output, "{\"budget_bytes\":67108864,")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"candidates\":[{\"what\":\"as written\"")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"step_time_ratio\":1.0}")) << r.output;  // the baseline
  EXPECT_TRUE(test::contains(r.output, "\"peak_bytes\":")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "\"recommended\":")) << r.output;
}

// The out-of-memory report ends with the command that measures what fits.
TEST(PlanSearch, TheOutOfMemoryReportPointsToTheSearchWithTheExactCommand) {
  const std::string demo = std::string(HEADROOM_SOURCE_DIR) + "/examples/demo.toml";
  const test::RunResult r = test::run_headroom("train " + demo + " --set train.steps=1 -q");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "headroom plan --measure --search " + demo + "\n"))
      << r.output;
}

// examples/demo.toml does not fit its 80 MiB as written (micro_batch 32). The search writes a whole
// config that trains within the limit, and it is the fastest fitting candidate by the measured
// ratios. (seq_len 16 under 16 MiB here, to keep the test short; bench/planner.sh records the
// demo's ratios.)
TEST(PlanSearch, TheDemosRecommendedConfigIsWrittenAndRunsWithinTheLimit) {
  const std::string demo = std::string(HEADROOM_SOURCE_DIR) + "/examples/demo.toml";
  const Config c = load_config(demo, {"model.seq_len=16", "device.memory_limit=\"16MiB\""});
  const SearchResult r = search(c, c.device.memory_limit);
  ASSERT_GE(r.best, 0) << format_search(c, r);
  const Candidate& best = r.candidates[r.best];
  EXPECT_TRUE(best.fits);
  EXPECT_NE(best.what, "as written");  // as written it does not fit
  EXPECT_EQ(best.config.train.micro_batch * best.config.train.grad_accum, 32);
  // The fastest, or one as fast within the timing noise that holds less, of those that keep
  // everything on the device (one that offloads is picked only when none of them fits: a CPU
  // timing never sees a GPU's copies to the host).
  EXPECT_FALSE(r.offload_only);
  const Candidate* fastest = &best;
  for (const Candidate& k : r.candidates)
    if (k.fits && k.m.host_peak == 0 && k.step_ms > 0 && k.step_ms < fastest->step_ms) fastest = &k;
  EXPECT_GE(r.noise, 0.03);
  EXPECT_LE(best.step_ms, fastest->step_ms * (1 + r.noise)) << fastest->what;
  if (&best != fastest) {
    EXPECT_LE(best.m.reserved, fastest->m.reserved) << fastest->what;
  }
  const std::string dir = test::temp_dir();
  write_config_file(dir + "/best.toml", best.config);
  Config written = load_config(dir + "/best.toml", {"train.steps=2"});
  EXPECT_EQ(written.device.memory_limit, c.device.memory_limit);
  Trainer t(written, TrainOptions{});
  t.run();  // no OutOfMemory
  EXPECT_LE(t.device().tracker().peak_total(), c.device.memory_limit);
  EXPECT_LE(t.device().tracker().peak_total(), best.m.reserved);
}

// The search ends within a stated deadline and says what it left: with --deadline 0 nothing is
// measured, and every candidate the closed form did not prune says so. (A tiny budget on the tiny
// model ran past 60 s on a loaded machine.)
TEST(PlanSearch, ADeadlineEndsTheSearchSayingWhatItLeft) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(dir, "p.toml", kModel);
  const test::RunResult r =
      test::run_headroom("plan " + cfg + " --measure --search --budget 64MiB --deadline 0");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "candidates, deadline 0 s:")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "not measured: past the search's deadline")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "of its 0 s deadline: ")) << r.output;
  EXPECT_TRUE(test::contains(r.output, " candidate(s) left past the deadline")) << r.output;
  const Config c = test::config_from(kModel);
  const SearchResult s = search(c, 64 << 20, 0);
  EXPECT_GT(s.past_deadline, 0);
  for (const Candidate& k : s.candidates)
    EXPECT_FALSE(k.measured) << k.what;
  // The default deadline is stated too; the flag is range-checked.
  EXPECT_TRUE(test::contains(format_search(c, search(c, 64 << 20)), "deadline 120 s:"));
  const test::RunResult bad =
      test::run_headroom("plan " + cfg + " --measure --search --budget 64MiB --deadline nan");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(test::contains(bad.output, "--deadline: must be a finite number")) << bad.output;
}

// The case: a tiny budget on the tiny model (preset "tiny", 4 MiB: most candidates fit and
// are timed) ran past 60 s on a loaded machine. Under a deadline it ends saying how long it took
// of it and what became of every candidate: measured (and timed) or skipped, each skipped one
// with its reason on its line. Whether the deadline comes before the end depends on the machine;
// either way the counts add up.
TEST(PlanSearch, ATinyBudgetOnTheTinyModelEndsInItsStatedTimeCountingWhatItSkipped) {
  const std::string dir = test::temp_dir();
  const std::string cfg =
      test::write_file(dir, "tiny.toml", "[model]\npreset = \"tiny\"\n[train]\nsteps = 2\n");
  const test::RunResult r =
      test::run_headroom("plan " + cfg + " --measure --search --budget 4MiB --deadline 2");
  ASSERT_TRUE(r.exit_code == 0 || r.exit_code == 3) << r.output;
  const size_t at = r.output.find("searched in ");
  ASSERT_NE(at, std::string::npos) << r.output;
  double took = 0;
  int n = 0, measured = 0, timed = 0, skipped = 0;
  ASSERT_EQ(std::sscanf(r.output.c_str() + at,
                        "searched in %lf s of its 2 s deadline: %d candidates, %d measured (%d "
                        "timed), %d skipped",
                        &took, &n, &measured, &timed, &skipped),
            5)
      << r.output;
  EXPECT_EQ(measured + skipped, n) << r.output;
  EXPECT_LE(timed, measured);
  // Each skipped candidate says why on its own line.
  size_t lines = 0;
  for (size_t p = r.output.find("not measured: "); p != std::string::npos;
       p = r.output.find("not measured: ", p + 1))
    ++lines;
  EXPECT_EQ(lines, size_t(skipped)) << r.output;
  // The timing rounds say whether the ranking settled (the fastest held its place in the last two
  // rounds) or not, when anything was timed.
  if (timed > 0) {
    EXPECT_TRUE(test::contains(r.output, "(the fastest held its place in the last two)") ||
                test::contains(r.output, "(the fastest changed until the last round)"))
        << r.output;
  }
  EXPECT_TRUE(test::contains(r.output, "left past the deadline (not measured, or not timed)") ||
              test::contains(r.output, "every candidate considered before the deadline"))
      << r.output;
}

// Timing cannot tell candidates within its noise apart (the median spread of the candidates'
// rounds, at least 3%): of those, the one with the lowest peak.
TEST(PlanSearch, CandidatesWithinTimingNoiseArePickedByTheLowerPeak) {
  auto cand = [](double ms, std::vector<double> times, uint64_t reserved) {
    Candidate c;
    c.fits = true;
    c.step_ms = ms;
    c.times = std::move(times);
    c.m.reserved = reserved;
    return c;
  };
  SearchResult r;
  // The rounds spread 10%, 1% and 10%: the noise is 10%, and the second (5% slower) is within it
  // and holds less.
  r.candidates = {cand(100, {100, 110}, 900), cand(105, {105, 106}, 500),
                  cand(130, {130, 143}, 100)};
  pick_recommended(r);
  EXPECT_EQ(r.best, 1);
  EXPECT_EQ(r.within_noise, 2);
  EXPECT_DOUBLE_EQ(r.noise, 0.1);
  // Steady rounds (1% spread; the floor is 3%): the fastest wins over one 5% slower.
  r.candidates = {cand(100, {100, 101}, 900), cand(105, {105, 106}, 500)};
  pick_recommended(r);
  EXPECT_EQ(r.best, 0);
  EXPECT_EQ(r.within_noise, 1);
  EXPECT_DOUBLE_EQ(r.noise, 0.03);
  // One noisy round of the fastest alone does not widen the band (the median holds).
  r.candidates = {cand(100, {100, 150}, 900), cand(105, {105, 106}, 500),
                  cand(106, {106, 107}, 400)};
  pick_recommended(r);
  EXPECT_EQ(r.best, 0);
  EXPECT_EQ(r.within_noise, 1);
  // What does not fit is never picked.
  r.candidates = {cand(100, {100, 101}, 900), cand(105, {105, 106}, 500)};
  r.candidates[0].fits = false;
  pick_recommended(r);
  EXPECT_EQ(r.best, 1);
}

// Offload is proposed where nothing that keeps everything on the device fits, with its estimated
// step cost; where a device-only candidate fits it is the pick, even when the offload one timed
// faster here (a CPU timing does not see a GPU's host<->device copies).
TEST(PlanSearch, WhereNothingOnTheDeviceAloneFitsOffloadIsProposedWithItsStepCost) {
  auto cand = [](const char* what, bool fits, double ms, uint64_t host) {
    Candidate c;
    c.what = what;
    c.measured = true;
    c.fits = fits;
    c.step_ms = fits ? ms : 0;
    c.times = {ms, ms};
    c.m.reserved = c.m.peak = 1000;
    c.m.host_peak = host;
    if (host) {
      c.host_wall = "[host] memory_limit 1.00 GiB";
      c.offload_ms = 3.25;
    }
    return c;
  };
  SearchResult r;
  r.budget = 1100;
  r.candidates = {cand("as written", false, 10, 0), cand("+ amp", false, 8, 0),
                  cand("+ offload (optimizer host)", true, 12, 5000)};
  pick_recommended(r);
  EXPECT_EQ(r.best, 2);
  EXPECT_TRUE(r.offload_only);
  const Config c = test::config_from(kModel);
  const std::string text = format_search(c, r);
  EXPECT_TRUE(test::contains(text,
                             "no candidate fits on the device alone; offloading to the host "
                             "does, at about 3.2 ms more a step"))
      << text;
  EXPECT_TRUE(test::contains(text, "recommended: + offload (optimizer host)")) << text;
  EXPECT_TRUE(test::contains(search_json(r), "\"offload_only\":true")) << search_json(r);
  // A device-only candidate that fits is the pick, though slower here.
  r.candidates[1] = cand("+ amp", true, 20, 0);
  pick_recommended(r);
  EXPECT_EQ(r.best, 1);
  EXPECT_FALSE(r.offload_only);
  EXPECT_FALSE(test::contains(format_search(c, r), "no candidate fits on the device alone"));
  // An offload candidate over the host's wall does not fit: nothing is recommended.
  r.candidates[1] = cand("+ amp", false, 20, 0);
  r.candidates[2].fits = false;
  pick_recommended(r);
  EXPECT_EQ(r.best, -1);
}

// The search measures the offload plugin's host tier as a candidate (its mode "optimizer host"):
// its host ledger against the host's wall ([host] memory_limit), its step cost estimated from
// rates timed at plan time and said so; over the host's wall it does not fit. The nvme tier is
// said not to be a candidate, and why.
TEST(PlanSearch, TheOffloadCandidateIsMeasuredOnBothLedgersWithItsStepCost) {
  const std::string dir = test::temp_dir();
  const std::string model =
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 2\nmicro_batch = 1\n";
  const Config c = test::config_from(model + "[host]\nmemory_limit = \"64MiB\"\n");
  const SearchResult r = search(c, 1 << 20);
  const Candidate* off = nullptr;
  for (const Candidate& k : r.candidates)
    if (k.what == "+ offload (optimizer host)") off = &k;
  ASSERT_NE(off, nullptr) << format_search(c, r);
  ASSERT_TRUE(off->measured) << off->skipped;
  const PeakEstimate e = estimate_config(off->config).peak;
  EXPECT_EQ(off->m.host_peak, e.host_total());
  EXPECT_EQ(off->m.by_category[int(Category::kOptimizer)], 0u);
  EXPECT_TRUE(off->host_fits);
  EXPECT_EQ(off->update_elements, gpt_num_params(c.model));
  EXPECT_EQ(off->transfer_bytes,
            e.host[int(Category::kGradients)] + e.host[int(Category::kParameters)]);
  EXPECT_GT(r.rates.copy_bytes_per_s, 0);
  EXPECT_GT(r.rates.adamw_elements_per_s, 0);
  EXPECT_GT(off->offload_ms, 0);
  const std::string text = format_search(c, r);
  EXPECT_TRUE(test::contains(text, "host ledger " + format_bytes(e.host_total()) +
                                       " ([host] memory_limit 64.00 MiB); offload's step cost, "
                                       "estimated: "))
      << text;
  EXPECT_TRUE(test::contains(text, "a host memcpy of 64 MiB timed now")) << text;
  EXPECT_TRUE(test::contains(text,
                             "the nvme tier (offload optimizer = \"nvme\") is not a "
                             "candidate: it needs nvme_path"))
      << text;
  // Under a host wall below its host ledger it is not measured: the closed form says so.
  const Config tight = test::config_from(model + "[host]\nmemory_limit = \"1MiB\"\n");
  const SearchResult t = search(tight, 1 << 20);
  int seen = 0;
  for (const Candidate& k : t.candidates)
    if (k.what == "+ offload (optimizer host)") {
      ++seen;
      EXPECT_FALSE(k.measured);
      EXPECT_FALSE(k.fits);
      EXPECT_EQ(k.skipped, "its host ledger needs " + format_bytes(e.host_total()) +
                               " by the closed form, over [host] memory_limit 1.00 MiB");
    }
  EXPECT_EQ(seen, 1) << format_search(tight, t);
}

// --write is checked before the search (it was checked after the whole of it), and refused with
// exit 4, as it was after the search (issue 32 keeps that: an output that cannot be written,
// docs/guide/exit-codes.md): a folder, a missing folder, a read-only folder.
TEST(PlanSearch, WriteIsCheckedBeforeTheSearch) {
  const std::string dir = test::temp_dir();
  const std::string cfg = test::write_file(dir, "p.toml", kModel);
  const test::RunResult r =
      test::run_headroom("plan " + cfg + " --measure --search --budget 64MiB --write " + dir);
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_TRUE(test::contains(r.output, "--write " + dir + ": is a folder")) << r.output;
  EXPECT_FALSE(test::contains(r.output, "search under")) << "before the search: " << r.output;
  const test::RunResult missing = test::run_headroom(
      "plan " + cfg + " --measure --search --budget 64MiB --write " + dir + "/no/best.toml");
  EXPECT_EQ(missing.exit_code, 4) << missing.output;
  EXPECT_FALSE(test::contains(missing.output, "search under")) << missing.output;
  // A read-only folder: a read-only tmpfs in a mount namespace of its own (root writes through
  // permission bits), else a folder without write permission.
  const std::string ro = dir + "/ro";
  fs::create_directories(ro);
  const std::string plan = std::string(HEADROOM_BINARY) + " plan " + cfg +
                           " --measure --search --budget 64MiB --write " + ro + "/best.toml";
  const std::string mount = "mount -t tmpfs -o ro,size=64k tmpfs " + ro;
  test::RunResult r2;
  if (test::run_command("unshare -m sh -c '" + mount + "'").exit_code == 0) {
    r2 = test::run_command("unshare -m sh -c '" + mount + " && " + plan + "'");
  } else {
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    if (::access(ro.c_str(), W_OK) == 0) GTEST_SKIP() << "cannot make a read-only folder here";
    r2 = test::run_command(plan);
  }
  EXPECT_EQ(r2.exit_code, 4) << r2.output;
  EXPECT_TRUE(test::contains(r2.output,
                             "--write " + ro + "/best.toml: its folder " + ro + " is not writable"))
      << r2.output;
  EXPECT_FALSE(test::contains(r2.output, "search under")) << "before the search: " << r2.output;
}

}  // namespace
}  // namespace headroom
