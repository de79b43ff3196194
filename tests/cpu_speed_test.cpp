// The loop's waits and the CPU backend's threads (issue 20): the host-sync count per step, the
// fused gradient norm, [device] threads, and the element-wise kernels' results for any thread
// count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/optim/optim.h"
#include "core/run/trainer.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/gemm_lowp.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/parallel.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

const char* kTiny =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 16\nseq_len = 8\nvocab_size = 32\n"
    "[train]\nsteps = 3\nmicro_batch = 2\ngrad_clip = 1.0\n";

// On the CUDA backend's accounting (the CPU backend counts the calls CUDA would wait in), an
// optimizer step of one micro-step and no plugins waits at most 4 times; in fact twice: the loss
// and the gradient norm (one fused reduction, not one per parameter). The staging buffers are
// double-buffered behind upload events, not a synchronize (the CPU's uploads never wait).
TEST(HostSyncs, AtMostFourPerOptimizerStepWithoutPlugins) {
  Trainer trainer(test::config_from(kTiny), TrainOptions{});
  trainer.run();
  ASSERT_EQ(trainer.history().size(), 3u);
  const size_t params = trainer.model().params().size();
  ASSERT_GT(params, 4u);  // one wait per parameter would be well over the bound
  for (const StepState& r : trainer.history()) {
    EXPECT_GE(r.host_syncs, 1u) << "step " << r.step;
    EXPECT_LE(r.host_syncs, 4u) << "step " << r.step;
    EXPECT_EQ(r.host_syncs, 2u) << "step " << r.step << ": the loss and the gradient norm";
  }
}

// Every micro-step adds its loss read, nothing else (no synchronize before its upload).
TEST(HostSyncs, GrowByTheMicroStepsOnly) {
  Trainer one(test::config_from(kTiny), TrainOptions{});
  one.run();
  Trainer two(test::config_from(kTiny, {"train.grad_accum=2"}), TrainOptions{});
  two.run();
  for (size_t i = 0; i < one.history().size(); ++i)
    EXPECT_EQ(two.history()[i].host_syncs, one.history()[i].host_syncs + 1) << "step " << i + 1;
}

// The fused norm is the per-tensor norms' sum (exactly: each span summed as sum_squares does,
// added in order), with one wait instead of one per tensor.
TEST(FusedNorm, EqualsTheSumOfPerTensorSumsWithOneWait) {
  auto device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const std::vector<uint64_t> sizes = {1, 7, 64, 1000, 40000, 3, 100003};
  std::vector<std::vector<float>> f32(sizes.size());
  std::vector<Backend::Span> spans;
  for (size_t i = 0; i < sizes.size(); ++i) {
    f32[i].resize(sizes[i]);
    for (float& x : f32[i])
      x = nd(rng);
    spans.push_back({Dtype::kF32, f32[i].data(), sizes[i]});
  }
  // A bf16 tensor among them (amp's compute-dtype gradients).
  std::vector<uint16_t> bf(513);
  for (size_t i = 0; i < bf.size(); ++i)
    bf[i] = uint16_t(0x3F80 + (i % 97));  // 1.0 .. about 1.7
  spans.push_back({Dtype::kBF16, bf.data(), bf.size()});

  double separate = 0.0;
  const uint64_t s0 = ops.host_syncs();
  for (const Backend::Span& s : spans)
    separate += ops.sum_squares(s.dtype, s.data, s.numel);
  const uint64_t s1 = ops.host_syncs();
  const double fused = ops.sum_squares_many(spans);
  const uint64_t s2 = ops.host_syncs();
  EXPECT_EQ(s1 - s0, spans.size());
  EXPECT_EQ(s2 - s1, 1u);
  EXPECT_NEAR(fused, separate, 1e-6 * separate);
  EXPECT_EQ(fused, separate);  // the same sums, added in the same order
  EXPECT_EQ(ops.sum_squares_many({}), 0.0);
}

// amp's fused overflow check is the or of the per-tensor checks, with one wait instead of one a
// tensor: no NaN or infinity anywhere, then one in each span in turn, in each dtype.
TEST(FusedNonfinite, EqualsThePerTensorChecksWithOneWait) {
  auto device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  const std::vector<uint64_t> sizes = {1, 7, 1000, 40000, 100003};
  std::vector<std::vector<float>> f32(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i)
    f32[i].assign(sizes[i], 0.5f + float(i));
  std::vector<uint16_t> bf(513, 0x3F80);  // bf16 1.0
  std::vector<uint16_t> hf(257, 0x3C00);  // fp16 1.0
  auto spans_now = [&] {
    std::vector<Backend::Span> spans;
    for (size_t i = 0; i < sizes.size(); ++i)
      spans.push_back({Dtype::kF32, f32[i].data(), sizes[i]});
    spans.push_back({Dtype::kBF16, bf.data(), bf.size()});
    spans.push_back({Dtype::kF16, hf.data(), hf.size()});
    return spans;
  };
  auto separate = [&](const std::vector<Backend::Span>& spans) {
    bool any = false;
    for (const Backend::Span& s : spans)
      any = ops.any_nonfinite(s.dtype, s.data, s.numel) || any;
    return any;
  };
  const std::vector<Backend::Span> clean = spans_now();
  const uint64_t s0 = ops.host_syncs();
  EXPECT_FALSE(ops.any_nonfinite_many(clean));
  EXPECT_EQ(ops.host_syncs() - s0, 1u);
  EXPECT_FALSE(separate(clean));
  EXPECT_FALSE(ops.any_nonfinite_many({}));
  // One bad value at a time: in the last element of each f32 span, then in the bf16 and fp16 ones.
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      f32[i].back() = bad;
      const std::vector<Backend::Span> spans = spans_now();
      EXPECT_TRUE(ops.any_nonfinite_many(spans)) << "span " << i;
      EXPECT_EQ(ops.any_nonfinite_many(spans), separate(spans));
      f32[i].back() = 0.5f + float(i);
    }
  }
  bf[100] = 0x7F80;  // bf16 +inf
  EXPECT_TRUE(ops.any_nonfinite_many(spans_now()));
  bf[100] = 0x3F80;
  hf[200] = 0x7E00;  // fp16 NaN
  EXPECT_TRUE(ops.any_nonfinite_many(spans_now()));
  hf[200] = 0x3C00;
  EXPECT_FALSE(ops.any_nonfinite_many(spans_now()));
}

// amp fp16 checks every gradient for an overflow each step: one fused wait on top of a plain
// run's, where one op_nonfinite a gradient was one wait a parameter.
TEST(HostSyncs, AmpFp16AddsOneWaitForItsOverflowCheck) {
  Trainer plain(test::config_from(kTiny), TrainOptions{});
  plain.run();
  // A scale small enough that no step overflows (an overflow skips the step, and its waits).
  Trainer amp(
      test::config_from(std::string(kTiny) + "[[plugins]]\nname = \"amp\"\ndtype = \"fp16\"\n"
                                             "init_scale = 1024.0\n"),
      TrainOptions{});
  amp.run();
  ASSERT_EQ(amp.history().size(), plain.history().size());
  ASSERT_GT(amp.model().params().size(), 4u);
  for (size_t i = 0; i < amp.history().size(); ++i) {
    EXPECT_FALSE(amp.history()[i].skipped) << "step " << i + 1;
    EXPECT_EQ(amp.history()[i].host_syncs, plain.history()[i].host_syncs + 1) << "step " << i + 1;
  }
}

// Grad::kWrite gives the bits of a zero fill (or a copy of dres) followed by the accumulating op,
// whatever the buffer held: matmul, GELU and LayerNorm backward, in f32 and bf16.
TEST(GradWrite, EqualsFillThenAccumulateBitwise) {
  auto device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  const int N = 37, C = 48, OC = 80;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto f32 = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v)
      x = nd(rng);
    return v;
  };
  for (const Dtype dt : {Dtype::kF32, Dtype::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    // Tensors in dt (bf16: rounded from the f32 values).
    auto in_dt = [&](const std::vector<float>& v) {
      std::vector<uint8_t> b(v.size() * dtype_size(dt));
      ops.cast(b.data(), dt, v.data(), Dtype::kF32, v.size());
      return b;
    };
    const auto dout = in_dt(f32(size_t(N) * OC)), inp = in_dt(f32(size_t(N) * C));
    const auto w = in_dt(f32(size_t(OC) * C)), dres = in_dt(f32(size_t(N) * C));
    const auto x = in_dt(f32(size_t(N) * C)), lnw = in_dt(f32(C)), lnb = in_dt(f32(C));
    const auto garbage = in_dt(f32(size_t(N) * OC));  // what a workspace may hold
    std::vector<float> mean(N), rstd(N);
    std::vector<uint8_t> lnout(size_t(N) * C * dtype_size(dt));
    ops.layernorm_forward(dt, lnout.data(), mean.data(), rstd.data(), x.data(), lnw.data(),
                          lnb.data(), N, C);
    const size_t nc = size_t(N) * C * dtype_size(dt);

    // matmul_backward's dinp (dweight accumulates either way: its own buffers)
    std::vector<uint8_t> acc(nc), wr(garbage.begin(), garbage.begin() + nc);
    std::vector<uint8_t> dw1(size_t(OC) * C * dtype_size(dt)), dw2 = dw1;
    ops.fill(dt, acc.data(), size_t(N) * C, 0.0);
    ops.fill(dt, dw1.data(), size_t(OC) * C, 0.0);
    ops.fill(dt, dw2.data(), size_t(OC) * C, 0.0);
    ops.matmul_backward(dt, acc.data(), dw1.data(), nullptr, dout.data(), inp.data(), w.data(), N,
                        C, OC);
    ops.matmul_backward(dt, wr.data(), dw2.data(), nullptr, dout.data(), inp.data(), w.data(), N, C,
                        OC, Grad::kWrite);
    EXPECT_EQ(acc, wr) << "matmul_backward";
    EXPECT_EQ(dw1, dw2);

    // gelu_backward over (N, C)
    acc.assign(nc, 0);
    ops.fill(dt, acc.data(), size_t(N) * C, 0.0);
    wr.assign(garbage.begin(), garbage.begin() + nc);
    ops.gelu_backward(dt, acc.data(), inp.data(), dres.data(), size_t(N) * C);
    ops.gelu_backward(dt, wr.data(), inp.data(), dres.data(), size_t(N) * C, Grad::kWrite);
    EXPECT_EQ(acc, wr) << "gelu_backward";

    // layernorm_backward: written from 0, and from the residual path's gradient
    for (const bool residual : {false, true}) {
      SCOPED_TRACE(residual ? "dres" : "no dres");
      std::vector<uint8_t> pw1(C * dtype_size(dt)), pb1(pw1.size());
      ops.fill(dt, pw1.data(), C, 0.0);
      ops.fill(dt, pb1.data(), C, 0.0);
      std::vector<uint8_t> pw2 = pw1, pb2 = pb1;
      if (residual) {
        acc = dres;
      } else {
        ops.fill(dt, acc.data(), size_t(N) * C, 0.0);
      }
      wr.assign(garbage.begin(), garbage.begin() + nc);
      const auto dy = in_dt(f32(size_t(N) * C));
      ops.layernorm_backward(dt, acc.data(), pw1.data(), pb1.data(), dy.data(), x.data(),
                             lnw.data(), mean.data(), rstd.data(), N, C);
      ops.layernorm_backward(dt, wr.data(), pw2.data(), pb2.data(), dy.data(), x.data(), lnw.data(),
                             mean.data(), rstd.data(), N, C, Grad::kWrite,
                             residual ? dres.data() : nullptr);
      EXPECT_EQ(acc, wr) << "layernorm_backward";
      EXPECT_EQ(pw1, pw2);
      EXPECT_EQ(pb1, pb2);
    }
  }
  // dres goes with kWrite only.
  std::vector<float> a(size_t(N) * C), m(N), r(N), c(C);
  EXPECT_THROW(
      ops.layernorm_backward(Dtype::kF32, a.data(), c.data(), c.data(), a.data(), a.data(),
                             c.data(), m.data(), r.data(), N, C, Grad::kAccumulate, a.data()),
      OpError);
}

// Clipping folded into the update (Backend::Stored::grad_scale) against the separate pass that
// scales the gradients first: within 1e-6, and in fact bitwise (the same f32 products).
TEST(ClipFolded, EqualsTheSeparatePassForAdamWAndSgd) {
  auto device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  const size_t n = 50000;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> p0(n), g0(n);
  for (size_t i = 0; i < n; ++i)
    p0[i] = nd(rng), g0[i] = 5.0f * nd(rng);
  const float factor = clip_factor(1234.5, 1.0);  // what the trainer passes
  ASSERT_LT(factor, 1.0f);
  for (const bool adamw : {true, false}) {
    SCOPED_TRACE(adamw ? "adamw" : "sgd");
    std::vector<float> pa = p0, ga = g0, ma(n, 0.1f), va(n, 0.2f);  // separate pass
    std::vector<float> pb = p0, gb = g0, mb(n, 0.1f), vb(n, 0.2f);  // folded
    Backend::Stored plain, folded;
    folded.grad_scale = factor;
    for (int64_t step = 1; step <= 3; ++step) {
      ops.scale(Dtype::kF32, ga.data(), n, factor);
      if (adamw) {
        ops.adamw_update_stored(plain, pa.data(), ga.data(), ma.data(), va.data(), n, 1e-2f, 0.9f,
                                0.95f, 1e-8f, 0.1f, step);
        ops.adamw_update_stored(folded, pb.data(), gb.data(), mb.data(), vb.data(), n, 1e-2f, 0.9f,
                                0.95f, 1e-8f, 0.1f, step);
      } else {
        ops.sgd_update_stored(plain, pa.data(), ga.data(), ma.data(), n, 1e-2f, 0.9f, 0.1f);
        ops.sgd_update_stored(folded, pb.data(), gb.data(), mb.data(), n, 1e-2f, 0.9f, 0.1f);
      }
      ga = g0;
    }
    EXPECT_EQ(gb, g0);  // folded: the gradients are not touched
    double worst = 0.0;
    for (size_t i = 0; i < n; ++i)
      worst = std::max(worst,
                       std::abs(double(pa[i]) - pb[i]) / std::max(1e-30, std::abs(double(pa[i]))));
    EXPECT_LT(worst, 1e-6);
    EXPECT_EQ(pa, pb);
    EXPECT_EQ(ma, mb);
  }
}

// The built-in optimizers take the clipping factor into their update (the trainer then scales no
// gradient); an optimizer that does not say so gets the gradients clipped in place.
TEST(ClipFolded, BuiltInOptimizersFoldPluginsDoNot) {
  auto device = Device::create(DeviceConfig{});
  TrainConfig t;
  EXPECT_TRUE(make_optimizer(t, *device)->fold_grad_scale(0.5f));
  t.optimizer = "sgd";
  EXPECT_TRUE(make_optimizer(t, *device)->fold_grad_scale(0.5f));
}

// Clipping is folded wherever nothing can read the clipped gradients: also with amp (its hook is
// GRADS_READY, before clipping). The last step's gradients stay in place after the run: folded,
// they are the unclipped ones (their norm is the step's grad_norm); with a listener, which may
// read them at OPTIMIZER_STEP, they are clipped in place (norm grad_clip).
TEST(ClipFolded, AlsoWithAmpNotWithAListener) {
  const std::string toml = std::string(kTiny) + "[[plugins]]\nname = \"amp\"\n";
  auto last_grad_norm = [](Trainer& t) {
    double ss = 0.0;
    for (Param<float>* p : t.model().params())
      for (uint64_t i = 0; i < p->numel; ++i)
        ss += double(p->master().grad[i]) * p->master().grad[i];
    return std::sqrt(ss);
  };
  Trainer folded(test::config_from(toml, {"train.grad_clip=0.05"}), TrainOptions{});
  folded.run();
  const double norm = folded.history().back().grad_norm;
  ASSERT_GT(norm, 0.1) << "the step must clip for the test to say anything";
  EXPECT_NEAR(last_grad_norm(folded), norm, 1e-6 * norm);

  struct Quiet final : EventListener {
    void on_event(const EventInfo&) override {}
  } quiet;
  Trainer clipped(test::config_from(toml, {"train.grad_clip=0.05"}), TrainOptions{});
  clipped.add_listener(&quiet);
  clipped.run();
  EXPECT_NEAR(last_grad_norm(clipped), 0.05, 1e-4);
  // The same update either way.
  ASSERT_EQ(folded.history().size(), clipped.history().size());
  for (size_t i = 0; i < folded.history().size(); ++i)
    EXPECT_EQ(folded.history()[i].loss, clipped.history()[i].loss) << "step " << i + 1;
}

TEST(DeviceThreads, KeyIsReadAndChecked) {
  EXPECT_EQ(test::config_from("[device]\nthreads = 3\n").device.threads, 3);
  EXPECT_EQ(test::config_from("").device.threads, 0);
  const std::string e = test::error_of([] { test::config_from("[device]\nthreads = -1\n"); });
  EXPECT_TRUE(test::contains(e, "threads")) << e;
}

// The element-wise kernels give bitwise the same results on 1 and on 3 threads (static
// partitions, sums over rows split over columns: kernels/cpu/parallel.h).
TEST(CpuThreads, ElementWiseKernelsAreBitwiseTheSameForAnyThreadCount) {
  const int N = 96, C = 200, V = 300;  // above kParallelMin, so the loops do split
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randn = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v)
      x = nd(rng);
    return v;
  };
  const std::vector<float> x = randn(size_t(N) * C), w = randn(C), b = randn(C),
                           dy = randn(size_t(N) * C), logits0 = randn(size_t(N) * V),
                           p0 = randn(size_t(N) * C), g = randn(size_t(N) * C);
  std::vector<int32_t> tokens(N), targets(N);
  for (int i = 0; i < N; ++i) {
    tokens[i] = (i * 7) % 13;  // repeated tokens: the embedding's scatter adds into shared rows
    targets[i] = (i * 5) % V;
  }
  struct Out {
    std::vector<float> ln, mean, rstd, dx, dw, db, gelu, dgelu, logits, losses, dwte, dwpe, bias,
        param, m, v;
  };
  auto run = [&](int threads) {
    cpu::set_threads(threads);
    Out o;
    o.ln.resize(size_t(N) * C), o.mean.resize(N), o.rstd.resize(N);
    cpu::layernorm_forward(o.ln.data(), o.mean.data(), o.rstd.data(), x.data(), w.data(), b.data(),
                           N, C);
    o.dx.assign(size_t(N) * C, 0.0f), o.dw.assign(C, 0.0f), o.db.assign(C, 0.0f);
    cpu::layernorm_backward(o.dx.data(), o.dw.data(), o.db.data(), dy.data(), x.data(), w.data(),
                            o.mean.data(), o.rstd.data(), N, C);
    o.gelu.resize(size_t(N) * C), o.dgelu.assign(size_t(N) * C, 0.0f);
    cpu::gelu_forward(o.gelu.data(), x.data(), size_t(N) * C);
    cpu::gelu_backward(o.dgelu.data(), x.data(), dy.data(), size_t(N) * C);
    o.logits = logits0, o.losses.resize(N);
    cpu::crossentropy_forward_backward(o.logits.data(), o.losses.data(), targets.data(), N, V,
                                       1.0f / N);
    o.dwte.assign(size_t(13) * C, 0.0f), o.dwpe.assign(size_t(N) * C, 0.0f);
    cpu::embedding_backward(o.dwte.data(), o.dwpe.data(), dy.data(), tokens.data(), 1, N, C);
    o.bias.assign(C, 0.0f);
    cpu::matmul_backward<float>(nullptr, nullptr, o.bias.data(), dy.data(), x.data(), w.data(), N,
                                C, C);
    o.param = p0, o.m.assign(p0.size(), 0.0f), o.v.assign(p0.size(), 0.0f);
    cpu::adamw_update(o.param.data(), g.data(), o.m.data(), o.v.data(), p0.size(), 1e-3f, 0.9f,
                      0.95f, 1e-8f, 0.1f, 1);
    cpu::set_threads(0);
    return o;
  };
  const Out a = run(1), c = run(3);
  EXPECT_EQ(a.ln, c.ln);
  EXPECT_EQ(a.mean, c.mean);
  EXPECT_EQ(a.rstd, c.rstd);
  EXPECT_EQ(a.dx, c.dx);
  EXPECT_EQ(a.dw, c.dw);
  EXPECT_EQ(a.db, c.db);
  EXPECT_EQ(a.gelu, c.gelu);
  EXPECT_EQ(a.dgelu, c.dgelu);
  EXPECT_EQ(a.logits, c.logits);
  EXPECT_EQ(a.losses, c.losses);
  EXPECT_EQ(a.dwte, c.dwte);
  EXPECT_EQ(a.dwpe, c.dwpe);
  EXPECT_EQ(a.bias, c.bias);
  EXPECT_EQ(a.param, c.param);
  EXPECT_EQ(a.m, c.m);
  EXPECT_EQ(a.v, c.v);
}

// A run on 2 threads is bitwise the run on 2 threads again (fixed partitions, no reduction whose
// order depends on scheduling), and within 1e-6 of the run on 1 thread (only the GEMM library's
// blocking may differ between thread counts).
// The parallel zero fill (the gradients' at every step): every byte of a buffer that ends inside
// a chunk is zero, and nothing beside it is touched, on one thread and on several.
TEST(CpuThreads, ZeroBytesClearsExactlyTheRange) {
  const size_t chunk = size_t(1) << 20;
  for (const int threads : {1, 3})
    for (const size_t bytes : {size_t(0), size_t(1), chunk - 1, chunk, 3 * chunk + 4097}) {
      cpu::set_threads(threads);
      std::vector<unsigned char> buf(bytes + 2, 0xAB);
      cpu::zero_bytes(buf.data() + 1, bytes);
      EXPECT_EQ(buf.front(), 0xAB);
      EXPECT_EQ(buf.back(), 0xAB);
      EXPECT_EQ(size_t(std::count(buf.begin() + 1, buf.end() - 1, 0)), bytes)
          << bytes << " bytes on " << threads << " threads";
    }
  cpu::set_threads(0);
}

TEST(CpuThreads, RunsAreDeterministicForAThreadCount) {
  auto losses = [](const std::string& threads) {
    Trainer t(test::config_from(kTiny, {"device.threads=" + threads}), TrainOptions{});
    t.run();
    std::vector<double> l;
    for (const StepState& r : t.history())
      l.push_back(r.loss);
    return l;
  };
  const std::vector<double> two = losses("2"), again = losses("2"), one = losses("1");
  EXPECT_EQ(two, again);
  EXPECT_LT(test::relative_error(two, one), 1e-6);
}

// The 16-bit GEMMs (kernels/cpu/gemm_lowp.h: oneDNN's matmul where it is fast, the widened f32
// GEMM elsewhere) against a double-precision product of the same 16-bit operands: within the
// rounding of the output to the 16-bit dtype plus f32 accumulation, over both transposes, odd
// sizes, bias, accumulation onto C, bf16 and f16.
TEST(LowpGemm, MatchesADoubleReferenceOverTransposesAndShapes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct Dims {
    int M, N, K;
  };
  const Dims shapes[] = {{1, 1, 1}, {7, 13, 5}, {37, 80, 48}, {64, 64, 64}, {129, 257, 95}};
  for (const cpu::Lowp dt : {cpu::Lowp::kBF16, cpu::Lowp::kF16}) {
    const bool bf = dt == cpu::Lowp::kBF16;
    SCOPED_TRACE(bf ? "bf16" : "f16");
    std::printf("%s\n", cpu::lowp_gemm_library(dt).c_str());
    auto to16 = [bf](float f) { return bf ? float_to_bf16(f) : float_to_f16(f); };
    auto to32 = [bf](uint16_t h) { return bf ? bf16_to_float(h) : f16_to_float(h); };
    auto random16 = [&](size_t n) {
      std::vector<uint16_t> v(n);
      for (uint16_t& x : v)
        x = to16(nd(rng));
      return v;
    };
    for (const Dims& d : shapes)
      for (int t = 0; t < 4; ++t)
        for (int mode = 0; mode < 3; ++mode) {  // 0: plain, 1: + bias, 2: + C
          const bool ta = t & 1, tb = t & 2, bias = mode == 1, acc = mode == 2;
          SCOPED_TRACE(::testing::Message() << d.M << "x" << d.N << "x" << d.K << " ta " << ta
                                            << " tb " << tb << " mode " << mode);
          const int lda = ta ? d.M : d.K, ldb = tb ? d.K : d.N, ldc = d.N;
          const auto A = random16(size_t(d.M) * d.K), B = random16(size_t(d.K) * d.N);
          const auto bv = random16(size_t(d.N));
          const auto C0 = random16(size_t(d.M) * d.N);
          std::vector<uint16_t> C = C0;
          cpu::gemm_lowp_or_widened(dt, ta, tb, d.M, d.N, d.K, A.data(), lda, B.data(), ldb,
                                    bias ? bv.data() : nullptr, acc, C.data(), ldc);
          for (int m = 0; m < d.M; ++m)
            for (int n = 0; n < d.N; ++n) {
              double ref = acc ? to32(C0[size_t(m) * ldc + n]) : bias ? to32(bv[n]) : 0.0;
              double mag = std::fabs(ref);
              for (int k = 0; k < d.K; ++k) {
                const double a = to32(A[ta ? size_t(k) * lda + m : size_t(m) * lda + k]);
                const double b = to32(B[tb ? size_t(n) * ldb + k : size_t(k) * ldb + n]);
                ref += a * b;
                mag += std::fabs(a * b);
              }
              const double got = to32(C[size_t(m) * ldc + n]);
              // Half an ulp of the output's rounding (bf16: 2^-9, f16: 2^-12 relative), plus f32
              // accumulation (K terms).
              const double tol = (bf ? 0x1p-8 : 0x1p-11) * std::fabs(ref) + 1e-6 * mag + 1e-7;
              ASSERT_NEAR(got, ref, tol) << "at " << m << "," << n;
            }
        }
  }
}

// The CPU backend's bf16 linear layer against its f32 one on the widened operands: forward and
// both weight and input gradients within bf16 rounding; the bias gradient bitwise (summed in f32
// rows in order, rounded once, as the widened path does).
TEST(LowpGemm, Bf16MatmulLayerMatchesTheF32LayerOnWidenedOperands) {
  auto device = Device::create(DeviceConfig{});
  Backend& ops = device->backend();
  const int N = 67, C = 96, OC = 130;
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto bf16 = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v)
      x = float_to_bf16(nd(rng));
    return v;
  };
  auto wide = [](const std::vector<uint16_t>& v) {
    std::vector<float> f(v.size());
    for (size_t i = 0; i < v.size(); ++i)
      f[i] = bf16_to_float(v[i]);
    return f;
  };
  auto close = [](const std::vector<uint16_t>& got, const std::vector<float>& ref, int K,
                  const char* what) {
    double worst = 0.0;
    for (size_t i = 0; i < ref.size(); ++i)
      worst = std::max(worst, std::fabs(double(bf16_to_float(got[i])) - ref[i]) /
                                  (std::fabs(ref[i]) + 1e-3 * std::sqrt(double(K))));
    EXPECT_LT(worst, 1.0 / 128) << what;
  };
  const auto inp = bf16(size_t(N) * C), w = bf16(size_t(OC) * C), b = bf16(OC);
  const auto dout = bf16(size_t(N) * OC);
  const auto dinp0 = bf16(size_t(N) * C), dw0 = bf16(size_t(OC) * C), db0 = bf16(OC);
  std::vector<uint16_t> out(size_t(N) * OC), dinp = dinp0, dw = dw0, db = db0;
  ops.matmul_forward(Dtype::kBF16, out.data(), inp.data(), w.data(), b.data(), N, C, OC);
  ops.matmul_backward(Dtype::kBF16, dinp.data(), dw.data(), db.data(), dout.data(), inp.data(),
                      w.data(), N, C, OC);
  const auto finp = wide(inp), fw = wide(w), fb = wide(b), fdout = wide(dout);
  std::vector<float> fout(out.size()), fdinp = wide(dinp0), fdw = wide(dw0), fdb = wide(db0);
  ops.matmul_forward(Dtype::kF32, fout.data(), finp.data(), fw.data(), fb.data(), N, C, OC);
  ops.matmul_backward(Dtype::kF32, fdinp.data(), fdw.data(), fdb.data(), fdout.data(), finp.data(),
                      fw.data(), N, C, OC);
  close(out, fout, C, "out");
  close(dinp, fdinp, OC, "dinp");
  close(dw, fdw, N, "dweight");
  for (int o = 0; o < OC; ++o)
    ASSERT_EQ(db[o], float_to_bf16(fdb[o])) << "dbias " << o;
  // Written, not accumulated: the same as accumulating onto zeros.
  std::vector<uint16_t> dinp_w(dinp0), dinp_z(dinp0.size(), 0), dw1 = dw0, dw2 = dw0;
  ops.matmul_backward(Dtype::kBF16, dinp_w.data(), dw1.data(), nullptr, dout.data(), inp.data(),
                      w.data(), N, C, OC, Grad::kWrite);
  ops.matmul_backward(Dtype::kBF16, dinp_z.data(), dw2.data(), nullptr, dout.data(), inp.data(),
                      w.data(), N, C, OC);
  EXPECT_EQ(dinp_w, dinp_z);
  EXPECT_EQ(dw1, dw2);
}

}  // namespace
}  // namespace headroom
