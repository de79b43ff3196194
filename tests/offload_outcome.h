// What the offload tests (tests/offload*_test.cpp) compare: one training run's losses, weights,
// bytes and segments, and the check that two runs trained bitwise alike.
#pragma once

#include <gtest/gtest.h>

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace test {

struct Outcome {
  std::vector<double> losses;
  std::string saved;  // the --save-weights file (the f32 masters), when asked for
  std::vector<std::vector<unsigned char>> weights;  // every parameter's updated values (masters)
  std::vector<std::vector<unsigned char>> compute;  // and what the layers read
  ByCategory device_peak{};
  ByCategory device_at_peak{};  // the device's categories at its peak total
  ByCategory host_peak{};       // the host ledger's at its peak total (what plan --measure reads)
  uint64_t largest_layer = 0;   // the most parameter elements one layer has
  uint64_t device_peak_total = 0;
  uint64_t host_allocs = 0;
  std::vector<OptSegment> segments;
};

inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Trains `toml` to its end; with `save`, keeps the --save-weights file's bytes.
inline Outcome train_outcome(const std::string& toml, bool save = false) {
  TrainOptions o;
  const std::string path = save ? test::temp_dir() + "/w.safetensors" : "";
  o.save_weights_path = path;
  Trainer t(test::config_from(toml), std::move(o));
  t.run();
  Outcome r;
  if (save) r.saved = file_bytes(path);
  for (const StepState& s : t.history())
    r.losses.push_back(s.loss);
  for (Param<float>* p : t.model().params()) {
    const auto bytes = [](const void* data, uint64_t n) {
      const auto* b = static_cast<const unsigned char*>(data);
      return std::vector<unsigned char>(b, b + n);
    };
    const auto m = p->optimized();
    r.weights.push_back(bytes(m.value, p->numel * dtype_size(m.dtype)));
    r.compute.push_back(bytes(p->compute().value, p->numel * dtype_size(p->compute_dtype)));
  }
  r.device_peak = t.device().tracker().peak_by_category();
  r.device_peak_total = t.device().tracker().peak_total();
  r.device_at_peak = t.device().tracker().live_at_peak();
  for (const auto& layer : t.model().layers())
    r.largest_layer = std::max(r.largest_layer, layer->flat().numel);
  r.host_peak = t.device().host_place()->tracker().live_at_peak();
  r.host_allocs = t.device().host_place()->tracker().num_allocs();
  r.segments = whole_params(t.model().params());
  return r;
}

// `toml` run to step `at`, snapshotted there, then resumed from that snapshot to its end as
// `resume_toml` (by default the same config): the resumed run's losses (steps at + 1 ..) and its
// --save-weights file.
struct Resumed {
  std::vector<double> losses;
  std::string saved;
};
inline Resumed resume_from_step(const std::string& toml, int at, std::string resume_toml = "") {
  if (resume_toml.empty()) resume_toml = toml;
  const std::string dir = test::temp_dir();
  const std::string snap =
      "[snapshot]\nevery = " + std::to_string(at) + "\ndir = \"" + dir + "/s\"\n";
  {
    Trainer first(test::config_from(toml + snap, {"train.steps=" + std::to_string(at)}),
                  TrainOptions{});
    first.run();
  }
  TrainOptions o;
  o.resume_dir = dir + "/s";
  o.save_weights_path = dir + "/resumed.safetensors";
  Trainer resumed(test::config_from(resume_toml + snap), std::move(o));
  resumed.run();
  Resumed r;
  for (const StepState& s : resumed.history())
    r.losses.push_back(s.loss);
  r.saved = file_bytes(dir + "/resumed.safetensors");
  return r;
}

// `base` with [host] memory_limit one byte under `need` (the host ledger's closed form): out of
// memory on the host, exit 3, the report naming the place. Returns that run's output.
inline std::string expect_out_of_memory_on_the_host(const std::string& dir, const std::string& base,
                                                    uint64_t need) {
  const std::string tight = test::write_file(
      dir, "tight.toml", base + "[host]\nmemory_limit = " + std::to_string(need - 1) + "\n");
  const test::RunResult r = test::run_headroom("train " + tight + " -q");
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_TRUE(test::contains(r.output, "out of memory on the host:")) << r.output;
  EXPECT_TRUE(test::contains(r.output, "place                  host")) << r.output;
  return r.output;
}

// What a run whose parameters are sharded (zero3) leaves to compare: its losses, its saved weights
// (the masters, gathered whole) and both ledgers.
struct Sharded {
  std::vector<double> losses;
  std::string saved;
  ByCategory device_at_peak{}, host_peak{};  // each ledger's categories at its peak total
  uint64_t device_peak_total = 0;
};

inline Sharded train_sharded(const std::string& toml) {
  TrainOptions o;
  const std::string path = test::temp_dir() + "/w.safetensors";
  o.save_weights_path = path;
  Trainer t(test::config_from(toml), std::move(o));
  t.run();
  Sharded r;
  for (const StepState& s : t.history())
    r.losses.push_back(s.loss);
  r.saved = file_bytes(path);
  r.device_at_peak = t.device().tracker().live_at_peak();
  r.device_peak_total = t.device().tracker().peak_total();
  r.host_peak = t.device().host_place()->tracker().live_at_peak();
  return r;
}

// A folder on tmpfs (/dev/shm), removed with the object: its path is empty when none could be
// made. O_DIRECT there from Linux 6.6 on, buffered before.
struct TmpfsDir {
  std::string path;
  TmpfsDir() {
    std::string t = "/dev/shm/headroom-offload-test-XXXXXX";
    if (mkdtemp(t.data())) path = t;
  }
  ~TmpfsDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
  TmpfsDir(const TmpfsDir&) = delete;
  TmpfsDir& operator=(const TmpfsDir&) = delete;
};

// Runs the shell `script` with the folder `small` full after 8 KiB: an 8 KiB tmpfs mounted there in
// a mount namespace of its own, or where none can be mounted a file-size limit of 8 KiB
// (posix_fallocate past it fails the same way). The output, and in *how which ("tmpfs" or
// "ulimit -f").
inline test::RunResult run_on_a_full_disk(const std::string& small, const std::string& script,
                                          std::string* how) {
  const std::string mount = "mount -t tmpfs -o size=8k tmpfs " + small;
  if (test::run_command("unshare -m sh -c '" + mount + "'").exit_code == 0) {
    *how = "tmpfs";
    return test::run_command("unshare -m sh -c '" + mount + " && " + script + "'");
  }
  *how = "ulimit -f";
  return test::run_command("bash -c 'ulimit -f 8; " + script + "'");
}

// The same losses, weights and compute copies, bitwise; and the same --save-weights file where the
// runs saved one.
inline void expect_same_training(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_EQ(a.losses[i], b.losses[i]) << "step " << i + 1;  // bitwise: == on doubles
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) {
    // With amp's masters on the host the optimizer updates the device's compute copies' values
    // no more: the masters compare as saved, below.
    if (a.segments.at(i).value_dtype == b.segments.at(i).value_dtype) {
      EXPECT_TRUE(a.weights[i] == b.weights[i]) << "parameter " << i;
    }
    EXPECT_TRUE(a.compute[i] == b.compute[i]) << "parameter " << i;
  }
  if (!a.saved.empty() || !b.saved.empty()) {
    EXPECT_TRUE(a.saved == b.saved) << "the saved weights (the masters) differ";
  }
}

}  // namespace test
}  // namespace headroom
