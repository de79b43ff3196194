// The planner and LoRA (issue: fine-tuning on a small device, point 4): the closed form of a run
// with adapters and a frozen, possibly quantized base (core/report/advice.cpp, from the lora
// plugin's headroom.estimate/1) equals what the tracker records at its peak, category by
// category, for GPT-2 and Llama, fp32 and amp, with dropout and checkpointing, with an optimizer
// plugin (its state the adapters' alone); and `plan` of a
// fine-tune that does not fit proposes lora on the least quantized base that fits, only where the
// run starts from weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "core/plan/measure.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

const char* kGpt2 =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 16\nvocab_size = 64\n"
    "[train]\nsteps = 2\nmicro_batch = 2\nlr = 1e-2\n";
const char* kLlama =
    "[model]\narch = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 32\n"
    "seq_len = 16\nvocab_size = 64\nintermediate_size = 48\n"
    "[train]\nsteps = 2\nmicro_batch = 2\nlr = 1e-2\n";

std::string lora(const std::string& targets, const std::string& keys = "") {
  return "[[plugins]]\nname = \"lora\"\nr = 4\nalpha = 8.0\ntarget_modules = [" + targets + "]\n" +
         keys;
}

struct Case {
  const char* name;
  const char* model;
  std::string plugins;
};

class LoraClosedForm : public ::testing::TestWithParam<Case> {};

// A run of two steps: the tracker's peak, category by category, is the closed form's.
TEST_P(LoraClosedForm, EqualsTheTrackersPeak) {
  const Config c = test::config_from(std::string(GetParam().model) + GetParam().plugins);
  const ConfigEstimate e = estimate_config(c);
  ASSERT_FALSE(e.mechanisms.lora.empty()) << "the lora plugin's estimate set no adapters";
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.peak.total(), mt.peak_total());
}

const std::string kAmp = "[[plugins]]\nname = \"amp\"\n";
const std::string kCheckpoint = "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\"\n";

INSTANTIATE_TEST_SUITE_P(
    Runs, LoraClosedForm,
    ::testing::Values(
        Case{"Gpt2OneModule", kGpt2, lora("\"c_attn\"")},
        Case{"Gpt2AllLinearDropout", kGpt2, lora("\"all-linear\"", "dropout = 0.1\n")},
        Case{"Gpt2Nf4", kGpt2, lora("\"c_attn\", \"c_proj\", \"c_fc\"", "base_dtype = \"nf4\"\n")},
        Case{"Gpt2Int8DoubleQuantFcOnly", kGpt2,
             lora("\"c_fc\"", "base_dtype = \"int8\"\ndouble_quant = true\n")},
        Case{"Gpt2Bf16BaseWithAmp", kGpt2,
             kAmp + lora("\"all-linear\"", "base_dtype = \"bf16\"\n")},
        Case{"Gpt2Nf4WithAmp", kGpt2,
             kAmp + lora("\"all-linear\"", "base_dtype = \"nf4\"\ndouble_quant = true\n")},
        Case{"Gpt2Nf4DropoutCheckpoint", kGpt2,
             kCheckpoint + lora("\"c_attn\", \"c_fc\"", "dropout = 0.2\nbase_dtype = \"nf4\"\n")},
        Case{"LlamaQvNf4", kLlama, lora("\"q_proj\", \"v_proj\"", "base_dtype = \"nf4\"\n")},
        // An optimizer plugin's state is the adapters' alone, listed before or after lora.
        Case{"Gpt2Adam8bitBeforeLora", kGpt2,
             "[[plugins]]\nname = \"adam8bit\"\nmin_8bit_size = 64\n" + lora("\"all-linear\"")},
        Case{"Gpt2LoraNf4ThenAdafactor", kGpt2,
             lora("\"c_attn\", \"c_fc\"", "base_dtype = \"nf4\"\n") +
                 "[[plugins]]\nname = \"adafactor\"\n"},
        Case{
            "LlamaAllLinearInt8AmpCheckpoint", kLlama,
            kAmp + kCheckpoint + lora("\"all-linear\"", "dropout = 0.1\nbase_dtype = \"int8\"\n")}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

// QLoRA at the anchor's scale: llama-3.1-8b's shapes and llama-2-7b's (the 7B class QLoRA
// fine-tunes in about 5-6 GB), amp, checkpoint and an nf4 base with double quantization, r 16 on
// every linear module: the closed form is the dry run of the config itself, to the byte, category
// by category (docs/results/lora.md's figures).
TEST(LoraClosedFormDryRun, QloraAtSevenAndEightBillionIsTheDryRunsPeak) {
  const std::string rest =
      "seq_len = 512\n[train]\nmicro_batch = 1\n" + kAmp + kCheckpoint +
      "[[plugins]]\nname = \"lora\"\nr = 16\nalpha = 32.0\ntarget_modules = [\"all-linear\"]\n"
      "base_dtype = \"nf4\"\ndouble_quant = true\n";
  for (const std::string& model :
       {std::string("[model]\npreset = \"llama-3.1-8b\"\n"),
        std::string("[model]\narch = \"llama\"\nn_layer = 32\nn_head = 32\nn_kv_head = 32\n"
                    "n_embd = 4096\nintermediate_size = 11008\nvocab_size = 32000\n"
                    "tie_embeddings = false\n")}) {
    SCOPED_TRACE(model);
    const Config c = test::config_from(model + rest);
    const Measured m = measure(c);
    ASSERT_EQ(m.method, Measured::Method::kDirect) << m.why_extrapolated;
    const ConfigEstimate e = estimate_config(c);
    for (int i = 0; i < kNumCategories; ++i)
      EXPECT_EQ(e.peak.at_peak[i], m.by_category[i]) << category_name(category_at(i));
    EXPECT_EQ(e.peak.total(), m.peak);
  }
}

// The optimizer plugins (adam8bit, adafactor) update the adapters alone: the base is bitwise as
// loaded, the adapters move, the plugin holds state for the adapters only (the tracker's optimizer
// category is the closed form above) and a resume from its snapshot is bitwise; [train] freeze
// likewise.
TEST(LoraOptimizerPlugins, UpdateTheTrainableParametersAlone) {
  for (const std::string& optimizer :
       {std::string("[[plugins]]\nname = \"adam8bit\"\nmin_8bit_size = 64\n"),
        std::string("[[plugins]]\nname = \"adafactor\"\n")}) {
    for (const std::string& tuning :
         {lora("\"c_attn\", \"c_fc\""), std::string("[train]\nfreeze = [\"wte.weight\"]\n")}) {
      SCOPED_TRACE(optimizer + tuning);
      // [train] freeze goes into kGpt2's own [train] table.
      const std::string toml = tuning.rfind("[train]", 0) == 0
                                   ? std::string(kGpt2) + "freeze = [\"wte.weight\"]\n" + optimizer
                                   : std::string(kGpt2) + optimizer + tuning;
      const Config c = test::config_from(toml);
      std::unique_ptr<Device> d0 = Device::create(DeviceConfig{});
      Gpt<float> init(c.model, *d0, c.train.seed);  // the base of the same seed
      Trainer t(c, TrainOptions{});
      t.run();
      EXPECT_TRUE(std::isfinite(t.history().back().loss));
      const auto before = download_params(init), after = download_params(t.model());
      std::map<std::string, size_t> index;
      for (size_t i = 0; i < init.params().size(); ++i)
        index[init.params()[i]->name] = i;
      int frozen = 0, trained = 0;
      for (size_t i = 0; i < t.model().params().size(); ++i) {
        const Param<float>& p = *t.model().params()[i];
        if (p.frozen) {
          ++frozen;
          EXPECT_TRUE(test::bitwise_equal(after[i], before.at(index.at(p.name)))) << p.name;
        } else {
          ++trained;
          if (index.count(p.name)) {
            EXPECT_FALSE(test::bitwise_equal(after[i], before.at(index.at(p.name)))) << p.name;
          }
        }
      }
      EXPECT_GT(frozen, 0);
      EXPECT_GT(trained, 0);
      test::expect_resume_is_bitwise(toml, t);  // the plugin's state is the adapters'
    }
  }
}

// "all-linear" adapts every linear module of the blocks, as listing them all does.
TEST(LoraAllLinear, IsEveryModuleListed) {
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  const Config c = test::config_from(kGpt2);
  Gpt<float> all(c.model, *device, 7, Precision(), 1, false, nullptr,
                 Tuning{{}, {{kAllLinear, 2, 4.0}}});
  Gpt<float> listed(c.model, *device, 7, Precision(), 1, false, nullptr,
                    Tuning{{}, {{"c_attn", 2, 4.0}, {"c_proj", 2, 4.0}, {"c_fc", 2, 4.0}}});
  std::vector<std::string> a, b;
  for (const Param<float>* p : all.trainable_params())
    a.push_back(p->name);
  for (const Param<float>* p : listed.trainable_params())
    b.push_back(p->name);
  EXPECT_EQ(a.size(), 2u * 4 * 2);  // A and B on 4 modules of 2 blocks
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  EXPECT_EQ(a, b);
}

// A fine-tune (init_from a saved model) of gpt2 shapes whose full training does not fit: `plan`
// proposes lora, on the least quantized base whose closed form fits; the proposal's table,
// appended to the config, fits by the same closed form. A run from a fresh init gets no such
// proposal: it has no base to freeze.
TEST(LoraProposal, PlanProposesTheLeastQuantizedBaseThatFits) {
  const std::string dir = test::temp_dir();
  const std::string model =
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 128\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 2\nmicro_batch = 2\nlr = 1e-2\n";
  {
    std::unique_ptr<Device> device = Device::create(DeviceConfig{});
    Gpt<float> m(test::config_from(model).model, *device, 3);
    save_safetensors(dir + "/base.safetensors", m);
  }
  const std::string fine_tune = model + "init_from = \"" + dir + "/base.safetensors\"\n";
  // The wall: between the nf4 and the int8 base's closed forms, with the proposal's adapters.
  auto peak_with = [&](const std::string& base) {
    return estimate_config(test::config_from(fine_tune +
                                             "[[plugins]]\nname = \"lora\"\nr = 16\nalpha = "
                                             "32.0\ntarget_modules = [\"all-linear\"]\n" +
                                             base))
        .peak.total();
  };
  const uint64_t int8 = peak_with("base_dtype = \"int8\"\n");
  const uint64_t nf4 = peak_with("base_dtype = \"nf4\"\n");
  ASSERT_LT(nf4, int8);
  const uint64_t limit = (nf4 + int8) / 2;
  const std::string wall = "[device]\nmemory_limit = " + std::to_string(limit) + "\n";

  const Advice a = advise(test::config_from(fine_tune + wall));
  ASSERT_FALSE(a.fits);
  const Remedy* proposal = nullptr;
  for (const Remedy& r : a.remedies)
    if (r.plugins == std::vector<std::string>{"lora"}) proposal = &r;
  std::string all;
  for (const auto* list : {&a.remedies, &a.not_enough})
    for (const Remedy& r : *list)
      all += r.what + "\n";
  ASSERT_NE(proposal, nullptr) << "no lora remedy among:\n" << all;
  EXPECT_NE(proposal->toml.find("base_dtype = \"nf4\""), std::string::npos) << proposal->toml;
  EXPECT_EQ(proposal->toml.find("double_quant"), std::string::npos) << proposal->toml;
  EXPECT_NE(proposal->toml.find("\"all-linear\""), std::string::npos) << proposal->toml;
  const Config with = test::config_from(fine_tune + wall + proposal->toml + "\n");
  EXPECT_EQ(estimate_config(with).peak.total(), proposal->peak_after);
  EXPECT_LE(proposal->peak_after, limit);

  // From a fresh init: nothing from lora.
  for (const Remedy& r : advise(test::config_from(model + wall)).remedies)
    EXPECT_NE(r.plugins, std::vector<std::string>{"lora"}) << r.what;
}

}  // namespace
}  // namespace headroom
