// LoRA (core/model/model.h LoraSpec, headroom.adapters/1, plugins/lora): the loss and every
// adapter's gradient against Hugging Face PEFT on a random GPT-2 and a random Llama (fused GEMMs:
// q, k, v and gate, up are rows of ours), the lora plugin's run (the base bitwise unchanged, the
// adapters trained, the gradient and optimizer bytes those of the adapters alone, an exact resume)
// and its config errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/hf_folder.h"
#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "core/plugin_host/plugin_host.h"
#include "core/run/trainer.h"
#include "tests/lora_reference.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

using nlohmann::json;

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

// ||a - b|| / ||b||.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

std::vector<float> host_of(Device& d, const void* p, uint64_t n) {
  std::vector<float> v(n);
  d.backend().download(v.data(), p, n * sizeof(float));
  return v;
}

class LoraParity : public ::testing::TestWithParam<std::string> {};

// PEFT's LoraConfig (rank 4, alpha 8, every linear module of the blocks, B drawn nonzero) on the
// random model of tests/hf/reference.py: headroom's model with the same adapters loaded gives the
// same loss and the same gradient for every A and B, within 1e-5 relative in fp32; the base has
// no gradient.
TEST_P(LoraParity, LossAndAdapterGradientsMatchPeft) {
  HEADROOM_REFERENCE_IN_RELEASE_PASS("LoraPlugin.*, LoraDropout.*");
  const std::string arch = GetParam();
  const test::Reference r = test::make_reference(arch);
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  const Config config = test::config_from("[train]\ninit_from = \"" + r.dir + "/base\"\n");
  ASSERT_EQ(config.model.arch, arch);
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Tuning tuning;
  for (const auto& t : r.ref["targets"])
    tuning.lora.push_back(
        {t.get<std::string>(), r.ref["rank"].get<int>(), r.ref["alpha"].get<double>()});
  Gpt<float> model(config.model, *device, 1, Precision(), 1, false, nullptr, tuning);
  load_weights(config.train.init_from, model);  // the base; the adapters keep their init
  // PEFT's adapters, by name.
  const std::string adapters = r.dir + "/adapters.safetensors";
  std::map<std::string, SafetensorsEntry> by_name;
  for (SafetensorsEntry& e : read_safetensors_header(adapters))
    by_name[e.name] = std::move(e);
  size_t loaded = 0;
  for (Param<float>* p : model.params()) {
    ASSERT_EQ(p->frozen, !is_adapter_param(p->name)) << p->name;
    if (!is_adapter_param(p->name)) continue;
    const auto it = by_name.find(p->name);
    ASSERT_NE(it, by_name.end()) << p->name << " is not in PEFT's model";
    ASSERT_EQ(it->second.shape, p->shape) << p->name;
    std::vector<float> v(p->numel);
    read_safetensors_tensor(adapters, it->second, v.data(), false);
    device->backend().upload(p->master().value, v.data(), v.size() * sizeof(float));
    ++loaded;
  }
  device->backend().synchronize();
  EXPECT_EQ(loaded, by_name.size());
  EXPECT_EQ(loaded, r.ref["adapters"].get<size_t>());

  Batch b = r.ids.batch(r.ids.mean_dloss());
  model.zero_grad();
  model.forward(b);
  model.backward(b);
  const double theirs = r.ref["loss"].get<double>();
  EXPECT_LE(std::abs(model.loss() - theirs), 1e-5 * std::abs(theirs))
      << "headroom " << model.loss() << ", PEFT " << theirs;

  const std::string grads = r.dir + "/lora_grads.safetensors";
  std::map<std::string, SafetensorsEntry> grad_of;
  for (SafetensorsEntry& e : read_safetensors_header(grads))
    grad_of[e.name] = std::move(e);
  double worst = 0;
  size_t compared = 0;
  for (const Param<float>* p : model.params()) {
    if (p->frozen) {
      EXPECT_EQ(p->master().grad, nullptr) << p->name;
      continue;
    }
    const auto it = grad_of.find(p->name);
    ASSERT_NE(it, grad_of.end()) << p->name;
    std::vector<float> want(p->numel);
    read_safetensors_tensor(grads, it->second, want.data(), false);
    const double e = rel_error(host_of(*device, p->master().grad, p->numel), want);
    worst = std::max(worst, e);
    EXPECT_LT(e, 1e-5) << p->name;
    ++compared;
  }
  EXPECT_EQ(compared, grad_of.size());
  std::cout << "[ parity ] lora " << arch << ": loss relative difference "
            << std::abs(model.loss() / theirs - 1) << ", worst adapter gradient relative error "
            << worst << " over " << compared << " tensors\n";
}

// A LoRA run's --save-weights DIR/ is its adapter in PEFT's format: PeftModel.from_pretrained on
// the base loads it and gives the loss headroom's trained model gives on the same batch.
TEST(LoraSave, PeftLoadsTheSavedAdapter) {
  const test::Reference r = test::make_reference("gpt2");
  if (!r.skip.empty()) GTEST_SKIP() << r.skip;
  const std::string saved = r.dir + "/adapter/";
  TrainOptions o;
  o.save_weights_path = saved;
  Trainer t(test::config_from("[train]\ninit_from = \"" + r.dir +
                              "/base\"\nsteps = 3\nmicro_batch = 2\nlr = 0.05\n"
                              "warmup_steps = 0\n[[plugins]]\nname = \"lora\"\nr = 4\n"
                              "alpha = 8.0\ntarget_modules = [\"c_attn\", \"c_proj\", \"c_fc\"]\n"),
            std::move(o));
  t.run();
  const json config = json::parse(test::read_file(saved + "adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 8.0);
  EXPECT_EQ(config["fan_in_fan_out"], true);
  EXPECT_EQ(config["base_model_name_or_path"], r.dir + "/base");
  size_t tensors = 0;
  for (const SafetensorsEntry& e : read_safetensors_header(saved + "adapter_model.safetensors")) {
    EXPECT_EQ(e.name.rfind("base_model.model.transformer.h.", 0), 0u) << e.name;
    ++tensors;
  }
  EXPECT_EQ(tensors, r.ref["adapters"].get<size_t>());

  const Batch b = r.ids.batch(1.0);
  const double ours = t.model().evaluate(b);
  const std::string python = std::string(HEADROOM_SOURCE_DIR) + "/.venv-test/bin/python";
  const test::RunResult run =
      test::run_command(python + " " + HEADROOM_SOURCE_DIR + "/tests/hf/lora_reference.py check " +
                        "gpt2 " + r.dir + " " + saved);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const double theirs =
      json::parse(test::read_file(r.dir + "/lora_check.json"))["loss"].get<double>();
  EXPECT_LE(std::abs(ours - theirs), 1e-5 * std::abs(theirs))
      << "headroom " << ours << ", PEFT with the saved adapter " << theirs;
  // The adapters trained: the base alone gives another loss, so the equality above is theirs.
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Gpt<float> base(t.model().config(), *device, 1);
  load_weights(r.dir + "/base", base);
  const double base_loss = base.evaluate(b);
  EXPECT_GT(std::abs(ours - base_loss), 1e-4 * base_loss);
  std::cout << "[ parity ] lora saved adapter: loss " << ours << ", PEFT " << theirs << "\n";
}

INSTANTIATE_TEST_SUITE_P(Archs, LoraParity, ::testing::Values("gpt2", "llama"),
                         [](const auto& info) { return info.param; });

const char* kToy =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
    "[train]\nsteps = 4\nmicro_batch = 2\nlr = 1e-2\n";

std::string lora_table(const std::string& keys) {
  return "[[plugins]]\nname = \"lora\"\n" + keys;
}

// The plugin's run: every base weight bitwise the init's, every adapter's B moved from zero; the
// gradients and AdamW's moments are the adapters' alone, to the byte.
TEST(LoraPlugin, TrainsTheAdaptersAloneOnAFrozenBase) {
  const Config c =
      test::config_from(kToy + lora_table("r = 2\nalpha = 4.0\ntarget_modules = [\"c_attn\", "
                                          "\"mlp.c_proj\"]\n"));
  std::unique_ptr<Device> d0 = Device::create(DeviceConfig{});
  Gpt<float> init(c.model, *d0, c.train.seed);  // the base alone: the adapters draw apart
  Trainer t(c, TrainOptions{});
  t.run();
  uint64_t adapters = 0;
  int adapted = 0;
  std::map<std::string, const Param<float>*> base;
  for (const Param<float>* p : init.params())
    base[p->name] = p;
  for (const Param<float>* p : t.model().params()) {
    const std::vector<float> now = host_of(t.device(), p->master().value, p->numel);
    if (!is_adapter_param(p->name)) {
      EXPECT_TRUE(p->frozen) << p->name;
      EXPECT_TRUE(
          test::bitwise_equal(now, host_of(*d0, base.at(p->name)->master().value, p->numel)))
          << p->name << " is frozen but changed";
      continue;
    }
    EXPECT_FALSE(p->frozen) << p->name;
    adapters += p->numel;
    if (p->name.find("lora_B") != std::string::npos) {
      ++adapted;
      bool moved = false;
      for (float v : now)
        moved = moved || v != 0.0f;
      EXPECT_TRUE(moved) << p->name << " is still zero";
    }
  }
  EXPECT_EQ(adapted, 2 * 2);  // c_attn and mlp.c_proj of 2 blocks
  // r = 2: c_attn A (2, 32) + B (96, 2), mlp.c_proj A (2, 128) + B (32, 2), per block.
  EXPECT_EQ(adapters, uint64_t(2 * (2 * 32 + 96 * 2 + 2 * 128 + 32 * 2)));
  const auto& live = t.device().tracker().live_by_category();
  EXPECT_EQ(live[int(Category::kGradients)], 4 * adapters);
  EXPECT_EQ(live[int(Category::kOptimizer)], 8 * adapters);
  for (const StepState& s : t.history())
    EXPECT_TRUE(std::isfinite(s.loss));
}

TEST(LoraPlugin, ResumeIsBitwise) {
  const std::string toml = kToy + lora_table("r = 4\ntarget_modules = [\"c_attn\", \"c_fc\"]\n");
  Trainer whole(test::config_from(toml), TrainOptions{});
  whole.run();
  test::expect_resume_is_bitwise(toml, whole);
}

// With amp the frozen base is its bf16 copy alone; the adapters train with fp32 masters.
TEST(LoraPlugin, RunsWithAmp) {
  const Config c = test::config_from(kToy + lora_table("target_modules = \"c_attn\"\n") +
                                     "[[plugins]]\nname = \"amp\"\n");
  Trainer t(c, TrainOptions{});
  t.run();
  uint64_t adapters = 0, all = 0;
  for (const Param<float>* p : t.model().params()) {
    all += p->numel;
    if (!p->frozen) adapters += p->numel;
  }
  const auto& live = t.device().tracker().live_by_category();
  EXPECT_EQ(live[int(Category::kParameters)], 6 * adapters + 2 * (all - adapters));
  EXPECT_EQ(live[int(Category::kGradients)], 4 * adapters);
  EXPECT_TRUE(std::isfinite(t.history().back().loss));
}

TEST(LoraPlugin, ConfigErrorsNameTheirPlace) {
  auto error = [](const std::string& keys) {
    return test::error_of([&] { Trainer t(test::config_from(kToy + lora_table(keys)), {}); });
  };
  // kToy is 10 lines, the table's header and name 2 more: the plugin's keys start on line 13.
  const std::string none = error("target_modules = [\"c_attn\", \"q_proj\"]\n");
  EXPECT_HAS(none, "test.toml:13:18: plugins.lora.target_modules");
  EXPECT_HAS(none,
             "plugins.lora.target_modules: \"q_proj\" names no module of this gpt2 model "
             "(valid: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, the part after a dot "
             "of one, as \"c_attn\", or \"all-linear\")");
  EXPECT_HAS(error("r = 4\n"), "plugins.lora.target_modules: is required");
  const std::string dropout = error("target_modules = [\"c_attn\"]\ndropout = 1.0\n");
  EXPECT_HAS(dropout, "test.toml:14:11: plugins.lora.dropout");
  EXPECT_HAS(dropout, "plugins.lora.dropout: must be in [0, 1)");
  const std::string rank = error("target_modules = [\"c_attn\"]\nr = 0\n");
  EXPECT_HAS(rank, "test.toml:14:5: plugins.lora.r");
  EXPECT_HAS(rank, "plugins.lora.r: the rank must be between 1 and 2^20");
  EXPECT_HAS(error("target_modules = [\"c_attn\", 3]\n"),
             "plugins.lora.target_modules: entry 2 is an integer, expected a string");
  EXPECT_HAS(error("target_modules = [\"c_attn\"]\nrank = 4\n"), "rank");  // unknown key
}

// The dropout op: about p of the elements dropped, the rest scaled by 1 / (1 - p) exactly, the
// same mask from the same seed (in place too), another from another seed; bf16 as f32 rounded.
TEST(LoraDropout, TheOpDropsAboutPAndScalesTheRest) {
  std::unique_ptr<Device> d = Device::create(DeviceConfig{});
  Backend& o = d->backend();
  const uint64_t n = 200000;
  std::vector<float> x(n);
  for (uint64_t i = 0; i < n; ++i)
    x[i] = 0.25f + float(i % 97) * 0.01f;  // never 0
  Buffer in(*d, n * 4, Category::kWorkspace, "x"), out(*d, n * 4, Category::kWorkspace, "y");
  o.upload(in.as<void>(), x.data(), n * 4);
  o.dropout(Dtype::kF32, out.as<void>(), in.as<void>(), n, 0.3, 42);
  const std::vector<float> y = host_of(*d, out.as<void>(), n);
  uint64_t dropped = 0;
  for (uint64_t i = 0; i < n; ++i) {
    if (y[i] == 0.0f) {
      ++dropped;
      continue;
    }
    ASSERT_EQ(y[i], x[i] * (1.0f / 0.7f)) << i;
  }
  EXPECT_NEAR(double(dropped) / n, 0.3, 0.005);                      // 200k draws: sigma ~0.001
  o.dropout(Dtype::kF32, in.as<void>(), in.as<void>(), n, 0.3, 42);  // in place
  EXPECT_TRUE(test::bitwise_equal(host_of(*d, in.as<void>(), n), y));
  o.upload(in.as<void>(), x.data(), n * 4);
  o.dropout(Dtype::kF32, out.as<void>(), in.as<void>(), n, 0.3, 43);
  EXPECT_FALSE(test::bitwise_equal(host_of(*d, out.as<void>(), n), y));
}

// lora_dropout in training: the same run twice is bitwise, a resume is bitwise (the draws come
// from the step), training differs from dropout 0 after the first update, and evaluation drops
// nothing (the model's validation loss is the dropout-free one of the same weights).
TEST(LoraDropout, TrainsDeterministicallyResumesAndEvaluatesWithout) {
  const std::string toml =
      kToy + lora_table("r = 4\ndropout = 0.5\ntarget_modules = [\"c_attn\", \"c_fc\"]\n");
  Trainer a(test::config_from(toml), TrainOptions{}), b(test::config_from(toml), TrainOptions{});
  a.run();
  b.run();
  ASSERT_EQ(a.history().size(), b.history().size());
  for (size_t i = 0; i < a.history().size(); ++i)
    EXPECT_EQ(a.history()[i].loss, b.history()[i].loss) << "step " << i + 1;
  test::expect_resume_is_bitwise(toml, a);
  Trainer none(
      test::config_from(kToy + lora_table("r = 4\ntarget_modules = [\"c_attn\", \"c_fc\"]\n")),
      TrainOptions{});
  none.run();
  // B starts at zero: the first loss is the base's either way; the updates differ.
  EXPECT_EQ(a.history()[0].loss, none.history()[0].loss);
  EXPECT_NE(a.history().back().loss, none.history().back().loss);
  // Evaluation: a's weights in a model without dropout give a's evaluation loss.
  const Config c = test::config_from(toml);
  // (2, 16) of kToy's vocabulary: tokens 7·i, targets 5·i, mod 64.
  const test::TokenBatch ids = test::arithmetic_batch(2, 16, 64, 7, 0, 5, 0);
  const Batch batch = ids.batch(1.0, 99);  // evaluate() draws nothing whatever the seed
  const double with = a.model().evaluate(batch);
  Tuning plain;
  plain.lora = {{"c_attn", 4, 4.0, 0.0}, {"c_fc", 4, 4.0, 0.0}};
  std::unique_ptr<Device> d = Device::create(DeviceConfig{});
  Gpt<float> m(c.model, *d, c.train.seed, Precision(), 1, false, nullptr, plain);
  const auto weights = download_params(a.model());
  const auto params = m.params();
  for (size_t i = 0; i < params.size(); ++i)
    d->backend().upload(params[i]->master().value, weights[i].data(), 4 * weights[i].size());
  m.sync_compute_params();
  EXPECT_EQ(with, m.evaluate(batch));
}

// The adapters' gradients with dropout are the gradients of the loss with that mask: against
// central differences of the loss over A's and B's elements, the mask drawn again from the same
// batch seed each time.
TEST(LoraDropout, GradientsAreTheLossesWithTheSameMask) {
  const Config c = test::config_from(kToy);
  std::unique_ptr<Device> d = Device::create(DeviceConfig{});
  Tuning t;
  t.lora = {{"c_attn", 2, 2.0, 0.4}};
  Gpt<float> m(c.model, *d, 7, Precision(), 1, false, nullptr, t);
  Backend& o = d->backend();
  // B nonzero, so that A has a gradient too.
  for (Param<float>* p : m.params())
    if (p->name.find("lora_B") != std::string::npos) {
      std::vector<float> v(p->numel);
      for (size_t i = 0; i < v.size(); ++i)
        v[i] = 0.05f * float(int(i % 7) - 3);
      o.upload(p->master().value, v.data(), 4 * v.size());
    }
  const test::TokenBatch ids = test::arithmetic_batch(2, 16, 64, 11, 0, 3, 0);
  const Batch b = ids.batch(1.0 / 32, 1234);
  auto loss = [&] {
    m.zero_grad();
    m.forward(b);
    m.backward(b);
    const double l = m.loss();
    m.release_micro_step();
    return l;
  };
  loss();
  int checked = 0;
  for (Param<float>* p : m.params()) {
    if (!is_adapter_param(p->name) || p->name.rfind("h.0.", 0) != 0) continue;
    const std::vector<float> g = host_of(*d, p->master().grad, p->numel);
    std::vector<float> v = host_of(*d, p->master().value, p->numel);
    for (size_t i = 0; i < p->numel; i += p->numel / 5 + 1) {
      const float keep = v[i], eps = 1e-2f;
      v[i] = keep + eps;
      o.upload(p->master().value, v.data(), 4 * v.size());
      const double up = loss();
      v[i] = keep - eps;
      o.upload(p->master().value, v.data(), 4 * v.size());
      const double down = loss();
      v[i] = keep;
      o.upload(p->master().value, v.data(), 4 * v.size());
      const double fd = (up - down) / (2.0 * eps);
      EXPECT_NEAR(g[i], fd, 2e-3 + 2e-2 * std::abs(fd)) << p->name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GE(checked, 10);
}

}  // namespace
}  // namespace headroom
