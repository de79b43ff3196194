// The CUDA backend's op table: each Backend method dispatches on the storage dtype to the
// launchers of kernels/cuda (float, bf16, f16; f64 is the CPU's alone) and enqueues them on one
// compute stream.
//
// Streams: one compute stream for every op, and a side copy stream for upload(). An upload waits
// for the compute work enqueued before it (its destination may still be read there: a batch
// buffer reused by the next micro-step) and every op enqueued after it waits for the copy; so the
// ops see the memory exactly as on the CPU backend, where upload is an immediate memcpy. The
// copy still leaves the host thread at once, so the host can keep preparing work. The host's
// staging slots are reused after an event on the copy stream (mark_uploads / wait_uploads), not
// after a synchronize of everything.
//
// Every method makes the backend's device current first, so the backend may be driven from any
// host thread (one at a time).
#include "core/device/cuda/backend_cuda.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace headroom {

namespace {

using cuda::bf16;
using cuda::f16;

[[noreturn]] void unsupported_dtype(const char* op, Dtype dt) {
  if (dt == Dtype::kF64)
    throw OpError(std::string(op) +
                  ": f64 is CPU-only (the gradient checks' dtype); the cuda backend computes "
                  "f32, bf16 and f16");
  throw OpError(std::string(op) + ": needs a floating-point dtype (f32, bf16, f16), got " +
                dtype_name(dt));
}

// Runs fn with a value of the storage type for dt (float, bf16 or f16): fn's parameter type is
// the element type the launcher is instantiated for.
template <class Fn>
void dispatch(Dtype dt, const char* op, Fn&& fn) {
  switch (dt) {
    case Dtype::kF32:
      fn(float{});
      return;
    case Dtype::kBF16:
      fn(bf16{});
      return;
    case Dtype::kF16:
      fn(f16{});
      return;
    case Dtype::kF64:
    case Dtype::kI32:
      break;
  }
  unsupported_dtype(op, dt);
}

template <class S>
S* as(void* p) {
  return static_cast<S*>(p);
}
template <class S>
const S* as(const void* p) {
  return static_cast<const S*>(p);
}

// Owners of CUDA objects; teardown errors are ignored (destructors, possibly after the runtime is
// shutting down).
struct StreamDestroy {
  void operator()(CUstream_st* s) const noexcept { (void)cudaStreamDestroy(s); }
};
struct EventDestroy {
  void operator()(CUevent_st* e) const noexcept { (void)cudaEventDestroy(e); }
};
struct DeviceFree {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};
struct HostFree {
  void operator()(void* p) const noexcept { (void)cudaFreeHost(p); }
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    CUDA_CHECK(cudaSetDevice(device_));
    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    compute_.reset(s);
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    copy_.reset(s);
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    computed_.reset(e);
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    uploaded_.reset(e);
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    downloaded_.reset(e);
    for (auto& slot : slots_) {
      CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      slot.reset(e);
    }
    ctx_ = std::make_unique<cuda::CudaContext>();
    void* p = nullptr;
    // [0] the result, [1..] the per-block partial sums of sum_squares.
    CUDA_CHECK(cudaMalloc(&p, sizeof(double) * (1 + cuda::kSumSquaresBlocks)));
    reduce_.reset(p);
    CUDA_CHECK(cudaMalloc(&p, sizeof(int)));
    flag_.reset(p);
    CUDA_CHECK(cudaMallocHost(&p, sizeof(HostResult)));
    result_.reset(p);
  }
  ~CudaBackend() override {
    // Work still in flight may use the scratch and the handles released below.
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(copy_.get());
    (void)cudaStreamSynchronize(compute_.get());
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  // --- model ops
  // ----------------------------------------------------------------------------------
  void embedding_forward(Dtype dt, void* out, const int32_t* tokens, const void* wte,
                         const void* wpe, int B, int T, int C) override {
    on_device();
    dispatch(dt, "embedding_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::embedding_forward(as<S>(out), tokens, as<S>(wte), as<S>(wpe), B, T, C, stream());
    });
  }
  void embedding_backward(Dtype dt, void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                          int B, int T, int C) override {
    on_device();
    dispatch(dt, "embedding_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::embedding_backward(as<S>(dwte), as<S>(dwpe), as<S>(dout), tokens, B, T, C, stream());
    });
  }
  void layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, const void* inp,
                         const void* weight, const void* bias, int N, int C) override {
    on_device();
    dispatch(dt, "layernorm_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::layernorm_forward(as<S>(out), as<float>(mean), as<float>(rstd), as<S>(inp),
                              as<S>(weight), as<S>(bias), N, C, stream());
    });
  }
  void residual_layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, void* res,
                                  const void* x, const void* weight, const void* bias, int N,
                                  int C) override {
    on_device();
    dispatch(dt, "residual_layernorm_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::residual_layernorm_forward(as<S>(out), as<float>(mean), as<float>(rstd), as<S>(res),
                                       as<S>(x), as<S>(weight), as<S>(bias), N, C, stream());
    });
  }
  void layernorm_backward(Dtype dt, void* dinp, void* dweight, void* dbias, const void* dout,
                          const void* inp, const void* weight, const void* mean, const void* rstd,
                          int N, int C, Grad dinp_mode, const void* dres) override {
    on_device();
    const bool acc = dinp_mode == Grad::kAccumulate;
    if (acc && dres) throw OpError("layernorm_backward: dres is for Grad::kWrite only");
    dispatch(dt, "layernorm_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::layernorm_backward(as<S>(dinp), as<S>(dweight), as<S>(dbias), as<S>(dout), as<S>(inp),
                               as<S>(weight), as<float>(mean), as<float>(rstd), N, C, stream(), acc,
                               as<S>(dres));
    });
  }
  void matmul_forward(Dtype dt, void* out, const void* inp, const void* weight, const void* bias,
                      int N, int C, int OC) override {
    on_device();
    dispatch(dt, "matmul_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::matmul_forward(*ctx_, as<S>(out), as<S>(inp), as<S>(weight), as<S>(bias), N, C, OC,
                           stream());
    });
  }
  void matmul_backward(Dtype dt, void* dinp, void* dweight, void* dbias, const void* dout,
                       const void* inp, const void* weight, int N, int C, int OC,
                       Grad dinp_mode) override {
    on_device();
    dispatch(dt, "matmul_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::matmul_backward(*ctx_, as<S>(dinp), as<S>(dweight), as<S>(dbias), as<S>(dout),
                            as<S>(inp), as<S>(weight), N, C, OC, stream(),
                            dinp_mode == Grad::kAccumulate);
    });
  }
  void attention_forward(Dtype dt, void* out, void* att, const void* qkv, int B, int T, int C,
                         int NH) override {
    on_device();
    dispatch(dt, "attention_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_forward(*ctx_, as<S>(out), as<S>(att), as<S>(qkv), B, T, C, NH, stream());
    });
  }
  void attention_decode(Dtype dt, void* out, const void* qkv, int T, int C, int NH) override {
    on_device();
    dispatch(dt, "attention_decode", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_decode(*ctx_, as<S>(out), as<S>(qkv), T, C, NH, stream());
    });
  }
  void attention_backward(Dtype dt, void* dqkv, void* scratch, const void* dout, const void* qkv,
                          const void* att, int B, int T, int C, int NH) override {
    on_device();
    dispatch(dt, "attention_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_backward(*ctx_, as<S>(dqkv), as<S>(scratch), as<S>(dout), as<S>(qkv),
                               as<S>(att), B, T, C, NH, stream());
    });
  }
  void attention_tiled_forward(Dtype dt, void* out, void* lse, const void* qkv, int B, int T, int C,
                               int NH) override {
    on_device();
    dispatch(dt, "attention_tiled_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_tiled_forward(as<S>(out), static_cast<float*>(lse), as<S>(qkv), B, T, C, NH,
                                    NH, stream());
    });
  }
  void attention_tiled_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                                const void* out, const void* lse, int B, int T, int C,
                                int NH) override {
    on_device();
    dispatch(dt, "attention_tiled_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_tiled_backward(as<S>(dqkv), as<S>(dout), as<S>(qkv), as<S>(out),
                                     static_cast<const float*>(lse), B, T, C, NH, NH, stream());
    });
  }
  uint64_t attention_scratch_numel(int B, int T, int NH) const override {
    return cuda::attention_scratch_numel(B, T, NH);
  }
  void dequantize(Dtype dt, void* out, const void* q, QuantKind kind, bool double_quant,
                  uint64_t n) override {
    on_device();
    dispatch(dt, "dequantize", [&](auto tag) {
      using S = decltype(tag);
      cuda::dequantize(as<S>(out), static_cast<const unsigned char*>(q), uint32_t(kind),
                       double_quant, n, stream());
    });
  }
  void dropout(Dtype dt, void* out, const void* inp, uint64_t n, double p, uint64_t seed) override {
    on_device();
    dispatch(dt, "dropout", [&](auto tag) {
      using S = decltype(tag);
      cuda::dropout(as<S>(out), as<S>(inp), n, float(p), seed, stream());
    });
  }
  void gelu_forward(Dtype dt, void* out, const void* inp, uint64_t n) override {
    on_device();
    dispatch(dt, "gelu_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::gelu_forward(as<S>(out), as<S>(inp), n, stream());
    });
  }
  void gelu_backward(Dtype dt, void* dinp, const void* inp, const void* dout, uint64_t n,
                     Grad dinp_mode) override {
    on_device();
    dispatch(dt, "gelu_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::gelu_backward(as<S>(dinp), as<S>(inp), as<S>(dout), n, stream(),
                          dinp_mode == Grad::kAccumulate);
    });
  }
  void add_inplace(Dtype dt, void* dst, const void* src, uint64_t n) override {
    on_device();
    dispatch(dt, "add_inplace", [&](auto tag) {
      using S = decltype(tag);
      cuda::add_inplace(as<S>(dst), as<S>(src), n, stream());
    });
  }
  void crossentropy_forward_backward(Dtype dt, void* logits, void* losses, const int32_t* targets,
                                     int N, int V, double dloss) override {
    on_device();
    dispatch(dt, "crossentropy_forward_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::crossentropy_forward_backward(as<S>(logits), as<float>(losses), targets, N, V,
                                          static_cast<float>(dloss), stream());
    });
  }

  // --- Llama's ops (kernels/cuda/rmsnorm.cu, swiglu.cu, rope.cu, attention_tiled.cu) ------------
  bool llama_ops() const override { return true; }
  void rmsnorm_forward(Dtype dt, void* out, void* rstd, const void* inp, const void* weight, int N,
                       int C, double eps) override {
    on_device();
    dispatch(dt, "rmsnorm_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::rmsnorm_forward(as<S>(out), as<float>(rstd), as<S>(inp), as<S>(weight), N, C, eps,
                            stream());
    });
  }
  void rmsnorm_backward(Dtype dt, void* dinp, void* dweight, const void* dout, const void* inp,
                        const void* weight, const void* rstd, int N, int C, Grad dinp_mode,
                        const void* dres) override {
    on_device();
    const bool acc = dinp_mode == Grad::kAccumulate;
    if (acc && dres) throw OpError("rmsnorm_backward: dres is for Grad::kWrite only");
    dispatch(dt, "rmsnorm_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::rmsnorm_backward(as<S>(dinp), as<S>(dweight), as<S>(dout), as<S>(inp), as<S>(weight),
                             as<float>(rstd), N, C, stream(), acc, as<S>(dres));
    });
  }
  void swiglu_forward(Dtype dt, void* out, const void* gu, int N, int H) override {
    on_device();
    dispatch(dt, "swiglu_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::swiglu_forward(as<S>(out), as<S>(gu), N, H, stream());
    });
  }
  void swiglu_backward(Dtype dt, void* dgu, const void* gu, const void* dout, int N, int H,
                       Grad dgu_mode) override {
    on_device();
    dispatch(dt, "swiglu_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::swiglu_backward(as<S>(dgu), as<S>(gu), as<S>(dout), N, H, stream(),
                            dgu_mode == Grad::kAccumulate);
    });
  }
  void rope_forward(Dtype dt, void* qkv, int B, int T, int NH, int NKV, int hs,
                    const RopeParams& p) override {
    on_device();
    dispatch(dt, "rope_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::rope_forward(as<S>(qkv), B, T, NH, NKV, hs, p, stream());
    });
  }
  void rope_backward(Dtype dt, void* dqkv, int B, int T, int NH, int NKV, int hs,
                     const RopeParams& p) override {
    on_device();
    dispatch(dt, "rope_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::rope_backward(as<S>(dqkv), B, T, NH, NKV, hs, p, stream());
    });
  }
  void attention_gqa_forward(Dtype dt, void* out, void* lse, const void* qkv, int B, int T, int C,
                             int NH, int NKV) override {
    on_device();
    dispatch(dt, "attention_gqa_forward", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_tiled_forward(as<S>(out), static_cast<float*>(lse), as<S>(qkv), B, T, C, NH,
                                    NKV, stream());
    });
  }
  void attention_gqa_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                              const void* out, const void* lse, int B, int T, int C, int NH,
                              int NKV) override {
    on_device();
    dispatch(dt, "attention_gqa_backward", [&](auto tag) {
      using S = decltype(tag);
      cuda::attention_tiled_backward(as<S>(dqkv), as<S>(dout), as<S>(qkv), as<S>(out),
                                     static_cast<const float*>(lse), B, T, C, NH, NKV, stream());
    });
  }

  // --- optimizer updates (f32) -------------------------------------------------------------------
  // Stored::compute as the kernels take it (checked: only beside f32 weights, bf16 or f16).
  static cuda::CopyOut copy_out(const Stored& o) {
    check_compute_copy(o);
    return {static_cast<uint16_t*>(o.compute), o.compute_dtype == Dtype::kF16};
  }
  void adamw_update(float* param, const float* grad, float* m, float* v, uint64_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int64_t t) override {
    on_device();
    cuda::adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, t, 1.0f, {},
                       stream());
  }
  void sgd_update(float* param, const float* grad, float* momentum_buf, uint64_t n, float lr,
                  float momentum, float weight_decay) override {
    on_device();
    cuda::sgd_update(param, grad, momentum_buf, n, lr, momentum, weight_decay, 1.0f, {}, stream());
  }
  void adamw_update_stored(const Stored& o, void* param, const void* grad, void* m, void* v,
                           uint64_t n, float lr, float beta1, float beta2, float eps,
                           float weight_decay, int64_t t) override {
    on_device();
    const cuda::CopyOut copy = copy_out(o);
    if (o.all_f32())
      return cuda::adamw_update(static_cast<float*>(param), static_cast<const float*>(grad),
                                static_cast<float*>(m), static_cast<float*>(v), n, lr, beta1, beta2,
                                eps, weight_decay, t, o.grad_scale, copy, stream());
    if (o.grad_scale != 1.0f) scale(o.grad, const_cast<void*>(grad), n, o.grad_scale);
    with_stored_types(o, [&](auto w, auto g, auto st) {
      using W = decltype(w);
      using G = decltype(g);
      using S = decltype(st);
      cuda::adamw_update_stored(static_cast<W*>(param), static_cast<const G*>(grad),
                                static_cast<S*>(m), static_cast<S*>(v), n, lr, beta1, beta2, eps,
                                weight_decay, t, o.seed, copy, stream());
    });
  }
  void sgd_update_stored(const Stored& o, void* param, const void* grad, void* momentum_buf,
                         uint64_t n, float lr, float momentum, float weight_decay) override {
    on_device();
    const cuda::CopyOut copy = copy_out(o);
    if (o.all_f32())
      return cuda::sgd_update(static_cast<float*>(param), static_cast<const float*>(grad),
                              static_cast<float*>(momentum_buf), n, lr, momentum, weight_decay,
                              o.grad_scale, copy, stream());
    if (o.grad_scale != 1.0f) scale(o.grad, const_cast<void*>(grad), n, o.grad_scale);
    with_stored_types(o, [&](auto w, auto g, auto st) {
      using W = decltype(w);
      using G = decltype(g);
      using S = decltype(st);
      cuda::sgd_update_stored(static_cast<W*>(param), static_cast<const G*>(grad),
                              static_cast<S*>(momentum_buf), n, lr, momentum, weight_decay, o.seed,
                              copy, stream());
    });
  }

  // --- element-wise and reductions ---------------------------------------------------------------
  void fill(Dtype dt, void* x, uint64_t n, double value) override {
    on_device();
    dispatch(dt, "fill", [&](auto tag) {
      using S = decltype(tag);
      cuda::fill(as<S>(x), n, value, stream());
    });
  }
  void cast(void* dst, Dtype dst_dt, const void* src, Dtype src_dt, uint64_t n) override {
    on_device();
    dispatch(dst_dt, "cast", [&](auto dst_tag) {
      using D = decltype(dst_tag);
      dispatch(src_dt, "cast", [&](auto src_tag) {
        using S = decltype(src_tag);
        cuda::cast(as<D>(dst), as<S>(src), n, stream());
      });
    });
  }
  void scale(Dtype dt, void* x, uint64_t n, double s) override {
    on_device();
    dispatch(dt, "scale", [&](auto tag) {
      using S = decltype(tag);
      cuda::scale(as<S>(x), n, s, stream());
    });
  }
  void axpy(Dtype dt, void* y, const void* x, uint64_t n, double a) override {
    on_device();
    dispatch(dt, "axpy", [&](auto tag) {
      using S = decltype(tag);
      cuda::axpy(as<S>(y), as<S>(x), n, a, stream());
    });
  }
  void binary(BinaryOp op, Dtype dt, void* z, const void* x, const void* y, uint64_t n) override {
    on_device();
    dispatch(dt, "binary", [&](auto tag) {
      using S = decltype(tag);
      cuda::binary(op, as<S>(z), as<S>(x), as<S>(y), n, stream());
    });
  }
  void unary(UnaryOp op, Dtype dt, void* y, const void* x, uint64_t n) override {
    on_device();
    dispatch(dt, "unary", [&](auto tag) {
      using S = decltype(tag);
      cuda::unary(op, as<S>(y), as<S>(x), n, stream());
    });
  }
  void lerp(Dtype dt, void* z, const void* x, const void* y, float w, uint64_t n) override {
    on_device();
    dispatch(dt, "lerp", [&](auto tag) {
      using S = decltype(tag);
      cuda::lerp(as<S>(z), as<S>(x), as<S>(y), w, n, stream());
    });
  }
  void affine(Dtype dt, void* y, const void* x, float a, float b, uint64_t n) override {
    on_device();
    dispatch(dt, "affine", [&](auto tag) {
      using S = decltype(tag);
      cuda::affine(as<S>(y), as<S>(x), a, b, n, stream());
    });
  }
  void accumulate(float* y, const void* x, Dtype x_dt, uint64_t n) override {
    on_device();
    dispatch(x_dt, "accumulate", [&](auto tag) {
      using S = decltype(tag);
      cuda::accumulate(y, as<S>(x), n, stream());
    });
  }
  double sum_squares(Dtype dt, const void* x, uint64_t n) override {
    count_host_sync();
    on_device();
    double* d = static_cast<double*>(reduce_.get());
    dispatch(dt, "sum_squares", [&](auto tag) {
      using S = decltype(tag);
      cuda::sum_squares(d, d + 1, as<S>(x), n, stream());
    });
    HostResult* r = result();
    CUDA_CHECK(cudaMemcpyAsync(&r->sum, d, sizeof(double), cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return r->sum;
  }
  double sum_squares_many(const std::vector<Span>& spans) override {
    count_host_sync();
    on_device();
    if (spans.empty()) return 0.0;
    // Each span's sum into its own device double, in stream order (the partials' scratch is
    // reused: the kernels run one after the other), then one copy of all of them and one wait.
    if (spans.size() > sums_count_) {
      void* p = nullptr;
      CUDA_CHECK(cudaMalloc(&p, sizeof(double) * spans.size()));
      sums_.reset(p);
      CUDA_CHECK(cudaMallocHost(&p, sizeof(double) * spans.size()));
      sums_host_.reset(p);
      sums_count_ = spans.size();
    }
    double* d = static_cast<double*>(sums_.get());
    double* scratch = static_cast<double*>(reduce_.get()) + 1;
    for (size_t i = 0; i < spans.size(); ++i) {
      dispatch(spans[i].dtype, "sum_squares", [&](auto tag) {
        using S = decltype(tag);
        cuda::sum_squares(d + i, scratch, as<S>(spans[i].data), spans[i].numel, stream());
      });
    }
    double* h = static_cast<double*>(sums_host_.get());
    CUDA_CHECK(
        cudaMemcpyAsync(h, d, sizeof(double) * spans.size(), cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    double total = 0.0;
    for (size_t i = 0; i < spans.size(); ++i)
      total += h[i];
    return total;
  }
  bool any_nonfinite(Dtype dt, const void* x, uint64_t n) override {
    count_host_sync();
    on_device();
    int* flag = static_cast<int*>(flag_.get());
    dispatch(dt, "any_nonfinite", [&](auto tag) {
      using S = decltype(tag);
      cuda::any_nonfinite(flag, as<S>(x), n, stream());
    });
    HostResult* r = result();
    CUDA_CHECK(cudaMemcpyAsync(&r->flag, flag, sizeof(int), cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return r->flag != 0;
  }
  bool any_nonfinite_many(const std::vector<Span>& spans) override {
    count_host_sync();
    on_device();
    // One flag: cleared once, each span's kernel only sets it, then one copy and one wait.
    int* flag = static_cast<int*>(flag_.get());
    CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int), stream()));
    for (const Span& s : spans) {
      dispatch(s.dtype, "any_nonfinite", [&](auto tag) {
        using S = decltype(tag);
        cuda::any_nonfinite(flag, as<S>(s.data), s.numel, stream(), /*clear=*/false);
      });
    }
    HostResult* r = result();
    CUDA_CHECK(cudaMemcpyAsync(&r->flag, flag, sizeof(int), cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return r->flag != 0;
  }

  // --- memory ------------------------------------------------------------------------------------
  void copy(void* dst, const void* src, uint64_t bytes) override {
    if (bytes == 0) return;
    on_device();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
  }
  void upload(void* dst, const void* src, uint64_t bytes) override {
    if (bytes == 0) return;
    on_device();
    // After the compute work already enqueued (it may still read dst), before every op after.
    CUDA_CHECK(cudaEventRecord(computed_.get(), compute_.get()));
    CUDA_CHECK(cudaStreamWaitEvent(copy_.get(), computed_.get(), 0));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, copy_.get()));
    CUDA_CHECK(cudaEventRecord(uploaded_.get(), copy_.get()));
    CUDA_CHECK(cudaStreamWaitEvent(compute_.get(), uploaded_.get(), 0));
  }
  // A slot's event on the copy stream, after its uploads: waiting for it waits for those copies
  // (and the compute work each was ordered after), not for what the compute stream does since.
  void mark_uploads(int slot) override {
    on_device();
    CUDA_CHECK(cudaEventRecord(slots_[check_slot(slot)].get(), copy_.get()));
  }
  void wait_uploads(int slot) override {
    cudaEvent_t e = slots_[check_slot(slot)].get();
    const cudaError_t done = cudaEventQuery(e);  // cudaSuccess also for a slot never marked
    if (done == cudaSuccess) return;
    if (done != cudaErrorNotReady) CUDA_CHECK(done);
    count_host_sync();
    CUDA_CHECK(cudaEventSynchronize(e));
  }
  static size_t check_slot(int slot) {
    if (slot < 0 || slot >= kUploadSlots)
      throw OpError("upload slot " + std::to_string(slot) + " (valid: 0 to " +
                    std::to_string(kUploadSlots - 1) + ")");
    return size_t(slot);
  }
  void download(void* dst, const void* src, uint64_t bytes) override {
    if (bytes == 0) return;
    count_host_sync();
    on_device();
    // On the compute stream: after every op before it, and after every upload (the compute stream
    // waits for each).
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
  }
  void download_async(void* dst, const void* src, uint64_t bytes) override {
    if (bytes == 0) return;
    on_device();
    // On the copy stream, after the compute work already enqueued (what wrote src); the compute
    // stream does not wait for it.
    CUDA_CHECK(cudaEventRecord(computed_.get(), compute_.get()));
    CUDA_CHECK(cudaStreamWaitEvent(copy_.get(), computed_.get(), 0));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, copy_.get()));
    CUDA_CHECK(cudaEventRecord(downloaded_.get(), copy_.get()));
    downloads_pending_ = true;
  }
  void wait_downloads() override {
    if (!downloads_pending_) return;
    downloads_pending_ = false;
    count_host_sync();
    on_device();
    CUDA_CHECK(cudaEventSynchronize(downloaded_.get()));  // the copy stream runs in order
  }
  void synchronize() override {
    count_host_sync();
    on_device();
    downloads_pending_ = false;
    CUDA_CHECK(cudaStreamSynchronize(copy_.get()));
    CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  }
  void* host_alloc(uint64_t bytes) override {
    on_device();
    void* p = nullptr;
    CUDA_CHECK(cudaMallocHost(&p, bytes > 0 ? bytes : 1));
    return p;
  }
  void host_free(void* ptr) override {
    if (ptr != nullptr) (void)cudaFreeHost(ptr);
  }
  void* native_stream() override { return compute_.get(); }

 private:
  // Page-locked, so the reductions' results come back by DMA on the compute stream.
  struct HostResult {
    double sum;
    int flag;
  };

  void on_device() const { CUDA_CHECK(cudaSetDevice(device_)); }
  cudaStream_t stream() const { return compute_.get(); }
  HostResult* result() const { return static_cast<HostResult*>(result_.get()); }

  int device_;
  std::unique_ptr<CUstream_st, StreamDestroy> compute_;
  std::unique_ptr<CUstream_st, StreamDestroy> copy_;
  std::unique_ptr<CUevent_st, EventDestroy> computed_;    // compute work before an upload
  std::unique_ptr<CUevent_st, EventDestroy> uploaded_;    // the last upload
  std::unique_ptr<CUevent_st, EventDestroy> downloaded_;  // the last download_async
  bool downloads_pending_ = false;
  std::unique_ptr<CUevent_st, EventDestroy> slots_[kUploadSlots];  // mark_uploads' events
  std::unique_ptr<cuda::CudaContext> ctx_;
  std::unique_ptr<void, DeviceFree> reduce_;  // sum_squares: result + partials (doubles)
  std::unique_ptr<void, DeviceFree> flag_;    // any_nonfinite's flag (int)
  // sum_squares_many: one double per span on the device and page-locked on the host.
  std::unique_ptr<void, DeviceFree> sums_;
  std::unique_ptr<void, HostFree> sums_host_;
  size_t sums_count_ = 0;
  std::unique_ptr<void, HostFree> result_;  // HostResult, pinned
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace headroom
