// The pieces around the model: the memory tracker and wall, the optimizers and schedule, the data
// sources, and the order of the loop's events.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "core/data/data.h"
#include "core/device/device.h"
#include "core/optim/optim.h"
#include "core/run/trainer.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// ---------------------------------------------------------------------------------------------
// Memory

TEST(MemoryWall, AllocationPastTheLimitFailsWithAReportAndAllocatesNothing) {
  // The limit is the CPU arena's size, which hands out blocks in multiples of 512 bytes (as
  // cudaMalloc does): sizes here are multiples of it, so that no padding blurs the arithmetic.
  DeviceConfig dc;
  dc.memory_limit = 10240;
  auto device = Device::create(dc);
  Phase p;
  p.kind = Phase::Kind::kForward;
  p.layer = 2;
  p.layer_name = "block 1";
  p.step = 4;
  p.micro_step = 2;
  device->tracker().set_phase(p);
  Buffer a(*device, 6144, Category::kParameters, "a");
  try {
    Buffer b(*device, 5120, Category::kActivations, "b (B, T, C)");
    FAIL() << "allocation past the limit succeeded";
  } catch (const OutOfMemory& e) {
    const OomReport& r = e.report();
    EXPECT_EQ(r.requested, 5120u);
    EXPECT_EQ(r.limit, 10240u);
    EXPECT_EQ(r.live_total, 6144u);
    EXPECT_EQ(r.category, Category::kActivations);
    EXPECT_EQ(r.live[static_cast<int>(Category::kParameters)], 6144u);
    EXPECT_EQ(r.what, "b (B, T, C)");
    EXPECT_EQ(r.phase.str(), "forward of layer 2 (block 1), step 4, micro-step 2");
  }
  EXPECT_EQ(device->tracker().live_total(), 6144u);
  Buffer c(*device, 4096, Category::kActivations, "c");  // exactly at the limit is fine
  EXPECT_EQ(device->tracker().live_total(), 10240u);
}

// A request near 2^64 bytes must fail as out of memory, not wrap around to a small buffer.
TEST(MemoryWall, RequestsNear2To64BytesFailWithoutWrapping) {
  for (const uint64_t limit : {uint64_t{0}, uint64_t{1} << 20}) {
    DeviceConfig dc;
    dc.memory_limit = limit;
    auto device = Device::create(dc);
    Buffer a(*device, 4096, Category::kParameters, "a");
    for (const uint64_t bytes : {UINT64_MAX, UINT64_MAX - 62, UINT64_MAX - 4095})
      EXPECT_THROW(Buffer(*device, bytes, Category::kWorkspace, "huge"), OutOfMemory)
          << bytes << " bytes, memory_limit " << limit;
    EXPECT_EQ(device->tracker().live_total(), 4096u);
  }
}

// A data position from a snapshot is range-checked before it is used.
TEST(DataSource, RestoreRefusesAPositionOutsideTheSource) {
  DataConfig d;
  ModelConfig m;
  m.vocab_size = 64;
  m.seq_len = 8;
  auto src = make_data_source(d, m, 2, 8);
  const std::string good = src->state();
  for (const std::string bad : {"synthetic 64 1", "synthetic -1 1", "synthetic x", "text 1 0", ""})
    EXPECT_THROW(src->restore(bad), ConfigError) << bad;
  EXPECT_NO_THROW(src->restore(good));
}

TEST(MemoryTracker, PeaksPhasesAndTimeline) {
  MemoryTracker t;
  Phase fwd;
  fwd.kind = Phase::Kind::kForward;
  fwd.layer = 0;
  fwd.layer_name = "embedding";
  Phase bwd = fwd;
  bwd.kind = Phase::Kind::kBackward;

  t.on_alloc(Category::kParameters, 100);
  t.set_phase(fwd);
  t.on_alloc(Category::kActivations, 50);
  t.on_alloc(Category::kActivations, 30);
  t.set_phase(bwd);
  t.on_alloc(Category::kWorkspace, 10);
  t.on_free(Category::kActivations, 80);
  t.on_free(Category::kWorkspace, 10);

  EXPECT_EQ(t.live_total(), 100u);
  EXPECT_EQ(t.peak_total(), 190u);
  EXPECT_EQ(t.peak_phase().kind, Phase::Kind::kBackward);
  EXPECT_EQ(t.live_at_peak()[static_cast<int>(Category::kWorkspace)], 10u);
  EXPECT_EQ(t.peak(Category::kActivations), 80u);
  const auto tl = t.timeline();
  ASSERT_EQ(tl.size(), 3u);  // setup, forward, backward
  EXPECT_EQ(tl[0].total(), 100u);
  EXPECT_EQ(tl[1].phase.kind, Phase::Kind::kForward);
  EXPECT_EQ(tl[1].total(), 180u);
  EXPECT_EQ(tl[2].total(), 190u);  // the highest point of the phase, not its end
}

// ---------------------------------------------------------------------------------------------
// Schedule and optimizers

TEST(Schedule, WarmupThenCosineLinearConstant) {
  TrainConfig t;
  t.steps = 110;
  t.warmup_steps = 10;
  t.lr = 1.0;
  t.min_lr = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.1);  // (step + 1) / warmup
  EXPECT_DOUBLE_EQ(learning_rate(t, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 10), 1.0);     // decay starts at the peak
  EXPECT_NEAR(learning_rate(t, 60), 0.55, 1e-12);  // halfway: (1 + 0.1) / 2
  EXPECT_NEAR(learning_rate(t, 110), 0.1, 1e-12);
  t.lr_schedule = "linear";
  EXPECT_NEAR(learning_rate(t, 35), 1.0 - 0.9 * 0.25, 1e-12);
  t.lr_schedule = "constant";
  EXPECT_DOUBLE_EQ(learning_rate(t, 100), 1.0);
}

struct OneParam {
  std::unique_ptr<Device> device = Device::create(DeviceConfig{});
  FlatStorage flat;
  Param<float> p;
  explicit OneParam(std::vector<float> values, std::vector<float> grads, bool decay) {
    p.numel = values.size();
    p.decay = decay;
    p.flat = &flat;
    flat.numel = flat.padded = p.numel;
    flat.value = Buffer(*device, p.numel * 4, Category::kParameters, "p");
    flat.grad = Buffer(*device, p.numel * 4, Category::kGradients, "g");
    std::copy(values.begin(), values.end(), p.master().value);
    std::copy(grads.begin(), grads.end(), p.master().grad);
  }
};

TEST(Optimizer, AdamWDecaysMatricesButNotBiasesOrGains) {
  TrainConfig t;
  t.weight_decay = 0.5;
  OneParam matrix({1.0f, -2.0f}, {0.0f, 0.0f}, true);
  OneParam bias({1.0f, -2.0f}, {0.0f, 0.0f}, false);
  auto opt = make_optimizer(t, *matrix.device);
  std::vector<Param<float>*> ps{&matrix.p, &bias.p};
  opt->step(whole_params(ps), 0.1, 1);
  // Zero gradient: AdamW's update is pure decoupled decay, p -= lr * wd * p.
  EXPECT_FLOAT_EQ(matrix.p.master().value[0], 1.0f * (1 - 0.05f));
  EXPECT_FLOAT_EQ(matrix.p.master().value[1], -2.0f * (1 - 0.05f));
  EXPECT_EQ(bias.p.master().value[0], 1.0f);
  EXPECT_EQ(bias.p.master().value[1], -2.0f);
  // m and v for both tensors: 2 tensors x 2 elements x 2 states x 4 bytes.
  EXPECT_EQ(matrix.device->tracker().live(Category::kOptimizer), 2u * 2 * 2 * 4);
}

TEST(Optimizer, AdamWFirstStepMovesEachParameterByLr) {
  TrainConfig t;
  t.weight_decay = 0.0;
  OneParam a({0.5f, 0.5f, 0.5f}, {3.0f, -1e-3f, 0.0f}, true);
  auto opt = make_optimizer(t, *a.device);
  std::vector<Param<float>*> ps{&a.p};
  opt->step(whole_params(ps), 0.01, 1);
  // Bias correction makes the first update sign(g) * lr (up to eps).
  EXPECT_NEAR(a.p.master().value[0], 0.49f, 1e-6);
  EXPECT_NEAR(a.p.master().value[1], 0.51f, 1e-5);
  EXPECT_EQ(a.p.master().value[2], 0.5f);
}

TEST(Optimizer, SgdWithAndWithoutMomentum) {
  TrainConfig t;
  t.optimizer = "sgd";
  t.weight_decay = 0.0;
  OneParam plain({1.0f}, {2.0f}, true);
  auto opt = make_optimizer(t, *plain.device);
  std::vector<Param<float>*> ps{&plain.p};
  opt->step(whole_params(ps), 0.1, 1);
  opt->step(whole_params(ps), 0.1, 2);
  EXPECT_FLOAT_EQ(plain.p.master().value[0], 1.0f - 0.2f - 0.2f);
  EXPECT_EQ(plain.device->tracker().peak(Category::kOptimizer), 0u);  // no state

  t.momentum = 0.9;
  OneParam mom({1.0f}, {2.0f}, true);
  auto opt2 = make_optimizer(t, *mom.device);
  std::vector<Param<float>*> ps2{&mom.p};
  opt2->step(whole_params(ps2), 0.1, 1);  // buf = 2
  opt2->step(whole_params(ps2), 0.1, 2);  // buf = 0.9 * 2 + 2 = 3.8
  EXPECT_FLOAT_EQ(mom.p.master().value[0], 1.0f - 0.2f - 0.38f);
  EXPECT_EQ(mom.device->tracker().live(Category::kOptimizer), 4u);
}

TEST(Optimizer, ClipGradNormScalesToTheMaximum) {
  OneParam a({0.0f, 0.0f}, {3.0f, 4.0f}, true);
  std::vector<Param<float>*> ps{&a.p};
  EXPECT_DOUBLE_EQ(clip_grad_norm(a.device->backend(), ps, 10.0),
                   5.0);  // under the maximum: untouched
  EXPECT_EQ(a.p.master().grad[0], 3.0f);
  EXPECT_DOUBLE_EQ(clip_grad_norm(a.device->backend(), ps, 1.0), 5.0);
  EXPECT_NEAR(global_grad_norm(a.device->backend(), ps), 1.0, 1e-6);
  EXPECT_DOUBLE_EQ(clip_grad_norm(a.device->backend(), ps, 0.0),
                   global_grad_norm(a.device->backend(), ps));  // 0 turns clipping off
}

// ---------------------------------------------------------------------------------------------
// Data

TEST(SyntheticData, EntropyRateMatchesTheSampledStream) {
  MarkovChain chain(64, 4, 11);
  std::mt19937_64 rng(5);
  // The mean of -log P(next | current) along a long stream estimates the entropy rate.
  int32_t tok = chain.start();
  double nll = 0.0;
  const int n = 400000;
  for (int i = 0; i < n; ++i) {
    const int32_t next = chain.sample(tok, rng);
    for (int j = 0; j < 4; ++j)
      if (chain.successors(tok)[j] == next) nll -= std::log(chain.probabilities(tok)[j]);
    tok = next;
  }
  EXPECT_NEAR(nll / n, chain.entropy_rate(), 0.01 * chain.entropy_rate());
  EXPECT_LT(chain.entropy_rate(), std::log(4.0));
}

TEST(SyntheticData, BatchesAreAContinuousSeededStream) {
  DataConfig d;
  ModelConfig m;
  m.vocab_size = 32;
  auto a = make_data_source(d, m, 2, 8);
  auto b = make_data_source(d, m, 2, 8);
  std::vector<int32_t> in1(16), tg1(16), in2(16), tg2(16), in3(16), tg3(16);
  a->next(in1.data(), tg1.data(), 2, 8);
  a->next(in2.data(), tg2.data(), 2, 8);
  b->next(in3.data(), tg3.data(), 2, 8);
  EXPECT_EQ(in1, in3);  // same seed, same data
  EXPECT_EQ(tg1, tg3);
  for (int i = 0; i + 1 < 16; ++i)
    EXPECT_EQ(tg1[i], in1[i + 1]);
  EXPECT_EQ(in2[0], tg1[15]);  // the next batch continues the stream
  for (int i = 0; i < 16; ++i)
    EXPECT_LT(in1[i], 32);
}

TEST(TextData, ConsecutiveByteWindowsWrapping) {
  const std::string dir = test::temp_dir();
  DataConfig d;
  d.kind = "text";
  d.path = test::write_file(dir, "t.txt", "abcdefghijklmnopqrstu");  // 21 bytes
  ModelConfig m;
  m.vocab_size = 256;
  auto src = make_data_source(d, m, 2, 4);
  std::vector<int32_t> in(8), tg(8);
  src->next(in.data(), tg.data(), 2, 4);
  EXPECT_EQ(in[0], 'a');
  EXPECT_EQ(in[7], 'h');
  EXPECT_EQ(tg[7], 'i');
  src->next(in.data(), tg.data(), 2, 4);
  EXPECT_EQ(in[0], 'i');
  src->next(in.data(), tg.data(), 2, 4);  // 16 + 9 > 21: back to the start
  EXPECT_EQ(in[0], 'a');
  m.vocab_size = 100;
  EXPECT_THROW(make_data_source(d, m, 2, 4), ConfigError);
}

// ---------------------------------------------------------------------------------------------
// The loop's events

class Recorder final : public EventListener {
 public:
  void on_event(const EventInfo& e) override {
    if (e.event == Event::kAlloc || e.event == Event::kFree) {
      ++counts[e.event];
      return;
    }
    std::string s = event_name(e.event);
    if (e.layer >= 0) s += "(" + std::to_string(e.layer) + ")";
    seq.push_back(s);
  }
  std::vector<std::string> seq;
  std::map<Event, int> counts;
};

TEST(Loop, FiresEveryEventInOrder) {
  const Config c = test::config_from(
      "[model]\nn_layer = 1\nn_head = 1\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
      "[train]\nsteps = 2\nmicro_batch = 1\ngrad_accum = 2\n");
  Trainer trainer(c, TrainOptions{});
  Recorder rec;
  trainer.add_listener(&rec);
  trainer.run();
  // Layers: 0 embedding, 1 the block, 2 the head.
  const std::vector<std::string> micro = {
      "FORWARD_BEGIN(0)",  "FORWARD_END(0)",  "FORWARD_BEGIN(1)",  "FORWARD_END(1)",
      "FORWARD_BEGIN(2)",  "FORWARD_END(2)",  "BACKWARD_BEGIN(2)", "BACKWARD_END(2)",
      "BACKWARD_BEGIN(1)", "BACKWARD_END(1)", "BACKWARD_BEGIN(0)", "BACKWARD_END(0)"};
  std::vector<std::string> want = {"TRAIN_BEGIN"};
  for (int step = 0; step < 2; ++step) {
    want.push_back("STEP_BEGIN");
    for (int m = 0; m < 2; ++m)
      want.insert(want.end(), micro.begin(), micro.end());
    want.insert(want.end(), {"GRADS_READY", "OPTIMIZER_STEP", "STEP_END"});
  }
  want.push_back("TRAIN_END");
  EXPECT_EQ(rec.seq, want);
  EXPECT_GT(rec.counts[Event::kAlloc], 0);
  // Every allocation made during the run (activations, workspace, state) is matched by a free,
  // except the optimizer state and the two batch buffers, which live until the trainer goes.
  const int state_tensors = 2 * int(trainer.model().params().size());
  EXPECT_EQ(rec.counts[Event::kAlloc] - rec.counts[Event::kFree], state_tensors);
}

}  // namespace
}  // namespace headroom
