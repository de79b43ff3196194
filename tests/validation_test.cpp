// Validation (train.eval_every with data.val_fraction / val_path / val_pattern): the held-out data
// is never trained on, the validation loss is in the metrics and on the progress line, the eval
// forward does not raise the run's peak by a byte, the best loss survives a resume, and every bad
// combination of keys is a ConfigError naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/data.h"
#include "core/data/shards.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

const char* kModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 16\nseq_len = 8\nvocab_size = 256\n";

// 900 bytes of 'a'..'m' and then 100 of 'x' / 'y': with val_fraction 0.1 the training data has
// no 'x' or 'y' and the validation data nothing else.
std::string split_text() {
  std::string s;
  for (int i = 0; i < 900; ++i)
    s += char('a' + i % 13);
  for (int i = 0; i < 100; ++i)
    s += (i % 2) ? 'x' : 'y';
  return s;
}

std::set<int32_t> tokens_read(DataSource& src, int batches, int B, int T) {
  std::vector<int32_t> in(size_t(B) * T), tg(size_t(B) * T);
  std::set<int32_t> seen;
  for (int i = 0; i < batches; ++i) {
    src.next(in.data(), tg.data(), B, T);
    seen.insert(in.begin(), in.end());
  }
  return seen;
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(in, line);)
    rows.push_back(nlohmann::json::parse(line));
  return rows;
}

TEST(Validation, ValFractionHoldsOutTheTailOfText) {
  const std::string dir = test::temp_dir();
  const std::string text = test::write_file(dir, "corpus.txt", split_text());
  const Config c = test::config_from(std::string(kModel) + "[data]\nkind = \"text\"\npath = \"" +
                                     text + "\"\nval_fraction = 0.1\n");
  auto train = make_data_source(c.data, c.model, 2, 8);
  auto val = make_validation_source(c.data, c.model, 2, 8);
  ASSERT_TRUE(val);
  // 200 batches of 16 bytes wrap the 900 training bytes several times.
  const std::set<int32_t> trained = tokens_read(*train, 200, 2, 8);
  EXPECT_EQ(trained.count('x') + trained.count('y'), 0u);
  EXPECT_EQ(tokens_read(*val, 50, 2, 8), (std::set<int32_t>{'x', 'y'}));
}

TEST(Validation, ValFractionHoldsOutTheTailOfShards) {
  const std::string dir = test::temp_dir();
  const std::string text = test::write_file(dir, "corpus.txt", split_text());
  // Three shards of 400, 400 and 200 tokens: the cut at token 900 falls inside the last.
  write_text_shards(text, dir + "/shards", 400);
  const Config c =
      test::config_from(std::string(kModel) + "[data]\nkind = \"shards\"\npattern = \"" + dir +
                        "/shards/shard_*.bin\"\nval_fraction = 0.1\n");
  auto train = make_data_source(c.data, c.model, 2, 8);
  auto val = make_validation_source(c.data, c.model, 2, 8);
  ASSERT_TRUE(val);
  const std::set<int32_t> trained = tokens_read(*train, 200, 2, 8);
  EXPECT_EQ(trained.count('x') + trained.count('y'), 0u);
  EXPECT_GT(trained.size(), 10u);
  EXPECT_EQ(tokens_read(*val, 50, 2, 8), (std::set<int32_t>{'x', 'y'}));
  // A fraction that leaves validation less than one batch says so, naming the key.
  const Config tiny =
      test::config_from(std::string(kModel) + "[data]\nkind = \"shards\"\npattern = \"" + dir +
                        "/shards/shard_*.bin\"\nval_fraction = 0.01\n");
  const std::string e =
      test::error_of([&] { make_validation_source(tiny.data, tiny.model, 2, 8); });
  EXPECT_TRUE(test::contains(e, "test.toml:")) << e;
  EXPECT_TRUE(test::contains(e, "data.val_fraction = 1%")) << e;
  EXPECT_TRUE(test::contains(e, "larger")) << e;
}

// The metrics have val_loss on the eval steps and the last one, and the progress line says it.
TEST(Validation, MetricsAndProgressCarryTheValidationLoss) {
  const std::string dir = test::temp_dir();
  const std::string text = test::write_file(dir, "corpus.txt", split_text());
  const Config c = test::config_from(
      std::string(kModel) + "[train]\nsteps = 5\nmicro_batch = 2\nlr = 1e-2\nwarmup_steps = 0\n" +
      "eval_every = 2\neval_batches = 3\n[data]\nkind = \"text\"\npath = \"" + text +
      "\"\nval_fraction = 0.1\n");
  TrainOptions o;
  o.metrics_path = dir + "/metrics.jsonl";
  std::ostringstream log;
  o.log = &log;
  Trainer trainer(c, std::move(o));
  trainer.run();
  const std::vector<nlohmann::json> rows = read_metrics(dir + "/metrics.jsonl");
  ASSERT_EQ(rows.size(), 5u);
  double best = INFINITY;
  for (const nlohmann::json& r : rows) {
    const int64_t step = r["step"];
    const bool due = step % 2 == 0 || step == 5;
    ASSERT_EQ(r.contains("val_loss"), due) << r.dump();
    if (!due) continue;
    const double v = r["val_loss"];
    EXPECT_TRUE(std::isfinite(v));
    best = std::min(best, v);
    EXPECT_EQ(double(r["best_val_loss"]), best);
  }
  EXPECT_TRUE(test::contains(log.str(), "| val ")) << log.str();
}

// The same run with and without evaluation: the same peak, category by category, to the byte.
void expect_eval_leaves_the_peak(const std::string& extra) {
  const std::string base =
      std::string(kModel) +
      "[train]\nsteps = 3\nmicro_batch = 2\ngrad_accum = 2\nwarmup_steps = 0\n";
  const Config off = test::config_from(base + extra);
  const Config on = test::config_from(base + "eval_every = 1\neval_batches = 2\n" + extra);
  Trainer a(off, TrainOptions{});
  a.run();
  Trainer b(on, TrainOptions{});
  b.run();
  const MemoryTracker& ta = a.device().tracker();
  const MemoryTracker& tb = b.device().tracker();
  EXPECT_EQ(ta.peak_total(), tb.peak_total());
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(ta.peak_by_category()[i], tb.peak_by_category()[i]) << category_name(category_at(i));
  // The evaluation ran and its phase is in the timeline.
  bool evaluated = false;
  for (const TimelineSample& s : tb.timeline())
    evaluated = evaluated || s.phase.kind == Phase::Kind::kEval;
  EXPECT_TRUE(evaluated);
  ASSERT_EQ(b.history().size(), 3u);
  EXPECT_TRUE(b.history()[0].evaluated);
  // The training itself is untouched: the same losses, bitwise.
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(a.history()[i].loss, b.history()[i].loss);
}

TEST(Validation, EvalForwardDoesNotRaiseThePeak) {
  expect_eval_leaves_the_peak("");
}

TEST(Validation, EvalForwardDoesNotRaiseThePeakWithCheckpointAndAmp) {
  expect_eval_leaves_the_peak(
      "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n[[plugins]]\nname = \"checkpoint\"\n"
      "policy = \"every\"\n");
}

// A resume keeps the best validation loss of the steps before the snapshot.
TEST(Validation, BestLossSurvivesAResume) {
  const std::string dir = test::temp_dir();
  const std::string base = std::string(kModel) +
                           "[train]\nsteps = 4\nmicro_batch = 2\nlr = 1e-2\nwarmup_steps = 0\n" +
                           "lr_schedule = \"constant\"\neval_every = 1\neval_batches = 2\n";
  const std::string snapshots = "[snapshot]\nevery = 2\ndir = \"" + dir + "/snaps\"\n";
  TrainOptions whole_o;
  whole_o.metrics_path = dir + "/whole.jsonl";
  Trainer whole(test::config_from(base), std::move(whole_o));
  whole.run();
  const Config half = test::config_from(base + snapshots, {"train.steps=2"});
  Trainer(half, TrainOptions{}).run();
  TrainOptions resumed_o;
  resumed_o.metrics_path = dir + "/resumed.jsonl";
  resumed_o.resume_dir = dir + "/snaps";
  Trainer resumed(test::config_from(base + snapshots), std::move(resumed_o));
  resumed.run();
  const auto a = read_metrics(dir + "/whole.jsonl");
  const auto b = read_metrics(dir + "/resumed.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 2u);  // steps 3 and 4
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(double(a[i + 2]["val_loss"]), double(b[i]["val_loss"]));
    EXPECT_EQ(double(a[i + 2]["best_val_loss"]), double(b[i]["best_val_loss"]));
  }
}

TEST(Validation, BadKeysAreConfigErrorsNamingTheKey) {
  const std::string m = kModel;
  struct Case {
    std::string toml, want;
  } cases[] = {
      {m + "[data]\nval_fraction = 0.1\n", "test.toml:8:16: data.val_fraction is not used with "},
      {m + "[data]\nkind = \"text\"\npath = \"x.txt\"\nval_fraction = 1.0\n", "val_fraction"},
      {m + "[data]\nkind = \"text\"\npath = \"x.txt\"\nval_fraction = 0.1\nval_path = "
           "\"y.txt\"\n",
       "set one of data.val_path, data.val_pattern and data.val_fraction"},
      {m + "[data]\nkind = \"shards\"\npattern = \"s/*.bin\"\nval_path = \"y.txt\"\n",
       "data.val_path is a text file"},
      {m + "[data]\nkind = \"text\"\npath = \"x.txt\"\nval_pattern = \"v/*.bin\"\n",
       "data.val_pattern is a glob of shards"},
      {m + "[train]\neval_every = 5\n[data]\nkind = \"text\"\npath = \"x.txt\"\n",
       "test.toml:8:14: train.eval_every needs validation data: set data.val_path or "
       "data.val_fraction"},
      {m + "[train]\neval_every = -1\n", "eval_every"},
      {m + "[train]\neval_batches = 0\n", "eval_batches"},
  };
  for (const Case& c : cases) {
    const std::string e = test::error_of([&] { test::config_from(c.toml); });
    EXPECT_TRUE(test::contains(e, c.want)) << c.toml << "\n-> " << e;
  }
}

// Exit 2 from the host, naming the key, for the validation data that cannot be read.
TEST(Validation, MissingValidationFileExits2) {
  const std::string dir = test::temp_dir();
  const std::string text = test::write_file(dir, "corpus.txt", split_text());
  const std::string cfg = test::write_file(
      dir, "run.toml",
      std::string(kModel) + "[train]\nsteps = 1\nmicro_batch = 2\neval_every = 1\n[data]\n" +
          "kind = \"text\"\npath = \"corpus.txt\"\nval_path = \"missing.txt\"\n");
  const test::RunResult r = test::run_headroom("train " + cfg);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(test::contains(r.output, "data.val_path")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "missing.txt")) << r.output;
}

}  // namespace
}  // namespace headroom
