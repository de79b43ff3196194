// Element-wise math shared by the CPU and CUDA backends. One source, so the CPU tests also pin down
// what the GPU computes. Everything here is a header-only HR_HD inline function of one element.
#pragma once

#include <math.h>    // exp, copysignf, sqrtf: C names, on the host and in CUDA device code
#include <stdint.h>  // int32_t, uint32_t

#include "kernels/common/dtype.h"  // HR_HD, float_bits / bits_float

// Inlined wherever it is called, even where GCC's size heuristics would stop: backend_cpu.cpp
// calls these from dozens of kernels, each in three target clones, and a call GCC leaves out of
// line (through the PLT, -fPIC) makes the loop around it scalar — the GELU kernels ran so, about
// ten times slower than vectorized, and the stored-state optimizer updates (amp's bf16 state).
#if defined(__CUDACC__)
#define HR_INLINE __forceinline__
#elif defined(__GNUC__)
#define HR_INLINE inline __attribute__((always_inline))
#else
#define HR_INLINE inline
#endif

namespace headroom {

// exp(-|x|) in float, from arithmetic and integer bit operations only: no libm call and no
// floating-point select, so that host loops over it vectorize under GCC's default flags (a
// select between floats, such as a clamp, becomes a branch that -ftrapping-math keeps from being
// if-converted; glibc's expf and tanhf are scalar calls). With them, softmax, cross-entropy and
// GELU cost a fraction of what they did next to the GEMMs.
// The callers only need exp of non-positive numbers (x - rowmax; -2|u| in GELU), and exp(-|x|)
// is defined, finite and in (0, 1] for every input, which keeps this free of range checks.
// Cephes' expf: -|x| = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-7 polynomial, 2^n built in
// the exponent bits. Relative error within 2 ulp down to exp(-87.33) = FLT_MIN; beyond that the
// result stays FLT_MIN ~ 1.2e-38 (no subnormals, never 0). NaN gives NaN.
HR_HD HR_INLINE float exp_minus_abs(float x) {
  const uint32_t mag =
      float_bits(x) & 0x7FFFFFFFu;       // bits of |x|: ordered like |x| for non-NaN values
  const uint32_t kMaxMag = 0x42AEAC50u;  // 87.3365448 = -ln(FLT_MIN): 2^n stays normal
  const uint32_t clamped = mag < kMaxMag ? mag : kMaxMag;
  const uint32_t kInf = 0x7F800000u;
  const uint32_t neg_bits = (mag > kInf ? mag : clamped) | 0x80000000u;  // NaN passes through
  const float xn = bits_float(neg_bits);                                 // -min(|x|, 87.34), or NaN
  // n = round(xn / ln2) in [-126, 0]: adding 1.5 * 2^23 rounds to an integer held in the low
  // mantissa bits (round to nearest even; no float -> int conversion, no subtraction a fast-math
  // build could cancel).
  const float shifted = xn * 1.44269504088896341f + 12582912.0f;
  const int32_t n = static_cast<int32_t>(float_bits(shifted) - 0x4B400000u);
  const float nf = static_cast<float>(n);
  // r = xn - n ln2, with ln2 split in two so that n * hi is exact (Cody-Waite).
  const float r = (xn - nf * 0.693359375f) - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
  const float two_n = bits_float(static_cast<uint32_t>(n + 127) << 23);  // 2^n
  return er * two_n;
}

namespace detail {
// float goes through exp_minus_abs (vectorizable, the same on host and device); double, used for
// the gradient checks, through libm at full precision.
HR_HD HR_INLINE float hr_exp_minus_abs(float x) {
  return exp_minus_abs(x);
}
HR_HD HR_INLINE double hr_exp_minus_abs(double x) {
  return exp(-fabs(x));
}
HR_HD HR_INLINE float hr_copysign(float x, float s) {
  return copysignf(x, s);
}
HR_HD HR_INLINE double hr_copysign(double x, double s) {
  return copysign(x, s);
}
HR_HD inline float hr_sqrt(float x) {
  return sqrtf(x);
}
HR_HD inline double hr_sqrt(double x) {
  return sqrt(x);
}
}  // namespace detail

// GELU, GPT-2's tanh approximation: 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3).
// tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) in (0, 1]: one exp, nothing overflows
// for any x, and no select, so the loop vectorizes (see exp_minus_abs).
template <class T>
HR_HD HR_INLINE T gelu_tanh(T x) {
  const T kSqrt2OverPi = T(0.79788456080286535588);  // sqrt(2/pi)
  const T kCoeff = T(0.044715);
  const T u = kSqrt2OverPi * (x + kCoeff * x * x * x);
  const T e = detail::hr_exp_minus_abs(T(2) * u);
  const T th = detail::hr_copysign((T(1) - e) / (T(1) + e), u);  // tanh(u)
  return T(0.5) * x * (T(1) + th);
}

// Online softmax (Milakov & Gimelshein 2018), as tiled attention folds in one tile of scores at
// a time: what a row has summed as exp(x - m_old) times this factor is the same sum relative to
// the new running max m_new >= m_old.
template <class T>
HR_HD HR_INLINE T online_softmax_rescale(T m_old, T m_new) {
  return detail::hr_exp_minus_abs(m_old - m_new);
}

// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx,  du/dx = sqrt(2/pi) (1 + 3c x^2),
// with 1 - tanh^2 u = 4e / (1 + e)^2 formed directly rather than by cancellation.
template <class T>
HR_HD HR_INLINE T gelu_tanh_grad(T x) {
  const T kSqrt2OverPi = T(0.79788456080286535588);
  const T kCoeff = T(0.044715);
  const T x2 = x * x;
  const T u = kSqrt2OverPi * (x + kCoeff * x2 * x);
  const T e = detail::hr_exp_minus_abs(T(2) * u);
  const T inv = T(1) / (T(1) + e);
  const T th = detail::hr_copysign((T(1) - e) * inv, u);
  const T du = kSqrt2OverPi * (T(1) + T(3) * kCoeff * x2);
  return T(0.5) * (T(1) + th) + T(2) * x * e * inv * inv * du;
}

// One AdamW step for one parameter, torch.optim.AdamW semantics (decoupled weight decay, applied
// to the parameter before this step). Updates the moments m and v in place and returns the new
// parameter. bias_correction1/2 = 1 - beta1^t, 1 - beta2^t (t 1-based), computed once per step by
// the caller (in double) rather than per element.
template <class T>
HR_HD inline T adamw_element(T param, T grad, T& m, T& v, T lr, T beta1, T beta2, T eps,
                             T weight_decay, T bias_correction1, T bias_correction2) {
  m = beta1 * m + (T(1) - beta1) * grad;
  v = beta2 * v + (T(1) - beta2) * grad * grad;
  const T mhat = m / bias_correction1;
  const T vhat = v / bias_correction2;
  return param - lr * (mhat / (detail::hr_sqrt(vhat) + eps) + weight_decay * param);
}

// --- stochastic rounding (weights and optimizer state stored in bf16) -------------------------
// Rounding a small update into bf16 to nearest loses it whenever it is under half a bf16 ulp of
// the weight (1/256 of it): the weight stops moving. Rounded up or down with probabilities in
// proportion to the distances, the expected stored value is the f32 one, so small updates
// accumulate on average (Gupta et al. 2015; llm.c's bf16 weights without masters).

// 32 random bits for element i of a stream `seed`: a counter-based hash (MurmurHash3's 64-bit
// finalizer over the index and the seed), the same on the host and the device, in any order and
// any thread layout, so that a run and its resume round alike.
HR_HD inline uint32_t rounding_noise(uint32_t seed, uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull ^ ((uint64_t(seed) << 32) | seed);
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

// x to bf16, rounded up in magnitude with probability (dropped bits) / 2^16: the 16 bits bf16
// drops plus 16 random ones, truncated. Infinities and NaN round as float_to_bf16 does.
HR_HD inline uint16_t float_to_bf16_stochastic(float x, uint32_t noise) {
  const uint32_t b = float_bits(x);
  if ((b & 0x7F800000u) == 0x7F800000u) return float_to_bf16(x);
  return uint16_t((b + (noise & 0xFFFFu)) >> 16);
}

// An optimizer operand as stored: f32, or bf16 (uint16_t bits), widened to f32 to compute and
// stored back, bf16 rounded stochastically with `noise`.
HR_HD inline float widen(float x) {
  return x;
}
HR_HD inline float widen(uint16_t bf16) {
  return bf16_to_float(bf16);
}
HR_HD inline void store_rounded(float& out, float x, uint32_t) {
  out = x;
}
HR_HD inline void store_rounded(uint16_t& out, float x, uint32_t noise) {
  out = float_to_bf16_stochastic(x, noise);
}

// One AdamW step on stored operands: weights W, gradient G, state S, each float or bf16. The
// math is adamw_element's in f32; element i of the segment draws its three streams of noise
// (weight, m, v) from `seed`, the step's and segment's.
template <class W, class G, class S>
HR_HD HR_INLINE void adamw_stored(W& param, G grad, S& m, S& v, uint64_t i, uint32_t seed, float lr,
                                  float beta1, float beta2, float eps, float weight_decay,
                                  float bc1, float bc2) {
  float mf = widen(m), vf = widen(v);
  const float p = adamw_element(widen(param), widen(grad), mf, vf, lr, beta1, beta2, eps,
                                weight_decay, bc1, bc2);
  store_rounded(param, p, rounding_noise(seed, 3 * i));
  store_rounded(m, mf, rounding_noise(seed, 3 * i + 1));
  store_rounded(v, vf, rounding_noise(seed, 3 * i + 2));
}

// One SGD step on stored operands (buf null: no momentum), as adamw_stored.
template <class W, class G, class S>
HR_HD HR_INLINE void sgd_stored(W& param, G grad, S* buf, uint64_t i, uint32_t seed, float lr,
                                float momentum, float weight_decay);

// One plain SGD step (no momentum state), torch.optim.SGD semantics: weight decay is L2 added to
// the gradient. Returns the new parameter.
template <class T>
HR_HD inline T sgd_element(T param, T grad, T lr, T weight_decay) {
  return param - lr * (grad + weight_decay * param);
}

// One SGD step with momentum (dampening 0, no Nesterov), torch.optim.SGD semantics. The buffer
// starts at zero, so the first step gives buf = g exactly as torch's first-use copy does.
template <class T>
HR_HD inline T sgd_momentum_element(T param, T grad, T& buf, T lr, T momentum, T weight_decay) {
  const T g = grad + weight_decay * param;
  buf = momentum * buf + g;
  return param - lr * buf;
}

template <class W, class G, class S>
HR_HD HR_INLINE void sgd_stored(W& param, G grad, S* buf, uint64_t i, uint32_t seed, float lr,
                                float momentum, float weight_decay) {
  float p;
  if (buf != nullptr) {
    float b = widen(*buf);
    p = sgd_momentum_element(widen(param), widen(grad), b, lr, momentum, weight_decay);
    store_rounded(*buf, b, rounding_noise(seed, 2 * i + 1));
  } else {
    p = sgd_element(widen(param), widen(grad), lr, weight_decay);
  }
  store_rounded(param, p, rounding_noise(seed, 2 * i));
}

}  // namespace headroom
