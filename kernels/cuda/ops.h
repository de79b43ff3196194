// The CUDA backend's ops: launchers mirroring the CPU kernels in kernels/cpu/*.h, one topic per
// source file (kernels/cuda/<topic>.cu). A plain C++ header: includers need no CUDA types beyond
// cudaStream_t.
//
// Conventions, the same as the CPU kernels and core/device/backend.h:
//   - every pointer is a device pointer; shapes are given in the comments, row-major;
//   - the storage type T of the float tensors is float, bf16 or f16 (each launcher template is
//     instantiated for those three in its .cu file). The math is fp32 whatever T is: loads widen
//     to float, stores round to T to nearest even with kernels/common/dtype.h's functions, the
//     ones the CPU backend rounds with. Statistics (LayerNorm mean/rstd, losses) are float always;
//   - backward ACCUMULATES (+=) into its gradient outputs, rounding once per element per call;
//   - every launcher enqueues its work on `stream` and returns without synchronizing;
//   - every CUDA/cuBLAS call is checked: a failure throws std::runtime_error with file:line.
// GEMMs run in true fp32 accumulation (CUBLAS_COMPUTE_32F, never TF32): f32 GEMMs match the CPU
// backend to ~1e-6, and bf16/f16 GEMMs take 16-bit A/B/C with fp32 sums.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/pointwise.h"
#include "kernels/common/rope.h"

// cuBLAS's handle types, forward-declared so that includers need no cuBLAS header
// (cublasHandle_t is cublasContext*, cublasLtHandle_t is cublasLtContext*).
struct cublasContext;
struct cublasLtContext;

namespace headroom::cuda {

// The 16-bit storage types: the bits of a bfloat16 / IEEE half, converted with
// kernels/common/dtype.h. Two bytes, two-byte aligned: the layout cuBLAS's CUDA_R_16BF and
// CUDA_R_16F expect.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2, "bf16 is two bytes");
static_assert(sizeof(f16) == 2 && alignof(f16) == 2, "f16 is two bytes");

// The per-device state the GEMM ops need, created once and reused: the cuBLASLt handle (matmul),
// the cuBLAS handle (attention's strided-batched GEMMs) and the cuBLASLt workspace.
// Constructing one needs a CUDA device (it allocates); it belongs to the device current then.
struct CudaContext {
  explicit CudaContext(size_t workspace_bytes = size_t(32) << 20);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  cublasLtContext* lt = nullptr;
  cublasContext* blas = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

 private:
  void release() noexcept;
};

// --- embedding.cu ------------------------------------------------------------------------------
// out (B,T,C) = wte[tokens[b,t]] + wpe[t];  tokens (B,T), wte (V,C), wpe (maxT,C) with maxT >= T.
// wpe null: no position table (Llama), out = wte[tokens[b,t]].
template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn,
                       int C, cudaStream_t stream);
// dwte (V,C) += scatter of dout rows by token; dwpe (maxT,C) += dout summed over the batch.
// Deterministic, no atomics: each touched element of dwte and dwpe is summed in (b,t) order in
// fp32 starting from its old value and stored once — for float the CPU's additions, bitwise.
// dwte or dwpe may be null.
template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn,
                        int C, cudaStream_t stream);

// --- layernorm.cu ------------------------------------------------------------------------------
// out (N,C) = (inp - mean) * rstd * weight (C) + bias (C), eps = 1e-5, biased variance.
// mean, rstd (N) are saved for backward (either may be null); always float.
template <class T>
void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                       const T* bias, int N, int C, cudaStream_t stream);
// res (N,C) += x (N,C), then out (N,C) = layernorm_forward of res: bitwise add_inplace then
// layernorm_forward, one pass over res.
template <class T>
void residual_layernorm_forward(T* out, float* mean, float* rstd, T* res, const T* x,
                                const T* weight, const T* bias, int N, int C, cudaStream_t stream);
// dbias (C) += sum_n dout,  dweight (C) += sum_n dout * norm,
// dinp (N,C) += rstd * (dnorm - mean_i(dnorm) - norm * mean_i(dnorm * norm)), dnorm = dout *
// weight. Any of dinp, dweight, dbias may be null (skipped). !accumulate: dinp's contents are
// ignored, dinp = dres + that (dres (N,C) may be null: 0 + that).
template <class T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const float* mean, const float* rstd, int N, int C, cudaStream_t stream,
                        bool accumulate = true, const T* dres = nullptr);

// --- matmul.cu (cuBLASLt) ----------------------------------------------------------------------
// out (N,OC) = inp (N,C) · weight (OC,C)^T + bias (OC); bias may be null. The bias is the GEMM's
// epilogue (CUBLASLT_EPILOGUE_BIAS) where cuBLASLt has an algorithm for it, else it is written
// first and the GEMM accumulates onto it (the CPU's way).
template <class T>
void matmul_forward(CudaContext& ctx, T* out, const T* inp, const T* weight, const T* bias, int N,
                    int C, int OC, cudaStream_t stream);
// dinp (N,C) += dout (N,OC) · weight (OC,C);  dweight (OC,C) += dout^T · inp (N,C);
// dbias (OC) += column sums of dout. dinp and dbias may be null. !accumulate_dinp: dinp =, its
// contents ignored (beta 0).
template <class T>
void matmul_backward(CudaContext& ctx, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int N, int C, int OC, cudaStream_t stream,
                     bool accumulate_dinp = true);

// --- attention.cu (cuBLAS strided-batched GEMMs over the heads + causal softmax kernels) -------
// qkv (B,T,3C) laid out [q | k | v]; head h uses columns h*hs..(h+1)*hs, hs = C/NH.
// att (B,NH,T,T): softmax probabilities saved for backward (exact zeros above the diagonal).
// out (B,T,C): the heads side by side. For 16-bit T the pre-softmax scores pass through att in T.
template <class T>
void attention_forward(CudaContext& ctx, T* out, T* att, const T* qkv, int B, int Tn, int C, int NH,
                       cudaStream_t stream);
// Generation: qkv (T,3C) one sequence's cached rows; out (C) = row T-1's query attending over
// rows 0..T-1. One block per head, the scores in dynamic shared memory (T floats: T <= 12288).
template <class T>
void attention_decode(CudaContext& ctx, T* out, const T* qkv, int Tn, int C, int NH,
                      cudaStream_t stream);
// Elements of T the backward's scratch needs: one batch row's heads at a time, (NH,T,T).
inline uint64_t attention_scratch_numel(int B, int Tn, int NH) {
  (void)B;
  return uint64_t(NH) * uint64_t(Tn) * uint64_t(Tn);
}
// dqkv (B,T,3C) += gradient w.r.t. qkv, given dout (B,T,C) and the forward's qkv and att.
// scratch: attention_scratch_numel(B,T,NH) elements, contents undefined on entry and exit.
template <class T>
void attention_backward(CudaContext& ctx, T* dqkv, T* scratch, const T* dout, const T* qkv,
                        const T* att, int B, int Tn, int C, int NH, cudaStream_t stream);

// --- attention_tiled.cu (FlashAttention-style: no (T,T) tensor, shared-memory tiles) ---------
// qkv (B,T,C + 2·NKV·hs) laid out [q | k | v], hs = C/NH: NH query heads and NKV key/value heads
// (grouped-query attention, NKV dividing NH; NKV = NH is multi-head attention, qkv (B,T,3C)),
// query head h reading key/value head h / (NH/NKV). out (B,T,C) as attention_forward's; lse
// (B,NH,T) in fp32: each query row's log-sum-exp of its scaled scores, all that backward needs
// besides qkv and out. Head size at most 128.
template <class T>
void attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int Tn, int C, int NH,
                             int NKV, cudaStream_t stream);
// dqkv (same layout as qkv) += gradient, the scores recomputed tile by tile from qkv, out and lse.
// A key/value head's dk and dv sum its NH/NKV query heads in registers and are stored once.
template <class T>
void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                              int B, int Tn, int C, int NH, int NKV, cudaStream_t stream);

// --- rmsnorm.cu ---------------------------------------------------------------------------------
// out (N,C) = inp * rstd * weight (C), rstd (N, float; may be null) = 1 / sqrt(mean(inp^2) + eps).
template <class T>
void rmsnorm_forward(T* out, float* rstd, const T* inp, const T* weight, int N, int C, double eps,
                     cudaStream_t stream);
// norm = inp * rstd, dnorm = dout * weight:
// dweight (C) += sum_n dout * norm; dinp (N,C) += rstd * (dnorm - norm * mean_i(dnorm * norm)).
// dinp or dweight may be null (skipped). !accumulate: dinp's contents are ignored, dinp = dres +
// that (dres (N,C) may be null: 0 + that).
template <class T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                      const float* rstd, int N, int C, cudaStream_t stream, bool accumulate = true,
                      const T* dres = nullptr);

// --- swiglu.cu ----------------------------------------------------------------------------------
// out (N,H) = silu(gu[:, :H]) * gu[:, H:], gu (N,2H) = [gate | up] a row.
template <class T>
void swiglu_forward(T* out, const T* gu, int N, int H, cudaStream_t stream);
// dgu (N,2H) += [dout * up * silu'(gate) | dout * silu(gate)] (!accumulate: dgu = 0 + that, its
// contents ignored).
template <class T>
void swiglu_backward(T* dgu, const T* gu, const T* dout, int N, int H, cudaStream_t stream,
                     bool accumulate = true);

// --- rope.cu ------------------------------------------------------------------------------------
// In place on qkv (B,T,(NH + 2·NKV)·hs)'s NH q and NKV k heads: pair i (elements i, i + hs/2) of
// row t rotated by t · rope_inv_freq(i, hs, p) (kernels/common/rope.h); backward rotates dqkv by
// the opposite angle. hs even, at most 512.
template <class T>
void rope_forward(T* qkv, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p,
                  cudaStream_t stream);
template <class T>
void rope_backward(T* dqkv, int B, int Tn, int NH, int NKV, int hs, const RopeParams& p,
                   cudaStream_t stream);

// --- gelu.cu -----------------------------------------------------------------------------------
// out (N) = gelu(inp (N)), GPT-2's tanh approximation (kernels/common/elementwise.h).
template <class T>
void gelu_forward(T* out, const T* inp, size_t N, cudaStream_t stream);
// dinp (N) += gelu'(inp) * dout (!accumulate: dinp = 0 + that, its contents ignored)
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N, cudaStream_t stream,
                   bool accumulate = true);

// --- quant.cu ----------------------------------------------------------------------------------
// out (n) = the quantized tensor q's elements (kernels/common/quant.h's layout of `kind`, 1 bf16,
// 2 int8, 3 nf4; with double-quantized absmaxes when double_quant), each an f32 code value times
// its block's absmax rounded once to T: a frozen weight's transient before a GEMM.
template <class T>
void dequantize(T* out, const unsigned char* q, uint32_t kind, bool double_quant, size_t n,
                cudaStream_t stream);

// --- dropout.cu --------------------------------------------------------------------------------
// out (n) = inp (n) * (kept ? 1 / (1 - p) : 0), element i kept as kernels/common/dropout.h's hash
// of (seed, i) says; in place when out == inp.
template <class T>
void dropout(T* out, const T* inp, size_t n, float p, uint64_t seed, cudaStream_t stream);

// --- residual.cu -------------------------------------------------------------------------------
// out (N) = a (N) + b (N)
template <class T>
void residual_forward(T* out, const T* a, const T* b, size_t N, cudaStream_t stream);
// dst (N) += src (N)
template <class T>
void add_inplace(T* dst, const T* src, size_t N, cudaStream_t stream);

// --- crossentropy.cu ---------------------------------------------------------------------------
// logits (N,V), targets (N) in [0,V) or < 0 to ignore a row.
// losses (N, float) = -log softmax(logits)[target] (0 for ignored rows); logits overwritten with
// dloss * (softmax - onehot(target)) (zeros for ignored rows), each element rounded once.
template <class T>
void crossentropy_forward_backward(T* logits, float* losses, const int32_t* targets, int N, int V,
                                   float dloss, cudaStream_t stream);

// --- elementwise.cu: fill, cast, scale, axpy, and the reductions that answer the host ----------
// x (n) = value, rounded once to T (float(value) first, as the CPU backend stores it).
template <class T>
void fill(T* x, size_t n, double value, cudaStream_t stream);
// dst (n) = src (n), widened exactly / narrowed to nearest even; Dst == Src is a device copy.
template <class Dst, class Src>
void cast(Dst* dst, const Src* src, size_t n, cudaStream_t stream);
// x (n) *= s: in fp32 for float (x * float(s), as the CPU), in double for bf16 / f16 (as the CPU
// backend does, so both round the same product).
template <class T>
void scale(T* x, size_t n, double s, cudaStream_t stream);
// y (n) += a * x (n): fp32 for float (float(a) * x, then the add, no fused multiply-add: the CPU's
// operations), double for bf16 / f16 (as the CPU backend).
template <class T>
void axpy(T* y, const T* x, size_t n, double a, cudaStream_t stream);
// y (n, f32) += x (n) widened to f32, one rounded add (as the CPU backend).
template <class T>
void accumulate(float* y, const T* x, size_t n, cudaStream_t stream);

// Number of doubles sum_squares needs as scratch.
constexpr int kSumSquaresBlocks = 512;
// out[0] (device) = sum of x[i]^2, accumulated in double; deterministic (fixed grid, fixed order
// of the partial sums). scratch: kSumSquaresBlocks doubles. x may be empty (out[0] = 0).
template <class T>
void sum_squares(double* out, double* scratch, const T* x, size_t n, cudaStream_t stream);
// flag[0] (device) = 1 if any x[i] is NaN or infinite, else 0 (tested on the bits: immune to
// fast-math). x may be empty. clear = false leaves flag[0] alone unless x has one (an or into
// it: one flag over many tensors).
template <class T>
void any_nonfinite(int* flag, const T* x, size_t n, cudaStream_t stream, bool clear = true);

// --- pointwise.cu: headroom.ops/1's element-wise ops ------------------------------------------
// Each element is kernels/common/pointwise.h's function in f32 of the widened inputs, rounded to T
// to nearest even: the CPU backend's bits. An output may be an input's very buffer (in place),
// never a partial overlap. n may be 0.
// z (n) = x op y
template <class T>
void binary(BinaryOp op, T* z, const T* x, const T* y, size_t n, cudaStream_t stream);
// y (n) = op(x)
template <class T>
void unary(UnaryOp op, T* y, const T* x, size_t n, cudaStream_t stream);
// z (n) = x + w (y - x)
template <class T>
void lerp(T* z, const T* x, const T* y, float w, size_t n, cudaStream_t stream);
// y (n) = a x + b
template <class T>
void affine(T* y, const T* x, float a, float b, size_t n, cudaStream_t stream);

// --- optimizer.cu (float parameters, gradients and state) --------------------------------------
// Where an update also writes each new float weight's compute-dtype copy (amp's compute copies
// beside f32 masters), in the same kernel: bf16 or (f16) f16 bits, rounded to nearest even as
// cast() rounds them. data null: no copy.
struct CopyOut {
  uint16_t* data = nullptr;
  bool f16 = false;
};
// AdamW, torch.optim.AdamW semantics, t the 1-based step (bias corrections computed on the host in
// double, as on the CPU); m, v (n) zero-initialized before step 1. The update reads
// grad * grad_scale (clipping folded in; 1 for none).
void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t,
                  float grad_scale, CopyOut copy, cudaStream_t stream);
// SGD, torch.optim.SGD semantics; momentum_buf (n) null (or momentum 0) means no state.
void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, float lr,
                float momentum, float weight_decay, float grad_scale, CopyOut copy,
                cudaStream_t stream);
// The same on stored operands: W, G, S each float or uint16_t (bf16 bits, weights and state
// rounded stochastically from seed); instantiated for every combination in optimizer.cu. `copy`
// only with float weights.
template <class W, class G, class S>
void adamw_update_stored(W* param, const G* grad, S* m, S* v, size_t n, float lr, float beta1,
                         float beta2, float eps, float weight_decay, int64_t t, uint32_t seed,
                         CopyOut copy, cudaStream_t stream);
template <class W, class G, class S>
void sgd_update_stored(W* param, const G* grad, S* momentum_buf, size_t n, float lr, float momentum,
                       float weight_decay, uint32_t seed, CopyOut copy, cudaStream_t stream);
// x (n) *= s
void scale_inplace(float* x, size_t n, float s, cudaStream_t stream);

}  // namespace headroom::cuda
