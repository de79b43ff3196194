// The whole model: gradient against finite differences, gradient accumulation, memory closed forms,
// learning the synthetic source.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/device/device.h"
#include "core/model/model.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

TEST(ModelGradient, WholeModelMatchesCentralDifferencesInDouble) {
  ModelConfig m;
  m.n_layer = 2;
  m.n_head = 2;
  m.n_embd = 8;
  m.seq_len = 5;
  m.vocab_size = 11;
  auto device = Device::create(DeviceConfig{});
  Gpt<double> model(m, *device, 7);

  std::mt19937_64 rng(3);
  test::perturb_params(model, rng);

  const int B = 2, T = 5;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    tokens[i] = int32_t(rng() % 11);
    targets[i] = int32_t(rng() % 11);
  }
  targets[3] = -1;  // an ignored position: no loss, no gradient
  Batch batch;
  batch.tokens = tokens.data();
  batch.targets = targets.data();
  batch.B = B;
  batch.T = T;
  batch.dloss = 1.0 / (B * T - 1);  // forward returns the mean over the counted tokens

  model.zero_grad();
  model.forward(batch);
  model.backward(batch);

  std::vector<double> analytic, numeric;
  const double h = 1e-5;
  test::finite_differences(model, batch, h, &analytic, &numeric);
  ASSERT_EQ(analytic.size(), gpt_num_params(m));
  EXPECT_LT(test::relative_error(analytic, numeric), 1e-6);
  for (size_t i = 0; i < analytic.size(); ++i)
    ASSERT_NEAR(analytic[i], numeric[i], 1e-6 * std::max(std::abs(numeric[i]), 1e-3)) << i;
  // Backward freed every activation and workspace buffer.
  EXPECT_EQ(device->tracker().live(Category::kActivations), 0u);
  EXPECT_EQ(device->tracker().live(Category::kWorkspace), 0u);
}

Config small_config(int micro_batch, int grad_accum, const std::string& extra = "") {
  return test::config_from(
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 3\nlr = 1e-3\nwarmup_steps = 0\nmicro_batch = " +
      std::to_string(micro_batch) + "\ngrad_accum = " + std::to_string(grad_accum) + "\n" + extra);
}

std::vector<double> parameters_after_run(const Config& config) {
  Trainer trainer(config, TrainOptions{});
  trainer.run();
  std::vector<double> out;
  for (Param<float>* p : trainer.model().params())
    out.insert(out.end(), p->master().value, p->master().value + p->numel);
  return out;
}

TEST(GradientAccumulation, TwoTimesFourEqualsEightTimesOne) {
  const std::vector<double> accumulated = parameters_after_run(small_config(2, 4));
  const std::vector<double> one_batch = parameters_after_run(small_config(8, 1));
  const std::vector<double> initial = [] {
    Config c = small_config(8, 1);
    auto device = Device::create(c.device);
    Gpt<float> model(c.model, *device, c.train.seed);
    std::vector<double> v;
    for (Param<float>* p : model.params())
      v.insert(v.end(), p->master().value, p->master().value + p->numel);
    return v;
  }();
  EXPECT_LT(test::relative_error(accumulated, one_batch), 1e-5);
  // ...and training moved the parameters, so the comparison means something.
  EXPECT_GT(test::relative_error(one_batch, initial), 1e-3);
}

// Closed form of GPT-2's parameter count, written out here independently of the model code:
// wte (V, C) + wpe (T, C) + per block [ln_1 2C, c_attn 3C·C + 3C, c_proj C·C + C, ln_2 2C,
// c_fc 4C·C + 4C, mlp c_proj 4C·C + C] = 12C² + 13C + ln_f 2C.
uint64_t closed_form_params(const ModelConfig& m) {
  const uint64_t C = m.n_embd;
  return uint64_t(m.vocab_size) * C + uint64_t(m.seq_len) * C +
         uint64_t(m.n_layer) * (12 * C * C + 13 * C) + 2 * C;
}

struct MemoryCase {
  const char* name;
  const char* optimizer_toml;
  uint64_t state_floats_per_param;
};

class TrackerClosedForm : public ::testing::TestWithParam<MemoryCase> {};

TEST_P(TrackerClosedForm, ParameterGradientOptimizerBytes) {
  const Config c = small_config(2, 1, GetParam().optimizer_toml);
  Trainer trainer(c, TrainOptions{});
  trainer.run();
  const MemoryTracker& mt = trainer.device().tracker();
  const uint64_t n = closed_form_params(c.model);
  EXPECT_EQ(n, 64u * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 64);
  EXPECT_EQ(mt.live(Category::kParameters), 4 * n);
  EXPECT_EQ(mt.live(Category::kGradients), 4 * n);
  EXPECT_EQ(mt.peak(Category::kOptimizer), 4 * n * GetParam().state_floats_per_param);
  EXPECT_EQ(mt.live(Category::kOptimizer), 4 * n * GetParam().state_floats_per_param);
  // Between steps nothing but the persistent state and the batch buffers is live.
  EXPECT_EQ(mt.live(Category::kActivations), 0u);
  EXPECT_EQ(mt.live(Category::kWorkspace), 0u);
  // The activation peak is at least one block's saved tensors (closed form in the model).
  EXPECT_GE(mt.peak(Category::kActivations),
            2 * gpt_block_activation_bytes(c.model, 2, 16, Dtype::kF32));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, TrackerClosedForm,
                         ::testing::Values(MemoryCase{"AdamW", "optimizer = \"adamw\"\n", 2},
                                           MemoryCase{"Sgd", "optimizer = \"sgd\"\n", 0},
                                           MemoryCase{"SgdMomentum",
                                                      "optimizer = \"sgd\"\nmomentum = 0.9\n", 1}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Convergence, SyntheticLossComesWithinTenPercentOfTheEntropy) {
  const Config c = test::config_from(
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n"
      "[train]\nsteps = 300\nmicro_batch = 16\nlr = 1e-2\nwarmup_steps = 10\nweight_decay = 0.0\n"
      "[data]\nkind = \"synthetic\"\nbranching = 4\nseed = 5\n");
  Trainer trainer(c, TrainOptions{});
  trainer.run();
  const double entropy = trainer.data().entropy();
  ASSERT_GT(entropy, 0.3);
  // The last 20 steps' mean: one step's loss is a noisy estimate.
  double sum = 0;
  for (size_t i = trainer.history().size() - 20; i < trainer.history().size(); ++i)
    sum += trainer.history()[i].loss;
  const double final_loss = sum / 20;
  std::printf("entropy %.4f nats/token, final loss %.4f (%.1f%% above)\n", entropy, final_loss,
              100 * (final_loss / entropy - 1));
  EXPECT_LT(final_loss, 1.10 * entropy);
  EXPECT_GT(final_loss, 0.95 * entropy);  // below the entropy would mean a leak of the targets
}

}  // namespace
}  // namespace headroom
