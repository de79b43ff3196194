// Causal multi-head self-attention, GEMM-based like the CPU kernel: cuBLAS strided-batched GEMMs
// over the NH heads of one batch row (the heads of q, k, v sit hs columns apart inside qkv, so a
// head is a strided view, no copies), plus a causal softmax kernel and its backward.
// The GEMMs take the storage type for A, B and C with fp32 accumulation
// (cublasGemmStridedBatchedEx, CUBLAS_COMPUTE_32F); the softmax kernels compute in fp32 and round
// what they store. The full (B,NH,T,T) attention matrix is stored: a later step replaces this for
// long sequences.
#include <cmath>

#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

// Row-major, batched: C_i (M,N) = alpha * op(A_i) (M,K) · op(B_i) (K,N) + beta * C_i, with
// X_i = X + i * stride_x, and lda/ldb/ldc the row strides as stored (the CPU gemm's convention).
// Issued column-major as C^T = op(B)^T · op(A)^T.
template <class T>
void gemm_batched(CudaContext& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                  const T* A, int lda, long long stride_a, const T* B, int ldb, long long stride_b,
                  float beta, T* C, int ldc, long long stride_c, int batch, cudaStream_t stream) {
  const cudaDataType_t type = CublasType<T>::value;
  CUBLAS_CHECK(cublasSetStream(ctx.blas, stream));
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      ctx.blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
      &alpha, B, type, ldb, stride_b, A, type, lda, stride_a, &beta, C, type, ldc, stride_c, batch,
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

// In place over rows of att (rows, T), row r holding query position t = r % T: softmax over
// positions 0..t, exact zeros after. One warp per row; the same exp as the CPU
// (exp_minus_abs of x - max <= 0). Each lane reads and then writes only its own elements.
template <class T>
__global__ void causal_softmax_kernel(T* att, int rows, int Tn) {
  const int lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (r >= rows) return;
  const int n = r % Tn + 1;
  T* row = att + static_cast<size_t>(r) * Tn;
  float maxv = -INFINITY;
  for (int j = lane; j < n; j += kWarpSize) {
    maxv = fmaxf(maxv, to_float(row[j]));
  }
  maxv = warp_max(maxv);
  float sum = 0.0f;
  for (int j = lane; j < n; j += kWarpSize) {
    sum += exp_minus_abs(to_float(row[j]) - maxv);
  }
  const float inv = 1.0f / warp_sum(sum);
  for (int j = lane; j < n; j += kWarpSize) {
    row[j] = from_float<T>(exp_minus_abs(to_float(row[j]) - maxv) * inv);
  }
  for (int j = n + lane; j < Tn; j += kWarpSize) {
    row[j] = from_float<T>(0.0f);
  }
}

// In place over rows of d (rows, T) holding datt on entry: dpreatt = att * (datt - <att, datt>)
// over positions 0..t, exact zeros after (datt there is whatever the GEMM produced).
template <class T>
__global__ void causal_softmax_backward_kernel(T* d, const T* att, int rows, int Tn) {
  const int lane = threadIdx.x % kWarpSize;
  const int r = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (r >= rows) return;
  const int n = r % Tn + 1;
  const T* a = att + static_cast<size_t>(r) * Tn;
  T* dr = d + static_cast<size_t>(r) * Tn;
  float dot = 0.0f;
  for (int j = lane; j < n; j += kWarpSize) {
    dot += to_float(a[j]) * to_float(dr[j]);
  }
  dot = warp_sum(dot);
  for (int j = lane; j < n; j += kWarpSize) {
    dr[j] = from_float<T>(to_float(a[j]) * (to_float(dr[j]) - dot));
  }
  for (int j = n + lane; j < Tn; j += kWarpSize) {
    dr[j] = from_float<T>(0.0f);
  }
}

template <class T>
void attention_forward(CudaContext& ctx, T* out, T* att, const T* qkv, int B, int Tn, int C, int NH,
                       cudaStream_t stream) {
  if (NH <= 0 || C % NH != 0)
    throw std::invalid_argument("attention_forward: C must be a positive multiple of NH");
  if (B <= 0 || Tn <= 0 || C <= 0) return;
  const int hs = C / NH;
  const int C3 = 3 * C;
  const long long TT = static_cast<long long>(Tn) * Tn;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  for (int b = 0; b < B; b++) {
    const T* q = qkv + static_cast<size_t>(b) * Tn * C3;  // head h at + h*hs, (T,hs) stride 3C
    const T* k = q + C;
    T* att_b = att + static_cast<size_t>(b) * NH * TT;  // (NH,T,T)
    // preatt (T,T) = scale * q · k^T, per head
    gemm_batched(ctx, false, true, Tn, Tn, hs, scale, q, C3, hs, k, C3, hs, 0.0f, att_b, Tn, TT, NH,
                 stream);
  }
  const int block = 256;
  const int rows_per_block = block / kWarpSize;
  const long long rows = static_cast<long long>(B) * NH * Tn;
  if (rows > 0x7FFFFFFFLL) throw std::invalid_argument("attention_forward: B*NH*T exceeds 2^31-1");
  causal_softmax_kernel<<<static_cast<unsigned>(
                              ceil_div(static_cast<size_t>(rows), rows_per_block)),
                          block, 0, stream>>>(att, static_cast<int>(rows), Tn);
  CUDA_CHECK_LAUNCH();
  for (int b = 0; b < B; b++) {
    const T* v = qkv + static_cast<size_t>(b) * Tn * C3 + 2 * C;
    const T* att_b = att + static_cast<size_t>(b) * NH * TT;
    T* out_b = out + static_cast<size_t>(b) * Tn * C;  // head h at + h*hs, (T,hs) stride C
    // out (T,hs) = att (T,T) · v (T,hs), per head
    gemm_batched(ctx, false, false, Tn, hs, Tn, 1.0f, att_b, Tn, TT, v, C3, hs, 0.0f, out_b, C, hs,
                 NH, stream);
  }
}

template <class T>
void attention_backward(CudaContext& ctx, T* dqkv, T* scratch, const T* dout, const T* qkv,
                        const T* att, int B, int Tn, int C, int NH, cudaStream_t stream) {
  if (NH <= 0 || C % NH != 0)
    throw std::invalid_argument("attention_backward: C must be a positive multiple of NH");
  if (B <= 0 || Tn <= 0 || C <= 0) return;
  const int hs = C / NH;
  const int C3 = 3 * C;
  const long long TT = static_cast<long long>(Tn) * Tn;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const int block = 256;
  const int rows = NH * Tn;  // the softmax rows of one batch row
  for (int b = 0; b < B; b++) {
    const size_t off = static_cast<size_t>(b) * Tn * C3;
    const T* q = qkv + off;  // per head (T,hs), row stride 3C; likewise k, v, dq, dk, dv
    const T* k = q + C;
    const T* v = q + 2 * C;
    T* dq = dqkv + off;
    T* dk = dq + C;
    T* dv = dq + 2 * C;
    const T* att_b = att + static_cast<size_t>(b) * NH * TT;   // (NH,T,T)
    const T* dout_b = dout + static_cast<size_t>(b) * Tn * C;  // per head (T,hs)
    // dv (T,hs) += att^T (T,T) · dout (T,hs)
    gemm_batched(ctx, true, false, Tn, hs, Tn, 1.0f, att_b, Tn, TT, dout_b, C, hs, 1.0f, dv, C3, hs,
                 NH, stream);
    // datt (T,T) = dout (T,hs) · v^T, into scratch (NH,T,T)
    gemm_batched(ctx, false, true, Tn, Tn, hs, 1.0f, dout_b, C, hs, v, C3, hs, 0.0f, scratch, Tn,
                 TT, NH, stream);
    // dpreatt = softmax backward of datt, in place
    causal_softmax_backward_kernel<<<static_cast<unsigned>(ceil_div(rows, block / kWarpSize)),
                                     block, 0, stream>>>(scratch, att_b, rows, Tn);
    CUDA_CHECK_LAUNCH();
    // dq (T,hs) += scale * dpreatt (T,T) · k (T,hs);  dk (T,hs) += scale * dpreatt^T · q
    gemm_batched(ctx, false, false, Tn, hs, Tn, scale, scratch, Tn, TT, k, C3, hs, 1.0f, dq, C3, hs,
                 NH, stream);
    gemm_batched(ctx, true, false, Tn, hs, Tn, scale, scratch, Tn, TT, q, C3, hs, 1.0f, dk, C3, hs,
                 NH, stream);
  }
}

// One block per head h: scores s_j = scale * q · k_j for j in 0..T-1 (q from row T-1) into shared
// memory, their softmax (the forward's exp), then out[h*hs + d] = sum_j p_j v_j[d]. fp32 inside.
template <class T>
__global__ void attention_decode_kernel(T* out, const T* qkv, int Tn, int C, int hs, float scale) {
  extern __shared__ float scores[];  // (T)
  const int h = blockIdx.x;
  const size_t C3 = static_cast<size_t>(3) * C;
  const T* q = qkv + static_cast<size_t>(Tn - 1) * C3 + static_cast<size_t>(h) * hs;
  float maxv = -INFINITY;
  for (int j = threadIdx.x; j < Tn; j += blockDim.x) {
    const T* k = qkv + static_cast<size_t>(j) * C3 + C + static_cast<size_t>(h) * hs;
    float dot = 0.0f;
    for (int d = 0; d < hs; d++)
      dot += to_float(q[d]) * to_float(k[d]);
    scores[j] = scale * dot;
    maxv = fmaxf(maxv, scores[j]);
  }
  maxv = block_max(maxv);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < Tn; j += blockDim.x) {
    scores[j] = exp_minus_abs(scores[j] - maxv);
    sum += scores[j];
  }
  const float inv = 1.0f / block_sum(sum);  // its __syncthreads make every score visible
  for (int d = threadIdx.x; d < hs; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < Tn; j++)
      acc += scores[j] * to_float(qkv[static_cast<size_t>(j) * C3 + 2 * static_cast<size_t>(C) +
                                      static_cast<size_t>(h) * hs + d]);
    out[static_cast<size_t>(h) * hs + d] = from_float<T>(acc * inv);
  }
}

template <class T>
void attention_decode(CudaContext& ctx, T* out, const T* qkv, int Tn, int C, int NH,
                      cudaStream_t stream) {
  (void)ctx;
  if (NH <= 0 || C % NH != 0)
    throw std::invalid_argument("attention_decode: C must be a positive multiple of NH");
  if (Tn <= 0 || Tn > 12288)
    throw std::invalid_argument("attention_decode: 1 to 12288 cached positions");
  const int hs = C / NH;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  attention_decode_kernel<<<NH, 256, static_cast<size_t>(Tn) * sizeof(float), stream>>>(
      out, qkv, Tn, C, hs, scale);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                                      \
  template void attention_decode<T>(CudaContext&, T*, const T*, int, int, int, cudaStream_t);  \
  template void attention_forward<T>(CudaContext&, T*, T*, const T*, int, int, int, int,       \
                                     cudaStream_t);                                            \
  template void attention_backward<T>(CudaContext&, T*, T*, const T*, const T*, const T*, int, \
                                      int, int, int, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
