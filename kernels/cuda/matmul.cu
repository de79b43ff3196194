// Fully connected layer through cuBLASLt, weight stored (OC,C) as in nn.Linear / llm.c.
//
// cuBLAS is column-major: a row-major (R,K) matrix with row stride ld is, to cuBLAS, the
// column-major (K,R) matrix with leading dimension ld, i.e. its transpose. So each row-major
// product below is issued as the column-major product of the transposes.
//
// A, B, C and D all have the storage type (CUDA_R_32F, CUDA_R_16BF or CUDA_R_16F), the sums are
// fp32 (CUBLAS_COMPUTE_32F: for float no TF32; for 16-bit types tensor-core products with fp32
// accumulation) and alpha/beta are float.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

// The largest power of two (up to 256, at least the element size) dividing the address:
// cuBLASLt's heuristic assumes 256-byte-aligned operands unless told otherwise, and pointers into
// an arena (or a plugin's pool) may be less aligned.
uint32_t alignment_of(const void* p, uint32_t element_bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > element_bytes && (addr % a) != 0)
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
// storage type T for A, B, D and the bias, fp32 accumulation. The bias requires beta == 0 here.
// Returns false (having enqueued nothing) when cuBLASLt has no algorithm for the bias epilogue:
// the caller then adds the bias itself. Without a bias, a shape cuBLASLt has no algorithm for
// goes to cublasGemmEx.
template <class T>
bool lt_matmul(CudaContext& ctx, bool trans_a, bool trans_b, int m, int n, int k, const T* A,
               int lda, const T* B, int ldb, float beta, T* D, int ldd, const T* bias,
               cudaStream_t stream) {
  const cudaDataType_t type = CublasType<T>::value;
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
    // The bias vector has D's type: cuBLASLt's default for f32, bf16 and f16 outputs.
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof(bias)));
  }
  // Stored shapes (column-major rows x cols): op(A) is (m,k), so A is stored (k,m) when
  // transposed; likewise B.
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.a, type, trans_a ? k : m, trans_a ? m : k, lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.b, type, trans_b ? n : k, trans_b ? k : n, ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&desc.d, type, m, n, ldd));

  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&desc.pref));
  const size_t ws = ctx.workspace_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t es = sizeof(T);
  const uint32_t align_a = alignment_of(A, es), align_b = alignment_of(B, es),
                 align_d = alignment_of(D, es);
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
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      ctx.lt, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1, &heuristic, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    found = 0;
  } else {
    CUBLAS_CHECK(status);
  }
  if (found == 0) {
    if (bias != nullptr) return false;
    // No cuBLASLt algorithm for this shape, type and alignment: cuBLAS's GEMM, which has one for
    // every shape (same types, same fp32 accumulation).
    const float one = 1.0f;
    CUBLAS_CHECK(cublasSetStream(ctx.blas, stream));
    CUBLAS_CHECK(cublasGemmEx(ctx.blas, op_a, op_b, m, n, k, &one, A, type, lda, B, type, ldb,
                              &beta, D, type, ldd, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return true;
  }
  const float alpha = 1.0f;
  // C and D are the same matrix: beta = 1 accumulates in place.
  CUBLAS_CHECK(cublasLtMatmul(ctx.lt, desc.op, &alpha, A, desc.a, B, desc.b, &beta, D, desc.d, D,
                              desc.d, &heuristic.algo, ctx.workspace, ctx.workspace_bytes, stream));
  return true;
}

}  // namespace

// out (N,OC) = bias (OC) broadcast over the rows: the start the GEMM accumulates onto when
// cuBLASLt has no bias epilogue for the shape.
template <class T>
__global__ void bias_broadcast_kernel(T* out, const T* bias, size_t N, int OC) {
  const size_t total = N * OC;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    out[idx] = bias[idx % OC];
  }
}

template <class T>
void matmul_forward(CudaContext& ctx, T* out, const T* inp, const T* weight, const T* bias, int N,
                    int C, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  if (C <= 0) throw std::invalid_argument("matmul_forward: C must be positive");
  // out^T (OC,N) = weight (OC,C) · inp^T (C,N): weight is stored as column-major (C,OC) -> op T;
  // inp is stored as column-major (C,N) -> op N. The bias (OC) runs down out^T's columns.
  // cuBLASLt wants the bias vector 16-byte aligned; a bias elsewhere takes the fallback.
  const bool bias_epilogue = bias != nullptr && reinterpret_cast<uintptr_t>(bias) % 16 == 0;
  if (bias == nullptr || bias_epilogue) {
    if (lt_matmul(ctx, true, false, OC, N, C, weight, C, inp, C, 0.0f, out, OC, bias, stream))
      return;
  }
  // Bias first, then the GEMM adds onto it (beta = 1).
  const int block = 256;
  const size_t total = static_cast<size_t>(N) * OC;
  bias_broadcast_kernel<<<grid_for(total, block), block, 0, stream>>>(out, bias,
                                                                      static_cast<size_t>(N), OC);
  CUDA_CHECK_LAUNCH();
  lt_matmul<T>(ctx, true, false, OC, N, C, weight, C, inp, C, 1.0f, out, OC, nullptr, stream);
}

// dbias (OC) += column sums of dout (N,OC). A block is a tile of 32 columns (threadIdx.x) by 32
// row lanes (threadIdx.y): lane y sums rows y, y+32, y+64, ... of its column, then lane 0 adds the
// 32 partial sums in lane order to the old value and stores once. The order of additions is fixed
// (deterministic run to run) and each warp reads 32 consecutive columns of one row (coalesced).
template <class T>
__global__ void bias_backward_kernel(T* dbias, const T* dout, int N, int OC) {
  __shared__ float partial[kWarpSize][kWarpSize + 1];  // [lane y][column x]; +1: no bank conflicts
  const int o = blockIdx.x * kWarpSize + threadIdx.x;
  float acc = 0.0f;
  if (o < OC) {
    for (int n = threadIdx.y; n < N; n += kWarpSize) {
      acc += to_float(dout[static_cast<size_t>(n) * OC + o]);
    }
  }
  partial[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || o >= OC) return;
  float total = to_float(dbias[o]);
  for (int y = 0; y < kWarpSize; y++) {
    total += partial[y][threadIdx.x];
  }
  dbias[o] = from_float<T>(total);
}

template <class T>
void matmul_backward(CudaContext& ctx, T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     const T* weight, int N, int C, int OC, cudaStream_t stream,
                     bool accumulate_dinp) {
  if (N <= 0 || C <= 0 || OC <= 0) return;
  if (dinp != nullptr) {
    // dinp^T (C,N) += weight^T (C,OC) · dout^T (OC,N); both stored that way -> op N, op N. Beta 0
    // (written): dinp is not read.
    lt_matmul<T>(ctx, false, false, C, N, OC, weight, C, dout, OC, accumulate_dinp ? 1.0f : 0.0f,
                 dinp, C, nullptr, stream);
  }
  if (dweight != nullptr) {
    // dweight^T (C,OC) += inp^T (C,N) · dout (N,OC); inp stored (C,N) -> op N, dout stored
    // (OC,N) -> op T.
    lt_matmul<T>(ctx, false, true, C, OC, N, inp, C, dout, OC, 1.0f, dweight, C, nullptr, stream);
  }
  if (dbias != nullptr) {
    const dim3 block(kWarpSize, kWarpSize);
    bias_backward_kernel<<<static_cast<unsigned>(ceil_div(OC, kWarpSize)), block, 0, stream>>>(
        dbias, dout, N, OC);
    CUDA_CHECK_LAUNCH();
  }
}

#define HR_INSTANTIATE(T)                                                                        \
  template void matmul_forward<T>(CudaContext&, T*, const T*, const T*, const T*, int, int, int, \
                                  cudaStream_t);                                                 \
  template void matmul_backward<T>(CudaContext&, T*, T*, T*, const T*, const T*, const T*, int,  \
                                   int, int, cudaStream_t, bool);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
