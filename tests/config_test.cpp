// The strict TOML config: every kind of bad input names its position and what would be valid.
#include "core/config/config.h"
#include "core/device/device.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace headroom {
namespace {

namespace fs = std::filesystem;

std::string parse_error(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return test::error_of([&] { parse_config(text, "demo.toml", overrides); });
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

// A unique temporary directory per test.
class ConfigFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "headroom_config_test_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  fs::path dir_;
};

// ---------------------------------------------------------------------------------------------
// Unknown keys and sections

TEST_F(ConfigFileTest, UnknownKeyInModel) {
  const std::string f = write("m.toml", "[model]\npreset = \"tiny\"\nlayers = 3\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":3:1: ")) << e;
  EXPECT_HAS(e, "'layers'");
  EXPECT_HAS(e, "[model]");
  EXPECT_HAS(e, "preset, n_layer, n_head, n_embd, seq_len, vocab_size");
}

TEST_F(ConfigFileTest, UnknownKeyInTrain) {
  const std::string f = write("t.toml", "[train]\nsteps = 3\n  learning_rate = 0.1\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":3:3: ")) << e;
  EXPECT_HAS(e, "'learning_rate'");
  EXPECT_HAS(e, "[train]");
  EXPECT_HAS(e, "steps, micro_batch, grad_accum, optimizer, lr, min_lr");
  EXPECT_HAS(e, "log_every");
}

TEST_F(ConfigFileTest, UnknownKeyInData) {
  const std::string f = write("d.toml", "[data]\nkind = \"synthetic\"\nfile = \"x.txt\"\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":3:1: ")) << e;
  EXPECT_HAS(e, "'file'");
  EXPECT_HAS(e, "[data]");
  EXPECT_HAS(e, "kind, path, pattern, seed, branching, shuffle, workers, prefetch");
}

TEST_F(ConfigFileTest, UnknownKeyInDevice) {
  const std::string f = write("v.toml", "[device]\n\nkind = \"cpu\"\ngpus = 2\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":4:1: ")) << e;
  EXPECT_HAS(e, "'gpus'");
  EXPECT_HAS(e, "[device]");
  EXPECT_HAS(e, "kind, index, memory_limit");
}

// Every section, [snapshot] included, and [[plugins]] said to be an array of tables.
const char* kSectionList =
    "[model], [train], [data], [device], [host], [snapshot], [distributed], [[plugins]] (an array "
    "of "
    "tables, one "
    "[[plugins]] entry per plugin)";

TEST_F(ConfigFileTest, UnknownSection) {
  const std::string f = write("s.toml", "[train]\nsteps = 3\n\n[optim]\nlr = 1\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_EQ(e, f + ":4:2: unknown section 'optim'; valid sections: " + kSectionList);
  // An array of tables is a section too.
  EXPECT_EQ(parse_error("[[optim]]\nlr = 1\n"),
            std::string("demo.toml:1:3: unknown section 'optim'; valid sections: ") + kSectionList);
}

// A key before any section header is not a section: say so, and where such a key goes.
TEST(Config, TopLevelKeySuggestsItsSection) {
  EXPECT_EQ(parse_error("steps = 3\n"),
            "demo.toml:1:1: 'steps' is a key outside any section; steps is a key of [train]: put "
            "it under [train]");
  // Also when the section follows: the key still belongs to no section.
  EXPECT_EQ(parse_error("\nkeep = 3\n[train]\nsteps = 2\n"),
            "demo.toml:2:1: 'keep' is a key outside any section; keep is a key of [snapshot]: put "
            "it under [snapshot]");
  EXPECT_EQ(parse_error("seed = 3\n"),
            "demo.toml:1:1: 'seed' is a key outside any section; seed is a key of [train] and "
            "[data]: put it under one of them");
  EXPECT_EQ(parse_error("name = \"amp\"\n"),
            "demo.toml:1:1: 'name' is a key outside any section; name is a key of [[plugins]]: put "
            "it under a [[plugins]] entry");
}

TEST(Config, TopLevelKeyOfNoSection) {
  EXPECT_EQ(parse_error("stepz = 3\n"),
            std::string("demo.toml:1:1: 'stepz' is a key outside any section; no section has a "
                        "key 'stepz'; every key goes under a section header: ") +
                kSectionList);
}

TEST(Config, SectionThatIsNotATable) {
  const std::string e = parse_error("train = 3\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:1:9: ")) << e;
  EXPECT_HAS(e, "must be a table");
}

// ---------------------------------------------------------------------------------------------
// Types and ranges

TEST_F(ConfigFileTest, WrongType) {
  const std::string f = write("w.toml", "[train]\nlr = 0.1\nsteps = \"100\"\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":3:9: ")) << e;
  EXPECT_HAS(e, "train.steps");
  EXPECT_HAS(e, "expected an integer, got string");
}

TEST(Config, WrongTypeForFloatAndString) {
  std::string e = parse_error("[train]\nlr = \"fast\"\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:2:6: ")) << e;
  EXPECT_HAS(e, "train.lr: expected a number, got string");
  e = parse_error("[train]\noptimizer = 1\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:2:13: ")) << e;
  EXPECT_HAS(e, "train.optimizer: expected a string, got integer");
  e = parse_error("[device]\nmemory_limit = true\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:2:16: ")) << e;
  EXPECT_HAS(e, "got boolean");
  EXPECT_HAS(e, "\"64MiB\"");
  EXPECT_HAS(e, "\"none\"");
}

TEST(Config, IntegerAcceptedForFloatKeys) {
  const Config c = parse_config("[train]\nlr = 1\ngrad_clip = 0\n", "demo.toml");
  EXPECT_EQ(c.train.lr, 1.0);
  EXPECT_EQ(c.train.grad_clip, 0.0);
}

TEST_F(ConfigFileTest, OutOfRange) {
  const std::string f = write("r.toml", "[train]\nsteps = 0\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":2:9: ")) << e;
  EXPECT_HAS(e, "train.steps must be >= 1");
}

TEST(Config, OutOfRangeValues) {
  struct Case {
    std::string text, pos, want;
  };
  const std::vector<Case> cases = {
      {"[train]\nmicro_batch = -2\n", "demo.toml:2:15: ", "train.micro_batch must be >= 1"},
      {"[train]\ngrad_accum = 0\n", "demo.toml:2:14: ", "must be >= 1"},
      {"[train]\nlr = 0\n", "demo.toml:2:6: ", "train.lr must be a finite number > 0"},
      {"[train]\nlr = -0.5\n", "demo.toml:2:6: ", "> 0"},
      {"[train]\nlr = inf\n", "demo.toml:2:6: ", "finite"},
      {"[train]\nbeta1 = 1.0\n",
       "demo.toml:2:9: ", "train.beta1 must be a finite number >= 0.0 and < 1.0"},
      {"[train]\nbeta2 = -0.1\n", "demo.toml:2:9: ", ">= 0.0 and < 1.0"},
      {"[train]\nmomentum = 1\n", "demo.toml:2:12: ", ">= 0.0 and < 1.0"},
      {"[train]\neps = 0.0\n", "demo.toml:2:7: ", "> 0"},
      {"[train]\nweight_decay = -1\n", "demo.toml:2:16: ", ">= 0"},
      {"[train]\ngrad_clip = -1.0\n", "demo.toml:2:13: ", ">= 0"},
      {"[train]\nwarmup_steps = -1\n", "demo.toml:2:16: ", "must be >= 0"},
      {"[train]\nseed = -1\n", "demo.toml:2:8: ", "train.seed must be >= 0"},
      {"[train]\nlog_every = 0\n", "demo.toml:2:13: ", "train.log_every must be >= 1"},
      {"[train]\nlr = 0.001\nmin_lr = 0.01\n", "demo.toml:3:10: ", "must be <= train.lr"},
      {"[train]\noptimizer = \"adam\"\n",
       "demo.toml:2:13: ", "train.optimizer must be one of \"adamw\", \"sgd\""},
      {"[train]\nlr_schedule = \"step\"\n",
       "demo.toml:2:15: ", "must be one of \"cosine\", \"linear\", \"constant\""},
      {"[data]\nbranching = 65\n", "demo.toml:2:13: ", "data.branching must be <= 64"},
      {"[data]\nbranching = 0\n", "demo.toml:2:13: ", "data.branching must be >= 1"},
      {"[data]\nkind = \"images\"\n", "demo.toml:2:8: ", "\"synthetic\", \"text\""},
      {"[data]\nseed = -3\n", "demo.toml:2:8: ", "must be >= 0"},
      {"[device]\nindex = -1\n", "demo.toml:2:9: ", "device.index must be >= 0"},
      {"[device]\nkind = \"tpu\"\n", "demo.toml:2:8: ", "must be \"cpu\" or \"cuda\""},
      {"[device]\nmemory_limit = -5\n", "demo.toml:2:16: ", "must be >= 0 bytes"},
      {"[model]\npreset = \"gpt3\"\n",
       "demo.toml:2:10: ", "\"tiny\", \"gpt2-124m\", \"gpt2-350m\", \"gpt2-774m\", \"gpt2-1558m\""},
      {"[model]\npreset = \"tiny\"\nn_layer = 0\n",
       "demo.toml:3:11: ", "model.n_layer must be >= 1"},
      {"[model]\npreset = \"tiny\"\nseq_len = 2000000\n",
       "demo.toml:3:11: ", "model.seq_len must be <= 1048576"},
      {"[model]\npreset = \"tiny\"\nvocab_size = 20000000\n",
       "demo.toml:3:14: ", "model.vocab_size must be <= 16777216"},
      {"[model]\npreset = \"tiny\"\nvocab_size = 0\n",
       "demo.toml:3:14: ", "model.vocab_size must be >= 2"},
      {"[train]\nmicro_batch = 3000000000\n",
       "demo.toml:2:15: ", "train.micro_batch must be <= 2147483647, got 3000000000"},
      {"[device]\nmemory_limit = \"-1\"\n", "demo.toml:2:16: ", "bad size '-1'"},
  };
  for (const auto& c : cases) {
    const std::string e = parse_error(c.text);
    EXPECT_TRUE(test::starts_with(e, c.pos)) << c.text << " -> " << e;
    EXPECT_HAS(e, c.want);
  }
}

// A language model predicts one of its tokens: one token leaves nothing to predict.
TEST(Config, VocabSizeNeedsTwoTokens) {
  EXPECT_EQ(parse_error("[model]\npreset = \"tiny\"\nvocab_size = 1\n"),
            "demo.toml:3:14: model.vocab_size must be >= 2 (the number of tokens, from 2 to "
            "16777216), got 1");
  EXPECT_EQ(parse_error("", {"model.vocab_size=1"}),
            "--set model.vocab_size=1: model.vocab_size must be >= 2 (the number of tokens, from 2 "
            "to 16777216), got 1");
  EXPECT_EQ(parse_config("[model]\npreset = \"tiny\"\nvocab_size = 2\n", "d").model.vocab_size, 2);
}

// An integer TOML cannot hold is a syntax error at its position, not a wrapped-around value.
TEST(Config, IntegerBeyondInt64) {
  const std::string e = parse_error("[train]\nsteps = 99999999999999999999\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:2:")) << e;
  EXPECT_HAS(e, "TOML syntax error");
}

// kind = "cuda" is valid config; where the build has no CUDA backend or the machine no GPU,
// making the device fails naming the line that asked for it.
TEST(Config, CudaWithoutAGpuNamesTheLine) {
  const Config c = parse_config("[device]\nkind = \"cuda\"\n", "demo.toml");
  EXPECT_EQ(c.device.kind, "cuda");
  std::string e;
  try {
    Device::create(c.device);
    GTEST_SKIP() << "this machine has a GPU and a CUDA build: the device was made";
  } catch (const ConfigError& err) {
    e = err.what();
  }
  EXPECT_TRUE(test::starts_with(e, "demo.toml:2:8: ")) << e;
  EXPECT_HAS(e, "cuda");
}

// ---------------------------------------------------------------------------------------------
// Sizes

TEST_F(ConfigFileTest, BadSizeStrings) {
  for (const std::string bad : {"64MB", "64 mib", "-1MiB", "", "MiB", "1.5", "1..5GiB", "12 34B",
                                "99999999999GiB", "0x10"}) {
    const std::string f = write("size.toml", "[device]\nmemory_limit = \"" + bad + "\"\n");
    const std::string e = test::error_of([&] { load_config(f); });
    EXPECT_TRUE(test::starts_with(e, f + ":2:16: ")) << bad << " -> " << e;
    EXPECT_HAS(e, "bad size '" + bad + "'");
    EXPECT_HAS(e, "B, KiB, MiB or GiB");
    EXPECT_HAS(e, "\"none\"");
  }
}

TEST(Config, ParseSizeErrors) {
  for (const std::string bad : {"64MB", "-1", "", "   ", "1.5", ".5GiB", "1.GiB", "+5B", "5 KB",
                                "18446744073709551616", "17179869184GiB", "1e3B"}) {
    const std::string e = test::error_of([&] { parse_size(bad, "here"); });
    EXPECT_TRUE(test::starts_with(e, "here: bad size '" + bad + "'")) << e;
    EXPECT_HAS(e, "expected a number followed by B, KiB, MiB or GiB, e.g. \"64MiB\"");
  }
}

TEST(Config, ParseSize) {
  EXPECT_EQ(parse_size("1024", "x"), 1024u);
  EXPECT_EQ(parse_size("0", "x"), 0u);
  EXPECT_EQ(parse_size("512B", "x"), 512u);
  EXPECT_EQ(parse_size("1KiB", "x"), 1024u);
  EXPECT_EQ(parse_size("64MiB", "x"), 64u << 20);
  EXPECT_EQ(parse_size("64 MiB", "x"), 64u << 20);
  EXPECT_EQ(parse_size(" 2GiB ", "x"), uint64_t{2} << 30);
  EXPECT_EQ(parse_size("1.5GiB", "x"), uint64_t{3} << 29);
  EXPECT_EQ(parse_size("0.5KiB", "x"), 512u);
  EXPECT_EQ(parse_size("1.0001KiB", "x"), 1024u);  // 1024.1024 rounds down
  EXPECT_EQ(parse_size("2.9B", "x"), 2u);
  EXPECT_EQ(parse_size("0.000000000931322574615478515625GiB", "x"), 1u);  // exactly 2^-30 GiB
  EXPECT_EQ(parse_size("18446744073709551615", "x"), UINT64_MAX);
  EXPECT_EQ(parse_size("17179869183GiB", "x"), uint64_t{17179869183} << 30);
}

TEST(Config, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(64u << 20), "64.00 MiB");
  EXPECT_EQ(format_bytes(uint64_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(format_bytes(uint64_t{100} << 30), "100.00 GiB");
}

TEST(Config, MemoryLimitForms) {
  EXPECT_EQ(parse_config("[device]\nmemory_limit = \"64MiB\"\n", "d").device.memory_limit,
            64u << 20);
  EXPECT_EQ(parse_config("[device]\nmemory_limit = 4096\n", "d").device.memory_limit, 4096u);
  EXPECT_EQ(parse_config("[device]\nmemory_limit = \"none\"\n", "d").device.memory_limit, 0u);
  EXPECT_EQ(parse_config("[device]\nmemory_limit = \"1.5 GiB\"\n", "d").device.memory_limit,
            uint64_t{3} << 29);
}

// [distributed]: bucket_size a size > 0, timeout_s > 0; unknown keys named with file:line.
TEST(Config, Distributed) {
  const Config d = parse_config("", "d");
  EXPECT_EQ(d.distributed.bucket_size, 25u << 20);
  EXPECT_EQ(d.distributed.timeout_s, 60.0);
  const Config c = parse_config("[distributed]\nbucket_size = \"4KiB\"\ntimeout_s = 2.5\n", "d");
  EXPECT_EQ(c.distributed.bucket_size, 4096u);
  EXPECT_EQ(c.distributed.timeout_s, 2.5);
  EXPECT_EQ(parse_config("", "d", {"distributed.bucket_size=\"100B\""}).distributed.bucket_size,
            100u);
  EXPECT_EQ(parse_error("[distributed]\nbucket_size = \"0MiB\"\n"),
            "demo.toml:2:15: distributed.bucket_size must be > 0 bytes, got \"0MiB\"");
  EXPECT_HAS(parse_error("[distributed]\nbucket_size = 25\n"),
             "demo.toml:2:15: distributed.bucket_size: expected a size string like \"25MiB\"");
  EXPECT_HAS(parse_error("[distributed]\nbucket_size = \"25 MB\"\n"),
             "demo.toml:2:15: distributed.bucket_size: bad size '25 MB'");
  EXPECT_HAS(parse_error("[distributed]\ntimeout_s = 0\n"),
             "demo.toml:2:13: distributed.timeout_s must be a finite number > 0.0, got 0.0");
  EXPECT_EQ(parse_error("[distributed]\nbuckets = 3\n"),
            "demo.toml:2:1: unknown key 'buckets' in [distributed]; valid keys: bucket_size, "
            "timeout_s, overlap");
  EXPECT_TRUE(d.distributed.overlap);
  EXPECT_FALSE(parse_config("[distributed]\noverlap = false\n", "d").distributed.overlap);
  EXPECT_HAS(parse_error("[distributed]\noverlap = 1\n"), "distributed.overlap");
}

// Whether [device] index was written: a GPU rank picks its device by local rank unless it was.
TEST(Config, DeviceIndexSet) {
  EXPECT_FALSE(parse_config("", "d").device.index_set);
  EXPECT_FALSE(parse_config("[device]\nkind = \"cpu\"\n", "d").device.index_set);
  EXPECT_TRUE(parse_config("[device]\nindex = 0\n", "d").device.index_set);
  EXPECT_TRUE(parse_config("", "d", {"device.index=0"}).device.index_set);
}

// ---------------------------------------------------------------------------------------------
// Model shape

TEST_F(ConfigFileTest, NEmbdNotDivisibleByNHead) {
  const std::string f = write("shape.toml",
                              "[model]\nn_layer = 2\nn_head = 3\nn_embd = 64\nseq_len = 32\n"
                              "vocab_size = 256\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":4:10: ")) << e;
  EXPECT_HAS(e, "model.n_embd (64)");
  EXPECT_HAS(e, "model.n_head (3)");
  EXPECT_HAS(e, "divisible");
  EXPECT_HAS(e, "n_embd = 63");
  EXPECT_HAS(e, "n_embd = 66");
}

TEST(Config, NEmbdNotDivisibleAfterPresetOverride) {
  const std::string e = parse_error("[model]\npreset = \"gpt2-124m\"\nn_head = 7\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:3:10: ")) << e;
  EXPECT_HAS(e, "model.n_embd (768)");
  EXPECT_HAS(e, "model.n_head (7)");

  const std::string small = parse_error("[model]\npreset = \"tiny\"\nn_embd = 2\n");
  EXPECT_TRUE(test::starts_with(small, "demo.toml:3:10: ")) << small;
  EXPECT_HAS(small, "e.g. n_embd = 4");
}

TEST_F(ConfigFileTest, MissingShapeKeysWithoutPreset) {
  const std::string f = write("noshape.toml", "[model]\nn_layer = 2\nn_embd = 64\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":1:1: ")) << e;
  EXPECT_HAS(e, "missing: n_head, seq_len, vocab_size");
  EXPECT_HAS(e, "preset");
  EXPECT_HAS(e, "\"gpt2-124m\"");
}

TEST(Config, ExplicitShapeWithoutPreset) {
  const Config c = parse_config(
      "[model]\nn_layer = 3\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 100\n", "d");
  EXPECT_EQ(c.model.preset, "");
  EXPECT_EQ(c.model.n_layer, 3);
  EXPECT_EQ(c.model.n_head, 2);
  EXPECT_EQ(c.model.n_embd, 32);
  EXPECT_EQ(c.model.seq_len, 16);
  EXPECT_EQ(c.model.vocab_size, 100);
}

TEST(Config, PresetPlusOverride) {
  const Config c = parse_config("[model]\npreset = \"gpt2-124m\"\nseq_len = 256\n", "d");
  EXPECT_EQ(c.model.preset, "gpt2-124m");
  EXPECT_EQ(c.model.n_layer, 12);
  EXPECT_EQ(c.model.n_head, 12);
  EXPECT_EQ(c.model.n_embd, 768);
  EXPECT_EQ(c.model.seq_len, 256);
  EXPECT_EQ(c.model.vocab_size, 50257);

  const Config s = parse_config("[model]\npreset = \"gpt2-350m\"\n", "d", {"model.n_layer=4"});
  EXPECT_EQ(s.model.preset, "gpt2-350m");
  EXPECT_EQ(s.model.n_layer, 4);
  EXPECT_EQ(s.model.n_head, 16);
  EXPECT_EQ(s.model.n_embd, 1024);
}

TEST(Config, Presets) {
  std::vector<std::string> want = {"tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1558m"};
  const std::vector<std::string> llama = {"smollm2-135m", "tinyllama-1.1b", "llama-3.2-1b",
                                          "llama-3.1-8b"};  // tests/llama_model_test.cpp
  std::vector<std::string> all = want;
  all.insert(all.end(), llama.begin(), llama.end());
  EXPECT_EQ(model_presets(), all);
  struct Shape {
    int l, h, e, s, v;
  };
  const Shape shapes[] = {{2, 4, 64, 64, 256},
                          {12, 12, 768, 1024, 50257},
                          {24, 16, 1024, 1024, 50257},
                          {36, 20, 1280, 1024, 50257},
                          {48, 25, 1600, 1024, 50257}};
  for (size_t i = 0; i < want.size(); ++i) {
    const Config c = parse_config("[model]\npreset = \"" + want[i] + "\"\n", "d");
    EXPECT_EQ(c.model.preset, want[i]);
    EXPECT_EQ(c.model.n_layer, shapes[i].l) << want[i];
    EXPECT_EQ(c.model.n_head, shapes[i].h) << want[i];
    EXPECT_EQ(c.model.n_embd, shapes[i].e) << want[i];
    EXPECT_EQ(c.model.seq_len, shapes[i].s) << want[i];
    EXPECT_EQ(c.model.vocab_size, shapes[i].v) << want[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Data

TEST_F(ConfigFileTest, TextWithoutPath) {
  const std::string f = write("text.toml", "[data]\nkind = \"text\"\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":2:8: ")) << e;
  EXPECT_HAS(e, "needs data.path");
}

TEST(Config, SyntheticWithPath) {
  const std::string e = parse_error("[data]\nkind = \"synthetic\"\npath = \"a.txt\"\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:3:8: ")) << e;
  EXPECT_HAS(e, "only used with data.kind = \"text\"");
}

// Text data is bytes, tokens 0..255: a smaller vocabulary is refused when the config is read
// (check and plan too), at the line of vocab_size.
TEST(Config, TextDataNeedsAByteVocabulary) {
  const std::string shape =
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 100\n";
  const std::string text = "[data]\nkind = \"text\"\npath = \"corpus.txt\"\n";
  EXPECT_EQ(parse_error(shape + text),
            "demo.toml:6:14: model.vocab_size is 100, but data.kind = \"text\" (demo.toml:8:8) "
            "trains on bytes, tokens 0..255: model.vocab_size must be >= 256");
  EXPECT_EQ(parse_error(text, {"model.vocab_size=255"}),
            "--set model.vocab_size=255: model.vocab_size is 255, but data.kind = \"text\" "
            "(demo.toml:2:8) trains on bytes, tokens 0..255: model.vocab_size must be >= 256");
  EXPECT_EQ(parse_error(shape, {"data.kind=text", "data.path=c.txt"}),
            "demo.toml:6:14: model.vocab_size is 100, but data.kind = \"text\" "
            "(--set data.kind=text) trains on bytes, tokens 0..255: model.vocab_size must be >= "
            "256");
  EXPECT_EQ(parse_config(text, "demo.toml", {"model.vocab_size=256"}).model.vocab_size, 256);
  // Synthetic data and shards are not bytes.
  EXPECT_EQ(parse_config(shape, "demo.toml").model.vocab_size, 100);
  EXPECT_EQ(parse_config(shape + "[data]\nkind = \"shards\"\npattern = \"*.bin\"\n", "demo.toml")
                .model.vocab_size,
            100);
}

TEST_F(ConfigFileTest, TextPathResolvedAgainstConfigDir) {
  const std::string f = write("text.toml", "[data]\nkind = \"text\"\npath = \"corpus.txt\"\n");
  const Config c = load_config(f);
  EXPECT_EQ(fs::path(c.data.path), dir_ / "corpus.txt");  // not checked for existence
  const Config a = parse_config("[data]\nkind = \"text\"\npath = \"/abs/c.txt\"\n", f);
  EXPECT_EQ(a.data.path, "/abs/c.txt");
}

// ---------------------------------------------------------------------------------------------
// Plugins

TEST_F(ConfigFileTest, DuplicatePluginNames) {
  const std::string f = write("dup.toml",
                              "[[plugins]]\nname = \"amp\"\n\n[[plugins]]\nname = \"zero\"\n\n"
                              "[[plugins]]\nname = \"amp\"\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":7:1: ")) << e;
  EXPECT_HAS(e, "'amp'");
  EXPECT_HAS(e, "first at " + f + ":1:1");
}

TEST_F(ConfigFileTest, PluginWithoutName) {
  const std::string f = write("noname.toml", "[[plugins]]\nname = \"amp\"\n[[plugins]]\nx = 1\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":3:1: ")) << e;
  EXPECT_HAS(e, "no name");
  EXPECT_HAS(e, "name = \"...\"");
}

TEST(Config, PluginBadName) {
  for (const std::string bad : {"\"\"", "\"Amp\"", "\"my-plugin\"", "\"a b\""}) {
    const std::string e = parse_error("[[plugins]]\nname = " + bad + "\n");
    EXPECT_TRUE(test::starts_with(e, "demo.toml:2:8: ")) << e;
    EXPECT_HAS(e, "[a-z0-9_]+");
  }
  const std::string e = parse_error("[[plugins]]\nname = 3\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:2:8: ")) << e;
  EXPECT_HAS(e, "expected a string, got integer");
}

TEST(Config, PluginsNotAnArrayOfTables) {
  const std::string e = parse_error("[plugins]\nname = \"amp\"\n");
  EXPECT_HAS(e, "demo.toml:1:1: ");
  EXPECT_HAS(e, "[[plugins]]");
}

TEST_F(ConfigFileTest, PluginsKeepOwnKeysAndOrder) {
  const std::string f =
      write("plugins.toml",
            "[[plugins]]\nname = \"amp\"\nloss_scale = 1024.5\nmode = \"bf16\"\n\n"
            "[[plugins]]\nname = \"offload\"\npath = \"lib/off.so\"\n\n"
            "[[plugins]]\nname = \"checkpoint\"\nlayers = [1, 2]\n"
            "[plugins.extra]\nk = true\n");
  const Config c = load_config(f);
  ASSERT_EQ(c.plugins.size(), 3u);
  EXPECT_EQ(c.plugins[0].name, "amp");
  EXPECT_EQ(c.plugins[0].path, "");
  EXPECT_EQ(c.plugins[0].pos.str(), f + ":1:1");
  EXPECT_HAS(c.plugins[0].toml, "loss_scale = 1024.5");
  EXPECT_HAS(c.plugins[0].toml, "mode = ");
  EXPECT_HAS(c.plugins[0].toml, "bf16");
  EXPECT_EQ(c.plugins[0].toml.find("name"), std::string::npos);
  EXPECT_EQ(c.plugins[1].name, "offload");
  EXPECT_EQ(fs::path(c.plugins[1].path), dir_ / "lib/off.so");
  EXPECT_EQ(c.plugins[1].toml, "");
  EXPECT_EQ(c.plugins[1].pos.line, 6);
  EXPECT_EQ(c.plugins[2].name, "checkpoint");
  EXPECT_HAS(c.plugins[2].toml, "layers = [ 1, 2 ]");
  EXPECT_HAS(c.plugins[2].toml, "[extra]");
  EXPECT_HAS(c.plugins[2].toml, "k = true");
}

// ---------------------------------------------------------------------------------------------
// Files and syntax

TEST_F(ConfigFileTest, MissingConfigFile) {
  const std::string f = (dir_ / "nope.toml").string();
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_EQ(e, "cannot read config file '" + f + "': No such file or directory");
}

TEST_F(ConfigFileTest, ConfigFileIsADirectory) {
  const std::string e = test::error_of([&] { load_config(dir_.string()); });
  EXPECT_TRUE(test::starts_with(e, "cannot read config file '" + dir_.string() + "': ")) << e;
}

TEST_F(ConfigFileTest, TomlSyntaxError) {
  const std::string f = write("syntax.toml", "[train]\nsteps = 3\nlr = = 0.1\n");
  const std::string e = test::error_of([&] { load_config(f); });
  EXPECT_TRUE(test::starts_with(e, f + ":3:")) << e;
  EXPECT_HAS(e, "TOML syntax error");
}

TEST(Config, TomlSyntaxErrorDuplicateKey) {
  const std::string e = parse_error("[train]\nsteps = 3\nsteps = 4\n");
  EXPECT_TRUE(test::starts_with(e, "demo.toml:3:")) << e;
  EXPECT_HAS(e, "TOML syntax error");
}

// ---------------------------------------------------------------------------------------------
// Overrides

TEST(Config, BadSetForms) {
  for (const std::string bad :
       {"train.steps", "=3", "steps=3", ".steps=3", "train.=3", "train.a.b=3", "train..x=3"}) {
    const std::string e = parse_error("", {bad});
    EXPECT_TRUE(test::starts_with(e, "--set " + bad + ": ")) << e;
    EXPECT_HAS(e, "--set section.key=value");
    EXPECT_HAS(e, "--set plugins.NAME.key=value");
  }
  // The same list of sections as for the file, with how a [[plugins]] entry is named.
  EXPECT_EQ(parse_error("", {"optim.lr=1"}),
            std::string("--set optim.lr=1: unknown section 'optim'; valid sections: ") +
                kSectionList + "; a [[plugins]] entry is set as plugins.NAME.key");
}

TEST(Config, SetIntoSnapshot) {
  const Config c = parse_config("", "demo.toml", {"snapshot.keep=5"});
  EXPECT_EQ(c.snapshot.keep, 5);
  EXPECT_EQ(parse_error("", {"snapshot.kept=5"}),
            "--set snapshot.kept=5: unknown key 'kept' in [snapshot]; valid keys: every, dir, "
            "keep, save_weights");
}

// ---------------------------------------------------------------------------------------------
// Overrides into [[plugins]]: plugins.NAME.key sets a key of the entry named NAME

const char* kTwoPlugins =
    "[[plugins]]\nname = \"amp\"\nloss_scale = 1024\n\n"
    "[[plugins]]\nname = \"offload\"\npath = \"lib/off.so\"\n";

TEST(Config, SetPluginKey) {
  const Config c = parse_config(
      kTwoPlugins, "/cfg/demo.toml",
      {"plugins.amp.loss_scale=2048", "plugins.amp.mode=bf16", "plugins.offload.layers=[1, 2]"});
  ASSERT_EQ(c.plugins.size(), 2u);
  const PluginEntry& amp = c.plugins[0];
  EXPECT_EQ(amp.name, "amp");
  EXPECT_HAS(amp.toml, "loss_scale = 2048");
  EXPECT_EQ(amp.toml.find("1024"), std::string::npos) << amp.toml;
  EXPECT_HAS(amp.toml, "mode = 'bf16'");  // a bare word is a string, as for every --set
  EXPECT_EQ(amp.key_pos.at("loss_scale").str(), "--set plugins.amp.loss_scale=2048");
  EXPECT_EQ(amp.key_pos.at("mode").str(), "--set plugins.amp.mode=bf16");
  EXPECT_EQ(amp.pos.str(), "/cfg/demo.toml:1:1");
  const PluginEntry& off = c.plugins[1];
  EXPECT_EQ(off.path, "/cfg/lib/off.so");
  EXPECT_HAS(off.toml, "layers = [ 1, 2 ]");
  EXPECT_EQ(off.key_pos.at("layers").str(), "--set plugins.offload.layers=[1, 2]");
  // Keys not overridden keep their place in the file; the later of two overrides wins.
  const Config d =
      parse_config(kTwoPlugins, "/cfg/demo.toml",
                   {"plugins.offload.x=1", "plugins.amp.loss_scale=1", "plugins.amp.loss_scale=8"});
  EXPECT_EQ(d.plugins[0].key_pos.at("loss_scale").str(), "--set plugins.amp.loss_scale=8");
  EXPECT_HAS(d.plugins[0].toml, "loss_scale = 8");
  const Config f = parse_config(kTwoPlugins, "/cfg/demo.toml");
  EXPECT_EQ(f.plugins[0].key_pos.at("loss_scale").str(), "/cfg/demo.toml:3:14");
}

TEST(Config, SetPluginKeyRoundTripsThroughFormatConfig) {
  const Config c = parse_config(kTwoPlugins, "/cfg/demo.toml", {"plugins.amp.loss_scale=0.5"});
  const Config again = parse_config(format_config(c), "/elsewhere/out.toml");
  ASSERT_EQ(again.plugins.size(), 2u);
  EXPECT_EQ(again.plugins[0].toml, c.plugins[0].toml);
  EXPECT_EQ(again.plugins[1].path, "/cfg/lib/off.so");
}

// path may be overridden (another build of the plugin); like every --set path it is taken from the
// current directory.
TEST(Config, SetPluginPath) {
  const Config c = parse_config(kTwoPlugins, "/cfg/demo.toml",
                                {"plugins.amp.path=build/amp.so", "plugins.offload.path=/x/o.so"});
  EXPECT_EQ(fs::path(c.plugins[0].path), fs::absolute("build/amp.so"));
  EXPECT_EQ(c.plugins[1].path, "/x/o.so");
  EXPECT_EQ(c.plugins[0].toml.find("path"), std::string::npos) << c.plugins[0].toml;
  EXPECT_EQ(c.plugins[0].key_pos.count("path"), 0u);
  EXPECT_EQ(c.plugins[0].path_pos.str(), "--set plugins.amp.path=build/amp.so");
  // Without an override: where path is written, or the table when it is not.
  const Config f = parse_config(kTwoPlugins, "/cfg/demo.toml");
  EXPECT_EQ(f.plugins[0].path_pos.str(), "/cfg/demo.toml:1:1");
  EXPECT_EQ(f.plugins[1].path_pos.str(), "/cfg/demo.toml:7:8");
  EXPECT_EQ(parse_error(kTwoPlugins, {"plugins.amp.path=\"\""}),
            "--set plugins.amp.path=\"\": plugins.path must name a file, got an empty string; "
            "leave it out to search the plugin path");
  EXPECT_EQ(parse_error(kTwoPlugins, {"plugins.offload.path=3"}),
            "--set plugins.offload.path=3: plugins.path: expected a string, got integer");
}

TEST(Config, SetPluginNameIsRefused) {
  EXPECT_EQ(parse_error(kTwoPlugins, {"plugins.amp.name=zero"}),
            "--set plugins.amp.name=zero: a [[plugins]] entry's name cannot be changed with --set "
            "(the name picks the entry); edit the config file, or load another file with --set "
            "plugins.amp.path=FILE");
}

TEST(Config, SetPluginThatIsNotListed) {
  EXPECT_EQ(parse_error(kTwoPlugins, {"plugins.zero.stage=2"}),
            "--set plugins.zero.stage=2: no [[plugins]] entry is named 'zero'; the config lists: "
            "amp, offload (--set can change the keys of a listed plugin, not add one)");
  EXPECT_EQ(parse_error("", {"plugins.amp.loss_scale=1"}),
            "--set plugins.amp.loss_scale=1: no [[plugins]] entry is named 'amp'; the config lists "
            "no plugins (--set can change the keys of a listed plugin, not add one)");
  // An entry without a name is the file's error, reported at its line, not hidden by the override.
  EXPECT_EQ(parse_error("[[plugins]]\nname = 1\n", {"plugins.amp.x=1"}),
            "demo.toml:2:8: plugins.name: expected a string, got integer");
  EXPECT_EQ(parse_error("[plugins]\nname = \"amp\"\n", {"plugins.amp.x=1"}),
            "--set plugins.amp.x=1: 'plugins' in the config file is not an array of [[plugins]] "
            "tables");
}

TEST(Config, BadPluginSetForms) {
  for (const std::string bad : {"plugins.name=amp", "plugins.amp.extra.k=1"}) {
    EXPECT_EQ(parse_error(kTwoPlugins, {bad}),
              "--set " + bad +
                  ": a [[plugins]] override names the entry and one of its keys: --set "
                  "plugins.NAME.key=value (NAME: the entry's name = \"...\")");
  }
  const std::string e = parse_error(kTwoPlugins, {"plugins..x=1"});
  EXPECT_TRUE(test::starts_with(e, "--set plugins..x=1: the key must be section.key")) << e;
}

TEST(Config, SetWithBadValue) {
  std::string e = parse_error("[train]\nsteps = 5\n", {"train.steps=abc"});
  EXPECT_TRUE(test::starts_with(e, "--set train.steps=abc: ")) << e;
  EXPECT_HAS(e, "expected an integer, got string");
  e = parse_error("", {"train.steps=0"});
  EXPECT_TRUE(test::starts_with(e, "--set train.steps=0: ")) << e;
  EXPECT_HAS(e, "must be >= 1");
  e = parse_error("", {"train.optimizer=adam"});
  EXPECT_TRUE(test::starts_with(e, "--set train.optimizer=adam: ")) << e;
  EXPECT_HAS(e, "\"adamw\", \"sgd\"");
  e = parse_error("", {"device.memory_limit=64MB"});
  EXPECT_TRUE(test::starts_with(e, "--set device.memory_limit=64MB: ")) << e;
  EXPECT_HAS(e, "bad size '64MB'");
  e = parse_error("", {"train.learning_rate=1"});
  EXPECT_TRUE(test::starts_with(e, "--set train.learning_rate=1: ")) << e;
  EXPECT_HAS(e, "unknown key 'learning_rate'");
  EXPECT_HAS(e, "steps, micro_batch");
}

TEST(Config, SetThatWorks) {
  const Config c =
      parse_config("[train]\nsteps = 5\n", "demo.toml",
                   {"train.steps=100", "device.memory_limit=64MiB", "train.optimizer=sgd",
                    "train.lr=0.5", "data.seed = 7", "train.lr_schedule=\"linear\""});
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_EQ(c.device.memory_limit, 64u << 20);
  EXPECT_EQ(c.train.optimizer, "sgd");
  EXPECT_EQ(c.train.lr, 0.5);
  EXPECT_EQ(c.data.seed, 7u);
  EXPECT_EQ(c.train.lr_schedule, "linear");
}

TEST(Config, SetIntoModelWithoutModelSectionKeepsTiny) {
  const Config c = parse_config("", "demo.toml", {"model.seq_len=32"});
  EXPECT_EQ(c.model.preset, "tiny");
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.seq_len, 32);
  const Config p = parse_config("", "demo.toml", {"model.preset=gpt2-124m"});
  EXPECT_EQ(p.model.preset, "gpt2-124m");
  EXPECT_EQ(p.model.n_embd, 768);
}

TEST(Config, SetDataPathIsRelativeToTheCurrentDirectory) {
  const Config c =
      parse_config("[data]\nkind = \"text\"\n", "/cfgdir/c.toml", {"data.path=corpus.txt"});
  EXPECT_EQ(fs::path(c.data.path), fs::absolute("corpus.txt"));
  const Config f =
      parse_config("[data]\nkind = \"text\"\npath = \"corpus.txt\"\n", "/cfgdir/c.toml");
  EXPECT_EQ(f.data.path, "/cfgdir/corpus.txt");
}

TEST(Config, LaterSetWins) {
  const Config c = parse_config("", "demo.toml", {"train.steps=abc", "train.steps=9"});
  EXPECT_EQ(c.train.steps, 9);
}

// ---------------------------------------------------------------------------------------------
// Defaults and format_config

TEST(Config, DefaultFilling) {
  const Config c = parse_config("", "demo.toml");
  const TrainConfig t;
  const DataConfig d;
  const DeviceConfig v;
  EXPECT_EQ(c.file, "demo.toml");
  EXPECT_EQ(c.model.preset, "tiny");
  EXPECT_EQ(c.model.n_layer, 2);
  EXPECT_EQ(c.model.n_head, 4);
  EXPECT_EQ(c.model.n_embd, 64);
  EXPECT_EQ(c.model.seq_len, 64);
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_EQ(c.train.steps, t.steps);
  EXPECT_EQ(c.train.micro_batch, t.micro_batch);
  EXPECT_EQ(c.train.optimizer, "adamw");
  EXPECT_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.train.lr_schedule, "cosine");
  EXPECT_EQ(c.train.warmup_steps, t.warmup_steps);
  EXPECT_EQ(c.data.kind, d.kind);
  EXPECT_EQ(c.data.branching, d.branching);
  EXPECT_EQ(c.device.kind, v.kind);
  EXPECT_EQ(c.device.memory_limit, 0u);
  EXPECT_TRUE(c.plugins.empty());

  const Config partial = parse_config("[train]\nsteps = 7\n", "demo.toml");
  EXPECT_EQ(partial.train.steps, 7);
  EXPECT_EQ(partial.train.beta2, t.beta2);
}

void expect_same(const Config& a, const Config& b) {
  EXPECT_EQ(a.model.preset, b.model.preset);
  EXPECT_EQ(a.model.n_layer, b.model.n_layer);
  EXPECT_EQ(a.model.n_head, b.model.n_head);
  EXPECT_EQ(a.model.n_embd, b.model.n_embd);
  EXPECT_EQ(a.model.seq_len, b.model.seq_len);
  EXPECT_EQ(a.model.vocab_size, b.model.vocab_size);
  EXPECT_EQ(a.train.steps, b.train.steps);
  EXPECT_EQ(a.train.micro_batch, b.train.micro_batch);
  EXPECT_EQ(a.train.grad_accum, b.train.grad_accum);
  EXPECT_EQ(a.train.optimizer, b.train.optimizer);
  EXPECT_EQ(a.train.lr, b.train.lr);
  EXPECT_EQ(a.train.min_lr, b.train.min_lr);
  EXPECT_EQ(a.train.weight_decay, b.train.weight_decay);
  EXPECT_EQ(a.train.beta1, b.train.beta1);
  EXPECT_EQ(a.train.beta2, b.train.beta2);
  EXPECT_EQ(a.train.eps, b.train.eps);
  EXPECT_EQ(a.train.momentum, b.train.momentum);
  EXPECT_EQ(a.train.warmup_steps, b.train.warmup_steps);
  EXPECT_EQ(a.train.lr_schedule, b.train.lr_schedule);
  EXPECT_EQ(a.train.grad_clip, b.train.grad_clip);
  EXPECT_EQ(a.train.seed, b.train.seed);
  EXPECT_EQ(a.train.log_every, b.train.log_every);
  EXPECT_EQ(a.data.kind, b.data.kind);
  EXPECT_EQ(a.data.path, b.data.path);
  EXPECT_EQ(a.data.seed, b.data.seed);
  EXPECT_EQ(a.data.branching, b.data.branching);
  EXPECT_EQ(a.device.kind, b.device.kind);
  EXPECT_EQ(a.device.index, b.device.index);
  EXPECT_EQ(a.device.memory_limit, b.device.memory_limit);
  ASSERT_EQ(a.plugins.size(), b.plugins.size());
  for (size_t i = 0; i < a.plugins.size(); ++i) {
    EXPECT_EQ(a.plugins[i].name, b.plugins[i].name);
    EXPECT_EQ(a.plugins[i].path, b.plugins[i].path);
    EXPECT_EQ(a.plugins[i].toml, b.plugins[i].toml);
  }
}

TEST_F(ConfigFileTest, FormatConfigRoundTrip) {
  const std::string text =
      "[model]\npreset = \"gpt2-124m\"\nseq_len = 256\n\n"
      "[train]\nsteps = 1000\nmicro_batch = 8\ngrad_accum = 2\noptimizer = \"sgd\"\n"
      "lr = 0.0003\nmin_lr = 1e-5\nweight_decay = 0.01\nbeta1 = 0.85\nbeta2 = 0.999\n"
      "eps = 1e-10\nmomentum = 0.9\nwarmup_steps = 0\nlr_schedule = \"linear\"\ngrad_clip = 0\n"
      "seed = 1234567890123\nlog_every = 25\n\n"
      "[data]\nkind = \"text\"\npath = \"data/tiny \\\"shakespeare\\\".txt\"\nseed = 9\n"
      "branching = 64\n\n"
      "[device]\nkind = \"cpu\"\nindex = 0\nmemory_limit = \"1.5GiB\"\n\n"
      "[[plugins]]\nname = \"amp\"\nloss_scale = 0.1\nmode = 'bf16'\n\n"
      "[[plugins]]\nname = \"offload\"\npath = \"plug/off.so\"\n[plugins.nested]\nx = [1, 2]\n";
  const std::string f = write("round.toml", text);
  const Config a = load_config(f);
  const std::string out = format_config(a);
  EXPECT_HAS(out, "lr = 0.0003\n");
  EXPECT_HAS(out, "memory_limit = \"1536MiB\"\n");
  EXPECT_HAS(out, "[model]\n");
  EXPECT_HAS(out, "[train]\n");
  EXPECT_HAS(out, "[data]\n");
  EXPECT_HAS(out, "[device]\n");
  EXPECT_HAS(out, "[[plugins]]");
  const Config b = parse_config(out, (dir_ / "elsewhere" / "out.toml").string());
  expect_same(a, b);
  // And once more, to be sure the output is stable.
  EXPECT_EQ(format_config(b).substr(format_config(b).find('\n')), out.substr(out.find('\n')));

  // The defaults round-trip too, as do byte counts that are not whole KiB and an explicit shape.
  const Config d = parse_config(
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 3\n"
      "[device]\nmemory_limit = 1000\n",
      "d.toml");
  const std::string dout = format_config(d);
  EXPECT_EQ(dout.find("preset"), std::string::npos);
  EXPECT_HAS(dout, "memory_limit = 1000\n");
  expect_same(d, parse_config(dout, "d.toml"));
  const Config z = parse_config("", "z.toml");
  const std::string zout = format_config(z);
  EXPECT_HAS(zout, "memory_limit = \"none\"\n");
  EXPECT_HAS(zout, "eps = 1e-08\n");
  expect_same(z, parse_config(zout, "z.toml"));
}

TEST(Config, SourcePosStr) {
  SourcePos p;
  p.file = "a.toml";
  p.line = 3;
  p.column = 9;
  EXPECT_EQ(p.str(), "a.toml:3:9");
  SourcePos s;
  s.file = "--set train.steps=abc";
  EXPECT_EQ(s.str(), "--set train.steps=abc");
}

}  // namespace

// What the fuzzer found: values and keys that `check` could not write back as TOML.
TEST(Config, SetValuesAndKeysThatAreNotTomlAreRefused) {
  EXPECT_HAS(parse_error("", {"train.init_from=t\xe9st"}), "neither TOML nor plain text");
  EXPECT_HAS(parse_error("", {"train.init_from=a\x1e b"}), "neither TOML nor plain text");
  EXPECT_NO_THROW(parse_config("", "d.toml", {"train.init_from=caf\xc3\xa9.safetensors"}));
  EXPECT_HAS(parse_error(kTwoPlugins, {"plugins.amp.d]]\nname=1"}), "is not a key");
  EXPECT_HAS(parse_error("", {"device.memory_limit=9511862599518519294"}),
             "device.memory_limit must be at most 281474976710656 bytes");
  EXPECT_HAS(parse_error("[device]\nmemory_limit = \"1048577GiB\"\n"),
             "device.memory_limit must be at most 281474976710656 bytes");
}

}  // namespace headroom
