// The plugin host: finds the libraries a config's [[plugins]] list names, loads them with
// Boost.DLL, negotiates the ABI, hands each its services table, dispatches the loop's events to
// them in TOML order, and puts the allocator and optimizer roles in place.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/device/device.h"
#include "core/events/events.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/plugin_host/run_interfaces.h"
#include "core/shard/sharding.h"
#include "headroom/plugin.h"

namespace headroom {

// A plugin hook failed during the run: the host stops with exit code 1. The message names the
// plugin and the event.
class PluginFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What `headroom plugins` shows of one library file.
struct PluginInfo {
  std::string file;
  std::string name, version, description;
  uint32_t abi_version = 0;
  uint64_t events = 0;
  uint32_t roles = 0;
  std::string error;  // non-empty when the file could not be loaded as a plugin
};

// Where plugins are looked for, in order: HEADROOM_PLUGIN_PATH (colon-separated), the folder next
// to the executable (<exe>/../lib/headroom/plugins), the installed folder, and the build folder —
// that last only for an executable of the build tree itself (an installed headroom has its own).
std::vector<std::string> plugin_search_path();
// Every <dir>/*.so on the search path, loaded and asked for its descriptor (not instantiated).
std::vector<PluginInfo> discover_plugins();
std::string format_abi_version(uint32_t version);  // "1.0"
std::string describe_events(uint64_t mask);        // "STEP_END,ALLOC,FREE"
std::string describe_roles(uint32_t roles);        // "allocator,optimizer" or "-"

struct LoadedPlugin;  // one library and its instance (plugin_host.cpp)

// What a plugin offers the host under one extension id (hr_plugin_descriptor.get_extension).
struct OfferedExtension {
  std::string plugin;        // the plugin's name
  const void* table;         // its table for the id, to be cast to the id's struct
  void* instance = nullptr;  // the created instance; nullptr for a plugin that is not created
  uint32_t roles = 0;        // the HR_ROLE_*s its descriptor takes
};

// Every loadable plugin on the search path, loaded and kept loaded but not created: what the
// plugins a config does not list would offer (their estimates, for the advice).
class PluginCatalog {
 public:
  PluginCatalog();
  ~PluginCatalog();
  PluginCatalog(const PluginCatalog&) = delete;
  PluginCatalog& operator=(const PluginCatalog&) = delete;
  std::vector<std::string> names() const;
  // In search-path order, the first library of each name only; instance is nullptr.
  std::vector<OfferedExtension> offered(const char* id) const;

 private:
  std::vector<std::unique_ptr<LoadedPlugin>> plugins_;
};

// What `train` checks of the [[plugins]] before it builds the model, for `headroom check` and
// `headroom plan`: finds and loads every entry's library (the same lookup and refusals as
// PluginHost), negotiates its ABI, and creates each instance as train does — the allocator role
// first — then destroys them all. A plugin reads its own table only in create(), through the
// config getters, so that is where a wrong-typed or unknown key, or a value the plugin rejects, is
// found: the same ConfigError as train's, naming file:line of the key. Any other create() failure
// is a PluginFailure, as in train.
//
// There is no model. The device is the CPU backend: the config's own when [device] kind is "cpu"
// (its memory_limit included), otherwise a CPU device without a limit, so that a CUDA config is
// checked on a machine without a GPU (services->device_kind still says "cuda"; a value a plugin
// checks against the device, such as defrag_allocator's page_size against vm_granularity, is
// checked against the CPU's 2 MiB). What a plugin does in create() happens here too (amp chooses
// its compute dtype; a plugin may open a file), then its destroy() runs.
void validate_plugins(const Config& config);

class PluginHost;
// The config's plugins created as validate_plugins creates them, and kept until destroyed: what
// the created plugins offer (their estimates of the config as written, for `headroom plan` and
// the advice).
class CreatedPlugins {
 public:
  explicit CreatedPlugins(const Config& config);  // throws as validate_plugins does
  ~CreatedPlugins();
  CreatedPlugins(const CreatedPlugins&) = delete;
  CreatedPlugins& operator=(const CreatedPlugins&) = delete;
  PluginHost& host() { return *host_; }

 private:
  // In this order, so that they go in reverse: the instances (the allocator last), then the run
  // and the device they allocated from.
  class Run;  // the run they are created against (plugin_host.cpp)
  std::unique_ptr<Device> device_;
  std::unique_ptr<Run> run_;
  std::unique_ptr<PluginHost> host_;
};

class PluginHost final : public EventListener {
 public:
  // Finds, checks and loads every [[plugins]] entry and negotiates its ABI version. Throws
  // ConfigError (exit code 2), naming the entry's file:line, for a plugin that cannot be found or
  // loaded, is writable by others than its owner, speaks another major version, refuses to load,
  // or takes a role another plugin already has.
  explicit PluginHost(const Config& config);
  // Destroys every instance (the allocator last), then unloads the libraries.
  ~PluginHost() override;
  PluginHost(const PluginHost&) = delete;
  PluginHost& operator=(const PluginHost&) = delete;

  // Creates the instances — the allocator-role plugin first, then the rest in TOML order — and
  // installs the allocator on the device. A plugin whose table has a wrong-typed or unknown key
  // is a ConfigError; any other create() failure is a PluginFailure. What `run` has none of, the
  // services answer as run_interfaces.h says.
  void create(const RunInterfaces& run);

  bool provides_optimizer() const;
  // The name of the plugin with the optimizer role ("" when none has it), for messages.
  std::string optimizer_plugin() const;
  // The HR_EVENT_BIT()s of the events any plugin subscribes to.
  uint64_t subscribed_events() const;
  // The HR_EVENT_BIT()s of the events at which some plugin's hooks read or write the gradients:
  // the union of what each declared in headroom.reads/1, a plugin that declared nothing counting
  // as reading them at every event it subscribes to.
  uint64_t gradient_events() const;
  // A plugin reduces the gradients across ranks itself: core's data-parallel all-reduce is off.
  bool provides_gradient_reduction() const;
  // The allocator-role plugin's statistics; false when there is none or it keeps none.
  bool allocator_stats(hr_allocator_stats* out) const;
  // The optimizer-role plugin behind the host's Optimizer interface.
  std::unique_ptr<Optimizer> make_optimizer();

  // Dispatches to every plugin subscribed to the event, in TOML order. Throws PluginFailure when
  // a hook returns an error (a failure in a FREE hook is reported at the next event, since frees
  // happen where nothing may throw).
  void on_event(const EventInfo& info) override;

  // Each plugin's state for a snapshot, by plugin name (plugins without save_state, or
  // headroom.state/1, have none).
  std::map<std::string, std::vector<uint8_t>> save_states();
  // Hands each plugin its saved state from `snapshot` (the file, for messages; may be empty), in
  // TOML order; a plugin the snapshot holds no state of is not called. A
  // state for a plugin this run does not load, or for one that cannot load state, is a
  // ConfigError; so is a load_state returning HR_ERROR_CONFIG, naming the plugin and carrying its
  // message. Any other failure is a PluginFailure.
  void load_states(const std::map<std::string, std::vector<uint8_t>>& states,
                   const std::string& snapshot = "");

  size_t size() const { return plugins_.size(); }
  // What the created plugins offer under `id`, in TOML order.
  std::vector<OfferedExtension> offered(const char* id) const;
  // The HR_ROLE_*s the config's plugins take, together.
  uint32_t roles() const;

 private:
  friend struct HostServices;
  std::vector<std::unique_ptr<LoadedPlugin>> plugins_;
  class AllocatorAdapter;
  std::unique_ptr<AllocatorAdapter> allocator_;
  RunInterfaces run_;  // with_defaults(): every interface set once create() has begun
  std::string device_kind_;
  int device_index_ = 0;  // [device] index
  std::string pending_failure_;
  // The plugins' communicator when the run has none (made on first use): world size 1.
  std::unique_ptr<Communicator> self_comm_;
  // The event being dispatched (-1: none) and its layer: drop_activations checks it.
  int current_event_ = -1;
  int current_layer_ = -1;
};

}  // namespace headroom
