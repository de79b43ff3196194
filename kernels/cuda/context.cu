// CudaContext: the cuBLAS / cuBLASLt handles and the cuBLASLt workspace, created once.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

CudaContext::CudaContext(size_t bytes) : workspace_bytes(bytes) {
  try {
    CUBLAS_CHECK(cublasLtCreate(&lt));
    CUBLAS_CHECK(cublasCreate(&blas));
    // The default math mode: tensor cores where they keep at least the requested precision, so
    // bf16 / f16 GEMMs (fp32 accumulation) use them, while fp32 GEMMs (CUBLAS_COMPUTE_32F) stay
    // true fp32 — no TF32 — and match the CPU backend. (PEDANTIC would keep 16-bit GEMMs off the
    // tensor cores too.) The environment variable NVIDIA_TF32_OVERRIDE=1 would force TF32: leave
    // it unset.
    CUBLAS_CHECK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH));
    if (workspace_bytes > 0) CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  } catch (...) {
    release();
    throw;
  }
}

CudaContext::~CudaContext() {
  release();
}

// Must not throw (destructor): errors on teardown are ignored, the handles go away regardless.
void CudaContext::release() noexcept {
  if (workspace != nullptr) (void)cudaFree(workspace);
  if (blas != nullptr) (void)cublasDestroy(blas);
  if (lt != nullptr) (void)cublasLtDestroy(lt);
  workspace = nullptr;
  blas = nullptr;
  lt = nullptr;
}

}  // namespace headroom::cuda
