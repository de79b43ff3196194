// What the plugin host's files share (loader.cpp, the service files, plugin_host.cpp): one loaded
// plugin, the handle a plugin passes back to every service, the sized reads and writes of ABI
// structs, and the loader's entry points. Not installed: nothing outside core/plugin_host/ uses it.
#pragma once

#ifndef BOOST_DLL_USE_STD_FS
#define BOOST_DLL_USE_STD_FS
#endif

#include <toml++/toml.h>
#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/plugin_host/plugin_host.h"
#include "headroom/plugin.h"

// The opaque handle a plugin passes back to every service: which plugin is calling.
struct hr_host {
  headroom::PluginHost* owner = nullptr;
  headroom::LoadedPlugin* plugin = nullptr;
};

namespace headroom {

constexpr uint32_t kHostAbiMin = HR_ABI_MAKE_VERSION(1, 0);
constexpr uint32_t kHostAbiMax = HR_ABI_VERSION;

// The HR_EVENT_BIT()s of the events a plugin that negotiated ABI `abi` can know (loader.cpp):
// the only ones it is given.
uint64_t events_of_abi(uint32_t abi);

// Copies what the writer's struct_size covers into a zeroed struct of the reader's layout.
template <class S>
S read_sized(const S* src) {
  S out;
  std::memset(&out, 0, sizeof out);
  const size_t n = std::min<size_t>(src->struct_size, sizeof(S));
  std::memcpy(&out, src, n);
  out.struct_size = static_cast<uint32_t>(sizeof(S));
  return out;
}

// A struct's size in ABI 1.0: what a caller that left struct_size zero is taken to hold.
// hr_tensor grew in 1.5 (grad_dtype), hr_memory_stats in 1.7 (live_plugin, peak_plugin). The
// extensions' structs pass theirs to write_sized (their first version's).
template <class S>
constexpr size_t v1_0_size_of() {
  return sizeof(S);
}
template <>
constexpr size_t v1_0_size_of<hr_tensor>() {
  return offsetof(hr_tensor, grad_dtype);
}
// hr_memory_stats grew in 1.7 (live_plugin, peak_plugin): a 1.6 caller's struct ends before them.
template <>
constexpr size_t v1_0_size_of<hr_memory_stats>() {
  return offsetof(hr_memory_stats, live_plugin);
}

// Writes a host-side struct into the caller's, only as far as the caller's struct_size reaches
// (a plugin built against an older header has a smaller struct: nothing past it is written).
// A struct_size below ABI 1.0's (a caller that left it zero) counts as 1.0's: every field of 1.0
// is filled.
template <class S>
void write_sized(S* dst, const S& src, size_t v1_0_size = v1_0_size_of<S>()) {
  const size_t size = std::max<size_t>(dst->struct_size, v1_0_size);
  std::memcpy(dst, &src, std::min<size_t>(size, sizeof(S)));
  dst->struct_size = static_cast<uint32_t>(std::min<size_t>(size, sizeof(S)));
}

inline std::string status_name(hr_status s) {
  switch (s) {
    case HR_OK:
      return "HR_OK";
    case HR_ERROR:
      return "HR_ERROR";
    case HR_ERROR_CONFIG:
      return "HR_ERROR_CONFIG";
    case HR_ERROR_OUT_OF_MEMORY:
      return "HR_ERROR_OUT_OF_MEMORY";
    case HR_ERROR_UNSUPPORTED:
      return "HR_ERROR_UNSUPPORTED";
    case HR_ERROR_INVALID:
      return "HR_ERROR_INVALID";
    case HR_ERROR_VERSION:
      return "HR_ERROR_VERSION";
    case HR_ERROR_NOT_ALLOWED:
      return "HR_ERROR_NOT_ALLOWED";
    default:
      return "status " + std::to_string(s);
  }
}

inline std::string join(const std::vector<std::string>& parts, const std::string& sep = ", ") {
  std::string s;
  for (const std::string& p : parts)
    s += (s.empty() ? "" : sep) + p;
  return s;
}

// ---------------------------------------------------------------------------------------------
// One plugin: its library, what it declared, its instance and its services.

struct LoadedPlugin {
  PluginEntry entry;
  std::string file;
  boost::dll::shared_library library;
  uint32_t abi = 0;
  hr_plugin_descriptor desc{};
  hr_allocator_hooks allocator{};
  hr_optimizer_hooks optimizer{};
  // Its state in snapshots: the descriptor's save_state / load_state (ABI 1.1), else the
  // headroom.state/1 extension it offers (ABI 1.5); both NULL when it has none.
  hr_status (*save_state)(void* instance, const hr_state_writer* writer) = nullptr;
  hr_status (*load_state)(void* instance, const void* data, uint64_t size) = nullptr;
  // The HR_EVENT_BIT()s of the events whose hooks read or write the gradients: its
  // headroom.reads/1, else every event it subscribes to.
  uint64_t gradient_events = 0;

  void* instance = nullptr;
  bool created = false;
  bool creating = false;      // in its create(): what set_compute_dtype's rule allows
  int in_allocator_hook = 0;  // inside its allocate / deallocate: what alloc and free refuse
  hr_host handle;
  hr_host_services services{};
  toml::table table;            // the plugin's own keys
  std::set<std::string> asked;  // keys a config getter asked for
  std::string error;            // the last set_error message
  // The run's own failure a service met on the plugin's behalf: an allocation that ran out of
  // memory (a zero3 gather), or a collective a failing peer abandoned. The host rethrows it when
  // the plugin returns its error, so the run ends as that failure (out of memory: the report, the
  // advice, exit 3; a peer's: exit 6) rather than as a plugin failure.
  std::exception_ptr run_failure;
  std::set<void*> allocations;  // what services->alloc handed out and free may take back

  std::string where() const { return entry.pos.str() + ": plugin '" + entry.name + "'"; }
  // The message the plugin handed over, or a generic one for its status.
  std::string take_error(hr_status status) {
    std::string m = error.empty() ? "it gave no message (" + status_name(status) + ")" : error;
    error.clear();
    return m;
  }
  // A hook's HR_ERROR_CONFIG as a ConfigError: the config getters' and config_error's messages
  // already start with the key's file:line; anything else is prefixed with the entry's.
  ConfigError config_error(const std::string& hook) {
    bool positioned = false;
    auto starts_with_file = [&](const SourcePos& pos) {
      positioned |= !pos.file.empty() && error.compare(0, pos.file.size(), pos.file) == 0;
    };
    starts_with_file(entry.pos);
    for (const auto& kp : entry.key_pos)
      starts_with_file(kp.second);
    const std::string m = take_error(HR_ERROR_CONFIG);
    return ConfigError(positioned ? m : where() + ": " + hook + ": " + m);
  }
};

// A category as the plugin's ABI version knows it: HR_MEM_PLUGIN (ABI 1.7) reads as
// HR_MEM_OPTIMIZER to a plugin that negotiated an older version, where plugins kept their own
// memory before (headroom/plugin.h).
inline uint32_t category_for(const LoadedPlugin& p, Category c) {
  if (c == Category::kPlugin && p.abi < HR_ABI_MAKE_VERSION(1, 7)) return HR_MEM_OPTIMIZER;
  return uint32_t(c);
}

// --- loader.cpp ---
// Loads `file` and asks its entry point for the descriptor (and, for a 1.5 plugin, the role hooks
// and state it offers as extensions). Throws ConfigError prefixed by `where` (when not empty),
// naming the file and what is wrong with it.
std::unique_ptr<LoadedPlugin> load_library(const std::string& file, const std::string& where);
// How messages about an entry's library begin: where its path was set, and the plugin's name.
std::string file_where(const PluginEntry& e);
// The file for a [[plugins]] entry: its path, else <name>.so on the search path.
std::string find_plugin_file(const PluginEntry& e);
// Every <dir>/*.so on the search path: folder by folder, each folder's files in name order.
std::vector<std::string> plugin_files_on_search_path();

// --- services_v1.cpp ---
// The services table handed to `p`'s create(): every 1.4 function and get_extension.
hr_host_services make_services(LoadedPlugin& p);
// "file:line:col: plugins.<name>.<key>", for messages about one of a plugin's keys.
std::string key_where(const LoadedPlugin& p, const std::string& key);

}  // namespace headroom
