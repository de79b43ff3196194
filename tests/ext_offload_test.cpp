// headroom.offload/1 (headroom/ext/offload.h) through a real plugin loaded from a TOML. This one
// file is the extension's whole test (tests/abi/CMakeLists.txt): compiled with HEADROOM_EXT_PROBE
// it is the probe plugin ext_offload_probe; without, the GoogleTest cases that run it and the
// layout pins.
#ifdef HEADROOM_EXT_PROBE

// --- The probe plugin ---------------------------------------------------------------------------
// In create(): set_optimizer_place with a place that is none (recorded), then HR_PLACE_HOST when
// `host` is true, and optimizer_place. At STEP_END: set_optimizer_place again (outside create:
// refused), optimizer_place, and host_memory_stats with a full struct and with a 1.6 plugin's
// (which ends before live_plugin). One line each to `out`:
//
//   create bad=5 set=0 place=1
//   STEP_END step=1 set=7 place=1 stats=0 limit=0 live=... optimizer=... parameters=...
//       gradients=... short_size=152 short_plugin=7
//
// With `files` (a folder; the table's appended set_optimizer_files, the NVMe tier), instead of
// HR_PLACE_HOST: set_optimizer_files with a direct_io that is none, with no folder, then with
// `files` and HR_DIRECT_IO_OFF; and at STEP_END once more (outside create: refused):
//
//   files bad_io=5 empty=5 set=0 place=2
//   STEP_END files=7
#include <headroom/ext/offload.h>
#include <headroom/plugin.h>

#include <cstddef>
#include <cstdio>
#include <cstring>

namespace {

struct Probe {
  const hr_host_services* s;
  const hr_ext_offload* offload;
  FILE* out;
  bool files;
};

hr_status create(const hr_host_services* s, void** instance) {
  char path[512] = "", files[512] = "";
  int32_t host = 0;
  if (s->config_string(s->host, "out", path, sizeof path) != HR_OK ||
      s->config_bool(s->host, "host", &host) != HR_OK ||
      s->config_string(s->host, "files", files, sizeof files) != HR_OK)
    return HR_ERROR_CONFIG;
  if (!path[0]) return s->config_error(s->host, "out", "is required");
  const hr_ext_offload* offload =
      static_cast<const hr_ext_offload*>(s->get_extension(s->host, HR_EXT_OFFLOAD));
  if (!offload) {
    s->set_error(s->host, "the host offers no " HR_EXT_OFFLOAD);
    return HR_ERROR;
  }
  const hr_status bad = offload->set_optimizer_place(s->host, 7);
  const hr_status set = host ? offload->set_optimizer_place(s->host, HR_PLACE_HOST) : HR_OK;
  FILE* out = std::fopen(path, "w");
  if (!out) return s->config_error(s->host, "out", "cannot be opened");
  std::fprintf(out, "create bad=%d set=%d place=%u\n", int(bad), int(set),
               unsigned(offload->optimizer_place(s->host)));
  if (files[0]) {
    const hr_status bad_io = offload->set_optimizer_files(s->host, files, 9);
    const hr_status empty = offload->set_optimizer_files(s->host, "", HR_DIRECT_IO_OFF);
    const hr_status set_files = offload->set_optimizer_files(s->host, files, HR_DIRECT_IO_OFF);
    std::fprintf(out, "files bad_io=%d empty=%d set=%d place=%u\n", int(bad_io), int(empty),
                 int(set_files), unsigned(offload->optimizer_place(s->host)));
  }
  *instance = new Probe{s, offload, out, files[0] != 0};
  return HR_OK;
}

void destroy(void* instance) {
  Probe* p = static_cast<Probe*>(instance);
  std::fclose(p->out);
  delete p;
}

hr_status on_event(void* instance, const hr_event_info* info) {
  Probe* p = static_cast<Probe*>(instance);
  const hr_status set = p->offload->set_optimizer_place(p->s->host, HR_PLACE_DEVICE);
  hr_memory_stats m;
  std::memset(&m, 0, sizeof m);
  m.struct_size = sizeof m;
  const hr_status st = p->offload->host_memory_stats(p->s->host, &m);
  hr_memory_stats shorter;  // as a plugin built against 1.6 has it: no live_plugin, peak_plugin
  std::memset(&shorter, 0, sizeof shorter);
  shorter.struct_size = offsetof(hr_memory_stats, live_plugin);
  shorter.live_plugin = 7;  // what the host must not overwrite in a shorter struct
  p->offload->host_memory_stats(p->s->host, &shorter);
  std::fprintf(p->out,
               "STEP_END step=%lld set=%d place=%u stats=%d limit=%llu live=%llu optimizer=%llu "
               "parameters=%llu gradients=%llu short_size=%u short_plugin=%llu\n",
               static_cast<long long>(info->step), int(set),
               unsigned(p->offload->optimizer_place(p->s->host)), int(st),
               static_cast<unsigned long long>(m.limit),
               static_cast<unsigned long long>(m.live_bytes),
               static_cast<unsigned long long>(m.live_by_category[HR_MEM_OPTIMIZER]),
               static_cast<unsigned long long>(m.live_by_category[HR_MEM_PARAMETERS]),
               static_cast<unsigned long long>(m.live_by_category[HR_MEM_GRADIENTS]),
               unsigned(shorter.struct_size), static_cast<unsigned long long>(shorter.live_plugin));
  if (p->files)
    std::fprintf(p->out, "STEP_END files=%d\n",
                 int(p->offload->set_optimizer_files(p->s->host, "/tmp", HR_DIRECT_IO_AUTO)));
  return HR_OK;
}

const hr_plugin_descriptor kDescriptor = {
    sizeof(hr_plugin_descriptor),
    HR_ABI_VERSION,
    "ext_offload_probe",
    "1.0.0",
    "test plugin: records headroom.offload/1's answers",
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
    nullptr,  // get_extension
};

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}

#else  // the tests

#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "core/optim/optim.h"
#include "core/optim/state_layout.h"
#include "core/run/host_optimizer.h"
#include "core/run/trainer.h"
#include "headroom/ext/offload.h"
#include "tests/test_util.h"

// --- The layout, pinned (x86-64, LP64), as tests/abi_layout_test.cpp pins every other struct ---
#if defined(__x86_64__) && defined(__LP64__)
static_assert(HR_PLACE_DEVICE == 0 && HR_PLACE_HOST == 1 && HR_PLACE_NVME == 2);
static_assert(HR_DIRECT_IO_AUTO == 0 && HR_DIRECT_IO_ON == 1 && HR_DIRECT_IO_OFF == 2);
static_assert(sizeof(hr_ext_offload) == 72 && alignof(hr_ext_offload) == 8);
static_assert(offsetof(hr_ext_offload, struct_size) == 0);
static_assert(offsetof(hr_ext_offload, reserved0) == 4);
static_assert(offsetof(hr_ext_offload, set_optimizer_place) == 8);
static_assert(offsetof(hr_ext_offload, optimizer_place) == 16);
static_assert(offsetof(hr_ext_offload, host_memory_stats) == 24);
static_assert(offsetof(hr_ext_offload, set_optimizer_files) == 32);   // appended
static_assert(offsetof(hr_ext_offload, set_activation_place) == 40);  // appended
static_assert(offsetof(hr_ext_offload, set_host_page_locked) == 48);  // appended
static_assert(offsetof(hr_ext_offload, set_parameter_place) == 56);   // appended
static_assert(offsetof(hr_ext_offload, set_parameter_files) == 64);   // appended
static_assert(std::is_same_v<decltype(hr_ext_offload::set_parameter_place),
                             hr_status (*)(hr_host*, uint32_t)>);
static_assert(std::is_same_v<decltype(hr_ext_offload::set_activation_place),
                             hr_status (*)(hr_host*, uint32_t)>);
static_assert(std::is_same_v<decltype(hr_ext_offload::set_host_page_locked),
                             hr_status (*)(hr_host*, int32_t)>);
static_assert(std::is_same_v<decltype(hr_ext_offload::set_optimizer_files),
                             hr_status (*)(hr_host*, const char*, uint32_t)>);
static_assert(std::is_same_v<decltype(hr_ext_offload::set_optimizer_place),
                             hr_status (*)(hr_host*, uint32_t)>);
static_assert(std::is_same_v<decltype(hr_ext_offload::optimizer_place), uint32_t (*)(hr_host*)>);
static_assert(std::is_same_v<decltype(hr_ext_offload::host_memory_stats),
                             hr_status (*)(hr_host*, hr_memory_stats*)>);
#endif

namespace headroom {
namespace {

const char* kTinyModel =
    "[model]\nn_layer = 2\nn_head = 2\nn_embd = 8\nseq_len = 4\nvocab_size = 16\n"
    "[train]\nsteps = 2\nmicro_batch = 1\ngrad_accum = 1\n";

std::string probe(const std::string& keys) {
  return std::string("[[plugins]]\nname = \"ext_offload_probe\"\npath = \"") +
         HEADROOM_TEST_PLUGIN_DIR + "/ext_offload_probe.so\"\n" + keys;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t at = 0;
  for (size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1)
    lines.push_back(text.substr(at, nl - at));
  return lines;
}

// The place is chosen from create() only, among the two there are; the host ledger's statistics
// are what the host optimizer holds (its closed form), filled only as far as the caller's struct
// reaches.
TEST(ExtOffload, PlaceFromCreateAndTheHostLedgersStatistics) {
  const std::string dir = test::temp_dir(), out = dir + "/o.txt";
  ByCategory host{};
  uint64_t device_optimizer = 1;
  {
    Trainer t(test::config_from(kTinyModel + probe("out = \"" + out + "\"\nhost = true\n") +
                                "[host]\nmemory_limit = \"1MiB\"\n"),
              TrainOptions{});
    t.run();
    host = host_optimizer_bytes(whole_params(t.model().params()), 2, Dtype::kF32);
    device_optimizer = t.device().tracker().peak(Category::kOptimizer);
  }  // the probe closes its file
  uint64_t live = 0;
  for (uint64_t b : host)
    live += b;
  const std::string at_end =
      " set=7 place=1 stats=0 limit=1048576 live=" + std::to_string(live) +
      " optimizer=" + std::to_string(host[int(Category::kOptimizer)]) +
      " parameters=" + std::to_string(host[int(Category::kParameters)]) +
      " gradients=" + std::to_string(host[int(Category::kGradients)]) +
      " short_size=" + std::to_string(offsetof(hr_memory_stats, live_plugin)) + " short_plugin=7";
  EXPECT_EQ(lines_of(test::read_file(out)),
            (std::vector<std::string>{"create bad=5 set=0 place=1", "STEP_END step=1" + at_end,
                                      "STEP_END step=2" + at_end}));
  EXPECT_EQ(device_optimizer, 0u);
}

// The NVMe tier from create() only (set_optimizer_files, appended): a direct_io that is none of
// the three and no folder are refused; the place is HR_PLACE_NVME, the host ledger holds the
// staging of the state (core/optim/state_layout.h), the device none of it, the folder nothing
// after the run.
TEST(ExtOffload, NvmeTierFromCreate) {
  const std::string dir = test::temp_dir(), out = dir + "/o.txt", files = dir + "/state";
  std::filesystem::create_directories(files);
  uint64_t host_optimizer = 0, device_optimizer = 1, staging = 0;
  {
    Trainer t(
        test::config_from(kTinyModel + probe("out = \"" + out + "\"\nfiles = \"" + files + "\"\n")),
        TrainOptions{});
    t.run();
    std::vector<uint64_t> numels;
    for (const OptSegment& s : whole_params(t.model().params()))
      numels.push_back(s.numel);
    staging = state_file_host_bytes(numels, 2, Dtype::kF32, true);
    host_optimizer = t.device().host_place()->tracker().peak(Category::kOptimizer);
    device_optimizer = t.device().tracker().peak(Category::kOptimizer);
  }
  const auto lines = lines_of(test::read_file(out));
  ASSERT_EQ(lines.size(), 6u) << test::read_file(out);  // create, files, 2 x (STEP_END, files)
  EXPECT_EQ(lines[0], "create bad=5 set=0 place=0");
  EXPECT_EQ(lines[1], "files bad_io=5 empty=5 set=0 place=2");
  EXPECT_EQ(lines[3], "STEP_END files=7");
  EXPECT_EQ(lines[5], "STEP_END files=7");
  EXPECT_EQ(host_optimizer, staging);
  EXPECT_EQ(device_optimizer, 0u);
  EXPECT_TRUE(std::filesystem::is_empty(files));
}

// Without a choice the optimizer stays on the device and the host ledger holds nothing.
TEST(ExtOffload, WithoutAChoiceTheDevice) {
  const std::string dir = test::temp_dir(), out = dir + "/o.txt";
  uint64_t device_optimizer = 0;
  {
    Trainer t(test::config_from(kTinyModel + probe("out = \"" + out + "\"\n")), TrainOptions{});
    t.run();
    device_optimizer = t.device().tracker().peak(Category::kOptimizer);
  }  // the probe closes its file
  const auto lines = lines_of(test::read_file(out));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "create bad=5 set=0 place=0");
  EXPECT_TRUE(test::starts_with(lines[1], "STEP_END step=1 set=7 place=0 stats=0 limit=0 live=0 "))
      << lines[1];
  EXPECT_GT(device_optimizer, 0u);
}

}  // namespace
}  // namespace headroom

#endif
