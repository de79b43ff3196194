// headroom.ops/1 (headroom/ext/ops.h). This one file is the extension's whole test
// (tests/abi/CMakeLists.txt): compiled with HEADROOM_EXT_PROBE it is the probe plugin
// ext_ops_probe; without, the GoogleTest cases: the element-wise ops on the CPU backend against
// plain reference loops; through the real loader the probe (every function through the host's
// table), the Lion test plugin (tests/abi/plugins/lion.c) on the device next to the same Lion
// staged through headroom.tensors/1 read/write, and the fused adamw next to the built-in AdamW.
// The CUDA backend's ops are checked against the CPU's in tests/cuda_ops_test.cpp (CudaPointwise).
// The layout is pinned in tests/abi_layout_test.cpp.
#ifdef HEADROOM_EXT_PROBE

// --- The probe plugin ---------------------------------------------------------------------------
// At TRAIN_BEGIN: 8 f32 values written to a buffer of its own (services->alloc), each function of
// the table applied in place, the result read back and checked against the same arithmetic on
// the host; any difference is the hook's failure, with the element. Then every function with
// n = 0 and NULL pointers (nothing to do: HR_OK).
#include <headroom/ext/ops.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>

#include <cmath>
#include <cstdio>
#include <cstring>

namespace {

const hr_host_services* g_s = nullptr;

hr_status fail(const char* what) {
  g_s->set_error(g_s->host, what);
  return HR_ERROR;
}

hr_status create(const hr_host_services* s, void** instance) {
  static int the_instance;
  g_s = s;
  *instance = &the_instance;
  return HR_OK;
}

void destroy(void*) {}

hr_status check(const hr_ext_tensors* t, const float* dev, const float* want, const char* what) {
  float got[8];
  const hr_status st = t->read(g_s->host, got, dev, sizeof got);
  if (st != HR_OK) return st;
  for (int i = 0; i < 8; ++i)
    if (std::memcmp(&got[i], &want[i], 4) != 0) {
      static char message[160];
      std::snprintf(message, sizeof message, "ext_ops_probe: %s element %d is %.9g, not %.9g", what,
                    i, double(got[i]), double(want[i]));
      return fail(message);
    }
  return HR_OK;
}

hr_status on_event(void*, const hr_event_info* info) {
  if (info->event != HR_EVENT_TRAIN_BEGIN) return HR_OK;
  hr_host* h = g_s->host;
  const auto* o = static_cast<const hr_ext_ops*>(g_s->get_extension(h, HR_EXT_OPS));
  const auto* t = static_cast<const hr_ext_tensors*>(g_s->get_extension(h, HR_EXT_TENSORS));
  if (!o || !t || o->struct_size != sizeof(hr_ext_ops)) return fail("ext_ops_probe: no ops/1");
  float* x = static_cast<float*>(g_s->alloc(h, 16 * 4, HR_MEM_OPTIMIZER, "ext_ops_probe"));
  if (!x) return fail("ext_ops_probe: no memory");
  float* y = x + 8;
  float hx[8] = {1.5f, -2.0f, 0.0f, 3.25f, -0.5f, 7.0f, 0.125f, -9.0f};
  const float hy[8] = {0.5f, 4.0f, -1.0f, 2.0f, -0.25f, 0.75f, 8.0f, 3.0f};
  hr_status st = t->write(h, x, hx, sizeof hx);
  if (st == HR_OK) st = t->write(h, y, hy, sizeof hy);
  // x = x * y; x = sign(x) ... each against its host arithmetic.
  float want[8];
  for (int i = 0; i < 8; ++i)
    want[i] = hx[i] * hy[i];
  if (st == HR_OK) st = o->binary(h, HR_OP_MUL, x, x, y, HR_DTYPE_F32, 8);
  if (st == HR_OK) st = check(t, x, want, "binary MUL");
  for (int i = 0; i < 8; ++i)
    want[i] = std::fabs(want[i]);
  if (st == HR_OK) st = o->unary(h, HR_OP_ABS, x, x, HR_DTYPE_F32, 8);
  if (st == HR_OK) st = check(t, x, want, "unary ABS");
  for (int i = 0; i < 8; ++i) {
    const float d = hy[i] - want[i];
    const float p = 0.25f * d;
    want[i] = want[i] + p;
  }
  if (st == HR_OK) st = o->lerp(h, x, x, y, 0.25, HR_DTYPE_F32, 8);
  if (st == HR_OK) st = check(t, x, want, "lerp");
  for (int i = 0; i < 8; ++i) {
    const float p = 2.0f * want[i];
    want[i] = p + 1.0f;
  }
  if (st == HR_OK) st = o->affine(h, x, x, 2.0, 1.0, HR_DTYPE_F32, 8);
  if (st == HR_OK) st = check(t, x, want, "affine");
  // n = 0: nothing to do, whatever the pointers.
  if (st == HR_OK) st = o->binary(h, HR_OP_ADD, nullptr, nullptr, nullptr, HR_DTYPE_F32, 0);
  if (st == HR_OK) st = o->unary(h, HR_OP_SQRT, nullptr, nullptr, HR_DTYPE_BF16, 0);
  if (st == HR_OK) st = o->lerp(h, nullptr, nullptr, nullptr, 0.5, HR_DTYPE_F16, 0);
  if (st == HR_OK) st = o->affine(h, nullptr, nullptr, 1.0, 0.0, HR_DTYPE_F32, 0);
  if (st == HR_OK)
    st = o->adamw(h, nullptr, nullptr, nullptr, nullptr, 0, HR_DTYPE_F32, HR_DTYPE_F32,
                  HR_DTYPE_F32, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0);
  g_s->free(h, x);
  if (st == HR_OK)
    g_s->log(h, HR_LOG_INFO, "ext_ops_probe: every function as computed on the host");
  return st;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "ext_ops_probe",
    "1.0.0",
    "test plugin: every function of headroom.ops/1 once",
    HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN),
    0,  // roles
    0,  // reserved0
    create,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state
    nullptr,  // load_state
    nullptr,  // get_extension
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}

#else  // the tests

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/backend.h"
#include "core/model/model.h"
#include "core/plugin_host/plugin_host.h"
#include "core/run/trainer.h"
#include "headroom/ext/ops.h"
#include "kernels/common/dtype.h"
#include "tests/test_util.h"

namespace headroom {
namespace {

// --- the CPU backend against reference loops ---------------------------------------------------

const Dtype kDtypes[] = {Dtype::kF32, Dtype::kBF16, Dtype::kF16};

float widen(Dtype dt, uint16_t h) {
  return dt == Dtype::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}
uint16_t narrow(Dtype dt, float f) {
  return dt == Dtype::kBF16 ? float_to_bf16(f) : float_to_f16(f);
}

// n values of dt as bytes, and their widened floats.
struct Values {
  std::vector<uint8_t> bytes;
  std::vector<float> f;
};

Values random_values(Dtype dt, size_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.0f, 2.0f);
  Values v;
  v.bytes.resize(n * dtype_size(dt));
  v.f.resize(n);
  for (size_t i = 0; i < n; ++i) {
    float x = dist(gen);
    if (i == 0) x = 0.0f;
    if (i == 1) x = -0.0f;
    if (i == 2) x = -3.0f;
    if (dt == Dtype::kF32) {
      std::memcpy(v.bytes.data() + 4 * i, &x, 4);
      v.f[i] = x;
    } else {
      const uint16_t h = narrow(dt, x);
      std::memcpy(v.bytes.data() + 2 * i, &h, 2);
      v.f[i] = widen(dt, h);
    }
  }
  return v;
}

// The reference's f32 results stored as dt: bitwise for f32, rounded to nearest even for bf16 /
// f16 (the header's promise: f32 math, one rounding).
std::vector<uint8_t> stored(Dtype dt, const std::vector<float>& f) {
  std::vector<uint8_t> b(f.size() * dtype_size(dt));
  for (size_t i = 0; i < f.size(); ++i) {
    if (dt == Dtype::kF32) {
      std::memcpy(b.data() + 4 * i, &f[i], 4);
    } else {
      const uint16_t h = narrow(dt, f[i]);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

// Bytes equal, NaN bits aside: two NaNs of dt are equal whatever their payload.
void expect_same(Dtype dt, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  const size_t size = dtype_size(dt), n = got.size() / size;
  for (size_t i = 0; i < n; ++i) {
    float a, b;
    if (dt == Dtype::kF32) {
      std::memcpy(&a, got.data() + 4 * i, 4);
      std::memcpy(&b, want.data() + 4 * i, 4);
    } else {
      uint16_t ha, hb;
      std::memcpy(&ha, got.data() + 2 * i, 2);
      std::memcpy(&hb, want.data() + 2 * i, 2);
      a = widen(dt, ha);
      b = widen(dt, hb);
    }
    if (std::isnan(a) && std::isnan(b)) continue;
    ASSERT_EQ(0, std::memcmp(got.data() + size * i, want.data() + size * i, size))
        << what << " " << dtype_name(dt) << " element " << i << ": " << a << " vs " << b;
  }
}

struct CpuOps : ::testing::Test {
  std::unique_ptr<Backend> ops = make_cpu_backend(2);
  std::mt19937 gen{37};
  static constexpr size_t kN = 70001;  // over the threads' threshold, odd
};

TEST_F(CpuOps, BinaryMatchesAReferenceLoop) {
  const std::vector<std::pair<BinaryOp, std::function<float(float, float)> > > cases = {
      {BinaryOp::kAdd, [](float x, float y) { return x + y; }},
      {BinaryOp::kSub, [](float x, float y) { return x - y; }},
      {BinaryOp::kMul, [](float x, float y) { return x * y; }},
      {BinaryOp::kDiv, [](float x, float y) { return x / y; }},
      {BinaryOp::kMax,
       [](float x, float y) { return std::isnan(x) || std::isnan(y) ? NAN : (x > y ? x : y); }},
      {BinaryOp::kMin,
       [](float x, float y) { return std::isnan(x) || std::isnan(y) ? NAN : (x < y ? x : y); }},
  };
  for (const Dtype dt : kDtypes) {
    for (const auto& [op, f] : cases) {
      const Values x = random_values(dt, kN, gen), y = random_values(dt, kN, gen);
      std::vector<float> want(kN);
      for (size_t i = 0; i < kN; ++i)
        want[i] = f(x.f[i], y.f[i]);
      std::vector<uint8_t> z(x.bytes.size());
      const uint64_t syncs = ops->host_syncs();
      ops->binary(op, dt, z.data(), x.bytes.data(), y.bytes.data(), kN);
      EXPECT_EQ(ops->host_syncs(), syncs) << "binary waits for nothing";
      expect_same(dt, z, stored(dt, want), "binary op " + std::to_string(uint32_t(op)));
      // In place: the output is the first input's buffer.
      std::vector<uint8_t> in_place = x.bytes;
      ops->binary(op, dt, in_place.data(), in_place.data(), y.bytes.data(), kN);
      expect_same(dt, in_place, z, "in-place binary");
    }
  }
}

TEST_F(CpuOps, UnaryMatchesAReferenceLoop) {
  const std::vector<std::pair<UnaryOp, std::function<float(float)> > > cases = {
      {UnaryOp::kSign, [](float x) { return x > 0 ? 1.0f : (x < 0 ? -1.0f : x); }},
      {UnaryOp::kSqrt, [](float x) { return std::sqrt(x); }},
      {UnaryOp::kAbs, [](float x) { return std::fabs(x); }},
      {UnaryOp::kNeg, [](float x) { return -x; }},
      {UnaryOp::kReciprocal, [](float x) { return 1.0f / x; }},
  };
  for (const Dtype dt : kDtypes) {
    for (const auto& [op, f] : cases) {
      const Values x = random_values(dt, kN, gen);
      std::vector<float> want(kN);
      for (size_t i = 0; i < kN; ++i)
        want[i] = f(x.f[i]);
      std::vector<uint8_t> y = x.bytes;
      ops->unary(op, dt, y.data(), y.data(), kN);  // in place
      expect_same(dt, y, stored(dt, want), "unary op " + std::to_string(uint32_t(op)));
    }
  }
  // sign keeps the zeros' signs.
  std::vector<float> zeros = {0.0f, -0.0f};
  ops->unary(UnaryOp::kSign, Dtype::kF32, zeros.data(), zeros.data(), 2);
  EXPECT_FALSE(std::signbit(zeros[0]));
  EXPECT_TRUE(std::signbit(zeros[1]));
}

TEST_F(CpuOps, LerpAndAffineMatchAReferenceLoop) {
  const float w = 0.9f, a = 0.999f, b = 1e-8f;
  for (const Dtype dt : kDtypes) {
    const Values x = random_values(dt, kN, gen), y = random_values(dt, kN, gen);
    std::vector<float> lerp(kN), affine(kN);
    for (size_t i = 0; i < kN; ++i) {
      const float d = y.f[i] - x.f[i];
      const float p = w * d;
      lerp[i] = x.f[i] + p;
      const float q = a * x.f[i];
      affine[i] = q + b;
    }
    std::vector<uint8_t> z(x.bytes.size()), out(x.bytes.size());
    ops->lerp(dt, z.data(), x.bytes.data(), y.bytes.data(), w, kN);
    expect_same(dt, z, stored(dt, lerp), "lerp");
    ops->affine(dt, out.data(), x.bytes.data(), a, b, kN);
    expect_same(dt, out, stored(dt, affine), "affine");
  }
}

TEST_F(CpuOps, AnIntegerDtypeIsAnOpError) {
  std::vector<int32_t> x(4, 1);
  EXPECT_THROW(ops->binary(BinaryOp::kAdd, Dtype::kI32, x.data(), x.data(), x.data(), 4), OpError);
  EXPECT_THROW(ops->unary(UnaryOp::kAbs, Dtype::kF64, x.data(), x.data(), 2), OpError);
}

// --- through the loader: the Lion test plugin, the fused adamw ---------------------------------

const std::string kPluginDir = HEADROOM_TEST_PLUGIN_DIR;

std::string base_toml(int steps) {
  return "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nseq_len = 16\nvocab_size = 64\n"
         "[train]\nsteps = " +
         std::to_string(steps) +
         "\nmicro_batch = 2\ngrad_accum = 2\nlr = 1e-3\nwarmup_steps = 2\ngrad_clip = 0\n"
         "weight_decay = 0.1\nbeta1 = 0.9\nbeta2 = 0.95\neps = 1e-8\n";
}

std::string lion_toml(const std::string& keys) {
  return "[[plugins]]\nname = \"lion\"\npath = \"" + kPluginDir + "/lion.so\"\n" + keys;
}

struct TrainResult {
  std::vector<std::vector<float> > weights;  // every parameter's masters
  std::vector<double> losses;
  std::vector<uint64_t> host_syncs;  // per step
};

TrainResult train(const std::string& toml) {
  Trainer t(test::config_from(toml), TrainOptions{});
  t.run();
  TrainResult r;
  for (auto* p : t.model().params()) {
    const float* v = p->master().value;
    r.weights.emplace_back(v, v + p->numel);
  }
  for (const StepState& s : t.history()) {
    r.losses.push_back(s.loss);
    r.host_syncs.push_back(s.host_syncs);
  }
  return r;
}

void expect_same_weights(const TrainResult& a, const TrainResult& b, const char* what) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i)
    EXPECT_TRUE(test::bitwise_equal(a.weights[i], b.weights[i])) << what << ": parameter " << i;
}

TEST(OpsExtension, TheProbeComputesEveryFunctionAsTheHostDoes) {
  Trainer t(test::config_from(base_toml(1) + "[[plugins]]\nname = \"ext_ops_probe\"\npath = \"" +
                              kPluginDir + "/ext_ops_probe.so\"\n"),
            TrainOptions{});
  EXPECT_NO_THROW(t.run());
  EXPECT_EQ(t.history().size(), 1u);
}

TEST(OpsExtension, LionOnTheDeviceIsTheStagedLionBitwiseWithNoHostSyncsOfItsOwn) {
  const int steps = 12;
  const std::string lion_keys = "beta1 = 0.9\nbeta2 = 0.99\nweight_decay = 0.1\n";
  const TrainResult ops = train(base_toml(steps) + lion_toml("mode = \"ops\"\n" + lion_keys));
  const TrainResult staging =
      train(base_toml(steps) + lion_toml("mode = \"staging\"\n" + lion_keys));
  const TrainResult builtin = train(base_toml(steps));
  ASSERT_EQ(ops.losses.size(), size_t(steps));
  expect_same_weights(ops, staging, "ops vs staging");
  for (size_t i = 0; i < ops.losses.size(); ++i)
    EXPECT_EQ(ops.losses[i], staging.losses[i]) << "step " << i + 1;
  EXPECT_LT(ops.losses.back(), ops.losses.front() - 0.1) << "Lion trains";
  uint64_t ops_total = 0, staging_total = 0, builtin_total = 0;
  for (int i = 0; i < steps; ++i) {
    EXPECT_EQ(ops.host_syncs[i], builtin.host_syncs[i]) << "step " << i + 1;
    EXPECT_GT(staging.host_syncs[i], ops.host_syncs[i] + 50) << "step " << i + 1;
    ops_total += ops.host_syncs[i];
    staging_total += staging.host_syncs[i];
    builtin_total += builtin.host_syncs[i];
  }
  std::printf(
      "host syncs a step: built-in AdamW %.1f, Lion on the device (headroom.ops/1) %.1f, "
      "Lion staged through tensors/1 read/write %.1f; loss %.4f -> %.4f\n",
      double(builtin_total) / steps, double(ops_total) / steps, double(staging_total) / steps,
      ops.losses.front(), ops.losses.back());
}

TEST(OpsExtension, FusedAdamwInAPluginIsTheBuiltInAdamwBitwise) {
  const int steps = 8;
  const TrainResult builtin = train(base_toml(steps));
  const TrainResult plugin =
      train(base_toml(steps) + lion_toml("mode = \"adamw\"\nbeta1 = 0.9\nbeta2 = 0.95\neps = 1e-8\n"
                                         "weight_decay = 0.1\n"));
  expect_same_weights(plugin, builtin, "fused adamw vs built-in");
  ASSERT_EQ(plugin.losses.size(), builtin.losses.size());
  for (size_t i = 0; i < plugin.losses.size(); ++i) {
    EXPECT_EQ(plugin.losses[i], builtin.losses[i]) << "step " << i + 1;
    EXPECT_EQ(plugin.host_syncs[i], builtin.host_syncs[i]) << "step " << i + 1;
  }
  EXPECT_LT(plugin.losses.back(), plugin.losses.front());
}

TEST(OpsExtension, BadArgumentsAreInvalidWithAMessage) {
  const std::vector<std::pair<std::string, std::string> > cases = {
      {"binary_op", "headroom.ops/1 binary: op 99 is not HR_OP_ADD .. HR_OP_MIN"},
      {"unary_op", "headroom.ops/1 unary: op 17 is not HR_OP_SIGN .. HR_OP_RECIPROCAL"},
      {"dtype", "headroom.ops/1 lerp: dtype 4 is not HR_DTYPE_F32, HR_DTYPE_BF16 or HR_DTYPE_F16"},
      {"null", "headroom.ops/1 affine: y is NULL with n = "},
      {"adamw_dtype", "headroom.ops/1 adamw: param_dtype, grad_dtype and state_dtype must each be"},
      {"adamw_step", "headroom.ops/1 adamw: step 0 is not 1-based"},
  };
  for (const auto& [bad, message] : cases) {
    SCOPED_TRACE(bad);
    Trainer t(
        test::config_from(base_toml(2) + lion_toml("mode = \"adamw\"\nbad = \"" + bad + "\"\n")),
        TrainOptions{});
    try {
      t.run();
      ADD_FAILURE() << "the run was expected to stop";
    } catch (const PluginFailure& e) {
      EXPECT_TRUE(test::contains(e.what(), message)) << e.what();
      // lion.c returns the status only when it is HR_ERROR_INVALID, else a message of its own.
      EXPECT_FALSE(test::contains(e.what(), "did not return HR_ERROR_INVALID")) << e.what();
    }
  }
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_EXT_PROBE
