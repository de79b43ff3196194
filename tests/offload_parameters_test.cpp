// The offload plugin's `parameters = "host"` (headroom.offload/1 set_parameter_place; ZeRO-
// Infinity's offload_param) with zero3 on one rank: each sharded layer's parameter, master, frozen
// and gradient shards rest in the host ledger (core/shard/sharding.h), the device holding a layer
// only from its gathering to its release. Training is bitwise the same run without it (fp32, amp
// + checkpoint, fp16 with a loss scale that overflows, prefetch 0, LoRA on an nf4 base, with the
// layers' outputs on the host too, the optimizer's state on the NVMe tier); the device's bytes by
// category at its peak and the host ledger's are the closed form's (core/report/advice.cpp); the
// device holds less than with the optimizer alone on the host. The multi-rank runs are
// tests/mpi/train_test.sh's `offload` part.
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>
#include <string>
#include <vector>

#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/offload_outcome.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// Six blocks of 49,856 elements; a threshold of 1,000 shards them and the embedding (6,144) and
// keeps the head's ln_f (128) whole, on the device: both places in one run. With grad_accum > 1
// zero3 reduces each micro-step's gradients into the shard (reduce_every_micro_step, its
// default), where the micro-steps add up in another order than one buffer accumulating them on
// one rank: bitwise the run without only with reduce_every_micro_step = false.
std::string model_toml(int grad_accum = 1) {
  return "[model]\nn_layer = 6\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n"
         "[train]\nsteps = 3\nmicro_batch = 4\ngrad_accum = " +
         std::to_string(grad_accum) + "\nlr = 3e-3\nwarmup_steps = 2\ngrad_clip = 0.5\n";
}

std::string plugin(const std::string& name, const std::string& keys = "") {
  return "[[plugins]]\nname = \"" + name + "\"\n" + keys;
}

std::string zero3(const std::string& keys = "") {
  return plugin("zero3", "param_persistence_threshold = 1000\n" + keys);
}

uint64_t at(const ByCategory& b, Category c) {
  return b[int(c)];
}

using Trained = test::Sharded;

Trained train(const std::string& toml) {
  return test::train_sharded(toml);
}

void expect_same(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;  // bitwise: == on doubles
  EXPECT_FALSE(a.saved.empty());
  EXPECT_TRUE(a.saved == b.saved) << "the saved weights differ";
}

struct Case {
  const char* name;
  int grad_accum;
  std::string plugins;  // before zero3 and the offload plugin
  std::string zero;     // zero3's keys beyond the threshold
  std::string offload;  // the offload plugin's keys beyond parameters
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class OffloadParameters : public ::testing::TestWithParam<Case> {};

TEST_P(OffloadParameters, IsBitwiseAndRestsTheShardsOnTheHostAsPlanned) {
  const Case& c = GetParam();
  const std::string base = model_toml(c.grad_accum) + c.plugins;
  // Without: the optimizer alone on the host (zero3 on one rank shards nothing more); with: the
  // parameter shards there too.
  const std::string without = base + zero3(c.zero) + plugin("offload", c.offload);
  const std::string with =
      base + zero3(c.zero) + plugin("offload", c.offload + "parameters = \"host\"\n");
  const Trained a = train(without);
  const Trained b = train(with);
  expect_same(a, b);

  // Each ledger as its closed form, category by category at the peak.
  const PeakEstimate e = estimate_config(test::config_from(with)).peak;
  for (int i = 0; i < kNumCategories; ++i) {
    EXPECT_EQ(b.device_at_peak[i], e.at_peak[i]) << "device " << category_name(category_at(i));
    EXPECT_EQ(b.host_peak[i], e.host[i]) << "host " << category_name(category_at(i));
  }
  EXPECT_EQ(b.device_peak_total, e.total());
  const PeakEstimate ea = estimate_config(test::config_from(without)).peak;
  EXPECT_EQ(a.device_peak_total, ea.total());
  // The device keeps only the layers in flight: less of the parameters and gradients.
  EXPECT_LT(at(b.device_at_peak, Category::kParameters),
            at(a.device_at_peak, Category::kParameters));
  EXPECT_LT(b.device_peak_total, a.device_peak_total);
  std::printf(
      "%s: device peak %llu -> %llu B (parameters %llu -> %llu B), host %llu B\n", c.name,
      (unsigned long long)a.device_peak_total, (unsigned long long)b.device_peak_total,
      (unsigned long long)at(a.device_at_peak, Category::kParameters),
      (unsigned long long)at(b.device_at_peak, Category::kParameters), (unsigned long long)[&] {
        uint64_t t = 0;
        for (uint64_t x : b.host_peak)
          t += x;
        return t;
      }());
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, OffloadParameters,
    ::testing::Values(
        Case{"Fp32", 1, "", "", "optimizer = \"host\"\n"},
        Case{"AmpCheckpoint", 1, plugin("amp") + plugin("checkpoint"), "",
             "optimizer = \"host\"\n"},
        Case{"AmpCheckpointPrefetch0", 1, plugin("amp") + plugin("checkpoint"),
             "prefetch_layers = 0\n", "optimizer = \"host\"\n"},
        // fp16's loss scaler reads the host gradient shards at GRADS_READY: an init_scale that
        // overflows at step 1 (skipped there, as without), the next steps update.
        Case{"AmpFp16LossScalingCheckpoint", 1,
             plugin("amp",
                    "dtype = \"fp16\"\ninit_scale = 1e30\nbackoff_factor = 1e-25\n"
                    "hysteresis = 1\n") +
                 plugin("checkpoint"),
             "", "optimizer = \"host\"\n"},
        Case{"AccumulatingOnTheDevice", 2, plugin("amp") + plugin("checkpoint"),
             "reduce_every_micro_step = false\n", "optimizer = \"host\"\n"},
        Case{"Fp32Prefetch2ActivationsToo", 1, plugin("checkpoint"), "prefetch_layers = 2\n",
             "optimizer = \"host\"\nactivations = true\n"},
        Case{"LoraNf4AmpCheckpoint", 1,
             plugin("lora",
                    "r = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\nbase_dtype = "
                    "\"nf4\"\ndouble_quant = true\n") +
                 plugin("amp") + plugin("checkpoint"),
             "", "optimizer = \"host\"\n"}),
    [](const auto& info) { return std::string(info.param.name); });

// Against a run with no plugin at all: the same training.
TEST(OffloadParametersTrain, IsBitwiseTheRunWithoutPlugins) {
  const Trained plain = train(model_toml());
  const Trained b = train(model_toml() + zero3() +
                          plugin("offload", "optimizer = \"host\"\nparameters = \"host\"\n"));
  expect_same(plain, b);
}

// The tied embedding's gradient (issue 34, item 3): with the gradients sharded and the optimizer
// on the host, layer 0's full gradients (amp's bf16 ones of the micro-step; f32 without amp) wait
// in host memory through every block's backward. The device holds them in the head's backward,
// which adds into the tied wte, and in the embedding's, which adds the rest (and where amp's f32
// ones are made, to add the bf16 ones into); the losses and weights are the run's without
// plugins, and both ledgers the closed form's (the suite above).
TEST(OffloadParametersTrain, TheTiedEmbeddingsGradientWaitsOnTheHostThroughTheBlocks) {
  struct Probe : EventListener {
    Trainer* t = nullptr;
    int parked = 0, on_device = 0;
    void on_event(const EventInfo& i) override {
      if (i.event != Event::kBackwardBegin) return;
      const auto& layers = t->model().layers();
      const Layer<float>& emb = *layers[0];
      const bool block = i.layer > 0 && i.layer + 1 < int(layers.size());
      EXPECT_EQ(emb.grads_parked(), block) << "layer " << i.layer << "'s backward";
      // amp's f32 ones are made in the embedding's backward, which adds the bf16 ones into them
      EXPECT_EQ(bool(emb.flat().grad), i.layer == 0) << "layer " << i.layer << "'s backward";
      EXPECT_EQ(bool(emb.flat().compute_grad), !block) << "layer " << i.layer << "'s backward";
      ++(block ? parked : on_device);
    }
  };
  const std::string toml = model_toml() + plugin("amp") + zero3() +
                           plugin("offload", "optimizer = \"host\"\nparameters = \"host\"\n");
  Trainer t(test::config_from(toml), TrainOptions{});
  Probe probe;
  probe.t = &t;
  t.add_listener(&probe);
  t.run();
  EXPECT_EQ(probe.parked, 3 * 6);     // 3 steps of 6 blocks
  EXPECT_EQ(probe.on_device, 3 * 2);  // the head and the embedding
  // The host ledger's gradients at its peak: the shards, the staging and the parked bf16
  // gradients of the embedding (6,144 elements: 64 tokens and 32 positions of 64).
  const PeakEstimate e = estimate_config(test::config_from(toml)).peak;
  EXPECT_EQ(t.device().host_place()->tracker().live_at_peak()[int(Category::kGradients)],
            e.host[int(Category::kGradients)]);
  const Trained plain = train(model_toml() + plugin("amp"));
  const Trained parked = train(toml);
  expect_same(plain, parked);
}

// The optimizer's state in a file too (the NVMe tier, here on the test's folder): the update
// streams it over the host shards in place.
TEST(OffloadParametersTrain, WithTheNvmeTierIsBitwise) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + plugin("amp") + plugin("checkpoint") + zero3();
  const Trained a = train(base + plugin("offload", "optimizer = \"host\"\n"));
  const Trained b = train(base + plugin("offload", "optimizer = \"nvme\"\nnvme_path = \"" + dir +
                                                       "\"\nparameters = \"host\"\n"));
  expect_same(a, b);
}

// Snapshotted after step 2 and resumed to the end: the losses and the saved masters of the run
// straight through (the snapshot's masters and state came from the host shards, and the resume
// put them back there; with the parameters' NVMe tier it cast the compute shards into the file).
TEST(OffloadParametersTrain, ResumeFromASnapshotIsBitwise) {
  const std::string dir = test::temp_dir();
  for (const std::string& tier : {std::string("parameters = \"host\"\n"),
                                  "parameters = \"nvme\"\nnvme_path = \"" + dir + "\"\n"}) {
    const std::string toml = model_toml() + plugin("amp") + plugin("checkpoint") + zero3() +
                             plugin("offload", "optimizer = \"host\"\n" + tier);
    const Trained whole = train(toml);
    const test::Resumed resumed = test::resume_from_step(toml, 2);
    ASSERT_EQ(resumed.losses.size(), 1u) << tier;  // step 3
    EXPECT_EQ(resumed.losses[0], whole.losses.at(2)) << tier;
    EXPECT_TRUE(resumed.saved == whole.saved) << tier;
  }
}

// The run needs zero3 and the optimizer on the host: exit 2 naming the plugin's line otherwise.
TEST(OffloadParametersTrain, WithoutZero3Exit2NamingThePlugin) {
  const std::string dir = test::temp_dir();
  struct Bad {
    std::string toml, expect;
  };
  for (const Bad& bad : std::vector<Bad>{
           {plugin("zero2") + plugin("offload", "parameters = \"host\"\n"),
            "plugin 'zero2' does not shard them: list zero3 in [[plugins]]"},
           {plugin("offload", "parameters = \"host\"\n"), "no plugin shards the parameters"},
       }) {
    const std::string cfg = test::write_file(dir, "bad.toml", model_toml() + bad.toml);
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the line: " << r.output;
  }
}

// The host's wall with the shards there: at the closed form's host bytes the run trains; one byte
// less stops it out of memory on the host (exit 3), the report naming the place.
TEST(OffloadParametersTrain, TheHostWallIsTheClosedFormToTheByte) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + plugin("amp") + plugin("checkpoint") + zero3() +
                           plugin("offload", "optimizer = \"host\"\nparameters = \"host\"\n");
  const uint64_t need = estimate_config(test::config_from(base)).peak.host_total();
  const std::string fits = test::write_file(
      dir, "fits.toml", base + "[host]\nmemory_limit = " + std::to_string(need) + "\n");
  const test::RunResult r = test::run_headroom("train " + fits + " -q");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  test::expect_out_of_memory_on_the_host(dir, base, need);
}

// The host place finds the buffer under a pointer inside it (what routes an offloaded gradient
// shard's range to the host's ops: Device::backend_for, nonfinite_many).
TEST(OffloadParametersPlace, ThePointerInsideAHostBufferIsTheHosts) {
  auto device = Device::create(DeviceConfig{});
  Device& host = *device->host_place();
  Buffer a(host, 4096, Category::kGradients, "a");
  Buffer d(*device, 4096, Category::kGradients, "d");
  EXPECT_TRUE(host.contains(a.as<char>()));
  EXPECT_TRUE(host.contains(a.as<char>() + 4095));
  EXPECT_FALSE(host.contains(a.as<char>() + 4096 + 4096 * 1024));
  EXPECT_FALSE(host.contains(d.as<char>() + 100));
  EXPECT_EQ(&device->backend_for(a.as<char>() + 100), &host.backend());
  EXPECT_EQ(&device->backend_for(d.as<char>() + 100), &device->backend());
}

}  // namespace
}  // namespace headroom
