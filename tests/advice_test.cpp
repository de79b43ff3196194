// The closed-form peak estimate behind `plan` and the out-of-memory advice, against the tracker;
// the in-tree plugins' estimates (headroom.estimate/1) chained as the config lists them; the
// remedies built from the installed plugins' proposals.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "core/plugin_host/plugin_host.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "headroom/ext/shard.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

const char* kModel =
    "[model]\nn_layer = 3\nn_head = 4\nn_embd = 64\nseq_len = 32\nvocab_size = 256\n"
    "[train]\nsteps = 2\n";

// The installed plugins named, as PluginCatalog offers them.
std::vector<OfferedExtension> installed(const std::vector<std::string>& names) {
  static const PluginCatalog catalog;
  std::vector<OfferedExtension> out;
  for (const OfferedExtension& e : catalog.offered(HR_EXT_ESTIMATE))
    if (std::find(names.begin(), names.end(), e.plugin) != names.end()) out.push_back(e);
  return out;
}

class PeakEstimateTest : public ::testing::TestWithParam<int> {};

TEST_P(PeakEstimateTest, MatchesTheTrackerByCategory) {
  const Config c = test::config_from(kModel, {"train.micro_batch=" + std::to_string(GetParam())});
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  const PeakEstimate e = estimate_peak(c, GetParam());
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.total(), mt.peak_total());
  EXPECT_EQ(estimate_config(c).peak.total(), mt.peak_total());  // no plugins: the same
}

INSTANTIATE_TEST_SUITE_P(MicroBatches, PeakEstimateTest, ::testing::Values(1, 4, 16));

// With the config's own plugins, through their estimates: amp's compute copies and activations,
// checkpoint's dropped blocks. Exact where the closed form is (every block kept or dropped, and
// every_n / sqrt, whose last block decides the block-side peak).
struct PluginCase {
  const char* name;
  const char* plugins;
};
class StrategyEstimateTest : public ::testing::TestWithParam<PluginCase> {};

TEST_P(StrategyEstimateTest, MatchesTheTrackerByCategory) {
  const Config c =
      test::config_from(std::string(kModel) + GetParam().plugins, {"train.micro_batch=8"});
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  const ConfigEstimate e = estimate_config(c);
  ASSERT_EQ(e.plugins.size(), c.plugins.size());
  for (const PluginEstimate& pe : e.plugins)
    EXPECT_TRUE(pe.ok()) << pe.plugin << " status " << pe.status;
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.peak.total(), mt.peak_total());
  EXPECT_LT(e.peak.total(), estimate_peak(c, 8).total());
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, StrategyEstimateTest,
    ::testing::Values(
        PluginCase{"AmpBf16", "[[plugins]]\nname = \"amp\"\n"},
        PluginCase{"AmpFp16", "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n"},
        PluginCase{"CheckpointEvery", "[[plugins]]\nname = \"checkpoint\"\n"},
        PluginCase{"CheckpointEveryN2",
                   "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every_n\"\nn = 2\n"},
        PluginCase{"CheckpointSqrt", "[[plugins]]\nname = \"checkpoint\"\npolicy = \"sqrt\"\n"},
        PluginCase{"AmpAndCheckpointEvery",
                   "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"}),
    [](const auto& info) { return std::string(info.param.name); });

// Selective keeps the GEMM outputs and drops the cheap tensors (HR_DROP_CHEAP): the closed form
// holds a block's activations less its cheap ones between its forward and its backward, and in
// its backward all but its output (freed before the cheap ones are made again). Exact too, with
// the tiled attention and the naive one (whose probabilities are the cheap tensors), with amp.
TEST(StrategyEstimate, SelectiveIsTheTrackersPeakByCategory) {
  for (const char* extra : {"", "[[plugins]]\nname = \"amp\"\n"}) {
    for (const char* attention : {"model.attention=\"tiled\"", "model.attention=\"naive\""}) {
      const Config c = test::config_from(std::string(kModel) + extra +
                                             "[[plugins]]\nname = \"checkpoint\"\npolicy = "
                                             "\"selective\"\n",
                                         {"train.micro_batch=8", attention});
      const ConfigEstimate e = estimate_config(c);
      ASSERT_EQ(e.plugins.size(), c.plugins.size());
      for (const PluginEstimate& pe : e.plugins)
        EXPECT_TRUE(pe.ok()) << pe.plugin;
      EXPECT_EQ(e.mechanisms.drop[1], HR_DROP_CHEAP);
      EXPECT_EQ(e.mechanisms.drop[0], HR_KEEP_ACTIVATIONS);  // the embedding cannot drop
      Trainer t(c, TrainOptions{});
      t.run();
      const MemoryTracker& mt = t.device().tracker();
      for (int i = 0; i < kNumCategories; ++i)
        EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i])
            << extra << attention << " " << category_name(category_at(i));
      EXPECT_EQ(e.peak.total(), mt.peak_total()) << extra << attention;
    }
  }
}

// A plugin without headroom.estimate/1 (here one built against the frozen ABI 1.0 header, which
// has no get_extension) changes nothing in the estimate, and the estimate says so.
TEST(StrategyEstimate, APluginWithoutAnEstimateCountsAsChangingNothing) {
  // The tests run in the build folder (tests/CMakeLists.txt); tests/abi builds the plugin there.
  const std::string lib =
      std::filesystem::current_path().string() + "/tests/plugins/frozen_v1_0.so";
  ASSERT_TRUE(std::filesystem::exists(lib)) << lib;
  const std::string dir = test::temp_dir();
  const Config c = test::config_from(
      std::string(kModel) + "[[plugins]]\nname = \"frozen_v1_0\"\npath = \"" + lib +
          "\"\nout = \"" + dir + "/f.txt\"\n" + "[[plugins]]\nname = \"checkpoint\"\n",
      {"train.micro_batch=8"});
  const ConfigEstimate e = estimate_config(c);
  ASSERT_EQ(e.plugins.size(), 2u);
  EXPECT_FALSE(e.plugins[0].offered);
  EXPECT_TRUE(e.plugins[1].ok());
  EXPECT_EQ(e.peak.total(),
            estimate_config(
                test::config_from(std::string(kModel) + "[[plugins]]\nname = \"checkpoint\"\n",
                                  {"train.micro_batch=8"}))
                .peak.total());
  EXPECT_NE(format_estimate(e).find("frozen_v1_0: offers no estimate"), std::string::npos)
      << format_estimate(e);
}

uint64_t peak_with(const std::string& plugins, int micro_batch) {
  return estimate_config(test::config_from(std::string(kModel) + plugins,
                                           {"train.micro_batch=" + std::to_string(micro_batch)}))
      .peak.total();
}

TEST(Remedies, BothTogetherWhenNeitherAloneFits) {
  // amp as it proposes itself on one rank: DeepSpeed's 16-byte layout.
  const char* amp = "[[plugins]]\nname = \"amp\"\ngrad_dtype = \"bf16\"\n";
  const char* every = "[[plugins]]\nname = \"checkpoint\"\n";
  const uint64_t p_amp = peak_with(amp, 64), p_every = peak_with(every, 64),
                 p_both = peak_with(std::string(amp) + every, 64);
  ASSERT_LT(p_both, std::min(p_amp, p_every));
  const uint64_t limit = p_both + 1000;  // only both fit
  const Config c = test::config_from(kModel, {"train.micro_batch=64", "train.grad_accum=1",
                                              "device.memory_limit=" + std::to_string(limit)});
  const Advice a = advise(c, installed({"amp", "checkpoint"}));
  ASSERT_FALSE(a.fits);
  const Remedy& both = a.remedies.back();
  EXPECT_TRUE(both.fits);
  EXPECT_EQ(both.peak_after, p_both);
  std::vector<std::string> names = both.plugins;
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"amp", "checkpoint"}));
  EXPECT_NE(both.toml.find("[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\ngrad_dtype = \"bf16\""),
            std::string::npos)
      << both.toml;
  EXPECT_NE(both.toml.find("[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\""),
            std::string::npos)
      << both.toml;
  // Each alone helps but does not fit: mentioned, not offered as a remedy.
  bool amp_alone = false;
  for (const Remedy& r : a.not_enough)
    amp_alone = amp_alone ||
                (r.plugins == std::vector<std::string>{"amp"} && !r.fits && r.peak_after == p_amp);
  EXPECT_TRUE(amp_alone) << format_remedies(a);
  for (const Remedy& r : a.remedies)
    EXPECT_TRUE(r.fits) << r.what;
  // A plugin already in the config is not offered again; its estimate is the starting point.
  const Config with_amp =
      test::config_from(std::string(kModel) + amp,
                        {"train.micro_batch=64", "device.memory_limit=" + std::to_string(limit)});
  const Advice b = advise(with_amp, installed({"amp", "checkpoint"}));
  EXPECT_EQ(b.config.peak.total(), p_amp);
  for (const auto* list : {&b.remedies, &b.not_enough})
    for (const Remedy& r : *list)
      EXPECT_EQ(r.toml.find("\"amp\""), std::string::npos) << r.toml;
}

// dynamic_batch, installed and not listed, proposes the smaller micro-batch at the same batch
// that fits; the advice also spells it as --set flags for a run without the plugin, with core's
// estimate of that config.
TEST(Remedies, SmallerMicroBatchAtTheSameBatchFits) {
  const uint64_t limit = estimate_peak(test::config_from(kModel), 4).total() + 1000;
  const Config c = test::config_from(kModel, {"train.micro_batch=16", "train.grad_accum=2",
                                              "device.memory_limit=" + std::to_string(limit)});
  ASSERT_GT(estimate_peak(c, 8).total(), limit);  // 4 fits, 8 does not
  EXPECT_TRUE(advise(c, installed({})).remedies.empty()) << "core proposes no remedy of its own";
  const Advice a = advise(c, installed({"dynamic_batch"}));
  const auto split = std::find_if(a.remedies.begin(), a.remedies.end(),
                                  [](const Remedy& r) { return !r.sets.empty(); });
  ASSERT_NE(split, a.remedies.end()) << format_remedies(a);
  const Remedy& r = *split;
  EXPECT_TRUE(r.fits);
  ASSERT_EQ(r.sets.size(), 2u);
  const int b = std::stoi(r.sets[0].substr(r.sets[0].find('=') + 1)),
            accum = std::stoi(r.sets[1].substr(r.sets[1].find('=') + 1));
  EXPECT_EQ(r.sets[0], "train.micro_batch=" + std::to_string(b));
  EXPECT_EQ(b * accum, 32) << "the same sequences per step";
  EXPECT_LE(b, 4);
  EXPECT_EQ(r.peak_after, estimate_peak(c, b).total());
  EXPECT_LE(r.peak_after, limit);
  EXPECT_GT(r.saves[static_cast<int>(Category::kActivations)], 0u);
  EXPECT_TRUE(r.plugins.empty()) << "the --set form needs no plugin";
  const std::string text = format_remedies(a);
  EXPECT_NE(text.find("--set train.micro_batch=" + std::to_string(b) +
                      " --set train.grad_accum=" + std::to_string(accum)),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("dynamic_batch"), std::string::npos) << text;
}

TEST(Remedies, NothingWhenTheConfigFits) {
  const Config c = test::config_from(kModel, {"device.memory_limit=64MiB"});
  const Advice a = advise(c, installed({"amp", "checkpoint", "defrag_allocator"}));
  EXPECT_TRUE(a.fits);
  EXPECT_TRUE(a.remedies.empty());
  EXPECT_TRUE(a.not_enough.empty());
}

TEST(Remedies, CheckpointWhenInstalledSavesActivations) {
  const uint64_t limit = estimate_peak(test::config_from(kModel), 16).total() / 2;
  const Config c = test::config_from(
      kModel, {"train.micro_batch=16", "device.memory_limit=" + std::to_string(limit)});
  auto find = [](const Advice& a) -> const Remedy* {
    for (const auto* list : {&a.remedies, &a.not_enough})
      for (const Remedy& r : *list)
        if (r.plugins == std::vector<std::string>{"checkpoint"}) return &r;
    return nullptr;
  };
  EXPECT_EQ(find(advise(c, installed({}))), nullptr);
  const Advice a = advise(c, installed({"checkpoint"}));
  const Remedy* r = find(a);
  ASSERT_NE(r, nullptr) << format_remedies(a);
  EXPECT_GT(r->saves[static_cast<int>(Category::kActivations)], 0u);
  EXPECT_LT(r->saves[static_cast<int>(Category::kActivations)],
            estimate_peak(c, 16).at_peak[static_cast<int>(Category::kActivations)]);
  EXPECT_GT(r->step_time_factor, 1.0);
}

TEST(Remedies, CheckpointProposesSqrtWhenItFitsElseEvery) {
  const uint64_t sqrt_peak =
      peak_with("[[plugins]]\nname = \"checkpoint\"\npolicy = \"sqrt\"\n", 8);
  const uint64_t every_peak = peak_with("[[plugins]]\nname = \"checkpoint\"\n", 8);
  ASSERT_LT(every_peak, sqrt_peak);
  auto proposal = [&](uint64_t limit) {
    const Config c = test::config_from(
        kModel, {"train.micro_batch=8", "device.memory_limit=" + std::to_string(limit)});
    for (const auto& list : {advise(c, installed({"checkpoint"})).remedies,
                             advise(c, installed({"checkpoint"})).not_enough})
      for (const Remedy& r : list)
        if (r.plugins == std::vector<std::string>{"checkpoint"}) return r;
    ADD_FAILURE() << "no checkpoint remedy under " << limit;
    return Remedy{};
  };
  const Remedy s = proposal(sqrt_peak);
  EXPECT_EQ(s.toml, "[[plugins]]\nname = \"checkpoint\"\npolicy = \"sqrt\"");
  EXPECT_EQ(s.peak_after, sqrt_peak);
  EXPECT_TRUE(s.fits);
  const Remedy e = proposal(sqrt_peak - 1);
  EXPECT_EQ(e.toml, "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\"");
  EXPECT_EQ(e.peak_after, every_peak);
}

TEST(Remedies, CheckpointEveryEstimateIsTheTrackersPeak) {
  // A limit of 1 byte: nothing fits, so checkpoint proposes policy every.
  const Config c = test::config_from(kModel, {"train.micro_batch=8", "device.memory_limit=1"});
  const Advice a = advise(c, installed({"checkpoint"}));
  ASSERT_TRUE(a.remedies.empty());
  ASSERT_FALSE(a.not_enough.empty());
  const Remedy& r = a.not_enough.back();
  ASSERT_EQ(r.toml, "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\"");
  const Config with = test::config_from(
      std::string(kModel) + "[[plugins]]\nname = \"checkpoint\"\n", {"train.micro_batch=8"});
  Trainer t(with, TrainOptions{});
  t.run();
  EXPECT_EQ(r.peak_after, t.device().tracker().peak_total());
}

TEST(Remedies, DefragAllocatorOnlyForFragmentationAndOnlyWhenInstalled) {
  const Config c = test::config_from(kModel, {"device.memory_limit=64MiB"});
  auto defrag = [](const Advice& a) -> const Remedy* {
    for (const Remedy& r : a.remedies)
      if (r.plugins == std::vector<std::string>{"defrag_allocator"}) return &r;
    return nullptr;
  };
  // 1 MiB requested, 3 MiB free, largest hole 512 KiB: fragmentation (the estimate fits).
  const OomNumbers frag{1 << 20, 3 << 20, 512 << 10};
  const Advice a = advise(c, installed({"defrag_allocator"}), frag);
  const Remedy* r = defrag(a);
  ASSERT_NE(r, nullptr) << format_remedies(a);
  EXPECT_EQ(r->unstranded, uint64_t(3 << 20) - (512 << 10));
  EXPECT_EQ(r->toml, "[[plugins]]\nname = \"defrag_allocator\"");
  EXPECT_NE(format_remedies(a).find("makes usable 2.50 MiB"), std::string::npos)
      << format_remedies(a);
  EXPECT_EQ(defrag(advise(c, installed({}), frag)), nullptr);
  // Not enough free bytes at all: an allocator cannot help.
  EXPECT_EQ(defrag(advise(c, installed({"defrag_allocator"}), {4 << 20, 3 << 20, 3 << 20})),
            nullptr);
}

// A plugin that takes a role one of the config's plugins has is no remedy: two allocators would be
// a config error. The test plugin alloc_a is a counting allocator.
TEST(Remedies, NoProposalTakesARoleAListedPluginHas) {
  const Config c = test::config_from(
      std::string(kModel) +
      "[device]\nmemory_limit = \"64MiB\"\n[[plugins]]\nname = \"alloc_a\"\n" + "path = \"" +
      HEADROOM_TEST_PLUGIN_DIR + "/alloc_a.so\"\nout = \"/dev/null\"\n");
  const OomNumbers frag{1 << 20, 3 << 20, 512 << 10};
  const Advice a = advise(c, installed({"defrag_allocator"}), frag);
  for (const auto* list : {&a.remedies, &a.not_enough})
    for (const Remedy& r : *list)
      EXPECT_NE(r.plugins, std::vector<std::string>{"defrag_allocator"}) << format_remedies(a);
}

// A model whose state, not its activations, is what does not fit (tests/mpi/zero_test.sh's advice
// part runs the same model's remedy under mpirun): the zero plugins propose themselves on the
// fewest of 2, 4 and 8 ranks at which a rank fits, and the advice says how to launch that.
const char* kStateBound =
    "[model]\nn_layer = 4\nn_head = 4\nn_embd = 96\nseq_len = 16\nvocab_size = 256\n"
    "[train]\nsteps = 2\nmicro_batch = 1\n";

uint64_t state_bound_peak(const std::string& plugins, int ranks) {
  return estimate_config(test::config_from(std::string(kStateBound) + plugins), {}, ranks)
      .peak.total();
}

const Remedy* remedy_of(const std::vector<Remedy>& rs, const std::vector<std::string>& plugins) {
  for (const Remedy& r : rs)
    if (r.plugins == plugins) return &r;
  return nullptr;
}

TEST(Remedies, ZeroOnTheFewestRanksAtWhichARankFits) {
  const std::string zero2 = "[[plugins]]\nname = \"zero2\"\n";
  const uint64_t limit = state_bound_peak(zero2, 4);
  ASSERT_GT(state_bound_peak(zero2, 2), limit);
  ASSERT_GT(state_bound_peak("", 1), limit);
  ASSERT_GT(state_bound_peak("[[plugins]]\nname = \"zero1\"\n", 8), limit);
  const Config c = test::config_from(kStateBound, {"device.memory_limit=" + std::to_string(limit)});
  const Advice a = advise(c, installed({"zero1", "zero2"}));
  ASSERT_FALSE(a.fits);
  const std::string text = format_remedies(a);
  const Remedy* r = remedy_of(a.remedies, {"zero2"});
  ASSERT_NE(r, nullptr) << text;
  EXPECT_EQ(r->ranks, 4);
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->peak_after, limit);
  EXPECT_EQ(r->what, "zero2: ZeRO stage 2 on 4 ranks: gradients and optimizer state sharded");
  EXPECT_EQ(r->toml, "[[plugins]]\nname = \"zero2\"");
  EXPECT_NE(text.find("    launch on 4 ranks (each reads micro_batch x grad_accum sequences of its "
                      "own a step):\n      mpirun -np 4 headroom train test.toml\n"),
            std::string::npos)
      << text;
  // zero1 does not fit on 8 ranks: it helps, and says on how many.
  EXPECT_EQ(remedy_of(a.remedies, {"zero1"}), nullptr) << text;
  EXPECT_NE(text.find("zero1 on 8 ranks (peak about "), std::string::npos) << text;

  // zero2 in the config, on one rank: the same table on 4 ranks.
  const Config listed = test::config_from(std::string(kStateBound) + zero2,
                                          {"device.memory_limit=" + std::to_string(limit)});
  const Advice b = advise(listed, installed({"zero1", "zero2"}));
  const Remedy* same = remedy_of(b.remedies, {"zero2"});
  ASSERT_NE(same, nullptr) << format_remedies(b);
  EXPECT_EQ(same->ranks, 4);
  EXPECT_EQ(same->peak_after, limit);
  EXPECT_TRUE(same->sets.empty());
  EXPECT_TRUE(same->toml.empty());
  EXPECT_EQ(
      same->what,
      "zero2: ZeRO stage 2 on 4 ranks: gradients and optimizer state sharded (now: ZeRO stage "
      "2 on 1 rank: nothing to shard over, partitioned as zero1)");
  EXPECT_NE(format_remedies(b).find("      mpirun -np 4 headroom train test.toml\n"),
            std::string::npos)
      << format_remedies(b);
  // zero1 takes the gradient-reduction role zero2 has: not proposed beside it.
  for (const auto* list : {&b.remedies, &b.not_enough})
    for (const Remedy& x : *list)
      EXPECT_EQ(std::find(x.plugins.begin(), x.plugins.end(), "zero1"), x.plugins.end()) << x.what;
}

// Sharded parameters (zero3's HR_SHARD_PARAMETERS), in core's closed form by zero3's window
// (core/report/advice.cpp; against zero3 runs' trackers in tests/mpi/zero_estimate_test.cpp):
// with every layer under the persistence threshold nothing is gathered and the peak is zero2's;
// sharding them saves.
TEST(StrategyEstimate, ShardedParametersByZero3sSchedule) {
  const Config c = test::config_from(kStateBound);
  Mechanisms m = mechanisms_of(c, 4);
  m.shard = HR_SHARD_OPTIMIZER | HR_SHARD_GRADIENTS;
  const PeakEstimate zero2 = estimate_peak(c, m, 0);
  m.shard |= 4;  // HR_SHARD_PARAMETERS
  m.param_persistence_threshold = uint64_t(1) << 40;
  const PeakEstimate persistent = estimate_peak(c, m, 0);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(persistent.at_peak[i], zero2.at_peak[i]) << category_name(category_at(i));
  m.param_persistence_threshold = 1000;  // every layer but the head (192 elements) sharded
  m.prefetch_layers = 0;
  const PeakEstimate p0 = estimate_peak(c, m, 0);
  m.prefetch_layers = 2;
  const PeakEstimate p2 = estimate_peak(c, m, 0);
  const auto params = [](const PeakEstimate& e) {
    return e.at_peak[static_cast<int>(Category::kParameters)];
  };
  EXPECT_LT(params(p0), params(zero2));
  EXPECT_LT(params(p0), params(p2));
  EXPECT_LT(p0.total(), zero2.total());
  // Elements: the embedding 256·96 + 16·96 = 26112, a block 12·96² + 13·96 = 111840, the head 192;
  // each layer a multiple of 4. At rest a rank holds its fp32 shard of the three sharded kinds, the
  // head whole. Without prefetching the peak is a block's backward (that block gathered whole) or
  // the embedding's; with 2, at most three computations' layers: three blocks, or two and the
  // embedding (the head's tied wte).
  const uint64_t emb = 26112, block = 111840, head = 192;
  const uint64_t rest = 4 * (emb + 4 * block) / 4 + 4 * head;
  EXPECT_TRUE(params(p0) == rest + 4 * block || params(p0) == rest + 4 * emb) << params(p0);
  EXPECT_LE(params(p2), rest + 4 * 3 * block) << params(p2);
  EXPECT_GE(params(p2), rest + 4 * (emb + 2 * block)) << params(p2);
}

// None fits alone, even on 8 ranks: zero2 with checkpoint does, and zero1 (zero2's role) is not
// combined with it.
TEST(Remedies, ZeroCombinedOnMoreRanksButNeverTwoOfOneRole) {
  const uint64_t limit =
      state_bound_peak("[[plugins]]\nname = \"zero2\"\n[[plugins]]\nname = \"checkpoint\"\n", 8);
  ASSERT_GT(state_bound_peak("[[plugins]]\nname = \"zero2\"\n", 8), limit);
  const Config c = test::config_from(kStateBound, {"device.memory_limit=" + std::to_string(limit)});
  const Advice a = advise(c, installed({"zero1", "zero2", "checkpoint"}));
  const Remedy* r = remedy_of(a.remedies, {"zero2", "checkpoint"});
  ASSERT_NE(r, nullptr) << format_remedies(a);
  EXPECT_EQ(r->ranks, 8);
  EXPECT_EQ(r->peak_after, limit);
  EXPECT_NE(format_remedies(a).find("      mpirun -np 8 headroom train test.toml\n"),
            std::string::npos)
      << format_remedies(a);
  for (const Remedy& x : a.remedies)
    EXPECT_FALSE(std::find(x.plugins.begin(), x.plugins.end(), "zero1") != x.plugins.end() &&
                 std::find(x.plugins.begin(), x.plugins.end(), "zero2") != x.plugins.end())
        << x.what;
}

}  // namespace
}  // namespace headroom
