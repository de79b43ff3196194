// kernels/cpu/bf16_ops.h (issue 36, item 2): the kernels on bf16 storage against the widened
// reference (each bf16 input widened to float by the scalar conversion, the f32 kernel, each
// output rounded by float_to_bf16), bitwise, at sizes with vector tails and on more than one
// thread; and the CPU backend's bf16 ops, which route to them, against the same reference.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/device/backend.h"
#include "kernels/common/dtype.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/bf16_ops.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/residual.h"

#include "tests/cpu_threads.h"

namespace headroom {
namespace {

using U16 = std::vector<uint16_t>;
using F32 = std::vector<float>;

U16 random_bf16(size_t n, uint32_t seed, float scale = 1.0f, bool specials = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  U16 v(n);
  for (auto& h : v)
    h = float_to_bf16(d(rng));
  if (specials && n >= 12) {
    const float inf = std::numeric_limits<float>::infinity();
    const float sp[] = {0.0f,    -0.0f, inf,    -inf,   std::nanf(""), 1e-40f,
                        -1e-40f, 3e38f, -3e38f, 1e-38f, 20.0f,         -20.0f};
    for (size_t i = 0; i < sizeof(sp) / sizeof(sp[0]); ++i)
      v[(i * 7919) % n] = float_to_bf16(sp[i]);
  }
  return v;
}

F32 widen(const U16& h) {
  F32 f(h.size());
  for (size_t i = 0; i < h.size(); ++i)
    f[i] = bf16_to_float(h[i]);
  return f;
}

U16 round_all(const F32& f) {
  U16 h(f.size());
  for (size_t i = 0; i < f.size(); ++i)
    h[i] = float_to_bf16(f[i]);
  return h;
}

// Bitwise, with the first difference named.
void expect_same(const U16& got, const U16& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << what << " differs at " << i << " of " << got.size();
}

void expect_same(const F32& got, const F32& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << what;
}

// Element counts with tails past 16 and 8 lanes, below and above the parallel threshold.
const size_t kSizes[] = {1, 7, 17, 33, 1000, (size_t(1) << 14) + 3, 100003};

// Each test on 1 and 3 threads (the kernels' bits may not depend on it).
using Threads = test::CpuThreads;

TEST(CpuBf16Kernels, GeluForwardIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (size_t n : kSizes) {
      const U16 x = random_bf16(n, uint32_t(n), 3.0f, true);
      F32 xf = widen(x), yf(n);
      cpu::gelu_forward(yf.data(), xf.data(), n);
      U16 y(n, 0xFFFF);
      cpu::gelu_forward_bf16(y.data(), x.data(), n);
      expect_same(y, round_all(yf), "gelu_forward");
      U16 in_place = x;  // out may be inp
      cpu::gelu_forward_bf16(in_place.data(), in_place.data(), n);
      expect_same(in_place, y, "gelu_forward in place");
    }
  }
}

TEST(CpuBf16Kernels, GeluBackwardIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (size_t n : kSizes) {
      for (bool acc : {true, false}) {
        const U16 x = random_bf16(n, uint32_t(n) + 1, 3.0f, true);
        const U16 dy = random_bf16(n, uint32_t(n) + 2, 0.1f);
        const U16 dx0 = random_bf16(n, uint32_t(n) + 3, 0.1f);
        F32 xf = widen(x), dyf = widen(dy), dxf = widen(dx0);
        cpu::gelu_backward(dxf.data(), xf.data(), dyf.data(), n, acc);
        U16 dx = dx0;
        cpu::gelu_backward_bf16(dx.data(), x.data(), dy.data(), n, acc);
        expect_same(dx, round_all(dxf), acc ? "gelu_backward +=" : "gelu_backward =");
      }
    }
  }
}

TEST(CpuBf16Kernels, AddInplaceIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (size_t n : kSizes) {
      const U16 a = random_bf16(n, uint32_t(n) + 4, 1.0f, true);
      const U16 b = random_bf16(n, uint32_t(n) + 5, 1.0f, true);
      F32 af = widen(a), bf = widen(b);
      cpu::add_inplace(af.data(), bf.data(), n);
      U16 got = a;
      cpu::add_inplace_bf16(got.data(), b.data(), n);
      expect_same(got, round_all(af), "add_inplace");
    }
  }
}

// Row shapes: odd widths (tails), one row, and enough rows for the threads.
const int kRows[][2] = {{1, 5}, {3, 17}, {37, 77}, {64, 768}, {300, 100}};

TEST(CpuBf16Kernels, LayerNormForwardIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nc : kRows) {
      const int N = nc[0], C = nc[1];
      const size_t n = size_t(N) * C;
      const U16 x = random_bf16(n, uint32_t(n) + 6, 2.0f);
      const U16 w = random_bf16(C, uint32_t(C) + 7), b = random_bf16(C, uint32_t(C) + 8);
      F32 xf = widen(x), wf = widen(w), bf = widen(b), yf(n), mf(N), rf(N);
      cpu::layernorm_forward(yf.data(), mf.data(), rf.data(), xf.data(), wf.data(), bf.data(), N,
                             C);
      U16 y(n);
      F32 m(N), r(N);
      cpu::layernorm_forward_bf16(y.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N, C);
      expect_same(y, round_all(yf), "layernorm_forward out");
      expect_same(m, mf, "layernorm_forward mean");
      expect_same(r, rf, "layernorm_forward rstd");
    }
  }
}

TEST(CpuBf16Kernels, LayerNormBackwardIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nc : kRows) {
      for (int mode = 0; mode < 3; ++mode) {  // accumulate; write; write over a residual's grad
        const int N = nc[0], C = nc[1];
        const size_t n = size_t(N) * C;
        const bool acc = mode == 0;
        const U16 x = random_bf16(n, uint32_t(n) + 9, 2.0f);
        const U16 w = random_bf16(C, uint32_t(C) + 10);
        const U16 dy = random_bf16(n, uint32_t(n) + 11, 0.1f);
        const U16 dres = random_bf16(n, uint32_t(n) + 12, 0.1f);
        const U16 dx0 = random_bf16(n, uint32_t(n) + 13, 0.1f);
        const U16 dw0 = random_bf16(C, uint32_t(C) + 14, 0.1f);
        const U16 db0 = random_bf16(C, uint32_t(C) + 15, 0.1f);
        F32 xf = widen(x), wf = widen(w), m(N), r(N), y(n);
        F32 wb = widen(random_bf16(C, 16));
        cpu::layernorm_forward(y.data(), m.data(), r.data(), xf.data(), wf.data(), wb.data(), N, C);
        F32 dyf = widen(dy), dresf = widen(dres), dxf = widen(dx0), dwf = widen(dw0),
            dbf = widen(db0);
        cpu::layernorm_backward(dxf.data(), dwf.data(), dbf.data(), dyf.data(), xf.data(),
                                wf.data(), m.data(), r.data(), N, C, acc,
                                mode == 2 ? dresf.data() : nullptr);
        U16 dx = dx0, dw = dw0, db = db0;
        cpu::layernorm_backward_bf16(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                                     m.data(), r.data(), N, C, acc,
                                     mode == 2 ? dres.data() : nullptr);
        expect_same(dx, round_all(dxf), "layernorm_backward dinp");
        expect_same(dw, round_all(dwf), "layernorm_backward dweight");
        expect_same(db, round_all(dbf), "layernorm_backward dbias");
      }
    }
  }
}

TEST(CpuBf16Kernels, CrossEntropyIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& nv :
         {std::pair{1, 7}, std::pair{5, 33}, std::pair{19, 1001}, std::pair{8, 50257}}) {
      const int N = nv.first, V = nv.second;
      const size_t n = size_t(N) * V;
      const U16 logits = random_bf16(n, uint32_t(n) + 17, 4.0f);
      std::vector<int32_t> targets(N);
      for (int i = 0; i < N; ++i)
        targets[i] = i % 4 == 3 ? -1 : int32_t((uint32_t(i) * 2654435761u) % uint32_t(V));
      const float dloss = 1.0f / float(N);
      F32 lf = widen(logits), lossf(N);
      cpu::crossentropy_forward_backward(lf.data(), lossf.data(), targets.data(), N, V, dloss);
      U16 l = logits;
      F32 loss(N);
      cpu::crossentropy_forward_backward_bf16(l.data(), loss.data(), targets.data(), N, V, dloss);
      expect_same(l, round_all(lf), "crossentropy gradient");
      expect_same(loss, lossf, "crossentropy losses");
    }
  }
}

TEST(CpuBf16Kernels, EmbeddingIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& btc : {std::array<int, 3>{1, 1, 5}, std::array<int, 3>{2, 7, 77},
                            std::array<int, 3>{4, 64, 96}}) {
      const int B = btc[0], Tn = btc[1], C = btc[2], V = 50, N = B * Tn;
      std::vector<int32_t> tokens(static_cast<size_t>(N));
      for (int i = 0; i < N; ++i)
        tokens[size_t(i)] = int32_t((uint32_t(i) * 2654435761u >> 7) % 23);  // repeats
      for (bool with_wpe : {true, false}) {
        const U16 wte = random_bf16(size_t(V) * C, 30), wpe = random_bf16(size_t(Tn) * C, 31);
        const U16 dout = random_bf16(size_t(N) * C, 32, 0.1f);
        const U16 dwte0 = random_bf16(size_t(V) * C, 33, 0.1f);
        const U16 dwpe0 = random_bf16(size_t(Tn) * C, 34, 0.1f);
        F32 wtef = widen(wte), wpef = widen(wpe), outf(size_t(N) * C);
        cpu::embedding_forward(outf.data(), tokens.data(), wtef.data(),
                               with_wpe ? wpef.data() : nullptr, B, Tn, C);
        U16 out(size_t(N) * C);
        cpu::embedding_forward_bf16(out.data(), tokens.data(), wte.data(),
                                    with_wpe ? wpe.data() : nullptr, B, Tn, C);
        expect_same(out, round_all(outf), "embedding_forward");

        F32 doutf = widen(dout), dwtef = widen(dwte0), dwpef = widen(dwpe0);
        cpu::embedding_backward(dwtef.data(), with_wpe ? dwpef.data() : nullptr, doutf.data(),
                                tokens.data(), B, Tn, C);
        U16 dwte = dwte0, dwpe = dwpe0;
        cpu::embedding_backward_bf16(dwte.data(), with_wpe ? dwpe.data() : nullptr, dout.data(),
                                     tokens.data(), B, Tn, C);
        expect_same(dwte, round_all(dwtef), "embedding_backward dwte");
        expect_same(dwpe, round_all(dwpef), "embedding_backward dwpe");
      }
    }
  }
}

// The tiled attention (and its grouped-query form): the same tile GEMMs on float copies of one
// head (or one key/value group) at a time, bitwise the widened kernel here (the tile GEMMs' row
// strides differ: the GEMM library gives the same bits for them); several tiles, a partial last
// one, and gpt2-124m's heads.
TEST(CpuBf16Kernels, TiledAttentionIsTheWidenedF32Kernel) {
  for (int t : {1, 3}) {
    Threads th(t);
    for (const auto& shape :
         {std::array<int, 6>{1, 5, 8, 2, 2, 64},  // B, T, C, NH, NKV, tile
          std::array<int, 6>{2, 70, 48, 4, 4, 16}, std::array<int, 6>{3, 37, 64, 4, 2, 8},
          std::array<int, 6>{1, 130, 96, 2, 2, 64}}) {
      const int B = shape[0], Tn = shape[1], C = shape[2], NH = shape[3], NKV = shape[4],
                tile = shape[5];
      const int W = C + 2 * (C / NH) * NKV;
      const size_t nq = size_t(B) * Tn * W, no = size_t(B) * Tn * C;
      const U16 qkv = random_bf16(nq, uint32_t(nq) + 40);
      F32 qkvf = widen(qkv), outf(no), lsef(size_t(B) * NH * Tn);
      cpu::attention_tiled_forward(outf.data(), lsef.data(), qkvf.data(), B, Tn, C, NH, tile, NKV);
      U16 out(no);
      F32 lse(size_t(B) * NH * Tn);
      cpu::attention_tiled_forward_bf16(out.data(), lse.data(), qkv.data(), B, Tn, C, NH, tile,
                                        NKV);
      expect_same(out, round_all(outf), "attention_tiled_forward out");
      expect_same(lse, lsef, "attention_tiled_forward lse");

      const U16 dout = random_bf16(no, uint32_t(no) + 41, 0.1f);
      const U16 dqkv0 = random_bf16(nq, uint32_t(nq) + 42, 0.1f);
      F32 doutf = widen(dout), dqkvf = widen(dqkv0), outw = widen(out);
      cpu::attention_tiled_backward(dqkvf.data(), doutf.data(), qkvf.data(), outw.data(),
                                    lse.data(), B, Tn, C, NH, tile, NKV);
      U16 dqkv = dqkv0;
      cpu::attention_tiled_backward_bf16(dqkv.data(), dout.data(), qkv.data(), out.data(),
                                         lse.data(), B, Tn, C, NH, tile, NKV);
      expect_same(dqkv, round_all(dqkvf), "attention_tiled_backward dqkv");
    }
  }
}

// The backend's bf16 ops (routed to bf16_ops.h unless HEADROOM_CPU_BF16_EW=0) against the same
// reference, so that the routing passes the right arguments.
TEST(CpuBf16Kernels, BackendBf16OpsAreTheWidenedF32Kernels) {
  std::unique_ptr<Backend> be = make_cpu_backend(2);
  const int N = 33, C = 70;
  const size_t n = size_t(N) * C;
  const U16 x = random_bf16(n, 20, 2.0f), w = random_bf16(C, 21), b = random_bf16(C, 22);
  const U16 dy = random_bf16(n, 23, 0.1f), dres = random_bf16(n, 24, 0.1f);
  F32 xf = widen(x), wf = widen(w), bf = widen(b), dyf = widen(dy), dresf = widen(dres);

  // gelu forward and backward (written), add_inplace
  U16 g(n);
  be->gelu_forward(Dtype::kBF16, g.data(), x.data(), n);
  F32 gf(n);
  cpu::gelu_forward(gf.data(), xf.data(), n);
  expect_same(g, round_all(gf), "backend gelu_forward");
  U16 dg(n, 0x7FC0);
  be->gelu_backward(Dtype::kBF16, dg.data(), x.data(), dy.data(), n, Grad::kWrite);
  F32 dgf(n);
  cpu::gelu_backward(dgf.data(), xf.data(), dyf.data(), n, false);
  expect_same(dg, round_all(dgf), "backend gelu_backward");
  U16 s = x;
  be->add_inplace(Dtype::kBF16, s.data(), dy.data(), n);
  F32 sf = xf;
  cpu::add_inplace(sf.data(), dyf.data(), n);
  expect_same(s, round_all(sf), "backend add_inplace");

  // LayerNorm forward, then backward over a residual path's gradient
  U16 y(n);
  F32 m(N), r(N), yf(n), mf(N), rf(N);
  be->layernorm_forward(Dtype::kBF16, y.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N,
                        C);
  cpu::layernorm_forward(yf.data(), mf.data(), rf.data(), xf.data(), wf.data(), bf.data(), N, C);
  expect_same(y, round_all(yf), "backend layernorm_forward");
  expect_same(m, mf, "backend layernorm mean");
  U16 dx(n), dw(C, 0), db(C, 0);
  be->layernorm_backward(Dtype::kBF16, dx.data(), dw.data(), db.data(), dy.data(), x.data(),
                         w.data(), m.data(), r.data(), N, C, Grad::kWrite, dres.data());
  F32 dxf(n), dwf(C, 0.0f), dbf(C, 0.0f);
  cpu::layernorm_backward(dxf.data(), dwf.data(), dbf.data(), dyf.data(), xf.data(), wf.data(),
                          mf.data(), rf.data(), N, C, false, dresf.data());
  expect_same(dx, round_all(dxf), "backend layernorm_backward dinp");
  expect_same(dw, round_all(dwf), "backend layernorm_backward dweight");
  expect_same(db, round_all(dbf), "backend layernorm_backward dbias");

  // the loss
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i)
    targets[i] = (i * 7) % C;
  U16 lg = x;
  F32 loss(N), lgf = xf, lossf(N);
  be->crossentropy_forward_backward(Dtype::kBF16, lg.data(), loss.data(), targets.data(), N, C,
                                    1.0 / N);
  cpu::crossentropy_forward_backward(lgf.data(), lossf.data(), targets.data(), N, C,
                                     float(1.0 / N));
  expect_same(lg, round_all(lgf), "backend crossentropy gradient");
  expect_same(loss, lossf, "backend crossentropy losses");
}

}  // namespace
}  // namespace headroom
