// Causal multi-head self-attention, tiled (FlashAttention, Dao et al. 2022), the CUDA side of
// kernels/cpu/attention_tiled.h: key (or query) rows are staged a tile at a time in shared
// memory and folded into per-row accumulators with the online softmax of
// kernels/common/elementwise.h, so no (T, T) matrix is ever written. One thread per row, fp32
// arithmetic, the storage type T only for what is read and written. Tiles past a block's last
// row's diagonal are not loaded at all.
//
// Forward: one thread per query row keeps its q, its output row, its running max and sum.
// Backward, two kernels (no atomics): dq with one thread per query row walking the key tiles up to
// its diagonal; dk and dv with one thread per key row walking the query tiles from its diagonal
// down. Both recompute p = exp(scale q k - lse) from the saved lse, and D = rowsum(dout * out).
//
// Grouped-query attention (kernels/cpu/attention_tiled.h): NKV key/value heads, NKV dividing NH,
// qkv (B, T, C + 2·NKV·hs) laid out [q (NH heads) | k (NKV) | v (NKV)], query head h reading
// key/value head h / (NH/NKV). NKV = NH is the multi-head case. The dk/dv kernel runs per
// key/value head and walks the query heads of its group in order, summing them in registers.
#include <cmath>
#include <stdexcept>

#include "kernels/common/elementwise.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace headroom::cuda {

namespace {

constexpr int kRows = 64;      // rows (threads) of a block
constexpr int kCols = 32;      // rows of a shared-memory tile
constexpr int kMaxHead = 128;  // largest head size: two (kCols, kMaxHead) fp32 tiles = 32 KiB

// Rows [r0, r0 + rows) x head columns of a (T, ·) view with row stride ld into tile (rows, hs).
template <class T>
__device__ inline void load_tile(float (*tile)[kMaxHead], const T* src, int r0, int rows, int hs,
                                 size_t ld) {
  for (int e = threadIdx.x; e < rows * hs; e += blockDim.x) {
    const int j = e / hs, d = e % hs;
    tile[j][d] = to_float(src[static_cast<size_t>(r0 + j) * ld + d]);
  }
}

__device__ inline float dot_row(const float* a, const float* b, int hs) {
  float s = 0.0f;
  for (int d = 0; d < hs; d++) {
    s += a[d] * b[d];
  }
  return s;
}

// Query head h of batch row b: its q and its key/value head's k and v, (T, hs) views of qkv
// (B, T, C3) with row stride C3 = C + 2·NKV·hs, their offsets from qkv (the same in dqkv), and its
// columns of a (B, T, C) tensor (out, dout), from `ohead` with row stride C.
template <class T>
struct HeadView {
  int b, h;
  size_t C3, ohead, qoff, koff, voff;
  const T *q, *k, *v;
  __device__ HeadView(const T* qkv, int b_, int h_, int Tn, int C, int NH, int NKV, int hs)
      : b(b_),
        h(h_),
        C3(static_cast<size_t>(C) + 2 * static_cast<size_t>(NKV) * hs),
        ohead(static_cast<size_t>(b) * Tn * C + static_cast<size_t>(h) * hs),
        qoff(static_cast<size_t>(b) * Tn * C3 + static_cast<size_t>(h) * hs),
        koff(static_cast<size_t>(b) * Tn * C3 + C + static_cast<size_t>(h / (NH / NKV)) * hs),
        voff(koff + static_cast<size_t>(NKV) * hs),
        q(qkv + qoff),
        k(qkv + koff),
        v(qkv + voff) {}
};

// grid (ceil(T / kRows), B * NH), kRows threads, one per query row.
template <class T>
__global__ void attention_tiled_forward_kernel(T* out, float* lse, const T* qkv, int Tn, int C,
                                               int NH, int NKV, int hs, float scale) {
  __shared__ float ks[kCols][kMaxHead];
  __shared__ float vs[kCols][kMaxHead];
  const HeadView<T> hv(qkv, blockIdx.y / NH, blockIdx.y % NH, Tn, C, NH, NKV, hs);
  const int b = hv.b, h = hv.h;
  const size_t C3 = hv.C3;
  const T *q = hv.q, *k = hv.k, *v = hv.v;
  const int r0 = blockIdx.x * kRows;
  const int t = r0 + threadIdx.x;
  const bool active = t < Tn;
  float qr[kMaxHead], o[kMaxHead];
  for (int d = 0; d < hs; d++) {
    qr[d] = active ? to_float(q[static_cast<size_t>(t) * C3 + d]) * scale : 0.0f;
    o[d] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const int last = min(Tn - 1, r0 + kRows - 1);  // the last key any row of the block sees
  for (int c0 = 0; c0 <= last; c0 += kCols) {
    const int cols = min(kCols, Tn - c0);
    __syncthreads();  // the previous tile is read by every thread
    load_tile(ks, k, c0, cols, hs, C3);
    load_tile(vs, v, c0, cols, hs, C3);
    __syncthreads();
    const int n = active ? min(cols, t - c0 + 1) : 0;  // keys c0 + j <= t
    if (n <= 0) continue;
    float s[kCols];
    float tmax = -INFINITY;
    for (int j = 0; j < n; j++) {
      s[j] = dot_row(qr, ks[j], hs);
      tmax = fmaxf(tmax, s[j]);
    }
    const float m_new = fmaxf(m, tmax);
    const float alpha = m == -INFINITY ? 0.0f : online_softmax_rescale(m, m_new);
    l *= alpha;
    for (int d = 0; d < hs; d++) {
      o[d] *= alpha;
    }
    for (int j = 0; j < n; j++) {
      const float p = exp_minus_abs(s[j] - m_new);
      l += p;
      for (int d = 0; d < hs; d++) {
        o[d] += p * vs[j][d];
      }
    }
    m = m_new;
  }
  if (!active) return;
  const float inv = 1.0f / l;
  T* orow = out + (static_cast<size_t>(b) * Tn + t) * C + static_cast<size_t>(h) * hs;
  for (int d = 0; d < hs; d++) {
    orow[d] = from_float<T>(o[d] * inv);
  }
  lse[(static_cast<size_t>(b) * NH + h) * Tn + t] = m + logf(l);
}

// dq: grid (ceil(T / kRows), B * NH), kRows threads, one per query row.
template <class T>
__global__ void attention_tiled_dq_kernel(T* dqkv, const T* dout, const T* qkv, const T* out,
                                          const float* lse, int Tn, int C, int NH, int NKV, int hs,
                                          float scale) {
  __shared__ float ks[kCols][kMaxHead];
  __shared__ float vs[kCols][kMaxHead];
  const HeadView<T> hv(qkv, blockIdx.y / NH, blockIdx.y % NH, Tn, C, NH, NKV, hs);
  const int b = hv.b, h = hv.h;
  const size_t C3 = hv.C3, ohead = hv.ohead, head = hv.qoff;
  const T *q = hv.q, *k = hv.k, *v = hv.v;
  const int r0 = blockIdx.x * kRows;
  const int t = r0 + threadIdx.x;
  const bool active = t < Tn;
  float qr[kMaxHead], dor[kMaxHead], dq[kMaxHead];
  for (int d = 0; d < hs; d++) {
    qr[d] = active ? to_float(q[static_cast<size_t>(t) * C3 + d]) : 0.0f;
    dor[d] = active ? to_float(dout[ohead + static_cast<size_t>(t) * C + d]) : 0.0f;
    dq[d] = 0.0f;
  }
  const float lr = active ? lse[(static_cast<size_t>(b) * NH + h) * Tn + t] : 0.0f;
  float Dr = 0.0f;  // D = dout_t · out_t over the head's columns
  if (active) {
    for (int d = 0; d < hs; d++) {
      Dr += dor[d] * to_float(out[ohead + static_cast<size_t>(t) * C + d]);
    }
  }
  const int last = min(Tn - 1, r0 + kRows - 1);
  for (int c0 = 0; c0 <= last; c0 += kCols) {
    const int cols = min(kCols, Tn - c0);
    __syncthreads();
    load_tile(ks, k, c0, cols, hs, C3);
    load_tile(vs, v, c0, cols, hs, C3);
    __syncthreads();
    const int n = active ? min(cols, t - c0 + 1) : 0;
    for (int j = 0; j < n; j++) {
      const float p = exp_minus_abs(scale * dot_row(qr, ks[j], hs) - lr);
      const float ds = p * (dot_row(dor, vs[j], hs) - Dr);
      for (int d = 0; d < hs; d++) {
        dq[d] += scale * ds * ks[j][d];
      }
    }
  }
  if (!active) return;
  T* dqr = dqkv + head + static_cast<size_t>(t) * C3;
  for (int d = 0; d < hs; d++) {
    dqr[d] = from_float<T>(to_float(dqr[d]) + dq[d]);
  }
}

// dk, dv: grid (ceil(T / kRows), B * NKV), kRows threads, one per key row of key/value head kvh;
// the group's query heads kvh·g .. kvh·g + g - 1 (g = NH / NKV) in order, each walking the query
// tiles from the block's diagonal down, all summed into the same registers.
template <class T>
__global__ void attention_tiled_dkv_kernel(T* dqkv, const T* dout, const T* qkv, const T* out,
                                           const float* lse, int Tn, int C, int NH, int NKV, int hs,
                                           float scale) {
  __shared__ float qs[kCols][kMaxHead];
  __shared__ float dos[kCols][kMaxHead];
  __shared__ float ls[kCols], Ds[kCols];
  const int b = blockIdx.y / NKV, kvh = blockIdx.y % NKV, group = NH / NKV;
  const HeadView<T> first(qkv, b, kvh * group, Tn, C, NH, NKV, hs);  // k, v: the group's
  const size_t C3 = first.C3;
  const T *k = first.k, *v = first.v;
  const int c0 = blockIdx.x * kRows;
  const int c = c0 + threadIdx.x;
  const bool active = c < Tn;
  float kr[kMaxHead], vr[kMaxHead], dk[kMaxHead], dv[kMaxHead];
  for (int d = 0; d < hs; d++) {
    kr[d] = active ? to_float(k[static_cast<size_t>(c) * C3 + d]) : 0.0f;
    vr[d] = active ? to_float(v[static_cast<size_t>(c) * C3 + d]) : 0.0f;
    dk[d] = 0.0f;
    dv[d] = 0.0f;
  }
  for (int h = kvh * group; h < (kvh + 1) * group; h++) {
    const HeadView<T> hv(qkv, b, h, Tn, C, NH, NKV, hs);
    const size_t ohead = hv.ohead;
    const T* q = hv.q;
    const float* lse_bh = lse + (static_cast<size_t>(b) * NH + h) * Tn;
    // Query tiles from the one holding the block's first key (earlier queries see none of them).
    for (int r0 = c0 / kCols * kCols; r0 < Tn; r0 += kCols) {
      const int rows = min(kCols, Tn - r0);
      __syncthreads();
      load_tile(qs, q, r0, rows, hs, C3);
      load_tile(dos, dout + ohead, r0, rows, hs, C);
      if (threadIdx.x < rows) {
        const int r = r0 + threadIdx.x;
        float s = 0.0f;
        for (int d = 0; d < hs; d++) {
          const size_t at = ohead + static_cast<size_t>(r) * C + d;
          s += to_float(dout[at]) * to_float(out[at]);
        }
        Ds[threadIdx.x] = s;
        ls[threadIdx.x] = lse_bh[r];
      }
      __syncthreads();
      if (!active) continue;
      for (int j = 0; j < rows; j++) {
        if (r0 + j < c) continue;  // query before the key: masked
        const float p = exp_minus_abs(scale * dot_row(qs[j], kr, hs) - ls[j]);
        const float ds = p * (dot_row(dos[j], vr, hs) - Ds[j]);
        for (int d = 0; d < hs; d++) {
          dv[d] += p * dos[j][d];
          dk[d] += scale * ds * qs[j][d];
        }
      }
    }
  }
  if (!active) return;
  T* dkr = dqkv + first.koff + static_cast<size_t>(c) * C3;
  T* dvr = dqkv + first.voff + static_cast<size_t>(c) * C3;
  for (int d = 0; d < hs; d++) {
    dkr[d] = from_float<T>(to_float(dkr[d]) + dk[d]);
    dvr[d] = from_float<T>(to_float(dvr[d]) + dv[d]);
  }
}

void check_shape(const char* op, int B, int Tn, int C, int NH, int NKV) {
  if (NH <= 0 || C % NH != 0)
    throw std::invalid_argument(std::string(op) + ": C must be a positive multiple of NH");
  if (NKV <= 0 || NH % NKV != 0)
    throw std::invalid_argument(std::string(op) + ": NKV = " + std::to_string(NKV) +
                                " key/value heads must divide NH = " + std::to_string(NH));
  if (C / NH > kMaxHead)
    throw std::invalid_argument(std::string(op) + ": head size " + std::to_string(C / NH) +
                                " exceeds the tiled kernels' " + std::to_string(kMaxHead) +
                                (NKV == NH ? " (use [model] attention = \"naive\")" : ""));
  if (static_cast<long long>(B) * NH > 65535)
    throw std::invalid_argument(std::string(op) + ": B*NH exceeds 65535");
  (void)Tn;
}

}  // namespace

template <class T>
void attention_tiled_forward(T* out, float* lse, const T* qkv, int B, int Tn, int C, int NH,
                             int NKV, cudaStream_t stream) {
  check_shape("attention_tiled_forward", B, Tn, C, NH, NKV);
  if (B <= 0 || Tn <= 0) return;
  const int hs = C / NH;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const dim3 grid(static_cast<unsigned>(ceil_div(Tn, kRows)), static_cast<unsigned>(B * NH));
  attention_tiled_forward_kernel<<<grid, kRows, 0, stream>>>(out, lse, qkv, Tn, C, NH, NKV, hs,
                                                             scale);
  CUDA_CHECK_LAUNCH();
}

template <class T>
void attention_tiled_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const float* lse,
                              int B, int Tn, int C, int NH, int NKV, cudaStream_t stream) {
  check_shape("attention_tiled_backward", B, Tn, C, NH, NKV);
  if (B <= 0 || Tn <= 0) return;
  const int hs = C / NH;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hs)));
  const unsigned row_blocks = static_cast<unsigned>(ceil_div(Tn, kRows));
  attention_tiled_dq_kernel<<<dim3(row_blocks, static_cast<unsigned>(B * NH)), kRows, 0, stream>>>(
      dqkv, dout, qkv, out, lse, Tn, C, NH, NKV, hs, scale);
  CUDA_CHECK_LAUNCH();
  attention_tiled_dkv_kernel<<<dim3(row_blocks, static_cast<unsigned>(B * NKV)), kRows, 0,
                               stream>>>(dqkv, dout, qkv, out, lse, Tn, C, NH, NKV, hs, scale);
  CUDA_CHECK_LAUNCH();
}

#define HR_INSTANTIATE(T)                                                                        \
  template void attention_tiled_forward<T>(T*, float*, const T*, int, int, int, int, int,        \
                                           cudaStream_t);                                        \
  template void attention_tiled_backward<T>(T*, const T*, const T*, const T*, const float*, int, \
                                            int, int, int, int, cudaStream_t);
HR_INSTANTIATE_FLOAT_TYPES(HR_INSTANTIATE)
#undef HR_INSTANTIATE

}  // namespace headroom::cuda
