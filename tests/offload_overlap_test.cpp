// The offload plugin's update overlapped with the backward (Trainer::overlapping_update,
// HostOptimizer::gradients_final): where nothing after the backward can change the gradients or
// skip the update (no clipping, no plugin at GRADS_READY, OPTIMIZER_STEP or OOM, one rank, the
// host tier), each layer is updated on the host while the backward goes on below it. Training is
// bitwise the same run with the overlap off (HEADROOM_OVERLAP_UPDATE=0) and without offload
// (AdamW and SGD, with accumulation, a frozen layer, LoRA; a resume); the host ledger's timeline
// marks each layer's update between the backward's layers. With clipping (its factor needs every
// gradient) only the gradients' copies overlap and the factor is folded into the update: bitwise
// too. Where the overlap may not run (amp fp16's scaler, the NVMe tier) there is none; amp bf16,
// which has no scaler and takes no GRADS_READY, overlaps.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/device/memory.h"
#include "core/run/trainer.h"
#include "tests/offload_outcome.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

std::string model_toml() {
  return "[model]\nn_layer = 3\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n";
}

std::string train_toml(const std::string& extra = "") {
  return "[train]\nsteps = 3\nmicro_batch = 4\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 2\n"
         "grad_clip = 0\n" +
         extra;
}

const std::string kOffload = "[[plugins]]\nname = \"offload\"\noptimizer = \"host\"\n";

// The layers (by index) whose update the host ledger's timeline marks during a backward, one
// entry per mark, in order.
std::vector<int> overlapped_layers(Trainer& t) {
  std::vector<int> out;
  for (const TimelineSample& s : t.device().host_place()->tracker().timeline())
    if (s.phase.kind == Phase::Kind::kOptimizer && s.phase.layer >= 0) out.push_back(s.phase.layer);
  return out;
}

struct NoOverlap {  // HEADROOM_OVERLAP_UPDATE=0 while it lives
  NoOverlap() { setenv("HEADROOM_OVERLAP_UPDATE", "0", 1); }
  ~NoOverlap() { unsetenv("HEADROOM_OVERLAP_UPDATE"); }
};

TEST(OffloadOverlap, IsBitwiseTheUpdateAfterTheBackward) {
  const std::string lora =
      "[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\n";
  for (const std::string& base :
       {model_toml() + train_toml(),
        model_toml() + train_toml("optimizer = \"sgd\"\nmomentum = 0.9\n"),
        model_toml() + train_toml("freeze = [\"wte.weight\", \"h.0.*\"]\n"),
        model_toml() + train_toml() + lora,
        // amp bf16 takes no GRADS_READY (headroom.step/1 set_events): the masters' update on the
        // host, the bf16 copies' upload, during the backward
        model_toml() + train_toml() + "[[plugins]]\nname = \"amp\"\n",
        model_toml() + train_toml() +
            "[[plugins]]\nname = \"amp\"\n[[plugins]]\nname = " + "\"checkpoint\"\n"}) {
    SCOPED_TRACE(base);
    const test::Outcome plain = test::train_outcome(base, true);
    const test::Outcome overlapped = test::train_outcome(base + kOffload, true);
    test::Outcome after;
    {
      NoOverlap off;
      after = test::train_outcome(base + kOffload, true);
    }
    test::expect_same_training(plain, overlapped);
    test::expect_same_training(after, overlapped);
    Trainer t(test::config_from(base + kOffload, {"train.steps=1"}), TrainOptions{});
    t.run();
    EXPECT_FALSE(overlapped_layers(t).empty()) << "the overlap ran";
    EXPECT_EQ(t.overlap(), Trainer::Overlap::kUpdates);
  }
}

// With clipping (a max norm the gradients exceed, so that its factor scales every update): the
// gradients start back layer by layer, the update waits for the factor: bitwise the run with the
// overlap off and the run without offload, and no update is marked during the backward.
TEST(OffloadOverlap, WithClippingTheCopiesOverlapAndTheRunIsBitwise) {
  const std::string base = model_toml() + train_toml();
  for (const std::string set : {"train.grad_clip=0.05", "train.grad_clip=1000"}) {
    SCOPED_TRACE(set);
    const auto outcome = [&](const std::string& toml) {
      TrainOptions o;
      const std::string path = test::temp_dir() + "/w.safetensors";
      o.save_weights_path = path;
      Trainer t(test::config_from(toml, {set}), std::move(o));
      t.run();
      std::vector<double> losses;
      for (const StepState& s : t.history())
        losses.push_back(s.loss);
      return std::make_pair(losses, test::file_bytes(path));
    };
    const auto plain = outcome(base);
    const auto overlapped = outcome(base + kOffload);
    std::pair<std::vector<double>, std::string> after;
    {
      NoOverlap off;
      after = outcome(base + kOffload);
    }
    EXPECT_EQ(plain.first, overlapped.first);  // bitwise: == on doubles
    EXPECT_EQ(after.first, overlapped.first);
    EXPECT_TRUE(plain.second == overlapped.second) << "the saved weights differ";
    EXPECT_TRUE(after.second == overlapped.second) << "the saved weights differ";
    Trainer t(test::config_from(base + kOffload, {"train.steps=1", set}), TrainOptions{});
    t.run();
    EXPECT_EQ(t.overlap(), Trainer::Overlap::kDownloads);
    EXPECT_TRUE(overlapped_layers(t).empty());
    if (set == std::string("train.grad_clip=0.05")) {
      EXPECT_LT(t.history().back().clip_coef, 1.0) << "clipping scaled the update";
    } else {
      EXPECT_EQ(t.history().back().clip_coef, 1.0);
    }
  }
}

// One step's timeline on the host: the update of layer l + 1 comes as layer l's backward ends,
// from the head (layer 4) down to block 0 (layer 1); the embedding's, the last, in the step.
TEST(OffloadOverlap, TheTimelineMarksEachLayersUpdateDuringTheBackward) {
  Trainer t(test::config_from(model_toml() + train_toml() + kOffload, {"train.steps=1"}),
            TrainOptions{});
  t.run();
  EXPECT_EQ(overlapped_layers(t), (std::vector<int>{4, 3, 2, 1}));
  // On the host's own timeline: block 1's update after block 0's backward began, before the
  // embedding's.
  std::vector<std::string> phases;
  for (const TimelineSample& s : t.device().host_place()->tracker().timeline())
    phases.push_back(s.phase.str());
  size_t at = 0;
  while (at < phases.size() &&
         phases[at] != "optimizer step of layer 2 (block 1) during the backward, step 1")
    ++at;
  ASSERT_LT(at, phases.size()) << ::testing::PrintToString(phases);
  ASSERT_GT(at, 0u);
  EXPECT_EQ(phases[at - 1], "backward of layer 1 (block 0), step 1, micro-step 2");
  bool embedding_after = false;
  for (size_t i = at + 1; i < phases.size(); ++i)
    embedding_after =
        embedding_after || test::contains(phases[i], "backward of layer 0 (embedding)");
  EXPECT_TRUE(embedding_after) << ::testing::PrintToString(phases);
}

TEST(OffloadOverlap, ResumeFromASnapshotIsBitwise) {
  std::string toml = model_toml() + train_toml() + kOffload;
  toml.replace(toml.find("steps = 3"), 9, "steps = 4");
  Trainer whole(test::config_from(toml), TrainOptions{});
  whole.run();
  EXPECT_FALSE(overlapped_layers(whole).empty());
  test::expect_resume_is_bitwise(toml, whole);
}

// No update during the backward where something after it reads the gradients or may skip the
// update: clipping (its factor needs every gradient: the copies alone overlap, above), amp (its
// scaler's GRADS_READY), the NVMe tier (its state streams in step()); the update then runs after
// the backward as before.
TEST(OffloadOverlap, NotWhereTheGradientsMayStillChange) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml();
  const std::vector<std::pair<std::string, std::string>> runs = {
      {base + kOffload, "train.grad_clip=1.0"},
      {base + "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n" + kOffload, "train.steps=1"},
      {base + "[[plugins]]\nname = \"offload\"\noptimizer = \"nvme\"\nnvme_path = \"" + dir +
           "\"\n",
       "train.steps=1"},
      {base, "train.steps=1"}};
  for (const auto& [toml, set] : runs) {
    SCOPED_TRACE(toml + set);
    Trainer t(test::config_from(toml, {"train.steps=1", set}), TrainOptions{});
    t.run();
    EXPECT_TRUE(overlapped_layers(t).empty());
    EXPECT_NE(t.overlap(), Trainer::Overlap::kUpdates);
  }
}

}  // namespace
}  // namespace headroom
