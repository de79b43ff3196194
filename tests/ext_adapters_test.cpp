// headroom.adapters/1 (headroom/ext/adapters.h) through a real plugin loaded from a TOML. This one
// file is the extension's whole test (tests/abi/CMakeLists.txt): compiled with HEADROOM_EXT_PROBE
// it is the probe plugin ext_adapters_probe; without, the GoogleTest cases that run it and the
// layout pins. The lora plugin (tests/lora_test.cpp) is the policy over it.
#ifdef HEADROOM_EXT_PROBE

// --- The probe plugin ---------------------------------------------------------------------------
// In create(): add_lora with its keys target (string), rank (integer) and alpha (float), spec.key
// "target" when with_key is true, and with a NULL spec; at TRAIN_BEGIN add_lora again. One line
// each to `out`:
//
//   create status=0 null=5
//   TRAIN_BEGIN status=7 params=N adapters=M     (the model's parameters, the adapters among them)
//
// A create() whose add_lora failed returns that status (the run does not start).
#include <headroom/ext/adapters.h>
#include <headroom/ext/tensors.h>
#include <headroom/plugin.h>

#include <cstdio>
#include <cstring>

namespace {

struct Probe {
  const hr_host_services* s;
  const hr_ext_adapters* adapters;
  FILE* out;
  char target[64];
  int64_t rank;
  double alpha;
};

hr_status create(const hr_host_services* s, void** instance) {
  Probe p{s, nullptr, nullptr, "", 2, 4.0};
  char path[512] = "";
  int32_t with_key = 0;
  if (s->config_string(s->host, "out", path, sizeof path) != HR_OK ||
      s->config_string(s->host, "target", p.target, sizeof p.target) != HR_OK ||
      s->config_int(s->host, "rank", &p.rank) != HR_OK ||
      s->config_float(s->host, "alpha", &p.alpha) != HR_OK ||
      s->config_bool(s->host, "with_key", &with_key) != HR_OK)
    return HR_ERROR_CONFIG;
  p.adapters = static_cast<const hr_ext_adapters*>(s->get_extension(s->host, HR_EXT_ADAPTERS));
  if (!p.adapters) {
    s->set_error(s->host, "the host offers no " HR_EXT_ADAPTERS);
    return HR_ERROR;
  }
  // The first revision's size (no dropout field): what a plugin built before it passes.
  const hr_lora_spec spec = {uint32_t(offsetof(hr_lora_spec, dropout)),
                             uint32_t(p.rank),
                             p.target,
                             p.alpha,
                             with_key ? "target" : nullptr,
                             0.5};
  const hr_status st = p.adapters->add_lora(s->host, &spec);
  if (st != HR_OK) return st;
  const hr_status null = p.adapters->add_lora(s->host, nullptr);
  p.out = std::fopen(path, "w");
  if (!p.out) return s->config_error(s->host, "out", "cannot be opened");
  std::fprintf(p.out, "create status=%d null=%d\n", int(st), int(null));
  std::fflush(p.out);
  *instance = new Probe(p);
  return HR_OK;
}

void destroy(void* instance) {
  Probe* p = static_cast<Probe*>(instance);
  std::fclose(p->out);
  delete p;
}

hr_status on_event(void* instance, const hr_event_info*) {
  Probe* p = static_cast<Probe*>(instance);
  const hr_lora_spec spec = {
      sizeof(hr_lora_spec), uint32_t(p->rank), p->target, p->alpha, nullptr, 0.0};
  const hr_status st = p->adapters->add_lora(p->s->host, &spec);
  int adapters = 0, params = 0;
  for (int32_t l = 0; l < p->s->num_layers(p->s->host); ++l)
    for (int32_t i = 0; i < p->s->layer_num_params(p->s->host, l); ++i) {
      hr_tensor t;
      std::memset(&t, 0, sizeof t);
      t.struct_size = sizeof t;
      if (p->s->layer_param(p->s->host, l, i, &t) != HR_OK) return HR_ERROR;
      ++params;
      adapters += std::strstr(t.name, ".lora_") != nullptr;
    }
  std::fprintf(p->out, "TRAIN_BEGIN status=%d params=%d adapters=%d\n", int(st), params, adapters);
  std::fflush(p->out);
  return HR_OK;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "ext_adapters_probe",
    "1.0.0",
    "test plugin: records headroom.adapters/1's answers",
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

#include <cstddef>
#include <string>
#include <type_traits>

#include "core/plugin_host/plugin_host.h"
#include "core/run/trainer.h"
#include "headroom/ext/adapters.h"
#include "tests/test_util.h"

// --- The layout, pinned (x86-64, LP64), as tests/abi_layout_test.cpp pins every other struct ---
#if defined(__x86_64__) && defined(__LP64__)
static_assert(sizeof(hr_lora_spec) == 40 && offsetof(hr_lora_spec, rank) == 4 &&
              offsetof(hr_lora_spec, target) == 8 && offsetof(hr_lora_spec, alpha) == 16 &&
              offsetof(hr_lora_spec, key) == 24);
static_assert(offsetof(hr_lora_spec, dropout) == 32, "appended in the second revision");
static_assert(sizeof(hr_ext_adapters) == 24 && offsetof(hr_ext_adapters, add_lora) == 8 &&
              offsetof(hr_ext_adapters, set_base) == 16);
static_assert(sizeof(hr_base_spec) == 24 && offsetof(hr_base_spec, double_quant) == 4 &&
              offsetof(hr_base_spec, dtype) == 8 && offsetof(hr_base_spec, key) == 16);
static_assert(std::is_same_v<decltype(hr_ext_adapters::add_lora),
                             hr_status (*)(hr_host*, const hr_lora_spec*)>);
#endif

namespace headroom {
namespace {

// One block (the plugins see 3 layers, 12 + 2 + 2 parameters).
const char* kTinyModel =
    "[model]\nn_layer = 1\nn_head = 2\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
    "[train]\nsteps = 1\nmicro_batch = 1\n";

std::string probe(const std::string& keys) {
  return std::string("[[plugins]]\nname = \"ext_adapters_probe\"\npath = \"") +
         HEADROOM_TEST_PLUGIN_DIR + "/ext_adapters_probe.so\"\n" + keys;
}

// From create(): the adapters are parameters of the built model (c_proj: both projections, an A
// and a B each), the rest frozen; a NULL spec is HR_ERROR_INVALID; after create() the call is
// refused.
TEST(ExtAdapters, AddedInCreateRefusedAfter) {
  const std::string dir = test::temp_dir(), out = dir + "/adapters.txt";
  Trainer t(test::config_from(kTinyModel + probe("out = \"" + out + "\"\ntarget = \"c_proj\"\n")),
            TrainOptions{});
  t.run();
  EXPECT_EQ(test::read_file(out),
            "create status=0 null=5\nTRAIN_BEGIN status=7 params=20 adapters=4\n");
  int frozen = 0;
  for (const Param<float>* p : t.model().params())
    frozen += p->frozen;
  EXPECT_EQ(frozen, 16);
}

// A target that names no module, a rank of 0, an alpha of 0: a config error, at the key's
// position when the spec names it.
TEST(ExtAdapters, BadSpecsAreConfigErrors) {
  const std::string dir = test::temp_dir(), out = dir + "/adapters.txt";
  auto error = [&](const std::string& keys) {
    return test::error_of([&] {
      Trainer t(test::config_from(kTinyModel + probe("out = \"" + out + "\"\n" + keys)),
                TrainOptions{});
    });
  };
  const std::string none = error("target = \"q_proj\"\nwith_key = true\n");
  EXPECT_TRUE(test::contains(none,
                             "test.toml:14:10: plugins.ext_adapters_probe.target: \"q_proj\" "
                             "names no module of this gpt2 model"))
      << none;
  EXPECT_TRUE(test::contains(error("target = \"c_fc\"\nrank = 0\nwith_key = true\n"),
                             "rank 0 (valid: 1 or more)"));
  EXPECT_TRUE(test::contains(error("target = \"c_fc\"\nalpha = 0.0\nwith_key = true\n"),
                             "alpha must be a finite number > 0"));
  // Without a key: the same message with no position, HR_ERROR_INVALID (a failed start).
  try {
    Trainer t(test::config_from(kTinyModel + probe("out = \"" + out + "\"\ntarget = \"x\"\n")),
              TrainOptions{});
    ADD_FAILURE() << "expected a PluginFailure";
  } catch (const PluginFailure& e) {
    EXPECT_TRUE(test::contains(e.what(), "headroom.adapters/1 add_lora: \"x\" names no module"))
        << e.what();
  }
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_EXT_PROBE
