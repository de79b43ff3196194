// The op table: every computation the model, the optimizer and the plugins' device ops run, one
// implementation per backend — the CPU reference (core/device/backend_cpu.cpp) and CUDA
// (core/device/cuda/backend_cuda.cpp). A Device owns its Backend (Device::backend()).
//
// Conventions, the same in both backends:
//   - Tensor arguments are device memory. Float tensors are in the storage dtype `dt` given to the
//     op (f32, bf16, f16; f64 on the CPU only, for gradient checks) and are computed in fp32 (f64
//     for f64): low-precision inputs are widened, results rounded to the storage dtype to nearest
//     even (kernels/common/dtype.h) — so bf16 storage halves memory, not the precision of sums.
//   - Statistics — LayerNorm mean and rstd, per-token losses — are in stat_dtype(dt): f32, or f64
//     for an f64 model. Tokens and targets are int32.
//   - Backward ACCUMULATES (+=) into its gradient outputs; a null gradient output is skipped where
//     the comment says it may be null. Where an op takes a Grad argument, Grad::kWrite writes its
//     input gradient instead (no zero fill first): for a buffer the op is the only producer of.
//     The bits are those of a zero fill (or a copy of dres) and then +=.
//   - Ops run in order on the backend's compute stream and return without waiting. Only the ops
//     that hand a value to the host (the reductions, download) wait for the work
//     before them.
//   - A dtype an op does not have on this backend throws OpError.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/common/pointwise.h"
#include "kernels/common/quant.h"
#include "kernels/common/rope.h"

namespace headroom {

enum class Dtype : uint32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kI32 = 4 };
const char* dtype_name(Dtype d);
uint64_t dtype_size(Dtype d);  // 0 for a value outside the enum
// The dtype of the statistics that go with tensors of dtype `dt`: f64 for f64, else f32.
inline Dtype stat_dtype(Dtype dt) {
  return dt == Dtype::kF64 ? Dtype::kF64 : Dtype::kF32;
}

class OpError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How a backward op produces an input gradient: added into the buffer, or written over it.
enum class Grad { kAccumulate, kWrite };

class Backend {
 public:
  virtual ~Backend() = default;

  // --- model ops (shapes as in kernels/cpu/*.h) ------------------------------------------------
  // out (B,T,C) = wte[tokens[b,t]] + wpe[t]; wpe null: wte[tokens[b,t]] (no position table)
  virtual void embedding_forward(Dtype dt, void* out, const int32_t* tokens, const void* wte,
                                 const void* wpe, int B, int T, int C) = 0;
  // dwte (V,C) += dout rows scattered by token; dwpe (T,C) += dout summed over the batch
  virtual void embedding_backward(Dtype dt, void* dwte, void* dwpe, const void* dout,
                                  const int32_t* tokens, int B, int T, int C) = 0;
  // out (N,C) = LayerNorm(inp (N,C)) * weight (C) + bias (C); mean, rstd (N) in stat_dtype(dt)
  virtual void layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, const void* inp,
                                 const void* weight, const void* bias, int N, int C) = 0;
  // Grad::kWrite: dinp's contents are ignored and dinp = dres + the gradient (dres (N,C), a
  // residual path's gradient, may be null: then 0 + the gradient). dres only with kWrite; it may
  // not overlap dinp.
  virtual void layernorm_backward(Dtype dt, void* dinp, void* dweight, void* dbias,
                                  const void* dout, const void* inp, const void* weight,
                                  const void* mean, const void* rstd, int N, int C,
                                  Grad dinp_mode = Grad::kAccumulate,
                                  const void* dres = nullptr) = 0;
  // out (N,OC) = inp (N,C) · weight (OC,C)^T + bias (OC); bias may be null
  virtual void matmul_forward(Dtype dt, void* out, const void* inp, const void* weight,
                              const void* bias, int N, int C, int OC) = 0;
  // dinp (N,C) += dout · weight; dweight (OC,C) += dout^T · inp; dbias (OC) += column sums.
  // dinp and dbias may be null, and dweight (a frozen weight: no weight-gradient GEMM runs).
  // Grad::kWrite: dinp = dout · weight, its contents ignored.
  virtual void matmul_backward(Dtype dt, void* dinp, void* dweight, void* dbias, const void* dout,
                               const void* inp, const void* weight, int N, int C, int OC,
                               Grad dinp_mode = Grad::kAccumulate) = 0;
  // qkv (B,T,3C) -> out (B,T,C); att (B,NH,T,T) the causal softmax probabilities, for backward
  virtual void attention_forward(Dtype dt, void* out, void* att, const void* qkv, int B, int T,
                                 int C, int NH) = 0;
  // dqkv (B,T,3C) += gradient; scratch holds attention_scratch_numel elements of dt
  virtual void attention_backward(Dtype dt, void* dqkv, void* scratch, const void* dout,
                                  const void* qkv, const void* att, int B, int T, int C,
                                  int NH) = 0;
  virtual uint64_t attention_scratch_numel(int B, int T, int NH) const = 0;
  // Tiled attention (FlashAttention): the same output as attention_forward, but what it keeps
  // for backward is lse (B,NH,T) in stat_dtype(dt), each query row's log-sum-exp of its scaled
  // scores, instead of the (B,NH,T,T) probabilities. No (T,T) tensor exists, not even as scratch.
  virtual void attention_tiled_forward(Dtype dt, void* out, void* lse, const void* qkv, int B,
                                       int T, int C, int NH) = 0;
  // dqkv (B,T,3C) += gradient, from dout and the forward's qkv, out and lse: the scores are
  // recomputed tile by tile. Needs no workspace.
  virtual void attention_tiled_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                                        const void* out, const void* lse, int B, int T, int C,
                                        int NH) = 0;
  // Generation with a KV cache: qkv (T,3C) holds one sequence's positions 0..T-1; out (C) is the
  // attention of row T-1's query over all of them (attention_forward's row T-1), in O(T C).
  virtual void attention_decode(Dtype dt, void* out, const void* qkv, int T, int C, int NH) = 0;
  // out (n) = gelu(inp), GPT-2's tanh approximation; dinp (n) += gelu'(inp) * dout (Grad::kWrite:
  // =, its contents ignored)
  virtual void gelu_forward(Dtype dt, void* out, const void* inp, uint64_t n) = 0;
  virtual void gelu_backward(Dtype dt, void* dinp, const void* inp, const void* dout, uint64_t n,
                             Grad dinp_mode = Grad::kAccumulate) = 0;
  // out (n) in dt = a frozen weight stored quantized, `q` laid out as kernels/common/quant.h says
  // for `kind` (bf16, int8, nf4; double-quantized absmaxes when double_quant): each element its
  // f32 value rounded once to dt. The transient a GEMM of a quantized weight reads.
  virtual void dequantize(Dtype dt, void* out, const void* q, QuantKind kind, bool double_quant,
                          uint64_t n) = 0;
  // out (n) = inp (n) * (kept ? 1 / (1 - p) : 0) in dt, element i kept with probability 1 - p as
  // kernels/common/dropout.h's hash of (seed, i) says: the same mask on every backend, drawn again
  // from the seed wherever it is needed. In place when out == inp. 0 <= p < 1.
  virtual void dropout(Dtype dt, void* out, const void* inp, uint64_t n, double p,
                       uint64_t seed) = 0;
  // dinp (N,OC) = gelu'(inp) * dout, written (gelu_backward's Grad::kWrite), and dbias (OC) +=
  // its column sums (matmul_backward's bias gradient with dinp as its dout): the MLP's GELU and
  // the bias gradient of the fc layer before it, in one pass over dinp where a backend fuses
  // them, bitwise the two ops. dbias may be null. Not pure: this default is the two ops.
  virtual void gelu_backward_bias(Dtype dt, void* dinp, void* dbias, const void* inp,
                                  const void* dout, int N, int OC);
  // dst (n) += src (n)
  virtual void add_inplace(Dtype dt, void* dst, const void* src, uint64_t n) = 0;
  // res (N,C) += x (N,C), then out (N,C) = LayerNorm(res) * weight + bias as layernorm_forward:
  // a residual add and the LayerNorm that reads its sum (GPT-2's ln_2), in one pass over res
  // where a backend fuses them, bitwise add_inplace then layernorm_forward. Not pure: this default
  // is those two ops.
  virtual void residual_layernorm_forward(Dtype dt, void* out, void* mean, void* rstd, void* res,
                                          const void* x, const void* weight, const void* bias,
                                          int N, int C);
  // logits (N,V) -> losses (N, stat_dtype) = -log softmax[target] (0 where target < 0); logits
  // are overwritten with dloss * (softmax - onehot(target)) (zeros for ignored rows).
  virtual void crossentropy_forward_backward(Dtype dt, void* logits, void* losses,
                                             const int32_t* targets, int N, int V,
                                             double dloss) = 0;

  // --- Llama's ops (arch = "llama"; kernels/cpu/rmsnorm.h, swiglu.h, rope.h, attention_tiled.h).
  // Not pure: the CPU and CUDA backends have them (kernels/cuda/rmsnorm.cu, swiglu.cu, rope.cu,
  // attention_tiled.cu; the CUDA ones have never run on a GPU); a backend without them inherits
  // these, which throw OpError, and says so in llama_ops(); the model refuses arch = "llama" on it
  // at construction.
  virtual bool llama_ops() const { return false; }
  // out (N,C) = inp * rstd * weight (C), rstd (N) in stat_dtype(dt) = 1 / sqrt(mean(inp^2) + eps)
  virtual void rmsnorm_forward(Dtype dt, void* out, void* rstd, const void* inp, const void* weight,
                               int N, int C, double eps);
  // dweight (C) += ...; dinp as layernorm_backward's (Grad::kWrite: dinp = dres + the gradient)
  virtual void rmsnorm_backward(Dtype dt, void* dinp, void* dweight, const void* dout,
                                const void* inp, const void* weight, const void* rstd, int N, int C,
                                Grad dinp_mode = Grad::kAccumulate, const void* dres = nullptr);
  // out (N,H) = silu(gu[:, :H]) * gu[:, H:], gu (N,2H) one GEMM's [gate | up] rows
  virtual void swiglu_forward(Dtype dt, void* out, const void* gu, int N, int H);
  // dgu (N,2H) += the gradient (Grad::kWrite: =, its contents ignored)
  virtual void swiglu_backward(Dtype dt, void* dgu, const void* gu, const void* dout, int N, int H,
                               Grad dgu_mode = Grad::kAccumulate);
  // Rotary embeddings in place on qkv (B,T,(NH + 2·NKV)·hs)'s q and k heads (Hugging Face's
  // rotate_half layout); backward rotates dqkv's back, in place.
  virtual void rope_forward(Dtype dt, void* qkv, int B, int T, int NH, int NKV, int hs,
                            const RopeParams& p);
  virtual void rope_backward(Dtype dt, void* dqkv, int B, int T, int NH, int NKV, int hs,
                             const RopeParams& p);
  // attention_tiled_forward / backward with NKV key/value heads (grouped-query attention, NKV
  // dividing NH): qkv (B,T,C + 2·NKV·C/NH) laid out [q | k | v]. NKV = NH is the tiled attention
  // itself (the defaults call it); fewer needs the backend's own kernels.
  virtual void attention_gqa_forward(Dtype dt, void* out, void* lse, const void* qkv, int B, int T,
                                     int C, int NH, int NKV);
  virtual void attention_gqa_backward(Dtype dt, void* dqkv, const void* dout, const void* qkv,
                                      const void* out, const void* lse, int B, int T, int C, int NH,
                                      int NKV);

  // --- optimizer updates, on f32 parameters, gradients and state -------------------------------
  // torch.optim.AdamW; t is the 1-based step
  virtual void adamw_update(float* param, const float* grad, float* m, float* v, uint64_t n,
                            float lr, float beta1, float beta2, float eps, float weight_decay,
                            int64_t t) = 0;
  // torch.optim.SGD; momentum_buf null means no momentum state
  virtual void sgd_update(float* param, const float* grad, float* momentum_buf, uint64_t n,
                          float lr, float momentum, float weight_decay) = 0;
  // The same updates on operands stored in f32 or bf16 (amp's state layouts): the math in f32,
  // bf16 weights and state stored rounded stochastically with noise from `seed`
  // (kernels/common/elementwise.h). All f32 is exactly adamw_update / sgd_update.
  struct Stored {
    Dtype param = Dtype::kF32;  // f32 masters or bf16 weights
    Dtype grad = Dtype::kF32;   // f32 or bf16
    Dtype state = Dtype::kF32;  // f32 or bf16
    uint32_t seed = 0;          // the step's and segment's rounding stream
    // Gradient clipping folded into the update: the update reads grad * grad_scale (f32, one
    // rounding: what a separate scale pass would have written), so clipping costs no pass of its
    // own. With bf16 gradients the backends scale them in place first (bf16 rounds the product).
    float grad_scale = 1.0f;
    // With f32 weights (amp's masters): where the update also writes each new weight's copy in
    // `compute_dtype` (bf16 or f16: the compute copy), rounded to nearest even with exactly the
    // bits cast() writes, in the same pass; null (the default): no copy. std::invalid_argument
    // for a copy beside other weights or in another dtype.
    void* compute = nullptr;
    Dtype compute_dtype = Dtype::kBF16;
    // The plain f32 update: the backends hand it to adamw_update / sgd_update, bitwise theirs
    // (and with `compute`, theirs followed by the cast).
    bool all_f32() const {
      return param == Dtype::kF32 && grad == Dtype::kF32 && state == Dtype::kF32;
    }
  };
  // Calls f(W{}, G{}, S{}) with the types the operands are stored as: float for f32, uint16_t
  // for bf16's bits. std::invalid_argument for any other dtype.
  template <class F>
  static void with_stored_types(const Stored& o, F&& f) {
    auto ok = [](Dtype d) { return d == Dtype::kF32 || d == Dtype::kBF16; };
    if (!ok(o.param) || !ok(o.grad) || !ok(o.state))
      throw std::invalid_argument("optimizer operands must be stored in f32 or bf16");
    auto with_state = [&](auto w, auto g) {
      if (o.state == Dtype::kF32) {
        f(w, g, float{});
      } else {
        f(w, g, uint16_t{});
      }
    };
    auto with_grad = [&](auto w) {
      if (o.grad == Dtype::kF32) {
        with_state(w, float{});
      } else {
        with_state(w, uint16_t{});
      }
    };
    if (o.param == Dtype::kF32) {
      with_grad(float{});
    } else {
      with_grad(uint16_t{});
    }
  }
  // Stored::compute's operands: a copy only beside f32 weights, in bf16 or f16
  // (std::invalid_argument otherwise).
  static void check_compute_copy(const Stored& o) {
    if (o.compute == nullptr) return;
    if (o.param != Dtype::kF32)
      throw std::invalid_argument("an optimizer update writes a compute copy only of f32 weights");
    if (o.compute_dtype != Dtype::kBF16 && o.compute_dtype != Dtype::kF16)
      throw std::invalid_argument("an optimizer update's compute copy is bf16 or f16");
  }
  virtual void adamw_update_stored(const Stored& o, void* param, const void* grad, void* m, void* v,
                                   uint64_t n, float lr, float beta1, float beta2, float eps,
                                   float weight_decay, int64_t t) = 0;
  virtual void sgd_update_stored(const Stored& o, void* param, const void* grad, void* momentum_buf,
                                 uint64_t n, float lr, float momentum, float weight_decay) = 0;

  // --- element-wise and reductions, any float dtype --------------------------------------------
  virtual void fill(Dtype dt, void* x, uint64_t n, double value) = 0;
  // dst (n of dst_dt) = src (n of src_dt); narrowing rounds to nearest even
  virtual void cast(void* dst, Dtype dst_dt, const void* src, Dtype src_dt, uint64_t n) = 0;
  virtual void scale(Dtype dt, void* x, uint64_t n, double s) = 0;                // x *= s
  virtual void axpy(Dtype dt, void* y, const void* x, uint64_t n, double a) = 0;  // y += a x
  // y (n of f32) += x (n of x_dt) widened to f32, one rounded add an element: a compute-dtype
  // gradient added into its fp32 master with no workspace.
  virtual void accumulate(float* y, const void* x, Dtype x_dt, uint64_t n) = 0;
  // Sum of x[i]^2 accumulated in double; waits for the result.
  virtual double sum_squares(Dtype dt, const void* x, uint64_t n) = 0;
  // Any NaN or infinity in x; waits for the result.
  virtual bool any_nonfinite(Dtype dt, const void* x, uint64_t n) = 0;
  // One tensor of a fused reduction.
  struct Span {
    Dtype dtype;
    const void* data;
    uint64_t numel;
  };
  // The sum over the spans of sum_squares(span), each span's sum as sum_squares computes it and
  // the sums added in span order (so exactly what one sum_squares call per span added up would
  // give), with one wait for the host: the gradient norm over all gradients.
  virtual double sum_squares_many(const std::vector<Span>& spans) = 0;
  // Any NaN or infinity in any of the spans (what any_nonfinite over each would say, or-ed), with
  // one wait for the host: amp's overflow check over all gradients.
  virtual bool any_nonfinite_many(const std::vector<Span>& spans) = 0;

  // --- headroom.ops/1's element-wise ops (headroom/ext/ops.h), f32, bf16 or f16 ----------------
  // Each element computed in f32 by kernels/common/pointwise.h (the same function on both
  // backends), rounded to dt to nearest even. An output may be an input's very buffer (in place),
  // not a partial overlap. No host wait: they only enqueue.
  // z (n) = x op y
  virtual void binary(BinaryOp op, Dtype dt, void* z, const void* x, const void* y, uint64_t n) = 0;
  // y (n) = op(x)
  virtual void unary(UnaryOp op, Dtype dt, void* y, const void* x, uint64_t n) = 0;
  // z (n) = x + w (y - x)
  virtual void lerp(Dtype dt, void* z, const void* x, const void* y, float w, uint64_t n) = 0;
  // y (n) = a x + b
  virtual void affine(Dtype dt, void* y, const void* x, float a, float b, uint64_t n) = 0;

  // --- memory ---------------------------------------------------------------------------------
  // Device to device; the two ranges must not overlap (cudaMemcpyAsync's rule).
  virtual void copy(void* dst, const void* src, uint64_t bytes) = 0;
  // Host to device on the copy stream (a side stream on CUDA), ordered after every op enqueued
  // before it (its destination may still be read there) and before every op enqueued after it:
  // the ops see memory as if the copy were immediate. The host does not wait; `src` must stay
  // unchanged until synchronize(). From host_alloc, `src` is page-locked on CUDA.
  virtual void upload(void* dst, const void* src, uint64_t bytes) = 0;
  // Device to host; waits for the work before it and the copy.
  virtual void download(void* dst, const void* src, uint64_t bytes) = 0;
  // Device to host without waiting (the offload's update overlapped with the backward): the copy
  // runs once the work enqueued before it is done — on CUDA on the copy stream, after an event
  // on the compute stream — while the host and the compute stream go on. `dst` (page-locked on
  // CUDA: the host place's) holds the bytes once wait_downloads() returns, which waits for every
  // download_async before it. By default (the CPU backend, whose ops are done when they return)
  // a download.
  virtual void download_async(void* dst, const void* src, uint64_t bytes) {
    download(dst, src, bytes);
  }
  virtual void wait_downloads() {}
  // Waits until every op and copy enqueued so far is done.
  virtual void synchronize() = 0;
  // Double-buffered host staging, without a full synchronize: after enqueuing the uploads from
  // staging slot `slot` (0 .. kUploadSlots-1) the caller marks them (mark_uploads); before it
  // writes that slot again it calls wait_uploads(slot), which returns once those copies have read
  // their host sources. The compute stream is not waited for: with two slots the host fills the
  // next micro-step's batch while the device may still run the one before. A host sync (counted)
  // only when the copies are not done yet: on CUDA an event on the copy stream; the CPU backend's
  // uploads are done when upload() returns, so it never waits.
  static constexpr int kUploadSlots = 2;
  virtual void mark_uploads(int slot) = 0;
  virtual void wait_uploads(int slot) = 0;
  // Host staging memory for uploads (page-locked on CUDA, so a copy can overlap compute); not
  // device memory, not tracked.
  virtual void* host_alloc(uint64_t bytes) = 0;
  virtual void host_free(void* ptr) = 0;
  // The compute stream as the platform knows it (cudaStream_t); nullptr on the CPU.
  virtual void* native_stream() { return nullptr; }
  // Host synchronisations so far: every call that makes the host wait for the device (the
  // reductions, download, synchronize), one each. The CPU backend counts the calls the CUDA
  // backend would wait in, so a test can hold the loop to its waits without a GPU.
  uint64_t host_syncs() const { return host_syncs_; }

  // What computes: the GEMM library and its kernel, the threads ("" when there is nothing to
  // say). `headroom train -v` prints it, the metrics' first record carries it.
  virtual std::string describe() const { return ""; }

 protected:
  void count_host_sync() { ++host_syncs_; }

 private:
  uint64_t host_syncs_ = 0;
};

// Host staging memory from Backend::host_alloc, freed on scope exit.
class HostStaging {
 public:
  HostStaging(Backend& ops, uint64_t bytes) : ops_(ops), ptr_(ops.host_alloc(bytes)) {}
  ~HostStaging() { ops_.host_free(ptr_); }
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  void* get() const { return ptr_; }

 private:
  Backend& ops_;
  void* ptr_;
};

// The CPU reference backend (core/device/backend_cpu.cpp), on `threads` threads (0: OpenMP's
// default, OMP_NUM_THREADS or the cores available). The thread count is the process's: the
// kernels and the GEMM library read it (kernels/cpu/parallel.h).
std::unique_ptr<Backend> make_cpu_backend(int threads = 0);

}  // namespace headroom
