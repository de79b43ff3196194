// The services table a plugin gets in create(): ABI 1.0 to 1.4's functions, frozen at 1.4 (what
// came after is an extension: ext_*.cpp), each beside its rule (services.h).
#include <cstdio>
#include <stdexcept>

#include "core/config/toml_type_name.h"
#include "core/plugin_host/services.h"

namespace headroom {
namespace services {

// --- log, errors ---

constexpr Rule kLog = {"log", kAnyone, When::kAnyTime, kNotAllowed};
static void log(hr_host* h, int32_t level, const char* message) {
  if (level < HR_LOG_WARN && run(h).checking_only) return;
  static const char* names[] = {"debug", "info", "warning", "error"};
  const char* lv = level >= 0 && level <= 3 ? names[level] : "info";
  std::fprintf(stderr, "[%s] %s: %s\n", plugin(h).entry.name.c_str(), lv, message ? message : "");
}

constexpr Rule kSetError = {"set_error", kAnyone, When::kAnyTime, kNotAllowed};
static void set_error(hr_host* h, const char* message) {
  plugin(h).error = message ? message : "";
}

// --- the plugin's own TOML table ---

// The node for `key`, marking it asked for; nullptr when absent.
static const toml::node* lookup(hr_host* h, const char* key) {
  if (!key) return nullptr;
  LoadedPlugin& p = plugin(h);
  p.asked.insert(key);
  return p.table.get(key);
}

static hr_status wrong_type(hr_host* h, const char* key, const char* want, const toml::node& n) {
  LoadedPlugin& p = plugin(h);
  p.error = key_where(p, key) + ": expected " + want + ", got " + type_name_with_article(n);
  return HR_ERROR_CONFIG;
}

constexpr Rule kConfigInt = {"config_int", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status config_int(hr_host* h, const char* key, int64_t* out) {
  const toml::node* n = lookup(h, key);
  if (!n) return HR_OK;
  if (!n->is_integer()) return wrong_type(h, key, "an integer", *n);
  *out = n->as_integer()->get();
  return HR_OK;
}

constexpr Rule kConfigFloat = {"config_float", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status config_float(hr_host* h, const char* key, double* out) {
  const toml::node* n = lookup(h, key);
  if (!n) return HR_OK;
  if (n->is_integer()) {
    *out = static_cast<double>(n->as_integer()->get());
  } else if (n->is_floating_point()) {
    *out = n->as_floating_point()->get();
  } else {
    return wrong_type(h, key, "a number", *n);
  }
  return HR_OK;
}

constexpr Rule kConfigBool = {"config_bool", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status config_bool(hr_host* h, const char* key, int32_t* out) {
  const toml::node* n = lookup(h, key);
  if (!n) return HR_OK;
  if (!n->is_boolean()) return wrong_type(h, key, "a boolean (true or false)", *n);
  *out = n->as_boolean()->get() ? 1 : 0;
  return HR_OK;
}

constexpr Rule kConfigString = {"config_string", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status config_string(hr_host* h, const char* key, char* out, size_t size) {
  const toml::node* n = lookup(h, key);
  if (!n) return HR_OK;
  if (!n->is_string()) return wrong_type(h, key, "a string", *n);
  const std::string& v = n->as_string()->get();
  if (!out || v.size() + 1 > size) {
    plugin(h).error = key_where(plugin(h), key) + ": the value is " + std::to_string(v.size()) +
                      " bytes, longer than the plugin's buffer";
    return HR_ERROR_INVALID;
  }
  std::memcpy(out, v.c_str(), v.size() + 1);
  return HR_OK;
}

constexpr Rule kConfigSize = {"config_size", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status config_size(hr_host* h, const char* key, uint64_t* out) {
  const toml::node* n = lookup(h, key);
  if (!n) return HR_OK;
  LoadedPlugin& p = plugin(h);
  if (n->is_integer() && n->as_integer()->get() >= 0) {
    *out = static_cast<uint64_t>(n->as_integer()->get());
    return HR_OK;
  }
  if (!n->is_string()) return wrong_type(h, key, "a size (\"256MiB\" or a number of bytes)", *n);
  try {
    *out = parse_size(n->as_string()->get(), key_where(p, key));
  } catch (const ConfigError& e) {
    p.error = e.what();
    return HR_ERROR_CONFIG;
  }
  return HR_OK;
}

constexpr Rule kConfigError = {"config_error", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status config_error(hr_host* h, const char* key, const char* message) {
  LoadedPlugin& p = plugin(h);
  p.error = (key ? key_where(p, key) : p.where()) + ": " + (message ? message : "bad value");
  return HR_ERROR_CONFIG;
}

// --- memory ---

constexpr Rule kAlloc = {"alloc", kAnyone, When::kNotInAllocation, kNotAllowed};
static void* alloc(hr_host* h, uint64_t bytes, uint32_t category, const char* what) {
  LoadedPlugin& p = plugin(h);
  const uint32_t known =
      p.abi >= HR_ABI_MAKE_VERSION(1, 7) ? HR_MEM_CATEGORY_COUNT : HR_MEM_CATEGORY_COUNT_V1;
  if (category >= known) {
    p.error = "alloc: category " + std::to_string(category) + " is not an hr_mem_category" +
              (category < HR_MEM_CATEGORY_COUNT
                   ? " of ABI " + format_abi_version(p.abi) + " (HR_MEM_PLUGIN came with ABI 1.7)"
                   : "");
    return nullptr;
  }
  try {
    void* ptr =
        run(h).device->try_allocate(bytes, category_at(int(category)),
                                    p.entry.name + ": " + (what ? what : "buffer"), p.entry.name);
    if (!ptr) {
      p.error = "alloc: " + format_bytes(bytes) + " do not fit in device memory";
      return nullptr;
    }
    p.allocations.insert(ptr);
    return ptr;
  } catch (const PluginFailure& e) {
    // Another plugin's ALLOC hook failed inside this allocation: the run stops at the next
    // event, with that plugin's message.
    if (HostServices::pending_failure(h).empty()) HostServices::pending_failure(h) = e.what();
    p.error = "alloc: stopped by a failing plugin";
  } catch (const std::exception& e) {
    p.error = e.what();
  }
  return nullptr;
}

constexpr Rule kFree = {"free", kAnyone, When::kNotInAllocation, kNotAllowed};
static void free(hr_host* h, void* ptr) {
  LoadedPlugin& p = plugin(h);
  if (!ptr) return;
  if (!p.allocations.erase(ptr)) {
    log(h, HR_LOG_ERROR, "free: a pointer services->alloc did not return; ignored");
    return;
  }
  run(h).device->free(ptr);
}

constexpr Rule kRawAlloc = {"raw_alloc", kAllocatorRole, When::kAnyTime, kNotAllowed};
void* raw_alloc(hr_host* h, uint64_t bytes) {
  return run(h).device->backend_allocate(bytes);
}

constexpr Rule kRawFree = {"raw_free", kAllocatorRole, When::kAnyTime, kNotAllowed};
void raw_free(hr_host* h, void* ptr) {
  if (ptr) run(h).device->backend_free(ptr);
}

constexpr Rule kMemoryStats = {"memory_stats", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status memory_stats(hr_host* h, hr_memory_stats* out) {
  return place_memory_stats(h, *run(h).device, out);
}

hr_status place_memory_stats(hr_host* h, const Device& d, hr_memory_stats* out) {
  if (!out) return HR_ERROR_INVALID;
  const MemoryTracker& t = d.tracker();
  hr_memory_stats s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.limit = d.memory_limit();
  s.live_bytes = t.live_total();
  s.peak_bytes = t.peak_total();
  for (int i = 0; i < HR_MEM_CATEGORY_COUNT_V1; ++i) {
    s.live_by_category[i] = t.live_by_category()[i];
    s.peak_by_category[i] = t.peak_by_category()[i];
  }
  s.num_allocs = t.num_allocs();
  s.live_plugin = t.live(Category::kPlugin);
  s.peak_plugin = t.peak(Category::kPlugin);
  // A plugin of an older version knows no plugin category: the optimizer's holds it, as it did.
  if (plugin(h).abi < HR_ABI_MAKE_VERSION(1, 7)) {
    s.live_by_category[HR_MEM_OPTIMIZER] += s.live_plugin;
    s.peak_by_category[HR_MEM_OPTIMIZER] += s.peak_plugin;
  }
  write_sized(out, s);
  return HR_OK;
}

// --- the model ---

constexpr Rule kNumLayers = {"num_layers", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t num_layers(hr_host* h) {
  Gpt<float>* m = run(h).model->built_model();
  return m ? int32_t(m->layers().size()) : 0;
}

constexpr Rule kLayerName = {"layer_name", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status layer_name(hr_host* h, int32_t index, char* out, size_t size) {
  Layer<float>* l = layer(h, index);
  if (!l) return HR_ERROR_INVALID;
  if (!out || l->name().size() + 1 > size) return HR_ERROR_INVALID;
  std::memcpy(out, l->name().c_str(), l->name().size() + 1);
  return HR_OK;
}

constexpr Rule kLayerNumParams = {"layer_num_params", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t layer_num_params(hr_host* h, int32_t index) {
  Layer<float>* l = layer(h, index);
  return l ? int32_t(l->params().size()) : 0;
}

constexpr Rule kLayerParam = {"layer_param", kAnyone, When::kAnyTime, kNotAllowed};
hr_status layer_param(hr_host* h, int32_t index, int32_t i, hr_tensor* out) {
  Layer<float>* l = layer(h, index);
  if (!l || !out) return HR_ERROR_INVALID;
  if (i < 0 || i >= int32_t(l->params().size())) {
    plugin(h).error = "layer " + std::to_string(index) + " has no parameter " + std::to_string(i);
    return HR_ERROR_INVALID;
  }
  const Param<float>& p = *l->params()[i];
  // What the optimizer updates: the f32 masters, or without them the bf16 weights; and the
  // step's gradient, f32 or (accumulated in the compute dtype) bf16.
  hr_tensor t = f32_view(p.name, p.shape, p.numel, p.optimized().value);
  t.dtype = uint32_t(p.optimized().dtype);
  t.grad = p.optimized().grad;
  t.grad_dtype = uint32_t(p.optimized().grad_dtype);
  t.weight_decay = p.decay ? 1 : 0;
  t.frozen = p.frozen ? 1 : 0;
  // A plugin built before grad_dtype existed reads the gradient as the tensor's dtype.
  if (!HR_HAS_FIELD(out, hr_tensor, grad_dtype) && t.grad_dtype != t.dtype) t.grad = nullptr;
  write_sized(out, t);
  return HR_OK;
}

constexpr Rule kLayerNumActivations = {"layer_num_activations", kAnyone, When::kAnyTime,
                                       kAnswersValue};
static int32_t layer_num_activations(hr_host* h, int32_t index) {
  Layer<float>* l = layer(h, index);
  return l ? int32_t(l->saved().size()) : 0;
}

constexpr Rule kLayerActivation = {"layer_activation", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status layer_activation(hr_host* h, int32_t index, int32_t i, hr_tensor* out) {
  Layer<float>* l = layer(h, index);
  if (!l || !out) return HR_ERROR_INVALID;
  if (i < 0 || i >= int32_t(l->saved().size())) {
    plugin(h).error =
        "layer " + std::to_string(index) + " holds no activation " + std::to_string(i) + " now";
    return HR_ERROR_INVALID;
  }
  // The chunked head computes its per-token losses in backward: a reader before gets them
  // computed now (Layer::fill_saved), never the buffer's old bytes.
  hr_status filled = guarded(h, [&] {
    if (!l->fill_saved(size_t(i), !in_allocation(h)))
      throw std::runtime_error(l->saved()[i].what +
                               " is computed on its first read, which allocates: read it from "
                               "an event other than ALLOC, FREE or OOM, or the allocator hooks");
  });
  if (filled != HR_OK) return filled;
  const SavedActivation& a = l->saved()[i];
  hr_tensor t = f32_view(a.what, {int64_t(a.numel)}, a.numel, a.buffer.as<void>());
  t.dtype = static_cast<uint32_t>(a.dtype);  // the compute dtype, or the statistics'
  write_sized(out, t);
  return HR_OK;
}

// --- device ops ---

constexpr Rule kOpFill = {"op_fill", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_fill(hr_host* h, void* x, uint32_t dtype, uint64_t n, double value) {
  return guarded(h, [&] { run(h).device->backend().fill(Dtype(dtype), x, n, value); });
}

constexpr Rule kOpCopy = {"op_copy", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_copy(hr_host* h, void* dst, const void* src, uint64_t bytes) {
  return guarded(h, [&] { run(h).device->backend().copy(dst, src, bytes); });
}

constexpr Rule kOpCast = {"op_cast", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_cast(hr_host* h, void* dst, uint32_t dd, const void* src, uint32_t sd,
                         uint64_t n) {
  return guarded(h, [&] { run(h).device->backend().cast(dst, Dtype(dd), src, Dtype(sd), n); });
}

constexpr Rule kOpScale = {"op_scale", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_scale(hr_host* h, void* x, uint32_t dtype, uint64_t n, double s) {
  return guarded(h, [&] { run(h).device->backend().scale(Dtype(dtype), x, n, s); });
}

constexpr Rule kOpAxpy = {"op_axpy", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_axpy(hr_host* h, void* y, const void* x, uint32_t dtype, uint64_t n, double a) {
  return guarded(h, [&] { run(h).device->backend().axpy(Dtype(dtype), y, x, n, a); });
}

constexpr Rule kOpSumSquares = {"op_sum_squares", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_sum_squares(hr_host* h, const void* x, uint32_t dtype, uint64_t n,
                                double* out) {
  if (!out) return HR_ERROR_INVALID;
  return guarded(h, [&] { *out = run(h).device->backend().sum_squares(Dtype(dtype), x, n); });
}

constexpr Rule kOpNonfinite = {"op_nonfinite", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status op_nonfinite(hr_host* h, const void* x, uint32_t dtype, uint64_t n, int32_t* out) {
  if (!out) return HR_ERROR_INVALID;
  return guarded(
      h, [&] { *out = run(h).device->backend().any_nonfinite(Dtype(dtype), x, n) ? 1 : 0; });
}

// --- device, ranks, step control ---

constexpr Rule kDeviceKind = {"device_kind", kAnyone, When::kAnyTime, kNotAllowed};
static const char* device_kind(hr_host* h) {
  return HostServices::device_kind(h).c_str();
}

constexpr Rule kDeviceIndex = {"device_index", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t device_index(hr_host* h) {
  return HostServices::device_index(h);
}

constexpr Rule kStream = {"stream", kAnyone, When::kAnyTime, kNotAllowed};
static void* stream(hr_host* h) {
  return run(h).device->backend().native_stream();
}

constexpr Rule kRank = {"rank", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t rank(hr_host* h) {
  return comm(h).rank();
}

constexpr Rule kWorldSize = {"world_size", kAnyone, When::kAnyTime, kAnswersValue};
static int32_t world_size(hr_host* h) {
  return comm(h).world_size();
}

constexpr Rule kVetoStep = {"veto_step", kAnyone, When::kAnyTime, kNotAllowed};
static void veto_step(hr_host* h, const char* reason) {
  run(h).step->veto_step(plugin(h).entry.name, reason ? reason : "");
}

constexpr Rule kRequestRetry = {"request_retry", kAnyone, When::kAnyTime, kNotAllowed};
static void request_retry(hr_host* h, const char* reason) {
  run(h).step->request_retry(plugin(h).entry.name, reason ? reason : "");
}

// --- virtual memory (the allocator role; headroom.vm/1 offers them again) ---

static bool vm_aligned(hr_host* h, const void* addr, uint64_t bytes) {
  const uint64_t g = run(h).device->vm_granularity();
  if (bytes % g == 0 && reinterpret_cast<uintptr_t>(addr) % g == 0) return true;
  plugin(h).error =
      "vm: address and size must be multiples of vm_granularity() = " + std::to_string(g);
  return false;
}

constexpr Rule kVmGranularity = {"vm_granularity", kAllocatorRole, When::kAnyTime, kNotAllowed};
uint64_t vm_granularity(hr_host* h) {
  return run(h).device->vm_granularity();
}

constexpr Rule kVmReserve = {"vm_reserve", kAllocatorRole, When::kAnyTime, kNotAllowed};
void* vm_reserve(hr_host* h, uint64_t bytes) {
  if (!vm_aligned(h, nullptr, bytes)) return nullptr;
  return run(h).device->vm_reserve(bytes);
}

constexpr Rule kVmMap = {"vm_map", kAllocatorRole, When::kAnyTime, kNotAllowed};
hr_status vm_map(hr_host* h, void* addr, uint64_t bytes) {
  if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
  return run(h).device->vm_map(addr, bytes) ? HR_OK : HR_ERROR_OUT_OF_MEMORY;
}

constexpr Rule kVmUnmap = {"vm_unmap", kAllocatorRole, When::kAnyTime, kNotAllowed};
hr_status vm_unmap(hr_host* h, void* addr, uint64_t bytes) {
  if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
  run(h).device->vm_unmap(addr, bytes);
  return HR_OK;
}

constexpr Rule kVmRelease = {"vm_release", kAllocatorRole, When::kAnyTime, kNotAllowed};
hr_status vm_release(hr_host* h, void* addr, uint64_t bytes) {
  if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
  run(h).device->vm_release(addr, bytes);
  return HR_OK;
}

// --- precision (ABI 1.4; headroom.precision/1 offers them again) ---

constexpr Rule kSetComputeDtype = {"set_compute_dtype", kAnyone, When::kCreate, HR_ERROR_INVALID};
hr_status set_compute_dtype(hr_host* h, uint32_t dtype) {
  LoadedPlugin& p = plugin(h);
  try {
    if (dtype > HR_DTYPE_I32) throw std::invalid_argument("unknown dtype " + std::to_string(dtype));
    run(h).precision->set_compute_dtype(p.entry.name, Dtype(dtype));
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string("set_compute_dtype: ") + e.what();
    return HR_ERROR_INVALID;
  }
}

constexpr Rule kSetLossScale = {"set_loss_scale", kAnyone, When::kAnyTime, kNotAllowed};
hr_status set_loss_scale(hr_host* h, double scale) {
  LoadedPlugin& p = plugin(h);
  try {
    run(h).precision->set_loss_scale(p.entry.name, scale);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string("set_loss_scale: ") + e.what();
    return HR_ERROR_INVALID;
  }
}

// --- activation recomputation (ABI 1.3; headroom.recompute/1 offers it again) ---

constexpr Rule kDropActivations = {"drop_activations", kAnyone, When::kForwardEndOfLayer,
                                   HR_ERROR_INVALID};
hr_status drop_activations(hr_host* h, int32_t index, uint32_t what) {
  LoadedPlugin& p = plugin(h);
  if (what != HR_DROP_ALL && what != HR_DROP_CHEAP) {
    p.error = "drop_activations(" + std::to_string(index) + ", " + std::to_string(what) +
              "): what must be HR_DROP_ALL (0) or HR_DROP_CHEAP (1)";
    return HR_ERROR_INVALID;
  }
  Gpt<float>* m = run(h).model->built_model();
  if (!m) {
    p.error = "drop_activations: the model is not built yet";
    return HR_ERROR_INVALID;
  }
  try {
    m->drop_activations(index, what == HR_DROP_CHEAP ? Drop::kCheap : Drop::kAll);
    return HR_OK;
  } catch (const std::exception& e) {
    p.error = std::string("drop_activations: ") + e.what();
    return HR_ERROR_INVALID;
  }
}

}  // namespace services

// ---------------------------------------------------------------------------------------------

hr_host_services make_services(LoadedPlugin& p) {
  using namespace services;
  hr_host_services s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.abi_version = p.abi;
  s.host = &p.handle;
  s.log = checked<kLog, log>;
  s.set_error = checked<kSetError, set_error>;
  s.config_int = checked<kConfigInt, config_int>;
  s.config_float = checked<kConfigFloat, config_float>;
  s.config_bool = checked<kConfigBool, config_bool>;
  s.config_string = checked<kConfigString, config_string>;
  s.config_size = checked<kConfigSize, config_size>;
  s.config_error = checked<kConfigError, config_error>;
  s.alloc = checked<kAlloc, alloc>;
  s.free = checked<kFree, free>;
  s.raw_alloc = checked<kRawAlloc, raw_alloc>;
  s.raw_free = checked<kRawFree, raw_free>;
  s.memory_stats = checked<kMemoryStats, memory_stats>;
  s.num_layers = checked<kNumLayers, num_layers>;
  s.layer_name = checked<kLayerName, layer_name>;
  s.layer_num_params = checked<kLayerNumParams, layer_num_params>;
  s.layer_param = checked<kLayerParam, layer_param>;
  s.layer_num_activations = checked<kLayerNumActivations, layer_num_activations>;
  s.layer_activation = checked<kLayerActivation, layer_activation>;
  s.op_fill = checked<kOpFill, op_fill>;
  s.op_copy = checked<kOpCopy, op_copy>;
  s.op_cast = checked<kOpCast, op_cast>;
  s.op_scale = checked<kOpScale, op_scale>;
  s.op_axpy = checked<kOpAxpy, op_axpy>;
  s.op_sum_squares = checked<kOpSumSquares, op_sum_squares>;
  s.op_nonfinite = checked<kOpNonfinite, op_nonfinite>;
  s.device_kind = checked<kDeviceKind, device_kind>;
  s.device_index = checked<kDeviceIndex, device_index>;
  s.stream = checked<kStream, stream>;
  s.rank = checked<kRank, rank>;
  s.world_size = checked<kWorldSize, world_size>;
  s.veto_step = checked<kVetoStep, veto_step>;
  s.request_retry = checked<kRequestRetry, request_retry>;
  s.vm_granularity = checked<kVmGranularity, vm_granularity>;
  s.vm_reserve = checked<kVmReserve, vm_reserve>;
  s.vm_map = checked<kVmMap, vm_map>;
  s.vm_unmap = checked<kVmUnmap, vm_unmap>;
  s.vm_release = checked<kVmRelease, vm_release>;
  s.drop_activations = checked<kDropActivations, drop_activations>;
  s.set_compute_dtype = checked<kSetComputeDtype, set_compute_dtype>;
  s.set_loss_scale = checked<kSetLossScale, set_loss_scale>;
  s.get_extension = get_extension;
  return s;
}

}  // namespace headroom
