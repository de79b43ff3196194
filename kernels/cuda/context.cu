// CudaContext: the cuBLAS / cuBLASLt handles and the cuBLASLt workspace, created once.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

CudaContext::CudaContext(size_t bytes) : workspace_bytes(bytes) {
  try {
    CUBLAS_CHECK(cublasLtCreate(&lt));
    CUBLAS_CHECK(cublasCreate(&blas));
    // fp32 stays fp32: no TF32 tensor-op shortcuts, so the GPU matches the CPU backend.
    CUBLAS_CHECK(cublasSetMathMode(blas, CUBLAS_PEDANTIC_MATH));
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
