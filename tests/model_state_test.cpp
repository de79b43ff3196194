// The model state's layouts amp chooses (core/model/model.h Precision, headroom.precision/1):
// fp32 or bf16 gradient accumulation, no fp32 masters with stochastic rounding, bf16 optimizer
// state. Their bytes against the closed form and against k·Ψ, the stochastic rounding against a
// double-precision emulation, and an exact resume.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/plugin_host/plugin_host.h"
#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "kernels/common/dtype.h"
#include "kernels/common/elementwise.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// A 12-layer toy, and gpt2-124m's shapes at a short sequence (the model state is what is
// checked; the activations' closed form is the same for any seq_len).
const char* kToy12 =
    "[model]\nn_layer = 12\nn_head = 4\nn_embd = 64\nseq_len = 32\nvocab_size = 256\n"
    "[train]\nsteps = 2\nmicro_batch = 4\ngrad_accum = 2\n";
const char* kGpt2 =
    "[model]\nn_layer = 12\nn_head = 12\nn_embd = 768\nseq_len = 32\nvocab_size = 50257\n"
    "[train]\nsteps = 1\nmicro_batch = 1\n";

struct Layout {
  const char* name;
  const char* amp_keys;
  uint64_t model_state_per_param;  // parameters + gradients + AdamW's state, bytes a parameter
};
const Layout kLayouts[] = {
    {"GradFp32", "", 18},
    {"GradBf16", "grad_dtype = \"bf16\"\n", 16},
    {"NoMasters", "master_weights = false\n", 12},
    {"NoMastersBf16State", "master_weights = false\nstate_dtype = \"bf16\"\n", 8},
};

// Its name in test listings (GoogleTest prints a parameter's bytes otherwise).
void PrintTo(const Layout& l, std::ostream* os) {
  *os << l.name;
}

std::string with_amp(const char* model, const Layout& l) {
  return std::string(model) + "[[plugins]]\nname = \"amp\"\n" + l.amp_keys;
}

// Parameters + gradients + optimizer state at rest are k·Ψ (at the peak the backward of a layer
// also holds its and the tied wte's bf16 gradients of one micro-step, with fp32 accumulation),
// and they are what amp's estimate says. With two steps or more (the optimizer state exists in
// the second step's backward) the tracker's bytes at the peak equal the closed form by category.
void expect_bytes(const std::string& toml, const Layout& l) {
  const Config c = test::config_from(toml);
  Trainer t(c, TrainOptions{});
  t.run();
  const MemoryTracker& mt = t.device().tracker();
  const ConfigEstimate e = estimate_config(c);
  ASSERT_EQ(e.plugins.size(), 1u);
  ASSERT_TRUE(e.plugins[0].ok()) << e.plugins[0].status;
  const auto& live = mt.live_by_category();  // after the run: no backward in flight
  for (Category k : {Category::kParameters, Category::kOptimizer})
    EXPECT_EQ(e.peak.at_peak[int(k)], live[int(k)]) << l.name << " " << category_name(k);
  if (c.train.steps > 1) {
    for (int i = 0; i < kNumCategories; ++i)
      EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i])
          << l.name << " " << category_name(category_at(i));
    EXPECT_EQ(e.peak.total(), mt.peak_total()) << l.name;
  }
  const uint64_t psi = gpt_num_params(c.model);
  const uint64_t state = live[int(Category::kParameters)] + live[int(Category::kGradients)] +
                         live[int(Category::kOptimizer)];
  EXPECT_EQ(state, l.model_state_per_param * psi) << l.name;
}

class ModelStateBytes : public ::testing::TestWithParam<Layout> {};

TEST_P(ModelStateBytes, TrackerEqualsClosedFormAndKPsiOnAToy12LayerModel) {
  expect_bytes(with_amp(kToy12, GetParam()), GetParam());
}

TEST_P(ModelStateBytes, TrackerEqualsClosedFormAndKPsiOnGpt2Shapes) {
#ifdef HEADROOM_SANITIZE_BUILD
  GTEST_SKIP() << "124M parameters: the release pass runs this, the sanitizer pass the toy";
#endif
  expect_bytes(with_amp(kGpt2, GetParam()), GetParam());
}

INSTANTIATE_TEST_SUITE_P(AmpLayouts, ModelStateBytes, ::testing::ValuesIn(kLayouts),
                         [](const auto& info) { return std::string(info.param.name); });

// One AdamW step on bf16 weights and bf16 state, against a double-precision emulation: the update
// in double from the same inputs, then each stored value rounded up with probability (its
// distance from the bf16 below) / (the bf16 spacing), decided by the same 16 noise bits. The
// kernel computes in f32: where its value and the double one straddle a rounding boundary, or a
// sum cancels (m near zero), the two may round differently; those elements must be rare, and
// within one bf16 spacing plus f32's own error of the double value.
TEST(StochasticRounding, AdamWOnBf16MatchesADoubleEmulation) {
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  const size_t n = 1 << 16;
  std::vector<uint16_t> w(n), m(n), v(n), g(n);
  std::mt19937 rng(7);
  std::normal_distribution<double> normal;
  for (size_t i = 0; i < n; ++i) {
    w[i] = float_to_bf16(float(normal(rng) * 0.05));
    g[i] = float_to_bf16(float(normal(rng) * 1e-3));
    m[i] = float_to_bf16(float(normal(rng) * 1e-4));
    v[i] = float_to_bf16(float(std::fabs(normal(rng)) * 1e-7));
  }
  const float lr = 1e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  const int64_t t = 3;
  const uint32_t seed = 12345;
  std::vector<uint16_t> w1 = w, m1 = m, v1 = v;
  Backend::Stored o;
  o.param = o.grad = o.state = Dtype::kBF16;
  o.seed = seed;
  ops.adamw_update_stored(o, w1.data(), g.data(), m1.data(), v1.data(), n, lr, b1, b2, eps, wd, t);

  // x (double) into bf16 with noise r: the bf16 at or below |x| (truncation) or the next one up.
  auto emulate = [](double x, uint32_t r) {
    const uint16_t lo = uint16_t(float_bits(float(x)) >> 16);
    const double lo_v = bf16_to_float(lo), hi_v = bf16_to_float(uint16_t(lo + 1));
    const double frac = (x - lo_v) / (hi_v - lo_v);  // in [0, 1)
    return double(r & 0xFFFFu) / 65536.0 >= 1.0 - frac ? uint16_t(lo + 1) : lo;
  };
  const double bc1 = 1.0 - std::pow(double(b1), double(t)),
               bc2 = 1.0 - std::pow(double(b2), double(t));
  const double f32_err = std::ldexp(1.0, -21);  // a few f32 roundings, relative to the terms
  size_t same = 0, differ = 0;
  for (size_t i = 0; i < n; ++i) {
    const double gd = bf16_to_float(g[i]), m0 = bf16_to_float(m[i]), v0 = bf16_to_float(v[i]);
    const double md = double(b1) * m0 + (1 - double(b1)) * gd;
    const double vd = double(b2) * v0 + (1 - double(b2)) * gd * gd;
    const double w0 = bf16_to_float(w[i]);
    const double step =
        double(lr) * ((md / bc1) / (std::sqrt(vd / bc2) + double(eps)) + double(wd) * w0);
    const double wn = w0 - step;
    const double want[3] = {wn, md, vd};
    // The size of the terms each f32 result is a sum of: its rounding error's scale.
    const double terms[3] = {std::fabs(w0) + std::fabs(step) * 2,
                             std::fabs(double(b1) * m0) + std::fabs((1 - double(b1)) * gd), vd};
    const uint16_t got[3] = {w1[i], m1[i], v1[i]};
    for (int k = 0; k < 3; ++k) {
      const uint32_t r = rounding_noise(seed, 3 * i + uint64_t(k));
      if (got[k] == emulate(want[k], r)) {
        ++same;
        continue;
      }
      ++differ;
      const double spacing = std::fabs(bf16_to_float(uint16_t(emulate(want[k], r) | 1)) -
                                       bf16_to_float(uint16_t(emulate(want[k], r) & ~1u)));
      EXPECT_LE(std::fabs(bf16_to_float(got[k]) - want[k]), spacing + f32_err * terms[k])
          << "element " << i << " operand " << k;
    }
  }
  EXPECT_LT(double(differ), 1e-3 * double(same)) << differ << " of " << 3 * n << " differ";
}

// Unbiased: a value between two bf16 numbers rounds up as often as its position says; the same
// seed rounds alike, another seed otherwise.
TEST(StochasticRounding, IsUnbiasedAndDeterministic) {
  const float x = 1.0f + 0.3f / 128.0f;  // 0.3 of the way from 1 to the next bf16 (1 + 2^-7)
  const size_t trials = 200000;
  double sum = 0;
  size_t same = 0;
  for (size_t i = 0; i < trials; ++i) {
    const uint16_t a = float_to_bf16_stochastic(x, rounding_noise(99, i));
    sum += bf16_to_float(a);
    same += a == float_to_bf16_stochastic(x, rounding_noise(99, i));
  }
  EXPECT_EQ(same, trials);
  const double mean = sum / double(trials);
  // Up with p = 0.3: the mean's standard error is 2^-7 sqrt(p (1 - p) / trials) ~ 8e-6.
  EXPECT_NEAR(mean, double(x), 5e-5);
  size_t differ = 0;
  for (size_t i = 0; i < 1000; ++i)
    differ += rounding_noise(1, i) != rounding_noise(2, i);
  EXPECT_GT(differ, 990u);
}

// Without masters and with bf16 state, a run of 8 steps and one of 4 steps, a snapshot and 4 more
// resumed are the same run, bitwise (the rounding streams continue; the snapshot says the seed).
TEST(NoMasters, ResumeIsBitwise) {
  const std::string base =
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n"
      "[train]\nsteps = 8\nmicro_batch = 4\nlr = 3e-3\n"
      "[[plugins]]\nname = \"amp\"\nmaster_weights = false\nstate_dtype = \"bf16\"\n";
  Trainer whole(test::config_from(base), TrainOptions{});
  whole.run();
  test::expect_resume_is_bitwise(base, whole);
}

// The snapshot says where the rounding streams start: resuming it under another [train] seed
// would round otherwise, so it is refused, naming the seed (exit 2 from the host).
TEST(NoMasters, ResumeUnderAnotherSeedIsRefused) {
  const std::string dir = test::temp_dir();
  const std::string base =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 2\n[[plugins]]\nname = \"amp\"\nmaster_weights = false\n"
      "[snapshot]\nevery = 1\ndir = \"" +
      dir + "/s\"\n";
  {
    Trainer first(test::config_from(base, {"train.steps=1"}), TrainOptions{});
    first.run();
  }
  const std::string cfg = test::write_file(dir, "resume.toml", base);
  const auto r =
      test::run_headroom("train " + cfg + " -q --resume " + dir + "/s --set train.seed=2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "stochastic rounding seed 1")) << r.output;
}

// A run without masters learns: its loss falls as fp32's does over a few steps.
TEST(NoMasters, LearnsLikeFp32OverAShortRun) {
  const std::string model =
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n"
      "[train]\nsteps = 30\nmicro_batch = 4\nlr = 3e-3\n";
  Trainer fp32(test::config_from(model), TrainOptions{});
  fp32.run();
  Trainer bf16(test::config_from(model + "[[plugins]]\nname = \"amp\"\nmaster_weights = false\n"),
               TrainOptions{});
  bf16.run();
  const double first = bf16.history().front().loss, last = bf16.history().back().loss;
  EXPECT_LT(last, 0.8 * first);
  EXPECT_NEAR(last, fp32.history().back().loss, 0.05 * fp32.history().back().loss);
}

// The layouts' config errors name the key; one rank without a zero plugin, so far.
TEST(AmpLayouts, BadCombinationsAreConfigErrorsNamingTheKey) {
  const std::string model =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 1\n";
  auto error = [&](const std::string& plugins) {
    return test::error_of([&] { Trainer t(test::config_from(model + plugins), TrainOptions{}); });
  };
  std::string e = error("[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\ngrad_dtype = \"bf16\"\n");
  EXPECT_TRUE(test::contains(e, "plugins.amp.grad_dtype")) << e;
  e = error("[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\nmaster_weights = false\n");
  EXPECT_TRUE(test::contains(e, "plugins.amp.master_weights")) << e;
  e = error("[[plugins]]\nname = \"amp\"\nstate_dtype = \"int8\"\n");
  EXPECT_TRUE(test::contains(e, "plugins.amp.state_dtype")) << e;
  e = error("[[plugins]]\nname = \"amp\"\nmaster_weights = false\n[[plugins]]\nname = \"zero1\"\n");
  EXPECT_TRUE(test::contains(e, "one rank without a zero plugin")) << e;
}

// Proposed by the advice, amp takes the first of its layouts (16, 12, 8 bytes a parameter) at
// which the run fits: here only without masters, so that is what it offers, and it fits as
// estimated.
TEST(AmpLayouts, TheAdviceProposesTheFirstLayoutThatFits) {
  auto peak = [](const std::string& keys) {
    return estimate_config(
               test::config_from(std::string(kToy12) + "[[plugins]]\nname = \"amp\"\n" + keys))
        .peak.total();
  };
  const uint64_t p16 = peak("grad_dtype = \"bf16\"\n"), p12 = peak("master_weights = false\n");
  ASSERT_LT(p12, p16);
  const Config c =
      test::config_from(kToy12, {"device.memory_limit=" + std::to_string((p12 + p16) / 2)});
  static const PluginCatalog catalog;
  std::vector<OfferedExtension> amp;
  for (const OfferedExtension& e : catalog.offered(HR_EXT_ESTIMATE))
    if (e.plugin == "amp") amp.push_back(e);
  ASSERT_EQ(amp.size(), 1u);
  const Advice a = advise(c, amp);
  ASSERT_FALSE(a.fits);
  const Remedy* r = nullptr;
  for (const Remedy& x : a.remedies)
    if (x.plugins == std::vector<std::string>{"amp"}) r = &x;
  ASSERT_NE(r, nullptr) << format_remedies(a);
  EXPECT_TRUE(r->fits);
  EXPECT_EQ(r->peak_after, p12);
  EXPECT_TRUE(test::contains(r->toml, "master_weights = false")) << r->toml;
  EXPECT_FALSE(test::contains(r->toml, "state_dtype")) << r->toml;
}

// gpt_param_shapes (the estimates' tensors) is the built model's parameter list.
TEST(ParamShapes, AreTheBuiltModels) {
  ModelConfig m;
  m.n_layer = 2;
  m.n_head = 2;
  m.n_embd = 16;
  m.seq_len = 8;
  m.vocab_size = 32;
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  Gpt<float> model(m, *device, 1);
  const std::vector<ParamShape> shapes = gpt_param_shapes(m);
  size_t k = 0;
  for (size_t l = 0; l < model.layers().size(); ++l)
    for (const auto& p : model.layers()[l]->params()) {
      ASSERT_LT(k, shapes.size());
      EXPECT_EQ(shapes[k].layer, int(l));
      EXPECT_EQ(shapes[k].name, p->name);
      EXPECT_EQ(shapes[k].shape, p->shape);
      EXPECT_EQ(shapes[k].decay, p->decay);
      ++k;
    }
  EXPECT_EQ(k, shapes.size());
}

}  // namespace
}  // namespace headroom
