// The one place the CPU backend calls BLAS. Every matmul-shaped kernel (matmul, attention) goes
// through here, so GEMM dominates step time and the rest of the kernels stay simple loops.
#pragma once

#include <cblas.h>

#include "kernels/cpu/profile.h"

namespace headroom::cpu {

// Row-major C (M,N) = alpha * op(A) (M,K) · op(B) (K,N) + beta * C, op(X) = X or X^T.
// lda/ldb/ldc are the row strides of the matrices as stored: A is stored (M,K) when !trans_a and
// (K,M) when trans_a, likewise B is (K,N) or (N,K). Strides larger than the width let a kernel
// address a column slice in place (a head inside qkv: lda = 3C) without copying.
// beta = 0 ignores C's contents on entry; beta = 1 accumulates (how backward kernels do +=).
inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  GemmTimer timer(M, N, K);  // one branch unless benchmarks turn profiling on
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Same in double, for gradient checks.
inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A,
                 int lda, const double* B, int ldb, double beta, double* C, int ldc) {
  GemmTimer timer(M, N, K);
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace headroom::cpu
