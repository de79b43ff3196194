// The CUDA backend's ops (kernels/cuda/ops.h) against the CPU backend (kernels/cpu/*.h), which is
// the reference: fresh random inputs each run (the seed is printed with any failure), fp32
// relative error (norm-wise) below 1e-5, a NaN or infinity never passes, and every output buffer
// is poisoned with NaN before the GPU writes it, so an element the kernel forgets is caught.
// Backward ops accumulate, so their gradient buffers start from the same random values on both
// sides instead (that checks the += as well).
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

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/residual.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace headroom {
namespace {

constexpr double kTolFp32 = 1e-5;

// A device array of n elements, freed on scope exit.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ > 0) CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), n_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  void upload(const std::vector<T>& host) {
    if (n_ > 0) CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0) CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // All bits set: a NaN in float and double, so an element the kernel never writes shows up.
  void poison() {
    if (n_ > 0) CUDA_CHECK(cudaMemset(ptr_, 0xFF, n_ * sizeof(T)));
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

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

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      (void)cudaGetLastError();  // clear the sticky error, if any
      GTEST_SKIP() << "no CUDA device: the CUDA-vs-CPU op tests need a GPU (cudaGetDeviceCount: "
                   << (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices") << ")";
    }
    CUDA_CHECK(cudaStreamCreate(&stream_));
    ctx_ = std::make_unique<cuda::CudaContext>();
    seed_ = std::random_device{}();
    gen_.seed(seed_);
  }
  void TearDown() override {
    ctx_.reset();
    if (stream_ != nullptr) {
      const cudaError_t err = cudaStreamSynchronize(stream_);
      if (err != cudaSuccess)
        ADD_FAILURE() << "CUDA error after the test: " << cudaGetErrorString(err);
      (void)cudaStreamDestroy(stream_);
    }
  }

  void sync() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  std::vector<float> normal(size_t n, float scale = 1.0f, float offset = 0.0f) {
    std::normal_distribution<float> dist(offset, scale);
    std::vector<float> v(n);
    for (auto& x : v)
      x = dist(gen_);
    return v;
  }
  std::vector<int32_t> ints(size_t n, int32_t lo, int32_t hi) {  // uniform in [lo, hi]
    std::uniform_int_distribution<int32_t> dist(lo, hi);
    std::vector<int32_t> v(n);
    for (auto& x : v)
      x = dist(gen_);
    return v;
  }

  template <class T>
  void expect_close(const char* what, const std::vector<T>& got, const std::vector<T>& want,
                    double tol = kTolFp32) {
    const double err = rel_error(got, want);
    EXPECT_LT(err, tol) << what << ": CUDA vs CPU relative error " << err << " (seed " << seed_
                        << ")";
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::CudaContext> ctx_;
  uint32_t seed_ = 0;
  std::mt19937 gen_;
};

TEST_F(CudaOps, EmbeddingForward) {
  const int B = 3, T = 17, C = 40, V = 53, maxT = 20;
  const auto tokens = ints(static_cast<size_t>(B) * T, 0, V - 1);
  const auto wte = normal(static_cast<size_t>(V) * C), wpe = normal(static_cast<size_t>(maxT) * C);
  std::vector<float> want(static_cast<size_t>(B) * T * C);
  cpu::embedding_forward(want.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);

  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<float> d_wte(wte), d_wpe(wpe), d_out(want.size());
  d_out.poison();
  cuda::embedding_forward(d_out.get(), d_tokens.get(), d_wte.get(), d_wpe.get(), B, T, C, stream_);
  sync();
  expect_close("out", d_out.download(), want);
}

TEST_F(CudaOps, EmbeddingBackward) {
  const int B = 3, T = 17, C = 40, V = 11, maxT = 20;  // small V: many repeated tokens
  const auto tokens = ints(static_cast<size_t>(B) * T, 0, V - 1);
  const auto dout = normal(static_cast<size_t>(B) * T * C);
  auto dwte = normal(static_cast<size_t>(V) * C), dwpe = normal(static_cast<size_t>(maxT) * C);
  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<float> d_dout(dout), d_dwte(dwte), d_dwpe(dwpe);
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  cuda::embedding_backward(d_dwte.get(), d_dwpe.get(), d_dout.get(), d_tokens.get(), B, T, C,
                           stream_);
  sync();
  expect_close("dwte", d_dwte.download(), dwte);
  expect_close("dwpe", d_dwpe.download(), dwpe);
}

TEST_F(CudaOps, LayernormForward) {
  const int N = 37, C = 67;
  const auto inp = normal(static_cast<size_t>(N) * C, 2.0f, 3.0f);  // a mean far from 0
  const auto weight = normal(C), bias = normal(C);
  std::vector<float> out(static_cast<size_t>(N) * C), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                         bias.data(), N, C);

  DeviceBuffer<float> d_inp(inp), d_w(weight), d_b(bias), d_out(out.size()), d_mean(N), d_rstd(N);
  d_out.poison();
  d_mean.poison();
  d_rstd.poison();
  cuda::layernorm_forward(d_out.get(), d_mean.get(), d_rstd.get(), d_inp.get(), d_w.get(),
                          d_b.get(), N, C, stream_);
  sync();
  expect_close("out", d_out.download(), out);
  expect_close("mean", d_mean.download(), mean);
  expect_close("rstd", d_rstd.download(), rstd);
}

TEST_F(CudaOps, LayernormBackward) {
  const int N = 37, C = 67;
  const auto inp = normal(static_cast<size_t>(N) * C, 2.0f, 3.0f);
  const auto weight = normal(C), bias = normal(C), dout = normal(static_cast<size_t>(N) * C);
  std::vector<float> out(static_cast<size_t>(N) * C), mean(N), rstd(N);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                         bias.data(), N, C);
  auto dinp = normal(static_cast<size_t>(N) * C), dweight = normal(C), dbias = normal(C);

  DeviceBuffer<float> d_inp(inp), d_w(weight), d_dout(dout), d_mean(mean), d_rstd(rstd);
  DeviceBuffer<float> d_dinp(dinp), d_dw(dweight), d_db(dbias);
  cpu::layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                          weight.data(), mean.data(), rstd.data(), N, C);
  cuda::layernorm_backward(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(),
                           d_w.get(), d_mean.get(), d_rstd.get(), N, C, stream_);
  sync();
  expect_close("dinp", d_dinp.download(), dinp);
  expect_close("dweight", d_dw.download(), dweight);
  expect_close("dbias", d_db.download(), dbias);
}

TEST_F(CudaOps, MatmulForward) {
  struct Shape {
    int N, C, OC;
    bool bias;
  };
  for (const Shape s :
       {Shape{37, 53, 101, true}, Shape{74, 48, 144, false}, Shape{64, 96, 32, true}}) {
    SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) +
                 " OC=" + std::to_string(s.OC) + (s.bias ? " bias" : " no bias"));
    const auto inp = normal(static_cast<size_t>(s.N) * s.C);
    const auto weight = normal(static_cast<size_t>(s.OC) * s.C), bias = normal(s.OC);
    std::vector<float> out(static_cast<size_t>(s.N) * s.OC);
    cpu::matmul_forward(out.data(), inp.data(), weight.data(), s.bias ? bias.data() : nullptr, s.N,
                        s.C, s.OC);

    DeviceBuffer<float> d_inp(inp), d_w(weight), d_b(bias), d_out(out.size());
    d_out.poison();
    cuda::matmul_forward(*ctx_, d_out.get(), d_inp.get(), d_w.get(), s.bias ? d_b.get() : nullptr,
                         s.N, s.C, s.OC, stream_);
    sync();
    expect_close("out", d_out.download(), out);
  }
}

TEST_F(CudaOps, MatmulBackward) {
  const int N = 37, C = 53, OC = 101;
  const auto inp = normal(static_cast<size_t>(N) * C), weight = normal(static_cast<size_t>(OC) * C);
  const auto dout = normal(static_cast<size_t>(N) * OC);
  auto dinp = normal(static_cast<size_t>(N) * C), dweight = normal(static_cast<size_t>(OC) * C);
  auto dbias = normal(OC);
  DeviceBuffer<float> d_inp(inp), d_w(weight), d_dout(dout), d_dinp(dinp), d_dw(dweight),
      d_db(dbias);
  cpu::matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(),
                       weight.data(), N, C, OC);
  cuda::matmul_backward(*ctx_, d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(),
                        d_w.get(), N, C, OC, stream_);
  sync();
  expect_close("dinp", d_dinp.download(), dinp);
  expect_close("dweight", d_dw.download(), dweight);
  expect_close("dbias", d_db.download(), dbias);
}

TEST_F(CudaOps, AttentionForward) {
  const int B = 2, T = 19, C = 48, NH = 4;
  const auto qkv = normal(static_cast<size_t>(B) * T * 3 * C);
  std::vector<float> out(static_cast<size_t>(B) * T * C), att(static_cast<size_t>(B) * NH * T * T);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);

  DeviceBuffer<float> d_qkv(qkv), d_out(out.size()), d_att(att.size());
  d_out.poison();
  d_att.poison();
  cuda::attention_forward(*ctx_, d_out.get(), d_att.get(), d_qkv.get(), B, T, C, NH, stream_);
  sync();
  expect_close("out", d_out.download(), out);
  expect_close("att", d_att.download(), att);
}

TEST_F(CudaOps, AttentionBackward) {
  const int B = 2, T = 19, C = 48, NH = 4;
  const auto qkv = normal(static_cast<size_t>(B) * T * 3 * C);
  const auto dout = normal(static_cast<size_t>(B) * T * C);
  std::vector<float> out(static_cast<size_t>(B) * T * C), att(static_cast<size_t>(B) * NH * T * T);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  auto dqkv = normal(qkv.size());
  std::vector<float> scratch(static_cast<size_t>(T) * T);

  DeviceBuffer<float> d_qkv(qkv), d_dout(dout), d_att(att), d_dqkv(dqkv);
  DeviceBuffer<float> d_scratch(static_cast<size_t>(NH) * T * T);
  d_scratch.poison();  // "contents undefined on entry": the kernel must not read them
  cpu::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B, T, C,
                          NH);
  cuda::attention_backward(*ctx_, d_dqkv.get(), d_scratch.get(), d_dout.get(), d_qkv.get(),
                           d_att.get(), B, T, C, NH, stream_);
  sync();
  expect_close("dqkv", d_dqkv.download(), dqkv);
}

TEST_F(CudaOps, GeluForward) {
  const size_t N = 4099;
  const auto inp = normal(N, 3.0f);
  std::vector<float> out(N);
  cpu::gelu_forward(out.data(), inp.data(), N);
  DeviceBuffer<float> d_inp(inp), d_out(N);
  d_out.poison();
  cuda::gelu_forward(d_out.get(), d_inp.get(), N, stream_);
  sync();
  expect_close("out", d_out.download(), out);
}

TEST_F(CudaOps, GeluBackward) {
  const size_t N = 4099;
  const auto inp = normal(N, 3.0f), dout = normal(N);
  auto dinp = normal(N);
  DeviceBuffer<float> d_inp(inp), d_dout(dout), d_dinp(dinp);
  cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), N);
  cuda::gelu_backward(d_dinp.get(), d_inp.get(), d_dout.get(), N, stream_);
  sync();
  expect_close("dinp", d_dinp.download(), dinp);
}

TEST_F(CudaOps, ResidualForward) {
  const size_t N = 4099;
  const auto a = normal(N), b = normal(N);
  std::vector<float> out(N);
  cpu::residual_forward(out.data(), a.data(), b.data(), N);
  DeviceBuffer<float> d_a(a), d_b(b), d_out(N);
  d_out.poison();
  cuda::residual_forward(d_out.get(), d_a.get(), d_b.get(), N, stream_);
  sync();
  expect_close("out", d_out.download(), out);
}

TEST_F(CudaOps, AddInplace) {  // the residual's backward
  const size_t N = 4099;
  auto dst = normal(N);
  const auto src = normal(N);
  DeviceBuffer<float> d_dst(dst), d_src(src);
  cpu::add_inplace(dst.data(), src.data(), N);
  cuda::add_inplace(d_dst.get(), d_src.get(), N, stream_);
  sync();
  expect_close("dst", d_dst.download(), dst);
}

TEST_F(CudaOps, CrossentropyForwardBackward) {
  const int N = 23, V = 1031;
  auto logits = normal(static_cast<size_t>(N) * V, 3.0f);
  auto targets = ints(N, 0, V - 1);
  targets[4] = -1;  // ignored rows
  targets[17] = -1;
  const float dloss = 1.0f / N;
  DeviceBuffer<float> d_logits(logits), d_losses(N);
  DeviceBuffer<int32_t> d_targets(targets);
  d_losses.poison();
  std::vector<float> losses(N);
  cpu::crossentropy_forward_backward(logits.data(), losses.data(), targets.data(), N, V, dloss);
  cuda::crossentropy_forward_backward(d_logits.get(), d_losses.get(), d_targets.get(), N, V, dloss,
                                      stream_);
  sync();
  expect_close("losses", d_losses.download(), losses);
  expect_close("dlogits", d_logits.download(), logits);
}

TEST_F(CudaOps, AdamwUpdate) {
  const size_t n = 4099;
  auto param = normal(n), m = normal(n, 0.1f), v = normal(n, 0.1f);
  for (auto& x : v)
    x = x * x;  // second moments are non-negative
  const auto grad = normal(n);
  DeviceBuffer<float> d_param(param), d_grad(grad), d_m(m), d_v(v);
  const int64_t t = 7;
  cpu::adamw_update(param.data(), grad.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f,
                    0.1f, t);
  cuda::adamw_update(d_param.get(), d_grad.get(), d_m.get(), d_v.get(), n, 1e-3f, 0.9f, 0.95f,
                     1e-8f, 0.1f, t, stream_);
  sync();
  expect_close("param", d_param.download(), param);
  expect_close("m", d_m.download(), m);
  expect_close("v", d_v.download(), v);
}

TEST_F(CudaOps, SgdUpdate) {
  const size_t n = 4099;
  const auto grad = normal(n);
  for (const float momentum : {0.0f, 0.9f}) {
    SCOPED_TRACE("momentum " + std::to_string(momentum));
    auto param = normal(n), buf = normal(n);
    DeviceBuffer<float> d_param(param), d_grad(grad), d_buf(buf);
    cpu::sgd_update(param.data(), grad.data(), momentum != 0.0f ? buf.data() : nullptr, n, 0.1f,
                    momentum, 0.01f);
    cuda::sgd_update(d_param.get(), d_grad.get(), momentum != 0.0f ? d_buf.get() : nullptr, n, 0.1f,
                     momentum, 0.01f, stream_);
    sync();
    expect_close("param", d_param.download(), param);
    expect_close("momentum_buf", d_buf.download(), buf);
  }
}

TEST_F(CudaOps, ScaleInplace) {
  const size_t n = 4099;
  auto x = normal(n);
  DeviceBuffer<float> d_x(x);
  cpu::scale_inplace(x.data(), n, 0.37f);
  cuda::scale_inplace(d_x.get(), n, 0.37f, stream_);
  sync();
  expect_close("x", d_x.download(), x);
}

TEST_F(CudaOps, SumSquares) {
  // Large enough that every block of the fixed grid strides several times; and the empty case.
  for (const size_t n : {size_t(1000003), size_t(1), size_t(0)}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const auto x = normal(n);
    const double want = cpu::sum_squares(x.data(), n);
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<double> d_out(1), d_scratch(cuda::kSumSquaresBlocks);
    d_out.poison();
    d_scratch.poison();
    cuda::sum_squares(d_out.get(), d_scratch.get(), d_x.get(), n, stream_);
    sync();
    // Both sides accumulate in double: only the order of the additions differs.
    expect_close("sum", d_out.download(), std::vector<double>{want}, 1e-12);
  }
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_HAVE_CUDA
