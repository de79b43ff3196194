// adafactor's update of one tensor on the CPU backend (device memory is host memory), in three
// passes over it: the second moments' new values and sum(theta^2), then sum(u^2), then the
// update. Arithmetic in double, state stored as f32.
//
// The passes run on the OpenMP threads the host's kernels use ([device] threads) and their inner
// loops vectorize, yet any thread count gives the same bits: every sum is taken over fixed
// pieces (kLanes interleaved partial sums inside a row or a chunk, the rows of a kRowBlock, the
// row blocks), added in a fixed order, never split by thread. The dtypes are template
// parameters, so the inner loops have no dtype branch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/bf16.h"
#include "../common/cpu_clones.h"
#include "../common/x86_intrinsics.h"

namespace adafactor {

// One parameter and its state.
struct Tensor {
  void* theta = nullptr;       // numel f32 (masters) or bf16 (amp master_weights = false)
  const void* grad = nullptr;  // numel f32, or bf16 where amp accumulates bf16 gradients
  uint64_t numel = 0;
  uint64_t rows = 0, cols = 0;  // factored when rows > 0: (rows, cols) = (shape[0], the rest)
  float* row = nullptr;         // rows: the decayed row means of g^2 + eps1
  float* col = nullptr;         // cols: the decayed column means
  float* v = nullptr;           // numel: the full second moment (not factored)
  float* m = nullptr;           // numel: the first moment (beta1 given), else null
};

struct Hyper {
  double beta2 = 0.0;  // of this step
  double rel = 0.0;    // the step size before scale_parameter
  double eps1 = 1e-30, eps2 = 1e-3;
  double clip_threshold = 1.0;
  bool scale_parameter = true;
  double weight_decay = 0.0;  // 0 where the tensor has none
  double beta1 = 0.0;         // used where Tensor::m is set
  uint64_t round_key = 0;     // bf16 theta: the stochastic rounding's stream of this tensor
};

// The host memory the passes reuse between tensors.
struct Scratch {
  std::vector<double> col_part;    // (row blocks, cols): column sums of each row block
  std::vector<double> col_factor;  // cols: 1 / sqrt(col)
  std::vector<double> piece;       // a partial sum for each row, row block or chunk
};

constexpr uint64_t kLanes = 8;      // partial sums inside a row or chunk
constexpr uint64_t kRowBlock = 32;  // rows of one piece of the factored pass 1
constexpr uint64_t kChunk = 4096;   // elements of one piece of a vector's passes
// Under 2^14 elements a tensor's passes stay on the calling thread (as the host's element-wise
// kernels do, kernels/cpu/parallel.h): waking the threads for each of its passes costs more, the
// more so on a loaded machine (the biases and LayerNorms of a transformer).
constexpr uint64_t kParallelMin = uint64_t(1) << 14;

template <bool Bf16>
inline double load(const void* p, uint64_t k) {
  if constexpr (Bf16) {
    return double(headroom_plugin::bf16::load(static_cast<const uint16_t*>(p)[k]));
  } else {
    return double(static_cast<const float*>(p)[k]);
  }
}

template <bool Bf16>
inline void store(void* p, uint64_t k, double v, uint64_t key) {
  namespace bf = headroom_plugin::bf16;
  if constexpr (Bf16) {
    static_cast<uint16_t*>(p)[k] = bf::round_stochastic(float(v), bf::random16_at(key, k));
  } else {
    static_cast<float*>(p)[k] = float(v);
  }
}

// The kLanes partial sums, added in a fixed order.
inline double add_lanes(const double* acc) {
  double s = 0.0;
  for (uint64_t l = 0; l < kLanes; ++l)
    s += acc[l];
  return s;
}

// sum(f(j)) for j < n: kLanes interleaved partial sums, so the loop vectorizes without
// reassociating anything.
template <class F>
inline double lane_sum(uint64_t n, F f) {
  double acc[kLanes] = {};
  uint64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (uint64_t l = 0; l < kLanes; ++l)
      acc[l] += f(j + l);
  for (; j < n; ++j)
    acc[j % kLanes] += f(j);
  return add_lanes(acc);
}

// The pieces' partial sums, in order.
inline double sum_of(const std::vector<double>& piece, uint64_t n) {
  double s = 0.0;
  for (uint64_t i = 0; i < n; ++i)
    s += piece[i];
  return s;
}

// Pass 3 for one element: fold u into m (beta1), decay, subtract.
template <bool Theta16>
inline void apply(const Tensor& t, const Hyper& h, double decay, uint64_t k, double u) {
  if (t.m) {
    t.m[k] = float(h.beta1 * double(t.m[k]) + (1.0 - h.beta1) * u);
    u = double(t.m[k]);
  }
  const double th = load<Theta16>(t.theta, k);
  store<Theta16>(t.theta, k, th - decay * th - u, h.round_key);
}

// The step size of this tensor and the update's clip, from the pass sums.
struct Scale {
  double scale = 0.0;  // u is multiplied by it
  double decay = 0.0;  // theta -= decay * theta first
};
inline Scale scale_of(const Hyper& h, double theta_sq, double u_sq, uint64_t n) {
  const double rms_theta = std::sqrt(theta_sq / double(n));
  const double lr = h.scale_parameter ? std::max(h.eps2, rms_theta) * h.rel : h.rel;
  const double rms_u = std::sqrt(u_sq / double(n));
  return {lr / std::max(1.0, rms_u / h.clip_threshold), h.weight_decay * lr};
}

// The factored passes' inner loops on AVX-512 (8 doubles a vector, one for each of the kLanes
// partial sums), where the CPU has it: GCC does not vectorize the interleaved partial sums. The
// same operations in the same order as the scalar loops, so the same bits; each returns how far
// it went (a multiple of kLanes), the scalar loops doing the rest.
#if defined(__x86_64__) && defined(__GNUC__)
#define HR_ADAFACTOR_AVX512 1
#define HR_ADAFACTOR_AVX512_TARGET __attribute__((target("avx512f")))
static_assert(kLanes == 8, "one AVX-512 vector of doubles holds the kLanes partial sums");

inline bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// A row pass reads one or two streams with little arithmetic on them, and the hardware
// prefetcher alone left it well under the memory bandwidth AdamW's one pass reaches (on wte's
// 50257 x 768, one thread: the factored update 1.7 times AdamW's time without, 1.15 with): each
// loop also prefetches its streams kPrefetchBytes ahead, once every 16 elements. A prefetch never
// faults, past the end of an array included.
constexpr uint64_t kPrefetchBytes = 4096;
template <bool Bf16>
HR_ADAFACTOR_AVX512_TARGET inline void prefetch(const void* p, uint64_t k) {
  _mm_prefetch(static_cast<const char*>(p) + k * (Bf16 ? 2 : 4) + kPrefetchBytes, _MM_HINT_T0);
}

// Elements k .. k + 7 widened to double.
template <bool Bf16>
HR_ADAFACTOR_AVX512_TARGET inline __m512d load8(const void* p, uint64_t k) {
  if constexpr (Bf16) {
    const __m256i w = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + k)));
    return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  } else {
    return _mm512_cvtps_pd(_mm256_loadu_ps(static_cast<const float*>(p) + k));
  }
}

// Pass 1 over the row at base: racc += g^2 + eps1, cs[j] += it, tacc += theta^2.
template <bool Theta16, bool Grad16>
HR_ADAFACTOR_AVX512_TARGET uint64_t pass1_row_avx512(const Tensor& t, uint64_t base, uint64_t C,
                                                     double eps1, double* cs, double* racc,
                                                     double* tacc) {
  const __m512d e = _mm512_set1_pd(eps1);
  __m512d r = _mm512_loadu_pd(racc), th2 = _mm512_loadu_pd(tacc);
  uint64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    if (j % 16 == 0) {
      prefetch<Grad16>(t.grad, base + j);
      prefetch<Theta16>(t.theta, base + j);
    }
    const __m512d g = load8<Grad16>(t.grad, base + j), th = load8<Theta16>(t.theta, base + j);
    const __m512d q = _mm512_add_pd(_mm512_mul_pd(g, g), e);
    r = _mm512_add_pd(r, q);
    _mm512_storeu_pd(cs + j, _mm512_add_pd(_mm512_loadu_pd(cs + j), q));
    th2 = _mm512_add_pd(th2, _mm512_mul_pd(th, th));
  }
  _mm512_storeu_pd(racc, r);
  _mm512_storeu_pd(tacc, th2);
  return j;
}

// Pass 2 over the row at base: acc += u^2, u = g rf cf[j].
template <bool Grad16>
HR_ADAFACTOR_AVX512_TARGET uint64_t pass2_row_avx512(const Tensor& t, uint64_t base, uint64_t C,
                                                     double rf, const double* cf, double* acc) {
  const __m512d f = _mm512_set1_pd(rf);
  __m512d a = _mm512_loadu_pd(acc);
  uint64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    if (j % 16 == 0) prefetch<Grad16>(t.grad, base + j);
    const __m512d u =
        _mm512_mul_pd(_mm512_mul_pd(load8<Grad16>(t.grad, base + j), f), _mm512_loadu_pd(cf + j));
    a = _mm512_add_pd(a, _mm512_mul_pd(u, u));
  }
  _mm512_storeu_pd(acc, a);
  return j;
}

// Pass 3 over the row at base, f32 theta and no first moment: theta - decay theta - u.
template <bool Grad16>
HR_ADAFACTOR_AVX512_TARGET uint64_t pass3_row_avx512(const Tensor& t, uint64_t base, uint64_t C,
                                                     double rf, const double* cf, double decay) {
  const __m512d f = _mm512_set1_pd(rf), d = _mm512_set1_pd(decay);
  float* theta = static_cast<float*>(t.theta) + base;
  uint64_t j = 0;
  for (; j + kLanes <= C; j += kLanes) {
    if (j % 16 == 0) {
      prefetch<Grad16>(t.grad, base + j);
      prefetch<false>(theta, j);
    }
    const __m512d u =
        _mm512_mul_pd(_mm512_mul_pd(load8<Grad16>(t.grad, base + j), f), _mm512_loadu_pd(cf + j));
    const __m512d th = _mm512_cvtps_pd(_mm256_loadu_ps(theta + j));
    _mm256_storeu_ps(theta + j,
                     _mm512_cvtpd_ps(_mm512_sub_pd(_mm512_sub_pd(th, _mm512_mul_pd(d, th)), u)));
  }
  return j;
}
#endif

// A matrix (rows, cols): row and column means of g^2 + eps1, the second moment estimated as
// row_i col_j / mean(row).
template <bool Theta16, bool Grad16>
HR_PLUGIN_CPU_CLONES void update_factored(const Tensor& t, const Hyper& h, Scratch& s) {
  const uint64_t R = t.rows, C = t.cols;
  const int64_t blocks = int64_t((R + kRowBlock - 1) / kRowBlock);
  const double keep = h.beta2, take = 1.0 - h.beta2, eps1 = h.eps1;
#ifdef HR_ADAFACTOR_AVX512
  const bool avx512 = have_avx512();
#endif
  s.col_part.assign(uint64_t(blocks) * C, 0.0);
  s.piece.assign(std::max<uint64_t>(R, uint64_t(blocks)), 0.0);
  std::vector<double> theta_part(uint64_t(blocks), 0.0);
  // Pass 1, by row blocks: each row's sum, the block's column sums, the block's sum(theta^2).
#pragma omp parallel for schedule(static) if (t.numel >= kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) {
    double* cs = s.col_part.data() + uint64_t(b) * C;  // (C,)
    double theta_sq = 0.0;
    const uint64_t end = std::min(R, uint64_t(b + 1) * kRowBlock);
    for (uint64_t i = uint64_t(b) * kRowBlock; i < end; ++i) {
      const uint64_t base = i * C;
      // One read of the row: its sum and sum(theta^2) in kLanes partial sums each (as
      // lane_sum takes them), the block's column sums.
      double racc[kLanes] = {}, tacc[kLanes] = {};
      auto element = [&](uint64_t j, uint64_t lane) {
        const double g = load<Grad16>(t.grad, base + j), th = load<Theta16>(t.theta, base + j);
        const double q = g * g + eps1;
        racc[lane] += q;
        cs[j] += q;
        tacc[lane] += th * th;
      };
      uint64_t j = 0;
#ifdef HR_ADAFACTOR_AVX512
      if (avx512) j = pass1_row_avx512<Theta16, Grad16>(t, base, C, eps1, cs, racc, tacc);
#endif
      for (; j + kLanes <= C; j += kLanes)
        for (uint64_t l = 0; l < kLanes; ++l)
          element(j + l, l);
      for (; j < C; ++j)
        element(j, j % kLanes);
      const double rs = add_lanes(racc);
      theta_sq += add_lanes(tacc);
      t.row[i] = float(keep * double(t.row[i]) + take * (rs / double(C)));
    }
    theta_part[uint64_t(b)] = theta_sq;
  }
  double row_sum = 0.0;
  for (uint64_t i = 0; i < R; ++i)
    row_sum += double(t.row[i]);
  const double row_mean = row_sum / double(R);
  // Each column's sum over the row blocks in order, the blocks' rows read in turn.
  s.col_factor.assign(C, 0.0);
  double* col_sum = s.col_factor.data();
  for (int64_t b = 0; b < blocks; ++b) {
    const double* part = s.col_part.data() + uint64_t(b) * C;
    for (uint64_t j = 0; j < C; ++j)
      col_sum[j] += part[j];
  }
  for (uint64_t j = 0; j < C; ++j) {
    t.col[j] = float(keep * double(t.col[j]) + take * (col_sum[j] / double(R)));
    s.col_factor[j] = 1.0 / std::sqrt(double(t.col[j]));
  }
  const double* cf = s.col_factor.data();
  // Pass 2, by rows: sum(u^2).
#pragma omp parallel for schedule(static) if (t.numel >= kParallelMin)
  for (int64_t i = 0; i < int64_t(R); ++i) {
    const uint64_t base = uint64_t(i) * C;
    const double rf = 1.0 / std::sqrt(double(t.row[i]) / row_mean);
    auto u_sq = [&](uint64_t j) {
      const double u = load<Grad16>(t.grad, base + j) * rf * cf[j];
      return u * u;
    };
#ifdef HR_ADAFACTOR_AVX512
    if (avx512) {  // lane_sum's partial sums, the vector part first
      double acc[kLanes] = {};
      uint64_t j = pass2_row_avx512<Grad16>(t, base, C, rf, cf, acc);
      for (; j < C; ++j)
        acc[j % kLanes] += u_sq(j);
      s.piece[uint64_t(i)] = add_lanes(acc);
      continue;
    }
#endif
    s.piece[uint64_t(i)] = lane_sum(C, u_sq);
  }
  const Scale sc = scale_of(h, sum_of(theta_part, uint64_t(blocks)), sum_of(s.piece, R), t.numel);
  // Pass 3, by rows: the update.
#pragma omp parallel for schedule(static) if (t.numel >= kParallelMin)
  for (int64_t i = 0; i < int64_t(R); ++i) {
    const uint64_t base = uint64_t(i) * C;
    const double rf = sc.scale / std::sqrt(double(t.row[i]) / row_mean);
    uint64_t j = 0;
#ifdef HR_ADAFACTOR_AVX512
    if constexpr (!Theta16) {
      if (avx512 && !t.m) j = pass3_row_avx512<Grad16>(t, base, C, rf, cf, sc.decay);
    }
#endif
    for (; j < C; ++j)
      apply<Theta16>(t, h, sc.decay, base + j, load<Grad16>(t.grad, base + j) * rf * cf[j]);
  }
}

// A vector: the full second moment v, u = g / sqrt(v). By chunks of kChunk elements.
template <bool Theta16, bool Grad16>
HR_PLUGIN_CPU_CLONES void update_vector(const Tensor& t, const Hyper& h, Scratch& s) {
  const uint64_t n = t.numel;
  const int64_t chunks = int64_t((n + kChunk - 1) / kChunk);
  const double keep = h.beta2, take = 1.0 - h.beta2, eps1 = h.eps1;
  s.piece.assign(2 * uint64_t(chunks), 0.0);  // [sum(u^2) | sum(theta^2)] of each chunk
  double* u_part = s.piece.data();
  double* theta_part = u_part + chunks;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    const uint64_t lo = uint64_t(c) * kChunk, len = std::min(kChunk, n - lo);
    for (uint64_t j = 0; j < len; ++j) {
      const double g = load<Grad16>(t.grad, lo + j);
      t.v[lo + j] = float(keep * double(t.v[lo + j]) + take * (g * g + eps1));
    }
    u_part[c] = lane_sum(len, [&](uint64_t j) {
      const double u = load<Grad16>(t.grad, lo + j) / std::sqrt(double(t.v[lo + j]));
      return u * u;
    });
    theta_part[c] = lane_sum(len, [&](uint64_t j) {
      const double th = load<Theta16>(t.theta, lo + j);
      return th * th;
    });
  }
  double u_sq = 0.0, theta_sq = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    u_sq += u_part[c];
    theta_sq += theta_part[c];
  }
  const Scale sc = scale_of(h, theta_sq, u_sq, n);
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t k = 0; k < int64_t(n); ++k)
    apply<Theta16>(t, h, sc.decay, uint64_t(k),
                   sc.scale * load<Grad16>(t.grad, uint64_t(k)) / std::sqrt(double(t.v[k])));
}

template <bool Theta16, bool Grad16>
inline void update_typed(const Tensor& t, const Hyper& h, Scratch& s) {
  if (t.rows) {
    update_factored<Theta16, Grad16>(t, h, s);
  } else {
    update_vector<Theta16, Grad16>(t, h, s);
  }
}

// One tensor's update; theta16 / grad16: bf16 storage (else f32).
inline void update(const Tensor& t, const Hyper& h, bool theta16, bool grad16, Scratch& s) {
  if (t.numel == 0) return;
  if (theta16) {
    grad16 ? update_typed<true, true>(t, h, s) : update_typed<true, false>(t, h, s);
  } else {
    grad16 ? update_typed<false, true>(t, h, s) : update_typed<false, false>(t, h, s);
  }
}

}  // namespace adafactor
