// The faults a user can cause, through the host binary as they meet them: setup steps that fail
// (weights that do not load, a plugin or data that does not start), signals during a step and
// during a snapshot, a full disk, output paths that cannot be written, and a run that diverges.
// Each ends in a clear message, its documented exit code (docs/guide/exit-codes.md), and no file
// written half.
#include <gtest/gtest.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/os/interrupt.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using test::contains;
using test::run_command;
using test::run_headroom;
using test::write_file;

// Small and fast; a constant learning rate, so that a run's steps do not depend on train.steps.
const char* kModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 256\n"
    "[train]\nmicro_batch = 2\nlr_schedule = \"constant\"\nwarmup_steps = 0\nlr = 1e-3\n";

struct Faults : ::testing::Test {
  std::string dir = test::temp_dir();
  std::string config(const std::string& extra, const std::string& name = "run.toml") {
    return write_file(dir, name, std::string(kModel) + extra);
  }
  // Files in `d` whose name marks a temporary (".NAME.tmp"): an output written half.
  static std::vector<std::string> temporaries(const std::string& d) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(d, ec))
      if (e.path().extension() == ".tmp") out.push_back(e.path().string());
    return out;
  }
};

std::vector<nlohmann::json> metrics_lines(const std::string& path, std::string* error) {
  std::vector<nlohmann::json> out;
  std::istringstream in(test::read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const std::exception& e) {
      *error = "line " + std::to_string(out.size() + 1) + " is not JSON: " + line;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// 1. Setup steps that throw: every one ends in its message and exit 2, never a crash.

// A safetensors file from a header and a data section.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string s(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i)
    s[i] = char(uint8_t(n >> (8 * i)));
  return s + header + data;
}

struct InitFromCase {
  const char* name;
  const char* expect;  // part of the loader's message
  // The file's bytes, from the weights a real run wrote (or "" for no file at all).
  std::string (*make)(const std::string& valid, const std::string& other_model);
};

std::string header_of(const std::string& valid) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= uint64_t(uint8_t(valid[i])) << (8 * i);
  return valid.substr(8, n);
}
std::string data_of(const std::string& valid) {
  return valid.substr(8 + header_of(valid).size());
}
// The valid file with its header edited.
std::string edited(const std::string& valid, void (*edit)(nlohmann::json&)) {
  nlohmann::json h = nlohmann::json::parse(header_of(valid));
  edit(h);
  return safetensors_bytes(h.dump(), data_of(valid));
}

const InitFromCase kInitFromCases[] = {
    {"Missing", "cannot open",
     [](const std::string&, const std::string&) { return std::string(); }},
    {"Truncated", "",
     [](const std::string& v, const std::string&) { return v.substr(0, v.size() / 2); }},
    {"HeaderLength2To63", "header",
     [](const std::string& v, const std::string&) {
       std::string s = v;
       for (int i = 0; i < 7; ++i)
         s[i] = 0;
       s[7] = char(0x80);
       return s;
     }},
    {"HeaderNotAnObject", "",
     [](const std::string& v, const std::string&) {
       return safetensors_bytes("[1, 2, 3]", data_of(v));
     }},
    {"OverlappingOffsets", "overlap",
     [](const std::string& v, const std::string&) {
       return edited(v, [](nlohmann::json& h) {
         h["h.0.ln_1.bias"]["data_offsets"] = h["h.0.ln_1.weight"]["data_offsets"];
       });
     }},
    {"BadDtype", "dtype",
     [](const std::string& v, const std::string&) {
       return edited(v, [](nlohmann::json& h) { h["wte.weight"]["dtype"] = "Q7"; });
     }},
    {"WrongShape", "shape",
     [](const std::string& v, const std::string&) {
       return edited(v, [](nlohmann::json& h) { h["wpe.weight"]["shape"] = {32, 16}; });
     }},
    {"AnotherModel", "", [](const std::string&, const std::string& other) { return other; }},
};

class InitFrom : public Faults, public ::testing::WithParamInterface<InitFromCase> {};

TEST_P(InitFrom, FailingToLoadExits2WithTheLoadersMessage) {
  // Real weights of this model and of a wider one, as `--save-weights` writes them.
  const std::string cfg = config("steps = 1\n");
  const std::string valid_path = dir + "/valid.safetensors";
  const std::string other_path = dir + "/other.safetensors";
  ASSERT_EQ(run_headroom("train -q " + cfg + " --save-weights " + valid_path).exit_code, 0);
  ASSERT_EQ(run_headroom("train -q " + cfg + " --set model.n_embd=64 --save-weights " + other_path)
                .exit_code,
            0);
  const std::string bytes =
      GetParam().make(test::read_file(valid_path), test::read_file(other_path));
  const std::string bad = dir + "/bad.safetensors";
  if (!bytes.empty()) std::ofstream(bad, std::ios::binary) << bytes;

  const auto r = run_headroom("train " + cfg + " --set 'train.init_from=\"" + bad + "\"'");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(contains(r.output, "train.init_from")) << r.output;
  EXPECT_TRUE(contains(r.output, bad)) << r.output;
  EXPECT_TRUE(contains(r.output, GetParam().expect)) << r.output;
  EXPECT_FALSE(contains(r.output, "step ")) << "no step ran: " << r.output;
}

INSTANTIATE_TEST_SUITE_P(Cases, InitFrom, ::testing::ValuesIn(kInitFromCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The other setup steps that can throw after something was built: data, plugins, the metrics file.
TEST_F(Faults, EverySetupStepThatThrowsExits2WithItsMessage) {
  struct Case {
    std::string extra, flags, expect;
  };
  const std::string metrics_dir = dir + "/metrics-is-a-folder";
  fs::create_directories(metrics_dir);
  const Case cases[] = {
      {"steps = 2\n[data]\nkind = \"text\"\npath = \"absent.txt\"\n", "", "absent.txt"},
      {"steps = 2\n[[plugins]]\nname = \"amp\"\ndtypo = \"bf16\"\n", "", "dtypo"},
      {"steps = 2\n[[plugins]]\nname = \"no_such_plugin\"\n", "", "no_such_plugin"},
      {"steps = 2\n", "--metrics " + metrics_dir, "is a folder"},
  };
  for (const Case& c : cases) {
    const std::string cfg = config(c.extra);
    const auto r = run_headroom("train " + cfg + " " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.extra << r.output;
    EXPECT_TRUE(contains(r.output, c.expect)) << r.output;
    EXPECT_TRUE(contains(r.output, "headroom: error: ")) << r.output;
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Signals

// Starts `command` in the background, waits until `ready` (a shell test) holds, sends the
// signals, and prints "exit=N" with the command's exit code. Bounded: gives up after 120 s.
std::string signal_script(const std::string& command, const std::string& ready,
                          const std::string& signals) {
  return "bash -c '" + command + " & pid=$!; for i in $(seq 1 2400); do if " + ready +
         "; then break; fi; kill -0 $pid 2>/dev/null || break; sleep 0.05; done; " + signals +
         "; wait $pid; echo \"exit=$?\"'";
}

int exit_of(const std::string& output) {
  const size_t at = output.rfind("exit=");
  return at == std::string::npos ? -1 : std::atoi(output.c_str() + at + 5);
}

// The final loss of a metrics file.
double last_loss(const std::string& path, int64_t* step) {
  std::string error;
  const auto lines = metrics_lines(path, &error);
  if (lines.empty() || !error.empty()) return NAN;
  *step = lines.back()["step"].get<int64_t>();
  return lines.back()["loss"].get<double>();
}

// A run sent SIGINT once its third step is logged, then resumed. `extra`: more of its config.
void sigint_during_a_step(Faults& f, const std::string& extra) {
  const std::string& dir = f.dir;
  const std::string snaps = dir + "/snaps";
  const std::string cfg = f.config(
      "steps = 1000000\ngrad_accum = 2\n[snapshot]\nevery = 50\ndir = \"" + snaps + "\"\n" + extra);
  const std::string m = dir + "/m.jsonl", tl = dir + "/t.html", tr = dir + "/a.trace";
  const std::string cmd = std::string(HEADROOM_BINARY) + " train -q " + cfg + " --metrics " + m +
                          " --memory-timeline " + tl + " --record-allocs " + tr;
  const auto r = run_command(
      signal_script(cmd, "[ $(wc -l < " + m + " 2>/dev/null || echo 0) -ge 3 ]", "kill -INT $pid"));
  EXPECT_EQ(exit_of(r.output), 130) << r.output;
  EXPECT_TRUE(contains(r.output, "stopped by SIGINT")) << r.output;
  EXPECT_TRUE(contains(r.output, "resume with --resume " + snaps)) << r.output;

  // Metrics: every line whole; the timeline drawn up to now; the trace closed and replayable.
  std::string error;
  const auto lines = metrics_lines(m, &error);
  EXPECT_TRUE(error.empty()) << error;
  ASSERT_GE(lines.size(), 3u);
  const int64_t done = lines.back()["step"].get<int64_t>();
  const std::string html = test::read_file(tl);
  EXPECT_TRUE(contains(html, "</html>")) << "timeline of " << html.size() << " bytes";
  const auto replay = run_headroom("replay " + tr);
  EXPECT_EQ(replay.exit_code, 0) << replay.output;
  EXPECT_TRUE(Faults::temporaries(dir).empty());

  // The final snapshot holds the last completed step, and resuming from it computes exactly what
  // an unbroken run does.
  const std::string snap = snaps + "/step_" + std::string(12 - std::to_string(done).size(), '0') +
                           std::to_string(done) + ".hrsnap";
  EXPECT_TRUE(fs::exists(snap)) << r.output;
  const int64_t until = done + 3;
  const std::string m2 = dir + "/m2.jsonl", m3 = dir + "/m3.jsonl";
  const auto resumed =
      run_headroom("train -q " + cfg + " --set train.steps=" + std::to_string(until) +
                   " --resume " + snaps + " --metrics " + m2);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto whole =
      run_headroom("train -q " + cfg + " --set train.steps=" + std::to_string(until) +
                   " --set snapshot.every=0 --metrics " + m3);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  int64_t s2 = 0, s3 = 0;
  const double a = last_loss(m2, &s2), b = last_loss(m3, &s3);
  EXPECT_EQ(s2, until);
  EXPECT_EQ(s3, until);
  EXPECT_EQ(a, b) << "the resumed run's step " << until << " loss differs";
}

TEST_F(Faults, SigintDuringAStepWritesWhatTheRunHasAndExits130) {
  sigint_during_a_step(*this, "");
}

// The same with the loader's worker threads prefetching when the signal comes (the signal may land
// on one of them): the snapshot records the batch the loop reads next, not one a worker read ahead,
// so the resumed run is still the unbroken one.
TEST_F(Faults, SigintWithPrefetchWorkersWritesWhatTheRunHasAndResumesExactly) {
  sigint_during_a_step(*this, "[data]\nworkers = 2\nprefetch = 3\n");
}

// SIGTERM during an evaluation waited for the whole of it (49 s in the report): the evaluation
// checks for a stop between its batches, leaves the step's validation uncounted, and the run stops
// at its next safe point with the step done.
TEST_F(Faults, SigtermDuringAnEvaluationStopsBetweenItsBatches) {
  const std::string snaps = dir + "/snaps";
  const std::string cfg = config(
      "steps = 1000000\neval_every = 2\neval_batches = 1000000\n"
      "[snapshot]\nevery = 100\ndir = \"" +
      snaps + "\"\n");
  const std::string m = dir + "/m.jsonl";
  const std::string cmd = std::string(HEADROOM_BINARY) + " train " + cfg + " --metrics " + m;
  // Step 1's line is written; step 2 trains in milliseconds, then its evaluation runs for minutes.
  const auto r = run_command(signal_script(
      cmd, "[ $(wc -l < " + m + " 2>/dev/null || echo 0) -ge 1 ]", "sleep 1; kill -TERM $pid"));
  EXPECT_EQ(exit_of(r.output), 143) << r.output;
  EXPECT_TRUE(contains(r.output, "validation after step 2: stopped by SIGTERM after ")) << r.output;
  EXPECT_TRUE(contains(r.output, " of 1000000 batches; not counted")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "stopped by SIGTERM before step 3 of 1000000; 2 steps done; "
                       "snapshot " +
                           snaps + "/step_000000000002.hrsnap written"))
      << r.output;
  std::string error;
  const auto lines = metrics_lines(m, &error);
  EXPECT_TRUE(error.empty()) << error;
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_FALSE(lines[1].contains("val_loss")) << "an evaluation cut short is not counted";
}

// A run that snapshots every step, writing slowly (at least a second a snapshot), sent `signals`
// as soon as its second snapshot is being written.
struct SlowSnapshots {
  std::string snaps, cfg;
  test::RunResult signalled;
};
SlowSnapshots signal_during_snapshot(Faults& f, const std::string& signals) {
  SlowSnapshots s;
  s.snaps = f.dir + "/snaps";
  s.cfg =
      f.config("steps = 1000000\n[snapshot]\nevery = 1\nkeep = 100\ndir = \"" + s.snaps + "\"\n");
  const std::string cmd =
      "HEADROOM_TEST_WRITE_DELAY_MS=10 " + std::string(HEADROOM_BINARY) + " train -q " + s.cfg;
  const std::string writing = "[ -e " + s.snaps + "/.step_000000000002.hrsnap.tmp ]";
  s.signalled = run_command(signal_script(cmd, writing, signals));
  return s;
}

TEST_F(Faults, SigtermDuringASnapshotFinishesItThenExits143) {
  const SlowSnapshots s = signal_during_snapshot(*this, "kill -TERM $pid");
  const std::string& out = s.signalled.output;
  EXPECT_EQ(exit_of(out), 143) << out;
  EXPECT_TRUE(contains(out, "stopped by SIGTERM")) << out;
  EXPECT_TRUE(fs::exists(s.snaps + "/step_000000000002.hrsnap")) << "the write was finished";
  EXPECT_TRUE(temporaries(s.snaps).empty());
  const auto resumed =
      run_headroom("train -q " + s.cfg + " --set train.steps=4 --resume " + s.snaps);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
}

TEST_F(Faults, SecondSignalDuringASnapshotExitsAtOnceAndThePreviousStaysLoadable) {
  const SlowSnapshots s =
      signal_during_snapshot(*this, "kill -INT $pid; sleep 0.2; kill -INT $pid");
  const std::string& out = s.signalled.output;
  EXPECT_EQ(exit_of(out), 130) << out;
  EXPECT_TRUE(contains(out, "second signal")) << out;
  EXPECT_FALSE(fs::exists(s.snaps + "/step_000000000002.hrsnap")) << "cut off while written";
  EXPECT_TRUE(fs::exists(s.snaps + "/step_000000000001.hrsnap"));
  const auto resumed = run_headroom("train " + s.cfg + " --set train.steps=3 --resume " + s.snaps);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "step_000000000001.hrsnap")) << resumed.output;
}

TEST_F(Faults, SigintWhileShardingLeavesNoShard) {
  std::string text;
  for (int i = 0; i < 20000; ++i)
    text += "a line of text to shard, number " + std::to_string(i) + "\n";
  const std::string txt = write_file(dir, "corpus.txt", text);
  const std::string out = dir + "/out";
  // Slow writes: the signal comes after two shards of many.
  const std::string cmd = "HEADROOM_TEST_WRITE_DELAY_MS=10 " + std::string(HEADROOM_BINARY) +
                          " shard " + txt + " " + out + " --tokens-per-shard 2048";
  const auto r =
      run_command(signal_script(cmd, "[ -e " + out + "/shard_000001.bin ]", "kill -INT $pid"));
  EXPECT_EQ(exit_of(r.output), 130) << r.output;
  EXPECT_TRUE(contains(r.output, "shard: stopped by SIGINT")) << r.output;
  std::error_code ec;
  EXPECT_TRUE(fs::is_empty(out, ec)) << "no shard and no temporary left";
}

// In process, at an exact point: a stop between the micro-steps of a step drops them, snapshots
// the step before, and the resumed run is bitwise the unbroken one.
class StopAt final : public EventListener {
 public:
  StopAt(int64_t step, int micro_step) : step_(step), micro_step_(micro_step) {}
  void on_event(const EventInfo& e) override {
    if (e.event == Event::kForwardBegin && e.layer == 0 && e.step == step_ &&
        e.micro_step == micro_step_)
      request_stop(SIGINT);
  }

 private:
  int64_t step_;
  int micro_step_;
};

std::vector<double> losses_of(const Trainer& t) {
  std::vector<double> out;
  for (const StepState& r : t.history())
    out.push_back(r.loss);
  return out;
}

TEST_F(Faults, StopBetweenMicroStepsResumesBitwise) {
  const std::string snaps = dir + "/snaps";
  const Config c = test::config_from(std::string(kModel) +
                                     "steps = 8\ngrad_accum = 3\n[snapshot]\nevery = 100\n"
                                     "dir = \"" +
                                     snaps + "\"\n[data]\nworkers = 2\n");
  Config whole_config = c;
  whole_config.snapshot.every = 0;
  Trainer whole(whole_config, TrainOptions{});
  whole.run();

  clear_stop();
  std::vector<double> first;
  {
    Trainer t(c, TrainOptions{});
    StopAt stop(5, 1);  // asked during step 5's first micro-step: stops at its end
    t.add_listener(&stop);
    try {
      t.run();
      FAIL() << "the run did not stop";
    } catch (const Interrupted& e) {
      EXPECT_EQ(e.exit_code(), 130);
      EXPECT_TRUE(contains(e.what(), "in step 5 (its 1 of 3 micro-steps are dropped)")) << e.what();
      EXPECT_TRUE(contains(e.what(), "step_000000000004.hrsnap written")) << e.what();
    }
    first = losses_of(t);
  }
  clear_stop();
  TrainOptions o;
  o.resume_dir = snaps;
  Trainer resumed(c, std::move(o));
  resumed.run();
  std::vector<double> all = first;
  for (double l : losses_of(resumed))
    all.push_back(l);
  EXPECT_EQ(all, losses_of(whole));
}

// ---------------------------------------------------------------------------------------------
// 4. A full disk

// Runs the shell commands `script` ($H: the host binary) with a tmpfs of `kib` KiB mounted at
// dir/small, in a mount namespace of their own or, where that cannot be done, under a file-size
// limit of `kib` KiB; *how says which.
test::RunResult run_on_small_disk(const std::string& dir, const std::string& script, int kib,
                                  std::string* how) {
  const std::string small = dir + "/small";
  fs::create_directories(small);
  const std::string commands = "H=" + std::string(HEADROOM_BINARY) + "; " + script;
  const std::string mount = "mount -t tmpfs -o size=" + std::to_string(kib) + "k tmpfs " + small;
  if (run_command("unshare -m sh -c '" + mount + "'").exit_code == 0) {
    *how = "tmpfs";
    return run_command("unshare -m sh -c '" + mount + " && " + commands + "'");
  }
  *how = "ulimit -f";
  return run_command("bash -c 'ulimit -f " + std::to_string(kib) + "; " + commands + "'");
}

std::string disk_full_reason(const std::string& how) {
  return how == "tmpfs" ? "No space left on device" : "File too large";
}

TEST_F(Faults, FullDiskForMetricsExits4NamingTheFileAndReason) {
  const std::string cfg = config("steps = 3\n");
  const auto r = run_headroom("train -q " + cfg + " --metrics /dev/full");
  EXPECT_EQ(r.exit_code, 4) << r.output;
  EXPECT_TRUE(contains(r.output, "--metrics /dev/full")) << r.output;
  EXPECT_TRUE(contains(r.output, "No space left on device")) << r.output;
}

// The metrics on a disk that fills up mid-run: the line the disk took part of is cut off again, so
// every line of the file is whole JSON (the 15th line was half a record, exit 4).
TEST_F(Faults, FullDiskForMetricsLeavesOnlyWholeLines) {
  const std::string cfg = config("steps = 200\n");
  const std::string m = dir + "/small/m.jsonl", copy = dir + "/m-copy.jsonl";
  std::string how;
  const auto r = run_on_small_disk(
      dir, "$H train -q " + cfg + " --metrics " + m + "; echo exit=$?; cp " + m + " " + copy, 8,
      &how);
  EXPECT_TRUE(contains(r.output, "exit=4")) << how << ": " << r.output;
  EXPECT_TRUE(contains(r.output, "--metrics " + m + ": write failed: " + disk_full_reason(how)))
      << r.output;
  const std::string text = test::read_file(copy);
  ASSERT_FALSE(text.empty()) << r.output;
  EXPECT_EQ(text.back(), '\n') << "the file ends on a whole line";
  std::string error;
  const auto lines = metrics_lines(copy, &error);
  EXPECT_TRUE(error.empty()) << error;
  EXPECT_GE(lines.size(), 5u);
  EXPECT_LT(lines.size(), 200u);
  for (size_t i = 0; i < lines.size(); ++i)
    EXPECT_EQ(lines[i]["step"].get<int64_t>(), int64_t(i) + 1);
}

TEST_F(Faults, FullDiskForAtomicOutputsLeavesNoPartialFile) {
  const std::string cfg = config("steps = 2\n");
  // The weights (460 KiB) and the timeline (15 KiB) do not fit in 8 KiB.
  for (const std::string flag : {"--save-weights", "--memory-timeline"}) {
    const std::string out = dir + "/small/out";
    std::string how;
    const auto r = run_on_small_disk(
        dir, "$H train -q " + cfg + " " + flag + " " + out + " --set model.n_embd=64", 8, &how);
    EXPECT_EQ(r.exit_code, 4) << how << ": " << r.output;
    EXPECT_TRUE(contains(r.output, flag + " " + out) || contains(r.output, "weights " + out))
        << r.output;
    EXPECT_TRUE(contains(r.output, disk_full_reason(how))) << r.output;
    EXPECT_FALSE(fs::exists(out));
    EXPECT_TRUE(temporaries(dir + "/small").empty());
  }
}

TEST_F(Faults, FullDiskForASnapshotExits4AndKeepsThePreviousOne) {
  // One snapshot (about 400 KiB) fits in 600 KiB, two do not.
  const std::string snaps = dir + "/small/snaps";
  const std::string cfg =
      config("steps = 5\n[snapshot]\nevery = 1\nkeep = 100\ndir = \"" + snaps + "\"\n");
  std::string how;
  const auto r = run_on_small_disk(
      dir,
      "$H train -q " + cfg + "; echo exit=$?; ls -a " + snaps + "; $H train -q " + cfg +
          " --set snapshot.every=0 --set train.steps=2 --resume " + snaps + "; echo resumed=$?",
      600, &how);
  // A file-size limit holds each file, not the folder: it cannot make the second one fail.
  if (how != "tmpfs") GTEST_SKIP() << "no tmpfs can be mounted here";
  EXPECT_TRUE(contains(r.output, "exit=4")) << r.output;
  EXPECT_TRUE(contains(r.output, "snapshot " + snaps + "/step_000000000002.hrsnap")) << r.output;
  EXPECT_TRUE(contains(r.output, disk_full_reason(how))) << r.output;
  EXPECT_TRUE(contains(r.output, "step_000000000001.hrsnap\n")) << r.output;
  EXPECT_FALSE(contains(r.output, ".tmp\n")) << "no temporary left: " << r.output;
  EXPECT_TRUE(contains(r.output, "resumed=0")) << "the previous one loads: " << r.output;
}

TEST_F(Faults, FullDiskForShardsExits4AndLeavesNoShard) {
  std::string text;
  for (int i = 0; i < 2000; ++i)
    text += "some text to shard, line " + std::to_string(i) + "\n";
  const std::string txt = write_file(dir, "corpus.txt", text);
  std::string how;
  const auto r = run_on_small_disk(
      dir, "$H shard " + txt + " " + dir + "/small/out --tokens-per-shard 100000", 32, &how);
  EXPECT_EQ(r.exit_code, 4) << how << ": " << r.output;
  EXPECT_TRUE(contains(r.output, "shard " + dir + "/small/out/shard_0000")) << r.output;
  EXPECT_TRUE(contains(r.output, disk_full_reason(how))) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/small/out/shard_000000.bin"));
}

// A target that is not a regular file is written in place: a rename over /dev/null would replace
// the device with a file.
TEST_F(Faults, OutputsToADeviceAreWrittenInPlace) {
  const std::string cfg = config("steps = 2\n");
  const auto r = run_headroom("train -q " + cfg +
                              " --save-weights /dev/null --memory-timeline /dev/null "
                              "--metrics /dev/null --record-allocs /dev/null");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  EXPECT_FALSE(fs::exists("/dev/.null.tmp"));
  const auto full = run_headroom("train -q " + cfg + " --save-weights /dev/full");
  EXPECT_EQ(full.exit_code, 4) << full.output;
  EXPECT_TRUE(contains(full.output, "weights /dev/full: write failed: No space left on device"))
      << full.output;
  EXPECT_TRUE(fs::is_character_file("/dev/full"));
}

// ---------------------------------------------------------------------------------------------
// 5. Output paths are checked before step 1

TEST_F(Faults, UnwritableOutputPathsFailBeforeTheFirstStep) {
  write_file(dir, "a-file", "x");
  const std::string cfg = config("steps = 2\n");
  const std::pair<std::string, std::string> cases[] = {
      {"--save-weights " + dir + "/missing/w.safetensors", "does not exist"},
      {"--metrics " + dir + "/a-file/m.jsonl", "not a folder"},
      {"--memory-timeline " + dir, "is a folder"},
      {"--record-allocs " + dir + "/missing/a.trace", "does not exist"},
      {"--set 'snapshot.dir=\"" + dir + "/a-file/snaps\"' --set snapshot.every=1", "is a file"},
      {"--resume " + dir + "/no-snapshots", "not a folder of snapshots"},
  };
  for (const auto& [flags, expect] : cases) {
    const auto r = run_headroom("train " + cfg + " " + flags);
    EXPECT_EQ(r.exit_code, 2) << flags << ": " << r.output;
    EXPECT_TRUE(contains(r.output, expect)) << r.output;
    EXPECT_FALSE(contains(r.output, "step      1")) << "failed before step 1: " << r.output;
    EXPECT_FALSE(contains(r.output, "headroom: model")) << "before the run began: " << r.output;
  }
}

// ---------------------------------------------------------------------------------------------
// 6. Divergence

TEST_F(Faults, DivergedRunStopsNamingTheStepAndKeepsTheLastSnapshot) {
  const std::string snaps = dir + "/snaps";
  const std::string cfg = config("steps = 20\ngrad_clip = 0.0\n[snapshot]\nevery = 1\ndir = \"" +
                                 snaps + "\"\nkeep = 100\n");
  const std::string m = dir + "/m.jsonl";
  const auto r = run_headroom("train " + cfg + " --set train.lr=1e30 --metrics " + m);
  EXPECT_EQ(r.exit_code, 5) << r.output;
  EXPECT_TRUE(contains(r.output, "training diverged at step ")) << r.output;
  EXPECT_TRUE(contains(r.output, "the last good snapshot is " + snaps)) << r.output;
  std::string error;
  const auto lines = metrics_lines(m, &error);
  EXPECT_TRUE(error.empty()) << error;
  ASSERT_FALSE(lines.empty());
  const int64_t bad = lines.back()["step"].get<int64_t>();
  EXPECT_TRUE(contains(r.output, "diverged at step " + std::to_string(bad))) << r.output;
  // No snapshot of the diverged step; the one before it is whole.
  int64_t newest = 0;
  for (const auto& e : fs::directory_iterator(snaps))
    if (e.path().extension() == ".hrsnap")
      newest = std::max<int64_t>(newest, std::stoll(e.path().stem().string().substr(5)));
  EXPECT_EQ(newest, bad - 1);
}

}  // namespace
}  // namespace headroom
