// The closed-form peak estimate behind the out-of-memory advice, against the tracker.
#include <gtest/gtest.h>

#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

const char* kModel =
    "[model]\nn_layer = 3\nn_head = 4\nn_embd = 64\nseq_len = 32\nvocab_size = 256\n"
    "[train]\nsteps = 2\n";

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
}

INSTANTIATE_TEST_SUITE_P(MicroBatches, PeakEstimateTest, ::testing::Values(1, 4, 16));

// With the config's own plugins: amp's bf16 copies and activations, checkpoint's dropped blocks.
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
  const PeakEstimate e = estimate_peak(c, 8, strategy_of(c));
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.total(), mt.peak_total());
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, StrategyEstimateTest,
    ::testing::Values(PluginCase{"AmpBf16", "[[plugins]]\nname = \"amp\"\n"},
                      PluginCase{"AmpFp16", "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n"},
                      PluginCase{
                          "AmpAndCheckpointEvery",
                          "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = \"checkpoint\"\n"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Remedies, AmpAndBothTogetherWhenNeitherAloneFits) {
  const Config c = test::config_from(kModel, {"train.micro_batch=16"});
  const Strategy amp{Dtype::kBF16, -1}, every{Dtype::kF32, 0}, both{Dtype::kBF16, 0};
  const uint64_t p_amp = estimate_peak(c, 16, amp).total(),
                 p_every = estimate_peak(c, 16, every).total(),
                 p_both = estimate_peak(c, 16, both).total();
  ASSERT_LT(p_both, std::min(p_amp, p_every));
  const uint64_t limit = p_both + 1000;  // only both fit
  const auto rs = suggest_remedies(c, limit, 1 << 20, 0, 0, {"amp", "checkpoint"});
  const Remedy& last = rs.back();
  EXPECT_EQ(last.what, "amp + checkpoint together");
  EXPECT_TRUE(last.fits);
  EXPECT_EQ(last.peak_after, p_both);
  EXPECT_EQ(last.toml,
            "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n[[plugins]]\nname = "
            "\"checkpoint\"\npolicy = \"every\"");
  bool amp_alone = false;
  for (const Remedy& r : rs)
    amp_alone = amp_alone ||
                (r.toml.find("\"amp\"") != std::string::npos && !r.fits && r.peak_after == p_amp);
  EXPECT_TRUE(amp_alone) << format_remedies(rs);
  // A plugin already in the config is not offered again.
  const Config with_amp = test::config_from(std::string(kModel) + "[[plugins]]\nname = \"amp\"\n",
                                            {"train.micro_batch=16"});
  for (const Remedy& r : suggest_remedies(with_amp, limit, 1 << 20, 0, 0, {"amp", "checkpoint"}))
    EXPECT_EQ(r.toml.find("\"amp\""), std::string::npos) << r.toml;
}

TEST(Remedies, SmallerMicroBatchAtTheSameBatchFits) {
  const Config c = test::config_from(kModel, {"train.micro_batch=16", "train.grad_accum=2"});
  const uint64_t limit = estimate_peak(c, 4).total() + 1000;  // 4 fits, 8 does not
  ASSERT_GT(estimate_peak(c, 8).total(), limit);
  const auto remedies = suggest_remedies(c, limit, 1 << 20, 0, 0, {});
  ASSERT_FALSE(remedies.empty());
  EXPECT_TRUE(remedies[0].fits);
  EXPECT_NE(remedies[0].toml.find("micro_batch = 4"), std::string::npos) << remedies[0].toml;
  EXPECT_NE(remedies[0].toml.find("grad_accum = 8"), std::string::npos) << remedies[0].toml;
  EXPECT_GT(remedies[0].saves[static_cast<int>(Category::kActivations)], 0u);
  const std::string text = format_remedies(remedies);
  EXPECT_NE(text.find("[train]"), std::string::npos) << text;
}

TEST(Remedies, CheckpointWhenAvailableSavesActivations) {
  const Config c = test::config_from(kModel, {"train.micro_batch=16"});
  const uint64_t limit = estimate_peak(c, 16).total() / 2;
  auto find = [](const std::vector<Remedy>& rs) -> const Remedy* {
    for (const Remedy& r : rs)
      if (r.toml.find("\"checkpoint\"") != std::string::npos) return &r;
    return nullptr;
  };
  EXPECT_EQ(find(suggest_remedies(c, limit, 1 << 20, 0, 0, {})), nullptr);
  const auto rs = suggest_remedies(c, limit, 1 << 20, 0, 0, {"checkpoint"});
  const Remedy* r = find(rs);
  ASSERT_NE(r, nullptr);
  EXPECT_GT(r->saves[static_cast<int>(Category::kActivations)], 0u);
  EXPECT_LT(r->saves[static_cast<int>(Category::kActivations)],
            estimate_peak(c, 16).at_peak[static_cast<int>(Category::kActivations)]);
}

TEST(Remedies, CheckpointEveryEstimateIsTheTrackersPeak) {
  // A limit of 1 byte makes every remedy "not fit", so checkpoint is offered with policy every.
  const Config c = test::config_from(kModel, {"train.micro_batch=8"});
  const auto rs = suggest_remedies(c, 1, 1 << 20, 0, 0, {"checkpoint"});
  ASSERT_EQ(rs.back().toml, "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\"");
  const Config with = test::config_from(
      std::string(kModel) + "[[plugins]]\nname = \"checkpoint\"\n", {"train.micro_batch=8"});
  Trainer t(with, TrainOptions{});
  t.run();
  EXPECT_EQ(rs.back().peak_after, t.device().tracker().peak_total());
}

TEST(Remedies, DefragAllocatorOnlyForFragmentationAndOnlyWhenAvailable) {
  const Config c = test::config_from(kModel);
  auto has_defrag = [](const std::vector<Remedy>& rs) {
    for (const Remedy& r : rs)
      if (r.toml.find("defrag_allocator") != std::string::npos) return true;
    return false;
  };
  // 1 MiB requested, 3 MiB free, largest hole 512 KiB: fragmentation.
  const auto frag =
      suggest_remedies(c, 64 << 20, 1 << 20, 3 << 20, 512 << 10, {"defrag_allocator"});
  EXPECT_TRUE(has_defrag(frag));
  EXPECT_EQ(frag.back().unstranded, uint64_t(3 << 20) - (512 << 10));
  EXPECT_NE(format_remedies(frag).find("makes usable 2.50 MiB"), std::string::npos)
      << format_remedies(frag);
  EXPECT_FALSE(has_defrag(suggest_remedies(c, 64 << 20, 1 << 20, 3 << 20, 512 << 10, {})));
  // Not enough free bytes at all: an allocator cannot help.
  EXPECT_FALSE(
      has_defrag(suggest_remedies(c, 64 << 20, 4 << 20, 3 << 20, 3 << 20, {"defrag_allocator"})));
}

}  // namespace
}  // namespace headroom
