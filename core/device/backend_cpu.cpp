// The CPU backend's op table: the reference every other backend is checked against.
//
// f32 and f64 tensors go straight to the kernels of kernels/cpu (templates over the element
// type). bf16 and f16 tensors are computed in fp32: each op widens its inputs to float, runs the
// f32 kernel, and rounds its outputs back to the storage dtype to nearest even — the same
// conversions (kernels/common/dtype.h) the CUDA kernels use in registers. The float copies live
// only for the op's duration in host memory outside the device's accounting: they stand for a
// GPU's registers, not for device memory.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device/backend.h"
#include "kernels/common/dropout.h"
#include "kernels/common/dtype.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/bf16_ops.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/profile.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/residual.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace headroom {

namespace {

// Tensors of a native dtype (float, double): the kernels read and write them where they are.
template <class T>
struct Native {
  const T* in(const void* x, uint64_t) const { return static_cast<const T*>(x); }
  T* out(void* x, uint64_t, bool) const { return static_cast<T*>(x); }
  T* stat(void* x) const { return static_cast<T*>(x); }
  const T* stat(const void* x) const { return static_cast<const T*>(x); }
};

float load_low(Dtype dt, const void* x, uint64_t i) {
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  return dt == Dtype::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}

uint16_t to_low(Dtype dt, float f) {
  return dt == Dtype::kBF16 ? float_to_bf16(f) : float_to_f16(f);
}

// The widened copies' float buffers, kept between ops: a step widens the same shapes over and
// over, and a fresh allocation of that size is a fresh mmap, paged in (and zeroed) again each
// time. A buffer is reused for a request of at least half its size; at most kPoolBytes stay.
class FloatPool {
 public:
  struct Buf {
    std::unique_ptr<float[]> p;
    uint64_t n = 0;
  };
  static Buf take(uint64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu());
      std::vector<Buf>& free = bufs();
      size_t best = free.size();
      for (size_t i = 0; i < free.size(); ++i)
        if (free[i].n >= n && free[i].n / 2 <= n &&
            (best == free.size() || free[i].n < free[best].n))
          best = i;
      if (best != free.size()) {
        Buf b = std::move(free[best]);
        free.erase(free.begin() + std::ptrdiff_t(best));
        held() -= b.n;
        return b;
      }
    }
    return {std::unique_ptr<float[]>(new float[n]), n};
  }
  static void give(Buf b) {
    std::lock_guard<std::mutex> lock(mu());
    std::vector<Buf>& free = bufs();
    held() += b.n;
    free.push_back(std::move(b));
    while (held() * sizeof(float) > kPoolBytes) {  // the oldest go first
      held() -= free.front().n;
      free.erase(free.begin());
    }
  }

 private:
  static constexpr uint64_t kPoolBytes = uint64_t(256) << 20;
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::vector<Buf>& bufs() {
    static std::vector<Buf> v;
    return v;
  }
  static uint64_t& held() {
    static uint64_t h = 0;
    return h;
  }
};

// Tensors of a 16-bit dtype, widened to float for one op: in() copies, out() registers a float
// buffer that finish() rounds back into the tensor. Statistics are f32 already. The conversions
// are kernels/cpu/convert.h (vectorized, on the threads). An output's buffer starts zeroed, as
// before: an op that writes part of its output (the attention's masked half) rounds zeros into
// the rest.
class Widened {
 public:
  explicit Widened(Dtype dt) : dt_(dt) {}
  Widened(const Widened&) = delete;
  Widened& operator=(const Widened&) = delete;
  ~Widened() {
    for (FloatPool::Buf& b : buffers_)
      FloatPool::give(std::move(b));
  }
  const float* in(const void* x, uint64_t n) {
    if (!x) return nullptr;
    float* f = buffer(n, false);
    const uint16_t* h = static_cast<const uint16_t*>(x);
    dt_ == Dtype::kBF16 ? cpu::widen_bf16(h, f, n) : cpu::widen_f16(h, f, n);
    return f;
  }
  // `load`: the op reads the tensor too (an accumulating gradient, an in-place update).
  float* out(void* x, uint64_t n, bool load) {
    if (!x) return nullptr;
    float* f = load ? const_cast<float*>(in(x, n)) : buffer(n, true);
    outs_.push_back({x, f, n});
    return f;
  }
  float* stat(void* x) const { return static_cast<float*>(x); }
  const float* stat(const void* x) const { return static_cast<const float*>(x); }
  void finish() {
    for (const Out& o : outs_) {
      uint16_t* dst = static_cast<uint16_t*>(o.dst);
      dt_ == Dtype::kBF16 ? cpu::round_bf16(o.src, dst, o.n) : cpu::round_f16(o.src, dst, o.n);
    }
  }

 private:
  struct Out {
    void* dst;
    const float* src;
    uint64_t n;
  };
  float* buffer(uint64_t n, bool zero) {
    float* f = buffers_.emplace_back(FloatPool::take(n)).p.get();
    if (zero) std::memset(f, 0, n * sizeof(float));
    return f;
  }
  Dtype dt_;
  std::vector<FloatPool::Buf> buffers_;
  std::vector<Out> outs_;
};

// Runs fn with the access object for dt: Native<float>, Native<double> or Widened.
template <class Fn>
void dispatch(Dtype dt, const char* op, Fn&& fn) {
  switch (dt) {
    case Dtype::kF32:
      fn(Native<float>{});
      return;
    case Dtype::kF64:
      fn(Native<double>{});
      return;
    case Dtype::kBF16:
    case Dtype::kF16: {
      Widened w(dt);
      fn(w);
      w.finish();
      return;
    }
    case Dtype::kI32:
      break;
  }
  throw OpError(std::string(op) + ": needs a floating-point dtype (f32, bf16, f16, f64), got " +
                dtype_name(dt));
}

// Element i of x as a double, for the element-wise ops over any float dtype.
double load(const void* x, Dtype d, uint64_t i) {
  switch (d) {
    case Dtype::kF32:
      return static_cast<const float*>(x)[i];
    case Dtype::kF64:
      return static_cast<const double*>(x)[i];
    case Dtype::kBF16:
    case Dtype::kF16:
      return load_low(d, x, i);
    case Dtype::kI32:
      return static_cast<const int32_t*>(x)[i];
  }
  return 0.0;
}

void store(void* x, Dtype d, uint64_t i, double v) {
  switch (d) {
    case Dtype::kF32:
      static_cast<float*>(x)[i] = static_cast<float>(v);
      return;
    case Dtype::kF64:
      static_cast<double*>(x)[i] = v;
      return;
    // Through float first, as the storage formats are defined from it.
    case Dtype::kBF16:
    case Dtype::kF16:
      static_cast<uint16_t*>(x)[i] = to_low(d, static_cast<float>(v));
      return;
    case Dtype::kI32:
      static_cast<int32_t*>(x)[i] = static_cast<int32_t>(v);
      return;
  }
}

void require_dtype(Dtype d, const char* op) {
  if (dtype_size(d) == 0)
    throw OpError(std::string(op) + ": unknown dtype " + std::to_string(uint32_t(d)));
}

void require_float(Dtype d, const char* op) {
  require_dtype(d, op);
  if (d == Dtype::kI32) throw OpError(std::string(op) + ": needs a floating-point dtype, got i32");
}

// The storage of headroom.ops/1's element-wise ops: element i widened to float, a float rounded
// back to nearest even.
struct F32Io {
  static float get(const void* p, uint64_t i) { return static_cast<const float*>(p)[i]; }
  static void put(void* p, uint64_t i, float v) { static_cast<float*>(p)[i] = v; }
};
struct Bf16Io {
  static float get(const void* p, uint64_t i) {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  static void put(void* p, uint64_t i, float v) { static_cast<uint16_t*>(p)[i] = float_to_bf16(v); }
};
struct F16Io {
  static float get(const void* p, uint64_t i) {
    return f16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
  static void put(void* p, uint64_t i, float v) { static_cast<uint16_t*>(p)[i] = float_to_f16(v); }
};

// Runs fn with the Io of dt (f32, bf16, f16); OpError for any other dtype.
template <class Fn>
void pointwise_dispatch(Dtype dt, const char* op, Fn&& fn) {
  switch (dt) {
    case Dtype::kF32:
      fn(F32Io{});
      return;
    case Dtype::kBF16:
      fn(Bf16Io{});
      return;
    case Dtype::kF16:
      fn(F16Io{});
      return;
    default:
      break;
  }
  throw OpError(std::string(op) + ": needs f32, bf16 or f16, got " + dtype_name(dt));
}

// out[i] = f(i) for i in [0, n), on the threads when n is large. Each i reads its inputs before
// it writes its output, so an output may be an input's buffer.
template <class Io, class F>
void pointwise_map(void* out, uint64_t n, F&& f) {
  const int64_t count = int64_t(n);
#pragma omp parallel for schedule(static) if (count >= (int64_t(1) << 15)) \
    num_threads(cpu::threads())
  for (int64_t i = 0; i < count; ++i)
    Io::put(out, uint64_t(i), f(uint64_t(i)));
}

// bf16 and f16 linear layers go to kernels/cpu/matmul.h's 16-bit path: oneDNN's matmul on the
// 16-bit tensors where it is fast (AMX, AVX-512 BF16), else the widened f32 GEMM, GEMM by GEMM.
// HEADROOM_CPU_BF16_GEMM=0 keeps them on the widened path of every other op.
bool lowp_gemm(Dtype dt) {
  return (dt == Dtype::kBF16 || dt == Dtype::kF16) && cpu::lowp_gemm_enabled();
}
// bf16 element-wise and row-wise ops (GELU, the residual add, LayerNorm and the two fused, the
// loss, the embedding, the tiled attention) go to
// kernels/cpu/bf16_ops.h: computed on the bf16 tensors where they are, one parallel region an op,
// bitwise the widened path. HEADROOM_CPU_BF16_EW=0 keeps them widened (a benchmark's "before").
bool bf16_direct(Dtype dt) {
  static const bool on = [] {
    const char* e = std::getenv("HEADROOM_CPU_BF16_EW");
    return !(e && std::string(e) == "0");
  }();
  return dt == Dtype::kBF16 && on;
}
cpu::Lowp lowp(Dtype dt) {
  return dt == Dtype::kBF16 ? cpu::Lowp::kBF16 : cpu::Lowp::kF16;
}
uint16_t* u16(void* p) {
  return static_cast<uint16_t*>(p);
}
const uint16_t* u16(const void* p) {
  return static_cast<const uint16_t*>(p);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) { cpu::set_threads(threads); }
  std::string describe() const override {
    const int n = cpu::threads();
    return "GEMM " + cpu::gemm_library() + "; " + cpu::lowp_gemm_library(cpu::Lowp::kBF16) + "; " +
           std::to_string(n) + " thread" + (n == 1 ? "" : "s") + " (OpenMP)";
  }
  void embedding_forward(Dtype dt, void* out, const int32_t* tokens, const void* wte,
                         const void* wpe, int B, int T, int C) override {
    cpu::OpTimer timer_("embedding_forward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::embedding_forward_bf16(u16(out), tokens, u16(wte), u16(wpe), B, T, C);
    const uint64_t N = uint64_t(B) * T;
    dispatch(dt, "embedding_forward", [&](auto&& a) {
      // The token table is read only at the tokens' rows; widening all of it would cost V·C.
      cpu::embedding_forward(a.out(out, N * C, false), tokens, a.in(wte, vocab_rows(tokens, N) * C),
                             a.in(wpe, uint64_t(T) * C), B, T, C);
    });
  }
  void embedding_backward(Dtype dt, void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                          int B, int T, int C) override {
    cpu::OpTimer timer_("embedding_backward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::embedding_backward_bf16(u16(dwte), u16(dwpe), u16(dout), tokens, B, T, C);
    const uint64_t N = uint64_t(B) * T;
    dispatch(dt, "embedding_backward", [&](auto&& a) {
      cpu::embedding_backward(a.out(dwte, vocab_rows(tokens, N) * C, true),
                              a.out(dwpe, uint64_t(T) * C, true), a.in(dout, N * C), tokens, B, T,
                              C);
    });
  }
  void layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, const void* inp,
                         const void* weight, const void* bias, int N, int C) override {
    cpu::OpTimer timer_("layernorm_forward", dtype_name(dt));
    const uint64_t n = uint64_t(N) * C;
    if (bf16_direct(dt) && weight && bias) {
      cpu::layernorm_forward_bf16(u16(out), static_cast<float*>(mean), static_cast<float*>(rstd),
                                  u16(inp), u16(weight), u16(bias), N, C);
      return;
    }
    dispatch(dt, "layernorm_forward", [&](auto&& a) {
      cpu::layernorm_forward(a.out(out, n, false), a.stat(mean), a.stat(rstd), a.in(inp, n),
                             a.in(weight, C), a.in(bias, C), N, C);
    });
  }
  void residual_layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, void* res,
                                  const void* x, const void* weight, const void* bias, int N,
                                  int C) override {
    cpu::OpTimer timer_("residual_layernorm_forward", dtype_name(dt));
    if (!cpu::detail::fuse_enabled())
      return Backend::residual_layernorm_forward(dt, out, mean, rstd, res, x, weight, bias, N, C);
    if (bf16_direct(dt) && weight && bias)
      return cpu::residual_layernorm_forward_bf16(u16(out), static_cast<float*>(mean),
                                                  static_cast<float*>(rstd), u16(res), u16(x),
                                                  u16(weight), u16(bias), N, C);
    if (dt == Dtype::kF32)
      return cpu::residual_layernorm_forward(
          static_cast<float*>(out), static_cast<float*>(mean), static_cast<float*>(rstd),
          static_cast<float*>(res), static_cast<const float*>(x), static_cast<const float*>(weight),
          static_cast<const float*>(bias), N, C);
    if (dt == Dtype::kF64)
      return cpu::residual_layernorm_forward(
          static_cast<double*>(out), static_cast<double*>(mean), static_cast<double*>(rstd),
          static_cast<double*>(res), static_cast<const double*>(x),
          static_cast<const double*>(weight), static_cast<const double*>(bias), N, C);
    // f16 (and bf16 widened): the two ops, each through its widened copies.
    Backend::residual_layernorm_forward(dt, out, mean, rstd, res, x, weight, bias, N, C);
  }
  void layernorm_backward(Dtype dt, void* dinp, void* dweight, void* dbias, const void* dout,
                          const void* inp, const void* weight, const void* mean, const void* rstd,
                          int N, int C, Grad dinp_mode, const void* dres) override {
    cpu::OpTimer timer_("layernorm_backward", dtype_name(dt));
    const uint64_t n = uint64_t(N) * C;
    const bool acc = dinp_mode == Grad::kAccumulate;
    if (acc && dres) throw OpError("layernorm_backward: dres is for Grad::kWrite only");
    // An input gradient over an input (never in the model) takes the widened path, which copies
    // the inputs first.
    if (bf16_direct(dt) && dinp != dout && dinp != inp) {
      cpu::layernorm_backward_bf16(u16(dinp), u16(dweight), u16(dbias), u16(dout), u16(inp),
                                   u16(weight), static_cast<const float*>(mean),
                                   static_cast<const float*>(rstd), N, C, acc, u16(dres));
      return;
    }
    dispatch(dt, "layernorm_backward", [&](auto&& a) {
      cpu::layernorm_backward(a.out(dinp, n, acc), a.out(dweight, C, true), a.out(dbias, C, true),
                              a.in(dout, n), a.in(inp, n), a.in(weight, C), a.stat(mean),
                              a.stat(rstd), N, C, acc, a.in(dres, n));
    });
  }
  void matmul_forward(Dtype dt, void* out, const void* inp, const void* weight, const void* bias,
                      int N, int C, int OC) override {
    cpu::OpTimer timer_("matmul_forward", dtype_name(dt));
    if (lowp_gemm(dt)) {
      cpu::matmul_forward_lowp(lowp(dt), u16(out), u16(inp), u16(weight), u16(bias), N, C, OC);
      return;
    }
    dispatch(dt, "matmul_forward", [&](auto&& a) {
      cpu::matmul_forward(a.out(out, uint64_t(N) * OC, false), a.in(inp, uint64_t(N) * C),
                          a.in(weight, uint64_t(OC) * C), a.in(bias, OC), N, C, OC);
    });
  }
  void matmul_backward(Dtype dt, void* dinp, void* dweight, void* dbias, const void* dout,
                       const void* inp, const void* weight, int N, int C, int OC,
                       Grad dinp_mode) override {
    cpu::OpTimer timer_("matmul_backward", dtype_name(dt));
    const bool acc = dinp_mode == Grad::kAccumulate;
    if (lowp_gemm(dt)) {
      cpu::matmul_backward_lowp(lowp(dt), u16(dinp), u16(dweight), u16(dbias), u16(dout), u16(inp),
                                u16(weight), N, C, OC, acc);
      return;
    }
    dispatch(dt, "matmul_backward", [&](auto&& a) {
      cpu::matmul_backward(a.out(dinp, uint64_t(N) * C, acc),
                           a.out(dweight, uint64_t(OC) * C, true), a.out(dbias, OC, true),
                           a.in(dout, uint64_t(N) * OC), a.in(inp, uint64_t(N) * C),
                           a.in(weight, uint64_t(OC) * C), N, C, OC, acc);
    });
  }
  void attention_forward(Dtype dt, void* out, void* att, const void* qkv, int B, int T, int C,
                         int NH) override {
    cpu::OpTimer timer_("attention_forward", dtype_name(dt));
    const uint64_t N = uint64_t(B) * T;
    dispatch(dt, "attention_forward", [&](auto&& a) {
      cpu::attention_forward(a.out(out, N * C, false), a.out(att, N * NH * T, false),
                             a.in(qkv, N * 3 * C), B, T, C, NH);
    });
  }
  void attention_backward(Dtype dt, void* dqkv, void* scratch, const void* dout, const void* qkv,
                          const void* att, int B, int T, int C, int NH) override {
    cpu::OpTimer timer_("attention_backward", dtype_name(dt));
    const uint64_t N = uint64_t(B) * T;
    dispatch(dt, "attention_backward", [&](auto&& a) {
      cpu::attention_backward(
          a.out(dqkv, N * 3 * C, true), a.out(scratch, attention_scratch_numel(B, T, NH), false),
          a.in(dout, N * C), a.in(qkv, N * 3 * C), a.in(att, N * NH * T), B, T, C, NH);
    });
  }
  void attention_tiled_forward(Dtype dt, void* out, void* lse, const void* qkv, int B, int T, int C,
                               int NH) override {
    cpu::OpTimer timer_("attention_tiled_forward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::attention_tiled_forward_bf16(u16(out), static_cast<float*>(lse), u16(qkv), B, T,
                                               C, NH);
    const uint64_t N = uint64_t(B) * T;
    dispatch(dt, "attention_tiled_forward", [&](auto&& a) {
      cpu::attention_tiled_forward(a.out(out, N * C, false), a.stat(lse), a.in(qkv, N * 3 * C), B,
                                   T, C, NH);
    });
  }
  void attention_tiled_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                                const void* out, const void* lse, int B, int T, int C,
                                int NH) override {
    cpu::OpTimer timer_("attention_tiled_backward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::attention_tiled_backward_bf16(u16(dqkv), u16(dout), u16(qkv), u16(out),
                                                static_cast<const float*>(lse), B, T, C, NH);
    const uint64_t N = uint64_t(B) * T;
    dispatch(dt, "attention_tiled_backward", [&](auto&& a) {
      cpu::attention_tiled_backward(a.out(dqkv, N * 3 * C, true), a.in(dout, N * C),
                                    a.in(qkv, N * 3 * C), a.in(out, N * C), a.stat(lse), B, T, C,
                                    NH);
    });
  }
  uint64_t attention_scratch_numel(int, int T, int) const override { return uint64_t(T) * T; }
  void attention_decode(Dtype dt, void* out, const void* qkv, int T, int C, int NH) override {
    cpu::OpTimer timer_("attention_decode", dtype_name(dt));
    dispatch(dt, "attention_decode", [&](auto&& a) {
      cpu::attention_decode(a.out(out, uint64_t(C), false), a.in(qkv, uint64_t(T) * 3 * C), T, C,
                            NH);
    });
  }
  bool llama_ops() const override { return true; }
  void rmsnorm_forward(Dtype dt, void* out, void* rstd, const void* inp, const void* weight, int N,
                       int C, double eps) override {
    cpu::OpTimer timer_("rmsnorm_forward", dtype_name(dt));
    const uint64_t n = uint64_t(N) * C;
    dispatch(dt, "rmsnorm_forward", [&](auto&& a) {
      cpu::rmsnorm_forward(a.out(out, n, false), a.stat(rstd), a.in(inp, n), a.in(weight, C), N, C,
                           eps);
    });
  }
  void rmsnorm_backward(Dtype dt, void* dinp, void* dweight, const void* dout, const void* inp,
                        const void* weight, const void* rstd, int N, int C, Grad dinp_mode,
                        const void* dres) override {
    cpu::OpTimer timer_("rmsnorm_backward", dtype_name(dt));
    const uint64_t n = uint64_t(N) * C;
    const bool acc = dinp_mode == Grad::kAccumulate;
    if (acc && dres) throw OpError("rmsnorm_backward: dres is for Grad::kWrite only");
    dispatch(dt, "rmsnorm_backward", [&](auto&& a) {
      cpu::rmsnorm_backward(a.out(dinp, n, acc), a.out(dweight, C, true), a.in(dout, n),
                            a.in(inp, n), a.in(weight, C), a.stat(rstd), N, C, acc, a.in(dres, n));
    });
  }
  void swiglu_forward(Dtype dt, void* out, const void* gu, int N, int H) override {
    cpu::OpTimer timer_("swiglu_forward", dtype_name(dt));
    const uint64_t n = uint64_t(N) * H;
    dispatch(dt, "swiglu_forward",
             [&](auto&& a) { cpu::swiglu_forward(a.out(out, n, false), a.in(gu, 2 * n), N, H); });
  }
  void swiglu_backward(Dtype dt, void* dgu, const void* gu, const void* dout, int N, int H,
                       Grad dgu_mode) override {
    cpu::OpTimer timer_("swiglu_backward", dtype_name(dt));
    const uint64_t n = uint64_t(N) * H;
    const bool acc = dgu_mode == Grad::kAccumulate;
    dispatch(dt, "swiglu_backward", [&](auto&& a) {
      cpu::swiglu_backward(a.out(dgu, 2 * n, acc), a.in(gu, 2 * n), a.in(dout, n), N, H, acc);
    });
  }
  void rope_forward(Dtype dt, void* qkv, int B, int T, int NH, int NKV, int hs,
                    const RopeParams& p) override {
    cpu::OpTimer timer_("rope_forward", dtype_name(dt));
    const uint64_t n = uint64_t(B) * T * (NH + 2 * NKV) * hs;
    dispatch(dt, "rope_forward",
             [&](auto&& a) { cpu::rope_forward(a.out(qkv, n, true), B, T, NH, NKV, hs, p); });
  }
  void rope_backward(Dtype dt, void* dqkv, int B, int T, int NH, int NKV, int hs,
                     const RopeParams& p) override {
    cpu::OpTimer timer_("rope_backward", dtype_name(dt));
    const uint64_t n = uint64_t(B) * T * (NH + 2 * NKV) * hs;
    dispatch(dt, "rope_backward",
             [&](auto&& a) { cpu::rope_backward(a.out(dqkv, n, true), B, T, NH, NKV, hs, p); });
  }
  void attention_gqa_forward(Dtype dt, void* out, void* lse, const void* qkv, int B, int T, int C,
                             int NH, int NKV) override {
    cpu::OpTimer timer_("attention_gqa_forward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::attention_tiled_forward_bf16(u16(out), static_cast<float*>(lse), u16(qkv), B, T,
                                               C, NH, cpu::kAttentionTile, NKV);
    const uint64_t N = uint64_t(B) * T, W = uint64_t(C) + 2 * uint64_t(C) / NH * NKV;
    dispatch(dt, "attention_gqa_forward", [&](auto&& a) {
      cpu::attention_tiled_forward(a.out(out, N * C, false), a.stat(lse), a.in(qkv, N * W), B, T, C,
                                   NH, cpu::kAttentionTile, NKV);
    });
  }
  void attention_gqa_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const void* lse, int B, int T, int C, int NH,
                              int NKV) override {
    cpu::OpTimer timer_("attention_gqa_backward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::attention_tiled_backward_bf16(u16(dqkv), u16(dout), u16(qkv), u16(out),
                                                static_cast<const float*>(lse), B, T, C, NH,
                                                cpu::kAttentionTile, NKV);
    const uint64_t N = uint64_t(B) * T, W = uint64_t(C) + 2 * uint64_t(C) / NH * NKV;
    dispatch(dt, "attention_gqa_backward", [&](auto&& a) {
      cpu::attention_tiled_backward(a.out(dqkv, N * W, true), a.in(dout, N * C), a.in(qkv, N * W),
                                    a.in(out, N * C), a.stat(lse), B, T, C, NH, cpu::kAttentionTile,
                                    NKV);
    });
  }
  void gelu_forward(Dtype dt, void* out, const void* inp, uint64_t n) override {
    cpu::OpTimer timer_("gelu_forward", dtype_name(dt));
    if (bf16_direct(dt)) return cpu::gelu_forward_bf16(u16(out), u16(inp), n);
    dispatch(dt, "gelu_forward",
             [&](auto&& a) { cpu::gelu_forward(a.out(out, n, false), a.in(inp, n), n); });
  }
  void gelu_backward(Dtype dt, void* dinp, const void* inp, const void* dout, uint64_t n,
                     Grad dinp_mode) override {
    cpu::OpTimer timer_("gelu_backward", dtype_name(dt));
    const bool acc = dinp_mode == Grad::kAccumulate;
    if (bf16_direct(dt)) return cpu::gelu_backward_bf16(u16(dinp), u16(inp), u16(dout), n, acc);
    dispatch(dt, "gelu_backward", [&](auto&& a) {
      cpu::gelu_backward(a.out(dinp, n, acc), a.in(inp, n), a.in(dout, n), n, acc);
    });
  }
  void dequantize(Dtype dt, void* out, const void* q, QuantKind kind, bool double_quant,
                  uint64_t n) override {
    cpu::OpTimer timer_("dequantize", dtype_name(dt));
    require_dtype(dt, "dequantize");
    if (kind != QuantKind::kBF16 && kind != QuantKind::kInt8 && kind != QuantKind::kNF4)
      throw OpError("dequantize: no quantized kind " + std::to_string(uint32_t(kind)));
    const auto* b = static_cast<const unsigned char*>(q);
    switch (dt) {
      case Dtype::kF32:
        return cpu::dequantize_tensor(
            kind, b, n, double_quant,
            [o = static_cast<float*>(out)](uint64_t i, float v) { o[i] = v; });
      case Dtype::kBF16:
        return cpu::dequantize_tensor(
            kind, b, n, double_quant,
            [o = static_cast<uint16_t*>(out)](uint64_t i, float v) { o[i] = float_to_bf16(v); });
      case Dtype::kF16:
        return cpu::dequantize_tensor(
            kind, b, n, double_quant,
            [o = static_cast<uint16_t*>(out)](uint64_t i, float v) { o[i] = float_to_f16(v); });
      default:
        return cpu::dequantize_tensor(
            kind, b, n, double_quant,
            [o = static_cast<double*>(out)](uint64_t i, float v) { o[i] = double(v); });
    }
  }
  void dropout(Dtype dt, void* out, const void* inp, uint64_t n, double p, uint64_t seed) override {
    cpu::OpTimer timer_("dropout", dtype_name(dt));
    require_float(dt, "dropout");
    const float fp = float(p), s = dropout_scale(fp);
    // f32: the product rounded once, as the CUDA kernel's; the 16-bit dtypes through f32 too.
    const int64_t count = int64_t(n);
#pragma omp parallel for schedule(static) if (count >= (int64_t(1) << 15)) \
    num_threads(cpu::threads_for(n))
    for (int64_t i = 0; i < count; ++i)
      store(out, dt, uint64_t(i),
            dropout_keep(seed, uint64_t(i), fp) ? double(float(load(inp, dt, uint64_t(i))) * s)
                                                : 0.0);
  }
  void gelu_backward_bias(Dtype dt, void* dinp, void* dbias, const void* inp, const void* dout,
                          int N, int OC) override {
    cpu::OpTimer timer_("gelu_backward_bias", dtype_name(dt));
    if (!cpu::detail::fuse_enabled())
      return Backend::gelu_backward_bias(dt, dinp, dbias, inp, dout, N, OC);
    // bf16 (and f16) take the two ops: a bf16 kernel of the fused pass (column blocks over the
    // threads, bias_grad_lowp's bits) ran 0.9x their time in the gpt2-350m step on 2 threads
    // (docs/results/cpu.md): GELU's backward is bound by its arithmetic, not by the pass.
    if (dt == Dtype::kF32)
      return cpu::gelu_backward_bias(static_cast<float*>(dinp), static_cast<float*>(dbias),
                                     static_cast<const float*>(inp),
                                     static_cast<const float*>(dout), N, OC);
    if (dt == Dtype::kF64)
      return cpu::gelu_backward_bias(static_cast<double*>(dinp), static_cast<double*>(dbias),
                                     static_cast<const double*>(inp),
                                     static_cast<const double*>(dout), N, OC);
    Backend::gelu_backward_bias(dt, dinp, dbias, inp, dout, N, OC);
  }
  void add_inplace(Dtype dt, void* dst, const void* src, uint64_t n) override {
    cpu::OpTimer timer_("add_inplace", dtype_name(dt));
    if (bf16_direct(dt)) return cpu::add_inplace_bf16(u16(dst), u16(src), n);
    dispatch(dt, "add_inplace",
             [&](auto&& a) { cpu::add_inplace(a.out(dst, n, true), a.in(src, n), n); });
  }
  void crossentropy_forward_backward(Dtype dt, void* logits, void* losses, const int32_t* targets,
                                     int N, int V, double dloss) override {
    cpu::OpTimer timer_("crossentropy_forward_backward", dtype_name(dt));
    if (bf16_direct(dt))
      return cpu::crossentropy_forward_backward_bf16(u16(logits), static_cast<float*>(losses),
                                                     targets, N, V, static_cast<float>(dloss));
    dispatch(dt, "crossentropy_forward_backward", [&](auto&& a) {
      auto* l = a.out(logits, uint64_t(N) * V, true);
      using T = std::remove_pointer_t<decltype(l)>;
      cpu::crossentropy_forward_backward(l, a.stat(losses), targets, N, V, static_cast<T>(dloss));
    });
  }

  void adamw_update(float* param, const float* grad, float* m, float* v, uint64_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int64_t t) override {
    cpu::OpTimer timer_("adamw_update", nullptr);
    cpu::adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
  }
  void sgd_update(float* param, const float* grad, float* momentum_buf, uint64_t n, float lr,
                  float momentum, float weight_decay) override {
    cpu::OpTimer timer_("sgd_update", nullptr);
    cpu::sgd_update(param, grad, momentum_buf, n, lr, momentum, weight_decay);
  }
  // Calls f with the kernels' copy policy for o.compute (cpu::NoCopy when there is none; W the
  // weights' storage type, a copy only beside float ones).
  template <class W, class F>
  static void with_copy(const Stored& o, F&& f) {
    check_compute_copy(o);
    if constexpr (std::is_same_v<W, float>) {
      if (o.compute != nullptr && o.compute_dtype == Dtype::kBF16)
        return f(cpu::Bf16Copy{static_cast<uint16_t*>(o.compute)});
      if (o.compute != nullptr) return f(cpu::F16Copy{static_cast<uint16_t*>(o.compute)});
    }
    f(cpu::NoCopy{});
  }
  void adamw_update_stored(const Stored& o, void* param, const void* grad, void* m, void* v,
                           uint64_t n, float lr, float beta1, float beta2, float eps,
                           float weight_decay, int64_t t) override {
    cpu::OpTimer timer_("adamw_update_stored", nullptr);
    if (o.all_f32())
      return with_copy<float>(o, [&](auto copy) {
        cpu::adamw_update(static_cast<float*>(param), static_cast<const float*>(grad),
                          static_cast<float*>(m), static_cast<float*>(v), n, lr, beta1, beta2, eps,
                          weight_decay, t, o.grad_scale, copy);
      });
    if (o.grad_scale != 1.0f) scale(o.grad, const_cast<void*>(grad), n, o.grad_scale);
    with_stored_types(o, [&](auto w, auto g, auto st) {
      using W = decltype(w);
      using G = decltype(g);
      using S = decltype(st);
      with_copy<W>(o, [&](auto copy) {
        cpu::adamw_update_stored(static_cast<W*>(param), static_cast<const G*>(grad),
                                 static_cast<S*>(m), static_cast<S*>(v), n, lr, beta1, beta2, eps,
                                 weight_decay, t, o.seed, copy);
      });
    });
  }
  void sgd_update_stored(const Stored& o, void* param, const void* grad, void* momentum_buf,
                         uint64_t n, float lr, float momentum, float weight_decay) override {
    cpu::OpTimer timer_("sgd_update_stored", nullptr);
    if (o.all_f32())
      return with_copy<float>(o, [&](auto copy) {
        cpu::sgd_update(static_cast<float*>(param), static_cast<const float*>(grad),
                        static_cast<float*>(momentum_buf), n, lr, momentum, weight_decay,
                        o.grad_scale, copy);
      });
    if (o.grad_scale != 1.0f) scale(o.grad, const_cast<void*>(grad), n, o.grad_scale);
    with_stored_types(o, [&](auto w, auto g, auto st) {
      using W = decltype(w);
      using G = decltype(g);
      using S = decltype(st);
      with_copy<W>(o, [&](auto copy) {
        cpu::sgd_update_stored(static_cast<W*>(param), static_cast<const G*>(grad),
                               static_cast<S*>(momentum_buf), n, lr, momentum, weight_decay, o.seed,
                               copy);
      });
    });
  }

  void fill(Dtype dt, void* x, uint64_t n, double value) override {
    cpu::OpTimer timer_("fill", dtype_name(dt));
    require_dtype(dt, "fill");
    if (value == 0.0) {  // +0.0 is all zero bits in every dtype
      cpu::zero_bytes(x, n * dtype_size(dt));
      return;
    }
    for (uint64_t i = 0; i < n; ++i)
      store(x, dt, i, value);
  }
  void cast(void* dst, Dtype dst_dt, const void* src, Dtype src_dt, uint64_t n) override {
    cpu::OpTimer timer_("cast", dtype_name(dst_dt));
    require_dtype(dst_dt, "cast");
    require_dtype(src_dt, "cast");
    if (dst_dt == src_dt) {
      std::memmove(dst, src, n * dtype_size(dst_dt));
      return;
    }
    // f32 <-> bf16/f16 (amp's compute copies, every step): kernels/cpu/convert.h, on the threads,
    // bitwise the conversions below (through double, f32 and back is exact).
    const bool low_dst = dst_dt == Dtype::kBF16 || dst_dt == Dtype::kF16;
    const bool low_src = src_dt == Dtype::kBF16 || src_dt == Dtype::kF16;
    if (src_dt == Dtype::kF32 && low_dst) {
      const float* f = static_cast<const float*>(src);
      uint16_t* h = static_cast<uint16_t*>(dst);
      dst_dt == Dtype::kBF16 ? cpu::round_bf16(f, h, n) : cpu::round_f16(f, h, n);
      return;
    }
    if (low_src && dst_dt == Dtype::kF32) {
      const uint16_t* h = static_cast<const uint16_t*>(src);
      float* f = static_cast<float*>(dst);
      src_dt == Dtype::kBF16 ? cpu::widen_bf16(h, f, n) : cpu::widen_f16(h, f, n);
      return;
    }
    for (uint64_t i = 0; i < n; ++i)
      store(dst, dst_dt, i, load(src, src_dt, i));
  }
  void scale(Dtype dt, void* x, uint64_t n, double s) override {
    cpu::OpTimer timer_("scale", dtype_name(dt));
    require_float(dt, "scale");
    if (dt == Dtype::kF32) {
      cpu::scale_inplace(static_cast<float*>(x), n, static_cast<float>(s));
      return;
    }
    for (uint64_t i = 0; i < n; ++i)
      store(x, dt, i, load(x, dt, i) * s);
  }
  void axpy(Dtype dt, void* y, const void* x, uint64_t n, double a) override {
    cpu::OpTimer timer_("axpy", dtype_name(dt));
    require_float(dt, "axpy");
    if (dt == Dtype::kF32) {
      float* fy = static_cast<float*>(y);
      const float* fx = static_cast<const float*>(x);
      const float fa = static_cast<float>(a);
      for (uint64_t i = 0; i < n; ++i)
        fy[i] += fa * fx[i];
      return;
    }
    for (uint64_t i = 0; i < n; ++i)
      store(y, dt, i, load(y, dt, i) + a * load(x, dt, i));
  }
  void binary(BinaryOp op, Dtype dt, void* z, const void* x, const void* y, uint64_t n) override {
    cpu::OpTimer timer_("binary", dtype_name(dt));
    pointwise_dispatch(dt, "binary", [&](auto io) {
      using Io = decltype(io);
      pointwise_map<Io>(
          z, n, [&](uint64_t i) { return pointwise::binary(op, Io::get(x, i), Io::get(y, i)); });
    });
  }
  void unary(UnaryOp op, Dtype dt, void* y, const void* x, uint64_t n) override {
    cpu::OpTimer timer_("unary", dtype_name(dt));
    pointwise_dispatch(dt, "unary", [&](auto io) {
      using Io = decltype(io);
      pointwise_map<Io>(y, n, [&](uint64_t i) { return pointwise::unary(op, Io::get(x, i)); });
    });
  }
  void lerp(Dtype dt, void* z, const void* x, const void* y, float w, uint64_t n) override {
    cpu::OpTimer timer_("lerp", dtype_name(dt));
    pointwise_dispatch(dt, "lerp", [&](auto io) {
      using Io = decltype(io);
      pointwise_map<Io>(
          z, n, [&](uint64_t i) { return pointwise::lerp(Io::get(x, i), Io::get(y, i), w); });
    });
  }
  void affine(Dtype dt, void* y, const void* x, float a, float b, uint64_t n) override {
    cpu::OpTimer timer_("affine", dtype_name(dt));
    pointwise_dispatch(dt, "affine", [&](auto io) {
      using Io = decltype(io);
      pointwise_map<Io>(y, n, [&](uint64_t i) { return pointwise::affine(Io::get(x, i), a, b); });
    });
  }
  void accumulate(float* y, const void* x, Dtype x_dt, uint64_t n) override {
    cpu::OpTimer timer_("accumulate", dtype_name(x_dt));
    require_float(x_dt, "accumulate");
    if (x_dt == Dtype::kBF16) return cpu::accumulate_bf16(y, static_cast<const uint16_t*>(x), n);
    if (x_dt == Dtype::kF32) return cpu::accumulate_f32(y, static_cast<const float*>(x), n);
    for (uint64_t i = 0; i < n; ++i)
      y[i] += static_cast<float>(load(x, x_dt, i));
  }
  double sum_squares(Dtype dt, const void* x, uint64_t n) override {
    cpu::OpTimer timer_("sum_squares", dtype_name(dt));
    count_host_sync();
    return sum_squares_one(dt, x, n);
  }
  double sum_squares_many(const std::vector<Span>& spans) override {
    cpu::OpTimer timer_("sum_squares_many", nullptr);
    count_host_sync();
    for (const Span& s : spans)
      require_float(s.dtype, "sum_squares");
    // Spans over the threads (each span's sum is one thread's, in its order), added in order.
    std::vector<double> sums(spans.size(), 0.0);
    const int64_t count = int64_t(spans.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(cpu::threads())
    for (int64_t i = 0; i < count; ++i)
      sums[size_t(i)] =
          sum_squares_one(spans[size_t(i)].dtype, spans[size_t(i)].data, spans[size_t(i)].numel);
    double total = 0.0;
    for (const double s : sums)
      total += s;
    return total;
  }
  double sum_squares_one(Dtype dt, const void* x, uint64_t n) {
    require_float(dt, "sum_squares");
    if (dt == Dtype::kF32) return cpu::sum_squares(static_cast<const float*>(x), n);
    if (dt == Dtype::kF64) return cpu::sum_squares(static_cast<const double*>(x), n);
    double s = 0.0;
    for (uint64_t i = 0; i < n; ++i) {
      const double v = load(x, dt, i);
      s += v * v;
    }
    return s;
  }
  bool any_nonfinite(Dtype dt, const void* x, uint64_t n) override {
    cpu::OpTimer timer_("any_nonfinite", dtype_name(dt));
    count_host_sync();
    return any_nonfinite_one(dt, x, n);
  }
  bool any_nonfinite_many(const std::vector<Span>& spans) override {
    cpu::OpTimer timer_("any_nonfinite_many", nullptr);
    count_host_sync();
    for (const Span& s : spans)
      require_float(s.dtype, "nonfinite");
    // Spans over the threads; an or of flags is the same in any order.
    int found = 0;
    const int64_t count = int64_t(spans.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(cpu::threads()) reduction(| : found)
    for (int64_t i = 0; i < count; ++i) {
      const Span& s = spans[size_t(i)];
      found |= any_nonfinite_one(s.dtype, s.data, s.numel) ? 1 : 0;
    }
    return found != 0;
  }
  bool any_nonfinite_one(Dtype dt, const void* x, uint64_t n) {
    require_float(dt, "nonfinite");
    for (uint64_t i = 0; i < n; ++i)
      if (!std::isfinite(load(x, dt, i))) return true;
    return false;
  }

  void copy(void* dst, const void* src, uint64_t bytes) override {
    std::memmove(dst, src, bytes);
  }
  void upload(void* dst, const void* src, uint64_t bytes) override {
    std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, uint64_t bytes) override {
    if (bytes > 0) count_host_sync();  // as the CUDA backend, which returns at once for 0 bytes
    std::memcpy(dst, src, bytes);
  }
  void synchronize() override {
    count_host_sync();
  }
  // upload() copies at once: a slot's sources are free when it returns, nothing to wait for.
  void mark_uploads(int slot) override {
    check_slot(slot);
  }
  void wait_uploads(int slot) override {
    check_slot(slot);
  }
  static void check_slot(int slot) {
    if (slot < 0 || slot >= kUploadSlots)
      throw OpError("upload slot " + std::to_string(slot) + " (valid: 0 to " +
                    std::to_string(kUploadSlots - 1) + ")");
  }
  void* host_alloc(uint64_t bytes) override {
    return std::malloc(bytes ? bytes : 1);
  }
  void host_free(void* ptr) override {
    std::free(ptr);
  }

 private:
  // Rows of the token table the batch can touch: up to the largest token (the kernels index
  // wte by token), so a widened copy need not cover the whole vocabulary.
  static uint64_t vocab_rows(const int32_t* tokens, uint64_t n) {
    int64_t top = -1;
    for (uint64_t i = 0; i < n; ++i)
      if (tokens[i] > top) top = tokens[i];
    return uint64_t(top + 1);
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace headroom
