// A LoRA run's quantized frozen base (Tuning::base, the lora plugin's base_dtype): the weights'
// bytes in the parameters category are their closed form (gpt_quantized_base_bytes) for every
// kind with and without double quantization, a quantized model computes exactly what an f32
// model holding its dequantized weights computes, a resume is bitwise, and the config errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/model.h"
#include "core/model/safetensors.h"
#include "core/run/trainer.h"
#include "kernels/cpu/quant.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

const char* kToy =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 16\nvocab_size = 64\n"
    "[train]\nsteps = 4\nmicro_batch = 2\nlr = 1e-2\n";

std::string lora(const std::string& keys) {
  return "[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = [\"c_attn\", \"c_proj\", "
         "\"c_fc\"]\n" +
         keys;
}

struct Base {
  const char* dtype;
  bool double_quant;
};

// At rest after a run: the adapters' f32 weights, the other frozen parameters' f32 weights and the
// quantized block weights' bytes, each quant_tensor_bytes of its elements; gradients and AdamW's
// moments the adapters' alone.
TEST(LoraQuantBase, BytesAreTheClosedForms) {
  for (const Base& b : {Base{"bf16", false}, Base{"int8", false}, Base{"int8", true},
                        Base{"nf4", false}, Base{"nf4", true}}) {
    SCOPED_TRACE(std::string(b.dtype) + (b.double_quant ? " + double_quant" : ""));
    const Config c =
        test::config_from(kToy + lora(std::string("base_dtype = \"") + b.dtype + "\"\n" +
                                      (b.double_quant ? "double_quant = true\n" : "")));
    Trainer t(c, TrainOptions{});
    t.run();
    const QuantKind k = parse_base_dtype(b.dtype);
    uint64_t adapters = 0, other_frozen = 0, quantized = 0;
    for (const Param<float>* p : t.model().params()) {
      if (!p->frozen) {
        adapters += p->numel;
      } else if (p->quant == QuantKind::kNone) {
        other_frozen += p->numel;
        EXPECT_FALSE(is_quantizable_weight(c.model, p->name)) << p->name;
      } else {
        EXPECT_EQ(p->quant, k);
        EXPECT_TRUE(is_quantizable_weight(c.model, p->name)) << p->name;
        ++quantized;
      }
    }
    EXPECT_EQ(quantized, 4u * 2);  // c_attn, attn.c_proj, c_fc, mlp.c_proj of 2 blocks
    const uint64_t base_bytes = gpt_quantized_base_bytes(c.model, k, b.double_quant);
    const auto& live = t.device().tracker().live_by_category();
    EXPECT_EQ(live[int(Category::kParameters)], 4 * adapters + 4 * other_frozen + base_bytes);
    EXPECT_EQ(live[int(Category::kGradients)], 4 * adapters);
    EXPECT_EQ(live[int(Category::kOptimizer)], 8 * adapters);
    EXPECT_EQ(live[int(Category::kWorkspace)], 0u);  // every transient freed
    EXPECT_TRUE(std::isfinite(t.history().back().loss));
  }
  // The closed form itself: GPT-2's four weights of n_embd 64 per block, e.g. nf4 with double
  // quantization: c_attn (192, 64), attn.c_proj (64, 64), c_fc (256, 64), mlp.c_proj (64, 256).
  const Config c = test::config_from(kToy);
  uint64_t want = 0;
  for (uint64_t n : {192u * 64, 64u * 64, 256u * 64, 64u * 256})
    want += (n / 2 + n / 64 + 4 * ((n / 64 + 255) / 256 + 1) + 15) / 16 * 16;
  EXPECT_EQ(gpt_quantized_base_bytes(c.model, QuantKind::kNF4, true), 2 * want);
}

// An nf4 (or int8) model computes what an f32-base model holding its dequantized weights does: the
// same loss and the same adapter gradients, bit for bit (the GEMMs read the same values).
TEST(LoraQuantBase, ComputesWhatItsDequantizedWeightsDo) {
  const Config c = test::config_from(kToy);
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  const std::vector<LoraSpec> specs = {{"c_attn", 2, 4.0}, {"c_fc", 2, 4.0}};
  for (QuantKind k : {QuantKind::kInt8, QuantKind::kNF4}) {
    SCOPED_TRACE(quant_kind_name(k));
    Gpt<float> q(c.model, *device, 7, Precision(), 1, false, nullptr, Tuning{{}, specs, k, true});
    Gpt<float> f(c.model, *device, 7, Precision(), 1, false, nullptr, Tuning{{}, specs});
    const std::vector<std::vector<float>> values = download_params(q, q.master_access(true, false));
    const auto fp = f.params();
    for (size_t i = 0; i < fp.size(); ++i)
      f.device().backend().upload(fp[i]->master().value, values[i].data(),
                                  values[i].size() * sizeof(float));
    // The quantized ones moved off their f32 init: the comparison is not of two f32 models.
    const std::vector<std::vector<float>> init = download_params(f, nullptr);
    Gpt<float> plain(c.model, *device, 7, Precision(), 1, false, nullptr, Tuning{{}, specs});
    const std::vector<std::vector<float>> f32 = download_params(plain, nullptr);
    bool moved = false;
    for (size_t i = 0; i < fp.size(); ++i)
      moved = moved || (fp[i]->name == "h.0.attn.c_attn.weight" && init[i] != f32[i]);
    EXPECT_TRUE(moved);

    const test::TokenBatch ids = test::arithmetic_batch(2, c.model.seq_len, 64, 7, 3, 5, 1);
    const Batch b = ids.batch(1.0 / double(ids.tokens.size()));
    for (Gpt<float>* m : {&q, &f}) {
      m->zero_grad();
      m->forward(b);
      m->backward(b);
    }
    EXPECT_EQ(q.loss(), f.loss());
    const auto qp = q.params();
    int compared = 0;
    for (size_t i = 0; i < qp.size(); ++i) {
      if (qp[i]->frozen) continue;
      ++compared;
      EXPECT_EQ(
          std::memcmp(qp[i]->master().grad, fp[i]->master().grad, qp[i]->numel * sizeof(float)), 0)
          << qp[i]->name;
    }
    EXPECT_EQ(compared, 2 * 2 * 2);
  }
}

// The setup quantizes each weight's init on the host straight into its bytes (Layer::write_init):
// no T values of a quantized weight are ever on the device, so the tracker's peak once the model
// is built is what it holds at rest. The codes are those of quantizing the f32 init of the same
// seed with nothing quantized: they dequantize to what the host's quantization of it gives.
TEST(LoraQuantBase, SetupQuantizesEachWeightOnTheHost) {
  const Config c = test::config_from(kToy);
  const std::vector<LoraSpec> specs = {{"c_attn", 2, 4.0}, {"c_fc", 2, 4.0}};
  std::unique_ptr<Device> plain_device = Device::create(DeviceConfig{});
  Gpt<float> plain(c.model, *plain_device, 7);
  const std::vector<std::vector<float>> f32 = download_params(plain, nullptr);
  const auto pp = plain.params();
  for (QuantKind k : {QuantKind::kInt8, QuantKind::kNF4}) {
    for (bool dq : {false, true}) {
      SCOPED_TRACE(std::string(quant_kind_name(k)) + (dq ? " + double_quant" : ""));
      std::unique_ptr<Device> device = Device::create(DeviceConfig{});
      Gpt<float> q(c.model, *device, 7, Precision(), 1, false, nullptr, Tuning{{}, specs, k, dq});
      EXPECT_EQ(device->tracker().peak_total(), device->tracker().live_total());
      const std::vector<std::vector<float>> values =
          download_params(q, q.master_access(true, false));
      const auto qp = q.params();
      int quantized = 0;
      for (size_t i = 0; i < qp.size(); ++i) {
        if (is_adapter_param(qp[i]->name)) continue;
        size_t j = 0;
        while (j < pp.size() && pp[j]->name != qp[i]->name)
          ++j;
        ASSERT_LT(j, pp.size()) << qp[i]->name;
        std::vector<float> want = f32[j];
        if (qp[i]->quant != QuantKind::kNone) {
          ++quantized;
          std::vector<unsigned char> codes(quant_tensor_bytes(k, want.size(), dq), 0);
          cpu::quantize_tensor(k, want.data(), want.size(), dq, codes.data());
          cpu::dequantize_tensor(k, codes.data(), want.size(), dq,
                                 [&](uint64_t e, float x) { want[e] = x; });
        }
        EXPECT_EQ(std::memcmp(values[i].data(), want.data(), want.size() * sizeof(float)), 0)
            << qp[i]->name;
      }
      EXPECT_EQ(quantized, 4 * 2);
    }
  }
}

TEST(LoraQuantBase, ResumeIsBitwise) {
  for (const char* keys :
       {"base_dtype = \"nf4\"\ndouble_quant = true\n", "base_dtype = \"int8\"\n"}) {
    SCOPED_TRACE(keys);
    const std::string toml = kToy + lora(keys);
    Trainer whole(test::config_from(toml), TrainOptions{});
    whole.run();
    test::expect_resume_is_bitwise(toml, whole);
  }
}

TEST(LoraQuantBase, ConfigErrorsNameTheirPlace) {
  auto error = [](const std::string& keys) {
    return test::error_of([&] { Trainer t(test::config_from(kToy + lora(keys)), {}); });
  };
  // kToy is 10 lines, the table 4 more: the keys given here start on line 15.
  const std::string bad = error("base_dtype = \"fp8\"\n");
  EXPECT_HAS(bad, "test.toml:15:14: plugins.lora.base_dtype");
  EXPECT_HAS(bad, "\"fp8\" is none of \"f32\", \"bf16\", \"int8\", \"nf4\"");
  const std::string dq = error("base_dtype = \"bf16\"\ndouble_quant = true\n");
  EXPECT_HAS(dq, "test.toml:16:16: plugins.lora.double_quant");
  EXPECT_HAS(dq, "quantizes the absmaxes of an int8 or nf4 base");
  EXPECT_HAS(error("base_dtype = 4\n"), "plugins.lora.base_dtype");
}

}  // namespace
}  // namespace headroom
