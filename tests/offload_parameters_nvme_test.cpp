// The parameters' NVMe tier (issue 34: the offload plugin's parameters = "nvme"; headroom.offload/1
// set_parameter_files; core/shard/shard_file.h): with zero3 on one rank, the shards a sharded
// layer's gathering reads — amp's compute copy, frozen weights, a quantized base — rest in a file
// under nvme_path, the master and gradient shards in the host ledger.
//  - bitwise the same run with parameters = "host" (amp + checkpoint, prefetch 0 and 2, the
//    optimizer's state in its own file too, LoRA on an nf4 base), on the test folder's file system
//    (O_DIRECT) and on tmpfs buffered;
//  - both ledgers by category are the closed form's (core/report/advice.cpp), the host holding
//    less than with parameters = "host" by the shards now in the file, less the staging;
//  - the file is gone after the run (a resume from a snapshot: tests/offload_parameters_test.cpp);
//  - a full disk stops the run before step 1 (exit 4) naming the file, leaving none; fp32
//    parameters with nothing for the file, a missing nvme_path and optimizer = "none" exit 2.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/report/advice.h"
#include "core/run/trainer.h"
#include "tests/offload_outcome.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

// tests/offload_parameters_test.cpp's model: six blocks sharded, ln_f whole on the device.
std::string model_toml() {
  return "[model]\nn_layer = 6\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n"
         "[train]\nsteps = 3\nmicro_batch = 4\nlr = 3e-3\nwarmup_steps = 2\ngrad_clip = 0.5\n";
}

std::string plugin(const std::string& name, const std::string& keys = "") {
  return "[[plugins]]\nname = \"" + name + "\"\n" + keys;
}

std::string zero3(const std::string& keys = "") {
  return plugin("zero3", "param_persistence_threshold = 1000\n" + keys);
}

std::string in_file(const std::string& dir, const std::string& optimizer = "host") {
  return "optimizer = \"" + optimizer + "\"\nparameters = \"nvme\"\nnvme_path = \"" + dir + "\"\n";
}

uint64_t total(const ByCategory& b) {
  uint64_t t = 0;
  for (uint64_t x : b)
    t += x;
  return t;
}

using Trained = test::Sharded;

Trained train(const std::string& toml) {
  return test::train_sharded(toml);
}

using test::TmpfsDir;

struct Case {
  const char* name;
  std::string plugins;  // before zero3
  std::string zero;     // zero3's keys beyond the threshold
  std::string optimizer;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

class OffloadParametersNvme : public ::testing::TestWithParam<Case> {};

TEST_P(OffloadParametersNvme, IsBitwiseTheHostTierAndTheLedgersAreTheClosedForm) {
  const Case& c = GetParam();
  const std::string dir = test::temp_dir();
  const std::string base = model_toml() + c.plugins + zero3(c.zero);
  const std::string optimizer = c.optimizer == "nvme"
                                    ? "optimizer = \"nvme\"\nnvme_path = \"" + dir + "\"\n"
                                    : "optimizer = \"host\"\n";
  const std::string host = base + plugin("offload", optimizer + "parameters = \"host\"\n");
  const std::string nvme = base + plugin("offload", in_file(dir, c.optimizer));
  const Trained a = train(host);
  const Trained b = train(nvme);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;  // bitwise: == on doubles
  EXPECT_TRUE(a.saved == b.saved) << "the saved weights differ";

  const PeakEstimate e = estimate_config(test::config_from(nvme)).peak;
  for (int i = 0; i < kNumCategories; ++i) {
    EXPECT_EQ(b.device_at_peak[i], e.at_peak[i]) << "device " << category_name(category_at(i));
    EXPECT_EQ(b.host_peak[i], e.host[i]) << "host " << category_name(category_at(i));
  }
  // The device holds what it held with the shards on the host; the host less.
  EXPECT_EQ(total(a.device_at_peak), total(b.device_at_peak));
  EXPECT_LT(total(b.host_peak), total(a.host_peak));
  std::printf("%s: host peak %llu -> %llu B with the parameter shards in the file\n", c.name,
              (unsigned long long)total(a.host_peak), (unsigned long long)total(b.host_peak));
  // The run removed its files.
  std::vector<std::string> left;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().filename().string().rfind("headroom-", 0) == 0)
      left.push_back(f.path().filename().string());
  EXPECT_TRUE(left.empty()) << "left: " << left.front();
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, OffloadParametersNvme,
    ::testing::Values(Case{"AmpCheckpoint", plugin("amp") + plugin("checkpoint"), "", "host"},
                      Case{"AmpPrefetch0", plugin("amp"), "prefetch_layers = 0\n", "host"},
                      Case{"AmpPrefetch2StateInAFileToo", plugin("amp") + plugin("checkpoint"),
                           "prefetch_layers = 2\n", "nvme"},
                      Case{"LoraNf4AmpCheckpoint",
                           plugin("lora",
                                  "r = 2\ntarget_modules = [\"c_attn\", \"c_fc\"]\nbase_dtype = "
                                  "\"nf4\"\ndouble_quant = true\n") +
                               plugin("amp") + plugin("checkpoint"),
                           "", "host"},
                      Case{"Fp32FrozenMlps", "freeze = [\"h.*.mlp.*\"]\n", "", "host"}),
    [](const auto& info) { return std::string(info.param.name); });

// On tmpfs the file is read and written buffered where the kernel refuses O_DIRECT there: the same
// training.
TEST(OffloadParametersNvmeTrain, OnTmpfsIsBitwise) {
  TmpfsDir shm;
  ASSERT_FALSE(shm.path.empty());
  const std::string base = model_toml() + plugin("amp") + plugin("checkpoint") + zero3();
  const Trained a = train(base + plugin("offload", "parameters = \"host\"\n"));
  const Trained b = train(base + plugin("offload", in_file(shm.path)));
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_TRUE(a.saved == b.saved);
}

// Bad tables exit 2 naming the key or the plugin's line.
TEST(OffloadParametersNvmeTrain, BadConfigsExit2Saying) {
  const std::string dir = test::temp_dir();
  struct Bad {
    std::string toml, expect;
  };
  for (const Bad& bad : std::vector<Bad>{
           {zero3() + plugin("offload", "parameters = \"nvme\"\n"),
            "parameters: \"nvme\" needs nvme_path"},
           {zero3() + plugin("offload",
                             "optimizer = \"none\"\nparameters = \"nvme\"\n"
                             "nvme_path = \"" +
                                 dir + "\"\n"),
            "\"nvme\" needs the optimizer off the device too"},
           {zero3() + plugin("offload", in_file(dir + "/missing")), "nvme_path"},
           {zero3() + plugin("offload", in_file(dir)), "nothing would go to the file"},
           {plugin("amp") + plugin("offload", in_file(dir)), "no plugin shards the parameters"},
       }) {
    const std::string cfg = test::write_file(dir, "bad.toml", model_toml() + bad.toml);
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the line: " << r.output;
  }
  // `plan` refuses what train refuses.
  const std::string fp32 =
      test::write_file(dir, "fp32.toml", model_toml() + zero3() + plugin("offload", in_file(dir)));
  const auto r = test::run_headroom("plan " + fp32);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "nothing would go to the file")) << r.output;
}

// A disk too small for the shards: the file gets each layer's blocks as the model is built, so
// the run stops before step 1 (exit 4) naming the file and the reason, and leaves no file.
TEST(OffloadParametersNvmeTrain, FullDiskExits4BeforeStepOne) {
  const std::string dir = test::temp_dir();
  const std::string small = dir + "/small";
  fs::create_directories(small);
  const std::string cfg = test::write_file(
      dir, "full.toml", model_toml() + plugin("amp") + zero3() + plugin("offload", in_file(small)));
  const std::string script =
      std::string(HEADROOM_BINARY) + " train " + cfg + "; echo exit=$?; ls -a " + small;
  std::string how;
  const test::RunResult r = test::run_on_a_full_disk(small, script, &how);
  EXPECT_TRUE(test::contains(r.output, "exit=4")) << how << ": " << r.output;
  EXPECT_TRUE(test::contains(r.output, "parameter file " + small + "/headroom-")) << r.output;
  EXPECT_TRUE(
      test::contains(r.output, how == "tmpfs" ? "No space left on device" : "File too large"))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "exit=4\n.\n..\n")) << "no file left: " << r.output;
  EXPECT_FALSE(test::contains(r.output, "step 1 ")) << "stopped before a step: " << r.output;
}

}  // namespace
}  // namespace headroom
