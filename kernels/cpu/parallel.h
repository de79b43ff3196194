// The CPU kernels' threads: OpenMP (GCC's libgomp), the runtime oneDNN and BLIS run their GEMMs
// on too, so element-wise loops and GEMMs share one pool and never oversubscribe the cores.
//
// Determinism: every parallel loop is split statically (schedule(static)) into ranges whose
// results do not depend on which thread computes them. Element-wise and row-wise kernels give each
// element or row to one thread, which computes it exactly as the serial loop did; sums over rows
// (bias and LayerNorm weight gradients, the embedding's scatter) are split over columns, each
// column summed over its rows in order. So the element-wise kernels' results are bitwise the same
// for any thread count; only a GEMM library's own blocking may depend on it.
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <cstddef>
#include <cstring>

namespace headroom::cpu {

// OpenMP's queries, and what they are in a build without it (one thread; the pragmas are then
// ignored): the fuzz targets compile the CPU backend without -fopenmp.
#if defined(_OPENMP)
inline int max_threads() {
  return omp_get_max_threads();
}
inline bool in_parallel() {
  return omp_in_parallel() != 0;
}
inline int thread_num() {
  return omp_get_thread_num();
}
#else
inline int max_threads() {
  return 1;
}
inline bool in_parallel() {
  return false;
}
inline int thread_num() {
  return 0;
}
#endif

// 0 until set: OpenMP's default then, OMP_NUM_THREADS or the cores available.
inline int& threads_setting() {
  static int n = 0;
  return n;
}

// The threads the kernels and the GEMM library use.
inline int threads() {
  const int n = threads_setting();
  return n > 0 ? n : max_threads();
}

inline void set_threads(int n) {
  threads_setting() = n;
}

// The widest vector ISA the processor has, from one source: GCC's function multiversioning
// compiles the element-wise kernels for x86-64-v4 (AVX-512), v3 (AVX2, FMA) and the baseline,
// and the loader picks one at start-up. With -ffp-contract=off (kernels/CMakeLists.txt) no clone
// fuses a multiply and an add the baseline rounds twice, and no loop is reordered (no
// -ffast-math), so every clone computes bitwise the same results. Elsewhere (other compilers,
// the sanitizer builds, where ifuncs and instrumentation mix badly: an instrumented ifunc
// resolver runs before ThreadSanitizer is initialised and crashes the loader) the baseline alone.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define HEADROOM_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HEADROOM_CPU_CLONES
#endif

// Below this many elements of work a loop stays on the calling thread: waking the pool costs
// more than a few microseconds of arithmetic.
constexpr size_t kParallelMin = size_t(1) << 14;

// Threads for a loop over `work` elements: 1 when small, else threads().
inline int threads_for(size_t work) {
  return work < kParallelMin ? 1 : threads();
}

// memset(x, 0, bytes) on the threads: one thread's stores reach about half the memory bandwidth
// of two (a gradient buffer of gpt2-350m, 1.4 GB, takes 115 ms on one and 62 ms on two).
inline void zero_bytes(void* x, size_t bytes) {
  const size_t kChunk = size_t(1) << 20;  // 1 MiB a task: whole pages, and enough of them
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  char* p = static_cast<char*>(x);
#pragma omp parallel for schedule(static) num_threads(chunks > 1 ? threads() : 1)
  for (size_t c = 0; c < chunks; c++) {
    const size_t begin = c * kChunk;
    std::memset(p + begin, 0, (bytes - begin < kChunk ? bytes - begin : kChunk));
  }
}

}  // namespace headroom::cpu
