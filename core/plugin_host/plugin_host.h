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
#include "core/shard/sharding.h"
#include "headroom/plugin.h"

namespace headroom {

// A plugin hook failed during the run: the host stops with exit code 1. The message names the
// plugin and the event.
class PluginFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A resize (headroom.resize/1) this run cannot do: sharded, on several ranks, or an optimizer
// that cannot resize its state. Nothing was changed.
class ResizeRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Where the current optimizer step stands, for headroom.step/1 and headroom.precision/1 (the
// fields are hr_step_state's, headroom/ext/step.h, which says when each is defined).
struct RunState {
  int64_t step = 0;
  int micro_step = 0;
  int micro_steps = 1;  // [train] grad_accum
  double lr = 0.0;
  double loss_scale = 1.0;  // what this step's backward uses
  double loss = 0.0;        // the mean over the tokens of the micro-steps whose loss is known
  uint64_t tokens = 0;
  double grad_norm = 0.0;  // from OPTIMIZER_STEP on
  double clip_coef = 1.0;  // from OPTIMIZER_STEP on
  bool skipped = false;
  Precision precision;  // the compute dtype and the model state's layout around it
};

// The micro-batch of the steps, for headroom.batch/1 (the fields are hr_batch_state's,
// headroom/ext/batch.h).
struct BatchState {
  int configured_micro_batch = 1, configured_grad_accum = 1;
  int micro_batch = 1, grad_accum = 1;
  int restarts = 0;
  uint64_t memory_limit = 0;
  uint64_t attempt_start_bytes = 0, attempt_peak_bytes = 0;
};

// What plugins reach of the training run beyond the device: implemented by the trainer.
class PluginRun {
 public:
  virtual ~PluginRun() = default;
  virtual Device& device() = 0;
  virtual Gpt<float>* built_model() = 0;  // nullptr until the model is built
  virtual void veto_step(const std::string& plugin, const std::string& reason) = 0;
  virtual void request_retry(const std::string& plugin, const std::string& reason) = 0;
  // The dtype the model computes in; only before the model is built (std::logic_error after, or
  // when another plugin chose another; std::invalid_argument for a dtype that is not f32, bf16 or
  // f16).
  virtual void set_compute_dtype(const std::string& plugin, Dtype dtype) = 0;
  // The state layout around the compute dtype (headroom.precision/1's appended setters): only
  // before the model is built, after set_compute_dtype; std::invalid_argument naming what
  // precision_problem() finds, std::logic_error after the model is built.
  virtual void set_precision(const std::string& plugin, const Precision& p) {
    (void)p;
    throw std::logic_error(plugin + ": this run has no model state to lay out");
  }
  // The factor the loss gradient is multiplied by from the next step on (std::invalid_argument
  // unless finite and > 0).
  virtual void set_loss_scale(const std::string& plugin, double scale) = 0;
  // Where the run stands now.
  virtual RunState state() const = 0;
  // The run's communicator, for headroom.comm/1 and the ranks of the services table. nullptr: a
  // single process (the plugins see rank 0 of 1, their collectives local). A run launched on
  // several ranks must return its own.
  virtual Communicator* plugin_communicator() { return nullptr; }
  // headroom.shard/1. What the run shards (kShard* bits), from `plugin`'s create() only:
  // std::logic_error after, or when another plugin chose already; std::invalid_argument for bits
  // that are no ZeRO stage. A run that cannot shard says so with std::logic_error.
  virtual void set_partition(const std::string& plugin, uint32_t what) {
    (void)what;
    throw std::logic_error(plugin + ": this run has no model to shard");
  }
  // headroom.shard/1 persist_below: from create() only, after set_partition with parameters
  // sharded (std::logic_error otherwise).
  virtual void set_persist_below(const std::string& plugin, uint64_t elements) {
    (void)elements;
    throw std::logic_error(plugin + ": this run has no model to shard");
  }
  // The mechanism, once the model is built with something sharded; else nullptr.
  virtual Sharding* sharding() { return nullptr; }
  // headroom.batch/1. Where the steps' micro-batch stands.
  virtual BatchState batch_state() const { return BatchState{}; }
  // From the OOM event: the step runs again from its first micro-step at `micro_batch` once the
  // failed allocation has unwound (std::invalid_argument for a micro-batch that does not divide
  // [train] micro_batch or is above the current one; std::logic_error where steps cannot be
  // restarted).
  virtual void restart_step(const std::string& plugin, int micro_batch, const std::string& reason) {
    (void)micro_batch;
    (void)reason;
    throw std::logic_error(plugin + ": this run has no steps to restart");
  }
  // From TRAIN_BEGIN, STEP_BEGIN (this step) or STEP_END (the next step): the micro-batch
  // (std::invalid_argument for one that does not divide [train] micro_batch).
  virtual void set_micro_batch(const std::string& plugin, int micro_batch,
                               const std::string& reason) {
    (void)micro_batch;
    (void)reason;
    throw std::logic_error(plugin + ": this run has no steps to size");
  }
  // headroom.resize/1: keeps the hidden units `keep` of block `layer`'s MLP (Gpt::resize_mlp)
  // with every slot and the optimizer's state. std::invalid_argument for a bad layer or list,
  // ResizeRefused for a run that cannot resize, OutOfMemory.
  virtual void resize_mlp(const std::string& plugin, int layer, const std::vector<uint32_t>& keep) {
    (void)layer;
    (void)keep;
    throw ResizeRefused(plugin + ": this run has no model to resize");
  }
  // The same for the block's attention heads (Gpt::resize_heads).
  virtual void resize_heads(const std::string& plugin, int layer,
                            const std::vector<uint32_t>& keep) {
    (void)layer;
    (void)keep;
    throw ResizeRefused(plugin + ": this run has no model to resize");
  }
  // The plugins are created only to be checked or asked for estimates (validate_plugins,
  // `headroom plan`, the advice), often many times and at one rank whatever the run's: their
  // debug and info lines are not the run's and are not printed.
  virtual bool checking_only() const { return false; }
};

// A run with a device and no model — replaying an allocation trace, testing an allocator: vetoes,
// retries and precision choices (amp's) change nothing in it.
class ModelessRun final : public PluginRun {
 public:
  explicit ModelessRun(Device& device) : device_(device) {}
  Device& device() override { return device_; }
  Gpt<float>* built_model() override { return nullptr; }
  void veto_step(const std::string&, const std::string&) override {}
  void request_retry(const std::string&, const std::string&) override {}
  void set_compute_dtype(const std::string&, Dtype) override {}
  void set_precision(const std::string&, const Precision&) override {}
  void set_loss_scale(const std::string&, double) override {}
  RunState state() const override { return RunState{}; }

 private:
  Device& device_;
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
  std::unique_ptr<Device> device_;
  std::unique_ptr<PluginRun> run_;
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
  // is a ConfigError; any other create() failure is a PluginFailure.
  void create(PluginRun& run);

  bool provides_optimizer() const;
  // The name of the plugin with the optimizer role ("" when none has it), for messages.
  std::string optimizer_plugin() const;
  // The HR_EVENT_BIT()s of the events any plugin subscribes to.
  uint64_t subscribed_events() const;
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
  // Hands each plugin its saved state from `snapshot` (the file, for messages; may be empty). A
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
  PluginRun* run_ = nullptr;
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
