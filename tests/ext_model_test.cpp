// headroom.model/1 (headroom/ext/model.h) through a real plugin loaded from a TOML. This one file
// is the extension's whole test (tests/abi/CMakeLists.txt): compiled with HEADROOM_EXT_PROBE it is
// the probe plugin ext_model_probe; without, the GoogleTest cases that run it and the layout pins.
#ifdef HEADROOM_EXT_PROBE

// --- The probe plugin ---------------------------------------------------------------------------
// Asks for headroom.model/1's shape in create() (before the model exists) and at TRAIN_BEGIN and
// STEP_END, and records what it got to `out`, one line each:
//
//   create status=5
//   TRAIN_BEGIN status=0 size=40 architecture=gpt2 n_layer=2 n_head=2 n_embd=8 vocab_size=16
//       seq_len=4 num_layers=4 services_num_layers=4
//   TRAIN_BEGIN short size=36 seq_len=4 num_layers=-7     (a caller whose struct ends before
//                                                          num_layers: the host writes no further)
//   TRAIN_BEGIN null_out=5
//   STEP_END step=1 status=0 ...                          (as TRAIN_BEGIN's first line)
//
// Keys: out (string, required); fail_in_create (bool): create returns what shape answered there,
// so that the run fails with the host's message.
#include <headroom/ext/model.h>
#include <headroom/plugin.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

namespace {

struct Probe {
  const hr_host_services* s;
  const hr_ext_model* model;
  FILE* out;
};

hr_model_shape empty_shape(uint32_t size) {
  hr_model_shape m;
  std::memset(&m, 0, sizeof m);
  m.struct_size = size;
  m.num_layers = -7;  // what the host must not overwrite in a shorter struct
  return m;
}

void record_shape(Probe* p, const char* where) {
  hr_model_shape m = empty_shape(sizeof(hr_model_shape));
  const hr_status st = p->model->shape(p->s->host, &m);
  std::fprintf(p->out,
               "%s status=%d size=%u architecture=%s n_layer=%d n_head=%d n_embd=%d vocab_size=%d "
               "seq_len=%d num_layers=%d services_num_layers=%d\n",
               where, int(st), unsigned(m.struct_size), m.architecture ? m.architecture : "(null)",
               int(m.n_layer), int(m.n_head), int(m.n_embd), int(m.vocab_size), int(m.seq_len),
               int(m.num_layers), int(p->s->num_layers(p->s->host)));
}

hr_status create(const hr_host_services* s, void** instance) {
  char path[512] = "";
  int32_t fail_in_create = 0;
  if (s->config_string(s->host, "out", path, sizeof path) != HR_OK ||
      s->config_bool(s->host, "fail_in_create", &fail_in_create) != HR_OK)
    return HR_ERROR_CONFIG;
  if (!path[0]) return s->config_error(s->host, "out", "is required");
  const hr_ext_model* model =
      static_cast<const hr_ext_model*>(s->get_extension(s->host, HR_EXT_MODEL));
  if (!model) {
    s->set_error(s->host, "the host offers no " HR_EXT_MODEL);
    return HR_ERROR;
  }
  hr_model_shape m = empty_shape(sizeof(hr_model_shape));
  const hr_status st = model->shape(s->host, &m);
  if (fail_in_create) return st;
  FILE* out = std::fopen(path, "w");
  if (!out) return s->config_error(s->host, "out", "cannot be opened");
  std::fprintf(out, "create status=%d\n", int(st));
  *instance = new Probe{s, model, out};
  return HR_OK;
}

void destroy(void* instance) {
  Probe* p = static_cast<Probe*>(instance);
  std::fclose(p->out);
  delete p;
}

hr_status on_event(void* instance, const hr_event_info* info) {
  Probe* p = static_cast<Probe*>(instance);
  if (info->event == HR_EVENT_STEP_END) {
    char where[32];
    std::snprintf(where, sizeof where, "STEP_END step=%lld", static_cast<long long>(info->step));
    record_shape(p, where);
    return HR_OK;
  }
  record_shape(p, "TRAIN_BEGIN");
  hr_model_shape shorter = empty_shape(offsetof(hr_model_shape, num_layers));
  const hr_status st = p->model->shape(p->s->host, &shorter);
  std::fprintf(p->out, "TRAIN_BEGIN short status=%d size=%u seq_len=%d num_layers=%d\n", int(st),
               unsigned(shorter.struct_size), int(shorter.seq_len), int(shorter.num_layers));
  std::fprintf(p->out, "TRAIN_BEGIN null_out=%d\n", int(p->model->shape(p->s->host, nullptr)));
  return HR_OK;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "ext_model_probe",
    "1.0.0",
    "test plugin: records headroom.model/1's answers",
    HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END),
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
#include <vector>

#include "core/plugin_host/plugin_host.h"
#include "core/run/trainer.h"
#include "headroom/ext/model.h"
#include "tests/test_util.h"

// --- The layout, pinned (x86-64, LP64), as tests/abi_layout_test.cpp pins every other struct ---
#if defined(__x86_64__) && defined(__LP64__)
static_assert(sizeof(hr_model_shape) == 40 && alignof(hr_model_shape) == 8);
static_assert(offsetof(hr_model_shape, struct_size) == 0);
static_assert(offsetof(hr_model_shape, reserved0) == 4);
static_assert(offsetof(hr_model_shape, architecture) == 8);
static_assert(offsetof(hr_model_shape, n_layer) == 16 && offsetof(hr_model_shape, n_head) == 20);
static_assert(offsetof(hr_model_shape, n_embd) == 24 && offsetof(hr_model_shape, vocab_size) == 28);
static_assert(offsetof(hr_model_shape, seq_len) == 32 &&
              offsetof(hr_model_shape, num_layers) == 36);
static_assert(std::is_same_v<decltype(hr_model_shape::architecture), const char*>);
static_assert(sizeof(hr_ext_model) == 16 && offsetof(hr_ext_model, shape) == 8);
static_assert(
    std::is_same_v<decltype(hr_ext_model::shape), hr_status (*)(hr_host*, hr_model_shape*)>);
#endif

namespace headroom {
namespace {

// Two blocks: the plugins see 4 layers.
const char* kTinyModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
    "[train]\nsteps = 2\nmicro_batch = 1\ngrad_accum = 1\n";

std::string probe(const std::string& keys) {
  return std::string("[[plugins]]\nname = \"ext_model_probe\"\npath = \"") +
         HEADROOM_TEST_PLUGIN_DIR + "/ext_model_probe.so\"\n" + keys;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t at = 0;
  for (size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
    lines.push_back(text.substr(at, nl - at));
  return lines;
}

// The shape, once the model is built, at every event after; HR_ERROR_INVALID before it is and for
// a NULL out; a shorter struct filled only as far as its size.
TEST(ExtModel, ShapeOnceTheModelIsBuilt) {
  const std::string dir = test::temp_dir(), out = dir + "/shape.txt";
  Trainer(test::config_from(kTinyModel + probe("out = \"" + out + "\"\n")), TrainOptions{}).run();
  const std::string shape =
      "status=0 size=40 architecture=gpt2 n_layer=2 n_head=2 n_embd=8 vocab_size=16 seq_len=4 "
      "num_layers=4 services_num_layers=4";
  EXPECT_EQ(lines_of(test::read_file(out)),
            (std::vector<std::string>{
                "create status=5",
                "TRAIN_BEGIN " + shape,
                "TRAIN_BEGIN short status=0 size=36 seq_len=4 num_layers=-7",
                "TRAIN_BEGIN null_out=5",
                "STEP_END step=1 " + shape,
                "STEP_END step=2 " + shape,
            }));
}

// A plugin that fails create() with shape's answer there: the run does not start, and the host's
// message says why.
TEST(ExtModel, BeforeTheModelIsBuiltTheMessageSaysSo) {
  const std::string dir = test::temp_dir();
  const Config config =
      test::config_from(kTinyModel + probe("out = \"" + dir + "/x.txt\"\nfail_in_create = true\n"));
  try {
    Trainer(config, TrainOptions{});
    ADD_FAILURE() << "expected a PluginFailure";
  } catch (const PluginFailure& e) {
    EXPECT_TRUE(test::contains(e.what(),
                               "plugin 'ext_model_probe' failed to start (create): "
                               "headroom.model/1 shape: the model is not built yet"))
        << e.what();
  }
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_EXT_PROBE
