// 16-bit GEMMs on the CPU (issue 36, item 1): bf16 (or f16) operands multiplied by oneDNN's
// matmul primitive with f32 accumulation, the output rounded to the 16-bit dtype (or kept in f32)
// once, as the widened path rounds it. Where the CPU multiplies bf16 (AMX, AVX-512 BF16) oneDNN
// runs its brgemm kernels on the 16-bit data directly, with no widened copies.
//
// Each shape's primitive is created once and kept (a small map keyed by shape, strides, dtypes,
// bias and accumulation). A primitive that oneDNN can only offer as its reference implementation
// (a CPU without bf16 arithmetic or AVX-512, or f16 on oneDNN 2.6) is not used: gemm_lowp()
// returns false and the caller takes the widened path (f32 copies, the f32 GEMM of gemm.h),
// bitwise what the CPU backend computed before. HEADROOM_CPU_BF16_GEMM=0 in the environment
// turns the path off altogether (for comparisons); without oneDNN (HEADROOM_CPU_GEMM=BLIS or
// OPENBLAS) it does not exist.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(HEADROOM_GEMM_ONEDNN)
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include <dnnl.hpp>
#endif

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/profile.h"

namespace headroom::cpu {

enum class Lowp { kBF16, kF16 };

// Whether HEADROOM_CPU_BF16_GEMM leaves the path on (unset, or anything but "0").
inline bool lowp_gemm_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("HEADROOM_CPU_BF16_GEMM");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

#if defined(HEADROOM_GEMM_ONEDNN)

namespace lowp_detail {

struct Key {
  Lowp dt;
  bool trans_a, trans_b;
  int M, N, K, lda, ldb, ldc;
  bool bias, accumulate, c_f32;
  int threads;  // oneDNN sizes a primitive's work split for the threads it was created under
  auto tie() const {
    return std::tie(dt, trans_a, trans_b, M, N, K, lda, ldb, ldc, bias, accumulate, c_f32, threads);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Entry {
  bool usable = false;
  std::string impl;  // oneDNN's implementation name ("brg:avx512_core_amx"), or why not
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c, bias;  // the primitive's operands
};

inline dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

inline dnnl::memory::data_type dnnl_dt(Lowp dt) {
  return dt == Lowp::kBF16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f16;
}

// A primitive whose implementation is oneDNN's reference loop is slower than widening.
inline bool fast_impl(const std::string& impl) {
  return impl.rfind("ref", 0) != 0;
}

inline std::shared_ptr<Entry> make_entry(const Key& k) {
  using dims = dnnl::memory::dims;
  using md = dnnl::memory::desc;
  auto e = std::make_shared<Entry>();
  const auto t = dnnl_dt(k.dt);
  // Row-major strides: op(A) (M,K) is A (M,K) with row stride lda, or A^T of a stored (K,M).
  const md a({k.M, k.K}, t, k.trans_a ? dims{1, k.lda} : dims{k.lda, 1});
  const md b({k.K, k.N}, t, k.trans_b ? dims{1, k.ldb} : dims{k.ldb, 1});
  const md c({k.M, k.N}, k.c_f32 ? dnnl::memory::data_type::f32 : t, dims{k.ldc, 1});
  const md bias({1, k.N}, t, dims{k.N, 1});
  try {
    dnnl::primitive_attr attr;
    if (k.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    const dnnl::matmul::desc d =
        k.bias ? dnnl::matmul::desc(a, b, bias, c) : dnnl::matmul::desc(a, b, c);
    const dnnl::matmul::primitive_desc pd(d, attr, engine());
    e->impl = pd.impl_info_str();
    e->usable = fast_impl(e->impl);
    if (e->usable) {
      e->prim = dnnl::matmul(pd);
      e->a = a, e->b = b, e->c = c, e->bias = bias;
    }
  } catch (const dnnl::error& err) {
    e->impl = std::string("none (") + err.what() + ")";
    e->usable = false;
  }
  return e;
}

inline std::shared_ptr<Entry> entry(const Key& k) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<Entry>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it == cache.end()) it = cache.emplace(k, make_entry(k)).first;
  return it->second;
}

}  // namespace lowp_detail

// Row-major C (M,N) = op(A) (M,K) · op(B) (K,N) [+ bias (N)] [+ C when accumulate], A, B and
// bias of dtype dt, C of dt (or f32 when c_f32); strides as gemm() takes them. Accumulates in
// f32 and rounds C once. Returns false, having done nothing, where the path is off or oneDNN has
// no fast implementation for this shape and dtype.
inline bool gemm_lowp(Lowp dt, bool trans_a, bool trans_b, int M, int N, int K, const uint16_t* A,
                      int lda, const uint16_t* B, int ldb, const uint16_t* bias, bool accumulate,
                      void* C, int ldc, bool c_f32 = false) {
  if (!lowp_gemm_enabled()) return false;
  // oneDNN runs on the calling thread's OpenMP team, as dnnl_sgemm does (gemm.h).
  if (!in_parallel() && max_threads() != threads()) omp_set_num_threads(threads());
  const lowp_detail::Key key{dt,         trans_a, trans_b,      M,   N,
                             K,          lda,     ldb,          ldc, bias != nullptr,
                             accumulate, c_f32,   max_threads()};
  const std::shared_ptr<lowp_detail::Entry> e = lowp_detail::entry(key);
  if (!e->usable) return false;
  GemmTimer timer({trans_a, trans_b, M, N, K, lda, ldb, ldc, accumulate, true}, !in_parallel());
  dnnl::engine& eng = lowp_detail::engine();
  dnnl::memory a(e->a, eng, const_cast<uint16_t*>(A));
  dnnl::memory b(e->b, eng, const_cast<uint16_t*>(B));
  dnnl::memory c(e->c, eng, C);
  dnnl::stream s(eng);
  if (bias) {
    dnnl::memory m(e->bias, eng, const_cast<uint16_t*>(bias));
    e->prim.execute(
        s, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_BIAS, m}, {DNNL_ARG_DST, c}});
  } else {
    e->prim.execute(s, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  }
  s.wait();
  return true;
}

// What a linear layer's forward GEMM of dt runs here, for `headroom train -v`: oneDNN's
// implementation name (its ISA), or why the widened f32 path is taken.
inline std::string lowp_gemm_library(Lowp dt) {
  const char* name = dt == Lowp::kBF16 ? "bf16" : "f16";
  if (!lowp_gemm_enabled())
    return std::string(name) + " GEMMs widened to f32 (HEADROOM_CPU_BF16_GEMM=0)";
  const std::shared_ptr<lowp_detail::Entry> e = lowp_detail::entry(
      {dt, false, true, 256, 256, 256, 256, 256, 256, false, false, false, max_threads()});
  if (e->usable) return std::string(name) + " GEMMs by oneDNN matmul (" + e->impl + ")";
  return std::string(name) + " GEMMs widened to f32 (oneDNN offers " + e->impl + ")";
}

#else

inline bool gemm_lowp(Lowp, bool, bool, int, int, int, const uint16_t*, int, const uint16_t*, int,
                      const uint16_t*, bool, void*, int, bool = false) {
  return false;
}
inline std::string lowp_gemm_library(Lowp dt) {
  return std::string(dt == Lowp::kBF16 ? "bf16" : "f16") + " GEMMs widened to f32";
}

#endif

}  // namespace headroom::cpu
