// A LoRA run's adapter going out and coming back (core/model/peft_adapter.h): --save-weights
// --merge against PEFT's merge_and_unload, init_from of a PEFT adapter folder continuing the run
// it came from (on a base folder and on train.seed's init), and every way such a folder or the
// flags can be wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/hf_folder.h"
#include "core/model/model.h"
#include "core/model/peft_adapter.h"
#include "core/model/safetensors.h"
#include "core/run/trainer.h"
#include "tests/lora_reference.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

const char* kLora =
    "[[plugins]]\nname = \"lora\"\nr = 4\nalpha = 8.0\n"
    "target_modules = [\"c_attn\", \"c_proj\", \"c_fc\"]\n";

std::string on_base(const std::string& dir, int steps) {
  return "[train]\ninit_from = \"" + dir + "\"\nsteps = " + std::to_string(steps) +
         "\nmicro_batch = 2\nlr = 0.05\nwarmup_steps = 0\n" + kLora;
}

Batch batch_of(const test::Reference& r) {
  return r.ids.batch(1.0);
}

// Every parameter of `a` bitwise equal to `b`'s of the same name.
void expect_same_weights(const Gpt<float>& a, const Gpt<float>& b) {
  const auto va = download_params(a), vb = download_params(b);
  const auto pa = a.params(), pb = b.params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i]->name, pb[i]->name);
    EXPECT_TRUE(test::bitwise_equal(va[i], vb[i])) << pa[i]->name;
  }
}

// --save-weights DIR/ --merge: a Hugging Face folder of the base with the adapters folded in,
// equal to PEFT's merge_and_unload of the adapter the same run saves, and giving the LoRA model's
// loss as a plain model.
TEST(PeftAdapter, MergedWeightsEqualPeftsMergeAndUnload) {
  const test::Reference r = test::make_reference("gpt2");
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  const std::string merged = r.dir + "/merged/", adapter = r.dir + "/adapter/";
  TrainOptions o;
  o.save_weights_path = merged;
  o.merge = true;
  Trainer t(test::config_from(on_base(r.dir + "/base", 3)), std::move(o));
  t.run();
  save_peft_adapter(adapter, t.model(), {{"c_attn", 4, 8.0}, {"c_proj", 4, 8.0}, {"c_fc", 4, 8.0}},
                    r.dir + "/base");
  for (const SafetensorsEntry& e : read_safetensors_header(merged + "model.safetensors"))
    EXPECT_EQ(e.name.find("lora_"), std::string::npos) << e.name << " in a merged folder";

  const test::RunResult run = test::run_command(
      test::reference_python() + " " + HEADROOM_SOURCE_DIR +
      "/tests/hf/lora_reference.py merge gpt2 " + r.dir + " " + adapter + " " + merged);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const json m = json::parse(test::read_file(r.dir + "/lora_merge.json"));
  EXPECT_TRUE(m["missing"].empty()) << m.dump();
  EXPECT_GE(m["compared"].get<int>(), 4 * 2 + 2);  // the adapted weights of 2 blocks, at least
  EXPECT_LE(m["max_rel"].get<double>(), 1e-6) << m.dump();

  // The merged model is the LoRA model as one plain model: the same loss, within f32 rounding.
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Gpt<float> plain(t.model().config(), *device, 1);
  load_weights(merged, plain);
  const Batch b = batch_of(r);
  const double lora = t.model().evaluate(b), folded = plain.evaluate(b);
  EXPECT_LE(std::abs(folded - lora), 1e-5 * std::abs(lora)) << folded << " against " << lora;
  std::cout << "[ parity ] merged weights against PEFT's merge_and_unload: max relative "
            << m["max_rel"].get<double>() << " over " << m["compared"].get<int>()
            << " tensors; loss merged " << folded << ", with adapters " << lora << "\n";
}

// init_from = the adapter folder a run saved: the base from the folder it names and the adapters
// from the folder, bitwise the weights the run ended with; training goes on from there.
TEST(PeftAdapter, InitFromTheSavedAdapterContinuesTheRun) {
  const test::Reference r = test::make_reference("gpt2");
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  const std::string adapter = r.dir + "/adapter/";
  TrainOptions o;
  o.save_weights_path = adapter;
  Trainer first(test::config_from(on_base(r.dir + "/base", 3)), std::move(o));
  first.run();
  // Made, not run: the weights as loaded.
  Trainer loaded(test::config_from(on_base(adapter, 1)), TrainOptions{});
  expect_same_weights(loaded.model(), first.model());
  // And it trains on from them, saving an adapter on the same base.
  TrainOptions again;
  again.save_weights_path = r.dir + "/adapter2/";
  Trainer next(test::config_from(on_base(adapter, 2)), std::move(again));
  next.run();
  EXPECT_TRUE(std::isfinite(next.history().back().loss));
  const json c = json::parse(test::read_file(r.dir + "/adapter2/adapter_config.json"));
  EXPECT_EQ(c["base_model_name_or_path"], r.dir + "/base");
}

const char* kToy =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
    "[train]\nmicro_batch = 2\nlr = 1e-2\n";

// A run from train.seed's init names no base folder: its adapter continues on the same seed's.
TEST(PeftAdapter, AnAdapterOnTheSeedsInitContinuesOnIt) {
  const std::string dir = test::temp_dir() + "/adapter/";
  TrainOptions o;
  o.save_weights_path = dir;
  Trainer first(test::config_from(std::string(kToy) + "steps = 3\n" + kLora), std::move(o));
  first.run();
  EXPECT_EQ(json::parse(test::read_file(dir + "adapter_config.json"))["base_model_name_or_path"],
            "");
  Trainer loaded(
      test::config_from(std::string(kToy) + "steps = 1\ninit_from = \"" + dir + "\"\n" + kLora),
      TrainOptions{});
  expect_same_weights(loaded.model(), first.model());
}

// Every way an adapter folder or the flags can be wrong: a ConfigError naming the file, the key
// and both values, before any step.
TEST(PeftAdapter, AWrongFolderOrFlagIsAConfigErrorNamingIt) {
  const std::string dir = test::temp_dir() + "/adapter/";
  TrainOptions o;
  o.save_weights_path = dir;
  Trainer first(test::config_from(std::string(kToy) + "steps = 1\n" + kLora), std::move(o));
  first.run();
  const auto error_of = [&](const std::string& plugins, TrainOptions opts = {}) {
    return test::error_of([&] {
      Trainer t(test::config_from(std::string(kToy) + "steps = 1\ninit_from = \"" + dir + "\"\n" +
                                  plugins),
                std::move(opts));
    });
  };
  const std::string file = dir + "adapter_config.json";
  EXPECT_HAS(error_of(""),
             "is a PEFT adapter folder (it has adapter_config.json), but this run "
             "adds no adapters");
  const std::string rank = error_of(
      "[[plugins]]\nname = \"lora\"\nr = 2\nalpha = 8.0\n"
      "target_modules = [\"c_attn\", \"c_proj\", \"c_fc\"]\n");
  EXPECT_HAS(rank, "train.init_from: " + file + ": r is 4, but this run's lora plugin has r = 2");
  EXPECT_HAS(error_of("[[plugins]]\nname = \"lora\"\nr = 4\nalpha = 8.0\n"
                      "target_modules = [\"c_attn\"]\n"),
             file +
                 ": target_modules is [c_attn, c_fc, c_proj], but this run's lora plugin has "
                 "target_modules = [c_attn]");
  // A base that is not a folder here.
  json c = json::parse(test::read_file(file));
  c["base_model_name_or_path"] = "gpt2";
  test::write_file(dir, "adapter_config.json", c.dump());
  EXPECT_HAS(error_of(kLora), file + ": base_model_name_or_path \"gpt2\" is not a folder here");
  // Not LoRA, not JSON.
  c["base_model_name_or_path"] = "";
  c["peft_type"] = "IA3";
  test::write_file(dir, "adapter_config.json", c.dump());
  EXPECT_HAS(error_of(kLora),
             file + ": peft_type is \"IA3\"; headroom continues LoRA adapters only");
  test::write_file(dir, "adapter_config.json", "{ r: 4");
  EXPECT_HAS(error_of(kLora), file + ": is not JSON");
  // --merge on a run without adapters.
  TrainOptions merge;
  merge.save_weights_path = test::temp_dir() + "/m/";
  merge.merge = true;
  EXPECT_HAS(test::error_of([&] {
               Trainer t(test::config_from(std::string(kToy) + "steps = 1\n"), std::move(merge));
             }),
             "--merge folds LoRA adapters into the weights they adapt, but this run has none");
}

// An adapter file that holds another model's tensors, or lacks one of the run's.
TEST(PeftAdapter, AnAdapterFileThatDoesNotFitIsRefusedNamingTheTensor) {
  const std::string dir = test::temp_dir() + "/adapter/";
  TrainOptions o;
  o.save_weights_path = dir;
  Trainer first(test::config_from(std::string(kToy) + "steps = 1\n" + kLora), std::move(o));
  first.run();
  // The same folder read by a run adapting a 3-block model: block 2's adapters are missing.
  const std::string three = std::string(kToy) + "steps = 1\ninit_from = \"" + dir + "\"\n" + kLora;
  Config c = test::config_from(three);
  c.model.n_layer = 3;
  EXPECT_HAS(test::error_of([&] { Trainer t(c, TrainOptions{}); }),
             dir + "adapter_model.safetensors: holds no tensor base_model.model.transformer.h.2.");
  // A narrower model: the shapes differ.
  c.model.n_layer = 2;
  c.model.n_embd = 16;
  c.model.n_head = 2;
  EXPECT_HAS(test::error_of([&] { Trainer t(c, TrainOptions{}); }), "has shape [");
}

}  // namespace
}  // namespace headroom
