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

}  // namespace
}  // namespace headroom
