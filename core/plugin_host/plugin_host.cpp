// The plugin host: the loaded plugins of a config, created in order (the allocator first), their
// roles put in place, the loop's events dispatched to them, their states saved and loaded; and
// the two ways to reach plugins without a training run (CreatedPlugins, PluginCatalog).
// Loading is loader.cpp's; the services table is services_v1.cpp's, the extensions ext_*.cpp's.
#include "core/plugin_host/plugin_host.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <utility>

#include "core/plugin_host/plugin_internal.h"
#include "headroom/ext/resize.h"
#include "headroom/ext/state.h"

namespace headroom {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Roles

class PluginHost::AllocatorAdapter final : public DeviceAllocator {
  // Marks the plugin as inside one of its allocator hooks, for the rule that alloc and free may
  // not be called from there (they would allocate inside an allocation).
  struct InHook {
    explicit InHook(LoadedPlugin& p) : p_(p) { ++p_.in_allocator_hook; }
    ~InHook() { --p_.in_allocator_hook; }
    LoadedPlugin& p_;
  };

 public:
  explicit AllocatorAdapter(LoadedPlugin& p) : p_(p) {}
  void* allocate(uint64_t bytes, Category category, void* stream) override {
    const InHook in(p_);
    return p_.allocator.allocate(p_.instance, bytes, category_for(p_, category), stream);
  }
  void deallocate(void* ptr, uint64_t bytes, void* stream) override {
    const InHook in(p_);
    p_.allocator.deallocate(p_.instance, ptr, bytes, stream);
  }
  bool stats(AllocatorStats* out) const override {
    // A plugin built before ABI 1.2 has no stats hook: read_sized left it NULL.
    if (!p_.allocator.stats) return false;
    hr_allocator_stats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    if (p_.allocator.stats(p_.instance, &s) != HR_OK) return false;
    out->allocated = s.allocated;
    out->reserved = s.reserved;
    out->largest_free_block = s.largest_free_block;
    out->device_allocs = s.device_allocs;
    out->retries = s.retries;
    out->ooms = s.ooms;
    return true;
  }
  std::string name() const override { return "'" + p_.entry.name + "' (allocator plugin)"; }

 private:
  LoadedPlugin& p_;
};

namespace {

class PluginOptimizer final : public Optimizer {
 public:
  explicit PluginOptimizer(LoadedPlugin& p) : p_(p) {}
  // The plugin keeps its state itself and saves it through save_state.
  std::vector<StateTensor> state(const std::vector<OptSegment>&) override { return {}; }
  bool can_resize() const override { return p_.optimizer.resize != nullptr; }
  void resize(const std::vector<OptSegment>&, const std::vector<ParamResize>& changes) override {
    if (!p_.optimizer.resize)
      throw std::logic_error("plugin '" + p_.entry.name + "' cannot resize its optimizer state");
    for (const ParamResize& r : changes) {
      hr_resize_info info;
      std::memset(&info, 0, sizeof info);
      info.struct_size = sizeof info;
      info.layer = r.layer;
      info.index = r.index;
      info.axis = uint32_t(r.axis);
      info.ndim = int32_t(r.old_shape.size());
      info.num_keep = uint32_t(r.keep.size());
      info.name = r.name.c_str();
      for (size_t d = 0; d < r.old_shape.size() && d < HR_MAX_DIMS; ++d) {
        info.old_shape[d] = r.old_shape[d];
        info.new_shape[d] = r.new_shape[d];
      }
      info.keep = r.keep.data();
      const hr_status s = p_.optimizer.resize(p_.instance, &info);
      if (s != HR_OK)
        throw PluginFailure("plugin '" + p_.entry.name + "' failed to resize its state of '" +
                            r.name + "': " + p_.take_error(s));
    }
  }
  void step(const std::vector<OptSegment>&, double lr, int64_t step) override {
    hr_optimizer_step_info info;
    std::memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    info.step = step;
    info.lr = lr;
    const hr_status s = p_.optimizer.step(p_.instance, &info);
    if (s != HR_OK)
      throw PluginFailure("plugin '" + p_.entry.name + "' failed in its optimizer step (step " +
                          std::to_string(step) + "): " + p_.take_error(s));
  }

 private:
  LoadedPlugin& p_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// PluginHost

PluginHost::PluginHost(const Config& config)
    : device_kind_(config.device.kind), device_index_(config.device.index) {
  std::map<uint32_t, const LoadedPlugin*> role_owner;
  for (const PluginEntry& e : config.plugins) {
    const std::string where = e.pos.str() + ": plugin '" + e.name + "'";
    auto p = load_library(find_plugin_file(e), file_where(e));
    p->entry = e;
    if (e.name != p->desc.name)
      throw ConfigError(file_where(e) + ": '" + p->file + "' is the plugin '" + p->desc.name +
                        "' (its descriptor's name), not '" + e.name + "': set name = \"" +
                        p->desc.name + "\" in this [[plugins]] table, or point path at " + e.name +
                        "'s library");
    for (uint32_t role : {HR_ROLE_ALLOCATOR, HR_ROLE_OPTIMIZER, HR_ROLE_GRADIENT_REDUCTION}) {
      if (!(p->desc.roles & role)) continue;
      auto [it, first] = role_owner.emplace(role, p.get());
      if (!first)
        throw ConfigError(where + ": both '" + it->second->entry.name + "' (" +
                          it->second->entry.pos.str() + ") and '" + e.name + "' provide the " +
                          describe_roles(role) +
                          " role; at most one plugin may — remove one of them");
    }
    try {
      p->table = toml::parse(e.toml);
    } catch (const toml::parse_error& err) {
      throw ConfigError(where + ": cannot read its table back: " + std::string(err.description()));
    }
    plugins_.push_back(std::move(p));
  }
}

PluginHost::~PluginHost() {
  // Every plugin but the allocator, last listed first; then the allocator, which may still hold
  // the memory of everything destroyed before it.
  LoadedPlugin* alloc_plugin = nullptr;
  for (auto it = plugins_.rbegin(); it != plugins_.rend(); ++it) {
    LoadedPlugin& p = **it;
    if (!p.created) continue;
    if (p.desc.roles & HR_ROLE_ALLOCATOR) {
      alloc_plugin = &p;
      continue;
    }
    p.desc.destroy(p.instance);
    p.created = false;
  }
  if (alloc_plugin) {
    if (run_.device && run_.device->tracker().live_total() == 0)
      run_.device->set_allocator(nullptr);
    alloc_plugin->desc.destroy(alloc_plugin->instance);
    alloc_plugin->created = false;
  }
  plugins_.clear();  // unloads the libraries, after every instance is gone
}

void PluginHost::create(const RunInterfaces& run) {
  run_ = with_defaults(run);
  std::vector<LoadedPlugin*> order;
  for (auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_ALLOCATOR) order.push_back(p.get());
  for (auto& p : plugins_)
    if (!(p->desc.roles & HR_ROLE_ALLOCATOR)) order.push_back(p.get());

  for (LoadedPlugin* p : order) {
    p->handle.owner = this;
    p->handle.plugin = p;
    p->services = make_services(*p);
    void* instance = nullptr;
    p->creating = true;
    const hr_status s = p->desc.create(&p->services, &instance);
    p->creating = false;
    if (s == HR_ERROR_CONFIG) throw p->config_error("create");
    if (s != HR_OK)
      throw PluginFailure(p->where() + " failed to start (create): " + p->take_error(s));
    p->instance = instance;
    p->created = true;
    // Every key of its table must have been asked for: anything else is a typo or a key of a
    // different version of the plugin.
    for (auto&& [key, node] : p->table) {
      const std::string k(key.str());
      if (p->asked.count(k)) continue;
      std::string valid;
      for (const std::string& a : p->asked)
        valid += (valid.empty() ? "" : ", ") + a;
      throw ConfigError(
          key_where(*p, k) + ": unknown key '" + k + "' for plugin '" + p->entry.name + "'; " +
          (valid.empty() ? std::string("this plugin reads no keys") : "valid keys: " + valid));
    }
    if (p->desc.roles & HR_ROLE_ALLOCATOR) {
      allocator_ = std::make_unique<AllocatorAdapter>(*p);
      run_.device->set_allocator(allocator_.get());
    }
  }
}

bool PluginHost::allocator_stats(hr_allocator_stats* out) const {
  for (const auto& p : plugins_) {
    if (!(p->desc.roles & HR_ROLE_ALLOCATOR) || !p->created || !p->allocator.stats) continue;
    std::memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
    return p->allocator.stats(p->instance, out) == HR_OK;
  }
  return false;
}

bool PluginHost::provides_gradient_reduction() const {
  for (const auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_GRADIENT_REDUCTION) return true;
  return false;
}

uint64_t PluginHost::subscribed_events() const {
  uint64_t events = 0;
  for (const auto& p : plugins_)
    events |= p->desc.events;
  return events;
}

uint64_t PluginHost::gradient_events() const {
  uint64_t events = 0;
  for (const auto& p : plugins_)
    events |= p->gradient_events;
  return events;
}

bool PluginHost::provides_optimizer() const {
  for (const auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_OPTIMIZER) return true;
  return false;
}

std::string PluginHost::optimizer_plugin() const {
  for (const auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_OPTIMIZER) return p->entry.name;
  return "";
}

std::unique_ptr<Optimizer> PluginHost::make_optimizer() {
  for (auto& p : plugins_)
    if (p->desc.roles & HR_ROLE_OPTIMIZER) return std::make_unique<PluginOptimizer>(*p);
  return nullptr;
}

void PluginHost::on_event(const EventInfo& e) {
  if (!pending_failure_.empty() && e.event != Event::kFree) {
    const std::string m = std::move(pending_failure_);
    pending_failure_.clear();
    throw PluginFailure(m);
  }
  hr_event_info info;
  std::memset(&info, 0, sizeof info);
  info.struct_size = sizeof info;
  info.event = uint32_t(e.event);
  info.step = e.step;
  info.micro_step = e.micro_step;
  info.layer = e.layer;
  info.ptr = e.ptr;
  info.bytes = e.bytes;
  info.category = uint32_t(e.category);
  info.loss = e.loss;
  info.tokens = e.tokens;
  // Which event the plugins are in, for services that only some events may call; an event fired
  // inside another (an ALLOC inside a FORWARD_END hook) restores the outer one when done.
  struct CurrentEvent {
    PluginHost& host;
    int event, layer;
    CurrentEvent(PluginHost& h, int e, int l)
        : host(h), event(h.current_event_), layer(h.current_layer_) {
      host.current_event_ = e;
      host.current_layer_ = l;
    }
    ~CurrentEvent() {
      host.current_event_ = event;
      host.current_layer_ = layer;
    }
  } current(*this, int(e.event), e.layer);
  for (auto& p : plugins_) {
    if (!p->created || !(p->desc.events & HR_EVENT_BIT(info.event))) continue;
    info.category = category_for(*p, e.category);
    const hr_status s = p->desc.on_event(p->instance, &info);
    if (s == HR_OK) continue;
    if (p->run_failure) {  // a service met the run's own failure for it: the run's path for it
      std::exception_ptr failure = std::exchange(p->run_failure, nullptr);
      p->error.clear();
      std::rethrow_exception(failure);
    }
    std::string m = "plugin '" + p->entry.name + "' failed in " + event_name(e.event);
    if (e.layer >= 0) m += " (layer " + std::to_string(e.layer) + ")";
    if (e.step > 0) m += " at step " + std::to_string(e.step);
    m += ": " + p->take_error(s);
    if (e.event == Event::kFree) {
      if (pending_failure_.empty()) pending_failure_ = m;
      continue;
    }
    throw PluginFailure(m);
  }
}

std::map<std::string, std::vector<uint8_t>> PluginHost::save_states() {
  std::map<std::string, std::vector<uint8_t>> out;
  for (auto& p : plugins_) {
    if (!p->created || !p->save_state) continue;
    std::vector<uint8_t> bytes;
    hr_state_writer w;
    std::memset(&w, 0, sizeof w);
    w.struct_size = sizeof w;
    w.context = &bytes;
    w.write = [](void* context, const void* data, uint64_t size) -> hr_status {
      if (size && !data) return HR_ERROR_INVALID;
      auto* v = static_cast<std::vector<uint8_t>*>(context);
      const uint8_t* b = static_cast<const uint8_t*>(data);
      v->insert(v->end(), b, b + size);
      return HR_OK;
    };
    const hr_status s = p->save_state(p->instance, &w);
    if (s != HR_OK)
      throw PluginFailure("plugin '" + p->entry.name +
                          "' failed to save its state: " + p->take_error(s));
    out[p->entry.name] = std::move(bytes);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Checking a config's plugins without a run

// The run validate_plugins creates the plugins against: a device, no model, and the trainer's
// rules for the compute dtype and the loss scale (Trainer::set_compute_dtype, set_loss_scale),
// which a plugin's create() may call.
class CreatedPlugins::Run final : public StepControl,
                                  public PrecisionChoice,
                                  public ShardChoice,
                                  public BatchControl,
                                  public AdapterChoice {
 public:
  Run(Device& device, const TrainConfig& train, const ModelConfig& model)
      : device_(device), train_(train), model_(model) {}
  RunInterfaces interfaces() {
    RunInterfaces r;
    r.device = &device_;
    r.step = this;
    r.precision = this;
    r.shard = this;
    r.batch = this;
    r.place = &place_;
    r.adapters = this;
    r.checking_only = true;
    return r;
  }
  // As the run starts: at the configured micro-batch.
  int configured_micro_batch() const override { return train_.micro_batch; }
  int configured_grad_accum() const override { return train_.grad_accum; }
  int next_micro_batch() const override { return train_.micro_batch; }
  // The steps a checked config would run never start: the rules refuse both outside the OOM
  // hook and the step events, which a check does not fire.
  void restart_step(const std::string& plugin, int, const std::string&) override {
    throw std::logic_error(plugin + ": a config being checked runs no steps");
  }
  void set_micro_batch(const std::string& plugin, int, const std::string&) override {
    throw std::logic_error(plugin + ": a config being checked runs no steps");
  }
  void veto_step(const std::string&, const std::string&) override {}
  void request_retry(const std::string&, const std::string&) override {}
  void set_compute_dtype(const std::string& plugin, Dtype dtype) override {
    if (dtype != Dtype::kF32 && dtype != Dtype::kBF16 && dtype != Dtype::kF16)
      throw std::invalid_argument(plugin + ": compute dtype " + dtype_name(dtype) +
                                  " is not one of f32, bf16, f16");
    if (dtype_ != Dtype::kF32 && dtype_ != dtype)
      throw std::logic_error(plugin + ": the compute dtype is already " + dtype_name(dtype_) +
                             " (set by " + dtype_by_ + "); two plugins cannot both choose it");
    dtype_ = dtype;
    precision_.compute = dtype;
    dtype_by_ = plugin;
  }
  void set_precision(const std::string& plugin, const Precision& p) override {
    Precision q = p;
    q.compute = dtype_;
    const std::string why = precision_problem(q);
    if (!why.empty()) throw std::invalid_argument(plugin + ": " + why);
    precision_ = q;
  }
  void set_loss_scale(const std::string& plugin, double scale) override {
    if (!(scale > 0) || !std::isfinite(scale))
      throw std::invalid_argument(plugin + ": loss scale " + std::to_string(scale) +
                                  " must be finite and > 0");
    loss_scale_ = scale;
  }
  const StepState& step_state() const override { return step_; }
  const Precision& precision() const override { return precision_; }
  double loss_scale() const override { return loss_scale_; }
  // A zero plugin partitions from its create(): the run it would shard is not built here (the
  // estimate of what it shards is its headroom.estimate/1's). Two that both shard are refused as
  // the trainer refuses them; the host checked the bits.
  void set_partition(const std::string& plugin, uint32_t) override {
    if (!shard_by_.empty())
      throw std::logic_error(plugin + ": the model state is sharded already, by " + shard_by_ +
                             "; two plugins cannot both shard it");
    shard_by_ = plugin;
  }
  void set_persist_below(const std::string& plugin, uint64_t) override {
    if (plugin != shard_by_)
      throw std::logic_error(plugin + ": the persistence threshold is set after partitioning");
  }
  Sharding* sharding() override { return nullptr; }
  // The adapters' targets are checked against the config's model, as the trainer checks them.
  void add_lora(const std::string&, const LoraSpec& spec) override { check_lora(model_, spec); }
  void set_base(const std::string&, QuantKind, bool) override {}  // the host parsed the dtype

 private:
  Device& device_;
  TrainConfig train_;
  ModelConfig model_;
  Dtype dtype_ = Dtype::kF32;
  double loss_scale_ = 1.0;
  std::string dtype_by_;
  Precision precision_;
  StepState step_;  // a checked config runs no step
  std::string shard_by_;
  PlaceRecord place_;  // recorded, as the trainer's RunChoices does
};

CreatedPlugins::CreatedPlugins(const Config& config) {
  DeviceConfig cpu;
  cpu.kind = "cpu";
  if (config.device.kind == "cpu") cpu.memory_limit = config.device.memory_limit;
  device_ = Device::create(cpu);
  run_ = std::make_unique<Run>(*device_, config.train, config.model);
  host_ = std::make_unique<PluginHost>(config);
  host_->create(run_->interfaces());
}

CreatedPlugins::~CreatedPlugins() = default;

void validate_plugins(const Config& config) {
  if (config.plugins.empty()) return;
  CreatedPlugins created(config);
}

uint32_t PluginHost::roles() const {
  uint32_t roles = 0;
  for (const auto& p : plugins_)
    roles |= p->desc.roles;
  return roles;
}

std::vector<OfferedExtension> PluginHost::offered(const char* id) const {
  std::vector<OfferedExtension> out;
  for (const auto& p : plugins_) {
    if (!p->created || !p->desc.get_extension) continue;
    if (const void* table = p->desc.get_extension(id))
      out.push_back(OfferedExtension{p->entry.name, table, p->instance, p->desc.roles});
  }
  return out;
}

PluginCatalog::PluginCatalog() {
  std::set<std::string> seen;
  for (const std::string& file : plugin_files_on_search_path()) {
    try {
      auto p = load_library(file, "");
      if (!seen.insert(p->desc.name).second) continue;  // a later copy of one found before
      p->entry.name = p->desc.name;
      plugins_.push_back(std::move(p));
    } catch (const ConfigError&) {
      // Not loadable: `headroom plugins` says why; the catalog has nothing from it.
    }
  }
}

PluginCatalog::~PluginCatalog() = default;

std::vector<std::string> PluginCatalog::names() const {
  std::vector<std::string> out;
  for (const auto& p : plugins_)
    out.push_back(p->entry.name);
  return out;
}

std::vector<OfferedExtension> PluginCatalog::offered(const char* id) const {
  std::vector<OfferedExtension> out;
  for (const auto& p : plugins_) {
    if (!p->desc.get_extension) continue;
    if (const void* table = p->desc.get_extension(id))
      out.push_back(OfferedExtension{p->entry.name, table, nullptr, p->desc.roles});
  }
  return out;
}

void PluginHost::load_states(const std::map<std::string, std::vector<uint8_t>>& states,
                             const std::string& snapshot) {
  const std::string from = snapshot.empty() ? "the snapshot" : "the snapshot " + snapshot;
  // Every state has its plugin in this config before any plugin loads one.
  for (const auto& state : states) {
    // A plain reference, not a structured binding: C++17 lambdas may not capture those (clang
    // refuses; the fuzz build compiles this file with clang).
    const std::string& name = state.first;
    if (std::none_of(plugins_.begin(), plugins_.end(),
                     [&](const auto& q) { return q->entry.name == name; }))
      throw ConfigError("--resume: " + from + " holds the state of plugin '" + name +
                        "', which this config does not load; add it to [[plugins]]");
  }
  // In TOML order, as the events; a plugin without a state in the snapshot is not called.
  for (auto& q : plugins_) {
    const auto it = states.find(q->entry.name);
    if (it == states.end()) continue;
    LoadedPlugin* p = q.get();
    const std::vector<uint8_t>& bytes = it->second;
    if (!p->load_state)
      throw ConfigError(p->where() + ": --resume: " + from + " holds its state, but '" + p->file +
                        "' cannot load state (its descriptor has no load_state, and it offers "
                        "no " HR_EXT_STATE ")");
    const hr_status s = p->load_state(p->instance, bytes.data(), bytes.size());
    if (s == HR_OK) continue;
    const std::string what = "--resume: loading its state (" + std::to_string(bytes.size()) +
                             " bytes) from " + from + " failed, load_state returned " +
                             status_name(s) + ": " +
                             (p->error.empty() ? "it gave no message" : p->error);
    p->error.clear();
    if (s == HR_ERROR_CONFIG) throw ConfigError(p->where() + ": " + what);
    throw PluginFailure(p->where() + ": " + what);
  }
}

}  // namespace headroom
