// Activations at the physical limit (issue 19): the tiled attention and the chunked loss against
// the naive attention and the full logits — kernel outputs and gradients, whole-model losses and
// every parameter's gradient in fp32, central differences in double — and the bytes they keep:
// the tracker's activations equal the closed forms, no (B, NH, T, T) and no (B, T, V) tensor is
// saved, and the head's forward workspace is one chunk of logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/model/model.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_tiled.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

template <class T>
std::vector<T> random_vec(std::mt19937_64& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<T> v(n);
  for (T& x : v)
    x = T(u(rng));
  return v;
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// ---------------------------------------------------------------------------------------------
// Kernels

// The tiled kernels against the naive ones in fp32: the output, and dqkv for the same upstream
// gradient; the tile sizes reach one tile, several, and a partial last one.
TEST(TiledAttention, MatchesTheNaiveKernelsInFp32) {
  std::mt19937_64 rng(11);
  struct Case {
    int B, T, C, NH, tile;
  };
  const Case cases[] = {{2, 1, 8, 2, 64},   {2, 7, 8, 2, 64},    {1, 7, 12, 3, 3},
                        {2, 64, 16, 4, 64}, {1, 64, 16, 1, 16},  {1, 257, 16, 2, 64},
                        {1, 257, 8, 2, 32}, {1, 1024, 8, 2, 64}, {2, 100, 32, 4, 7}};
  for (const Case& k : cases) {
    SCOPED_TRACE("B " + std::to_string(k.B) + " T " + std::to_string(k.T) + " NH " +
                 std::to_string(k.NH) + " tile " + std::to_string(k.tile));
    const size_t N = size_t(k.B) * k.T;
    const auto qkv = random_vec<float>(rng, N * 3 * k.C, -2.0, 2.0);
    const auto dout = random_vec<float>(rng, N * k.C, -1.0, 1.0);
    const auto dqkv0 = random_vec<float>(rng, N * 3 * k.C, -1.0, 1.0);  // backward accumulates
    std::vector<float> out_n(N * k.C), att(size_t(k.B) * k.NH * k.T * k.T),
        scratch(size_t(k.T) * k.T);
    cpu::attention_forward(out_n.data(), att.data(), qkv.data(), k.B, k.T, k.C, k.NH);
    std::vector<float> dqkv_n = dqkv0;
    cpu::attention_backward(dqkv_n.data(), scratch.data(), dout.data(), qkv.data(), att.data(), k.B,
                            k.T, k.C, k.NH);

    std::vector<float> out_t(N * k.C, NAN), lse(size_t(k.B) * k.NH * k.T, NAN);
    cpu::attention_tiled_forward(out_t.data(), lse.data(), qkv.data(), k.B, k.T, k.C, k.NH, k.tile);
    std::vector<float> dqkv_t = dqkv0;
    cpu::attention_tiled_backward(dqkv_t.data(), dout.data(), qkv.data(), out_t.data(), lse.data(),
                                  k.B, k.T, k.C, k.NH, k.tile);
    EXPECT_LT(test::relative_error(as_double(out_t), as_double(out_n)), 1e-6);
    EXPECT_LT(test::relative_error(as_double(dqkv_t), as_double(dqkv_n)), 1e-5);
    // lse is the log of the softmax's denominator: row t of head h gives probability
    // exp(score - lse), which for key 0 is the naive kernel's att[.., t, 0].
    const size_t hs = size_t(k.C / k.NH);
    for (int b = 0; b < k.B; b++)
      for (int h = 0; h < k.NH; h++)
        for (int t = 0; t < k.T; t += std::max(1, k.T / 5)) {
          const float* q = qkv.data() + (size_t(b) * k.T + t) * 3 * k.C + h * hs;
          const float* key = qkv.data() + size_t(b) * k.T * 3 * k.C + k.C + h * hs;
          double s = 0;
          for (size_t d = 0; d < hs; d++)
            s += double(q[d]) * key[d];
          s /= std::sqrt(double(hs));
          const double p = std::exp(s - lse[(size_t(b) * k.NH + h) * k.T + t]);
          EXPECT_NEAR(p, att[((size_t(b) * k.NH + h) * k.T + t) * k.T], 1e-5);
        }
  }
}

// Central differences in double, as tests/kernels_grad_test.cpp checks every kernel: L = sum(out
// * W), dqkv from backward with dout = W, tiles of 3 over T = 10 (four tiles, the last partial).
TEST(TiledAttention, MatchesCentralDifferencesInDouble) {
  std::mt19937_64 rng(12);
  const int B = 2, C = 6, NH = 2;
  for (const int Tn : {1, 5, 10}) {
    for (const int tile : {3, 64}) {
      SCOPED_TRACE("T " + std::to_string(Tn) + " tile " + std::to_string(tile));
      const size_t N = size_t(B) * Tn;
      auto qkv = random_vec<double>(rng, N * 3 * C, -2.0, 2.0);
      const auto W = random_vec<double>(rng, N * C, -1.0, 1.0);
      std::vector<double> out(N * C), lse(size_t(B) * NH * Tn);
      auto loss = [&] {
        cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, Tn, C, NH, tile);
        long double s = 0;
        for (size_t i = 0; i < out.size(); i++)
          s += (long double)out[i] * W[i];
        return double(s);
      };
      loss();
      const std::vector<double> out0 = out, lse0 = lse;
      std::vector<double> dqkv(qkv.size(), 0.0);
      cpu::attention_tiled_backward(dqkv.data(), W.data(), qkv.data(), out0.data(), lse0.data(), B,
                                    Tn, C, NH, tile);
      std::vector<double> numeric(qkv.size());
      const double h = 1e-5;
      for (size_t i = 0; i < qkv.size(); i++) {
        const double saved = qkv[i];
        qkv[i] = saved + h;
        const double lp = loss();
        qkv[i] = saved - h;
        const double lm = loss();
        qkv[i] = saved;
        numeric[i] = (lp - lm) / (2 * h);
      }
      EXPECT_LT(test::relative_error(dqkv, numeric), 1e-6);
      for (size_t i = 0; i < dqkv.size(); i++)
        ASSERT_NEAR(dqkv[i], numeric[i], 1e-6 * std::max(std::abs(numeric[i]), 1e-3)) << i;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The whole model

ModelConfig tiny(int T, int NH, int C, int V, const std::string& attention, const std::string& loss,
                 int chunk) {
  ModelConfig m;
  m.n_layer = 2;
  m.n_head = NH;
  m.n_embd = C;
  m.seq_len = T;
  m.vocab_size = V;
  m.attention = attention;
  m.loss = loss;
  m.chunk_tokens = chunk;
  return m;
}

struct Tokens {
  std::vector<int32_t> tokens, targets;
  Batch batch(int B, int T) const {
    Batch b;
    b.tokens = tokens.data();
    b.targets = targets.data();
    b.B = B;
    b.T = T;
    return b;
  }
};

Tokens random_tokens(int B, int T, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tokens t;
  for (int i = 0; i < B * T; i++) {
    t.tokens.push_back(int32_t(rng() % uint64_t(V)));
    t.targets.push_back(int32_t(rng() % uint64_t(V)));
  }
  if (B * T > 3) t.targets[2] = -1;  // an ignored position
  return t;
}

// One forward and backward: the loss and every parameter's gradient, in order.
template <class T>
std::pair<double, std::vector<std::vector<double>>> loss_and_grads(const ModelConfig& m,
                                                                   const Tokens& tok, int B) {
  auto device = Device::create(DeviceConfig{});
  Gpt<T> model(m, *device, 5);
  Batch batch = tok.batch(B, m.seq_len);
  batch.dloss = 1.0 / (B * m.seq_len);
  model.zero_grad();
  model.forward(batch);
  model.backward(batch);
  const double loss = model.loss();
  std::vector<std::vector<double>> grads;
  for (Param<T>* p : model.params())
    grads.emplace_back(p->master().grad, p->master().grad + p->numel);
  EXPECT_EQ(device->tracker().live(Category::kActivations), 0u);
  EXPECT_EQ(device->tracker().live(Category::kWorkspace), 0u);
  return {loss, grads};
}

// Tiled attention and the chunked loss against the naive attention and the full logits: the loss
// and every parameter's gradient within 1e-5 relative in fp32, over T, head counts, and chunks
// that do and do not divide B·T.
TEST(Activations, LossAndEveryGradientMatchTheNaivePathInFp32) {
  const int B = 2, V = 37;
  struct Case {
    int T, NH, C;
    std::vector<int> chunks;
  };
  const std::vector<Case> cases = {{1, 2, 8, {0, 1}},
                                   {7, 2, 8, {0, 3, 7, 14}},
                                   {64, 4, 16, {0, 5, 64}},
                                   {257, 2, 8, {0, 100, 257}},
                                   {1024, 1, 8, {0, 333}}};
  for (const Case& k : cases) {
    const Tokens tok = random_tokens(B, k.T, V, 100 + k.T);
    const auto want = loss_and_grads<float>(tiny(k.T, k.NH, k.C, V, "naive", "full", 0), tok, B);
    for (const int chunk : k.chunks) {
      SCOPED_TRACE("T " + std::to_string(k.T) + " NH " + std::to_string(k.NH) + " chunk " +
                   std::to_string(chunk));
      const auto got =
          loss_and_grads<float>(tiny(k.T, k.NH, k.C, V, "tiled", "chunked", chunk), tok, B);
      EXPECT_NEAR(got.first, want.first, 1e-5 * std::abs(want.first));
      ASSERT_EQ(got.second.size(), want.second.size());
      for (size_t i = 0; i < got.second.size(); i++)
        EXPECT_LT(test::relative_error(got.second[i], want.second[i]), 1e-5) << "parameter " << i;
    }
    // Each half alone too: the keys are independent.
    const auto tiled_full =
        loss_and_grads<float>(tiny(k.T, k.NH, k.C, V, "tiled", "full", 0), tok, B);
    const auto naive_chunked =
        loss_and_grads<float>(tiny(k.T, k.NH, k.C, V, "naive", "chunked", 3), tok, B);
    for (const auto* got : {&tiled_full, &naive_chunked}) {
      EXPECT_NEAR(got->first, want.first, 1e-5 * std::abs(want.first));
      for (size_t i = 0; i < got->second.size(); i++)
        EXPECT_LT(test::relative_error(got->second[i], want.second[i]), 1e-5) << i;
    }
  }
}

// The per-token losses are today's: the chunked loss computes each token's from the same kernels.
TEST(Activations, ChunkedLossIsTheFullLossPerToken) {
  const int B = 3, T = 9, V = 53;
  const Tokens tok = random_tokens(B, T, V, 7);
  auto losses_of = [&](const std::string& loss, int chunk) {
    auto device = Device::create(DeviceConfig{});
    Gpt<float> model(tiny(T, 2, 8, V, "naive", loss, chunk), *device, 5);
    Batch batch = tok.batch(B, T);
    batch.dloss = 1.0 / (B * T);
    model.forward(batch);
    // A training forward of the chunked loss leaves the losses to the head's backward.
    const auto& layers = model.layers();
    Buffer dx(*device, uint64_t(B) * T * 8 * sizeof(float), Category::kWorkspace, "dx (B, T, C)");
    layers.back()->backward(dx.as<void>(), nullptr, layers[layers.size() - 2]->output(), batch);
    // The head's saved tensors end with the per-token losses (B, T).
    const SavedActivation& l = layers.back()->saved().back();
    EXPECT_EQ(l.what, "losses (B, T)");
    std::vector<float> host(l.numel);
    device->backend().download(host.data(), l.buffer.as<void>(), l.numel * sizeof(float));
    model.release_activations();
    return host;
  };
  const std::vector<float> want = losses_of("full", 0);
  for (const int chunk : {1, 4, 27, 0}) {
    const std::vector<float> got = losses_of("chunked", chunk);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); i++)
      EXPECT_NEAR(got[i], want[i], 1e-6 * std::max(1.0f, std::abs(want[i])))
          << "chunk " << chunk << " token " << i;
  }
}

// Whole model in double against central differences, with chunks that do not divide B·T.
TEST(Activations, WholeModelMatchesCentralDifferencesInDouble) {
  const int B = 2, T = 5, V = 11;
  for (const int chunk : {3, 4}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const ModelConfig m = tiny(T, 2, 8, V, "tiled", "chunked", chunk);
    auto device = Device::create(DeviceConfig{});
    Gpt<double> model(m, *device, 7);
    std::mt19937_64 rng(3);
    test::perturb_params(model, rng);
    const Tokens tok = random_tokens(B, T, V, 9);
    Batch batch = tok.batch(B, T);
    batch.dloss = 1.0 / (B * T - 1);
    model.zero_grad();
    model.forward(batch);
    model.backward(batch);
    std::vector<double> analytic, numeric;
    const double h = 1e-5;
    test::finite_differences(model, batch, h, &analytic, &numeric);
    EXPECT_LT(test::relative_error(analytic, numeric), 1e-6);
    for (size_t i = 0; i < analytic.size(); ++i)
      ASSERT_NEAR(analytic[i], numeric[i], 1e-6 * std::max(std::abs(numeric[i]), 1e-3)) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Bytes

// After forward the tracker holds exactly the closed forms: the embedding's output, each block's
// gpt_block_activation_bytes, the head's gpt_head_activation_bytes; no block keeps a (B, NH, T,
// T) tensor and the head no (B, T, V) one; forward holds a block's transient, backward's head one
// chunk.
TEST(Activations, TrackerBytesEqualTheClosedForms) {
  const int B = 2, T = 33, V = 97, C = 16, NH = 4;
  for (const std::string attention : {"tiled", "naive"}) {
    for (const std::string loss : {"chunked", "full"}) {
      for (const int chunk : {0, 10}) {
        SCOPED_TRACE(attention + " " + loss + " chunk " + std::to_string(chunk));
        const ModelConfig m = tiny(T, NH, C, V, attention, loss, chunk);
        auto device = Device::create(DeviceConfig{});
        Gpt<float> model(m, *device, 5);
        const Tokens tok = random_tokens(B, T, V, 3);
        Batch batch = tok.batch(B, T);
        batch.dloss = 1.0 / (B * T);
        MemoryTracker& mt = device->tracker();
        mt.reset_peaks();
        ASSERT_EQ(mt.live(Category::kWorkspace), 0u);
        model.forward(batch);
        const uint64_t N = uint64_t(B) * T;
        uint64_t want = 4 * N * C;  // the embedding's output
        for (int b = 0; b < m.n_layer; b++)
          want += gpt_block_activation_bytes(m, B, T, Dtype::kF32, b);
        want += gpt_head_activation_bytes(m, B, T, Dtype::kF32);
        EXPECT_EQ(mt.live(Category::kActivations), want);
        const auto& layers = model.layers();
        for (size_t l = 0; l < layers.size(); l++) {
          EXPECT_EQ(layers[l]->saved_bytes(),
                    l == 0 ? 4 * N * C
                    : l + 1 < layers.size()
                        ? gpt_block_activation_bytes(m, B, T, Dtype::kF32, int(l) - 1)
                        : gpt_head_activation_bytes(m, B, T, Dtype::kF32));
          for (const SavedActivation& a : layers[l]->saved()) {
            if (attention == "tiled") {
              EXPECT_NE(a.numel, uint64_t(B) * NH * T * T) << a.what;
            }
            if (loss == "chunked") {
              EXPECT_NE(a.numel, N * V) << a.what;
            }
          }
        }
        const bool tiled = attention == "tiled", chunked = loss == "chunked";
        EXPECT_EQ(want - (4 * N * C + gpt_head_activation_bytes(m, B, T, Dtype::kF32)),
                  uint64_t(m.n_layer) * (4 * (2 * N * C + 4 * N * C + 4 * N * C) + 4 * 4 * N +
                                         (tiled ? 4 * N * NH : 4 * N * NH * T)));
        EXPECT_EQ(gpt_head_activation_bytes(m, B, T, Dtype::kF32),
                  4 * N * C + 4 * 3 * N + (chunked ? 0 : 4 * N * V));
        const uint64_t rows = chunk ? uint64_t(chunk) : N;  // V·4 B · N fits the 64 MiB budget
        EXPECT_EQ(gpt_loss_chunk_tokens(m, N, Dtype::kF32), rows);
        // A training forward's only workspace is a block's transient (B, T, 4C) (the LayerNorm
        // and GELU outputs, not kept): the chunked loss's logits come in backward.
        EXPECT_EQ(mt.peak(Category::kWorkspace), 4 * N * 4 * C);
        // Backward's head holds d(ln_f) and one chunk, and the blocks (B, T)-sized buffers.
        mt.reset_peaks();
        model.backward(batch);
        EXPECT_EQ(mt.live(Category::kActivations), 0u);
        if (tiled) {
          // No block's scratch grows with T²: the largest workspace is two (B, T, C) gradients
          // and the block's dgelu, dfc, dres1, dtmp (or the head's).
          const uint64_t block_ws = 4 * N * (2 * C + 4 * C + 4 * C + 2 * C);
          const uint64_t head_ws = 4 * 2 * N * C + gpt_head_workspace_bytes(m, B, T, Dtype::kF32);
          EXPECT_EQ(mt.peak(Category::kWorkspace), std::max(block_ws, head_ws));
        }
      }
    }
  }
}

TEST(Activations, ConfigKeysNameTheValidValues) {
  const std::string base =
      "[model]\nn_layer = 1\nn_head = 2\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n";
  const Config c = test::config_from(base);
  EXPECT_EQ(c.model.attention, "tiled");
  EXPECT_EQ(c.model.loss, "chunked");
  EXPECT_EQ(c.model.chunk_tokens, 0);
  const Config d =
      test::config_from(base + "attention = \"naive\"\nloss = \"full\"\nchunk_tokens = 128\n");
  EXPECT_EQ(d.model.attention, "naive");
  EXPECT_EQ(d.model.loss, "full");
  EXPECT_EQ(d.model.chunk_tokens, 128);
  const std::string a =
      test::error_of([&] { test::config_from(base + "attention = \"flash\"\n"); });
  EXPECT_TRUE(test::contains(a, "model.attention")) << a;
  EXPECT_TRUE(test::contains(a, "\"tiled\"") && test::contains(a, "\"naive\"")) << a;
  const std::string l = test::error_of([&] { test::config_from(base + "loss = \"fused\"\n"); });
  EXPECT_TRUE(test::contains(l, "model.loss")) << l;
  EXPECT_TRUE(test::contains(l, "\"chunked\"") && test::contains(l, "\"full\"")) << l;
  const std::string k = test::error_of([&] { test::config_from(base + "chunk_tokens = -1\n"); });
  EXPECT_TRUE(test::contains(k, "chunk_tokens")) << k;
  // Overrides reach them as every other key.
  EXPECT_EQ(test::config_from(base, {"model.attention=naive"}).model.attention, "naive");
}

}  // namespace
}  // namespace headroom
