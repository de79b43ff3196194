// A config that `headroom check` accepts is one `headroom train` starts: whatever train refuses
// before its first step (exit 2: data files, shards, init_from weights, the device), check refuses
// too. Every example config and a few edge configs, each run both ways.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace headroom {
namespace {

using test::contains;
using test::run_headroom;
using test::write_file;

struct Outcome {
  int check, train;
  std::string check_out, train_out;
};

// `check`, then `train` for one step (-q): the exit codes.
Outcome both(const std::string& cfg) {
  const test::RunResult c = run_headroom("check " + cfg);
  const test::RunResult t = run_headroom("train -q " + cfg + " --set train.steps=1");
  return {c.exit_code, t.exit_code, c.output, t.output};
}

void expect_agree(const std::string& cfg, const Outcome& o) {
  // train's exit 2 is "the setup's input is bad"; 3 (out of memory) is a run that started.
  EXPECT_EQ(o.check == 2, o.train == 2)
      << cfg << ": check exit " << o.check << ", train exit " << o.train << "\ncheck:\n"
      << o.check_out << "\ntrain:\n"
      << o.train_out;
}

// The example configs, sorted: one case each, so that ctest runs them side by side.
std::vector<std::string> example_configs() {
  std::vector<std::string> names;
  for (const auto& e :
       std::filesystem::directory_iterator(std::string(HEADROOM_SOURCE_DIR) + "/examples"))
    if (e.path().extension() == ".toml") names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class EveryExample : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryExample, CheckAcceptsAndTrainStarts) {
  const std::string cfg = std::string(HEADROOM_SOURCE_DIR) + "/examples/" + GetParam();
  const test::RunResult c = run_headroom("check " + cfg);
  EXPECT_EQ(c.exit_code, 0) << cfg << ": an example config check refuses\n" << c.output;
#ifdef HEADROOM_SANITIZE_BUILD
  // gpt2's shapes: a step of gpt2-350m takes a minute under the sanitizers, and what the train
  // run adds to check's here (its setup) is the same code on these shapes as on the small ones.
  if (load_config(cfg).model.n_embd >= 768)
    GTEST_SKIP() << "gpt2-124m's shapes and larger: train runs in the release pass only";
#endif
  const test::RunResult t = run_headroom("train -q " + cfg + " --set train.steps=1");
  expect_agree(cfg, {c.exit_code, t.exit_code, c.output, t.output});
}

INSTANTIATE_TEST_SUITE_P(CheckAgreesWithTrain, EveryExample, ::testing::ValuesIn(example_configs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param.substr(0, info.param.size() - 5);
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

TEST(CheckAgreesWithTrain, ThereAreExampleConfigs) {
  EXPECT_GE(example_configs().size(), 4u);
}

TEST(CheckAgreesWithTrain, EdgeConfigsAreRefusedByBoth) {
  const std::string dir = test::temp_dir();
  const std::string model =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 256\n"
      "[train]\nmicro_batch = 2\n";
  write_file(dir, "small.txt", "too short");
  std::string text;
  for (int i = 0; i < 20; ++i)
    text += "enough text for a micro-batch of two sequences of sixteen bytes. ";
  write_file(dir, "corpus.txt", text);
  // Weights of another model (n_embd 32) for init_from.
  const std::string other =
      write_file(dir, "other.toml",
                 "[model]\nn_layer = 1\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n"
                 "[train]\nsteps = 1\nmicro_batch = 1\n");
  const test::RunResult w = run_headroom("train -q " + other + " --save-weights " + dir + "/o.st");
  ASSERT_EQ(w.exit_code, 0) << w.output;
  const struct {
    const char* name;
    std::string toml;
    const char* says;  // what check's message names
  } cases[] = {
      {"missing_text", model + "[data]\nkind = \"text\"\npath = \"none.txt\"\n", "none.txt"},
      {"short_text", model + "[data]\nkind = \"text\"\npath = \"small.txt\"\n",
       "fewer than one micro-batch needs"},
      {"no_shards", model + "[data]\nkind = \"shards\"\npattern = \"none/*.bin\"\n",
       "matches no files"},
      {"missing_init_from",
       model + "init_from = \"none.safetensors\"\n[data]\nkind = \"text\"\npath = \"corpus.txt\"\n",
       "train.init_from"},
      {"init_from_other_shape",
       model + "init_from = \"o.st\"\n[data]\nkind = \"text\"\npath = \"corpus.txt\"\n",
       "does not have the shape"},
      // What the plugins choose together: the parameter shards on the host without zero3, amp's
      // no-masters layout sharded.
      {"parameters_without_zero3",
       model + "[data]\nkind = \"text\"\npath = \"corpus.txt\"\n[[plugins]]\nname = "
               "\"offload\"\nparameters = \"host\"\n",
       "list zero3 in [[plugins]]"},
      {"amp_no_masters_sharded",
       model + "[data]\nkind = \"text\"\npath = \"corpus.txt\"\n[[plugins]]\nname = "
               "\"amp\"\nmaster_weights = false\n[[plugins]]\nname = \"zero1\"\n",
       "runs on one rank without a zero plugin so far"},
  };
  for (const auto& c : cases) {
    const std::string cfg = write_file(dir, std::string(c.name) + ".toml", c.toml);
    const Outcome o = both(cfg);
    expect_agree(cfg, o);
    EXPECT_EQ(o.check, 2) << c.name << "\n" << o.check_out;
    EXPECT_TRUE(contains(o.check_out, c.says)) << c.name << "\n" << o.check_out;
  }
  // And a good one: both start.
  const std::string good =
      write_file(dir, "good.toml", model + "[data]\nkind = \"text\"\npath = \"corpus.txt\"\n");
  const Outcome o = both(good);
  EXPECT_EQ(o.check, 0) << o.check_out;
  EXPECT_EQ(o.train, 0) << o.train_out;
}

// The device: a CUDA config on a machine (or build) without one is refused by both.
TEST(CheckAgreesWithTrain, CudaConfigWithoutAGpu) {
  const std::string dir = test::temp_dir();
  const std::string cfg =
      write_file(dir, "cuda.toml",
                 "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 64\n"
                 "[device]\nkind = \"cuda\"\n");
  const Outcome o = both(cfg);
  if (o.train == 0) GTEST_SKIP() << "this machine has a GPU and a CUDA build: both ran";
  expect_agree(cfg, o);
}

}  // namespace
}  // namespace headroom
