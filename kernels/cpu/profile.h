// Opt-in timing of the CPU kernels, for benchmarks only: off, it costs one branch per GEMM call.
// Not thread-safe: only GEMMs called outside a parallel region are recorded (the linear layers'
// and the head's; attention's per-head GEMMs run inside one and are not).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <tuple>

namespace headroom::cpu {

// One GEMM shape as the kernels issue it: row-major C (M,N) = op(A) · op(B) (+ C when
// accumulate), with the strides it was called with.
struct GemmShape {
  bool trans_a = false, trans_b = false;
  int M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  bool accumulate = false;  // beta != 0
  bool lowp = false;        // bf16/f16 operands through oneDNN's matmul (gemm_lowp.h), else f32
  auto key() const { return std::tie(trans_a, trans_b, M, N, K, lda, ldb, ldc, accumulate, lowp); }
  bool operator<(const GemmShape& o) const { return key() < o.key(); }
};

struct GemmShapeStats {
  uint64_t calls = 0;
  double seconds = 0.0;
};

struct GemmProfile {
  bool enabled = false;
  double seconds = 0.0;  // wall time inside BLAS GEMM calls
  double flops = 0.0;    // 2·M·N·K per call
  uint64_t calls = 0;
  std::map<GemmShape, GemmShapeStats> shapes;  // the same, shape by shape
  void reset() { seconds = flops = 0.0, calls = 0, shapes.clear(); }
};

inline GemmProfile& gemm_profile() {
  static GemmProfile profile;
  return profile;
}

// Times one GEMM when profiling is on and `record` (the caller is not inside a parallel region).
class GemmTimer {
 public:
  GemmTimer(const GemmShape& shape, bool record) : on_(gemm_profile().enabled && record) {
    if (!on_) return;
    shape_ = shape;
    start_ = std::chrono::steady_clock::now();
  }
  ~GemmTimer() {
    if (!on_) return;
    GemmProfile& p = gemm_profile();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    p.seconds += s;
    p.flops += 2.0 * shape_.M * shape_.N * shape_.K;
    ++p.calls;
    GemmShapeStats& st = p.shapes[shape_];
    ++st.calls;
    st.seconds += s;
  }
  GemmTimer(const GemmTimer&) = delete;
  GemmTimer& operator=(const GemmTimer&) = delete;

 private:
  bool on_;
  GemmShape shape_;
  std::chrono::steady_clock::time_point start_;
};

// The CPU backend's ops, timed one call at a time (wall clock, the widening and rounding around
// an op included) when enabled: where a step's non-GEMM time goes, op by op and dtype by dtype.
// An op called inside another op's timing (a scale inside an update) counts in the outer one.
struct OpProfile {
  bool enabled = false;
  int depth = 0;
  std::map<std::string, GemmShapeStats> ops;
  void reset() { ops.clear(), depth = 0; }
};

inline OpProfile& op_profile() {
  static OpProfile profile;
  return profile;
}

// Times one backend op under `name` (a string literal) and `dtype` (its dtype's name or null).
class OpTimer {
 public:
  OpTimer(const char* name, const char* dtype) {
    OpProfile& p = op_profile();
    if (!p.enabled) return;
    nested_ = true;
    if (p.depth++ > 0) return;
    on_ = true;
    name_ = name;
    dtype_ = dtype;
    start_ = std::chrono::steady_clock::now();
  }
  ~OpTimer() {
    OpProfile& p = op_profile();
    if (nested_ && p.depth > 0) --p.depth;
    if (!on_) return;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    GemmShapeStats& st = p.ops[dtype_ ? std::string(name_) + " " + dtype_ : std::string(name_)];
    ++st.calls;
    st.seconds += s;
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  bool on_ = false, nested_ = false;
  const char* name_ = nullptr;
  const char* dtype_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace headroom::cpu
