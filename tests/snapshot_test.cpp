// Training snapshots and resume, prefetching, and the data errors a user meets at the command line.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/shards.h"
#include "core/snapshot.h"
#include "core/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

struct Stop {};  // thrown by a listener to end a run early, as a crash would

class StopAtStep final : public EventListener {
 public:
  explicit StopAtStep(int64_t step) : step_(step) {}
  void on_event(const EventInfo& e) override {
    if (e.event == Event::kStepBegin && e.step == step_) throw Stop{};
  }

 private:
  int64_t step_;
};

struct RunResult {
  std::vector<double> losses;
  std::vector<float> weights;
};

std::string resume_config(const std::string& dir, const std::string& optimizer) {
  return "[model]\nn_layer = 2\nn_head = 2\nn_embd = 16\nseq_len = 8\nvocab_size = 32\n"
         "[train]\nsteps = 20\nmicro_batch = 2\ngrad_accum = 2\nwarmup_steps = 3\nlr = 1e-2\n" +
         optimizer + "[snapshot]\nevery = 5\ndir = \"" + dir + "\"\nkeep = 2\n";
}

// Runs the config, stopping before `stop_at` if > 0, resuming from its snapshots if asked.
RunResult run(const Config& c, int64_t stop_at, bool resume) {
  TrainOptions o;
  if (resume) o.resume_dir = c.snapshot.dir;
  Trainer t(c, std::move(o));
  StopAtStep stop(stop_at);
  if (stop_at > 0) t.add_listener(&stop);
  try {
    t.run();
  } catch (const Stop&) {
  }
  RunResult r;
  for (const StepRecord& s : t.history())
    r.losses.push_back(s.loss);
  for (Param<float>* p : t.model().params())
    r.weights.insert(r.weights.end(), p->data(), p->data() + p->numel);
  return r;
}

class Resume : public ::testing::TestWithParam<const char*> {};

TEST_P(Resume, TenStepsResumeTenStepsIsBitwiseTwentySteps) {
  const std::string dir = test::temp_dir();
  const Config whole = test::config_from(resume_config(dir + "/a", GetParam()));
  const Config parts = test::config_from(resume_config(dir + "/b", GetParam()));
  const RunResult a = run(whole, 0, false);
  ASSERT_EQ(a.losses.size(), 20u);

  const RunResult first = run(parts, 11, false);  // stops after step 10's snapshot
  ASSERT_EQ(first.losses.size(), 10u);
  const RunResult second = run(parts, 0, true);
  ASSERT_EQ(second.losses.size(), 10u);

  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(first.losses[i], a.losses[i]) << "step " << i + 1;
    EXPECT_EQ(second.losses[i], a.losses[10 + i]) << "step " << i + 11;
  }
  ASSERT_EQ(second.weights.size(), a.weights.size());
  EXPECT_EQ(std::memcmp(second.weights.data(), a.weights.data(), a.weights.size() * 4), 0);
  // keep = 2: only the newest two snapshots remain.
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir + "/b"))
    n += e.path().extension() == ".hrsnap";
  EXPECT_EQ(n, 2);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Resume,
                         ::testing::Values("optimizer = \"adamw\"\n",
                                           "optimizer = \"sgd\"\nmomentum = 0.9\n"),
                         [](const auto& info) {
                           return info.index == 0 ? "AdamW" : "SgdMomentum";
                         });

TEST(Resume, RefusesASnapshotOfAnotherModel) {
  const std::string dir = test::temp_dir();
  run(test::config_from(resume_config(dir, "")), 6, false);
  Config other = test::config_from(resume_config(dir, ""), {"model.n_embd=32"});
  TrainOptions o;
  o.resume_dir = dir;
  Trainer t(other, std::move(o));
  try {
    t.run();
    FAIL() << "resumed a snapshot of another model";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos) << e.what();
  }
}

TEST(Snapshot, DamagedNewestIsSkippedForThePreviousOne) {
  const std::string dir = test::temp_dir();
  run(test::config_from(resume_config(dir, "")), 11, false);  // snapshots at 5 and 10
  const std::string newest = dir + "/step_000000000010.hrsnap";
  ASSERT_TRUE(fs::exists(newest));
  fs::resize_file(newest, fs::file_size(newest) - 100);  // cut short
  std::string path;
  const SnapshotData d = read_newest_snapshot(dir, &path);
  EXPECT_EQ(d.step, 5);
  EXPECT_THROW(read_snapshot(newest), ConfigError);
}

// A run killed with SIGKILL while it writes a snapshot resumes from the previous one, and then
// computes exactly what an uninterrupted run does.
TEST(Snapshot, KilledWhileWritingResumesFromThePreviousSnapshot) {
  const std::string dir = test::temp_dir();
  const std::string config = test::write_file(
      dir, "run.toml",
      "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
      "[train]\nsteps = 30\nmicro_batch = 2\n[snapshot]\nevery = 10\ndir = \"snaps\"\n");
  const std::string snaps = dir + "/snaps";

  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    setenv("HEADROOM_SNAPSHOT_WRITE_DELAY_MS", "5", 1);
    const int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    execl(HEADROOM_BINARY, HEADROOM_BINARY, "train", config.c_str(), "-q", (char*)nullptr);
    _exit(127);
  }
  // Wait until the second snapshot (step 20) is being written, then kill the run.
  const std::string tmp = snaps + "/.step_000000000020.hrsnap.tmp";
  bool seen = false;
  for (int i = 0; i < 2000 && !seen; ++i) {
    seen = fs::exists(tmp) && fs::file_size(tmp) > 0;
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(seen) << "the run never started writing its second snapshot";
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_TRUE(fs::exists(snaps + "/step_000000000010.hrsnap"));
  EXPECT_FALSE(fs::exists(snaps + "/step_000000000020.hrsnap"));

  const auto resumed = test::run_headroom("train " + config + " --resume " + snaps + " --metrics " +
                                          dir + "/resumed.jsonl");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("step_000000000010.hrsnap (step 10)"), std::string::npos)
      << resumed.output;

  // The uninterrupted run, for comparison.
  const auto whole = test::run_headroom("train " + config + " -q --set snapshot.every=0" +
                                        " --metrics " + dir + "/whole.jsonl");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  std::map<int, double> whole_loss;
  std::ifstream w(dir + "/whole.jsonl"), r(dir + "/resumed.jsonl");
  std::string line;
  while (std::getline(w, line)) {
    const auto j = nlohmann::json::parse(line);
    whole_loss[j["step"].get<int>()] = j["loss"].get<double>();
  }
  int resumed_steps = 0;
  while (std::getline(r, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["loss"].get<double>(), whole_loss.at(j["step"].get<int>())) << line;
    ++resumed_steps;
  }
  EXPECT_EQ(resumed_steps, 20);  // steps 11..30
}

// ---------------------------------------------------------------------------------------------
// Prefetching

TEST(Prefetch, WorkersGiveTheSameBatchesAsInline) {
  auto losses = [](int workers) {
    const Config c = test::config_from(
        "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 8\nvocab_size = 32\n"
        "[train]\nsteps = 6\nmicro_batch = 2\ngrad_accum = 3\n[data]\nworkers = " +
        std::to_string(workers) + "\nprefetch = 3\n");
    Trainer t(c, TrainOptions{});
    t.run();
    std::vector<double> l;
    for (const StepRecord& s : t.history())
      l.push_back(s.loss);
    return l;
  };
  const std::vector<double> inline_losses = losses(0);
  EXPECT_EQ(losses(1), inline_losses);
  EXPECT_EQ(losses(2), inline_losses);
}

TEST(Prefetch, SnapshotDuringPrefetchResumesExactly) {
  const std::string dir = test::temp_dir();
  const std::string text =
      resume_config(dir, "optimizer = \"adamw\"\n") + "[data]\nworkers = 2\nprefetch = 4\n";
  const RunResult whole = run(test::config_from(resume_config(dir + "/w", "")), 0, false);
  run(test::config_from(text), 13, false);
  const RunResult rest = run(test::config_from(text), 0, true);
  ASSERT_EQ(rest.losses.size(), 10u);  // from step 10's snapshot
  for (int i = 0; i < 10; ++i)
    EXPECT_EQ(rest.losses[i], whole.losses[10 + i]) << i;
}

// ---------------------------------------------------------------------------------------------
// Bad shards at the command line: exit 2, naming the file.

struct BadShard {
  const char* name;
  int32_t magic, version, count;
  int64_t tokens_written;  // uint16 tokens actually in the file
  const char* expect;
};

class BadShardCli : public ::testing::TestWithParam<BadShard> {};

TEST_P(BadShardCli, Exits2NamingTheFile) {
  const BadShard b = GetParam();
  const std::string dir = test::temp_dir();
  fs::create_directories(dir + "/shards");
  const std::string shard = dir + "/shards/train_000.bin";
  {
    std::ofstream f(shard, std::ios::binary);
    int32_t header[256] = {0};
    header[0] = b.magic;
    header[1] = b.version;
    header[2] = b.count;
    f.write(reinterpret_cast<const char*>(header), sizeof header);
    for (int64_t i = 0; i < b.tokens_written; ++i) {
      const uint16_t t = uint16_t(i % 200);
      f.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  const std::string config = test::write_file(
      dir, "run.toml",
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 16\nvocab_size = 256\n"
      "[train]\nsteps = 1\nmicro_batch = 2\n[data]\nkind = \"shards\"\npattern = "
      "\"shards/*.bin\"\n");
  const auto r = test::run_headroom("train " + config);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(shard), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(b.expect), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Shards, BadShardCli,
    ::testing::Values(BadShard{"BadMagic", 12345, 1, 100, 100, "magic"},
                      BadShard{"WrongVersion", kShardMagic, 7, 100, 100, "version"},
                      BadShard{"Truncated", kShardMagic, 1, 100, 60, "truncated"},
                      BadShard{"CountMismatch", kShardMagic, 1, 100, 140, "mismatch"},
                      BadShard{"FewerThanOneBatch", kShardMagic, 1, 20, 20, "fewer than one"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ShardCli, ShardCommandWritesShardsTrainingReads) {
  const std::string dir = test::temp_dir();
  std::string text;
  for (int i = 0; i < 400; ++i)
    text += "the quick brown fox jumps over the lazy dog. ";
  test::write_file(dir, "corpus.txt", text);
  auto r =
      test::run_headroom("shard " + dir + "/corpus.txt " + dir + "/shards --tokens-per-shard 5000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("shard_000003.bin"), std::string::npos) << r.output;  // 18000 bytes
  const std::string config = test::write_file(
      dir, "run.toml",
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nseq_len = 32\nvocab_size = 256\n"
      "[train]\nsteps = 3\nmicro_batch = 4\n[data]\nkind = \"shards\"\npattern = \"shards/*.bin\"\n"
      "workers = 1\n");
  r = test::run_headroom("train " + config + " -q");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // Writing into a folder that already holds shards would mix old and new data.
  r = test::run_headroom("shard " + dir + "/corpus.txt " + dir + "/shards");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("already holds shards"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace headroom
