// The NVMe tier's file I/O rates (docs/results/offload.md), against fio on the same folder: the
// optimizer state of gpt2-124m's parameter tensors (AdamW's m and v, f32: about 1 GB, the layout
// of core/optim/state_layout.h) in a StateFile (core/run/state_file.h) under `--dir`, streamed
// whole in each of its passes:
//  - write: every segment written from the staging buffers (no read),
//  - read: every segment read (no write-back),
//  - update: read, an update that touches nothing, written back: what a training step's
//    optimizer update does, with the I/O alone (the AdamW kernel's time is
//    bench_optimizer_kernels').
// Each pass `--reps` rounds in turn; the table gives each pass's median time and MB/s (the
// update's: bytes read plus written). The passes are io_uring chains of at most 32 requests a
// tensor range, each at least 1 MiB (a piece is 1 Mi elements: 4 MiB of each f32 tensor, so 4
// requests of 1 MiB), one chain in flight:
// fio's matching job is --ioengine=io_uring --iodepth=1 --bs=1M (bench/offload.sh).
//
//   build/bin/bench_state_file --dir /mnt/nvme [--reps 3] [--direct auto|on|off]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/run/state_file.h"

namespace {

using Clock = std::chrono::steady_clock;

// gpt2-124m's parameter tensors' elements (bench/optimizer_kernels.cpp's shapes).
std::vector<uint64_t> gpt2_124m() {
  const uint64_t C = 768, V = 50257, T = 1024;
  std::vector<uint64_t> n = {V * C, T * C};
  for (int l = 0; l < 12; ++l) {
    const std::vector<uint64_t> block = {C, C, 3 * C * C, 3 * C, C * C,     C,
                                         C, C, 4 * C * C, 4 * C, 4 * C * C, C};
    n.insert(n.end(), block.begin(), block.end());
  }
  n.push_back(C);
  n.push_back(C);
  return n;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the NVMe tier's read and write rates"};
  std::string dir, direct = "auto";
  int reps = 3;
  app.add_option("--dir", dir, "the folder the state file goes in")->required();
  app.add_option("--reps", reps, "rounds")->check(CLI::Range(1, 100));
  app.add_option("--direct", direct, "O_DIRECT: auto, on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  CLI11_PARSE(app, argc, argv);
  using headroom::StateFile;
  try {
    auto host = headroom::Device::create(headroom::DeviceConfig{});
    StateFile file(*host, dir,
                   direct == "on"    ? headroom::DirectIo::kOn
                   : direct == "off" ? headroom::DirectIo::kOff
                                     : headroom::DirectIo::kAuto,
                   0, "--dir: ", &std::cerr);
    const std::vector<uint64_t> numels = gpt2_124m();
    file.open(numels, 2, headroom::Dtype::kF32, true);
    const double mb = double(file.file_bytes()) / 1e6;
    struct Pass {
      const char* name;
      StateFile::Pass pass;
      double bytes;  // MB moved
      std::vector<double> s;
    };
    std::vector<Pass> passes = {{"write", StateFile::Pass::kWrite, mb, {}},
                                {"read", StateFile::Pass::kRead, mb, {}},
                                {"update (read + write)", StateFile::Pass::kReadWrite, 2 * mb, {}}};
    const auto none = [](size_t, uint64_t, uint64_t, void* const*) {};
    for (int r = 0; r < reps; ++r)
      for (Pass& p : passes) {
        const auto t0 = Clock::now();
        file.stream(none, p.pass);
        p.s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
    std::printf("state file %s on %s, %s, %.1f MB (%zu segments), median of %d\n\n",
                file.path().c_str(), headroom::file_system_name(dir).c_str(),
                file.direct() ? "O_DIRECT" : "buffered", mb, numels.size(), reps);
    std::printf("| pass | time | MB/s |\n| --- | --- | --- |\n");
    for (const Pass& p : passes) {
      const double m = median(p.s);
      std::printf("| %s | %.3f s | %.0f |\n", p.name, m, p.bytes / m);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_state_file: %s\n", e.what());
    return 1;
  }
  return 0;
}
