// The optimizer plugins' update against the built-in AdamW's, kernel against kernel
// (docs/results/cpu.md, "The optimizer plugins' step"): one optimizer step over every parameter
// tensor of gpt2-124m (the embeddings, then per block c_attn, attn c_proj, c_fc, mlp c_proj as
// (out, in) matrices, their biases and both LayerNorms), f32 weights and gradients, with
//  - the host's AdamW (kernels/cpu/optimizer.h adamw_update, what a run without an optimizer
//    plugin calls),
//  - adam8bit's step (plugins/adam8bit/kernels.h: 8-bit block-wise moments, tensors under 4096
//    elements in f32, as the plugin keeps them),
//  - adafactor's update (plugins/adafactor/kernels.h: factored second moments, no first moment,
//    Hugging Face's defaults),
//  - amp's step over f32 masters with a bf16 compute copy: the host's AdamW then the cast of every
//    tensor to bf16 (kernels/cpu/convert.h round_bf16, what Gpt::sync_compute_params ran after
//    every update), and the AdamW that writes the bf16 copy in its own pass (cpu::Bf16Copy, the
//    fused update; HEADROOM_FUSE_CAST=0 turns it off in a run). A last line gives the fused
//    update's time over the update + cast's, round by round.
// They run in turn, `--reps` rounds (interleaved, so a change of load hits each alike); the
// table gives each one's median and its ratio to AdamW's, and the median (and range) of its
// ratio to AdamW's time in the same round. Every kernel runs on `--threads`
// OpenMP threads, the host's [device] threads.
//
//   build/bin/bench_optimizer_kernels [--reps 5] [--threads 2]
#include <omp.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optimizer.h"
#include "plugins/adafactor/kernels.h"
#include "plugins/adam8bit/kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Shape {
  uint64_t rows, cols;  // rows 1: a vector
};

// gpt2-124m's parameter tensors, (out, in) for the matrices.
std::vector<Shape> gpt2_124m() {
  const uint64_t C = 768, V = 50257, T = 1024;
  std::vector<Shape> s = {{V, C}, {T, C}};
  for (int l = 0; l < 12; ++l) {
    const std::vector<Shape> block = {{1, C}, {1, C}, {3 * C, C}, {1, 3 * C}, {C, C},     {1, C},
                                      {1, C}, {1, C}, {4 * C, C}, {1, 4 * C}, {C, 4 * C}, {1, C}};
    s.insert(s.end(), block.begin(), block.end());
  }
  s.push_back({1, C});
  s.push_back({1, C});
  return s;
}

// One tensor: weights, gradient and every optimizer's state.
struct Tensor {
  Shape shape;
  uint64_t n;
  std::vector<float> w, g;
  std::vector<float> m, v;  // AdamW's, and adam8bit's f32 moments of a small tensor
  std::vector<uint8_t> qm, qv;
  std::vector<float> am, av;
  std::vector<float> factored;  // adafactor: rows + cols, or numel for a vector
  std::vector<uint16_t> copy;   // amp's bf16 compute copy
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The optimizer plugins' update against the built-in AdamW on gpt2-124m's tensors"};
  int reps = 5, threads = 2;
  app.add_option("--reps", reps, "interleaved rounds")->check(CLI::Range(1, 1000));
  app.add_option("--threads", threads, "OpenMP threads")->check(CLI::Range(1, 1024));
  CLI11_PARSE(app, argc, argv);
  omp_set_num_threads(threads);
  headroom::cpu::set_threads(threads);

  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<Tensor> tensors;
  uint64_t params = 0;
  for (const Shape& s : gpt2_124m()) {
    Tensor t;
    t.shape = s;
    t.n = s.rows * s.cols;
    params += t.n;
    t.w.resize(t.n);
    t.g.resize(t.n);
    for (uint64_t i = 0; i < t.n; ++i) {
      t.w[i] = 0.02f * normal(rng);
      t.g[i] = 1e-3f * normal(rng);
    }
    t.m.assign(t.n, 0.0f);
    t.v.assign(t.n, 0.0f);
    t.qm.assign(t.n, 0);
    t.qv.assign(t.n, 0);
    t.am.assign(adam8bit::num_blocks(t.n), 0.0f);
    t.av.assign(adam8bit::num_blocks(t.n), 0.0f);
    t.factored.assign(s.rows > 1 ? s.rows + s.cols : t.n, 0.0f);
    t.copy.assign(t.n, 0);
    tensors.push_back(std::move(t));
  }
  const std::vector<float> map_m = adam8bit::dynamic_map(true),
                           map_v = adam8bit::dynamic_map(false);
  const adam8bit::Buckets buckets_m = adam8bit::buckets(adam8bit::thresholds(map_m).data()),
                          buckets_v = adam8bit::buckets(adam8bit::thresholds(map_v).data());
  for (Tensor& t : tensors) {
    std::fill(t.qm.begin(), t.qm.end(), adam8bit::zero_code(map_m.data()));
    std::fill(t.qv.begin(), t.qv.end(), adam8bit::zero_code(map_v.data()));
  }
  const uint64_t min_8bit_size = 4096;

  int64_t step = 0;
  auto adamw = [&] {
    for (Tensor& t : tensors)
      headroom::cpu::adamw_update<float>(t.w.data(), t.g.data(), t.m.data(), t.v.data(), t.n, 6e-4f,
                                         0.9f, 0.95f, 1e-8f, 0.1f, step);
  };
  auto adam8 = [&] {
    const adam8bit::Hyper h = adam8bit::make_hyper(6e-4, 0.9, 0.95, 1e-8, 0.1, step);
    for (Tensor& t : tensors) {
      adam8bit::ParamRef p;
      p.data = t.w.data();
      p.grad = t.g.data();
      p.numel = t.n;
      if (t.n < min_8bit_size) {
        adam8bit::step_f32(p, t.m.data(), t.v.data(), h);
        continue;
      }
      adam8bit::State8 s;
      s.qm = t.qm.data();
      s.qv = t.qv.data();
      s.absmax_m = t.am.data();
      s.absmax_v = t.av.data();
      s.map_m = map_m.data();
      s.map_v = map_v.data();
      s.buckets_m = &buckets_m;
      s.buckets_v = &buckets_v;
      adam8bit::step_8bit(p, s, h);
    }
  };
  auto adamw_then_cast = [&] {
    for (Tensor& t : tensors)
      headroom::cpu::adamw_update<float>(t.w.data(), t.g.data(), t.m.data(), t.v.data(), t.n, 6e-4f,
                                         0.9f, 0.95f, 1e-8f, 0.1f, step);
    for (Tensor& t : tensors)
      headroom::cpu::round_bf16(t.w.data(), t.copy.data(), t.n);
  };
  auto adamw_fused_cast = [&] {
    for (Tensor& t : tensors)
      headroom::cpu::adamw_update<float>(t.w.data(), t.g.data(), t.m.data(), t.v.data(), t.n, 6e-4f,
                                         0.9f, 0.95f, 1e-8f, 0.1f, step, 1.0f,
                                         headroom::cpu::Bf16Copy{t.copy.data()});
  };
  adafactor::Scratch scratch;
  auto adafac = [&] {
    adafactor::Hyper h;
    h.beta2 = 1.0 - std::pow(double(step), -0.8);
    h.rel = std::min(1e-2, 1.0 / std::sqrt(double(step)));
    for (Tensor& t : tensors) {
      adafactor::Tensor p;
      p.theta = t.w.data();
      p.grad = t.g.data();
      p.numel = t.n;
      if (t.shape.rows > 1) {
        p.rows = t.shape.rows;
        p.cols = t.shape.cols;
        p.row = t.factored.data();
        p.col = t.factored.data() + p.rows;
      } else {
        p.v = t.factored.data();
      }
      adafactor::update(p, h, false, false, scratch);
    }
  };

  struct Variant {
    const char* name;
    std::function<void()> run;
    std::vector<double> seconds;
  };
  std::vector<Variant> variants = {
      {"built-in AdamW (fp32 moments)", adamw, {}},
      {"adam8bit", adam8, {}},
      {"adafactor", adafac, {}},
      {"AdamW, then the cast to bf16 (amp, unfused)", adamw_then_cast, {}},
      {"AdamW writing the bf16 copy (amp, fused)", adamw_fused_cast, {}}};
  std::fprintf(stderr, "bench_optimizer_kernels: %llu parameters, %d threads, %d rounds\n",
               static_cast<unsigned long long>(params), threads, reps);
  for (int r = 0; r <= reps; ++r) {  // round 0 warms up (first touch of the state)
    ++step;
    for (Variant& v : variants) {
      const auto t0 = Clock::now();
      v.run();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r > 0) v.seconds.push_back(s);
    }
  }
  std::printf("gpt2-124m, %llu parameters, f32 weights and gradients, %d threads, median of %d\n\n",
              static_cast<unsigned long long>(params), threads, reps);
  std::printf(
      "| optimizer | step | against AdamW | ns a parameter | against AdamW, round by round "
      "(median, range) |\n|---|---:|---:|---:|---:|\n");
  const double base = median(variants.front().seconds);
  for (const Variant& v : variants) {
    const double m = median(v.seconds);
    std::vector<double> ratio;  // to AdamW of the same round: a change of load hits both alike
    for (size_t r = 0; r < v.seconds.size(); ++r)
      ratio.push_back(v.seconds[r] / variants.front().seconds[r]);
    std::printf("| %s | %.3f s | %.2f | %.2f | %.2f (%.2f-%.2f) |\n", v.name, m, m / base,
                1e9 * m / double(params), median(ratio),
                *std::min_element(ratio.begin(), ratio.end()),
                *std::max_element(ratio.begin(), ratio.end()));
  }
  // The fused update against the update + cast it replaces, in the same round.
  const Variant& unfused = variants[variants.size() - 2];
  const Variant& fused = variants.back();
  std::vector<double> ratio;
  for (size_t r = 0; r < fused.seconds.size(); ++r)
    ratio.push_back(fused.seconds[r] / unfused.seconds[r]);
  std::printf(
      "\namp's update and cast, fused against unfused: %.3f s against %.3f s, ratio %.2f; round "
      "by round %.2f (%.2f-%.2f)\n",
      median(fused.seconds), median(unfused.seconds),
      median(fused.seconds) / median(unfused.seconds), median(ratio),
      *std::min_element(ratio.begin(), ratio.end()), *std::max_element(ratio.begin(), ratio.end()));
  return 0;
}
