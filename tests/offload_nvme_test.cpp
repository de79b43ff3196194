// The NVMe tier of the offload plugin (issue 34: optimizer = "nvme"), loaded by the real plugin
// host from the TOML list: the built-in optimizer's state lives in a file under nvme_path
// (core/run/state_file.h), streamed through two host buffers with io_uring at each update.
//  - bitwise the run without offload (losses, every weight): fp32, amp bf16, SGD with and without
//    momentum; with O_DIRECT (the test folder's file system, ext4 here; tmpfs from Linux 6.6) and
//    buffered (direct_io = false, and "auto" on a ramfs, which refuses O_DIRECT);
//  - a resume from a snapshot is bitwise (the state goes through the file's mapping);
//  - the host ledger by category equals the closed form (state_file_host_bytes, and the
//    planner's), the device holds no optimizer state;
//  - the file is made before step 1 at its full size and removed at the end of the run;
//  - a full disk stops the run before step 1 (exit 4), the snapshot it resumed from intact; a
//    missing or bad nvme_path and direct_io = true on a ramfs exit 2 naming the key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/optim/state_layout.h"
#include "core/report/advice.h"
#include "core/run/host_optimizer.h"
#include "core/run/state_file.h"
#include "core/run/trainer.h"
#include "tests/offload_outcome.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;

namespace headroom {
namespace {

std::string model_toml() {
  return "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n";
}

std::string train_toml(int steps, const std::string& extra = "") {
  return "[train]\nsteps = " + std::to_string(steps) +
         "\nmicro_batch = 4\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 2\ngrad_clip = 0.5\n" +
         extra;
}

std::string nvme_toml(const std::string& dir, const std::string& keys = "") {
  return "[[plugins]]\nname = \"offload\"\noptimizer = \"nvme\"\nnvme_path = \"" + dir + "\"\n" +
         keys;
}

std::string amp_toml() {
  return "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n";
}

uint64_t at(const ByCategory& b, Category c) {
  return b[int(c)];
}

using test::TmpfsDir;

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    out.push_back(e.path().filename().string());
  return out;
}

using test::expect_same_training;
using test::Outcome;

Outcome run(const std::string& toml) {
  return test::train_outcome(toml, true);  // with the --save-weights file
}

// The run with the state in `dir` against the run without offload: bitwise; the device holds no
// optimizer state; the host ledger is the closed form to the byte (the weights' and gradients'
// copies as on the host place, the two staging buffers for the state), and so is the planner's;
// nothing is left in `dir`.
void expect_nvme_is_bitwise(const std::string& base, const std::string& dir, int tensors,
                            Dtype state, const std::string& keys = "") {
  const Outcome plain = run(base);
  const std::string with = base + nvme_toml(dir, keys);
  const Outcome off = run(with);
  expect_same_training(plain, off);
  // amp with f32 masters: they are on the host too (host_optimizer.h), 4 bytes a parameter less
  // on the device.
  const bool masters = plain.segments.at(0).value_dtype == Dtype::kF32 &&
                       off.segments.at(0).value_dtype != Dtype::kF32;
  uint64_t psi = 0;
  std::vector<uint64_t> numels;
  std::vector<OptSegment> updated = off.segments;  // what the host updates: f32 with masters
  for (OptSegment& s : updated) {
    numels.push_back(s.numel);
    psi += s.numel;
    if (masters) s.value_dtype = Dtype::kF32;
  }
  for (int i = 0; i < kNumCategories; ++i) {
    if (category_at(i) == Category::kOptimizer) continue;
    // The parameters' own highest is at the init then, one layer's masters on their way to the
    // host (offload_test.cpp checks it): compared at the peak total.
    if (masters && category_at(i) == Category::kParameters) {
      EXPECT_EQ(off.device_at_peak[i] + 4 * psi, plain.device_at_peak[i]) << "parameters";
      continue;
    }
    EXPECT_EQ(off.device_peak[i], plain.device_peak[i]) << category_name(category_at(i));
  }
  EXPECT_EQ(at(off.device_peak, Category::kOptimizer), 0u);
  ByCategory closed = host_optimizer_bytes(off.segments, 0, state, masters);
  closed[int(Category::kOptimizer)] =
      state_file_host_bytes(numels, tensors, state, streams_in_pieces(updated, state));
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(off.host_peak[i], closed[i]) << "host " << category_name(category_at(i));
  const ByCategory planned = estimate_config(test::config_from(with)).peak.host;
  for (int i = 0; i < kNumCategories; ++i)
    EXPECT_EQ(planned[i], closed[i]) << "planned host " << category_name(category_at(i));
  EXPECT_TRUE(files_in(dir).empty()) << "the state file is removed at the end of the run";
  std::printf("host: parameters %llu, gradients %llu, optimizer %llu B (device optimizer %llu B)\n",
              (unsigned long long)at(off.host_peak, Category::kParameters),
              (unsigned long long)at(off.host_peak, Category::kGradients),
              (unsigned long long)at(off.host_peak, Category::kOptimizer),
              (unsigned long long)at(plain.device_peak, Category::kOptimizer));
}

TEST(OffloadNvme, Fp32IsBitwiseWithTheStateInAFile) {
  const std::string dir = test::temp_dir();
  expect_nvme_is_bitwise(model_toml() + train_toml(4), dir, 2, Dtype::kF32);
}

TEST(OffloadNvme, AmpBf16IsBitwiseWithTheStateInAFile) {
  const std::string dir = test::temp_dir();
  expect_nvme_is_bitwise(model_toml() + train_toml(4) + amp_toml(), dir, 2, Dtype::kF32);
  // bf16 state: its stochastic rounding streams per segment, as on the device.
  expect_nvme_is_bitwise(model_toml() + train_toml(3) + amp_toml() + "state_dtype = \"bf16\"\n",
                         dir, 2, Dtype::kBF16);
}

// A parameter larger than a piece (wte: 20000 x 64 = 1.28 M elements, kStateChunk 1 Mi): streamed
// in two pieces, bitwise, and the host holds two pieces' staging, not the whole wte's state.
TEST(OffloadNvme, ALargeParameterStreamsInPiecesBitwise) {
  const std::string dir = test::temp_dir();
  const std::string model =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 64\nseq_len = 16\nvocab_size = 20000\n";
  ASSERT_GT(uint64_t(20000 * 64), kStateChunk);
  expect_nvme_is_bitwise(model + train_toml(3), dir, 2, Dtype::kF32);
  const uint64_t piece = state_file_host_bytes({20000 * 64}, 2, Dtype::kF32, true);
  EXPECT_EQ(piece, 2 * (2 * kStateChunk * 4 + kStatePage));
  EXPECT_LT(piece, state_file_host_bytes({20000 * 64}, 2, Dtype::kF32, false));
  // With amp's bf16 state the update rounds stochastically: whole segments, bitwise still.
  expect_nvme_is_bitwise(model + train_toml(2) + amp_toml() + "state_dtype = \"bf16\"\n", dir, 2,
                         Dtype::kBF16);
}

TEST(OffloadNvme, SgdIsBitwiseWithAndWithoutMomentum) {
  const std::string dir = test::temp_dir();
  expect_nvme_is_bitwise(model_toml() + train_toml(3, "optimizer = \"sgd\"\nmomentum = 0.9\n"), dir,
                         1, Dtype::kF32);
  expect_nvme_is_bitwise(model_toml() + train_toml(2, "optimizer = \"sgd\"\n"), dir, 0,
                         Dtype::kF32);
}

// On tmpfs ("auto": O_DIRECT from Linux 6.6, buffered before) and buffered (direct_io = false):
// bitwise either way.
TEST(OffloadNvme, OnTmpfsAndBufferedIsBitwise) {
  TmpfsDir shm;
  ASSERT_FALSE(shm.path.empty());
  ASSERT_EQ(file_system_name(shm.path), "tmpfs");
  expect_nvme_is_bitwise(model_toml() + train_toml(3), shm.path, 2, Dtype::kF32);
  expect_nvme_is_bitwise(model_toml() + train_toml(3), shm.path, 2, Dtype::kF32,
                         "direct_io = false\n");
  const std::string dir = test::temp_dir();
  expect_nvme_is_bitwise(model_toml() + train_toml(3), dir, 2, Dtype::kF32, "direct_io = false\n");
}

// Runs `script` ($H: the host binary) with a ramfs (no O_DIRECT on any Linux) mounted at
// dir/ram in a mount namespace of its own; false when none can be mounted here.
bool on_ramfs(const std::string& dir, const std::string& script, test::RunResult* r) {
  fs::create_directories(dir + "/ram");
  const std::string mount = "mount -t ramfs ramfs " + dir + "/ram";
  if (test::run_command("unshare -m sh -c '" + mount + "'").exit_code != 0) return false;
  *r = test::run_command("unshare -m sh -c '" + mount + " && H=" + HEADROOM_BINARY + "; " + script +
                         "'");
  return true;
}

// A file system that refuses O_DIRECT: "auto" reads and writes buffered and says so once;
// direct_io = true is a config error naming the key and the file system.
TEST(OffloadNvme, DirectIoOnAFileSystemWithoutIt) {
  const std::string dir = test::temp_dir(), ram = dir + "/ram";
  const std::string base = model_toml() + train_toml(2);
  const std::string on =
      test::write_file(dir, "on.toml", base + nvme_toml(ram, "direct_io = true\n"));
  const std::string autod = test::write_file(dir, "auto.toml", base + nvme_toml(ram));
  test::RunResult r;
  if (!on_ramfs(dir,
                "$H train -q " + on + "; echo exit=$?; $H train " + autod +
                    "; echo exit=$?; ls -a " + ram,
                &r))
    GTEST_SKIP() << "no ramfs can be mounted here";
  EXPECT_TRUE(test::contains(r.output, "on.toml:")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "plugins.offload.direct_io: true, but \"" + ram +
                                           "\" is on ramfs, which refuses O_DIRECT"))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "exit=2\n")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "read and written buffered: ramfs refuses O_DIRECT"))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "step      2/2")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "exit=0\n.\n..\n")) << "trained, no file left: " << r.output;
}

// The file is there, whole, from before step 1 (made when the trainer is), and gone after.
TEST(OffloadNvme, TheFileIsMadeWholeBeforeStepOneAndRemovedAfter) {
  const std::string dir = test::temp_dir();
  {
    Trainer t(test::config_from(model_toml() + train_toml(1) + nvme_toml(dir)), TrainOptions{});
    const auto names = files_in(dir);
    ASSERT_EQ(names.size(), 1u);
    const std::string prefix = "headroom-" + std::to_string(getpid()) + "-";
    EXPECT_EQ(names[0].rfind(prefix, 0), 0u) << names[0];
    EXPECT_TRUE(names[0].size() > 15 && names[0].substr(names[0].size() - 15) == "-rank0.optstate")
        << names[0];
    uint64_t bytes = 0;
    for (const OptSegment& s : whole_params(t.model().params()))
      bytes += state_slot_bytes(s.numel, 2, Dtype::kF32);
    EXPECT_EQ(fs::file_size(dir + "/" + names[0]), bytes);
    t.run();
  }
  EXPECT_TRUE(files_in(dir).empty());
}

TEST(OffloadNvme, ResumeFromASnapshotIsBitwise) {
  const std::string dir = test::temp_dir();
  TmpfsDir shm;
  ASSERT_FALSE(shm.path.empty());
  for (const std::string& where : {dir, shm.path})
    for (const std::string& extra : {std::string(), amp_toml()}) {
      const std::string toml = model_toml() + train_toml(4) + extra + nvme_toml(where);
      Trainer whole(test::config_from(toml), TrainOptions{});
      whole.run();
      test::expect_resume_is_bitwise(toml, whole);
    }
}

// A snapshot of the run without offload resumes with the state in a file, and the other way.
TEST(OffloadNvme, SnapshotsMoveBetweenPlaces) {
  const std::string dir = test::temp_dir();
  const std::string plain = model_toml() + train_toml(4);
  Trainer whole(test::config_from(plain), TrainOptions{});
  whole.run();
  test::expect_resume_is_bitwise(plain + nvme_toml(dir), whole);
}

// Pruning resizes the parameters; the file's layout is fixed: refused, saying why.
TEST(OffloadNvme, PruningIsRefusedSayingWhy) {
  const std::string dir = test::temp_dir();
  const std::string cfg =
      test::write_file(dir, "prune.toml",
                       model_toml() + train_toml(3) + nvme_toml(dir) +
                           "[[plugins]]\nname = \"pruning\"\nmode = \"mlp\"\nfinal_sparsity = 0.5\n"
                           "start_step = 1\nend_step = 2\nevery = 1\n");
  const auto r = test::run_headroom("train -q " + cfg);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::contains(r.output, "resizing with it is not built yet")) << r.output;
  EXPECT_EQ(files_in(dir).size(), 1u) << "only the config: the state file is removed";
}

TEST(OffloadNvme, PlanPrintsTheHostLedger) {
  const std::string dir = test::temp_dir();
  const std::string cfg =
      test::write_file(dir, "plan.toml", model_toml() + train_toml(1) + nvme_toml(dir));
  const auto r = test::run_headroom("plan " + cfg);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(test::contains(r.output, "estimated host memory")) << r.output;
  const ByCategory host = estimate_config(test::config_from(test::read_file(cfg))).peak.host;
  EXPECT_TRUE(test::contains(r.output, format_bytes(at(host, Category::kOptimizer)))) << r.output;
}

TEST(OffloadNvme, BadKeysExit2NamingTheKey) {
  const std::string dir = test::temp_dir();
  TmpfsDir shm;
  ASSERT_FALSE(shm.path.empty());
  const std::string base = model_toml() + train_toml(1);
  struct Bad {
    std::string toml, expect;
  };
  const std::string offload = "[[plugins]]\nname = \"offload\"\n";
  for (const Bad& bad : std::vector<Bad>{
           {offload + "optimizer = \"nvme\"\n",
            "plugins.offload.optimizer: \"nvme\" needs nvme_path"},
           {nvme_toml(dir + "/missing"),
            "plugins.offload.nvme_path: \"" + dir + "/missing\": No such file or directory"},
           {nvme_toml(dir + "/bad.toml"), "is not a folder"},
           {nvme_toml(dir, "direct_io = \"yes\"\n"), "plugins.offload.direct_io: valid: \"auto\""},
           {offload + "optimizer = \"host\"\nnvme_path = \"" + dir + "\"\n",
            "plugins.offload.nvme_path: is for optimizer = \"nvme\""},
       }) {
    const std::string cfg = test::write_file(dir, "bad.toml", base + bad.toml);
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, bad.expect)) << bad.toml << r.output;
    EXPECT_TRUE(test::contains(r.output, "bad.toml:")) << "names the file: " << r.output;
  }
  // A folder nobody may write (root writes anywhere: checked only for another user).
  if (geteuid() != 0) {
    fs::create_directories(dir + "/ro");
    fs::permissions(dir + "/ro", fs::perms::owner_read | fs::perms::owner_exec);
    const std::string cfg = test::write_file(dir, "ro.toml", base + nvme_toml(dir + "/ro"));
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(test::contains(r.output, "is not writable")) << r.output;
  }
  // direct_io = true where O_DIRECT works, and false anywhere: they train.
  if (file_system_name(dir) != "tmpfs") {
    const std::string cfg =
        test::write_file(dir, "on.toml", base + nvme_toml(dir, "direct_io = true\n"));
    const auto r = test::run_headroom("train " + cfg + " -q");
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  const std::string off =
      test::write_file(dir, "off.toml", base + nvme_toml(shm.path, "direct_io = false\n"));
  const auto r = test::run_headroom("train " + off);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(test::contains(r.output, "refuses O_DIRECT")) << "asked for buffered: " << r.output;
}

// A disk too small for the state (an 8 KiB tmpfs, the mechanism of tests/faults_test.cpp): the
// file is preallocated whole when the run starts, so the run stops before step 1 (exit 4) naming
// the file and the reason, leaves no file behind, and the snapshot it resumed from still loads.
TEST(OffloadNvme, FullDiskExits4BeforeStepOneAndLosesNothing) {
  const std::string dir = test::temp_dir();
  const std::string small = dir + "/small", snaps = dir + "/snaps";
  fs::create_directories(small);
  const std::string cfg =
      test::write_file(dir, "full.toml",
                       model_toml() + train_toml(4) + "[snapshot]\nevery = 2\ndir = \"" + snaps +
                           "\"\n" + nvme_toml(small));
  // Two steps with the state on the big disk first: the snapshot to resume from.
  const std::string first =
      test::write_file(dir, "first.toml",
                       model_toml() + train_toml(2) + "[snapshot]\nevery = 2\ndir = \"" + snaps +
                           "\"\n" + nvme_toml(dir));
  auto r = test::run_headroom("train -q " + first);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string snap = snaps + "/step_000000000002.hrsnap";
  ASSERT_TRUE(fs::exists(snap));
  const std::string before = test::read_file(snap);
  const std::string h = HEADROOM_BINARY;
  const std::string script =
      h + " train -q " + cfg + " --resume " + snaps + "; echo exit=$?; ls -a " + small;
  std::string how;
  r = test::run_on_a_full_disk(small, script, &how);
  EXPECT_TRUE(test::contains(r.output, "exit=4")) << how << ": " << r.output;
  EXPECT_TRUE(test::contains(r.output, "optimizer state file " + small + "/headroom-")) << r.output;
  EXPECT_TRUE(
      test::contains(r.output, how == "tmpfs" ? "No space left on device" : "File too large"))
      << r.output;
  EXPECT_TRUE(test::contains(r.output, "exit=4\n.\n..\n")) << "no file left: " << r.output;
  EXPECT_FALSE(test::contains(r.output, "step 3")) << "stopped before a step: " << r.output;
  // Nothing lost: the snapshot is as it was, and a run with room resumes from it.
  EXPECT_TRUE(test::read_file(snap) == before);
  const std::string roomy =
      test::write_file(dir, "roomy.toml",
                       model_toml() + train_toml(4) + "[snapshot]\nevery = 0\ndir = \"" + snaps +
                           "\"\n" + nvme_toml(dir));
  r = test::run_headroom("train -q " + roomy + " --resume " + snaps);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// plan --measure's dry runs move no state: the file gets its size and no blocks, so the plan of a
// state far larger than the disk (the same 8 KiB tmpfs) measures, and leaves no file.
TEST(OffloadNvme, APlanMeasureWritesNoStateToTheDisk) {
  const std::string dir = test::temp_dir();
  const std::string small = dir + "/small";
  fs::create_directories(small);
  const std::string cfg =
      test::write_file(dir, "plan.toml", model_toml() + train_toml(4) + nvme_toml(small));
  const std::string mount = "mount -t tmpfs -o size=8k tmpfs " + small;
  if (test::run_command("unshare -m sh -c '" + mount + "'").exit_code != 0)
    GTEST_SKIP() << "no tmpfs can be mounted here (unshare -m)";
  const test::RunResult r =
      test::run_command("unshare -m sh -c '" + mount + " && " + HEADROOM_BINARY +
                        " plan --measure " + cfg + "; echo exit=$?; ls -a " + small + "'");
  EXPECT_TRUE(test::contains(r.output, "exit=0\n.\n..\n")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "host ledger")) << r.output;
}

}  // namespace
}  // namespace headroom
