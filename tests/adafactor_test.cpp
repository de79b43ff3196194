// The adafactor plugin (plugins/adafactor), loaded by the real plugin host from the TOML list, in
// the optimizer role:
//  - its per-step losses agree within 1e-6 relative with a reference Adafactor written here from
//    the published algorithm (Shazeer & Stern 2018, Hugging Face's defaults) in double precision,
//    applied to the same model, initialisation and batches (the built-in SGD does nothing: the
//    reference zeroes the gradients after its own update);
//  - its optimizer state is the closed form (rows + cols floats a matrix, one float an element of
//    a vector) on a 12-layer toy and on gpt2-124m's shapes;
//  - a resume is bitwise; bad keys exit 2 naming the key; a damaged or mismatched state is a
//    clear error.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/events/events.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/report/advice.h"
#include "core/run/snapshot.h"
#include "core/run/trainer.h"
#include "plugins/adafactor/kernels.h"
#include "plugins/common/bf16.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

std::string model_toml(int n_layer = 2, int n_embd = 32) {
  return "[model]\nn_layer = " + std::to_string(n_layer) +
         "\nn_head = 2\nn_embd = " + std::to_string(n_embd) + "\nseq_len = 16\nvocab_size = 64\n";
}

std::string train_toml(int steps, const std::string& lr = "3e-3") {
  return "[train]\nsteps = " + std::to_string(steps) +
         "\nmicro_batch = 2\ngrad_accum = 2\nlr = " + lr + "\nwarmup_steps = 4\n";
}

std::string plugin_toml(const std::string& keys) {
  return "[[plugins]]\nname = \"adafactor\"\n" + keys;
}

// The reference: Adafactor from the paper's Algorithms 4 and 5 with Hugging Face's defaults, state
// and arithmetic in double, updating the float parameters at OPTIMIZER_STEP (after clipping),
// then zeroing the gradients so that the built-in SGD (no momentum, no weight decay) that runs
// next changes nothing.
struct Reference {
  bool first_moment = false;
  double beta1 = 0.0, decay_rate = -0.8, d = 1.0, eps1 = 1e-30, eps2 = 1e-3;
  bool relative_step = true, scale_parameter = true, warmup_init = false;
  double weight_decay = 0.0;
};

struct ReferenceOptimizer final : EventListener {
  Trainer* trainer = nullptr;
  Reference r;
  int64_t t = 0;
  // Per parameter: row and column second moments (matrices) or the full one (vectors), and m.
  std::vector<std::vector<double>> row, col, v, m;

  void on_event(const EventInfo& e) override {
    if (e.event != Event::kOptimizerStep) return;
    const std::vector<Param<float>*> params = trainer->model().params();
    if (row.empty()) {
      row.resize(params.size()), col.resize(params.size()), v.resize(params.size());
      m.resize(params.size());
      for (size_t k = 0; k < params.size(); ++k) {
        const Param<float>& p = *params[k];
        if (p.shape.size() >= 2) {
          row[k].assign(size_t(p.shape[0]), 0.0);
          col[k].assign(size_t(p.numel / uint64_t(p.shape[0])), 0.0);
        } else {
          v[k].assign(p.numel, 0.0);
        }
        if (r.first_moment) m[k].assign(p.numel, 0.0);
      }
    }
    ++t;
    const double td = double(t);
    const double beta2 = 1.0 - std::pow(td, r.decay_rate);
    const double rho = r.relative_step
                           ? std::min(r.warmup_init ? 1e-6 * td : 1e-2, 1.0 / std::sqrt(td))
                           : learning_rate(trainer->config().train, e.step - 1);
    for (size_t k = 0; k < params.size(); ++k) {
      const Param<float>& p = *params[k];
      float* theta = p.master().value;
      // The step's gradient: f32, or bf16 when amp accumulates it in the compute dtype.
      const bool bf16 = p.optimized().grad_dtype == Dtype::kBF16;
      float* g32 = static_cast<float*>(p.optimized().grad);
      uint16_t* g16 = static_cast<uint16_t*>(p.optimized().grad);
      std::vector<double> grad(p.numel);
      for (size_t i = 0; i < p.numel; ++i) {
        if (bf16) {
          const uint32_t bits = uint32_t(g16[i]) << 16;
          float f;
          std::memcpy(&f, &bits, sizeof f);
          grad[i] = f;
        } else {
          grad[i] = g32[i];
        }
      }
      const size_t n = p.numel;
      double ss = 0.0;
      for (size_t i = 0; i < n; ++i)
        ss += double(theta[i]) * double(theta[i]);
      const double alpha =
          r.scale_parameter ? std::max(r.eps2, std::sqrt(ss / double(n))) * rho : rho;
      std::vector<double> u(n);
      if (p.shape.size() >= 2) {
        const size_t R = row[k].size(), C = col[k].size();
        std::vector<double> rs(R, 0.0), cs(C, 0.0);
        for (size_t i = 0; i < R; ++i)
          for (size_t j = 0; j < C; ++j) {
            const double g = grad[i * C + j];
            rs[i] += g * g + r.eps1;
            cs[j] += g * g + r.eps1;
          }
        double mean_row = 0.0;
        for (size_t i = 0; i < R; ++i) {
          row[k][i] = beta2 * row[k][i] + (1 - beta2) * rs[i] / double(C);
          mean_row += row[k][i] / double(R);
        }
        for (size_t j = 0; j < C; ++j)
          col[k][j] = beta2 * col[k][j] + (1 - beta2) * cs[j] / double(R);
        for (size_t i = 0; i < R; ++i)
          for (size_t j = 0; j < C; ++j)
            u[i * C + j] = grad[i * C + j] / std::sqrt(row[k][i] * col[k][j] / mean_row);
      } else {
        for (size_t i = 0; i < n; ++i) {
          const double g = grad[i];
          v[k][i] = beta2 * v[k][i] + (1 - beta2) * (g * g + r.eps1);
          u[i] = g / std::sqrt(v[k][i]);
        }
      }
      double us = 0.0;
      for (double x : u)
        us += x * x;
      const double clip = std::max(1.0, std::sqrt(us / double(n)) / r.d);
      for (size_t i = 0; i < n; ++i) {
        double step = alpha * u[i] / clip;
        if (r.first_moment) {
          m[k][i] = r.beta1 * m[k][i] + (1 - r.beta1) * step;
          step = m[k][i];
        }
        const double th = theta[i];
        const double decayed = p.decay ? th - r.weight_decay * alpha * th : th;
        theta[i] = float(decayed - step);
        if (bf16) {
          g16[i] = 0;
        } else {
          g32[i] = 0.0f;
        }
      }
    }
  }
};

std::vector<double> losses(const Trainer& t) {
  std::vector<double> out;
  for (const StepState& s : t.history())
    out.push_back(s.loss);
  return out;
}

struct Variant {
  const char* name;
  std::string plugin_keys;
  Reference reference;
  std::string lr;                  // [train] lr
  bool trains;                     // the loss falls over the 20 steps
  std::string other_plugins = "";  // before adafactor, in both runs
  double tolerance = 1e-6;         // relative, on every step's loss
};

TEST(Adafactor, LossesMatchADoublePrecisionReferenceOver20Steps) {
  Reference beta1;
  beta1.first_moment = true;
  beta1.beta1 = 0.9;
  beta1.weight_decay = 0.1;
  Reference host_lr;
  host_lr.relative_step = false;
  host_lr.scale_parameter = false;
  Reference host_lr_scaled;
  host_lr_scaled.relative_step = false;
  Reference warmup;
  warmup.warmup_init = true;
  warmup.d = 0.5;
  warmup.decay_rate = -0.5;
  const std::vector<Variant> variants = {
      {"defaults", "", Reference{}, "3e-3", true},
      {"beta1 0.9, weight_decay 0.1", "beta1 = 0.9\nweight_decay = 0.1\n", beta1, "3e-3", true},
      {"relative_step false, scale_parameter false",
       "relative_step = false\nscale_parameter = false\n", host_lr, "1e-4", true},
      {"relative_step false, host lr scaled", "relative_step = false\n", host_lr_scaled, "3e-3",
       true},
      {"warmup_init, clip 0.5, decay_rate -0.5",
       "warmup_init = true\nclip_threshold = 0.5\ndecay_rate = -0.5\n", warmup, "3e-3", false},
      // bf16 compute copies: both update the fp32 masters from fp32 gradients. A master that
      // differs by one float ulp (the plugin keeps its moments in f32) can round to another bf16
      // compute weight, 2^-8 apart: the losses part slowly (1e-6 through step 14, 3e-5 by 20).
      {"amp bf16", "", Reference{}, "3e-3", true, "[[plugins]]\nname = \"amp\"\n", 1e-4},
      // bf16 gradients accumulated over the micro-steps (DeepSpeed's layout), widened to f32.
      {"amp bf16, grad_dtype bf16", "", Reference{}, "3e-3", true,
       "[[plugins]]\nname = \"amp\"\ngrad_dtype = \"bf16\"\n", 1e-4},
  };
  for (const Variant& v : variants) {
    const std::string base = model_toml() + train_toml(20, v.lr);
    Trainer plugin(test::config_from(base + v.other_plugins + plugin_toml(v.plugin_keys)),
                   TrainOptions{});
    plugin.run();
    Trainer ref(test::config_from(base +
                                  "optimizer = \"sgd\"\nmomentum = 0.0\n"
                                  "weight_decay = 0.0\n" +
                                  v.other_plugins),
                TrainOptions{});
    ReferenceOptimizer opt;
    opt.trainer = &ref;
    opt.r = v.reference;
    ref.add_listener(&opt);
    ref.run();
    const std::vector<double> a = losses(plugin), b = losses(ref);
    ASSERT_EQ(a.size(), 20u) << v.name;
    ASSERT_EQ(b.size(), 20u) << v.name;
    double worst = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double rel = std::fabs(a[i] - b[i]) / std::fabs(b[i]);
      worst = std::max(worst, rel);
      EXPECT_LE(rel, v.tolerance) << v.name << ", step " << i + 1 << ": " << a[i] << " vs " << b[i];
    }
    std::printf("%s: loss %.6f -> %.6f, worst relative difference to the reference %.3g\n", v.name,
                b.front(), b.back(), worst);
    if (v.trains) {
      EXPECT_LT(a.back(), a.front()) << v.name << ": it trains";
    }
  }
}

// rows + cols floats for each matrix, one float for each element of a vector.
uint64_t closed_form_bytes(Trainer& t, bool first_moment = false) {
  uint64_t floats = 0;
  for (const Param<float>* p : t.model().params()) {
    floats +=
        p->shape.size() >= 2 ? uint64_t(p->shape[0]) + p->numel / uint64_t(p->shape[0]) : p->numel;
    if (first_moment) floats += p->numel;
  }
  return floats * sizeof(float);
}

uint64_t optimizer_peak(Trainer& t) {
  return t.device().tracker().peak_by_category()[static_cast<int>(Category::kOptimizer)];
}

// Runs one step of `toml` and checks the tracker's optimizer bytes against the closed form;
// returns them.
uint64_t check_state_bytes(const char* name, const std::string& toml, bool first_moment) {
  Trainer t(test::config_from(toml), TrainOptions{});
  t.run();
  const uint64_t expect = closed_form_bytes(t, first_moment);
  const uint64_t psi = gpt_num_params(t.config().model);
  std::printf("%s: adafactor state %llu bytes, closed form %llu (AdamW's 8 psi: %llu bytes)\n",
              name, (unsigned long long)optimizer_peak(t), (unsigned long long)expect,
              (unsigned long long)(8 * psi));
  EXPECT_EQ(optimizer_peak(t), expect) << name;
  return optimizer_peak(t);
}

const char kOneStep[] = "[train]\nsteps = 1\nmicro_batch = 1\n";

TEST(Adafactor, OptimizerBytesAreTheClosedForm) {
  check_state_bytes("12-layer toy", model_toml(12, 32) + kOneStep + plugin_toml(""), false);
  check_state_bytes("12-layer toy, beta1",
                    model_toml(12, 32) + kOneStep + plugin_toml("beta1 = 0.9\n"), true);
  check_state_bytes(
      "12-layer toy, amp bf16",
      model_toml(12, 32) + kOneStep + "[[plugins]]\nname = \"amp\"\n" + plugin_toml(""), false);
}

std::string gpt2_124m_toml() {
  return "[model]\nn_layer = 12\nn_head = 12\nn_embd = 768\nseq_len = 32\nvocab_size = 50257\n" +
         std::string(kOneStep) + plugin_toml("");
}

TEST(Adafactor, OptimizerBytesOnGpt2SmallShapes) {
#ifdef HEADROOM_SANITIZE_BUILD
  GTEST_SKIP() << "124M parameters: the release pass runs this, the sanitizer pass the toy";
#endif
  // By hand: wte 50257 + 768, wpe 32 + 768, ln_f 2 * 768, and per block ln_1 and ln_2 4 * 768,
  // c_attn (2304 + 768) + 2304, attn c_proj (768 + 768) + 768, c_fc (3072 + 768) + 3072, mlp
  // c_proj (768 + 3072) + 768: 22272; 320625 floats in all.
  EXPECT_EQ(check_state_bytes("gpt2-124m shapes", gpt2_124m_toml(), false), 320625u * 4);
}

// The plugin's estimate (headroom.estimate/1) chained by core, as `headroom plan` prints it: the
// optimizer bytes are the state the tracker measured, and on the CPU backend the whole peak is.
TEST(Adafactor, EstimateIsTheMeasuredState) {
  for (const std::string keys : {"", "beta1 = 0.9\n"}) {
    const Config c = test::config_from(model_toml(12, 32) +
                                       "[train]\nsteps = 2\nmicro_batch = 1\n" + plugin_toml(keys));
    const ConfigEstimate e = estimate_config(c);
    ASSERT_EQ(e.plugins.size(), 1u);
    ASSERT_TRUE(e.plugins[0].ok()) << keys << "status " << e.plugins[0].status;
    Trainer t(c, TrainOptions{});
    t.run();
    const MemoryTracker& mt = t.device().tracker();
    EXPECT_EQ(e.peak.at_peak[static_cast<int>(Category::kOptimizer)], optimizer_peak(t)) << keys;
    for (int i = 0; i < kNumCategories; ++i)
      EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << keys << category_name(category_at(i));
    EXPECT_EQ(e.peak.total(), mt.peak_total()) << keys;
  }
  // gpt2-124m's shapes, from the estimate alone: the hand-counted 320625 floats.
  const ConfigEstimate g = estimate_config(test::config_from(gpt2_124m_toml()));
  ASSERT_EQ(g.plugins.size(), 1u);
  EXPECT_EQ(g.peak.at_peak[static_cast<int>(Category::kOptimizer)], 320625u * 4);
}

// Not in the config, it proposes itself: a run that fits only without AdamW's 8 bytes a parameter
// gets adafactor as a remedy, with its table.
TEST(Adafactor, ProposedWhenAdamWStateDoesNotFit) {
  const std::string model = model_toml(4, 64) + "[train]\nsteps = 2\nmicro_batch = 2\n";
  const uint64_t with = estimate_config(test::config_from(model + plugin_toml(""))).peak.total();
  const uint64_t without = estimate_config(test::config_from(model)).peak.total();
  ASSERT_LT(with, without);
  const Config c = test::config_from(model, {"device.memory_limit=" + std::to_string(with + 1000)});
  const Advice a = advise(c);
  ASSERT_FALSE(a.fits);
  bool found = false;
  for (const Remedy& r : a.remedies)
    if (r.plugins == std::vector<std::string>{"adafactor"}) {
      found = true;
      EXPECT_TRUE(r.fits);
      EXPECT_EQ(r.peak_after, with);
      EXPECT_TRUE(test::contains(r.toml, "[[plugins]]\nname = \"adafactor\"\nrelative_step = true"))
          << r.toml;
    }
  EXPECT_TRUE(found) << format_remedies(a);
}

// Stopping before step 11 (snapshot at 10) and resuming gives the uninterrupted run's losses and
// weights bit for bit.
struct Stop {};
struct StopAt final : EventListener {
  int64_t step;
  explicit StopAt(int64_t s) : step(s) {}
  void on_event(const EventInfo& e) override {
    if (e.event == Event::kStepBegin && e.step == step) throw Stop{};
  }
};

struct RunOutcome {
  std::vector<double> losses;
  std::vector<float> weights;
};

RunOutcome run(const Config& c, int64_t stop_at, const std::string& resume_dir) {
  TrainOptions o;
  o.resume_dir = resume_dir;
  Trainer t(c, std::move(o));
  StopAt stop(stop_at);
  if (stop_at > 0) t.add_listener(&stop);
  try {
    t.run();
  } catch (const Stop&) {
  }
  RunOutcome r;
  r.losses = losses(t);
  for (Param<float>* p : t.model().params())
    r.weights.insert(r.weights.end(), p->master().value, p->master().value + p->numel);
  return r;
}

std::string snapshot_toml(const std::string& dir) {
  return "[snapshot]\nevery = 10\ndir = \"" + dir + "\"\n";
}

TEST(Adafactor, ResumeIsBitwise) {
  const std::string dir = test::temp_dir();
  for (const std::string keys : {"", "beta1 = 0.9\nweight_decay = 0.01\n"}) {
    const std::string base = model_toml() + train_toml(20) + plugin_toml(keys);
    const RunOutcome whole = run(test::config_from(base), 0, "");
    const std::string snaps = dir + "/s" + std::to_string(keys.size());
    const Config c = test::config_from(base + snapshot_toml(snaps));
    run(c, 11, "");
    const RunOutcome resumed = run(c, 0, snaps);
    ASSERT_EQ(resumed.losses.size(), 10u);
    for (size_t i = 0; i < 10; ++i)
      EXPECT_EQ(resumed.losses[i], whole.losses[10 + i]) << keys << "step " << i + 11;
    EXPECT_TRUE(resumed.weights == whole.weights) << keys << "the final weights differ";
  }
}

// The snapshot's adafactor state cut short, or grown, or of another beta1 setting: a ConfigError
// saying so.
TEST(Adafactor, DamagedOrMismatchedStateIsAClearError) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(10) + plugin_toml("");
  run(test::config_from(base + snapshot_toml(dir + "/s")), 0, "");
  // The resumed run goes on to step 12.
  const Config c = test::config_from(model_toml() + train_toml(12) + plugin_toml("") +
                                     snapshot_toml(dir + "/s"));
  const SnapshotData good = read_snapshot(snapshot_file(dir + "/s", 10));
  ASSERT_EQ(good.plugins.count("adafactor"), 1u);
  auto resume_error = [&](const std::string& snaps, const Config& cfg) {
    TrainOptions o;
    o.resume_dir = snaps;
    Trainer t(cfg, std::move(o));
    return test::error_of([&] { t.run(); });
  };
  struct Damage {
    const char* name;
    std::vector<uint8_t> bytes;
    const char* expect;
  };
  std::vector<uint8_t> cut = good.plugins.at("adafactor");
  cut.resize(cut.size() - 3);
  std::vector<uint8_t> grown = good.plugins.at("adafactor");
  grown.push_back(0);
  std::vector<uint8_t> version = good.plugins.at("adafactor");
  version[8] = 9;
  std::vector<uint8_t> renamed = good.plugins.at("adafactor");
  const size_t name_at = 32 + 4;  // the header, the first name's length
  renamed[name_at] = 'X';
  for (const Damage& d : std::vector<Damage>{
           {"cut", cut, "adafactor state is damaged: it ends inside"},
           {"grown", grown, "adafactor state is damaged: 1 bytes after the last tensor"},
           {"version", version, "adafactor state is damaged: state version 9"},
           {"renamed", renamed, "this model's is 'wte.weight'"},
           {"empty", {}, "adafactor state is damaged: it holds 0 bytes"}}) {
    SnapshotData bad = good;
    bad.plugins["adafactor"] = d.bytes;
    const std::string snaps = dir + "/" + d.name;
    write_snapshot(snaps, bad, 1);
    const std::string e = resume_error(snaps, c);
    EXPECT_TRUE(test::contains(e, d.expect)) << d.name << ": " << e;
    EXPECT_TRUE(test::contains(e, "plugin 'adafactor'")) << d.name << ": " << e;
    std::printf("%s: %s\n", d.name, e.c_str());
  }
  const std::string e = resume_error(
      dir + "/s", test::config_from(model_toml() + train_toml(12) + plugin_toml("beta1 = 0.9\n") +
                                    snapshot_toml(dir + "/s")));
  EXPECT_TRUE(test::contains(e, "does not fit this run: it has no first moment")) << e;
}

// amp master_weights = false leaves bf16 weights only: the first step stops saying what to use.
// Without fp32 masters (amp master_weights = false) the weights are bf16 and adafactor rounds
// its updates into them stochastically: the loss falls as with masters, 8 steps = 4, a snapshot
// and 4 more bitwise (the seed is in the state), and the host's estimate is the tracker's peak.
TEST(Adafactor, Bf16WeightsWithoutMastersTrainResumeAndEstimate) {
  const std::string nomasters = "[[plugins]]\nname = \"amp\"\nmaster_weights = false\n";
  const std::string base = model_toml() + train_toml(8) + nomasters + plugin_toml("seed = 7\n");
  Trainer whole(test::config_from(base), TrainOptions{});
  whole.run();
  Trainer masters(test::config_from(model_toml() + train_toml(8) + "[[plugins]]\nname = \"amp\"\n" +
                                    plugin_toml("")),
                  TrainOptions{});
  masters.run();
  const double a = whole.history().back().loss, b = masters.history().back().loss;
  EXPECT_LT(a, whole.history().front().loss);
  EXPECT_NEAR(a, b, 0.02 * b) << "bf16 weights against fp32 masters after 8 steps";
  test::expect_resume_is_bitwise(base, whole);
  const Config c = test::config_from(base);
  const ConfigEstimate e = estimate_config(c);
  for (const PluginEstimate& pe : e.plugins)
    ASSERT_TRUE(pe.ok()) << pe.plugin << " status " << pe.status;
  const MemoryTracker& mt = whole.device().tracker();
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(e.peak.at_peak[i], mt.live_at_peak()[i]) << category_name(category_at(i));
}

TEST(Adafactor, BadKeysExit2NamingTheKey) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(1);
  struct Bad {
    std::string keys, expect;
  };
  for (const Bad& bad :
       std::vector<Bad>{{"beta1 = 1.0\n", "beta1"},
                        {"beta1 = \"0.9\"\n", "beta1"},
                        {"decay_rate = 0.8\n", "decay_rate"},
                        {"clip_threshold = 0.0\n", "clip_threshold"},
                        {"eps1 = -1.0\n", "eps1"},
                        {"eps2 = 0.0\n", "eps2"},
                        {"weight_decay = -0.1\n", "weight_decay"},
                        {"relative_step = 1\n", "relative_step"},
                        {"scale_parameter = \"yes\"\n", "scale_parameter"},
                        {"relative_step = false\nwarmup_init = true\n", "warmup_init"},
                        {"seed = -1\n", "seed"},
                        {"lr = 1e-3\n", "unknown key 'lr'"}}) {
    const std::string cfg = test::write_file(dir, "bad.toml", base + plugin_toml(bad.keys));
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.keys << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the file: " << r.output;
  }
}

// The update's passes run on the OpenMP threads (plugins/adafactor/kernels.h): 1 and 3 threads
// give the same bits, for a matrix whose rows are not a multiple of the row block nor its columns
// of the lanes, and a vector of more than two chunks (both over kParallelMin elements: smaller
// tensors stay on one thread); f32 and bf16 weights, with and without the first moment, 4 steps
// each. (That the passes are the algorithm is
// LossesMatchADoublePrecisionReferenceOver20Steps.)
TEST(Adafactor, KernelHasTheSameBitsOnAnyThreadCount) {
  struct Case {
    uint64_t rows, cols;
  };
  for (const Case shape : {Case{700, 45}, Case{0, 41000}})
    for (const bool theta16 : {false, true})
      for (const bool first_moment : {false, true}) {
        const uint64_t n = shape.rows ? shape.rows * shape.cols : shape.cols;
        struct State {
          std::vector<float> theta32, state, m;
          std::vector<uint16_t> theta16;
        };
        auto run = [&](int threads) {
          std::mt19937_64 rng(5);
          std::normal_distribution<float> normal(0.0f, 1.0f);
          State s;
          s.theta32.resize(n);
          s.theta16.resize(n);
          for (uint64_t i = 0; i < n; ++i) {
            s.theta32[i] = 0.02f * normal(rng);
            s.theta16[i] = headroom_plugin::bf16::round_nearest_even(s.theta32[i]);
          }
          s.state.assign(shape.rows ? shape.rows + shape.cols : n, 0.0f);
          s.m.assign(n, 0.0f);
          adafactor::Scratch scratch;
          std::vector<float> g(n);
          const int before = omp_get_max_threads();
          omp_set_num_threads(threads);
          for (int t = 1; t <= 4; ++t) {
            for (float& x : g)
              x = 1e-2f * normal(rng);
            adafactor::Tensor p;
            p.theta = theta16 ? static_cast<void*>(s.theta16.data()) : s.theta32.data();
            p.grad = g.data();
            p.numel = n;
            p.rows = shape.rows;
            p.cols = shape.rows ? shape.cols : 0;
            if (shape.rows) {
              p.row = s.state.data();
              p.col = s.state.data() + shape.rows;
            } else {
              p.v = s.state.data();
            }
            p.m = first_moment ? s.m.data() : nullptr;
            adafactor::Hyper h;
            h.beta2 = 1.0 - std::pow(double(t), -0.8);
            h.rel = std::min(1e-2, 1.0 / std::sqrt(double(t)));
            h.weight_decay = 0.01;
            h.beta1 = 0.9;
            h.round_key = headroom_plugin::bf16::stream_key(3, uint64_t(t), 0);
            adafactor::update(p, h, theta16, false, scratch);
          }
          omp_set_num_threads(before);
          return s;
        };
        const State one = run(1), three = run(3);
        const std::string what = std::to_string(shape.rows) + "x" + std::to_string(shape.cols) +
                                 (theta16 ? " bf16" : " f32") + (first_moment ? " beta1" : "");
        EXPECT_EQ(0, std::memcmp(one.theta32.data(), three.theta32.data(), n * 4)) << what;
        EXPECT_EQ(one.theta16, three.theta16) << what;
        EXPECT_EQ(0, std::memcmp(one.state.data(), three.state.data(), one.state.size() * 4))
            << what;
        EXPECT_EQ(0, std::memcmp(one.m.data(), three.m.data(), n * 4)) << what;
      }
}

}  // namespace
}  // namespace headroom
