// headroom.reads/1 (headroom/ext/reads.h): what plugins declare their hooks read, and
// PluginHost::gradient_events(), the union of it over a config's plugins. This one file is the
// extension's whole test (tests/abi/CMakeLists.txt): compiled with HEADROOM_EXT_PROBE it is the
// probe plugin ext_reads_probe; without, the GoogleTest cases and the layout pins.
#ifdef HEADROOM_EXT_PROBE

// --- The probe plugin ---------------------------------------------------------------------------
// Subscribes to TRAIN_BEGIN, BACKWARD_END and STEP_END and declares that BACKWARD_END and STEP_END
// read the gradients — and OOM, to which it does not subscribe (a bit that means nothing). Its
// hooks do nothing: what is tested is what the host reads of it when it loads it.
#include <headroom/ext/reads.h>
#include <headroom/plugin.h>

#include <cstring>

namespace {

hr_status create(const hr_host_services*, void** instance) {
  static int the_instance;
  *instance = &the_instance;
  return HR_OK;
}

void destroy(void*) {}

hr_status on_event(void*, const hr_event_info*) {
  return HR_OK;
}

const hr_ext_reads kReads = {sizeof(hr_ext_reads), 0,
                             HR_EVENT_BIT(HR_EVENT_BACKWARD_END) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
                                 HR_EVENT_BIT(HR_EVENT_OOM)};

const void* get_extension(const char* id) {
  return id && std::strcmp(id, HR_EXT_READS) == 0 ? &kReads : nullptr;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "ext_reads_probe",
    "1.0.0",
    "test plugin: declares what its hooks read (headroom.reads/1)",
    HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_BACKWARD_END) |
        HR_EVENT_BIT(HR_EVENT_STEP_END),
    0,  // roles
    0,  // reserved0
    create,
    destroy,
    on_event,
    nullptr,  // allocator
    nullptr,  // optimizer
    nullptr,  // save_state
    nullptr,  // load_state
    get_extension,
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
#include "headroom/ext/reads.h"
#include "tests/test_util.h"

// --- The layout, pinned (x86-64, LP64), as tests/abi_layout_test.cpp pins every other struct ---
#if defined(__x86_64__) && defined(__LP64__)
static_assert(sizeof(hr_ext_reads) == 16 && alignof(hr_ext_reads) == 8);
static_assert(offsetof(hr_ext_reads, struct_size) == 0 && offsetof(hr_ext_reads, reserved0) == 4);
static_assert(offsetof(hr_ext_reads, gradients) == 8);
static_assert(std::is_same_v<decltype(hr_ext_reads::gradients), uint64_t>);
#endif

namespace headroom {
namespace {

constexpr uint64_t bit(int event) {
  return HR_EVENT_BIT(event);
}

// A [[plugins]] table: an in-tree plugin by name, a test plugin by its path.
std::string in_tree(const std::string& name) {
  return "[[plugins]]\nname = \"" + name + "\"\n";
}
std::string test_plugin(const std::string& name) {
  return in_tree(name) + "path = \"" + HEADROOM_TEST_PLUGIN_DIR + "/" + name + ".so\"\n";
}

// The config's plugins loaded (not created), as train loads them.
struct Loaded {
  Config config;
  PluginHost host;
  explicit Loaded(const std::string& plugins)
      : config(test::config_from("[model]\npreset = \"tiny\"\n" + plugins)), host(config) {}
};

// What a plugin declares, and only the events it subscribes to.
TEST(ExtReads, DeclaredEventsAreWhatThePluginSays) {
  Loaded probe(test_plugin("ext_reads_probe"));
  EXPECT_EQ(probe.host.gradient_events(),
            bit(HR_EVENT_BACKWARD_END) | bit(HR_EVENT_STEP_END));  // not OOM: not subscribed
  EXPECT_NE(probe.host.subscribed_events(), probe.host.gradient_events());
}

// A plugin that declares nothing (frozen_v1_4 predates the extension) reads the gradients at
// every event it subscribes to.
TEST(ExtReads, AnUndeclaredPluginReadsAtEveryEventItSubscribesTo) {
  Loaded frozen(test_plugin("frozen_v1_4"));
  EXPECT_EQ(frozen.host.gradient_events(), frozen.host.subscribed_events());
  EXPECT_EQ(frozen.host.gradient_events(),
            bit(HR_EVENT_TRAIN_BEGIN) | bit(HR_EVENT_STEP_END) | bit(HR_EVENT_TRAIN_END));
}

// Every in-tree plugin declares, from reading its hooks.
TEST(ExtReads, InTreePluginsDeclareWhatTheirHooksRead) {
  const std::vector<std::pair<std::string, uint64_t> > declared = {
      {"amp", bit(HR_EVENT_GRADS_READY)},
      {"checkpoint", 0},
      {"defrag_allocator", 0},
      {"dynamic_batch", 0},
      {"pruning", bit(HR_EVENT_OPTIMIZER_STEP)},
      {"adafactor", 0},
      {"adam8bit", 0},
      {"zero1", bit(HR_EVENT_BACKWARD_END)},
      {"zero2", bit(HR_EVENT_BACKWARD_END)},
      {"zero3", bit(HR_EVENT_BACKWARD_END)},
  };
  for (const auto& [name, gradients] : declared) {
    Loaded one(in_tree(name));
    EXPECT_EQ(one.host.gradient_events(), gradients) << name;
  }
}

// A config's plugins together: the union of what each declared and what the undeclared ones
// subscribe to.
TEST(ExtReads, AMixIsTheUnion) {
  Loaded mix(in_tree("amp") + in_tree("checkpoint") + test_plugin("ext_reads_probe") +
             test_plugin("frozen_v1_4"));
  EXPECT_EQ(mix.host.gradient_events(), bit(HR_EVENT_GRADS_READY) | bit(HR_EVENT_BACKWARD_END) |
                                            bit(HR_EVENT_STEP_END) | bit(HR_EVENT_TRAIN_BEGIN) |
                                            bit(HR_EVENT_TRAIN_END));
  Loaded declared_none(in_tree("checkpoint") + in_tree("dynamic_batch"));
  EXPECT_EQ(declared_none.host.gradient_events(), 0u);
  EXPECT_NE(declared_none.host.subscribed_events(), 0u);
}

}  // namespace
}  // namespace headroom

#endif  // HEADROOM_EXT_PROBE
