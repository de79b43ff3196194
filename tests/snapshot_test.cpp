// Training snapshots and resume, prefetching, and the data errors a user meets at the command line.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/data/shards.h"
#include "core/os/output_file.h"
#include "core/run/snapshot.h"
#include "core/run/trainer.h"
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
  for (const StepState& s : t.history())
    r.losses.push_back(s.loss);
  for (Param<float>* p : t.model().params())
    r.weights.insert(r.weights.end(), p->master().value, p->master().value + p->numel);
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
    setenv("HEADROOM_TEST_WRITE_DELAY_MS", "5", 1);
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
// The file format: every byte a resume reads is covered by the checksum and range-checked.

SnapshotData small_snapshot(int64_t step) {
  SnapshotData d;
  d.step = step;
  d.skipped_steps = 1;
  d.data_state = "synthetic 7";
  d.model = "n_layer=1";
  d.optimizer = "adamw";
  d.tensors["a"] = {1, 2, 3, 4};
  d.tensors["b"] = std::vector<uint8_t>(64, 7);
  d.plugins["amp"] = {9, 9};
  return d;
}

void put_u64(std::string& file, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    file[at + i] = char(uint8_t(v >> (8 * i)));
}

// The file with its checksum (bytes 16..23) made right again, as a careful forger would.
std::string with_checksum(std::string file) {
  put_u64(file, 16, snapshot_checksum(reinterpret_cast<const uint8_t*>(file.data()), file.size()));
  return file;
}

// A file of `magic`, `manifest` and `payload`, with a correct checksum.
std::string build_file(const std::string& manifest, const std::string& payload,
                       const char* magic = "HRSNAP02") {
  std::string f(kSnapshotHeaderBytes, '\0');
  std::memcpy(&f[0], magic, 8);
  put_u64(f, 8, manifest.size());
  return with_checksum(f + manifest + payload);
}

// The ConfigError parse_snapshot gives for `file` as "s.hrsnap"; "" when it parses.
std::string parse_error(const std::string& file) {
  try {
    parse_snapshot(reinterpret_cast<const uint8_t*>(file.data()), file.size(), "s.hrsnap");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string manifest_of(const std::string& file) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= uint64_t(uint8_t(file[8 + i])) << (8 * i);
  return file.substr(kSnapshotHeaderBytes, n);
}

// The same file with `from` replaced by `to` in the manifest, manifest_len adjusted: the JSON
// still parses, only the checksum (left as it was) can tell.
std::string edit_manifest(const std::string& file, const std::string& from, const std::string& to) {
  std::string m = manifest_of(file);
  const size_t at = m.find(from);
  EXPECT_NE(at, std::string::npos) << from << " not in " << m;
  if (at == std::string::npos) return file;
  const std::string payload = file.substr(kSnapshotHeaderBytes + m.size());
  m.replace(at, from.size(), to);
  std::string out = file.substr(0, kSnapshotHeaderBytes);
  put_u64(out, 8, m.size());
  return out + m + payload;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(Snapshot, WritesFormat02AndReadsBackEveryField) {
  const std::string dir = test::temp_dir();
  const SnapshotData d = small_snapshot(10);
  const std::string path = write_snapshot(dir, d, 2);
  EXPECT_EQ(path, dir + "/step_000000000010.hrsnap");
  const std::string file = test::read_file(path);
  ASSERT_GE(file.size(), kSnapshotHeaderBytes);
  EXPECT_EQ(file.substr(0, 8), "HRSNAP02");
  EXPECT_EQ(file, with_checksum(file));  // the checksum covers header and manifest and payload
  const auto m = nlohmann::json::parse(manifest_of(file));
  EXPECT_EQ(m["step"], 10);
  EXPECT_EQ(m["payload_bytes"], 4 + 64 + 2);
  EXPECT_FALSE(m.contains("checksum"));

  const SnapshotData r = read_snapshot(path);
  EXPECT_EQ(r.step, d.step);
  EXPECT_EQ(r.skipped_steps, d.skipped_steps);
  EXPECT_EQ(r.data_state, d.data_state);
  EXPECT_EQ(r.model, d.model);
  EXPECT_EQ(r.optimizer, d.optimizer);
  EXPECT_EQ(r.tensors, d.tensors);
  EXPECT_EQ(r.plugins, d.plugins);
  // Nothing beside it but the snapshot.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(Reshard, OptimizerLayoutAndStateNames) {
  EXPECT_EQ(optimizer_layout("adamw").optimizer, "adamw");
  EXPECT_EQ(optimizer_layout("adamw").sharded_over, 0);
  EXPECT_EQ(optimizer_layout("adamw sharded over 4 ranks").optimizer, "adamw");
  EXPECT_EQ(optimizer_layout("adamw sharded over 4 ranks").sharded_over, 4);
  EXPECT_EQ(optimizer_layout("sgd sharded over x ranks").sharded_over, 0);

  StateName n;
  ASSERT_TRUE(parse_state_name("h.0.attn.c_attn.weight [3:700) adamw m", &n));
  EXPECT_EQ(n.param, "h.0.attn.c_attn.weight");
  EXPECT_FALSE(n.whole);
  EXPECT_EQ(n.begin, 3u);
  EXPECT_EQ(n.end, 700u);
  EXPECT_EQ(n.kind, "adamw m");
  ASSERT_TRUE(parse_state_name("wte.weight sgd momentum", &n));
  EXPECT_TRUE(n.whole);
  EXPECT_EQ(n.kind, "sgd momentum");
  for (const char* bad : {"wte.weight", "wte.weight [3:3) adamw m", "wte.weight [4:3) adamw m",
                          "wte.weight [3:x) adamw m", "wte.weight [0:3)", "wte.weight [0:3)adamw",
                          " adamw m", "wte.weight "})
    EXPECT_FALSE(parse_state_name(bad, &n)) << bad;
}

std::vector<uint8_t> floats(std::vector<float> v) {
  std::vector<uint8_t> b(v.size() * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// State cut one way (4 ranks: a's [0:3) [3:6), b whole, c's [0:1)) assembled into another cut:
// every wanted tensor gets its elements from whatever pieces overlap it, in place.
TEST(Reshard, AssemblesStateCutAnotherWay) {
  const std::map<std::string, uint64_t> params = {{"a", 6}, {"b", 2}, {"c", 1}};
  StateResharder r(params);
  r.want("a [0:4) adamw m", 4);
  r.want("a [4:6) adamw m", 2);
  r.want("b adamw m", 2);
  r.want("c adamw m", 1);
  r.want("a [0:4) adamw v", 4);
  r.take("a [0:3) adamw m", floats({0, 1, 2}), "p0");
  r.take("a [3:6) adamw m", floats({3, 4, 5}), "p1");
  r.take("a adamw v", floats({10, 11, 12, 13, 14, 15}), "file");
  r.take("b [0:2) adamw m", floats({20, 21}), "p1");
  r.take("c adamw m", floats({30}), "p2");
  r.take("b adamw v", floats({40, 41}), "p1");  // wanted by no tensor of this rank
  r.check("what 4 ranks wrote");
  EXPECT_EQ(r.bytes("a [0:4) adamw m"), floats({0, 1, 2, 3}));
  EXPECT_EQ(r.bytes("a [4:6) adamw m"), floats({4, 5}));
  EXPECT_EQ(r.bytes("b adamw m"), floats({20, 21}));
  EXPECT_EQ(r.bytes("c adamw m"), floats({30}));
  EXPECT_EQ(r.bytes("a [0:4) adamw v"), floats({10, 11, 12, 13}));
}

TEST(Reshard, RefusesStateThatDoesNotCoverOrFit) {
  const std::map<std::string, uint64_t> params = {{"a", 6}};
  auto wanting = [&] {
    auto r = std::make_unique<StateResharder>(params);
    r->want("a adamw m", 6);
    return r;
  };
  auto r = wanting();
  r->take("a [0:2) adamw m", floats({0, 1}), "p0");
  r->take("a [4:6) adamw m", floats({4, 5}), "p2");
  std::string msg = test::error_of([&] { r->check("what 3 ranks wrote"); });
  EXPECT_EQ(msg, "what 3 ranks wrote has no optimizer state for elements [2:4) of 'a' (adamw m)");
  r = wanting();
  r->take("a [0:4) adamw m", floats({0, 1, 2, 3}), "p0");
  msg = test::error_of([&] { r->check("what 3 ranks wrote"); });
  EXPECT_EQ(msg, "what 3 ranks wrote has no optimizer state for elements [4:6) of 'a' (adamw m)");
  r = wanting();
  r->take("a [0:4) adamw m", floats({0, 1, 2, 3}), "p0");
  r->take("a [3:6) adamw m", floats({3, 4, 5}), "p1");
  msg = test::error_of([&] { r->check("what 2 ranks wrote"); });
  EXPECT_EQ(msg,
            "what 2 ranks wrote has optimizer state for elements [3:4) of 'a' (adamw m) twice");
  msg = test::error_of([&] { r->take("z adamw m", floats({0}), "FILE"); });
  EXPECT_EQ(msg,
            "FILE: tensor 'z adamw m' is neither a parameter of this model nor optimizer "
            "state of one");
  msg = test::error_of([&] { r->take("a [4:7) adamw m", floats({0, 1, 2}), "FILE"); });
  EXPECT_EQ(msg, "FILE: tensor 'a [4:7) adamw m' covers elements [4:7) of 'a', which has 6");
  msg = test::error_of([&] { r->take("a [4:6) adamw m", floats({0}), "FILE"); });
  EXPECT_EQ(msg, "FILE: tensor 'a [4:6) adamw m' has 4 bytes; its 2 elements are 8");
  EXPECT_THROW(r->want("a [0:2) adamw m", 3), std::invalid_argument);
  EXPECT_THROW(r->want("b adamw m", 1), std::invalid_argument);
}

TEST(Snapshot, TamperedManifestIsRefusedNamingTheFile) {
  const std::string dir = test::temp_dir();
  write_snapshot(dir, small_snapshot(5), 3);
  const std::string path = write_snapshot(dir, small_snapshot(10), 3);
  const std::string file = test::read_file(path);

  // step 10 -> -5 (same length) and -> -500 (manifest_len adjusted): the JSON parses, the
  // checksum does not match.
  for (const std::string& to : {std::string("\"step\":-5"), std::string("\"step\":-500")}) {
    write_bytes(path, edit_manifest(file, "\"step\":10", to));
    const std::string e = test::error_of([&] { read_snapshot(path); });
    EXPECT_TRUE(test::starts_with(e, "snapshot " + path + ": checksum mismatch")) << e;
  }
  // A resume falls back to the previous snapshot, with a warning naming the damaged one.
  testing::internal::CaptureStderr();
  std::string used;
  const SnapshotData d = read_newest_snapshot(dir, &used);
  const std::string warning = testing::internal::GetCapturedStderr();
  EXPECT_EQ(d.step, 5);
  EXPECT_EQ(used, dir + "/step_000000000005.hrsnap");
  EXPECT_TRUE(test::contains(warning, "skipping snapshot " + path + ": checksum mismatch"))
      << warning;

  // With the checksum forged too, the range check still refuses a negative step.
  write_bytes(path, with_checksum(edit_manifest(file, "\"step\":10", "\"step\":-5")));
  const std::string e = test::error_of([&] { read_snapshot(path); });
  EXPECT_EQ(e, "snapshot " + path + ": step -5 is out of range (>= 1)") << e;
  // An edited tensor byte is caught the same way.
  std::string payload_edit = file;
  payload_edit[payload_edit.size() - 3] ^= 1;
  write_bytes(path, payload_edit);
  EXPECT_TRUE(test::contains(test::error_of([&] { read_snapshot(path); }), "checksum mismatch"));
}

TEST(Snapshot, TamperedSnapshotAtTheCommandLineResumesFromThePreviousOne) {
  const std::string dir = test::temp_dir();
  const std::string config = test::write_file(dir, "run.toml", resume_config("snaps", ""));
  const std::string snaps = dir + "/snaps";
  const auto first =
      test::run_headroom("train " + config + " -q --set train.steps=10");  // snapshots 5, 10
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string newest = snaps + "/step_000000000010.hrsnap";
  write_bytes(newest, edit_manifest(test::read_file(newest), "\"step\":10", "\"step\":-5"));
  const auto resumed = test::run_headroom("train " + config + " --resume " + snaps);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(test::contains(resumed.output, "skipping snapshot " + newest + ": checksum mismatch"))
      << resumed.output;
  EXPECT_TRUE(test::contains(resumed.output, "step_000000000005.hrsnap (step 5)"))
      << resumed.output;
}

// Every value read is range-checked, even in a file whose checksum is right.
struct ManifestCase {
  const char* name;
  std::function<void(nlohmann::json&)> edit;
  std::string want;
};

class SnapshotManifest : public ::testing::TestWithParam<ManifestCase> {};

nlohmann::json good_manifest() {
  return nlohmann::json::parse(R"({"step": 10, "skipped_steps": 2, "data_state": "synthetic 3",
    "model": "n_layer=1", "optimizer": "sgd",
    "tensors": [{"name": "a", "offset": 0, "bytes": 4}, {"name": "b", "offset": 4, "bytes": 2}],
    "plugins": [{"name": "amp", "offset": 6, "bytes": 2}], "payload_bytes": 8})");
}

TEST(SnapshotManifest, TheGoodOneParses) {
  EXPECT_EQ(parse_error(build_file(good_manifest().dump(), "ABCDEFGH")), "");
  const std::string file = build_file(good_manifest().dump(), "ABCDEFGH");
  const SnapshotData d =
      parse_snapshot(reinterpret_cast<const uint8_t*>(file.data()), file.size(), "s");
  EXPECT_EQ(d.tensors.at("b"), (std::vector<uint8_t>{'E', 'F'}));
  EXPECT_EQ(d.plugins.at("amp"), (std::vector<uint8_t>{'G', 'H'}));
}

TEST_P(SnapshotManifest, IsRefusedNamingTheFile) {
  nlohmann::json m = good_manifest();
  GetParam().edit(m);
  const std::string e = parse_error(build_file(m.dump(), "ABCDEFGH"));
  EXPECT_TRUE(test::starts_with(e, "snapshot s.hrsnap: ")) << e;
  EXPECT_TRUE(test::contains(e, GetParam().want)) << e;
}

using J = nlohmann::json;
INSTANTIATE_TEST_SUITE_P(
    RangeChecks, SnapshotManifest,
    ::testing::Values(
        ManifestCase{"StepZero", [](J& m) { m["step"] = 0; }, "step 0 is out of range (>= 1)"},
        ManifestCase{"StepNegative", [](J& m) { m["step"] = -5; }, "step -5 is out of range"},
        ManifestCase{"StepString", [](J& m) { m["step"] = "10"; },
                     "step is a string, not an integer"},
        ManifestCase{"StepFraction", [](J& m) { m["step"] = 2.5; }, "step is 2.5, not an integer"},
        ManifestCase{"StepTooLarge", [](J& m) { m["step"] = uint64_t(1) << 63; },
                     "not an integer in range"},
        ManifestCase{"SkippedNegative", [](J& m) { m["skipped_steps"] = -1; },
                     "skipped_steps -1 is out of range (0 to the step, 10)"},
        ManifestCase{"SkippedAboveStep", [](J& m) { m["skipped_steps"] = 11; },
                     "skipped_steps 11 is out of range"},
        ManifestCase{"MissingKey", [](J& m) { m.erase("model"); }, "the manifest has no 'model'"},
        ManifestCase{"UnknownKey", [](J& m) { m["extra"] = 1; }, "unknown manifest key 'extra'"},
        ManifestCase{"FrozenBaseNotObject", [](J& m) { m["frozen_base"] = 3; },
                     "frozen_base is 3, not a JSON object"},
        ManifestCase{"FrozenBaseChecksumNotHex",
                     [](J& m) {
                       m["frozen_base"] = {
                           {"init_from", ""}, {"seed", 1}, {"checksum", "xyz"}, {"tensors", 2}};
                     },
                     "frozen_base.checksum \"xyz\" is not 16 hex digits"},
        ManifestCase{"FrozenBaseNoTensors",
                     [](J& m) {
                       m["frozen_base"] = {{"init_from", ""},
                                           {"seed", 1},
                                           {"checksum", "0123456789abcdef"},
                                           {"tensors", 0}};
                     },
                     "frozen_base.tensors is 0"},
        ManifestCase{"FrozenBaseUnknownKey",
                     [](J& m) {
                       m["frozen_base"] = {{"init_from", ""},
                                           {"seed", 1},
                                           {"checksum", "0123456789abcdef"},
                                           {"tensors", 2},
                                           {"path", "x"}};
                     },
                     "unknown manifest key 'path''s frozen_base"},
        ManifestCase{"ModelEmpty", [](J& m) { m["model"] = ""; }, "model is empty"},
        ManifestCase{"OptimizerNotString", [](J& m) { m["optimizer"] = 3; },
                     "optimizer is 3, not a string"},
        ManifestCase{"DataStateNull", [](J& m) { m["data_state"] = nullptr; },
                     "data_state is null, not a string"},
        ManifestCase{"TensorsNotArray", [](J& m) { m["tensors"] = J::object(); },
                     "'tensors' is an object, not an array"},
        ManifestCase{"EntryNotObject", [](J& m) { m["tensors"][0] = 5; },
                     "tensors entry 0 is 5, not an object"},
        ManifestCase{"EntryNameEmpty", [](J& m) { m["tensors"][0]["name"] = ""; },
                     "tensor name (tensors entry 0) is empty"},
        ManifestCase{"PluginNameNotString", [](J& m) { m["plugins"][0]["name"] = 7; },
                     "plugin state name (plugins entry 0) is 7, not a string"},
        ManifestCase{"EntryNameTwice", [](J& m) { m["tensors"][1]["name"] = "a"; },
                     "tensor 'a' appears twice"},
        ManifestCase{"EntryUnknownKey", [](J& m) { m["tensors"][0]["dtype"] = "f32"; },
                     "unknown manifest key 'dtype' (tensors entry 0)"},
        ManifestCase{"EntryMissingOffset", [](J& m) { m["tensors"][0].erase("offset"); },
                     "the manifest (tensors entry 0) has no 'offset'"},
        ManifestCase{"EntryNegativeBytes", [](J& m) { m["tensors"][0]["bytes"] = -4; },
                     "the size of tensor 'a' is -4, not a byte count"},
        ManifestCase{"EntryOutsidePayload", [](J& m) { m["tensors"][1]["offset"] = 100; },
                     "tensor 'b' (2 bytes at offset 100) lies outside the 8-byte payload"},
        ManifestCase{"EntryHugeSize", [](J& m) { m["tensors"][1]["bytes"] = UINT64_MAX; },
                     "lies outside the 8-byte payload"},
        ManifestCase{"EntriesOverlap", [](J& m) { m["tensors"][1]["offset"] = 2; },
                     "tensor 'b' at offset 2 overlaps the entry before it, which ends at 4"},
        ManifestCase{"EntriesLeaveAGap",
                     [](J& m) {
                       m["tensors"][1]["offset"] = 5;
                       m["tensors"][1]["bytes"] = 1;
                     },
                     "tensor 'b' at offset 5 leaves a gap"},
        ManifestCase{"EntriesDoNotCoverThePayload", [](J& m) { m["plugins"] = J::array(); },
                     "the entries cover 6 of the 8 payload bytes"},
        ManifestCase{"PayloadShorterThanSaid", [](J& m) { m["payload_bytes"] = 9; },
                     "truncated: the payload holds 8 of its 9 bytes"},
        ManifestCase{"PayloadLongerThanSaid", [](J& m) { m["payload_bytes"] = 7; },
                     "the payload is 8 bytes but the manifest says 7"},
        ManifestCase{"NotAnObject",
                     [](J& m) {
                       m = J::array({1, 2});
                     },
                     "the manifest is an array, not a JSON object"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(SnapshotManifest, DuplicateKeysAndBadJsonAreRefused) {
  std::string m = good_manifest().dump();
  m.insert(1, "\"step\":3,");
  EXPECT_TRUE(test::contains(parse_error(build_file(m, "ABCDEFGH")),
                             "snapshot s.hrsnap: bad manifest: the key 'step' appears twice"));
  EXPECT_TRUE(test::contains(parse_error(build_file("{\"step\":", "ABCDEFGH")),
                             "snapshot s.hrsnap: bad manifest: "));
}

TEST(Snapshot, HeaderProblemsAreRefusedNamingTheFile) {
  const std::string good = build_file(good_manifest().dump(), "ABCDEFGH");
  struct Case {
    std::string file, want;
  };
  std::string long_manifest = good;
  put_u64(long_manifest, 8, 1u << 20);
  std::string bad_sum = good;
  bad_sum[20] ^= 1;
  const Case cases[] = {
      {"", "not a headroom snapshot (bad magic"},
      {"GARBAGE!" + good.substr(8), "not a headroom snapshot (bad magic"},
      {build_file(good_manifest().dump(), "ABCDEFGH", "HRSNAP01"),
       "written by an older headroom (format 01"},
      {build_file(good_manifest().dump(), "ABCDEFGH", "HRSNAP07"),
       "format 07 is not one this headroom reads (it reads 02)"},
      {good.substr(0, 20), "truncated: 20 bytes, shorter than the 24-byte header"},
      {long_manifest, "truncated: the manifest is 1048576 bytes"},
      {bad_sum, "checksum mismatch: the file is damaged or was edited"},
      {good.substr(0, good.size() - 3), "truncated: the payload holds 5 of its 8 bytes"},
      {good + "X", "checksum mismatch"},
  };
  for (const Case& c : cases) {
    const std::string e = parse_error(c.file);
    EXPECT_TRUE(test::starts_with(e, "snapshot s.hrsnap: ")) << e;
    EXPECT_TRUE(test::contains(e, c.want)) << c.want << "\n" << e;
  }
}

TEST(Snapshot, OldFormatFileIsRefusedWithAClearMessage) {
  const std::string dir = test::temp_dir();
  // What headroom before format 02 wrote: magic, native manifest_len, manifest with a checksum.
  const std::string manifest =
      R"({"step":5,"skipped_steps":0,"data_state":"","model":"m","optimizer":"sgd",)"
      R"("tensors":[],"plugins":[],"payload_bytes":0,"checksum":14695981039346656037})";
  std::string file = "HRSNAP01" + std::string(8, '\0') + manifest;
  put_u64(file, 8, manifest.size());
  const std::string path = dir + "/step_000000000005.hrsnap";
  write_bytes(path, file);
  const std::string e = test::error_of([&] { read_snapshot(path); });
  EXPECT_TRUE(test::starts_with(
      e, "snapshot " + path + ": written by an older headroom (format 01, whose checksum"))
      << e;
  EXPECT_TRUE(test::contains(e, "without --resume")) << e;
  testing::internal::CaptureStderr();
  const std::string none = test::error_of([&] { read_newest_snapshot(dir, nullptr); });
  EXPECT_TRUE(test::contains(testing::internal::GetCapturedStderr(), "format 01"));
  EXPECT_TRUE(test::contains(none, "no complete snapshot")) << none;
}

TEST(Snapshot, RenamedFileIsRefused) {
  const std::string dir = test::temp_dir();
  const std::string path = write_snapshot(dir, small_snapshot(5), 2);
  const std::string renamed = dir + "/step_000000000010.hrsnap";
  fs::rename(path, renamed);
  EXPECT_EQ(test::error_of([&] { read_snapshot(renamed); }),
            "snapshot " + renamed + ": holds step 5 but its name says step 10 (was it renamed?)");
}

TEST(Snapshot, LeftoverTemporariesAndFoldersAreIgnored) {
  const std::string dir = test::temp_dir();
  write_snapshot(dir, small_snapshot(10), 3);
  // What a killed run leaves: a half-written temporary of a newer step. And a folder where a
  // snapshot would be.
  const std::string tmp = dir + "/.step_000000000020.hrsnap.tmp";
  write_bytes(tmp, "HRSNAP02 half written");
  fs::create_directories(dir + "/step_000000000030.hrsnap");
  testing::internal::CaptureStderr();
  std::string used;
  EXPECT_EQ(read_newest_snapshot(dir, &used).step, 10);
  const std::string warnings = testing::internal::GetCapturedStderr();
  EXPECT_EQ(used, dir + "/step_000000000010.hrsnap");
  EXPECT_FALSE(test::contains(warnings, ".tmp")) << warnings;
  EXPECT_TRUE(test::contains(warnings, "step_000000000030.hrsnap: is a folder")) << warnings;
  // The next snapshot written removes the temporary.
  write_snapshot(dir, small_snapshot(15), 3);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(fs::exists(dir + "/step_000000000010.hrsnap"));
}

TEST(Snapshot, WriteSnapshotRefusesAStepItCouldNotReadBack) {
  const std::string dir = test::temp_dir();
  SnapshotData d = small_snapshot(0);
  EXPECT_THROW(write_snapshot(dir, d, 2), std::invalid_argument);
  d = small_snapshot(3);
  d.skipped_steps = 4;
  EXPECT_THROW(write_snapshot(dir, d, 2), std::invalid_argument);
}

// A write that fails (here: the file size limit, which stops root too) is an OutputError naming
// the snapshot and the OS's reason; the previous snapshot is untouched, nothing else is left, and
// nothing is pruned.
TEST(Snapshot, FailedWriteLeavesThePreviousSnapshot) {
  const std::string dir = test::temp_dir();
  const std::string previous = write_snapshot(dir, small_snapshot(5), 1);
  const std::string before = test::read_file(previous);

  SnapshotData big = small_snapshot(10);
  big.tensors["big"] = std::vector<uint8_t>(1 << 20, 3);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 64 * 1024;
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of a signal
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    write_snapshot(dir, big, 1);
  } catch (const OutputError& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);

  const std::string path = dir + "/step_000000000010.hrsnap";
  EXPECT_TRUE(test::starts_with(message, "snapshot " + path + ": write failed: File too large"))
      << message;
  EXPECT_EQ(test::read_file(previous), before);
  EXPECT_EQ(read_snapshot(previous).step, 5);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir))
    left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"step_000000000005.hrsnap"});

  // A folder that cannot be made: an OutputError naming it.
  const std::string file = test::write_file(dir, "plain", "x");
  try {
    write_snapshot(file + "/snaps", small_snapshot(5), 1);
    ADD_FAILURE() << "wrote a snapshot under a file";
  } catch (const OutputError& e) {
    EXPECT_TRUE(test::starts_with(e.what(), "snapshot " + file + "/snaps: cannot create"))
        << e.what();
  }
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
    for (const StepState& s : t.history())
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
