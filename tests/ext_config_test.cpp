// headroom.config/1 (headroom/ext/config.h) through a real plugin loaded from a TOML. This one
// file is the extension's whole test (tests/abi/CMakeLists.txt): compiled with HEADROOM_EXT_PROBE
// it is the probe plugin ext_config_probe; without, the GoogleTest cases that run it and the
// layout pins.
#ifdef HEADROOM_EXT_PROBE

// --- The probe plugin ---------------------------------------------------------------------------
// In create(), for each of the keys list, one, none: string_count and every string_at, one line
// each to `out`:
//
//   list count=2 status=0
//   list 0 status=0 value=a.b
//   list 1 status=0 value=c
//   list past status=5
//   list short status=5          (a buffer of 2 bytes: "a.b" does not fit, "x" does)
//
// A wrong type is the host's HR_ERROR_CONFIG, which create() returns (the run does not start).
#include <headroom/ext/config.h>
#include <headroom/plugin.h>

#include <cstdio>
#include <cstring>

namespace {

hr_status create(const hr_host_services* s, void** instance) {
  char path[512] = "";
  if (s->config_string(s->host, "out", path, sizeof path) != HR_OK) return HR_ERROR_CONFIG;
  const auto* config = static_cast<const hr_ext_config*>(s->get_extension(s->host, HR_EXT_CONFIG));
  if (!config) {
    s->set_error(s->host, "the host offers no " HR_EXT_CONFIG);
    return HR_ERROR;
  }
  FILE* out = std::fopen(path, "w");
  if (!out) return s->config_error(s->host, "out", "cannot be opened");
  const char* const keys[] = {"list", "one", "none"};
  for (const char* key : keys) {
    uint32_t n = 99;
    hr_status st = config->string_count(s->host, key, &n);
    std::fprintf(out, "%s count=%u status=%d\n", key, unsigned(n), int(st));
    if (st != HR_OK) {
      std::fclose(out);
      return st;
    }
    char value[64];
    for (uint32_t i = 0; i < n; ++i) {
      st = config->string_at(s->host, key, i, value, sizeof value);
      std::fprintf(out, "%s %u status=%d value=%s\n", key, unsigned(i), int(st), value);
    }
    std::fprintf(out, "%s past status=%d\n", key,
                 int(config->string_at(s->host, key, n, value, sizeof value)));
    if (n > 0)
      std::fprintf(out, "%s short status=%d\n", key,
                   int(config->string_at(s->host, key, 0, value, 2)));
  }
  std::fclose(out);
  *instance = nullptr;
  return HR_OK;
}

void destroy(void*) {}

hr_status on_event(void*, const hr_event_info*) {
  return HR_OK;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "ext_config_probe",
    "1.0.0",
    "test plugin: records headroom.config/1's answers",
    0,  // events
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
#include "headroom/ext/config.h"
#include "tests/test_util.h"

// --- The layout, pinned (x86-64, LP64), as tests/abi_layout_test.cpp pins every other struct ---
#if defined(__x86_64__) && defined(__LP64__)
static_assert(sizeof(hr_ext_config) == 24 && offsetof(hr_ext_config, string_count) == 8 &&
              offsetof(hr_ext_config, string_at) == 16);
static_assert(std::is_same_v<decltype(hr_ext_config::string_count),
                             hr_status (*)(hr_host*, const char*, uint32_t*)>);
static_assert(std::is_same_v<decltype(hr_ext_config::string_at),
                             hr_status (*)(hr_host*, const char*, uint32_t, char*, size_t)>);
#endif

namespace headroom {
namespace {

const char* kTinyModel =
    "[model]\nn_layer = 1\nn_head = 2\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
    "[train]\nsteps = 1\nmicro_batch = 1\n";

std::string probe(const std::string& keys) {
  return std::string("[[plugins]]\nname = \"ext_config_probe\"\npath = \"") +
         HEADROOM_TEST_PLUGIN_DIR + "/ext_config_probe.so\"\n" + keys;
}

// An array, a single string (an array of one), an absent key (none); past the end and a buffer
// too short are HR_ERROR_INVALID.
TEST(ExtConfig, ArraysOfStrings) {
  const std::string dir = test::temp_dir(), out = dir + "/config.txt";
  validate_plugins(test::config_from(
      kTinyModel + probe("out = \"" + out + "\"\nlist = [\"a.b\", \"c\"]\none = \"x\"\n")));
  EXPECT_EQ(test::read_file(out),
            "list count=2 status=0\nlist 0 status=0 value=a.b\nlist 1 status=0 value=c\n"
            "list past status=5\nlist short status=5\n"
            "one count=1 status=0\none 0 status=0 value=x\none past status=5\n"
            "one short status=0\n"
            "none count=0 status=0\nnone past status=5\n");
}

// A wrong type, or a wrong element, is a config error at the key's position naming it; the keys
// read through the extension are no unknown keys.
TEST(ExtConfig, AWrongTypeIsAConfigErrorNamingTheKey) {
  const std::string dir = test::temp_dir(), out = dir + "/config.txt";
  const std::string element = test::error_of([&] {
    validate_plugins(
        test::config_from(kTinyModel + probe("out = \"" + out + "\"\nlist = [\"a\", 3]\n")));
  });
  EXPECT_TRUE(test::contains(element,
                             "test.toml:14:8: plugins.ext_config_probe.list: entry 2 is "
                             "an integer, expected a string"))
      << element;
  const std::string type = test::error_of([&] {
    validate_plugins(test::config_from(kTinyModel + probe("out = \"" + out + "\"\none = 1.5\n")));
  });
  EXPECT_TRUE(test::contains(type,
                             "plugins.ext_config_probe.one: expected an array of strings, "
                             "got a float"))
      << type;
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_EXT_PROBE
