// Fully connected layer through cuBLASLt, weight stored (OC,C) as in nn.Linear / llm.c.
//
// cuBLAS is column-major: a row-major (R,K) matrix with row stride ld is, to cuBLAS, the
// column-major (K,R) matrix with leading dimension ld, i.e. its transpose. So each row-major
// product below is issued as the column-major product of the transposes.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

// The largest power of two (up to 256) dividing the address: cuBLASLt's heuristic assumes
// 256-byte-aligned operands unless told otherwise, and pointers into an arena may be less aligned.
uint32_t alignment_of(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 4 && (addr % a) != 0)
    a /= 2;
  return a;
}

// Owns the descriptors of one cublasLtMatmul call, so a failed check does not leak them.
struct LtMatmulDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtMatmulDescs() = default;
  LtMatmulDescs(const LtMatmulDescs&) = delete;
  LtMatmulDescs& operator=(const LtMatmulDescs&) = delete;
  ~LtMatmulDescs() {
    if (pref != nullptr) (void)cublasLtMatmulPreferenceDestroy(pref);
    if (d != nullptr) (void)cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) (void)cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) (void)cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) (void)cublasLtMatmulDescDestroy(op);
  }
};

// Column-major D (m,n) = op(A) (m,k) · op(B) (k,n) + beta * D [+ bias (m) broadcast over columns],
// fp32 in, fp32 accumulate (CUBLAS_COMPUTE_32F: no TF32). bias requires beta == 0 here.
void lt_matmul(CudaContext& ctx, bool trans_a, bool trans_b, int m, int n, int k, const float* A,
               int lda, const float* B, int ldb, float beta, float* D, int ldd, const float* bias,
               cudaStream_t stream) {
  LtMatmulDescs desc;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const cublasLtEpilogue_t epilogue =
      bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                              sizeof(epilogue)));
  if (bias != nullptr) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof(bias)));
  }
  // Stored shapes (column-major rows x cols): op(A) is (m,k), so A is stored (k,m) when
  // transposed; likewise B.
  CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&desc.a, CUDA_R_32F, trans_a ? k : m, trans_a ? m : k, lda));
  CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&desc.b, CUDA_R_32F, trans_b ? n : k, trans_b ? k : n, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, CUDA_R_32F, m, n, ldd));

  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
  const size_t ws = ctx.workspace_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t align_a = alignment_of(A), align_b = alignment_of(B), align_d = alignment_of(D);
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc.op, desc.a, desc.b, desc.d, desc.d,
                                              desc.pref, 1, &heuristic, &found));
  if (found == 0) {
    throw std::runtime_error(
        std::string(__FILE__) + ":" + std::to_string(__LINE__) +
        ": cublasLtMatmulAlgoGetHeuristic found no algorithm for m=" + std::to_string(m) +
        " n=" + std::to_string(n) + " k=" + std::to_string(k) + (bias ? " with bias" : ""));
  }
  const float alpha = 1.0f;
  // C and D are the same matrix: beta = 1 accumulates in place.
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt, desc.op, &alpha, A, desc.a, B, desc.b, &beta, D, desc.d, D,
                              desc.d, &heuristic.algo, ctx.workspace, ctx.workspace_bytes, stream));
}

}  // namespace

void matmul_forward(CudaContext& ctx, float* out, const float* inp, const float* weight,
                    const float* bias, int N, int C, int OC, cudaStream_t stream) {
  // out^T (OC,N) = weight (OC,C) · inp^T (C,N): weight is stored as column-major (C,OC) -> op T;
  // inp is stored as column-major (C,N) -> op N. The bias (OC) runs down out^T's columns.
  lt_matmul(ctx, true, false, OC, N, C, weight, C, inp, C, 0.0f, out, OC, bias, stream);
}

// dbias (OC) += column sums of dout (N,OC): one thread per column, rows in order (deterministic).
__global__ void bias_backward_kernel(float* dbias, const float* dout, int N, int OC) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= OC) return;
  float acc = 0.0f;
  for (int n = 0; n < N; n++) {
    acc += dout[static_cast<size_t>(n) * OC + o];
  }
  dbias[o] += acc;
}

void matmul_backward(CudaContext& ctx, float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int N, int C, int OC,
                     cudaStream_t stream) {
  if (dinp != nullptr) {
    // dinp^T (C,N) += weight^T (C,OC) · dout^T (OC,N); both stored that way -> op N, op N.
    lt_matmul(ctx, false, false, C, N, OC, weight, C, dout, OC, 1.0f, dinp, C, nullptr, stream);
  }
  if (dweight != nullptr) {
    // dweight^T (C,OC) += inp^T (C,N) · dout (N,OC); inp stored (C,N) -> op N, dout stored
    // (OC,N) -> op T.
    lt_matmul(ctx, false, true, C, OC, N, inp, C, dout, OC, 1.0f, dweight, C, nullptr, stream);
  }
  if (dbias != nullptr) {
    const int block = 256;
    bias_backward_kernel<<<static_cast<unsigned>(ceil_div(OC, block)), block, 0, stream>>>(
        dbias, dout, N, OC);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace headroom::cuda
