// Causal multi-head self-attention, GEMM-based like the CPU kernel: cuBLAS strided-batched GEMMs
// over the NH heads of one batch row (the heads of q, k, v sit hs columns apart inside qkv, so a
// head is a strided view, no copies), plus a causal softmax kernel and its backward.
// The full (B,NH,T,T) attention matrix is stored: a later step replaces this for long sequences.
#include <cmath>

#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

// Row-major, batched: C_i (M,N) = alpha * op(A_i) (M,K) · op(B_i) (K,N) + beta * C_i, with
// X_i = X + i * stride_x, and lda/ldb/ldc the row strides as stored (the CPU gemm's convention).
// Issued column-major as C^T = op(B)^T · op(A)^T.
void gemm_batched(CudaContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                  const float* A, int lda, long long stride_a, const float* B, int ldb,
                  long long stride_b, float beta, float* C, int ldc, long long stride_c, int batch,
                  cudaStream_t stream) {
  CUBLAS_CHECK(cublasSetStream(ctx.blas, stream));
  CUBLAS_CHECK(cublasSgemmStridedBatched(
      ctx.blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
      &alpha, B, ldb, stride_b, A, lda, stride_a, &beta, C, ldc, stride_c, batch));
}

}  // namespace

// In place over rows of att (rows, T), row r holding query position t = r % T: softmax over
// positions 0..t, exact zeros after. One warp per row; the same exp as the CPU
// (exp_minus_abs of x - max <= 0).
__global__ void causal_softmax_kernel(float* att, int rows, int T) {
  const int lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (r >= rows) return;
  const int n = r % T + 1;
  float* row = att + static_cast<size_t>(r) * T;
  float maxv = -INFINITY;
  for (int j = lane; j < n; j += kWarpSize) {
    maxv = fmaxf(maxv, row[j]);
  }
  maxv = warp_max(maxv);
  float sum = 0.0f;
  for (int j = lane; j < n; j += kWarpSize) {
    sum += exp_minus_abs(row[j] - maxv);
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int j = lane; j < n; j += kWarpSize) {
    row[j] = exp_minus_abs(row[j] - maxv) * inv;
  }
  for (int j = n + lane; j < T; j += kWarpSize) {
    row[j] = 0.0f;
  }
}

// In place over rows of d (rows, T) holding datt on entry: dpreatt = att * (datt - <att, datt>)
// over positions 0..t, exact zeros after (datt there is whatever the GEMM produced).
__global__ void causal_softmax_backward_kernel(float* d, const float* att, int rows, int T) {
  const int lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (r >= rows) return;
  const int n = r % T + 1;
  const float* a = att + static_cast<size_t>(r) * T;
  float* dr = d + static_cast<size_t>(r) * T;
  float dot = 0.0f;
  for (int j = lane; j < n; j += kWarpSize) {
    dot += a[j] * dr[j];
  }
  dot = warp_sum(dot);
  for (int j = lane; j < n; j += kWarpSize) {
    dr[j] = a[j] * (dr[j] - dot);
  }
  for (int j = n + lane; j < T; j += kWarpSize) {
    dr[j] = 0.0f;
  }
}

namespace {

void launch_rows(void (*kernel)(float*, int, int), float* x, int rows, int T, cudaStream_t stream) {
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  kernel<<<static_cast<unsigned>(ceil_div(rows, rows_per_block)), block, 0, stream>>>(x, rows, T);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(CudaContext& ctx, float* out, float* att, const float* qkv, int B, int T,
                       int C, int NH, cudaStream_t stream) {
  if (C % NH != 0) throw std::invalid_argument("attention_forward: C must be a multiple of NH");
  const int hs = C / NH;
  const int C3 = 3 * C;
  const long long TT = static_cast<long long>(T) * T;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  for (int b = 0; b < B; b++) {
    const float* q = qkv + static_cast<size_t>(b) * T * C3;  // head h at + h*hs, (T,hs) stride 3C
    const float* k = q + C;
    float* att_b = att + static_cast<size_t>(b) * NH * TT;  // (NH,T,T)
    // preatt (T,T) = scale * q · k^T, per head
    gemm_batched(ctx, false, true, T, T, hs, scale, q, C3, hs, k, C3, hs, 0.0f, att_b, T, TT, NH,
                 stream);
  }
  launch_rows(causal_softmax_kernel, att, B * NH * T, T, stream);
  for (int b = 0; b < B; b++) {
    const float* v = qkv + static_cast<size_t>(b) * T * C3 + 2 * C;
    const float* att_b = att + static_cast<size_t>(b) * NH * TT;
    float* out_b = out + static_cast<size_t>(b) * T * C;  // head h at + h*hs, (T,hs) stride C
    // out (T,hs) = att (T,T) · v (T,hs), per head
    gemm_batched(ctx, false, false, T, hs, T, 1.0f, att_b, T, TT, v, C3, hs, 0.0f, out_b, C, hs, NH,
                 stream);
  }
}

void attention_backward(CudaContext& ctx, float* dqkv, float* scratch, const float* dout,
                        const float* qkv, const float* att, int B, int T, int C, int NH,
                        cudaStream_t stream) {
  if (C % NH != 0) throw std::invalid_argument("attention_backward: C must be a multiple of NH");
  const int hs = C / NH;
  const int C3 = 3 * C;
  const long long TT = static_cast<long long>(T) * T;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  for (int b = 0; b < B; b++) {
    const size_t off = static_cast<size_t>(b) * T * C3;
    const float* q = qkv + off;  // per head (T,hs), row stride 3C; likewise k, v, dq, dk, dv
    const float* k = q + C;
    const float* v = q + 2 * C;
    float* dq = dqkv + off;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    const float* att_b = att + static_cast<size_t>(b) * NH * TT;  // (NH,T,T)
    const float* dout_b = dout + static_cast<size_t>(b) * T * C;  // per head (T,hs)
    // dv (T,hs) += att^T (T,T) · dout (T,hs)
    gemm_batched(ctx, true, false, T, hs, T, 1.0f, att_b, T, TT, dout_b, C, hs, 1.0f, dv, C3, hs,
                 NH, stream);
    // datt (T,T) = dout (T,hs) · v^T, into scratch (NH,T,T)
    gemm_batched(ctx, false, true, T, T, hs, 1.0f, dout_b, C, hs, v, C3, hs, 0.0f, scratch, T, TT,
                 NH, stream);
    // dpreatt = softmax backward of datt, in place
    const int block = 256;
    const int rows = NH * T;
    causal_softmax_backward_kernel<<<static_cast<unsigned>(ceil_div(rows, block / kWarpSize)),
                                     block, 0, stream>>>(scratch, att_b, rows, T);
    CUDA_CHECK_LAUNCH();
    // dq (T,hs) += scale * dpreatt (T,T) · k (T,hs);  dk (T,hs) += scale * dpreatt^T · q
    gemm_batched(ctx, false, false, T, hs, T, scale, scratch, T, TT, k, C3, hs, 1.0f, dq, C3, hs,
                 NH, stream);
    gemm_batched(ctx, true, false, T, hs, T, scale, scratch, T, TT, q, C3, hs, 1.0f, dk, C3, hs, NH,
                 stream);
  }
}

}  // namespace headroom::cuda
