// The one place the CPU backend calls a GEMM library. Every matmul-shaped kernel (matmul,
// attention) goes through here, so GEMM dominates step time and the rest of the kernels stay
// simple loops.
//
// The library is chosen at build time (CMake's HEADROOM_CPU_GEMM; docs/results/cpu.md has the
// measurements behind the default):
//   ONEDNN   (default) dnnl_sgemm: JIT-compiled for the ISA oneDNN finds at run time, threads
//            from the OpenMP runtime the element-wise kernels share;
//   BLIS     bli_sgemm: a sub-configuration picked from the CPU's features at start-up;
//   OPENBLAS cblas_sgemm: Debian's 0.3.21 picks its SSE3 "Prescott" kernels on CPUs newer than
//            it knows (a Sapphire Rapids Xeon among them) unless OPENBLAS_CORETYPE is set.
// Double precision (gradient checks only) goes to BLIS with BLIS and to OpenBLAS otherwise:
// oneDNN has no dgemm.
#pragma once

#include <string>

#if defined(HEADROOM_GEMM_ONEDNN)
#include <dnnl.h>

#include <stdexcept>
#endif
#if defined(HEADROOM_GEMM_BLIS)
#include <blis.h>
#else
#include <cblas.h>
#endif

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/profile.h"

namespace headroom::cpu {

// Row-major C (M,N) = alpha * op(A) (M,K) · op(B) (K,N) + beta * C, op(X) = X or X^T.
// lda/ldb/ldc are the row strides of the matrices as stored: A is stored (M,K) when !trans_a and
// (K,M) when trans_a, likewise B is (K,N) or (N,K). Strides larger than the width let a kernel
// address a column slice in place (a head inside qkv: lda = 3C) without copying.
// beta = 0 ignores C's contents on entry; beta = 1 accumulates (how backward kernels do +=).
inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A,
                 int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  // One branch unless benchmarks turn profiling on.
  GemmTimer timer({trans_a, trans_b, M, N, K, lda, ldb, ldc, beta != 0.0f}, !in_parallel());
#if defined(HEADROOM_GEMM_ONEDNN)
  // oneDNN runs on the calling thread's OpenMP team (single-threaded inside a parallel region).
  if (!in_parallel() && max_threads() != threads()) omp_set_num_threads(threads());
  if (dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C,
                 ldc) != dnnl_success)
    throw std::runtime_error("dnnl_sgemm failed (M " + std::to_string(M) + ", N " +
                             std::to_string(N) + ", K " + std::to_string(K) + ")");
#elif defined(HEADROOM_GEMM_BLIS)
  static int blis_threads = 0;
  if (!in_parallel() && blis_threads != threads())
    bli_thread_set_num_threads(blis_threads = threads());
  // Row-major: row stride ld, column stride 1. BLIS takes its operands non-const.
  bli_sgemm(trans_a ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
            trans_b ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, M, N, K, &alpha, const_cast<float*>(A),
            lda, 1, const_cast<float*>(B), ldb, 1, &beta, C, ldc, 1);
#else
  static int openblas_threads = 0;
  if (!in_parallel() && openblas_threads != threads())
    openblas_set_num_threads(openblas_threads = threads());
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

// Same in double, for gradient checks.
inline void gemm(bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A,
                 int lda, const double* B, int ldb, double beta, double* C, int ldc) {
  GemmTimer timer({trans_a, trans_b, M, N, K, lda, ldb, ldc, beta != 0.0}, !in_parallel());
#if defined(HEADROOM_GEMM_BLIS)
  bli_dgemm(trans_a ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
            trans_b ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, M, N, K, &alpha, const_cast<double*>(A),
            lda, 1, const_cast<double*>(B), ldb, 1, &beta, C, ldc, 1);
#else
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#endif
}

// Whether a GEMM may be called from inside an OpenMP parallel region (attention's per-head
// GEMMs): oneDNN and BLIS then run on the calling thread alone; OpenBLAS's own pthreads would
// contend with the region's.
#if defined(HEADROOM_GEMM_ONEDNN) || defined(HEADROOM_GEMM_BLIS)
constexpr bool kGemmInParallel = true;
#else
constexpr bool kGemmInParallel = false;
#endif

// Which library and kernel the fp32 GEMMs run, for `headroom train -v` and the metrics' header:
// "oneDNN 2.6.3 (dnnl_sgemm, ISA avx512_core_bf16)".
inline std::string gemm_library() {
#if defined(HEADROOM_GEMM_ONEDNN)
  const dnnl_version_t* v = dnnl_version();
  const char* isa = "?";
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_all:
      isa = "all";
      break;
    case dnnl_cpu_isa_sse41:
      isa = "sse41";
      break;
    case dnnl_cpu_isa_avx:
      isa = "avx";
      break;
    case dnnl_cpu_isa_avx2:
      isa = "avx2";
      break;
    case dnnl_cpu_isa_avx2_vnni:
      isa = "avx2_vnni";
      break;
    case dnnl_cpu_isa_avx512_mic:
      isa = "avx512_mic";
      break;
    case dnnl_cpu_isa_avx512_mic_4ops:
      isa = "avx512_mic_4ops";
      break;
    case dnnl_cpu_isa_avx512_core:
      isa = "avx512_core";
      break;
    case dnnl_cpu_isa_avx512_core_vnni:
      isa = "avx512_core_vnni";
      break;
    case dnnl_cpu_isa_avx512_core_bf16:
      isa = "avx512_core_bf16";
      break;
    case dnnl_cpu_isa_avx512_core_amx:
      isa = "avx512_core_amx";
      break;
  }
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch) + " (dnnl_sgemm, ISA " + isa + ")";
#elif defined(HEADROOM_GEMM_BLIS)
  return std::string("BLIS ") + bli_info_get_version_str() + " (bli_sgemm, sub-configuration " +
         bli_arch_string(bli_arch_query_id()) + ")";
#else
  return std::string("OpenBLAS (cblas_sgemm, core ") + openblas_get_corename() + ")";
#endif
}

}  // namespace headroom::cpu
