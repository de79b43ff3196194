// The CUDA backend against the CPU kernels (kernels/cpu/*.h), the reference, through the Backend
// interface of a real CUDA device (make_cuda_device -> backend()), so the dtype dispatch, the
// streams and the device's memory are tested with the kernels.
//
// Every op in f32 (norm-wise relative error below 1e-5) and in bf16 (below 1e-2), most in f16 too:
// for a 16-bit dtype the reference is the CPU kernel computing in f32 on the same 16-bit-rounded
// inputs, its outputs rounded to the dtype (what the backends promise: fp32 math, one rounding to
// the storage dtype). Fill, cast, scale, axpy and accumulate share their rounding code with the CPU
// backend and must match it bit for bit. Fresh random inputs each run (the seed is printed with any
// failure); a NaN or infinity never passes; every output buffer is poisoned (all bits set: NaN in
// every float dtype) before the GPU writes it, so an element the kernel forgets is caught. Backward
// ops accumulate, so their gradient buffers start from the same random values on both sides instead
// (that checks the += as well).
//
// Without a CUDA build, or on a machine without a GPU, every test here skips with the reason.
#include <gtest/gtest.h>

#if !defined(HEADROOM_HAVE_CUDA)

namespace {

TEST(CudaOps, SkippedNoCudaBuild) {
  GTEST_SKIP() << "this build has no CUDA backend (no nvcc found, or -DHEADROOM_CUDA=OFF): the "
                  "CUDA-vs-CPU op tests are not compiled in";
}

}  // namespace

#else  // HEADROOM_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/backend.h"
#include "core/device/device.h"
#include "core/device/memory.h"
#include "kernels/common/dtype.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/residual.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace headroom {
namespace {

constexpr double kTolFp32 = 1e-5;
constexpr double kTol16 = 1e-2;
double tol(Dtype dt) {
  return dt == Dtype::kF32 ? kTolFp32 : kTol16;
}

const Dtype kAllDtypes[] = {Dtype::kF32, Dtype::kBF16, Dtype::kF16};
const Dtype kF32AndBF16[] = {Dtype::kF32, Dtype::kBF16};

// --- host images of device tensors
// ----------------------------------------------------------------

std::vector<uint8_t> encode(const std::vector<float>& x, Dtype dt) {
  const size_t es = dtype_size(dt);
  std::vector<uint8_t> out(x.size() * es);
  for (size_t i = 0; i < x.size(); i++) {
    if (dt == Dtype::kF32) {
      std::memcpy(&out[i * es], &x[i], sizeof(float));
    } else {
      const uint16_t h = dt == Dtype::kBF16 ? float_to_bf16(x[i]) : float_to_f16(x[i]);
      std::memcpy(&out[i * es], &h, sizeof h);
    }
  }
  return out;
}

std::vector<float> decode(const std::vector<uint8_t>& bytes, Dtype dt) {
  const size_t es = dtype_size(dt);
  std::vector<float> out(bytes.size() / es);
  for (size_t i = 0; i < out.size(); i++) {
    if (dt == Dtype::kF32) {
      std::memcpy(&out[i], &bytes[i * es], sizeof(float));
    } else {
      uint16_t h;
      std::memcpy(&h, &bytes[i * es], sizeof h);
      out[i] = dt == Dtype::kBF16 ? bf16_to_float(h) : f16_to_float(h);
    }
  }
  return out;
}

// x rounded to dt's precision (to nearest even), as float.
std::vector<float> rounded(const std::vector<float>& x, Dtype dt) {
  return decode(encode(x, dt), dt);
}

// ||got - want|| / ||want||; +infinity when either holds a NaN or infinity, or the sizes differ.
template <class T>
double rel_error(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); i++) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    if (!std::isfinite(g) || !std::isfinite(w)) return std::numeric_limits<double>::infinity();
    num += (g - w) * (g - w);
    den += w * w;
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

// The first byte where two images differ, or -1.
long first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); i++)
    if (a[i] != b[i]) return static_cast<long>(i);
  return -1;
}

// A CUDA device for the test, or the reason there is none.
std::unique_ptr<Device> cuda_device(uint64_t memory_limit, std::string* why) {
  DeviceConfig dc;
  dc.kind = "cuda";
  dc.memory_limit = memory_limit;
  try {
    return make_cuda_device(dc);
  } catch (const ConfigError& e) {
    *why = e.what();
    return nullptr;
  }
}

class CudaBackendOps : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    device_ = cuda_device(0, &why);
    if (!device_) GTEST_SKIP() << "no GPU: the CUDA-vs-CPU op tests need one (" << why << ")";
    ops_ = &device_->backend();
    seed_ = std::random_device{}();
    gen_.seed(seed_);
  }
  void TearDown() override {
    if (ops_ != nullptr) {
      try {
        ops_->synchronize();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "CUDA error after the test: " << e.what();
      }
    }
    buffers_.clear();
    device_.reset();
  }

  // --- device memory, freed at the end of the test ---
  void* alloc(uint64_t bytes) {
    buffers_.emplace_back(*device_, std::max<uint64_t>(bytes, 1), Category::kWorkspace,
                          "test buffer");
    return buffers_.back().as<void>();
  }
  void* to_device_bytes(const std::vector<uint8_t>& bytes) {
    void* p = alloc(bytes.size());
    ops_->upload(p, bytes.data(), bytes.size());
    ops_->synchronize();  // the host image goes away
    return p;
  }
  void* to_device(const std::vector<float>& x, Dtype dt) { return to_device_bytes(encode(x, dt)); }
  template <class T>
  void* to_device_raw(const std::vector<T>& x) {
    std::vector<uint8_t> bytes(x.size() * sizeof(T));
    if (!x.empty()) std::memcpy(bytes.data(), x.data(), bytes.size());
    return to_device_bytes(bytes);
  }
  // n elements of dt with every bit set: NaN in f32, bf16 and f16.
  void* poisoned(size_t n, Dtype dt) {
    return to_device_bytes(std::vector<uint8_t>(n * dtype_size(dt), 0xFF));
  }
  std::vector<uint8_t> bytes_of(const void* p, size_t bytes) {
    std::vector<uint8_t> b(bytes);
    ops_->download(b.data(), p, bytes);
    return b;
  }
  std::vector<float> from_device(const void* p, size_t n, Dtype dt) {
    return decode(bytes_of(p, n * dtype_size(dt)), dt);
  }

  // --- random inputs, exactly representable in dt ---
  std::vector<float> normal(size_t n, Dtype dt = Dtype::kF32, float scale = 1.0f,
                            float offset = 0.0f) {
    std::normal_distribution<float> dist(offset, scale);
    std::vector<float> v(n);
    for (auto& x : v)
      x = dist(gen_);
    return rounded(v, dt);
  }
  std::vector<int32_t> ints(size_t n, int32_t lo, int32_t hi) {  // uniform in [lo, hi]
    std::uniform_int_distribution<int32_t> dist(lo, hi);
    std::vector<int32_t> v(n);
    for (auto& x : v)
      x = dist(gen_);
    return v;
  }

  void expect_close(const std::string& what, const std::vector<float>& got,
                    const std::vector<float>& want, double tolerance) {
    const double err = rel_error(got, want);
    EXPECT_LT(err, tolerance) << what << ": CUDA vs CPU relative error " << err << " (seed "
                              << seed_ << ")";
  }
  void expect_same_bytes(const std::string& what, const std::vector<uint8_t>& got,
                         const std::vector<uint8_t>& want) {
    const long at = first_difference(got, want);
    EXPECT_EQ(at, -1) << what << ": CUDA and CPU differ from byte " << at << " (seed " << seed_
                      << ")";
  }

  std::unique_ptr<Device> device_;
  Backend* ops_ = nullptr;
  std::vector<Buffer> buffers_;
  uint32_t seed_ = 0;
  std::mt19937 gen_;
};

// --- model ops
// --------------------------------------------------------------------------------------

// The estimates size the naive attention's scratch without a device: as the CUDA backend does.
TEST_F(CudaBackendOps, AttentionScratchOfTheKindIsTheBackendsOwn) {
  for (const int T : {1, 17, 256})
    EXPECT_EQ(attention_scratch_numel("cuda", 3, T, 12), ops_->attention_scratch_numel(3, T, 12));
}

TEST_F(CudaBackendOps, EmbeddingForward) {
  const int B = 3, T = 17, C = 40, V = 53, maxT = 20;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto tokens = ints(size_t(B) * T, 0, V - 1);
    const auto wte = normal(size_t(V) * C, dt), wpe = normal(size_t(maxT) * C, dt);
    std::vector<float> want(size_t(B) * T * C);
    cpu::embedding_forward(want.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    want = rounded(want, dt);

    void* d_out = poisoned(want.size(), dt);
    ops_->embedding_forward(dt, d_out, static_cast<const int32_t*>(to_device_raw(tokens)),
                            to_device(wte, dt), to_device(wpe, dt), B, T, C);
    expect_close("out", from_device(d_out, want.size(), dt), want, tol(dt));
  }
}

// Llama's embedding: no position table (wpe null), and no position gradient (dwpe null).
TEST_F(CudaBackendOps, EmbeddingWithoutAPositionTable) {
  const int B = 3, T = 17, C = 40, V = 11;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto tokens = ints(size_t(B) * T, 0, V - 1);
    const auto wte = normal(size_t(V) * C, dt);
    std::vector<float> want(size_t(B) * T * C);
    cpu::embedding_forward(want.data(), tokens.data(), wte.data(),
                           static_cast<const float*>(nullptr), B, T, C);
    const auto* d_tokens = static_cast<const int32_t*>(to_device_raw(tokens));
    void* d_out = poisoned(want.size(), dt);
    ops_->embedding_forward(dt, d_out, d_tokens, to_device(wte, dt), nullptr, B, T, C);
    // A copy of the token rows: exact.
    expect_same_bytes("out", bytes_of(d_out, want.size() * dtype_size(dt)), encode(want, dt));

    const auto dout = normal(want.size(), dt);
    auto dwte = normal(wte.size(), dt);
    void* d_dwte = to_device(dwte, dt);
    cpu::embedding_backward(dwte.data(), static_cast<float*>(nullptr), dout.data(), tokens.data(),
                            B, T, C);
    ops_->embedding_backward(dt, d_dwte, nullptr, to_device(dout, dt), d_tokens, B, T, C);
    expect_close("dwte", from_device(d_dwte, dwte.size(), dt), rounded(dwte, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, EmbeddingBackward) {
  const int B = 3, T = 17, C = 40, V = 11;  // small V: many repeated tokens
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto tokens = ints(size_t(B) * T, 0, V - 1);
    const auto dout = normal(size_t(B) * T * C, dt);
    auto dwte = normal(size_t(V) * C, dt), dwpe = normal(size_t(T) * C, dt);
    void* d_dwte = to_device(dwte, dt);
    void* d_dwpe = to_device(dwpe, dt);
    cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
    ops_->embedding_backward(dt, d_dwte, d_dwpe, to_device(dout, dt),
                             static_cast<const int32_t*>(to_device_raw(tokens)), B, T, C);
    expect_close("dwte", from_device(d_dwte, dwte.size(), dt), rounded(dwte, dt), tol(dt));
    expect_close("dwpe", from_device(d_dwpe, dwpe.size(), dt), rounded(dwpe, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, LayernormForward) {
  const int N = 37, C = 67;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto inp = normal(size_t(N) * C, dt, 2.0f, 3.0f);  // a mean far from 0
    const auto weight = normal(C, dt), bias = normal(C, dt);
    std::vector<float> out(size_t(N) * C), mean(N), rstd(N);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                           bias.data(), N, C);

    void* d_out = poisoned(out.size(), dt);
    void* d_mean = poisoned(N, Dtype::kF32);  // statistics are f32 for every storage dtype
    void* d_rstd = poisoned(N, Dtype::kF32);
    ops_->layernorm_forward(dt, d_out, d_mean, d_rstd, to_device(inp, dt), to_device(weight, dt),
                            to_device(bias, dt), N, C);
    expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
    expect_close("mean", from_device(d_mean, N, Dtype::kF32), mean, kTolFp32);
    expect_close("rstd", from_device(d_rstd, N, Dtype::kF32), rstd, kTolFp32);
  }
}

TEST_F(CudaBackendOps, LayernormBackward) {
  const int N = 37, C = 67;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto inp = normal(size_t(N) * C, dt, 2.0f, 3.0f);
    const auto weight = normal(C, dt), bias = normal(C, dt), dout = normal(size_t(N) * C, dt);
    std::vector<float> out(size_t(N) * C), mean(N), rstd(N);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                           bias.data(), N, C);
    auto dinp = normal(size_t(N) * C, dt), dweight = normal(C, dt), dbias = normal(C, dt);
    void* d_dinp = to_device(dinp, dt);
    void* d_dw = to_device(dweight, dt);
    void* d_db = to_device(dbias, dt);
    cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                            weight.data(), mean.data(), rstd.data(), N, C);
    ops_->layernorm_backward(dt, d_dinp, d_dw, d_db, to_device(dout, dt), to_device(inp, dt),
                             to_device(weight, dt), to_device(mean, Dtype::kF32),
                             to_device(rstd, Dtype::kF32), N, C);
    expect_close("dinp", from_device(d_dinp, dinp.size(), dt), rounded(dinp, dt), tol(dt));
    expect_close("dweight", from_device(d_dw, C, dt), rounded(dweight, dt), tol(dt));
    expect_close("dbias", from_device(d_db, C, dt), rounded(dbias, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, MatmulForward) {
  struct Shape {
    int N, C, OC;
    bool bias;
  };
  for (const Dtype dt : kAllDtypes) {
    for (const Shape s :
         {Shape{37, 53, 101, true}, Shape{74, 48, 144, false}, Shape{64, 96, 32, true}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " N=" + std::to_string(s.N) +
                   " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC) +
                   (s.bias ? " bias" : " no bias"));
      const auto inp = normal(size_t(s.N) * s.C, dt);
      const auto weight = normal(size_t(s.OC) * s.C, dt), bias = normal(s.OC, dt);
      std::vector<float> out(size_t(s.N) * s.OC);
      cpu::matmul_forward(out.data(), inp.data(), weight.data(), s.bias ? bias.data() : nullptr,
                          s.N, s.C, s.OC);

      void* d_out = poisoned(out.size(), dt);
      ops_->matmul_forward(dt, d_out, to_device(inp, dt), to_device(weight, dt),
                           s.bias ? to_device(bias, dt) : nullptr, s.N, s.C, s.OC);
      expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
    }
  }
}

TEST_F(CudaBackendOps, MatmulBackward) {
  const int N = 37, C = 53, OC = 101;
  for (const Dtype dt : kAllDtypes) {
    for (const bool all : {true, false}) {  // false: dinp and dbias null (the LM head's call)
      SCOPED_TRACE(std::string(dtype_name(dt)) + (all ? " all gradients" : " dweight only"));
      const auto inp = normal(size_t(N) * C, dt), weight = normal(size_t(OC) * C, dt);
      const auto dout = normal(size_t(N) * OC, dt);
      auto dinp = normal(size_t(N) * C, dt), dweight = normal(size_t(OC) * C, dt);
      auto dbias = normal(OC, dt);
      void* d_dinp = to_device(dinp, dt);
      void* d_dw = to_device(dweight, dt);
      void* d_db = to_device(dbias, dt);
      cpu::matmul_backward(all ? dinp.data() : nullptr, dweight.data(),
                           all ? dbias.data() : nullptr, dout.data(), inp.data(), weight.data(), N,
                           C, OC);
      ops_->matmul_backward(dt, all ? d_dinp : nullptr, d_dw, all ? d_db : nullptr,
                            to_device(dout, dt), to_device(inp, dt), to_device(weight, dt), N, C,
                            OC);
      expect_close("dinp", from_device(d_dinp, dinp.size(), dt), rounded(dinp, dt), tol(dt));
      expect_close("dweight", from_device(d_dw, dweight.size(), dt), rounded(dweight, dt), tol(dt));
      expect_close("dbias", from_device(d_db, OC, dt), rounded(dbias, dt), tol(dt));
    }
  }
}

TEST_F(CudaBackendOps, AttentionForward) {
  const int B = 2, T = 19, C = 48, NH = 4;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto qkv = normal(size_t(B) * T * 3 * C, dt);
    std::vector<float> out(size_t(B) * T * C), att(size_t(B) * NH * T * T);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);

    void* d_out = poisoned(out.size(), dt);
    void* d_att = poisoned(att.size(), dt);
    ops_->attention_forward(dt, d_out, d_att, to_device(qkv, dt), B, T, C, NH);
    expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
    expect_close("att", from_device(d_att, att.size(), dt), rounded(att, dt), tol(dt));
  }
}

// Generation's one-query attention over a KV cache: the CPU's attention_forward row T-1.
TEST_F(CudaBackendOps, AttentionDecode) {
  const int T = 37, C = 48, NH = 4;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto qkv = normal(size_t(T) * 3 * C, dt);
    std::vector<float> out(size_t(T) * C), att(size_t(NH) * T * T);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), 1, T, C, NH);
    const std::vector<float> last(out.end() - C, out.end());
    void* d_out = poisoned(size_t(C), dt);
    ops_->attention_decode(dt, d_out, to_device(qkv, dt), T, C, NH);
    expect_close("out", from_device(d_out, size_t(C), dt), rounded(last, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, AttentionBackward) {
  const int B = 2, T = 19, C = 48, NH = 4;
  EXPECT_EQ(ops_->attention_scratch_numel(B, T, NH), uint64_t(NH) * T * T);
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    const auto qkv = normal(size_t(B) * T * 3 * C, dt);
    const auto dout = normal(size_t(B) * T * C, dt);
    std::vector<float> out(size_t(B) * T * C), att(size_t(B) * NH * T * T);
    cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    att = rounded(att, dt);  // what the forward stored in dt: the input of both backwards
    auto dqkv = normal(qkv.size(), dt);
    void* d_dqkv = to_device(dqkv, dt);
    std::vector<float> scratch(size_t(T) * T);
    cpu::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B, T,
                            C, NH);
    // "contents undefined on entry": the kernel must not read them
    void* d_scratch = poisoned(ops_->attention_scratch_numel(B, T, NH), dt);
    ops_->attention_backward(dt, d_dqkv, d_scratch, to_device(dout, dt), to_device(qkv, dt),
                             to_device(att, dt), B, T, C, NH);
    expect_close("dqkv", from_device(d_dqkv, dqkv.size(), dt), rounded(dqkv, dt), tol(dt));
  }
}

// The tiled (FlashAttention) kernels against the CPU's tiled kernels: out and lse forward, dqkv
// backward from the same out and lse. T = 100 crosses the CUDA kernels' 64-row blocks and 32-row
// tiles with partial last ones; T = 1 is a single row. Unverified on a GPU so far.
TEST_F(CudaBackendOps, AttentionTiledForward) {
  for (const int T : {1, 100}) {
    const int B = 2, C = 48, NH = 4;
    for (const Dtype dt : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T " + std::to_string(T));
      const auto qkv = normal(size_t(B) * T * 3 * C, dt);
      std::vector<float> out(size_t(B) * T * C), lse(size_t(B) * NH * T);
      cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
      void* d_out = poisoned(out.size(), dt);
      void* d_lse = poisoned(lse.size(), Dtype::kF32);
      ops_->attention_tiled_forward(dt, d_out, d_lse, to_device(qkv, dt), B, T, C, NH);
      expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
      expect_close("lse", from_device(d_lse, lse.size(), Dtype::kF32), lse, kTolFp32);
    }
  }
}

TEST_F(CudaBackendOps, AttentionTiledBackward) {
  for (const int T : {1, 100}) {
    const int B = 2, C = 48, NH = 4;
    for (const Dtype dt : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T " + std::to_string(T));
      const auto qkv = normal(size_t(B) * T * 3 * C, dt);
      const auto dout = normal(size_t(B) * T * C, dt);
      std::vector<float> out(size_t(B) * T * C), lse(size_t(B) * NH * T);
      cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
      out = rounded(out, dt);  // what the forward stored in dt: the input of both backwards
      auto dqkv = normal(qkv.size(), dt);
      void* d_dqkv = to_device(dqkv, dt);
      cpu::attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B,
                                    T, C, NH);
      ops_->attention_tiled_backward(dt, d_dqkv, to_device(dout, dt), to_device(qkv, dt),
                                     to_device(out, dt), to_device(lse, Dtype::kF32), B, T, C, NH);
      expect_close("dqkv", from_device(d_dqkv, dqkv.size(), dt), rounded(dqkv, dt), tol(dt));
    }
  }
}

// --- Llama's ops against kernels/cpu/rmsnorm.h, swiglu.h, rope.h and the CPU's tiled attention
// with NKV key/value heads. Never run on a GPU so far: unverified.

TEST_F(CudaBackendOps, RmsnormForward) {
  const int N = 37, C = 67;
  const double eps = 1e-6;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto inp = normal(size_t(N) * C, dt, 2.0f, 0.5f);
    const auto weight = normal(C, dt);
    std::vector<float> out(size_t(N) * C), rstd(N);
    cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, eps);
    void* d_out = poisoned(out.size(), dt);
    void* d_rstd = poisoned(N, Dtype::kF32);  // f32 for every storage dtype
    ops_->rmsnorm_forward(dt, d_out, d_rstd, to_device(inp, dt), to_device(weight, dt), N, C, eps);
    expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
    expect_close("rstd", from_device(d_rstd, N, Dtype::kF32), rstd, kTolFp32);
  }
}

TEST_F(CudaBackendOps, RmsnormBackward) {
  const int N = 37, C = 67;
  for (const Dtype dt : kAllDtypes) {
    for (const bool write : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (write ? " Grad::kWrite + dres" : " accumulate"));
      const auto inp = normal(size_t(N) * C, dt, 2.0f, 0.5f);
      const auto weight = normal(C, dt), dout = normal(size_t(N) * C, dt);
      const auto dres = normal(size_t(N) * C, dt);
      std::vector<float> out(size_t(N) * C), rstd(N);
      cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), N, C, 1e-5);
      auto dinp = normal(size_t(N) * C, dt), dweight = normal(C, dt);
      void* d_dinp = write ? poisoned(dinp.size(), dt) : to_device(dinp, dt);
      void* d_dw = to_device(dweight, dt);
      cpu::rmsnorm_backward(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(),
                            rstd.data(), N, C, !write, write ? dres.data() : nullptr);
      ops_->rmsnorm_backward(dt, d_dinp, d_dw, to_device(dout, dt), to_device(inp, dt),
                             to_device(weight, dt), to_device(rstd, Dtype::kF32), N, C,
                             write ? Grad::kWrite : Grad::kAccumulate,
                             write ? to_device(dres, dt) : nullptr);
      expect_close("dinp", from_device(d_dinp, dinp.size(), dt), rounded(dinp, dt), tol(dt));
      expect_close("dweight", from_device(d_dw, C, dt), rounded(dweight, dt), tol(dt));
    }
  }
}

TEST_F(CudaBackendOps, SwigluForward) {
  const int N = 37, H = 91;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto gu = normal(size_t(N) * 2 * H, dt, 3.0f);
    std::vector<float> out(size_t(N) * H);
    cpu::swiglu_forward(out.data(), gu.data(), N, H);
    void* d_out = poisoned(out.size(), dt);
    ops_->swiglu_forward(dt, d_out, to_device(gu, dt), N, H);
    expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, SwigluBackward) {
  const int N = 37, H = 91;
  for (const Dtype dt : kAllDtypes) {
    for (const bool write : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (write ? " Grad::kWrite" : " accumulate"));
      const auto gu = normal(size_t(N) * 2 * H, dt, 3.0f), dout = normal(size_t(N) * H, dt);
      auto dgu = normal(gu.size(), dt);
      void* d_dgu = write ? poisoned(dgu.size(), dt) : to_device(dgu, dt);
      cpu::swiglu_backward(dgu.data(), gu.data(), dout.data(), N, H, !write);
      ops_->swiglu_backward(dt, d_dgu, to_device(gu, dt), to_device(dout, dt), N, H,
                            write ? Grad::kWrite : Grad::kAccumulate);
      expect_close("dgu", from_device(d_dgu, dgu.size(), dt), rounded(dgu, dt), tol(dt));
    }
  }
}

// Rotary embeddings in place on q and k (v untouched), without scaling and with Llama 3's: with
// hs 16 and original_max_position_embeddings 64 the pairs fall in all three bands (kept,
// interpolated, divided by factor), and T = 100 runs past the original length.
TEST_F(CudaBackendOps, RopeForwardAndBackward) {
  const int B = 2, T = 100, NH = 4, NKV = 2, hs = 16, W = (NH + 2 * NKV) * hs;
  RopeParams scaled;
  scaled.theta = 10000.0;
  scaled.factor = 8.0;
  scaled.low_freq_factor = 1.0;
  scaled.high_freq_factor = 4.0;
  scaled.original_max_position_embeddings = 64.0;
  RopeParams plain;
  plain.theta = 500000.0;
  for (const RopeParams& p : {plain, scaled}) {
    for (const Dtype dt : kAllDtypes) {
      for (const bool backward : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + (p.factor > 0 ? " scaled" : " unscaled") +
                     (backward ? " backward" : " forward"));
        auto x = normal(size_t(B) * T * W, dt);
        void* d_x = to_device(x, dt);
        if (backward) {
          cpu::rope_backward(x.data(), B, T, NH, NKV, hs, p);
          ops_->rope_backward(dt, d_x, B, T, NH, NKV, hs, p);
        } else {
          cpu::rope_forward(x.data(), B, T, NH, NKV, hs, p);
          ops_->rope_forward(dt, d_x, B, T, NH, NKV, hs, p);
        }
        expect_close("qkv", from_device(d_x, x.size(), dt), rounded(x, dt), tol(dt));
      }
    }
  }
}

// Grouped-query attention: NKV key/value heads, qkv (B,T,C + 2·NKV·hs), against the CPU's tiled
// kernels with the same NKV. NKV = NH goes the same way (the multi-head case); hs = 128 is the
// kernels' largest head.
struct GqaShape {
  int B, T, C, NH, NKV;
};
const GqaShape kGqaShapes[] = {{2, 1, 64, 4, 2},
                               {2, 100, 64, 4, 2},
                               {2, 100, 64, 4, 1},
                               {1, 100, 64, 4, 4},
                               {1, 70, 256, 2, 1}};

TEST_F(CudaBackendOps, AttentionGqaForward) {
  for (const GqaShape& g : kGqaShapes) {
    const int W = g.C + 2 * g.NKV * (g.C / g.NH);
    for (const Dtype dt : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T " + std::to_string(g.T) + " C " +
                   std::to_string(g.C) + " NH " + std::to_string(g.NH) + " NKV " +
                   std::to_string(g.NKV));
      const auto qkv = normal(size_t(g.B) * g.T * W, dt);
      std::vector<float> out(size_t(g.B) * g.T * g.C), lse(size_t(g.B) * g.NH * g.T);
      cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), g.B, g.T, g.C, g.NH,
                                   cpu::kAttentionTile, g.NKV);
      void* d_out = poisoned(out.size(), dt);
      void* d_lse = poisoned(lse.size(), Dtype::kF32);
      ops_->attention_gqa_forward(dt, d_out, d_lse, to_device(qkv, dt), g.B, g.T, g.C, g.NH, g.NKV);
      expect_close("out", from_device(d_out, out.size(), dt), rounded(out, dt), tol(dt));
      expect_close("lse", from_device(d_lse, lse.size(), Dtype::kF32), lse, kTolFp32);
    }
  }
}

TEST_F(CudaBackendOps, AttentionGqaBackward) {
  for (const GqaShape& g : kGqaShapes) {
    const int W = g.C + 2 * g.NKV * (g.C / g.NH);
    for (const Dtype dt : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " T " + std::to_string(g.T) + " C " +
                   std::to_string(g.C) + " NH " + std::to_string(g.NH) + " NKV " +
                   std::to_string(g.NKV));
      const auto qkv = normal(size_t(g.B) * g.T * W, dt);
      const auto dout = normal(size_t(g.B) * g.T * g.C, dt);
      std::vector<float> out(size_t(g.B) * g.T * g.C), lse(size_t(g.B) * g.NH * g.T);
      cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), g.B, g.T, g.C, g.NH,
                                   cpu::kAttentionTile, g.NKV);
      out = rounded(out, dt);  // what the forward stored in dt: the input of both backwards
      auto dqkv = normal(qkv.size(), dt);
      void* d_dqkv = to_device(dqkv, dt);
      cpu::attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(),
                                    g.B, g.T, g.C, g.NH, cpu::kAttentionTile, g.NKV);
      ops_->attention_gqa_backward(dt, d_dqkv, to_device(dout, dt), to_device(qkv, dt),
                                   to_device(out, dt), to_device(lse, Dtype::kF32), g.B, g.T, g.C,
                                   g.NH, g.NKV);
      expect_close("dqkv", from_device(d_dqkv, dqkv.size(), dt), rounded(dqkv, dt), tol(dt));
    }
  }
}

TEST_F(CudaBackendOps, AttentionGqaRefusesKvHeadsThatDoNotDivide) {
  EXPECT_TRUE(ops_->llama_ops());
  void* x = alloc(1 << 16);
  EXPECT_THROW(ops_->attention_gqa_forward(Dtype::kF32, x, x, x, 1, 4, 48, 4, 3), std::exception);
}

TEST_F(CudaBackendOps, GeluForward) {
  const size_t n = 4099;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto inp = normal(n, dt, 3.0f);
    std::vector<float> out(n);
    cpu::gelu_forward(out.data(), inp.data(), n);
    void* d_out = poisoned(n, dt);
    ops_->gelu_forward(dt, d_out, to_device(inp, dt), n);
    expect_close("out", from_device(d_out, n, dt), rounded(out, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, GeluBackward) {
  const size_t n = 4099;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto inp = normal(n, dt, 3.0f), dout = normal(n, dt);
    auto dinp = normal(n, dt);
    void* d_dinp = to_device(dinp, dt);
    cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), n);
    ops_->gelu_backward(dt, d_dinp, to_device(inp, dt), to_device(dout, dt), n);
    expect_close("dinp", from_device(d_dinp, n, dt), rounded(dinp, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, AddInplace) {  // the residual's backward
  const size_t n = 4099;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    auto dst = normal(n, dt);
    const auto src = normal(n, dt);
    void* d_dst = to_device(dst, dt);
    cpu::add_inplace(dst.data(), src.data(), n);
    ops_->add_inplace(dt, d_dst, to_device(src, dt), n);
    expect_close("dst", from_device(d_dst, n, dt), rounded(dst, dt), tol(dt));
  }
}

TEST_F(CudaBackendOps, CrossentropyForwardBackward) {
  const int N = 23, V = 1031;
  for (const Dtype dt : kF32AndBF16) {
    SCOPED_TRACE(dtype_name(dt));
    auto logits = normal(size_t(N) * V, dt, 3.0f);
    auto targets = ints(N, 0, V - 1);
    targets[4] = -1;  // ignored rows
    targets[17] = -1;
    const float dloss = 1.0f / N;
    void* d_logits = to_device(logits, dt);
    void* d_losses = poisoned(N, Dtype::kF32);  // losses are f32 for every storage dtype
    std::vector<float> losses(N);
    cpu::crossentropy_forward_backward(logits.data(), losses.data(), targets.data(), N, V, dloss);
    ops_->crossentropy_forward_backward(
        dt, d_logits, d_losses, static_cast<const int32_t*>(to_device_raw(targets)), N, V, dloss);
    expect_close("losses", from_device(d_losses, N, Dtype::kF32), losses, kTolFp32);
    expect_close("dlogits", from_device(d_logits, logits.size(), dt), rounded(logits, dt), tol(dt));
  }
}

// --- optimizer updates (f32)
// ------------------------------------------------------------------------

TEST_F(CudaBackendOps, AdamwUpdate) {
  const size_t n = 4099;
  auto param = normal(n), m = normal(n, Dtype::kF32, 0.1f), v = normal(n, Dtype::kF32, 0.1f);
  for (auto& x : v)
    x = x * x;  // second moments are non-negative
  const auto grad = normal(n);
  void* d_param = to_device(param, Dtype::kF32);
  void* d_m = to_device(m, Dtype::kF32);
  void* d_v = to_device(v, Dtype::kF32);
  const int64_t t = 7;
  cpu::adamw_update(param.data(), grad.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                    0.1f, t);
  ops_->adamw_update(
      static_cast<float*>(d_param), static_cast<const float*>(to_device(grad, Dtype::kF32)),
      static_cast<float*>(d_m), static_cast<float*>(d_v), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  expect_close("param", from_device(d_param, n, Dtype::kF32), param, kTolFp32);
  expect_close("m", from_device(d_m, n, Dtype::kF32), m, kTolFp32);
  expect_close("v", from_device(d_v, n, Dtype::kF32), v, kTolFp32);
}

TEST_F(CudaBackendOps, SgdUpdate) {
  const size_t n = 4099;
  const auto grad = normal(n);
  for (const float momentum : {0.0f, 0.9f}) {
    SCOPED_TRACE("momentum " + std::to_string(momentum));
    auto param = normal(n), buf = normal(n);
    void* d_param = to_device(param, Dtype::kF32);
    void* d_buf = to_device(buf, Dtype::kF32);
    cpu::sgd_update(param.data(), grad.data(), momentum != 0.0f ? buf.data() : nullptr, n, 0.1f,
                    momentum, 0.01f);
    ops_->sgd_update(
        static_cast<float*>(d_param), static_cast<const float*>(to_device(grad, Dtype::kF32)),
        momentum != 0.0f ? static_cast<float*>(d_buf) : nullptr, n, 0.1f, momentum, 0.01f);
    expect_close("param", from_device(d_param, n, Dtype::kF32), param, kTolFp32);
    expect_close("momentum_buf", from_device(d_buf, n, Dtype::kF32), buf, kTolFp32);
  }
}

// The update writing amp's compute copy in its own kernel (Backend::Stored::compute): masters,
// state and copy bitwise those of the same update followed by cast(), on the GPU.
TEST_F(CudaBackendOps, UpdateWritingTheComputeCopyIsTheUpdateThenTheCast) {
  const size_t n = 4099;
  for (const bool sgd : {false, true})
    for (const Dtype state : {Dtype::kF32, Dtype::kBF16})
      for (const Dtype copy : {Dtype::kBF16, Dtype::kF16})
        for (const float scale : {1.0f, 0.37f}) {
          SCOPED_TRACE(std::string(sgd ? "sgd" : "adamw") + " state " + dtype_name(state) +
                       " copy " + dtype_name(copy) + " grad_scale " + std::to_string(scale));
          const auto param = normal(n), grad = normal(n, Dtype::kF32, 1e-2f),
                     m = normal(n, state, 1e-3f);
          auto v = normal(n, Dtype::kF32, 1e-2f);
          for (auto& x : v)
            x = x * x;  // second moments are non-negative
          struct Result {
            std::vector<uint8_t> param, m, v, copy;
          };
          auto run = [&](bool fused) {
            void* dp = to_device(param, Dtype::kF32);
            void* dg = to_device(grad, Dtype::kF32);
            void* dm = to_device(m, state);
            void* dv = to_device(v, state);
            void* dc = poisoned(n, copy);
            Backend::Stored o;
            o.state = state;
            o.grad_scale = scale;
            o.seed = 11;
            if (fused) {
              o.compute = dc;
              o.compute_dtype = copy;
            }
            if (sgd) {
              ops_->sgd_update_stored(o, dp, dg, dm, n, 3e-2f, 0.9f, 0.1f);
            } else {
              ops_->adamw_update_stored(o, dp, dg, dm, dv, n, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7);
            }
            if (!fused) ops_->cast(dc, copy, dp, Dtype::kF32, n);
            const size_t s = dtype_size(state);
            return Result{bytes_of(dp, n * 4), bytes_of(dm, n * s), bytes_of(dv, n * s),
                          bytes_of(dc, n * 2)};
          };
          const Result want = run(false), got = run(true);
          expect_same_bytes("masters", got.param, want.param);
          expect_same_bytes("m", got.m, want.m);
          expect_same_bytes("v", got.v, want.v);
          expect_same_bytes("compute copy", got.copy, want.copy);
        }
}

// --- element-wise ops and reductions: the CPU backend's arithmetic, bit for bit
// ---------------------

// Values that exercise the rounding: ties, subnormals, overflow of f16, infinities, NaN.
std::vector<float> special_values() {
  const float inf = std::numeric_limits<float>::infinity();
  return {0.0f,        -0.0f,         1.0f,         -1.0f,         1.00390625f, 1.01171875f,
          3.14159265f, 1e-40f,        -1e-45f,      2.9802322e-8f, 6.1e-5f,     65504.0f,
          65519.0f,    65520.0f,      70000.0f,     -1e30f,        3.0e38f,     inf,
          -inf,        std::nanf(""), 0.333333343f, -2.5e-3f,      1234.5678f,  -7.0e-6f};
}

TEST_F(CudaBackendOps, FillEveryDtype) {
  const size_t n = 1029;
  for (const Dtype dt : kAllDtypes) {
    for (const double value : {0.0, -0.0, 1.3, -2.5e-3, 70000.0}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " value " + std::to_string(value));
      void* x = poisoned(n, dt);
      ops_->fill(dt, x, n, value);
      // The CPU backend writes zero bits for any zero, else the value through float.
      const std::vector<uint8_t> want =
          value == 0.0 ? std::vector<uint8_t>(n * dtype_size(dt), 0)
                       : encode(std::vector<float>(n, static_cast<float>(value)), dt);
      expect_same_bytes("fill", bytes_of(x, n * dtype_size(dt)), want);
    }
  }
}

// A quantized frozen weight's transient: the per-element math is kernels/common/quant.h's on both
// sides (no fused multiply-add in the double-quantized absmax), so the bytes are the CPU's, in
// every compute dtype, for every kind, with a ragged last block.
TEST_F(CudaBackendOps, DequantizeEveryKindAndDtype) {
  const uint64_t n = 64 * 300 + 37;
  const auto x = normal(n, Dtype::kF32, 0.05f);
  for (const QuantKind k : {QuantKind::kBF16, QuantKind::kInt8, QuantKind::kNF4}) {
    for (const bool dq : {false, true}) {
      if (k == QuantKind::kBF16 && dq) continue;
      std::vector<uint8_t> q(quant_tensor_bytes(k, n, dq));
      cpu::quantize_tensor(k, x.data(), n, dq, q.data());
      std::vector<float> ref(n);
      cpu::dequantize_tensor(k, q.data(), n, dq, [&](uint64_t i, float v) { ref[i] = v; });
      const void* d_q = to_device_bytes(q);
      for (const Dtype dt : kAllDtypes) {
        SCOPED_TRACE(std::string("kind ") + std::to_string(uint32_t(k)) + (dq ? " dq " : " ") +
                     dtype_name(dt));
        void* d_out = poisoned(n, dt);
        ops_->dequantize(dt, d_out, d_q, k, dq, n);
        expect_same_bytes("dequantize", bytes_of(d_out, n * dtype_size(dt)), encode(ref, dt));
      }
    }
  }
}

TEST_F(CudaBackendOps, CastEveryPair) {
  std::vector<float> values = special_values();
  const auto more = normal(1000, Dtype::kF32, 100.0f);
  values.insert(values.end(), more.begin(), more.end());
  const size_t n = values.size();
  for (const Dtype src_dt : kAllDtypes) {
    for (const Dtype dst_dt : kAllDtypes) {
      SCOPED_TRACE(std::string(dtype_name(src_dt)) + " -> " + dtype_name(dst_dt));
      const std::vector<uint8_t> src = encode(values, src_dt);
      void* d_dst = poisoned(n, dst_dt);
      ops_->cast(d_dst, dst_dt, to_device_bytes(src), src_dt, n);
      // Widen exactly, round once to nearest even (the same functions on both sides); a cast to
      // the same dtype is a copy.
      const std::vector<uint8_t> want =
          src_dt == dst_dt ? src : encode(decode(src, src_dt), dst_dt);
      expect_same_bytes("cast", bytes_of(d_dst, n * dtype_size(dst_dt)), want);
    }
  }
}

TEST_F(CudaBackendOps, ScaleEveryDtype) {
  const size_t n = 4099;
  for (const Dtype dt : kAllDtypes) {
    for (const double s : {0.37, 1.0 / 65536.0, 65536.0}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " s " + std::to_string(s));
      const auto x = normal(n, dt, 3.0f);
      void* d_x = to_device(x, dt);
      ops_->scale(dt, d_x, n, s);
      // core/device/backend_cpu.cpp: f32 multiplies by float(s); 16-bit dtypes multiply in double.
      std::vector<float> want(n);
      for (size_t i = 0; i < n; i++)
        want[i] = dt == Dtype::kF32 ? x[i] * static_cast<float>(s)
                                    : static_cast<float>(static_cast<double>(x[i]) * s);
      expect_same_bytes("scale", bytes_of(d_x, n * dtype_size(dt)), encode(want, dt));
    }
  }
}

TEST_F(CudaBackendOps, AxpyEveryDtype) {
  const size_t n = 4099;
  const double a = -0.7;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto x = normal(n, dt), y = normal(n, dt);
    void* d_y = to_device(y, dt);
    ops_->axpy(dt, d_y, to_device(x, dt), n, a);
    // core/device/backend_cpu.cpp: f32 adds float(a) * x (two roundings); 16-bit dtypes work in
    // double.
    std::vector<float> want(n);
    for (size_t i = 0; i < n; i++) {
      if (dt == Dtype::kF32) {
        const float prod = static_cast<float>(a) * x[i];
        want[i] = y[i] + prod;
      } else {
        want[i] = static_cast<float>(static_cast<double>(y[i]) + a * static_cast<double>(x[i]));
      }
    }
    expect_same_bytes("axpy", bytes_of(d_y, n * dtype_size(dt)), encode(want, dt));
  }
}

TEST_F(CudaBackendOps, AccumulateWidensEveryDtypeIntoF32) {
  const size_t n = 4099;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto x = normal(n, dt), y = normal(n, Dtype::kF32);
    void* d_y = to_device(y, Dtype::kF32);
    ops_->accumulate(static_cast<float*>(d_y), to_device(x, dt), dt, n);
    // core/device/backend_cpu.cpp: one rounded f32 add of the widened (exact) x.
    std::vector<float> want(n);
    for (size_t i = 0; i < n; i++)
      want[i] = y[i] + x[i];
    expect_same_bytes("accumulate", bytes_of(d_y, n * sizeof(float)), encode(want, Dtype::kF32));
  }
}

// headroom.ops/1's element-wise ops (kernels/cuda/pointwise.cu) against the CPU backend's, bit for
// bit: both compute kernels/common/pointwise.h's function of each element. Inputs include zeros,
// negatives (sqrt's NaN) and, for binary, equal pairs (max / min ties).
class CudaPointwise : public CudaBackendOps {
 protected:
  std::unique_ptr<Backend> cpu_ = make_cpu_backend(1);
  static constexpr size_t kN = 4099;
  std::vector<float> inputs(Dtype dt) {
    auto x = normal(kN, dt, 2.0f);
    x[0] = 0.0f;
    x[1] = -0.0f;
    x[2] = -4.0f;
    return x;
  }
  // The CPU backend's result of `op` on host images of x (and y), as bytes of dt.
  template <class F>
  std::vector<uint8_t> on_cpu(Dtype dt, const std::vector<float>& x, const std::vector<float>& y,
                              F&& op) {
    std::vector<uint8_t> bx = encode(x, dt), by = encode(y, dt), out(kN * dtype_size(dt));
    op(*cpu_, out.data(), bx.data(), by.data());
    return out;
  }
};

TEST_F(CudaPointwise, BinaryEveryOpAndDtypeIsTheCpusBitwise) {
  for (const Dtype dt : kAllDtypes) {
    for (const BinaryOp op : {BinaryOp::kAdd, BinaryOp::kSub, BinaryOp::kMul, BinaryOp::kDiv,
                              BinaryOp::kMax, BinaryOp::kMin}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " op " + std::to_string(uint32_t(op)));
      const auto x = inputs(dt);
      auto y = normal(kN, dt, 2.0f);
      y[3] = x[3];  // a tie
      void* d_z = poisoned(kN, dt);
      ops_->binary(op, dt, d_z, to_device(x, dt), to_device(y, dt), kN);
      const auto want = on_cpu(dt, x, y, [&](Backend& b, void* z, const void* px, const void* py) {
        b.binary(op, dt, z, px, py, kN);
      });
      expect_same_bytes("binary", bytes_of(d_z, kN * dtype_size(dt)), want);
    }
  }
}

TEST_F(CudaPointwise, UnaryEveryOpAndDtypeIsTheCpusBitwise) {
  for (const Dtype dt : kAllDtypes) {
    for (const UnaryOp op :
         {UnaryOp::kSign, UnaryOp::kSqrt, UnaryOp::kAbs, UnaryOp::kNeg, UnaryOp::kReciprocal}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " op " + std::to_string(uint32_t(op)));
      const auto x = inputs(dt);
      void* d_x = to_device(x, dt);
      ops_->unary(op, dt, d_x, d_x, kN);  // in place
      const auto want = on_cpu(dt, x, x, [&](Backend& b, void* y, const void* px, const void*) {
        b.unary(op, dt, y, px, kN);
      });
      expect_same_bytes("unary", bytes_of(d_x, kN * dtype_size(dt)), want);
    }
  }
}

TEST_F(CudaPointwise, LerpAndAffineEveryDtypeAreTheCpusBitwise) {
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const auto x = inputs(dt), y = normal(kN, dt, 2.0f);
    void* d_z = poisoned(kN, dt);
    ops_->lerp(dt, d_z, to_device(x, dt), to_device(y, dt), 0.9f, kN);
    expect_same_bytes("lerp", bytes_of(d_z, kN * dtype_size(dt)),
                      on_cpu(dt, x, y, [&](Backend& b, void* z, const void* px, const void* py) {
                        b.lerp(dt, z, px, py, 0.9f, kN);
                      }));
    void* d_y = poisoned(kN, dt);
    ops_->affine(dt, d_y, to_device(x, dt), 0.999f, 1e-8f, kN);
    expect_same_bytes("affine", bytes_of(d_y, kN * dtype_size(dt)),
                      on_cpu(dt, x, y, [&](Backend& b, void* out, const void* px, const void*) {
                        b.affine(dt, out, px, 0.999f, 1e-8f, kN);
                      }));
  }
}

// The ops only enqueue: no host wait is counted for them.
TEST_F(CudaPointwise, OpsAddNoHostSyncs) {
  const auto x = inputs(Dtype::kF32);
  void* d_x = to_device(x, Dtype::kF32);
  const uint64_t before = ops_->host_syncs();
  ops_->binary(BinaryOp::kMul, Dtype::kF32, d_x, d_x, d_x, kN);
  ops_->unary(UnaryOp::kSign, Dtype::kF32, d_x, d_x, kN);
  ops_->lerp(Dtype::kF32, d_x, d_x, d_x, 0.5f, kN);
  ops_->affine(Dtype::kF32, d_x, d_x, 2.0f, 1.0f, kN);
  EXPECT_EQ(ops_->host_syncs(), before);
}

TEST_F(CudaBackendOps, SumSquaresEveryDtype) {
  // Large enough that every block of the fixed grid strides several times; and the tiny cases.
  for (const Dtype dt : kAllDtypes) {
    for (const size_t n : {size_t(1000003), size_t(1), size_t(0)}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " n = " + std::to_string(n));
      const auto x = normal(n, dt);
      double want = 0.0;
      for (const float v : x)
        want += static_cast<double>(v) * v;
      const double got = ops_->sum_squares(dt, to_device(x, dt), n);
      // Both accumulate in double: only the order of the additions differs.
      EXPECT_LT(rel_error(std::vector<double>{got}, std::vector<double>{want}), 1e-12)
          << "got " << got << ", want " << want << " (seed " << seed_ << ")";
      // Deterministic: the same bits again.
      if (n > 0) {
        EXPECT_EQ(ops_->sum_squares(dt, to_device(x, dt), n), got);
      }
    }
  }
}

// The fused gradient norm: each span's sum as sum_squares computes it, added in order, with one
// wait (Backend::host_syncs) for all of them.
TEST_F(CudaBackendOps, SumSquaresManyIsThePerSpanSumsWithOneWait) {
  std::vector<Backend::Span> spans;
  for (const Dtype dt : kAllDtypes)
    for (const size_t n : {size_t(70001), size_t(1), size_t(0), size_t(4096)})
      spans.push_back({dt, to_device(normal(n, dt), dt), n});
  double separate = 0.0;
  for (const Backend::Span& s : spans)
    separate += ops_->sum_squares(s.dtype, s.data, s.numel);
  const uint64_t before = ops_->host_syncs();
  EXPECT_EQ(ops_->sum_squares_many(spans), separate);
  EXPECT_EQ(ops_->host_syncs() - before, 1u);
  EXPECT_EQ(ops_->sum_squares_many({}), 0.0);
}

TEST_F(CudaBackendOps, AnyNonfiniteEveryDtype) {
  const size_t n = 100003;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    auto x = normal(n, dt, 100.0f);
    EXPECT_FALSE(ops_->any_nonfinite(dt, to_device(x, dt), n));
    EXPECT_FALSE(ops_->any_nonfinite(dt, to_device(x, dt), 0));
    for (const float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      auto y = x;
      y[n - 7] = bad;
      EXPECT_TRUE(ops_->any_nonfinite(dt, to_device(y, dt), n)) << bad;
    }
    // 70000 is finite in f32 and bf16 and overflows f16 to infinity.
    auto z = x;
    z[3] = 70000.0f;
    EXPECT_EQ(ops_->any_nonfinite(dt, to_device(z, dt), n), dt == Dtype::kF16);
  }
}

// amp's fused overflow check: the or of the per-tensor checks, with one wait.
TEST_F(CudaBackendOps, AnyNonfiniteManyIsTheOrOfThePerSpanChecksWithOneWait) {
  std::vector<std::vector<float> > host;
  std::vector<Backend::Span> spans;
  for (const Dtype dt : kAllDtypes)
    for (const size_t n : {size_t(70001), size_t(1), size_t(0), size_t(4096)}) {
      host.push_back(normal(n, dt));
      spans.push_back({dt, to_device(host.back(), dt), n});
    }
  uint64_t before = ops_->host_syncs();
  EXPECT_FALSE(ops_->any_nonfinite_many(spans));
  EXPECT_EQ(ops_->host_syncs() - before, 1u);
  EXPECT_FALSE(ops_->any_nonfinite_many({}));
  // A NaN in each non-empty span in turn (the others clean): the flag is cleared once, set by any.
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].numel == 0) continue;
    std::vector<float> bad = host[i];
    bad.back() = std::nanf("");
    std::vector<Backend::Span> with = spans;
    with[i].data = to_device(bad, spans[i].dtype);
    EXPECT_TRUE(ops_->any_nonfinite_many(with)) << "span " << i;
  }
  EXPECT_FALSE(ops_->any_nonfinite_many(spans)) << "the flag of the last call does not stick";
}

// Grad::kWrite over a poisoned buffer gives what a zero fill and the accumulating op give.
TEST_F(CudaBackendOps, GradWriteEqualsFillThenAccumulate) {
  const int N = 67, C = 96, OC = 160;
  for (const Dtype dt : kAllDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    void* dout = to_device(normal(size_t(N) * OC, dt), dt);
    void* inp = to_device(normal(size_t(N) * C, dt), dt);
    void* w = to_device(normal(size_t(OC) * C, dt), dt);
    void* dres = to_device(normal(size_t(N) * C, dt), dt);
    const size_t nc = size_t(N) * C;
    auto compare = [&](const char* what, const std::function<void(void*, Grad)>& op) {
      void* acc = alloc(nc * dtype_size(dt));
      ops_->fill(dt, acc, nc, 0.0);
      op(acc, Grad::kAccumulate);
      void* wr = poisoned(nc, dt);
      op(wr, Grad::kWrite);
      EXPECT_EQ(bytes_of(acc, nc * dtype_size(dt)), bytes_of(wr, nc * dtype_size(dt))) << what;
    };
    compare("matmul_backward", [&](void* d, Grad g) {
      ops_->matmul_backward(dt, d, alloc(size_t(OC) * C * dtype_size(dt)), nullptr, dout, inp, w, N,
                            C, OC, g);
    });
    compare("gelu_backward",
            [&](void* d, Grad g) { ops_->gelu_backward(dt, d, inp, dres, nc, g); });
    void* lnw = to_device(normal(C, dt), dt);
    void* lnb = to_device(normal(C, dt), dt);
    void* mean = alloc(N * sizeof(float));
    void* rstd = alloc(N * sizeof(float));
    ops_->layernorm_forward(dt, alloc(nc * dtype_size(dt)), mean, rstd, inp, lnw, lnb, N, C);
    void* dy = to_device(normal(nc, dt), dt);
    compare("layernorm_backward", [&](void* d, Grad g) {
      ops_->layernorm_backward(dt, d, nullptr, nullptr, dy, inp, lnw, mean, rstd, N, C, g);
    });
    // With the residual path: accumulate onto a copy of dres, or write dres + the gradient.
    void* acc = alloc(nc * dtype_size(dt));
    ops_->copy(acc, dres, nc * dtype_size(dt));
    ops_->layernorm_backward(dt, acc, nullptr, nullptr, dy, inp, lnw, mean, rstd, N, C);
    void* wr = poisoned(nc, dt);
    ops_->layernorm_backward(dt, wr, nullptr, nullptr, dy, inp, lnw, mean, rstd, N, C, Grad::kWrite,
                             dres);
    EXPECT_EQ(bytes_of(acc, nc * dtype_size(dt)), bytes_of(wr, nc * dtype_size(dt))) << "dres";
    // Llama's: RMSNorm (with and without the residual path) and SwiGLU (dgu (N, 2H), 2H = C).
    void* rms_rstd = alloc(N * sizeof(float));
    ops_->rmsnorm_forward(dt, alloc(nc * dtype_size(dt)), rms_rstd, inp, lnw, N, C, 1e-5);
    compare("rmsnorm_backward", [&](void* d, Grad g) {
      ops_->rmsnorm_backward(dt, d, nullptr, dy, inp, lnw, rms_rstd, N, C, g);
    });
    ops_->copy(acc, dres, nc * dtype_size(dt));
    ops_->rmsnorm_backward(dt, acc, nullptr, dy, inp, lnw, rms_rstd, N, C);
    void* wr_rms = poisoned(nc, dt);
    ops_->rmsnorm_backward(dt, wr_rms, nullptr, dy, inp, lnw, rms_rstd, N, C, Grad::kWrite, dres);
    EXPECT_EQ(bytes_of(acc, nc * dtype_size(dt)), bytes_of(wr_rms, nc * dtype_size(dt)))
        << "rmsnorm dres";
    compare("swiglu_backward",
            [&](void* d, Grad g) { ops_->swiglu_backward(dt, d, inp, dy, N, C / 2, g); });
  }
}

// Double-buffered staging: a slot's uploads are done once wait_uploads returns, whatever the
// compute stream is doing; refilling the slot then does not change what was uploaded.
TEST_F(CudaBackendOps, UploadSlotsAreReusableAfterTheirEvent) {
  const size_t n = size_t(1) << 22;
  void* staging = ops_->host_alloc(n * sizeof(float));
  float* h = static_cast<float*>(staging);
  void* x = alloc(n * sizeof(float));
  for (int round = 0; round < 3; ++round) {
    const int slot = round % Backend::kUploadSlots;
    ops_->wait_uploads(slot);
    std::fill(h, h + n, float(round + 1));
    ops_->upload(x, h, n * sizeof(float));
    ops_->mark_uploads(slot);
    ops_->wait_uploads(slot);
    std::fill(h, h + n, -1.0f);  // the copy has read the slot: this must not reach x
    const std::vector<float> got = from_device(x, n, Dtype::kF32);
    EXPECT_EQ(std::count(got.begin(), got.end(), float(round + 1)), std::ptrdiff_t(n))
        << "round " << round;
  }
  EXPECT_THROW(ops_->wait_uploads(Backend::kUploadSlots), OpError);
  ops_->host_free(staging);
}

// --- memory and streams
// -----------------------------------------------------------------------------

TEST_F(CudaBackendOps, UploadCopyDownloadThroughPinnedStaging) {
  const size_t bytes = (size_t(1) << 20) + 12;
  uint8_t* host = static_cast<uint8_t*>(ops_->host_alloc(bytes));
  ASSERT_NE(host, nullptr);
  for (size_t i = 0; i < bytes; i++)
    host[i] = static_cast<uint8_t>(i * 131 + 7);
  void* a = alloc(bytes);
  void* b = alloc(bytes);
  ops_->upload(a, host, bytes);
  ops_->copy(b, a, bytes);  // an op after the upload sees its bytes
  const std::vector<uint8_t> got = bytes_of(b, bytes);
  EXPECT_EQ(first_difference(got, std::vector<uint8_t>(host, host + bytes)), -1);
  ops_->synchronize();
  ops_->host_free(host);
}

TEST_F(CudaBackendOps, UploadIsOrderedAfterEarlierOpsAndBeforeLaterOnes) {
  const size_t n = size_t(1) << 22;  // 16 MiB of f32: long enough to race if unordered
  const std::vector<float> ones(n, 1.0f);
  const std::vector<uint8_t> image = encode(ones, Dtype::kF32);
  void* x = alloc(image.size());
  // fill (compute stream) then upload (copy stream) to the same buffer: the upload lands last.
  ops_->fill(Dtype::kF32, x, n, 5.0);
  ops_->upload(x, image.data(), image.size());
  // scale after the upload sees the uploaded ones.
  ops_->scale(Dtype::kF32, x, n, 3.0);
  const std::vector<float> got = from_device(x, n, Dtype::kF32);
  const size_t wrong =
      static_cast<size_t>(std::count_if(got.begin(), got.end(), [](float v) { return v != 3.0f; }));
  EXPECT_EQ(wrong, 0u) << "elements not 3 (fill 5 then upload 1 then scale 3): first " << got[0]
                       << ", last " << got[n - 1];
}

TEST_F(CudaBackendOps, Float64AndIntegerDtypesAreRefused) {
  void* x = alloc(64);
  try {
    ops_->fill(Dtype::kF64, x, 8, 1.0);
    ADD_FAILURE() << "f64 fill did not throw";
  } catch (const OpError& e) {
    EXPECT_NE(std::string(e.what()).find("fill"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops_->gelu_forward(Dtype::kF64, x, x, 8), OpError);
  EXPECT_THROW(ops_->scale(Dtype::kI32, x, 16, 2.0), OpError);
  EXPECT_THROW(ops_->cast(x, Dtype::kF32, x, Dtype::kF64, 4), OpError);
  EXPECT_THROW(ops_->sum_squares(Dtype::kF64, x, 8), OpError);
  EXPECT_NE(ops_->native_stream(), nullptr);
}

// --- the device: memory wall, backend memory, virtual memory
// ----------------------------------------

class CudaDeviceMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    probe_ = cuda_device(0, &why);
    if (!probe_) GTEST_SKIP() << "no GPU: the CUDA device tests need one (" << why << ")";
  }
  std::unique_ptr<Device> probe_;
};

TEST_F(CudaDeviceMemory, MemoryLimitIsAWallWithAReport) {
  std::string why;
  const uint64_t MiB = uint64_t(1) << 20;
  auto device = cuda_device(4 * MiB, &why);
  ASSERT_TRUE(device) << why;
  EXPECT_EQ(device->kind(), "cuda");
  EXPECT_EQ(device->memory_limit(), 4 * MiB);
  Buffer a(*device, 3 * MiB, Category::kParameters, "a");
  EXPECT_EQ(device->backend_stats().capacity, 4 * MiB);
  EXPECT_EQ(device->backend_stats().used, 3 * MiB);
  EXPECT_EQ(device->try_allocate(2 * MiB, Category::kActivations, "b"), nullptr);
  try {
    Buffer b(*device, 2 * MiB, Category::kActivations, "b (B, T, C)");
    FAIL() << "allocation past the limit succeeded";
  } catch (const OutOfMemory& e) {
    const OomReport& r = e.report();
    EXPECT_EQ(r.requested, 2 * MiB);
    EXPECT_EQ(r.limit, 4 * MiB);
    EXPECT_EQ(r.live_total, 3 * MiB);
    EXPECT_EQ(r.what, "b (B, T, C)");
    EXPECT_EQ(r.reserved_unused, 0u);
    EXPECT_NE(r.str().find("out of memory: b (B, T, C)"), std::string::npos) << r.str();
  }
  Buffer c(*device, 1 * MiB, Category::kActivations, "c");  // exactly at the limit is fine
  EXPECT_EQ(device->tracker().live_total(), 4 * MiB);
}

TEST_F(CudaDeviceMemory, BackendAllocationsAreCounted) {
  Device& d = *probe_;
  const uint64_t before = d.backend_stats().used;
  void* p = d.backend_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(d.backend_stats().used, before + 1000);
  EXPECT_GT(d.backend_stats().capacity, 0u);
  EXPECT_GT(d.backend_stats().largest_free, 0u);
  d.backend_free(p);
  EXPECT_EQ(d.backend_stats().used, before);
  // More than any card has: refused, not thrown.
  EXPECT_EQ(d.backend_allocate(uint64_t(1) << 50), nullptr);
}

TEST_F(CudaDeviceMemory, VirtualMemoryMapsAndUnmapsPageByPage) {
  Device& d = *probe_;
  Backend& ops = d.backend();
  const uint64_t g = d.vm_granularity();
  ASSERT_GT(g, 0u);
  EXPECT_EQ(g & (g - 1), 0u) << "granularity " << g << " is not a power of two";
  char* base = static_cast<char*>(d.vm_reserve(4 * g));
  if (base == nullptr) GTEST_SKIP() << "this device or driver has no virtual memory management";
  const uint64_t before = d.backend_stats().used;
  ASSERT_TRUE(d.vm_map(base, 2 * g));
  EXPECT_EQ(d.backend_stats().used, before + 2 * g);
  const uint64_t n = 2 * g / sizeof(float);
  ops.fill(Dtype::kF32, base, n, 1.5);
  EXPECT_EQ(ops.sum_squares(Dtype::kF32, base, n), 2.25 * double(n));
  d.vm_unmap(base + g, g);  // the second page only
  EXPECT_EQ(d.backend_stats().used, before + g);
  EXPECT_EQ(ops.sum_squares(Dtype::kF32, base, n / 2), 2.25 * double(n / 2));  // first page kept
  ASSERT_TRUE(d.vm_map(base + g, 3 * g));  // grow to the end of the range
  EXPECT_EQ(d.backend_stats().used, before + 4 * g);
  d.vm_unmap(base, 4 * g);
  d.vm_release(base, 4 * g);
  EXPECT_EQ(d.backend_stats().used, before);
}

TEST_F(CudaDeviceMemory, VmMapPastTheLimitFails) {
  const uint64_t g = probe_->vm_granularity();
  std::string why;
  auto device = cuda_device(g, &why);  // room for one page
  ASSERT_TRUE(device) << why;
  char* base = static_cast<char*>(device->vm_reserve(2 * g));
  if (base == nullptr) GTEST_SKIP() << "this device or driver has no virtual memory management";
  EXPECT_FALSE(device->vm_map(base, 2 * g));
  EXPECT_EQ(device->backend_stats().used, 0u);
  EXPECT_TRUE(device->vm_map(base, g));
  EXPECT_EQ(device->backend_stats().used, g);
  EXPECT_EQ(device->backend_allocate(1), nullptr);  // the page holds the whole limit
  device->vm_release(base, 2 * g);                  // unmaps what is still mapped
  EXPECT_EQ(device->backend_stats().used, 0u);
}

TEST_F(CudaDeviceMemory, IndexOutOfRangeIsAConfigError) {
  DeviceConfig dc;
  dc.kind = "cuda";
  dc.index = 4096;
  try {
    make_cuda_device(dc);
    FAIL() << "device.index = 4096 was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("device.index = 4096: only "), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("CUDA device(s) present"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_HAVE_CUDA
