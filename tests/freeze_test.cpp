// Frozen parameters ([train] freeze, core/model/model.h Param::frozen): no gradient, optimizer
// state or master copy; the backward skips their weight gradients and still passes the input
// gradient down. Bytes against the closed form, frozen weights bitwise unchanged by training,
// gradients of the rest as a model with nothing frozen computes them, an exact resume, and the
// config's errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/hf_folder.h"
#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "core/plan/plan.h"
#include "core/report/advice.h"
#include "core/run/snapshot.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

const char* kToy =
    "[model]\nn_layer = 3\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
    "[train]\nsteps = 4\nmicro_batch = 2\ngrad_accum = 2\nlr = 1e-2\n"
    "freeze = [\"wte.weight\", \"h.*.mlp.*\", \"h.1.ln_?.*\"]\n";

std::vector<uint8_t> bytes_of(Device& d, const void* p, size_t n) {
  std::vector<uint8_t> out(n);
  d.backend().download(out.data(), p, n);
  return out;
}

uint64_t trainable_numel(const Gpt<float>& model) {
  uint64_t n = 0;
  for (const Param<float>* p : model.trainable_params())
    n += p->numel;
  return n;
}

// The tracker at the peak equals the closed form by category, and at rest the gradients and
// AdamW's moments are those of the trainable parameters alone, to the byte.
void expect_bytes(const std::string& toml, uint64_t weight_bytes, uint64_t frozen_weight_bytes) {
  const Config c = test::config_from(toml);
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  const PeakEstimate e = estimate_config(c).peak;
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
  EXPECT_EQ(e.total(), mt.peak_total());
  const uint64_t trainable = trainable_numel(t.model());
  const uint64_t frozen = t.model().num_params() - trainable;
  ASSERT_GT(frozen, 0u);
  ASSERT_GT(trainable, 0u);
  const auto& live = mt.live_by_category();
  EXPECT_EQ(live[int(Category::kGradients)], 4 * trainable);
  EXPECT_EQ(live[int(Category::kOptimizer)], 8 * trainable);
  EXPECT_EQ(live[int(Category::kParameters)],
            weight_bytes * trainable + frozen_weight_bytes * frozen);
}

TEST(Freeze, BytesEqualTheClosedFormFp32) {
  expect_bytes(kToy, 4, 4);
}

// amp (bf16, fp32 masters and gradients): a frozen weight is its bf16 copy alone.
TEST(Freeze, BytesEqualTheClosedFormWithAmp) {
  expect_bytes(std::string(kToy) + "[[plugins]]\nname = \"amp\"\n", 6, 2);
}

// Training moves every trainable parameter and no frozen one, bitwise; the frozen ones have no
// gradient and are out of the optimizer's segments.
TEST(Freeze, FrozenWeightsAreBitwiseUnchangedWhileTheRestTrain) {
  const Config c = test::config_from(kToy);
  std::unique_ptr<Device> d0 = Device::create(DeviceConfig{});
  Gpt<float> init(c.model, *d0, c.train.seed);  // the same init: freezing moves no random draw
  Trainer t(c, TrainOptions{});
  t.run();
  const auto before = init.params();
  const auto after = t.model().params();
  ASSERT_EQ(before.size(), after.size());
  int frozen = 0, trained = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const Param<float>& p = *after[i];
    ASSERT_EQ(p.name, before[i]->name);
    const size_t n = p.numel * sizeof(float);
    const bool same =
        bytes_of(t.device(), p.master().value, n) == bytes_of(*d0, before[i]->master().value, n);
    if (is_frozen(c.train.freeze, p.name)) {
      ++frozen;
      EXPECT_TRUE(p.frozen) << p.name;
      EXPECT_TRUE(same) << p.name << " is frozen but changed";
      EXPECT_EQ(p.master().grad, nullptr) << p.name;
      EXPECT_EQ(p.compute().grad, nullptr) << p.name;
    } else {
      ++trained;
      EXPECT_FALSE(p.frozen) << p.name;
      EXPECT_FALSE(same) << p.name << " trains but did not change";
    }
  }
  // wte; each block's four MLP tensors; block 1's ln_1 and ln_2 weight and bias.
  EXPECT_EQ(frozen, 1 + 3 * 4 + 4);
  EXPECT_GT(trained, 0);
}

// The backward of a model with frozen parameters computes the others' gradients exactly as the
// same model with nothing frozen: the input gradients pass through the frozen layers unchanged.
TEST(Freeze, TrainableGradientsAreThoseOfTheUnfrozenModel) {
  const Config c = test::config_from(kToy);
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Gpt<float> whole(c.model, *device, 7);
  Gpt<float> part(c.model, *device, 7, Precision(), 1, false, nullptr, Tuning{c.train.freeze, {}});
  const test::TokenBatch ids = test::arithmetic_batch(2, c.model.seq_len, 64, 7, 3, 5, 1);
  const Batch b = ids.batch(1.0 / double(ids.tokens.size()));
  for (Gpt<float>* m : {&whole, &part}) {
    m->zero_grad();
    m->forward(b);
    m->backward(b);
  }
  EXPECT_EQ(whole.loss(), part.loss());
  const auto a = whole.params(), p = part.params();
  int compared = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i]->frozen) continue;
    ++compared;
    EXPECT_EQ(std::memcmp(a[i]->master().grad, p[i]->master().grad, p[i]->numel * sizeof(float)), 0)
        << p[i]->name;
  }
  EXPECT_GT(compared, 0);
}

// frozen_init_chunk_bytes() set for a scope.
struct InitChunk {
  explicit InitChunk(uint64_t bytes) : was(frozen_init_chunk_bytes()) {
    set_frozen_init_chunk_bytes(bytes);
  }
  ~InitChunk() { set_frozen_init_chunk_bytes(was); }
  InitChunk(const InitChunk&) = delete;
  InitChunk& operator=(const InitChunk&) = delete;
  uint64_t was;
};

// A Llama of 2 blocks whose untied lm_head (256, 32) is its largest frozen tensor.
const char* kLlamaToy =
    "[model]\narch = \"llama\"\nn_layer = 2\nn_head = 4\nn_kv_head = 2\nn_embd = 32\n"
    "seq_len = 16\nvocab_size = 256\nintermediate_size = 48\n";

// With amp a frozen weight is its bf16 copy alone, and its init goes straight into that copy a
// chunk at a time, through an f32 transient cast on the device (Layer::write_init). The copies
// are bitwise those of the same seed with nothing frozen, whose bf16 copies are the cast of the
// whole f32 masters: for [train] freeze and for LoRA (everything but the adapters frozen), GPT-2
// and Llama, at a chunk of 250 elements (which divides no weight) and at the default chunk.
TEST(Freeze, FrozenComputeCopiesAreTheUnfrozenModelsBitwise) {
  struct Case {
    const char* toml;
    std::vector<std::string> freeze;
    const char* lora_target;
  };
  const Case cases[] = {{kToy, test::config_from(kToy).train.freeze, "c_attn"},
                        {kLlamaToy,
                         {"model.embed_tokens.weight", "model.layers.*.mlp.*", "lm_head.weight"},
                         "q_proj"}};
  for (uint64_t chunk : {uint64_t(1000), frozen_init_chunk_bytes()}) {
    InitChunk scope(chunk);
    for (const Case& k : cases) {
      SCOPED_TRACE(std::string(k.lora_target) + ", chunk " + std::to_string(chunk));
      const Config c = test::config_from(k.toml);
      std::unique_ptr<Device> device = Device::create(DeviceConfig{});
      const Precision amp(Dtype::kBF16);
      Gpt<float> whole(c.model, *device, 7, amp);
      for (const Tuning& tuning : {Tuning{k.freeze, {}}, Tuning{{}, {{k.lora_target, 2, 4.0}}}}) {
        Gpt<float> part(c.model, *device, 7, amp, 1, false, nullptr, tuning);
        int frozen = 0, compared = 0;
        for (const Param<float>* p : part.params()) {
          if (is_adapter_param(p->name)) continue;
          const Param<float>* w = nullptr;
          for (const Param<float>* q : whole.params())
            if (q->name == p->name) w = q;
          ASSERT_NE(w, nullptr) << p->name;
          ASSERT_EQ(p->compute().dtype, Dtype::kBF16) << p->name;
          const size_t n = p->numel * 2;
          EXPECT_EQ(bytes_of(*device, p->compute().value, n),
                    bytes_of(*device, w->compute().value, n))
              << p->name;
          ++compared;
          if (!p->frozen) continue;
          ++frozen;
          EXPECT_EQ(p->master().value, nullptr) << p->name << ": no f32 values after setup";
        }
        EXPECT_GT(frozen, 0);
        EXPECT_EQ(size_t(compared), whole.params().size());
      }
    }
  }
}

// Setup holds no layer's frozen f32 values: with amp and LoRA, the last layer built, a Llama's
// untied head, writes its frozen lm_head (256, 32) through one chunk of f32 values, so the
// tracker's peak once the model is built is what it holds at rest plus that chunk, to the byte.
// (Initialising the head's frozen f32 values whole held 4 · (256 · 32 + 32) bytes beside it.)
TEST(Freeze, SetupHoldsOneChunkOfAFrozenWeightsInit) {
  const uint64_t chunk = 4096;  // 1,024 f32 values; lm_head has 8,192
  InitChunk scope(chunk);
  const Config c = test::config_from(kLlamaToy);
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Gpt<float> m(c.model, *device, 7, Precision(Dtype::kBF16), 1, false, nullptr,
               Tuning{{}, {{"q_proj", 2, 4.0}}});
  uint64_t frozen = 0, trainable = 0, lm_head = 0;
  for (const Param<float>* p : m.params()) {
    (p->frozen ? frozen : trainable) += p->numel;
    if (p->name == "lm_head.weight") lm_head = p->numel;
  }
  ASSERT_EQ(lm_head, 256u * 32);
  ASSERT_GT(4 * lm_head, chunk);
  const MemoryTracker& mt = device->tracker();
  // At rest: the frozen weights in bf16, the adapters' f32 masters, bf16 copies and f32
  // gradients; no workspace.
  EXPECT_EQ(mt.live(Category::kParameters), 2 * frozen + 6 * trainable);
  EXPECT_EQ(mt.live(Category::kGradients), 4 * trainable);
  EXPECT_EQ(mt.live(Category::kWorkspace), 0u);
  EXPECT_EQ(mt.live_at_peak()[int(Category::kWorkspace)], chunk);
  EXPECT_EQ(mt.peak_total(), mt.live_total() + chunk);

  // init_from loads the frozen weights the same way: the peak stays, and lm_head's bf16 copy is
  // what a model with nothing frozen makes of the same file.
  const std::string file = test::temp_dir() + "/base";
  {
    std::unique_ptr<Device> other = Device::create(DeviceConfig{});  // not on m's tracker
    save_hf_folder(file, Gpt<float>(c.model, *other, 11));
  }
  const uint64_t peak = mt.peak_total();
  load_weights(file, m, m.master_access(false, true));
  EXPECT_EQ(mt.peak_total(), peak);
  Gpt<float> plain(c.model, *device, 7, Precision(Dtype::kBF16));
  load_weights(file, plain, plain.master_access(false, true));
  for (const Param<float>* p : m.params()) {
    if (p->name != "lm_head.weight") continue;
    for (const Param<float>* q : plain.params()) {
      if (q->name != p->name) continue;
      EXPECT_EQ(bytes_of(*device, p->compute().value, 2 * p->numel),
                bytes_of(*device, q->compute().value, 2 * q->numel));
    }
  }
}

// The first metrics record says how many parameters the model has and how many train.
TEST(Freeze, MetricsCountTheTrainableParameters) {
  const std::string dir = test::temp_dir();
  TrainOptions o;
  o.metrics_path = dir + "/metrics.jsonl";
  Trainer t(test::config_from(kToy), std::move(o));
  t.run();
  const std::string text = test::read_file(dir + "/metrics.jsonl");
  const nlohmann::json first = nlohmann::json::parse(text.substr(0, text.find('\n')));
  EXPECT_EQ(first["params"].get<uint64_t>(), t.model().num_params());
  EXPECT_EQ(first["trainable_params"].get<uint64_t>(), trainable_numel(t.model()));
  EXPECT_LT(trainable_numel(t.model()), t.model().num_params());
}

TEST(Freeze, ResumeIsBitwise) {
  Trainer whole(test::config_from(kToy), TrainOptions{});
  whole.run();
  test::expect_resume_is_bitwise(kToy, whole);
}

// A snapshot trained on one frozen base does not resume on another: init_from another file.
TEST(Freeze, AResumeOnAnotherFrozenBaseIsRefused) {
  const std::string dir = test::temp_dir();
  const Config c = test::config_from(kToy);
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  for (const int seed : {5, 6}) {
    Gpt<float> m(c.model, *device, uint64_t(seed));
    save_safetensors(dir + "/base" + std::to_string(seed) + ".safetensors", m);
  }
  auto toml = [&](int seed) {
    return std::string(kToy) + "init_from = \"" + dir + "/base" + std::to_string(seed) +
           ".safetensors\"\n[snapshot]\nevery = 2\ndir = \"" + dir + "/s\"\n";
  };
  Trainer(test::config_from(toml(5), {"train.steps=2"}), TrainOptions{}).run();
  TrainOptions other;
  other.resume_dir = dir + "/s";
  const std::string e =
      test::error_of([&] { Trainer(test::config_from(toml(6)), std::move(other)).run(); });
  EXPECT_HAS(e, "was trained on another frozen base: train.init_from " + dir +
                    "/base5.safetensors, 17 tensors of checksum ");
  EXPECT_HAS(e, ", but this run's is train.init_from " + dir + "/base6.safetensors, 17 tensors");
  // The snapshot names its base and holds none of it.
  std::string newest;
  const SnapshotData d = read_newest_snapshot(dir + "/s", &newest);
  ASSERT_TRUE(d.frozen_base.has_value());
  EXPECT_EQ(d.frozen_base->init_from, dir + "/base5.safetensors");
  EXPECT_EQ(d.frozen_base->tensors, 17u);
  for (const auto& [name, bytes] : d.tensors)
    EXPECT_FALSE(is_frozen(c.train.freeze, name)) << name << " is frozen, yet in the snapshot";
  TrainOptions same;
  same.resume_dir = dir + "/s";
  Trainer(test::config_from(toml(5)), std::move(same)).run();  // its own base: resumes
}

TEST(Freeze, PlanCountsTheTrainableParameters) {
  const PlanResult r = plan(test::config_from(kToy));
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  const Config c = test::config_from(kToy);
  Gpt<float> m(c.model, *device, 1, Precision(), 1, false, nullptr, Tuning{c.train.freeze, {}});
  EXPECT_HAS(r.text, std::to_string(trainable_numel(m)) + " trainable");
}

TEST(Freeze, APatternThatMatchesNothingNamesItsPlace) {
  const std::string toml =
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 1\nfreeze = [\"wte.weight\",\n  \"h.*.mlp.c_fcc.*\"]\n";
  const std::string e = test::error_of([&] { Trainer t(test::config_from(toml), TrainOptions{}); });
  EXPECT_HAS(e, "test.toml:10:3: train.freeze: \"h.*.mlp.c_fcc.*\" matches no parameter");
  EXPECT_HAS(e, "h.0.mlp.c_fc.weight");  // what it could match
  const std::string p = test::error_of([&] { plan(test::config_from(toml)); });
  EXPECT_HAS(p, "test.toml:10:3: train.freeze");
}

TEST(Freeze, BadValuesAreConfigErrors) {
  const std::string model =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n[train]\n";
  EXPECT_HAS(test::error_of([&] { test::config_from(model + "freeze = \"wte.weight\"\n"); }),
             "test.toml:8:");
  EXPECT_HAS(test::error_of([&] { test::config_from(model + "freeze = [\"wte.weight\", 3]\n"); }),
             "test.toml:8:25: train.freeze: each entry must be a non-empty string");
  const std::string all = test::error_of(
      [&] { Trainer t(test::config_from(model + "freeze = [\"*\"]\n"), TrainOptions{}); });
  EXPECT_HAS(all, "test.toml:8:11: train.freeze freezes every parameter");
}

}  // namespace
}  // namespace headroom
