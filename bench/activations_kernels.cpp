// Where the step time of the tiled attention and the chunked loss goes
// (docs/results/activations.md): on gpt2-124m's shapes, one block's attention forward + backward
// naive and tiled, and the head's logits, cross-entropy and their backward with the full (B, T, V)
// logits and chunked over tokens at several chunk sizes. Each variant runs `--reps` times in turn
// (interleaved), the table gives each one's median.
//
//   build/bin/bench_activations_kernels [--seq 512] [--micro-batch 4] [--reps 3]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_tiled.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/matmul.h"

namespace {

using namespace headroom;
using Clock = std::chrono::steady_clock;

double seconds(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tiled attention and chunked loss against the naive kernels, gpt2-124m shapes"};
  int T = 512, B = 4, reps = 3;
  app.add_option("--seq", T, "sequence length");
  app.add_option("--micro-batch", B, "micro-batch");
  app.add_option("--reps", reps, "repetitions of each variant, interleaved");
  CLI11_PARSE(app, argc, argv);
  const int C = 768, NH = 12, V = 50257;
  const size_t N = size_t(B) * T;
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto random = [&](size_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v)
      x = dist(rng) * scale;
    return v;
  };
  const auto qkv = random(N * 3 * C, 1.0f), dout = random(N * C, 1.0f);
  const auto lnf = random(N * C, 1.0f), wte = random(size_t(V) * C, 0.02f);
  std::vector<int32_t> targets(N);
  for (int32_t& t : targets)
    t = int32_t(rng() % uint32_t(V));
  std::vector<float> out(N * C), dqkv(N * 3 * C), lse(size_t(B) * NH * T), losses(N);
  std::vector<float> dlnf(N * C), dwte(size_t(V) * C);

  // name -> (forward, backward) seconds of each repetition
  std::map<std::string, std::pair<std::vector<double>, std::vector<double>>> times;
  std::vector<std::string> order;
  auto record = [&](const std::string& name, double f, double b) {
    if (!times.count(name)) order.push_back(name);
    times[name].first.push_back(f);
    times[name].second.push_back(b);
  };
  const float dloss = 1.0f / float(N);
  const std::vector<int> chunks = {166, 333, 666, 1024};
  for (int r = 0; r < reps; r++) {
    {
      std::vector<float> att(size_t(B) * NH * T * T), scratch(size_t(T) * T);
      const double f =
          seconds([&] { cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH); });
      const double b = seconds([&] {
        cpu::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B,
                                T, C, NH);
      });
      record("attention, naive (one block)", f, b);
    }
    {
      const double f = seconds(
          [&] { cpu::attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH); });
      const double b = seconds([&] {
        cpu::attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(),
                                      B, T, C, NH);
      });
      record("attention, tiled (one block)", f, b);
    }
    {
      std::vector<float> logits(N * V);
      const double f = seconds([&] {
        cpu::matmul_forward(logits.data(), lnf.data(), wte.data(), (const float*)nullptr, int(N), C,
                            V);
        cpu::crossentropy_forward_backward(logits.data(), losses.data(), targets.data(), int(N), V,
                                           dloss);
      });
      const double b = seconds([&] {
        cpu::matmul_backward(dlnf.data(), dwte.data(), (float*)nullptr, logits.data(), lnf.data(),
                             wte.data(), int(N), C, V);
      });
      record("head, full logits", f, b);
    }
    for (const int chunk : chunks) {
      std::vector<float> logits(size_t(chunk) * V);
      auto logits_of = [&](size_t n0, int rows) {
        cpu::matmul_forward(logits.data(), lnf.data() + n0 * C, wte.data(), (const float*)nullptr,
                            rows, C, V);
        cpu::crossentropy_forward_backward(logits.data(), losses.data() + n0, targets.data() + n0,
                                           rows, V, dloss);
      };
      // A training forward computes no logits: backward takes each chunk's logits, losses and
      // gradients in one pass (model.cpp, Head).
      const double f = 0.0;
      const double b = seconds([&] {
        for (size_t n0 = 0; n0 < N; n0 += size_t(chunk)) {
          const int rows = int(std::min(size_t(chunk), N - n0));
          logits_of(n0, rows);
          cpu::matmul_backward(dlnf.data() + n0 * C, dwte.data(), (float*)nullptr, logits.data(),
                               lnf.data() + n0 * C, wte.data(), rows, C, V);
        }
      });
      record("head, chunks of " + std::to_string(chunk) + " tokens", f, b);
    }
  }
  std::printf("| kernels (B %d, T %d, gpt2-124m) | forward (s) | backward (s) | total (s) |\n", B,
              T);
  std::printf("|---|---:|---:|---:|\n");
  for (const std::string& name : order) {
    const double f = median(times[name].first), b = median(times[name].second);
    std::printf("| %s | %.3f | %.3f | %.3f |\n", name.c_str(), f, b, f + b);
  }
  return 0;
}
