// The optimizer's update writing amp's compute copies in its own pass (issue 36, point 2), against
// the update followed by the cast it replaces, bitwise:
//  - the CPU backend's AdamW and SGD over f32 masters with f32 or bf16 gradients and state, a
//    clipping factor folded in or none, writing a bf16 or f16 copy: masters, gradients, state and
//    copy are those of adamw_update_stored / sgd_update_stored then cast(), at sizes with vector
//    tails, on 1 and 3 threads; a copy beside bf16 weights, or in f32, is refused;
//  - a whole amp run (bf16 and fp16, AdamW and SGD, f32 and bf16 gradients and state, clipping,
//    frozen parameters) with the fusion and with HEADROOM_FUSE_CAST=0: the same losses, gradient
//    norms, masters and compute copies; and with it every layer's cast after the step is skipped.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/device/backend.h"
#include "core/optim/optim.h"
#include "core/run/trainer.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/profile.h"
#include "tests/cpu_threads.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

using Bytes = std::vector<unsigned char>;

using Threads = test::CpuThreads;

// n values of dt, normal with standard deviation `scale`, as the backend rounds them.
Bytes random_values(Backend& be, Dtype dt, size_t n, uint32_t seed, double scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v)
    x = d(rng);
  Bytes out(n * dtype_size(dt));
  be.cast(out.data(), dt, v.data(), Dtype::kF64, n);
  return out;
}

// One update's operands: f32 masters, the gradient and state in their dtypes.
struct Operands {
  Bytes param, grad, m, v;
};

Operands make_operands(Backend& be, const Backend::Stored& o, size_t n, uint32_t seed) {
  Operands x;
  x.param = random_values(be, Dtype::kF32, n, seed, 0.5);
  x.grad = random_values(be, o.grad, n, seed + 1, 1e-2);
  // Adam's second moment is not negative; a few steps' worth of state.
  x.m = random_values(be, o.state, n, seed + 2, 1e-3);
  const Bytes v = random_values(be, Dtype::kF32, n, seed + 3, 1e-4);
  std::vector<float> vf(n);
  std::memcpy(vf.data(), v.data(), n * sizeof(float));
  for (float& f : vf)
    f = f * f;
  x.v.resize(n * dtype_size(o.state));
  be.cast(x.v.data(), o.state, vf.data(), Dtype::kF32, n);
  return x;
}

enum class Update { kAdamW, kSgd, kSgdMomentum };

void update(Backend& be, Update u, const Backend::Stored& o, Operands& x, size_t n) {
  switch (u) {
    case Update::kAdamW:
      be.adamw_update_stored(o, x.param.data(), x.grad.data(), x.m.data(), x.v.data(), n, 3e-3f,
                             0.9f, 0.95f, 1e-8f, 0.1f, 7);
      break;
    case Update::kSgd:
      be.sgd_update_stored(o, x.param.data(), x.grad.data(), nullptr, n, 3e-2f, 0.0f, 0.1f);
      break;
    case Update::kSgdMomentum:
      be.sgd_update_stored(o, x.param.data(), x.grad.data(), x.m.data(), n, 3e-2f, 0.9f, 0.1f);
      break;
  }
}

TEST(OptimizerCast, FusedUpdateIsTheUpdateThenTheCast) {
  std::unique_ptr<Backend> be = make_cpu_backend(3);
  // Below, at and past a vector of 16 floats, with tails; past the parallel threshold (2^14).
  const size_t sizes[] = {1, 7, 16, 17, 33, 1000, 70001};
  int cases = 0;
  for (int threads : {1, 3}) {
    Threads t(threads);
    for (Update u : {Update::kAdamW, Update::kSgd, Update::kSgdMomentum})
      for (Dtype grad : {Dtype::kF32, Dtype::kBF16})
        for (Dtype state : {Dtype::kF32, Dtype::kBF16})
          for (Dtype copy : {Dtype::kBF16, Dtype::kF16})
            for (float grad_scale : {1.0f, 0.37f})
              for (size_t n : sizes) {
                Backend::Stored o;
                o.grad = grad;
                o.state = state;
                o.grad_scale = grad_scale;
                o.seed = 0x5eed + uint32_t(n);
                const std::string what = "update " + std::to_string(int(u)) + " grad " +
                                         dtype_name(grad) + " state " + dtype_name(state) +
                                         " copy " + dtype_name(copy) + " scale " +
                                         std::to_string(grad_scale) + " n " + std::to_string(n) +
                                         " threads " + std::to_string(threads);
                Operands want = make_operands(*be, o, n, uint32_t(n) * 13);
                Operands got = want;
                update(*be, u, o, want, n);
                Bytes want_copy(n * 2), got_copy(n * 2, 0xAB);
                be->cast(want_copy.data(), copy, want.param.data(), Dtype::kF32, n);
                o.compute = got_copy.data();
                o.compute_dtype = copy;
                update(*be, u, o, got, n);
                EXPECT_EQ(got.param, want.param) << what << ": masters";
                EXPECT_EQ(got.grad, want.grad) << what << ": gradient";
                EXPECT_EQ(got.m, want.m) << what << ": state m";
                EXPECT_EQ(got.v, want.v) << what << ": state v";
                EXPECT_EQ(got_copy, want_copy) << what << ": compute copy";
                ++cases;
              }
  }
  EXPECT_EQ(cases, 2 * 3 * 2 * 2 * 2 * 2 * 7);
}

TEST(OptimizerCast, RefusesACopyBesideBf16WeightsOrInF32) {
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  std::vector<uint16_t> w(8, 0), g(8, 0), m(8, 0), v(8, 0), copy(8, 0);
  Backend::Stored o;
  o.param = Dtype::kBF16;
  o.grad = Dtype::kBF16;
  o.state = Dtype::kBF16;
  o.compute = copy.data();
  EXPECT_THROW(be->adamw_update_stored(o, w.data(), g.data(), m.data(), v.data(), 8, 1e-3f, 0.9f,
                                       0.95f, 1e-8f, 0.0f, 1),
               std::invalid_argument);
  EXPECT_THROW(be->sgd_update_stored(o, w.data(), g.data(), m.data(), 8, 1e-3f, 0.9f, 0.0f),
               std::invalid_argument);
  std::vector<float> wf(8, 0.0f), gf(8, 0.0f), mf(8, 0.0f), vf(8, 0.0f), cf(8, 0.0f);
  Backend::Stored f;
  f.compute = cf.data();
  f.compute_dtype = Dtype::kF32;
  EXPECT_THROW(be->adamw_update_stored(f, wf.data(), gf.data(), mf.data(), vf.data(), 8, 1e-3f,
                                       0.9f, 0.95f, 1e-8f, 0.0f, 1),
               std::invalid_argument);
}

// --- whole runs -------------------------------------------------------------------------------

// HEADROOM_FUSE_CAST=0 while it lives (read when the optimizer is made).
class NoFusedCast {
 public:
  NoFusedCast() { setenv("HEADROOM_FUSE_CAST", "0", 1); }
  ~NoFusedCast() { unsetenv("HEADROOM_FUSE_CAST"); }
};

struct RunResult {
  std::vector<double> losses, norms, clip;
  uint64_t updates = 0;                // steps not skipped
  uint64_t casts = 0;                  // the backend's cast calls over the run
  std::vector<Bytes> masters, copies;  // every parameter's, in params() order
  std::vector<bool> written;           // compute_copies_written of the last update's segments
  bool fused = false;                  // the optimizer wrote the compute copies
};

RunResult run(const std::string& toml, bool fuse) {
  std::unique_ptr<NoFusedCast> off;
  if (!fuse) off = std::make_unique<NoFusedCast>();
  Trainer t(test::config_from(toml), TrainOptions{});
  cpu::OpProfile& profile = cpu::op_profile();
  profile.reset();
  profile.enabled = true;
  t.run();
  profile.enabled = false;
  RunResult r;
  for (const auto& [name, stats] : profile.ops)
    if (name.rfind("cast ", 0) == 0) r.casts += stats.calls;
  profile.reset();
  for (const StepState& s : t.history()) {
    r.losses.push_back(s.loss);
    r.norms.push_back(s.grad_norm);
    r.clip.push_back(s.clip_coef);
    r.updates += s.skipped ? 0 : 1;
  }
  Gpt<float>& model = t.model();
  for (Param<float>* p : model.params()) {
    const auto m = p->master();
    const auto c = p->compute();
    r.masters.emplace_back();
    if (m.value != nullptr) {
      r.masters.back().resize(p->numel * sizeof(float));
      std::memcpy(r.masters.back().data(), m.value, r.masters.back().size());
    }
    r.copies.emplace_back(p->numel * dtype_size(c.dtype));
    std::memcpy(r.copies.back().data(), c.value, r.copies.back().size());
  }
  r.written = compute_copies_written(model, whole_params(model.trainable_params()));
  return r;
}

std::string model_toml() {
  return "[model]\nn_layer = 2\nn_head = 2\nn_embd = 64\nseq_len = 32\nvocab_size = 64\n";
}

// `fused`, when given, gets the fused run.
void expect_fused_run_is_unfused_run(const std::string& train, const std::string& amp,
                                     RunResult* fused_out = nullptr) {
  const std::string toml =
      model_toml() + "[train]\nsteps = 4\nmicro_batch = 4\ngrad_accum = 2\nwarmup_steps = 2\n" +
      train + "[[plugins]]\nname = \"amp\"\n" + amp;
  SCOPED_TRACE(toml);
  const RunResult unfused = run(toml, false);
  const RunResult fused = run(toml, true);
  if (fused_out) *fused_out = fused;
  ASSERT_EQ(fused.losses.size(), 4u);
  EXPECT_EQ(fused.losses, unfused.losses);
  EXPECT_EQ(fused.norms, unfused.norms);
  EXPECT_EQ(fused.clip, unfused.clip);
  ASSERT_EQ(fused.masters.size(), unfused.masters.size());
  for (size_t i = 0; i < fused.masters.size(); ++i) {
    EXPECT_EQ(fused.masters[i], unfused.masters[i]) << "parameter " << i << " masters";
    EXPECT_EQ(fused.copies[i], unfused.copies[i]) << "parameter " << i << " compute copy";
  }
  // The fusion did happen: every layer with trainable parameters had its compute copy written by
  // the update (the embedding, the blocks, the head's LayerNorm), so no cast ran after it.
  uint64_t written = 0;
  for (bool w : fused.written)
    written += w ? 1 : 0;
  EXPECT_GE(written, 3u);
  EXPECT_EQ(fused.updates, unfused.updates);
  EXPECT_GT(fused.updates, 0u);
  EXPECT_EQ(unfused.casts - fused.casts, fused.updates * written)
      << "unfused " << unfused.casts << " casts, fused " << fused.casts;
}

// Some step clipped its gradients (the factor folded into the update).
bool clipped(const RunResult& r) {
  for (double c : r.clip)
    if (c < 1.0) return true;
  return false;
}

TEST(OptimizerCast, AmpBf16RunIsBitwiseTheUnfusedRun) {
  expect_fused_run_is_unfused_run("lr = 3e-3\n", "dtype = \"bf16\"\n");
}

TEST(OptimizerCast, AmpBf16ClippedRunWithBf16GradientsAndStateIsBitwiseTheUnfusedRun) {
  RunResult r;
  expect_fused_run_is_unfused_run(
      "lr = 3e-3\ngrad_clip = 0.05\n",
      "dtype = \"bf16\"\ngrad_dtype = \"bf16\"\nstate_dtype = \"bf16\"\n", &r);
  EXPECT_TRUE(clipped(r));
}

TEST(OptimizerCast, AmpBf16SgdRunIsBitwiseTheUnfusedRun) {
  expect_fused_run_is_unfused_run("optimizer = \"sgd\"\nmomentum = 0.9\nlr = 3e-2\n",
                                  "dtype = \"bf16\"\n");
}

TEST(OptimizerCast, AmpFp16RunIsBitwiseTheUnfusedRun) {
  RunResult r;
  expect_fused_run_is_unfused_run("lr = 3e-3\ngrad_clip = 0.05\n",
                                  "dtype = \"fp16\"\ninit_scale = 1024.0\n", &r);
  EXPECT_TRUE(clipped(r));
}

TEST(OptimizerCast, AmpBf16RunWithFrozenParametersIsBitwiseTheUnfusedRun) {
  expect_fused_run_is_unfused_run("lr = 3e-3\nfreeze = [\"wte.weight\", \"h.0.mlp.*\"]\n",
                                  "dtype = \"bf16\"\n");
}

// Every layer's compute copy is covered by the whole-parameter segments of an amp model, and
// by none without compute copies or without masters.
TEST(OptimizerCast, WholeParamsCarryTheComputeCopiesOfMasters) {
  const std::string base = model_toml() + "[train]\nsteps = 1\nmicro_batch = 2\n";
  {
    Trainer t(test::config_from(base + "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n"),
              TrainOptions{});
    const std::vector<OptSegment> s = whole_params(t.model().trainable_params());
    for (const OptSegment& x : s) {
      EXPECT_NE(x.compute, nullptr) << x.name;
      EXPECT_EQ(x.compute_dtype, Dtype::kBF16) << x.name;
    }
    const std::vector<bool> w = compute_copies_written(t.model(), s);
    ASSERT_EQ(w.size(), t.model().layers().size());
    for (size_t l = 0; l < w.size(); ++l)
      EXPECT_EQ(w[l], t.model().layers()[l]->flat().numel > 0) << "layer " << l;
    // A segment left out: its layer is cast after the step again.
    std::vector<OptSegment> partial = s;
    partial.back().compute = nullptr;
    const std::vector<bool> wp = compute_copies_written(t.model(), partial);
    EXPECT_NE(wp, w);
  }
  {
    Trainer t(test::config_from(base), TrainOptions{});
    for (const OptSegment& x : whole_params(t.model().trainable_params()))
      EXPECT_EQ(x.compute, nullptr) << x.name;
  }
  {
    Trainer t(test::config_from(base + "[[plugins]]\nname = \"amp\"\ndtype = \"bf16\"\n"
                                       "master_weights = false\n"),
              TrainOptions{});
    for (const OptSegment& x : whole_params(t.model().trainable_params()))
      EXPECT_EQ(x.compute, nullptr) << x.name;
  }
}

}  // namespace
}  // namespace headroom
