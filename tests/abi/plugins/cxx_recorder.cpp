// A test plugin in C++17, built with headroom_add_plugin as a third party's would be: std::string,
// std::vector and std::to_string inside (the C++ runtime's templates they instantiate are weak
// symbols, which hidden visibility alone leaves exported; the version script keeps them in), the
// descriptor filled field by field (C++17 has no designated initializers), no exception crossing
// the C ABI. Appends to `out`, one line per event: "cxx_recorder <EVENT> step=<step>" at
// TRAIN_BEGIN, STEP_END and TRAIN_END, then at TRAIN_END the steps it kept in a std::vector.
#include <headroom/plugin.h>

#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Recorder {
  const hr_host_services* services = nullptr;
  std::string out;
  std::vector<int64_t> steps;

  void append(const std::string& line) const {
    FILE* f = std::fopen(out.c_str(), "a");
    if (!f) throw std::runtime_error("cannot open " + out);
    std::fprintf(f, "cxx_recorder %s\n", line.c_str());
    std::fclose(f);
  }
};

// The hook's body, with whatever it throws turned into a status and a message.
template <class F>
hr_status guarded(const hr_host_services* s, F&& body) noexcept {
  try {
    body();
    return HR_OK;
  } catch (const std::exception& e) {
    s->set_error(s->host, (std::string("cxx_recorder: ") + e.what()).c_str());
    return HR_ERROR;
  } catch (...) {
    return HR_ERROR;
  }
}

hr_status create(const hr_host_services* s, void** instance) {
  auto* r = new (std::nothrow) Recorder;
  if (!r) return HR_ERROR_OUT_OF_MEMORY;
  r->services = s;
  char out[4096] = "";
  const hr_status st = s->config_string(s->host, "out", out, sizeof out);
  if (st != HR_OK || out[0] == '\0') {
    delete r;
    return st != HR_OK ? st : s->config_error(s->host, "out", "cxx_recorder needs `out`");
  }
  r->out = out;
  *instance = r;
  return HR_OK;
}

void destroy(void* instance) {
  delete static_cast<Recorder*>(instance);
}

hr_status on_event(void* instance, const hr_event_info* info) {
  auto* r = static_cast<Recorder*>(instance);
  return guarded(r->services, [&] {
    const char* name = info->event == HR_EVENT_TRAIN_BEGIN ? "TRAIN_BEGIN"
                       : info->event == HR_EVENT_STEP_END  ? "STEP_END"
                                                           : "TRAIN_END";
    r->append(std::string(name) + " step=" + std::to_string(info->step));
    if (info->event == HR_EVENT_STEP_END) r->steps.push_back(info->step);
    if (info->event == HR_EVENT_TRAIN_END) {
      std::string kept = "kept";
      for (int64_t s : r->steps)
        kept += " " + std::to_string(s);
      r->append(kept);
    }
  });
}

// Every field set by name; the value-initialisation zeroes the rest (reserved fields, the roles'
// hooks, get_extension).
hr_plugin_descriptor make_descriptor() {
  hr_plugin_descriptor d{};
  d.struct_size = sizeof d;
  d.abi_version = HR_ABI_VERSION;
  d.name = "cxx_recorder";
  d.version = "1.0.0";
  d.description = "test plugin: C++17, records its events";
  d.events = HR_EVENT_BIT(HR_EVENT_TRAIN_BEGIN) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
             HR_EVENT_BIT(HR_EVENT_TRAIN_END);
  d.create = create;
  d.destroy = destroy;
  d.on_event = on_event;
  return d;
}

const hr_plugin_descriptor kDescriptor = make_descriptor();

}  // namespace

HR_PLUGIN_EXPORT hr_status hr_plugin_entry(hr_entry_args* args) {
  return hr_negotiate(args, &kDescriptor);
}
