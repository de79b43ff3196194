// The CUDA backend's ops: float (fp32) launchers mirroring the CPU kernels in kernels/cpu/*.h, one
// topic per source file (kernels/cuda/<topic>.cu). A plain C++ header: includers need no CUDA types
// beyond cudaStream_t.
//
// Conventions, the same as the CPU kernels:
//   - every pointer is a device pointer; shapes are given in the comments, row-major;
//   - backward ACCUMULATES (+=) into its gradient outputs;
//   - every launcher enqueues its work on `stream` and returns without synchronizing;
//   - every CUDA/cuBLAS call is checked: a failure throws std::runtime_error with file:line.
// GEMMs run in true fp32 (CUBLAS_COMPUTE_32F, never TF32), so they match the CPU backend to ~1e-6.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// cuBLAS's handle types, forward-declared so that includers need no cuBLAS header
// (cublasHandle_t is cublasContext*, cublasLtHandle_t is cublasLtContext*).
struct cublasContext;
struct cublasLtContext;

namespace headroom::cuda {

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
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, cudaStream_t stream);
// dwte (V,C) += scatter of dout rows by token; dwpe (maxT,C) += dout summed over the batch.
// Deterministic: each column is summed in (b,t) order, as on the CPU. dwte or dwpe may be null.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C, cudaStream_t stream);

// --- layernorm.cu ------------------------------------------------------------------------------
// out (N,C) = (inp - mean) * rstd * weight (C) + bias (C), eps = 1e-5, biased variance.
// mean, rstd (N) are saved for backward (either may be null).
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, cudaStream_t stream);
// dbias (C) += sum_n dout,  dweight (C) += sum_n dout * norm,
// dinp (N,C) += rstd * (dnorm - mean_i(dnorm) - norm * mean_i(dnorm * norm)), dnorm = dout *
// weight.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C, cudaStream_t stream);

// --- matmul.cu (cuBLASLt) ----------------------------------------------------------------------
// out (N,OC) = inp (N,C) · weight (OC,C)^T + bias (OC); bias may be null. The bias is the GEMM's
// epilogue (CUBLASLT_EPILOGUE_BIAS), not a second pass.
void matmul_forward(CudaContext& ctx, float* out, const float* inp, const float* weight,
                    const float* bias, int N, int C, int OC, cudaStream_t stream);
// dinp (N,C) += dout (N,OC) · weight (OC,C);  dweight (OC,C) += dout^T · inp (N,C);
// dbias (OC) += column sums of dout. dinp and dbias may be null.
void matmul_backward(CudaContext& ctx, float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int N, int C, int OC,
                     cudaStream_t stream);

// --- attention.cu (cuBLAS strided-batched GEMMs over the heads + causal softmax kernels) -------
// qkv (B,T,3C) laid out [q | k | v]; head h uses columns h*hs..(h+1)*hs, hs = C/NH.
// att (B,NH,T,T): softmax probabilities saved for backward (exact zeros above the diagonal).
// out (B,T,C): the heads side by side.
void attention_forward(CudaContext& ctx, float* out, float* att, const float* qkv, int B, int T,
                       int C, int NH, cudaStream_t stream);
// dqkv (B,T,3C) += gradient w.r.t. qkv, given dout (B,T,C) and the forward's qkv and att.
// scratch: workspace of NH*T*T floats (one batch row's heads at a time; the CPU kernel needs only
// T*T), contents undefined on entry and exit.
void attention_backward(CudaContext& ctx, float* dqkv, float* scratch, const float* dout,
                        const float* qkv, const float* att, int B, int T, int C, int NH,
                        cudaStream_t stream);

// --- gelu.cu -----------------------------------------------------------------------------------
// out (N) = gelu(inp (N)), GPT-2's tanh approximation (kernels/common/elementwise.h).
void gelu_forward(float* out, const float* inp, size_t N, cudaStream_t stream);
// dinp (N) += gelu'(inp) * dout
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N, cudaStream_t stream);

// --- residual.cu -------------------------------------------------------------------------------
// out (N) = a (N) + b (N)
void residual_forward(float* out, const float* a, const float* b, size_t N, cudaStream_t stream);
// dst (N) += src (N)
void add_inplace(float* dst, const float* src, size_t N, cudaStream_t stream);

// --- crossentropy.cu ---------------------------------------------------------------------------
// logits (N,V), targets (N) in [0,V) or < 0 to ignore a row.
// losses (N) = -log softmax(logits)[target] (0 for ignored rows); logits overwritten with
// dloss * (softmax - onehot(target)) (zeros for ignored rows).
void crossentropy_forward_backward(float* logits, float* losses, const int32_t* targets, int N,
                                   int V, float dloss, cudaStream_t stream);

// --- optimizer.cu ------------------------------------------------------------------------------
// AdamW, torch.optim.AdamW semantics, t the 1-based step (bias corrections computed on the host in
// double, as on the CPU); m, v (n) zero-initialized before step 1.
void adamw_update(float* param, const float* grad, float* m, float* v, size_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t,
                  cudaStream_t stream);
// SGD, torch.optim.SGD semantics; momentum_buf (n) null (or momentum 0) means no state.
void sgd_update(float* param, const float* grad, float* momentum_buf, size_t n, float lr,
                float momentum, float weight_decay, cudaStream_t stream);
// x (n) *= s
void scale_inplace(float* x, size_t n, float s, cudaStream_t stream);

// Number of doubles sum_squares needs as scratch.
constexpr int kSumSquaresBlocks = 512;
// out[0] (device) = sum of x[i]^2, accumulated in double; deterministic (fixed grid, fixed order
// of the partial sums). scratch: kSumSquaresBlocks doubles. x may be empty (out[0] = 0).
void sum_squares(double* out, double* scratch, const float* x, size_t n, cudaStream_t stream);

}  // namespace headroom::cuda
