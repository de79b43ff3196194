// Opt-in timing of the CPU kernels, for benchmarks only: off, it costs one branch per GEMM call.
// Not thread-safe; the CPU backend calls kernels from the training thread only.
#pragma once

#include <chrono>
#include <cstdint>

namespace headroom::cpu {

struct GemmProfile {
  bool enabled = false;
  double seconds = 0.0;  // wall time inside BLAS GEMM calls
  double flops = 0.0;    // 2·M·N·K per call
  uint64_t calls = 0;
  void reset() { seconds = flops = 0.0, calls = 0; }
};

inline GemmProfile& gemm_profile() {
  static GemmProfile profile;
  return profile;
}

// Times one GEMM when profiling is on.
class GemmTimer {
 public:
  GemmTimer(int M, int N, int K) : on_(gemm_profile().enabled) {
    if (!on_) return;
    flops_ = 2.0 * M * N * K;
    start_ = std::chrono::steady_clock::now();
  }
  ~GemmTimer() {
    if (!on_) return;
    GemmProfile& p = gemm_profile();
    p.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    p.flops += flops_;
    ++p.calls;
  }
  GemmTimer(const GemmTimer&) = delete;
  GemmTimer& operator=(const GemmTimer&) = delete;

 private:
  bool on_;
  double flops_ = 0.0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace headroom::cpu
