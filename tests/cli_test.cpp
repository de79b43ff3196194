// The host binary as a user meets it: exit codes, error messages that point at the input, the
// out-of-memory report, `check`, --metrics.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/device/device.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

using test::run_headroom;
using test::write_file;

const char* kSmallModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n";

struct Cli : ::testing::Test {
  std::string dir = test::temp_dir();
  std::string config(const std::string& text) { return write_file(dir, "run.toml", text); }
};

TEST_F(Cli, UnknownKeyExits2NamingFileAndLine) {
  const std::string path = config(std::string(kSmallModel) + "[train]\nsteps = 2\nstepz = 3\n");
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(path + ":9:1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stepz"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("micro_batch"), std::string::npos)
      << "lists the valid keys: " << r.output;
}

TEST_F(Cli, WrongTypeExits2NamingFileAndLine) {
  const std::string path = config(std::string(kSmallModel) + "[train]\nsteps = \"ten\"\n");
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(path + ":8:9"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("integer"), std::string::npos) << r.output;
}

TEST_F(Cli, BadSizeExits2NamingFileAndLine) {
  const std::string path = config(std::string(kSmallModel) + "[device]\nmemory_limit = \"64MB\"\n");
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(path + ":8:16"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("MiB"), std::string::npos) << "says what is valid: " << r.output;
}

TEST_F(Cli, MissingConfigFileExits2NamingIt) {
  const auto r = run_headroom("train " + dir + "/absent.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(dir + "/absent.toml"), std::string::npos) << r.output;
}

TEST_F(Cli, UnreadableDataFileExits2NamingConfigLineAndFile) {
  const std::string path =
      config(std::string(kSmallModel) + "[data]\nkind = \"text\"\npath = \"missing.txt\"\n");
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(path + ":9:8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("missing.txt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("No such file"), std::string::npos) << r.output;
}

TEST_F(Cli, TooSmallDataFileExits2) {
  write_file(dir, "small.txt", "hello");
  const std::string path =
      config(std::string(kSmallModel) + "[data]\nkind = \"text\"\npath = \"small.txt\"\n");
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(path + ":9:8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fewer than one micro-batch"), std::string::npos) << r.output;
}

// kind = "cuda" where this build has no CUDA backend, or this machine no GPU: exit 2, naming the
// line that asked for it.
TEST_F(Cli, CudaWithoutAGpuExits2NamingTheLine) {
  const std::string path =
      config(std::string(kSmallModel) + "[train]\nsteps = 1\n[device]\nkind = \"cuda\"\n");
  const auto r = run_headroom("train " + path + " -q");
  if (r.exit_code == 0) GTEST_SKIP() << "this machine has a GPU and a CUDA build: the run trained";
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(path + ":10:8: device.kind = \"cuda\""), std::string::npos) << r.output;
}

TEST_F(Cli, BadSetExits2NamingTheOverride) {
  const std::string path = config(kSmallModel);
  auto r = run_headroom("train " + path + " --set train.steps=abc");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--set train.steps=abc"), std::string::npos) << r.output;
  r = run_headroom("train " + path + " --set nosuch.key=1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("nosuch"), std::string::npos) << r.output;
  r = run_headroom("train " + path + " --set steps");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("section.key=value"), std::string::npos) << r.output;
}

TEST_F(Cli, UsageErrorsExit2) {
  EXPECT_EQ(run_headroom("").exit_code, 2);
  EXPECT_EQ(run_headroom("frobnicate").exit_code, 2);
  EXPECT_EQ(run_headroom("train").exit_code, 2);
  EXPECT_EQ(run_headroom("train x.toml --no-such-flag").exit_code, 2);
}

TEST_F(Cli, HelpListsEveryOption) {
  auto r = run_headroom("--help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("train"), std::string::npos);
  EXPECT_NE(r.output.find("check"), std::string::npos);
  r = run_headroom("train --help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--set", "--metrics", "--quiet"})
    EXPECT_NE(r.output.find(opt), std::string::npos) << opt << "\n" << r.output;
}

TEST_F(Cli, OutOfMemoryExits3WithTheFullReport) {
  // Parameters + gradients + AdamW fit; the activations of micro_batch 16 do not.
  const std::string path = config(std::string(kSmallModel) +
                                  "[train]\nsteps = 2\nmicro_batch = 16\n"
                                  "[device]\nmemory_limit = \"1280KiB\"\n");
  const auto r = run_headroom("train " + path);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (const char* field :
       {"out of memory: head backward: dlogits (chunk, V)", "requested", "256.00 KiB",
        "memory_limit", "1.25 MiB", "live", "phase", "backward of layer 3 (head)",
        "step 1, micro-step 1", "parameters", "gradients", "optimizer", "activations", "workspace",
        "data", "communication", "peak"})
    EXPECT_NE(r.output.find(field), std::string::npos) << "missing '" << field << "'\n" << r.output;
  // The same run with a smaller micro-batch fits.
  const auto ok = run_headroom("train " + path + " --set train.micro_batch=1 -q");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST_F(Cli, OutOfMemoryAdviceNamesAMicroBatchThatFits) {
  const std::string path = config(std::string(kSmallModel) +
                                  "[train]\nsteps = 2\nmicro_batch = 16\ngrad_accum = 1\n"
                                  "[device]\nmemory_limit = \"1536KiB\"\n");
  const auto r = run_headroom("train " + path);
  ASSERT_EQ(r.exit_code, 3) << r.output;
  const size_t at = r.output.find("what would make it fit");
  ASSERT_NE(at, std::string::npos) << r.output;
  // The advice's --set flags, applied as printed, make the same batch fit.
  const size_t mb = r.output.find("--set train.micro_batch=", at),
               ga = r.output.find("--set train.grad_accum=", at);
  ASSERT_NE(mb, std::string::npos) << r.output;
  ASSERT_NE(ga, std::string::npos) << r.output;
  const int micro = std::stoi(r.output.substr(mb + 24)),
            accum = std::stoi(r.output.substr(ga + 23));
  EXPECT_EQ(micro * accum, 16);
  const auto ok =
      run_headroom("train " + path + " -q --set train.micro_batch=" + std::to_string(micro) +
                   " --set train.grad_accum=" + std::to_string(accum));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

TEST_F(Cli, PlanEstimatesThePeakAndWhatWouldFit) {
  const std::string path = config(std::string(kSmallModel) +
                                  "[train]\nsteps = 2\nmicro_batch = 16\n"
                                  "[device]\nmemory_limit = \"1536KiB\"\n");
  auto r = run_headroom("plan " + path);
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("does not fit memory_limit 1.50 MiB: needs about"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("--set train.micro_batch="), std::string::npos) << r.output;
  // The plan's estimate is the peak the run then measures.
  r = run_headroom("plan " + path + " --set train.micro_batch=1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find("total");
  ASSERT_NE(at, std::string::npos) << r.output;
  const std::string total = r.output.substr(at + 5, r.output.find('\n', at) - at - 5);
  const auto run = run_headroom("train " + path + " --set train.micro_batch=1");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::string peak_line = "memory report: peak " + total.substr(total.find_first_not_of(' '));
  EXPECT_NE(run.output.find(peak_line), std::string::npos) << peak_line << "\n" << run.output;
}

TEST_F(Cli, CheckPrintsTheResolvedConfigWhichReadsBackTheSame) {
  const std::string path = config("[model]\npreset = \"tiny\"\n[train]\nsteps = 7\n");
  const auto first = run_headroom("check " + path + " --set device.memory_limit=64MiB");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (const char* key : {"n_layer = 2", "steps = 7", "micro_batch = 4", "optimizer = \"adamw\"",
                          "lr_schedule = \"cosine\"", "memory_limit = \"64MiB\"", "kind = \"cpu\""})
    EXPECT_NE(first.output.find(key), std::string::npos) << key << "\n" << first.output;
  const std::string resolved = write_file(dir, "resolved.toml", first.output);
  const auto second = run_headroom("check " + resolved);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  // Only the comment line naming the source file differs.
  EXPECT_EQ(first.output.substr(first.output.find('\n')),
            second.output.substr(second.output.find('\n')));
}

TEST_F(Cli, MetricsWritesOneJsonObjectPerStep) {
  const std::string path = config(std::string(kSmallModel) + "[train]\nsteps = 3\n");
  const auto r = run_headroom("train " + path + " -q --metrics " + dir + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir + "/m.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("step").get<int>(), ++n);
    for (const char* k : {"loss", "lr", "tokens_per_s", "mem_peak_bytes", "grad_norm"})
      EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_GT(j.at("mem_peak_by_category").at("parameters").get<uint64_t>(), 0u);
    EXPECT_GT(j.at("mem_peak_by_category").at("activations").get<uint64_t>(), 0u);
    EXPECT_TRUE(std::isfinite(j.at("loss").get<double>()));
  }
  EXPECT_EQ(n, 3);
}

TEST_F(Cli, UnknownCommandNamesTheWordAndTheNearestCommand) {
  const auto r = run_headroom("trian " + dir + "/run.toml");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("unknown command 'trian'; did you mean 'train'?"), std::string::npos)
      << r.output;
  const auto far = run_headroom("frobnicate");
  EXPECT_EQ(far.exit_code, 2) << far.output;
  EXPECT_NE(far.output.find("unknown command 'frobnicate'"), std::string::npos) << far.output;
  EXPECT_EQ(far.output.find("did you mean"), std::string::npos) << far.output;
  EXPECT_NE(far.output.find("train, plan, check"), std::string::npos) << far.output;
}

TEST_F(Cli, TokensPerShardOutsideItsRangeSaysTheRange) {
  const std::string text = write_file(dir, "t.txt", "some text");
  for (const char* n : {"0", "2147483648"}) {
    const auto r = run_headroom("shard " + text + " " + dir + "/out --tokens-per-shard " + n);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("must be a whole number from 1 to 2147483647"), std::string::npos)
        << r.output;
  }
}

TEST(OomReport, WithoutAMemoryLimitSaysTheDeviceRefusedTheAllocation) {
  OomReport r;
  r.requested = 3ull << 30;
  r.what = "block 0 activations: att (B, NH, T, T)";
  const std::string s = r.str();
  EXPECT_NE(s.find("none: the device refused the allocation of 3.00 GiB itself"), std::string::npos)
      << s;
  EXPECT_EQ(s.find("memory_limit                0 B"), std::string::npos) << s;
  EXPECT_EQ(s.find("free under the limit"), std::string::npos) << s;
}

// A host that refuses an allocation (here an address-space limit) with no memory_limit set: the
// report says so, with the size, and the exit code is 3.
TEST_F(Cli, HostRefusingAnAllocationReportsItsSize) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: ulimit -v cannot hold it";
#endif
  // Each (B, T, C) activation is 4 GiB, past a 3 GB address-space limit. The limit leaves room for
  // what the libraries map (NCCL, the CUDA runtime, OpenBLAS's per-thread buffers: about 1 GB):
  // below that, OpenBLAS's threads spin forever on a buffer they cannot get.
  const std::string path = config(
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 64\nseq_len = 64\nvocab_size = 256\n"
      "[train]\nsteps = 1\nmicro_batch = 262144\n");
  const auto r = test::run_command("bash -c 'ulimit -v 3000000; exec " +
                                   std::string(HEADROOM_BINARY) + " train -q " + path + "'");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("memory_limit           none: the device refused the allocation of"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace headroom
