// The host place and the offload plugin (issue 34, its first two points), loaded by the real
// plugin host from the TOML list:
//  - the host ledger: [host] memory_limit is a wall of its own (exit 3, a report naming the host),
//    the metrics carry host_peak_bytes by category, the end-of-run report and the timeline show it;
//  - optimizer = "host": the built-in optimizer's state and an f32 copy of its weights live in the
//    host ledger, and the run is bitwise the run without offload (losses, every weight), with amp
//    too; the device's bytes drop by exactly the optimizer state, the host's equal the closed
//    form (core/run/host_optimizer.h, and the planner's, core/report/advice.cpp); a resume from a
//    snapshot is bitwise;
//  - bad keys and what cannot combine with it are
//    refused before step 1, naming the key or the plugins.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/report/advice.h"
#include "core/run/host_optimizer.h"
#include "core/run/trainer.h"
#include "tests/offload_outcome.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

std::string model_toml() {
  return "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n";
}

std::string train_toml(int steps, const std::string& extra = "") {
  return "[train]\nsteps = " + std::to_string(steps) +
         "\nmicro_batch = 4\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 2\ngrad_clip = 0.5\n" +
         extra;
}

std::string offload_toml(const std::string& keys = "") {
  return "[[plugins]]\nname = \"offload\"\n" + keys;
}

std::string amp_toml() {
  return "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n";
}

uint64_t at(const ByCategory& b, Category c) {
  return b[int(c)];
}

using test::expect_same_training;
using test::file_bytes;
using test::Outcome;
Outcome run(const std::string& toml, bool save = false) {
  return test::train_outcome(toml, save);
}

// The closed form of the host ledger: core's planner, from the config's shapes.
ByCategory planned_host(const std::string& toml) {
  return estimate_config(test::config_from(toml)).peak.host;
}

void expect_offload_moves_exactly_the_optimizer(const std::string& base, uint64_t state_bytes_el) {
  const Outcome plain = run(base);
  const Outcome off = run(base + offload_toml("optimizer = \"host\"\n"));
  expect_same_training(plain, off);
  // The device: every category as without offload but the optimizer's state, which is gone.
  for (int i = 0; i < kNumCategories; ++i) {
    if (category_at(i) == Category::kOptimizer) continue;
    EXPECT_EQ(off.device_peak[i], plain.device_peak[i]) << category_name(category_at(i));
  }
  uint64_t psi = 0;
  for (const OptSegment& s : off.segments)
    psi += s.numel;
  EXPECT_EQ(at(plain.device_peak, Category::kOptimizer), 2 * state_bytes_el * psi);  // m and v
  EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
  // The host: the state, an f32 copy of the weights, a copy of the gradients; nothing else.
  const ByCategory closed = host_optimizer_bytes(off.segments, 2, Dtype::kF32);
  EXPECT_EQ(at(closed, Category::kOptimizer), 2 * state_bytes_el * psi);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(off.host_peak[i], closed[i]) << "host " << category_name(category_at(i));
  const ByCategory planned = planned_host(base + offload_toml("optimizer = \"host\"\n"));
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(planned[i], closed[i]) << "planned host " << category_name(category_at(i));
  // Without offload the host ledger holds nothing.
  EXPECT_EQ(plain.host_allocs, 0u);
  std::printf(
      "psi %llu: device optimizer %llu -> 0 B; host parameters %llu, gradients %llu, "
      "optimizer %llu B\n",
      (unsigned long long)psi, (unsigned long long)at(plain.device_peak, Category::kOptimizer),
      (unsigned long long)at(off.host_peak, Category::kParameters),
      (unsigned long long)at(off.host_peak, Category::kGradients),
      (unsigned long long)at(off.host_peak, Category::kOptimizer));
}

TEST(OffloadOptimizer, Fp32IsBitwiseAndMovesExactlyTheStateToTheHost) {
  expect_offload_moves_exactly_the_optimizer(model_toml() + train_toml(4), 4);
}

// amp with f32 masters (ZeRO-Offload's layout): the masters move to the host too. The device
// keeps the compute copies (2Ψ for bf16, not 6Ψ) and the gradients as amp makes them; the host
// updates its f32 masters and uploads their compute-dtype cast. Bitwise the run without offload:
// the losses, the compute copies and the masters as --save-weights writes them (read from the
// host).
void expect_masters_on_the_host(const std::string& base) {
  const Outcome plain = run(base, true);
  const std::string with = base + offload_toml("optimizer = \"host\"\n");
  const Outcome off = run(with, true);
  ASSERT_EQ(plain.losses.size(), off.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_EQ(plain.losses[i], off.losses[i]) << "step " << i + 1;
  ASSERT_EQ(plain.compute.size(), off.compute.size());
  for (size_t i = 0; i < plain.compute.size(); ++i)
    EXPECT_TRUE(plain.compute[i] == off.compute[i]) << "parameter " << i;
  ASSERT_FALSE(plain.saved.empty());
  EXPECT_TRUE(plain.saved == off.saved) << "the saved f32 masters differ";
  uint64_t psi = 0;
  for (const OptSegment& s : off.segments) {
    psi += s.numel;
    EXPECT_NE(s.value_dtype, Dtype::kF32) << s.name << ": no f32 masters on the device";
  }
  const uint64_t es = dtype_size(off.segments.at(0).value_dtype);
  // The device: the masters' 4Ψ and the optimizer's state gone, everything else the same. At
  // its peak it holds the compute copies alone; the parameters' own highest is at the init,
  // which passes one layer's f32 masters at a time through the device before they go to the
  // host.
  EXPECT_EQ(at(plain.device_peak, Category::kParameters), (4 + es) * psi);
  EXPECT_EQ(at(plain.device_at_peak, Category::kParameters), (4 + es) * psi);
  EXPECT_EQ(at(off.device_at_peak, Category::kParameters), es * psi);
  EXPECT_EQ(at(off.device_peak, Category::kParameters), es * psi + 4 * off.largest_layer);
  EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
  for (int i = 0; i < kNumCategories; ++i) {
    const Category c = category_at(i);
    if (c == Category::kOptimizer || c == Category::kParameters) continue;
    EXPECT_EQ(off.device_peak[i], plain.device_peak[i]) << category_name(c);
  }
  // The host: the f32 masters and their compute-dtype copy, the gradients' copies, the state.
  const ByCategory closed = host_optimizer_bytes(off.segments, 2, Dtype::kF32, true);
  EXPECT_EQ(at(closed, Category::kParameters), (4 + es) * psi);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(off.host_peak[i], closed[i]) << "host " << category_name(category_at(i));
  const ConfigEstimate planned = estimate_config(test::config_from(with));
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(planned.peak.host[i], closed[i]) << "planned host " << category_name(category_at(i));
  EXPECT_EQ(at(planned.peak.at_peak, Category::kParameters), es * psi) << "planned device";
  std::printf(
      "psi %llu: device parameters %llu -> %llu B, peak %llu -> %llu B; host %llu B\n",
      (unsigned long long)psi, (unsigned long long)at(plain.device_peak, Category::kParameters),
      (unsigned long long)at(off.device_peak, Category::kParameters),
      (unsigned long long)plain.device_peak_total, (unsigned long long)off.device_peak_total,
      (unsigned long long)(at(off.host_peak, Category::kParameters) +
                           at(off.host_peak, Category::kGradients) +
                           at(off.host_peak, Category::kOptimizer)));
}

TEST(OffloadMasters, AmpBf16IsBitwiseWithTheMastersOnTheHost) {
  expect_masters_on_the_host(model_toml() + train_toml(4) + amp_toml());
}

TEST(OffloadMasters, AmpBf16GradientsInBf16IsBitwise) {
  expect_masters_on_the_host(model_toml() + train_toml(3) + amp_toml() + "grad_dtype = \"bf16\"\n");
}

// fp16 with dynamic loss scaling: the overflow checks and the skipped steps as without offload
// (an init_scale that overflows at step 1, skipped; the next ones update).
TEST(OffloadMasters, AmpFp16WithLossScalingIsBitwise) {
  expect_masters_on_the_host(model_toml() + train_toml(4) +
                             "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n"
                             "init_scale = 1e30\nbackoff_factor = 1e-25\nhysteresis = 1\n");
}

TEST(OffloadMasters, ResumeFromASnapshotIsBitwise) {
  const std::string toml = model_toml() + train_toml(4) + amp_toml() + offload_toml();
  const std::string whole_path = test::temp_dir() + "/whole.safetensors";
  TrainOptions o;
  o.save_weights_path = whole_path;
  Trainer whole(test::config_from(toml), std::move(o));
  whole.run();
  test::expect_resume_is_bitwise(toml, whole);
  // The masters too: a run of the first half, snapshotted, then resumed to the end, saves the
  // whole run's f32 masters (the snapshot's came from the host, and the resume put them there).
  EXPECT_TRUE(test::resume_from_step(toml, 2).saved == file_bytes(whole_path));
  // And a snapshot of amp without offload resumes with it.
  EXPECT_TRUE(test::resume_from_step(model_toml() + train_toml(4) + amp_toml(), 2, toml).saved ==
              file_bytes(whole_path));
}

// init_from loads the masters through the host's access: the same run as amp's from the same file.
TEST(OffloadMasters, InitFromIsBitwise) {
  const Outcome start = run(model_toml() + train_toml(2, "seed = 7\n") + amp_toml(), true);
  const std::string dir = test::temp_dir();
  {
    std::ofstream out(dir + "/start.safetensors", std::ios::binary);
    out << start.saved;
  }
  const std::string base =
      model_toml() + train_toml(3, "init_from = \"" + dir + "/start.safetensors\"\n") + amp_toml();
  const Outcome plain = run(base, true);
  const Outcome off = run(base + offload_toml(), true);
  ASSERT_EQ(plain.losses.size(), off.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i)
    EXPECT_EQ(plain.losses[i], off.losses[i]) << "step " << i + 1;
  EXPECT_TRUE(plain.saved == off.saved) << "the saved f32 masters differ";
  // Not the seed's init: the loaded weights (the first loss is the loaded model's).
  const Outcome fresh = run(model_toml() + train_toml(1) + amp_toml() + offload_toml());
  EXPECT_NE(fresh.losses.at(0), off.losses.at(0));
}

// A device wall amp alone cannot train under, and amp with the masters on the host can.
TEST(OffloadMasters, FitsUnderADeviceWallAmpAloneCannot) {
  const std::string plain = model_toml() + train_toml(2) + amp_toml();
  const std::string with = plain + offload_toml();
  const Outcome off = run(with);
  const Outcome amp = run(plain);
  const uint64_t limit = off.device_peak_total + (64 << 10);  // the arena's first-fit slack
  ASSERT_LT(limit, amp.device_peak_total);
  Config c = test::config_from(with);
  c.device.memory_limit = limit;
  Trainer t(c, TrainOptions{});
  t.run();
  EXPECT_EQ(t.history().size(), 2u);
  Config without = test::config_from(plain);
  without.device.memory_limit = limit;
  EXPECT_THROW(
      {
        Trainer w(without, TrainOptions{});
        w.run();
      },
      OutOfMemory);
}

// The host masters are what a resize would shrink on the device: refused, naming why.
TEST(OffloadMasters, PruningIsRefused) {
  const std::string toml = model_toml() + train_toml(3) + amp_toml() + offload_toml() +
                           "[[plugins]]\nname = \"pruning\"\nmode = \"mlp\"\n"
                           "final_sparsity = 0.5\nstart_step = 1\nend_step = 2\nevery = 1\n";
  try {
    Trainer t(test::config_from(toml), TrainOptions{});
    t.run();
    ADD_FAILURE() << "pruning ran with the masters on the host";
  } catch (const std::exception& e) {
    EXPECT_TRUE(test::contains(e.what(), "f32 masters are in host memory")) << e.what();
  }
}

TEST(OffloadOptimizer, SgdWithMomentumIsBitwise) {
  const std::string base = model_toml() + train_toml(3, "optimizer = \"sgd\"\nmomentum = 0.9\n");
  const Outcome plain = run(base);
  const Outcome off = run(base + offload_toml());  // optimizer = "host" is the default
  expect_same_training(plain, off);
  EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
  EXPECT_EQ(at(off.host_peak, Category::kOptimizer), at(plain.device_peak, Category::kOptimizer));
}

// Structured pruning shrinks the parameters mid-run: the host optimizer's state and copies follow,
// and the run is still bitwise the one without offload.
TEST(OffloadOptimizer, PruningIsBitwise) {
  const std::string base = model_toml() + train_toml(4) +
                           "[[plugins]]\nname = \"pruning\"\nmode = \"mlp\"\n"
                           "final_sparsity = 0.5\nstart_step = 1\nend_step = 3\nevery = 1\n";
  const Outcome plain = run(base);
  const Outcome off = run(base + offload_toml());
  expect_same_training(plain, off);
  EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
  uint64_t psi = 0;  // the pruned model's
  for (const OptSegment& s : off.segments)
    psi += s.numel;
  EXPECT_LT(psi, 106240u) << "the model was pruned";
}

// With activation recomputation: bitwise the run with checkpointing alone.
TEST(OffloadOptimizer, WithCheckpointIsBitwise) {
  const std::string base =
      model_toml() + train_toml(3) + "[[plugins]]\nname = \"checkpoint\"\npolicy = \"every\"\n";
  const Outcome plain = run(base);
  const Outcome off = run(base + offload_toml());
  expect_same_training(plain, off);
  EXPECT_EQ(at(off.device_peak, Category::kActivations),
            at(plain.device_peak, Category::kActivations));
  EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
}

TEST(OffloadOptimizer, NoneChangesNothing) {
  const std::string base = model_toml() + train_toml(2);
  const Outcome plain = run(base);
  const Outcome none = run(base + offload_toml("optimizer = \"none\"\n"));
  expect_same_training(plain, none);
  EXPECT_EQ(none.device_peak, plain.device_peak);
  EXPECT_EQ(none.host_allocs, 0u);
}

TEST(OffloadOptimizer, ResumeFromASnapshotIsBitwise) {
  for (const std::string& extra : {std::string(), amp_toml()}) {
    const std::string toml = model_toml() + train_toml(4) + extra + offload_toml();
    Trainer whole(test::config_from(toml), TrainOptions{});
    whole.run();
    test::expect_resume_is_bitwise(toml, whole);
  }
}

// Frozen parameters ([train] freeze, LoRA's base): the host optimizer updates the trainable ones
// alone, bitwise as on the device, on the host tier and the NVMe tier, and a LoRA run with amp's
// masters on the host resumes bitwise (the model's access makes the frozen f32 weights around
// the host's masters for the snapshot's base checksum and the saved adapter).
TEST(OffloadFrozen, TrainsTheTrainableParametersBitwise) {
  const std::string dir = test::temp_dir();
  const std::string lora =
      "[[plugins]]\nname = \"lora\"\nr = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\n";
  for (const std::string& base :
       {model_toml() + train_toml(3, "freeze = [\"wte.weight\", \"h.0.*\"]\n"),
        model_toml() + train_toml(3) + lora, model_toml() + train_toml(3) + amp_toml() + lora}) {
    SCOPED_TRACE(base);
    const Outcome plain = run(base, true);
    for (const std::string& keys : {std::string("optimizer = \"host\"\n"),
                                    "optimizer = \"nvme\"\nnvme_path = \"" + dir + "\"\n"}) {
      const Outcome off = run(base + offload_toml(keys), true);
      expect_same_training(plain, off);
      EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
    }
  }
  const std::string toml = model_toml() + train_toml(4) + amp_toml() + lora + offload_toml();
  Trainer whole(test::config_from(toml), TrainOptions{});
  whole.run();
  test::expect_resume_is_bitwise(toml, whole);
}

// The host ledger's wall: out of memory there is exit 3 with a report naming the host; the
// metrics, the end-of-run report and the timeline show the ledger.
TEST(HostPlace, MemoryLimitIsAWallWithItsOwnReport) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(2) + offload_toml();
  const ByCategory host = planned_host(base);
  uint64_t need = 0;
  for (uint64_t b : host)
    need += b;
  ASSERT_GT(need, 0u);

  // Just enough: trains, and says what the host held.
  const std::string fits = test::write_file(
      dir, "fits.toml", base + "[host]\nmemory_limit = " + std::to_string(need) + "\n");
  auto r = test::run_headroom("train " + fits + " --metrics " + dir +
                              "/m.jsonl --memory-timeline " + dir + "/t.html");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::contains(r.output, "host: peak")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "of [host] memory_limit")) << r.output;
  std::ifstream metrics(dir + "/m.jsonl");
  std::string line, last;
  while (std::getline(metrics, line))
    last = line;
  const auto j = nlohmann::json::parse(last);
  EXPECT_EQ(j.at("host_peak_bytes").get<uint64_t>(), need);
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(j.at("host_peak_by_category").at(category_name(category_at(i))).get<uint64_t>(),
              host[i]);
  const std::string html = test::read_file(dir + "/t.host.html");
  EXPECT_TRUE(test::contains(html, "host memory")) << "the host ledger's timeline";
  EXPECT_TRUE(test::contains(html, "series-optimizer"));

  // One byte less: out of memory on the host, exit 3, the report naming the place.
  const std::string tight_out = test::expect_out_of_memory_on_the_host(dir, base, need);
  EXPECT_TRUE(test::contains(tight_out, "host memory_limit")) << tight_out;
  EXPECT_TRUE(test::contains(tight_out, "raise [host] memory_limit")) << tight_out;
  const std::string tight = dir + "/tight.toml";

  // plan says the same before anything runs.
  r = test::run_headroom("plan " + tight);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "does not fit [host] memory_limit")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "estimated host memory")) << r.output;
}

// The host ledger is a ledger of its own on the CPU backend: the device's wall does not count
// what the host holds. A device limit the run without offload does not fit (its optimizer state
// is over it) fits with it.
TEST(HostPlace, TwoLedgersOverTheSameRam) {
  const std::string plain = model_toml() + train_toml(2);  // step 2's backward holds the state
  const std::string base = plain + offload_toml();
  const Outcome off = run(base);
  const uint64_t limit = off.device_peak_total + (64 << 10);  // the arena's first-fit slack
  ASSERT_LT(limit, off.device_peak_total + at(off.host_peak, Category::kOptimizer));
  Config c = test::config_from(base);
  c.device.memory_limit = limit;
  Trainer t(c, TrainOptions{});
  t.run();
  EXPECT_EQ(t.device().tracker().peak(Category::kOptimizer), 0u);
  EXPECT_EQ(t.device().host_place()->tracker().peak(Category::kOptimizer),
            at(off.host_peak, Category::kOptimizer));
  Config without = test::config_from(plain);
  without.device.memory_limit = limit;
  EXPECT_THROW(
      {
        Trainer w(without, TrainOptions{});
        w.run();
      },
      OutOfMemory);
}

TEST(OffloadPlugin, BadKeysExit2NamingTheKeyAndWhatIsValid) {
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + train_toml(1);
  struct Bad {
    std::string toml, expect;
  };
  for (const Bad& bad : std::vector<Bad>{
           {offload_toml("optimizer = \"nvme\"\n"), "\"nvme\" needs nvme_path"},
           {offload_toml("optimizer = \"disk\"\n"), "valid: \"none\", \"host\", \"nvme\""},
           {offload_toml("optimizer = 1\n"), "optimizer"},
           {offload_toml("parameters = \"host\"\n"), "list zero3 in [[plugins]]"},
           {offload_toml("parameters = \"nvme\"\n"), "parameters: \"nvme\" needs nvme_path"},
           {offload_toml("parameters = \"disk\"\n"), "valid: \"none\", \"host\", \"nvme\""},
           {offload_toml("optimizer = \"none\"\nparameters = \"host\"\n"),
            "optimizer = \"host\" or \"nvme\""},
           {offload_toml("activations = \"host\"\n"), "activations"},
           {offload_toml("pin_memory = 0\n"), "pin_memory"},
           {offload_toml() + "[host]\nmemory_limit = -5\n", "host.memory_limit must be >= 0"},
           {offload_toml() + "[host]\nmemory_limit = \"lots\"\n", "host.memory_limit"},
           {offload_toml() + "[host]\nlimit = \"1GiB\"\n", "unknown key 'limit' in [host]"},
           {offload_toml() + "[[plugins]]\nname = \"adam8bit\"\n", "takes the optimizer role"},
       }) {
    const std::string cfg = test::write_file(dir, "bad.toml", base + bad.toml);
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml")) << "names the file: " << r.output;
  }
}

// The examples: gpt2-350m shapes that do not fit their device wall without their tier (plan: exit
// 3) and do with it (plan: exit 0, both ledgers within their walls). examples/offload-350m.toml:
// amp under 3 GiB, the masters and AdamW's state on the host. examples/offload-params-350m.toml:
// amp + checkpoint + zero3 under 1 GiB, the parameter shards on the host too. The training itself
// is docs/results/offload.md's (too long for the suite).
TEST(OffloadExample, Gpt2_350mFitsTheDeviceOnlyWithItsTier) {
  const struct {
    const char* file;
    const char* without;  // the --set that takes the tier away
    const char* wall;
  } examples[] = {
      {"offload-350m.toml", "plugins.offload.optimizer=\"none\"", "3.00 GiB"},
      {"offload-params-350m.toml", "plugins.offload.parameters=\"none\"", "1.00 GiB"},
  };
  for (const auto& x : examples) {
    const std::string cfg = std::string(HEADROOM_SOURCE_DIR) + "/examples/" + x.file;
    const test::RunResult with = test::run_headroom("plan " + cfg);
    EXPECT_EQ(with.exit_code, 0) << x.file << "\n" << with.output;
    EXPECT_TRUE(test::contains(with.output, "host ledger fits [host] memory_limit")) << with.output;
    const test::RunResult without =
        test::run_headroom("plan " + cfg + " --set '" + x.without + "'");
    EXPECT_EQ(without.exit_code, 3) << x.file << "\n" << without.output;
    EXPECT_TRUE(test::contains(without.output, std::string("does not fit memory_limit ") + x.wall))
        << without.output;
  }
}

}  // namespace
}  // namespace headroom
