// The second hostile round (issues 32 and 38): input that used to be taken for something else, or
// to crash, or to lose data with exit 0. Each case ends in a message naming the file, key or flag
// and its documented exit code (README.md, "Exit codes"), with nothing written half. The cases
// across ranks are in tests/mpi/agree_test.sh; docs/results/robustness.md lists them all.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/data/bpe_tokenizer.h"
#include "core/model/generate.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::run_headroom;
using test::write_file;

const char* kText =
    "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 512\n"
    "[train]\nsteps = 2\nmicro_batch = 2\n[data]\nkind = \"text\"\npath = \"t.txt\"\n";

struct Hardening : ::testing::Test {
  std::string dir = test::temp_dir();
  std::string text_config() {
    std::string text;
    for (int i = 0; i < 500; ++i)
      text += "hello world ";
    write_file(dir, "t.txt", text);  // 6000 bytes
    return write_file(dir, "a.toml", kText);
  }
};

// --- numbers out of range and numeric flags -----------------------------------------------------

// A number TOML cannot hold was taken as a bare word ("expected a number, got string").
TEST_F(Hardening, SetOfANumberOutOfRangeNamesTheKeyAndSaysOutOfRange) {
  const std::string cfg = text_config();
  for (const std::string set : {"train.lr=1e400", "train.steps=99999999999999999999"}) {
    const auto r = run_headroom("check " + cfg + " --set " + set);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    const std::string key = set.substr(0, set.find('='));
    const std::string value = set.substr(set.find('=') + 1);
    EXPECT_TRUE(contains(r.output, "--set " + set + ": " + key + ": " + value + " is out of range"))
        << r.output;
    EXPECT_FALSE(contains(r.output, "got string")) << r.output;
  }
  // A word is still a string.
  EXPECT_TRUE(
      contains(test::error_of([] { parse_config("[train]\n", "x.toml", {"train.lr=fast"}); }),
               "expected a number, got string"));
}

// sample's flags are checked as the config's numbers are: a NaN temperature drew the least likely
// token every time.
TEST_F(Hardening, SampleRefusesANonFiniteTemperatureNamingTheFlag) {
  const std::string cfg = text_config();
  for (const std::string t : {"nan", "inf", "-1", "1e400", "2x"}) {
    const auto r = run_headroom("sample " + cfg + " --prompt hi --tokens 2 --temperature " + t);
    EXPECT_EQ(r.exit_code, 2) << t << ": " << r.output;
    EXPECT_TRUE(contains(r.output, "--temperature: ")) << r.output;
    EXPECT_TRUE(contains(r.output, "a finite number from 0 to 100")) << r.output;
  }
  const auto seed = run_headroom("sample " + cfg + " --prompt hi --tokens 2 --seed -1");
  EXPECT_EQ(seed.exit_code, 2) << seed.output;
  EXPECT_TRUE(contains(seed.output, "--seed")) << seed.output;
  const auto ok = run_headroom("sample " + cfg + " --prompt hi --tokens 2 --temperature 0.5");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  // The library refuses it too, for hosts that embed it.
  SampleParams p;
  p.temperature = NAN;
  std::mt19937_64 rng(1);
  const Config c = test::config_from(
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 16\nvocab_size = 64\n");
  std::unique_ptr<Device> device = Device::create(c.device);
  Gpt<float> model(c.model, *device, 1);
  EXPECT_THROW(generate(model, {1, 2}, 2, p), std::invalid_argument);
}

// --- validation data ----------------------------------------------------------------------------

TEST_F(Hardening, ValFractionThatLeavesTooLittleSaysWhatItLeavesAndWhichWay) {
  const std::string cfg = text_config();
  const auto big =
      run_headroom("check " + cfg + " --set data.val_fraction=0.9999 --set train.eval_every=1");
  EXPECT_EQ(big.exit_code, 2) << big.output;
  EXPECT_TRUE(contains(big.output, "data.val_fraction = 0.9999 (99.99%) of data.path"))
      << big.output;
  EXPECT_TRUE(contains(big.output, "(6000 bytes) leaves 1 byte for training")) << big.output;
  EXPECT_TRUE(contains(big.output, "choose a smaller fraction")) << big.output;
  const auto small =
      run_headroom("train -q " + cfg + " --set data.val_fraction=0.001 --set train.eval_every=1");
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_TRUE(contains(small.output, "leaves 6 bytes for validation")) << small.output;
  EXPECT_TRUE(contains(small.output, "choose a larger fraction")) << small.output;
}

// check opens what train opens before step 1: the validation file too.
TEST_F(Hardening, CheckRefusesAMissingValPathAsTrainDoes) {
  const std::string cfg = text_config();
  const std::string sets =
      " --set 'data.val_path=\"" + dir + "/none.txt\"' --set train.eval_every=1";
  const auto check = run_headroom("check " + cfg + sets);
  const auto train = run_headroom("train -q " + cfg + sets);
  EXPECT_EQ(check.exit_code, 2) << check.output;
  EXPECT_EQ(train.exit_code, 2) << train.output;
  for (const auto* r : {&check, &train})
    EXPECT_TRUE(contains(r->output, "data.val_path '" + dir + "/none.txt': cannot open"))
        << r->output;
}

}  // namespace
}  // namespace headroom
