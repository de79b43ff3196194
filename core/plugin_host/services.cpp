// The services table a plugin gets in create() (ABI 1.0 to 1.4), the host's extension tables
// (ABI 1.5: headroom.vm/1, precision/1, recompute/1, tensors/1, step/1, comm/1, shard/1, batch/1),
// and the one rules table that says which plugin may call which of their functions, and from which
// events.
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>
#include <type_traits>

#include "core/comm/comm.h"
#include "core/config/toml_type_name.h"
#include "core/device/backend.h"
#include "core/plugin_host/plugin_internal.h"
#include "headroom/ext/batch.h"
#include "headroom/ext/comm.h"
#include "headroom/ext/precision.h"
#include "headroom/ext/recompute.h"
#include "headroom/ext/resize.h"
#include "headroom/ext/shard.h"
#include "headroom/ext/step.h"
#include "headroom/ext/tensors.h"
#include "headroom/ext/vm.h"

// headroom.comm/1's request: a collective in flight, the host's until the plugin waits for it.
struct hr_comm_request {
  headroom::CommRequest request;
};

namespace headroom {

// ---------------------------------------------------------------------------------------------
// The services table. Every function is a C entry point: nothing may throw through it.

struct HostServices {
  static LoadedPlugin& plugin(hr_host* h) { return *h->plugin; }
  static const RunInterfaces& run(hr_host* h) { return h->owner->run_; }
  // The event being dispatched (-1: none) and its layer.
  static int current_event(hr_host* h) { return h->owner->current_event_; }
  static int current_layer(hr_host* h) { return h->owner->current_layer_; }

  static void log(hr_host* h, int32_t level, const char* message) {
    if (level < HR_LOG_WARN && run(h).checking_only) return;
    static const char* names[] = {"debug", "info", "warning", "error"};
    const char* lv = level >= 0 && level <= 3 ? names[level] : "info";
    std::fprintf(stderr, "[%s] %s: %s\n", plugin(h).entry.name.c_str(), lv, message ? message : "");
  }
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
  static hr_status config_int(hr_host* h, const char* key, int64_t* out) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    if (!n->is_integer()) return wrong_type(h, key, "an integer", *n);
    *out = n->as_integer()->get();
    return HR_OK;
  }
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
  static hr_status config_bool(hr_host* h, const char* key, int32_t* out) {
    const toml::node* n = lookup(h, key);
    if (!n) return HR_OK;
    if (!n->is_boolean()) return wrong_type(h, key, "a boolean (true or false)", *n);
    *out = n->as_boolean()->get() ? 1 : 0;
    return HR_OK;
  }
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
  static hr_status config_error(hr_host* h, const char* key, const char* message) {
    LoadedPlugin& p = plugin(h);
    p.error = (key ? key_where(p, key) : p.where()) + ": " + (message ? message : "bad value");
    return HR_ERROR_CONFIG;
  }

  // --- memory ---
  static void* alloc(hr_host* h, uint64_t bytes, uint32_t category, const char* what) {
    LoadedPlugin& p = plugin(h);
    if (category >= uint32_t(kNumCategories)) {
      p.error = "alloc: category " + std::to_string(category) + " is not an hr_mem_category";
      return nullptr;
    }
    try {
      void* ptr = run(h).device->try_allocate(bytes, category_at(int(category)),
                                              p.entry.name + ": " + (what ? what : "buffer"));
      if (!ptr) {
        p.error = "alloc: " + format_bytes(bytes) + " do not fit in device memory";
        return nullptr;
      }
      p.allocations.insert(ptr);
      return ptr;
    } catch (const PluginFailure& e) {
      // Another plugin's ALLOC hook failed inside this allocation: the run stops at the next
      // event, with that plugin's message.
      if (h->owner->pending_failure_.empty()) h->owner->pending_failure_ = e.what();
      p.error = "alloc: stopped by a failing plugin";
    } catch (const std::exception& e) {
      p.error = e.what();
    }
    return nullptr;
  }
  static void free(hr_host* h, void* ptr) {
    LoadedPlugin& p = plugin(h);
    if (!ptr) return;
    if (!p.allocations.erase(ptr)) {
      log(h, HR_LOG_ERROR, "free: a pointer services->alloc did not return; ignored");
      return;
    }
    run(h).device->free(ptr);
  }
  static void* raw_alloc(hr_host* h, uint64_t bytes) {
    return run(h).device->backend_allocate(bytes);
  }
  static void raw_free(hr_host* h, void* ptr) {
    if (ptr) run(h).device->backend_free(ptr);
  }
  static hr_status memory_stats(hr_host* h, hr_memory_stats* out) {
    if (!out) return HR_ERROR_INVALID;
    const Device& d = *run(h).device;
    const MemoryTracker& t = d.tracker();
    hr_memory_stats s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.limit = d.memory_limit();
    s.live_bytes = t.live_total();
    s.peak_bytes = t.peak_total();
    for (int i = 0; i < kNumCategories; ++i) {
      s.live_by_category[i] = t.live_by_category()[i];
      s.peak_by_category[i] = t.peak_by_category()[i];
    }
    s.num_allocs = t.num_allocs();
    write_sized(out, s);
    return HR_OK;
  }

  // --- the model ---
  static Layer<float>* layer(hr_host* h, int32_t index) {
    Gpt<float>* m = run(h).model->built_model();
    if (!m || index < 0 || index >= int32_t(m->layers().size())) {
      plugin(h).error = "layer " + std::to_string(index) + " does not exist" +
                        (m ? " (the model has " + std::to_string(m->layers().size()) + ")"
                           : " (the model is not built yet)");
      return nullptr;
    }
    return m->layers()[index].get();
  }
  static int32_t num_layers(hr_host* h) {
    Gpt<float>* m = run(h).model->built_model();
    return m ? int32_t(m->layers().size()) : 0;
  }
  static hr_status layer_name(hr_host* h, int32_t index, char* out, size_t size) {
    Layer<float>* l = layer(h, index);
    if (!l) return HR_ERROR_INVALID;
    if (!out || l->name().size() + 1 > size) return HR_ERROR_INVALID;
    std::memcpy(out, l->name().c_str(), l->name().size() + 1);
    return HR_OK;
  }
  static int32_t layer_num_params(hr_host* h, int32_t index) {
    Layer<float>* l = layer(h, index);
    return l ? int32_t(l->params().size()) : 0;
  }
  // An f32 tensor view as the ABI describes it; the name and shape outlive the call.
  static hr_tensor f32_view(const std::string& name, const std::vector<int64_t>& shape,
                            uint64_t numel, void* data) {
    hr_tensor t;
    std::memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    t.dtype = HR_DTYPE_F32;
    t.name = name.c_str();
    t.ndim = int32_t(std::min<size_t>(shape.size(), HR_MAX_DIMS));
    for (int32_t d = 0; d < t.ndim; ++d)
      t.shape[d] = shape[d];
    t.numel = numel;
    t.data = data;
    return t;
  }
  static hr_status layer_param(hr_host* h, int32_t index, int32_t i, hr_tensor* out) {
    Layer<float>* l = layer(h, index);
    if (!l || !out) return HR_ERROR_INVALID;
    if (i < 0 || i >= int32_t(l->params().size())) {
      plugin(h).error = "layer " + std::to_string(index) + " has no parameter " + std::to_string(i);
      return HR_ERROR_INVALID;
    }
    const Param<float>& p = *l->params()[i];
    // What the optimizer updates: the f32 masters, or without them the bf16 weights; and the
    // step's gradient, f32 or (accumulated in the compute dtype) bf16.
    hr_tensor t = f32_view(p.name, p.shape, p.numel, p.weights());
    t.dtype = uint32_t(p.weights_dtype());
    t.grad = p.step_grad();
    t.grad_dtype = uint32_t(p.step_grad_dtype());
    t.weight_decay = p.decay ? 1 : 0;
    // A plugin built before grad_dtype existed reads the gradient as the tensor's dtype.
    if (!HR_HAS_FIELD(out, hr_tensor, grad_dtype) && t.grad_dtype != t.dtype) t.grad = nullptr;
    write_sized(out, t);
    return HR_OK;
  }
  static int32_t layer_num_activations(hr_host* h, int32_t index) {
    Layer<float>* l = layer(h, index);
    return l ? int32_t(l->saved().size()) : 0;
  }
  static hr_status layer_activation(hr_host* h, int32_t index, int32_t i, hr_tensor* out) {
    Layer<float>* l = layer(h, index);
    if (!l || !out) return HR_ERROR_INVALID;
    if (i < 0 || i >= int32_t(l->saved().size())) {
      plugin(h).error =
          "layer " + std::to_string(index) + " holds no activation " + std::to_string(i) + " now";
      return HR_ERROR_INVALID;
    }
    const SavedActivation& a = l->saved()[i];
    hr_tensor t = f32_view(a.what, {int64_t(a.numel)}, a.numel, a.buffer.as<void>());
    t.dtype = static_cast<uint32_t>(a.dtype);  // the compute dtype, or the statistics'
    write_sized(out, t);
    return HR_OK;
  }

  // --- device ops ---
  template <class F>
  static hr_status guarded(hr_host* h, F&& f) {
    try {
      f();
      return HR_OK;
    } catch (const OpError& e) {
      plugin(h).error = e.what();
      return HR_ERROR_UNSUPPORTED;
    } catch (const std::exception& e) {
      plugin(h).error = e.what();
      return HR_ERROR;
    }
  }
  static hr_status op_fill(hr_host* h, void* x, uint32_t dtype, uint64_t n, double value) {
    return guarded(h, [&] { run(h).device->backend().fill(Dtype(dtype), x, n, value); });
  }
  static hr_status op_copy(hr_host* h, void* dst, const void* src, uint64_t bytes) {
    return guarded(h, [&] { run(h).device->backend().copy(dst, src, bytes); });
  }
  static hr_status op_cast(hr_host* h, void* dst, uint32_t dd, const void* src, uint32_t sd,
                           uint64_t n) {
    return guarded(h, [&] { run(h).device->backend().cast(dst, Dtype(dd), src, Dtype(sd), n); });
  }
  static hr_status op_scale(hr_host* h, void* x, uint32_t dtype, uint64_t n, double s) {
    return guarded(h, [&] { run(h).device->backend().scale(Dtype(dtype), x, n, s); });
  }
  static hr_status op_axpy(hr_host* h, void* y, const void* x, uint32_t dtype, uint64_t n,
                           double a) {
    return guarded(h, [&] { run(h).device->backend().axpy(Dtype(dtype), y, x, n, a); });
  }
  static hr_status op_sum_squares(hr_host* h, const void* x, uint32_t dtype, uint64_t n,
                                  double* out) {
    if (!out) return HR_ERROR_INVALID;
    return guarded(h, [&] { *out = run(h).device->backend().sum_squares(Dtype(dtype), x, n); });
  }
  static hr_status op_nonfinite(hr_host* h, const void* x, uint32_t dtype, uint64_t n,
                                int32_t* out) {
    if (!out) return HR_ERROR_INVALID;
    return guarded(
        h, [&] { *out = run(h).device->backend().any_nonfinite(Dtype(dtype), x, n) ? 1 : 0; });
  }

  // --- device, ranks, step control ---
  static const char* device_kind(hr_host* h) { return h->owner->device_kind_.c_str(); }
  static int32_t device_index(hr_host* h) { return h->owner->device_index_; }
  static void* stream(hr_host* h) { return run(h).device->backend().native_stream(); }
  static int32_t rank(hr_host* h) { return comm(h).rank(); }
  static int32_t world_size(hr_host* h) { return comm(h).world_size(); }
  static void veto_step(hr_host* h, const char* reason) {
    run(h).step->veto_step(plugin(h).entry.name, reason ? reason : "");
  }
  static void request_retry(hr_host* h, const char* reason) {
    run(h).step->request_retry(plugin(h).entry.name, reason ? reason : "");
  }

  // --- virtual memory (allocator role) ---
  static uint64_t vm_granularity(hr_host* h) { return run(h).device->vm_granularity(); }
  static bool vm_aligned(hr_host* h, const void* addr, uint64_t bytes) {
    const uint64_t g = run(h).device->vm_granularity();
    if (bytes % g == 0 && reinterpret_cast<uintptr_t>(addr) % g == 0) return true;
    plugin(h).error =
        "vm: address and size must be multiples of vm_granularity() = " + std::to_string(g);
    return false;
  }
  static void* vm_reserve(hr_host* h, uint64_t bytes) {
    if (!vm_aligned(h, nullptr, bytes)) return nullptr;
    return run(h).device->vm_reserve(bytes);
  }
  static hr_status vm_map(hr_host* h, void* addr, uint64_t bytes) {
    if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
    return run(h).device->vm_map(addr, bytes) ? HR_OK : HR_ERROR_OUT_OF_MEMORY;
  }
  static hr_status vm_unmap(hr_host* h, void* addr, uint64_t bytes) {
    if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
    run(h).device->vm_unmap(addr, bytes);
    return HR_OK;
  }
  static hr_status vm_release(hr_host* h, void* addr, uint64_t bytes) {
    if (!addr || !vm_aligned(h, addr, bytes)) return HR_ERROR_INVALID;
    run(h).device->vm_release(addr, bytes);
    return HR_OK;
  }

  // --- precision (ABI 1.4) ---
  static hr_status set_compute_dtype(hr_host* h, uint32_t dtype) {
    LoadedPlugin& p = plugin(h);
    try {
      if (dtype > HR_DTYPE_I32)
        throw std::invalid_argument("unknown dtype " + std::to_string(dtype));
      run(h).precision->set_compute_dtype(p.entry.name, Dtype(dtype));
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string("set_compute_dtype: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }
  static hr_status set_loss_scale(hr_host* h, double scale) {
    LoadedPlugin& p = plugin(h);
    try {
      run(h).precision->set_loss_scale(p.entry.name, scale);
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string("set_loss_scale: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }

  // --- activation recomputation (ABI 1.3) ---
  static hr_status drop_activations(hr_host* h, int32_t index, uint32_t what) {
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

  // --- headroom.precision/1's getters ---
  static uint32_t compute_dtype(hr_host* h) {
    return uint32_t(run(h).step->state().precision.compute);
  }
  static double loss_scale(hr_host* h) { return run(h).step->state().loss_scale; }
  // The state layout: each setter changes one field of the run's Precision.
  template <class F>
  static hr_status set_precision(hr_host* h, const char* fn, F&& change) {
    LoadedPlugin& p = plugin(h);
    try {
      Precision q = run(h).step->state().precision;
      change(q);
      run(h).precision->set_precision(p.entry.name, q);
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string(fn) + ": " + e.what();
      return HR_ERROR_INVALID;
    }
  }
  static hr_status set_grad_dtype(hr_host* h, uint32_t dtype) {
    return set_precision(h, "set_grad_dtype", [&](Precision& q) {
      if (dtype != HR_DTYPE_F32 && dtype != uint32_t(q.compute))
        throw std::invalid_argument("gradients accumulate in f32 or in the compute dtype (" +
                                    std::string(dtype_name(q.compute)) + "), not dtype " +
                                    std::to_string(dtype));
      q.grad_in_compute = dtype != HR_DTYPE_F32;
    });
  }
  static hr_status set_master_weights(hr_host* h, int32_t keep) {
    return set_precision(h, "set_master_weights", [&](Precision& q) { q.masters = keep != 0; });
  }
  static hr_status set_state_dtype(hr_host* h, uint32_t dtype) {
    return set_precision(h, "set_state_dtype", [&](Precision& q) {
      if (dtype != HR_DTYPE_F32 && dtype != HR_DTYPE_BF16)
        throw std::invalid_argument("the optimizer state is f32 or bf16, not dtype " +
                                    std::to_string(dtype));
      q.state = Dtype(dtype);
    });
  }
  static uint32_t grad_dtype(hr_host* h) {
    const Precision q = run(h).step->state().precision;
    return q.grad_in_compute ? uint32_t(q.compute) : uint32_t(HR_DTYPE_F32);
  }
  static int32_t master_weights(hr_host* h) {
    return run(h).step->state().precision.masters ? 1 : 0;
  }
  static uint32_t state_dtype(hr_host* h) { return uint32_t(run(h).step->state().precision.state); }
  static hr_status nonfinite_many(hr_host* h, uint64_t count, const void* const* data,
                                  const uint32_t* dtypes, const uint64_t* numels, int32_t* out) {
    if (!out || (count > 0 && (!data || !dtypes || !numels))) return HR_ERROR_INVALID;
    return guarded(h, [&] {
      std::vector<Backend::Span> spans(count);
      for (uint64_t i = 0; i < count; ++i)
        spans[i] = {Dtype(dtypes[i]), data[i], numels[i]};
      *out = run(h).device->backend().any_nonfinite_many(spans) ? 1 : 0;
    });
  }

  // --- headroom.recompute/1 ---
  static uint64_t layer_activation_bytes(hr_host* h, int32_t index) {
    Layer<float>* l = layer(h, index);
    if (!l) return 0;
    uint64_t bytes = 0;
    for (const SavedActivation& a : l->saved())
      if (a.buffer) bytes += a.buffer.bytes();
    return bytes;
  }

  // --- headroom.tensors/1 ---
  static hr_status find_param(hr_host* h, const char* name, hr_tensor* out, int32_t* layer_out,
                              int32_t* index_out) {
    LoadedPlugin& p = plugin(h);
    if (!name || !out) {
      p.error = "find_param: name and out must not be NULL";
      return HR_ERROR_INVALID;
    }
    Gpt<float>* m = run(h).model->built_model();
    if (!m) {
      p.error = std::string("find_param(\"") + name + "\"): the model is not built yet";
      return HR_ERROR_INVALID;
    }
    for (size_t l = 0; l < m->layers().size(); ++l) {
      const auto& params = m->layers()[l]->params();
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i]->name != name) continue;
        if (layer_out) *layer_out = int32_t(l);
        if (index_out) *index_out = int32_t(i);
        return layer_param(h, int32_t(l), int32_t(i), out);
      }
    }
    p.error = std::string("find_param: the model has no parameter \"") + name +
              "\" (Hugging Face GPT-2 names: \"wte.weight\", \"h.0.attn.c_attn.weight\", ...)";
    return HR_ERROR_INVALID;
  }
  static hr_status read(hr_host* h, void* dst, const void* src, uint64_t bytes) {
    LoadedPlugin& p = plugin(h);
    if (bytes > HR_READ_MAX_BYTES) {
      p.error = "read: " + std::to_string(bytes) + " bytes is more than HR_READ_MAX_BYTES (" +
                std::to_string(HR_READ_MAX_BYTES) + "): read() is for scalars and small buffers";
      return HR_ERROR_INVALID;
    }
    if (bytes == 0) return HR_OK;
    if (!dst || !src) {
      p.error = "read: dst and src must not be NULL";
      return HR_ERROR_INVALID;
    }
    return guarded(h, [&] { run(h).device->backend().download(dst, src, bytes); });
  }
  static hr_status write(hr_host* h, void* dst, const void* src, uint64_t bytes) {
    if (bytes == 0) return HR_OK;
    if (!dst || !src) {
      plugin(h).error = "write: dst and src must not be NULL";
      return HR_ERROR_INVALID;
    }
    return guarded(h, [&] {
      Backend& ops = run(h).device->backend();
      ops.upload(dst, src, bytes);
      ops.synchronize();  // done when it returns: `src` is the plugin's to reuse
    });
  }
  // One element of `dtype` at `b`, widened to double.
  static double element(uint32_t dtype, const unsigned char* b) {
    switch (dtype) {
      case HR_DTYPE_F32: {
        float f;
        std::memcpy(&f, b, 4);
        return f;
      }
      case HR_DTYPE_F64: {
        double d;
        std::memcpy(&d, b, 8);
        return d;
      }
      case HR_DTYPE_I32: {
        int32_t i;
        std::memcpy(&i, b, 4);
        return i;
      }
      case HR_DTYPE_BF16: {
        uint16_t u;
        std::memcpy(&u, b, 2);
        const uint32_t bits = uint32_t(u) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
      }
      default: {  // HR_DTYPE_F16
        uint16_t u;
        std::memcpy(&u, b, 2);
        const int exp = (u >> 10) & 0x1F, mant = u & 0x3FF;
        const double sign = (u & 0x8000) ? -1.0 : 1.0;
        if (exp == 0) return sign * std::ldexp(double(mant), -24);
        if (exp == 31)
          return mant ? std::numeric_limits<double>::quiet_NaN()
                      : sign * std::numeric_limits<double>::infinity();
        return sign * std::ldexp(double(mant | 0x400), exp - 25);
      }
    }
  }
  static hr_status reduce(hr_host* h, const void* x, uint32_t dtype, uint64_t n, uint32_t op,
                          double* out) {
    LoadedPlugin& p = plugin(h);
    if (!out) {
      p.error = "reduce: out must not be NULL";
      return HR_ERROR_INVALID;
    }
    if (op > HR_REDUCE_SUM_SQUARES) {
      p.error = "reduce: op " + std::to_string(op) +
                " is not HR_REDUCE_SUM, _MAX, _MAX_ABS or _SUM_SQUARES";
      return HR_ERROR_INVALID;
    }
    if (dtype > HR_DTYPE_I32) {
      p.error = "reduce: dtype " + std::to_string(dtype) + " is not an hr_dtype";
      return HR_ERROR_INVALID;
    }
    const bool sums = op == HR_REDUCE_SUM || op == HR_REDUCE_SUM_SQUARES;
    if (n == 0) {
      *out = sums ? 0.0 : -std::numeric_limits<double>::infinity();
      return HR_OK;
    }
    if (!x) {
      p.error = "reduce: x must not be NULL";
      return HR_ERROR_INVALID;
    }
    // The sum of squares of a float tensor is the backend's own reduction, on the device; the
    // rest reads the elements back a bounded chunk at a time and reduces on the host.
    if (op == HR_REDUCE_SUM_SQUARES &&
        (dtype == HR_DTYPE_F32 || dtype == HR_DTYPE_BF16 || dtype == HR_DTYPE_F16))
      return guarded(h, [&] { *out = run(h).device->backend().sum_squares(Dtype(dtype), x, n); });
    const uint64_t size = dtype_size(Dtype(dtype));
    return guarded(h, [&] {
      constexpr uint64_t kChunkBytes = uint64_t(1) << 20;
      std::vector<unsigned char> chunk(kChunkBytes);
      const uint64_t per_chunk = kChunkBytes / size;
      double acc = sums ? 0.0 : -std::numeric_limits<double>::infinity();
      bool nan = false;
      Backend& ops = run(h).device->backend();
      for (uint64_t at = 0; at < n; at += per_chunk) {
        const uint64_t k = std::min(per_chunk, n - at);
        ops.download(chunk.data(), static_cast<const unsigned char*>(x) + at * size, k * size);
        for (uint64_t i = 0; i < k; ++i) {
          const double v = element(dtype, chunk.data() + i * size);
          switch (op) {
            case HR_REDUCE_SUM:
              acc += v;
              break;
            case HR_REDUCE_SUM_SQUARES:
              acc += v * v;
              break;
            case HR_REDUCE_MAX:
              nan |= std::isnan(v);
              acc = std::max(acc, v);
              break;
            default:
              nan |= std::isnan(v);
              acc = std::max(acc, std::fabs(v));
              break;
          }
        }
      }
      *out = nan ? std::numeric_limits<double>::quiet_NaN() : acc;
    });
  }

  // --- headroom.step/1 ---
  static hr_status step_state(hr_host* h, hr_step_state* out) {
    if (!out) {
      plugin(h).error = "state: out must not be NULL";
      return HR_ERROR_INVALID;
    }
    const RunState r = run(h).step->state();
    hr_step_state s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.step = r.step;
    s.micro_step = r.micro_step;
    s.lr = r.lr;
    s.loss_scale = r.loss_scale;
    s.loss = r.loss;
    s.tokens = r.tokens;
    s.grad_norm = r.grad_norm;
    s.clip_coef = r.clip_coef;
    s.skipped = r.skipped ? 1 : 0;
    s.micro_steps = r.micro_steps;
    write_sized(out, s, offsetof(hr_step_state, struct_size) + sizeof(uint32_t));
    return HR_OK;
  }

  // --- headroom.batch/1 ---
  static hr_status batch_state(hr_host* h, hr_batch_state* out) {
    if (!out) {
      plugin(h).error = HR_EXT_BATCH " state: out must not be NULL";
      return HR_ERROR_INVALID;
    }
    const BatchState b = run(h).batch->batch_state();
    hr_batch_state s;
    std::memset(&s, 0, sizeof s);
    s.struct_size = sizeof s;
    s.configured_micro_batch = b.configured_micro_batch;
    s.configured_grad_accum = b.configured_grad_accum;
    s.micro_batch = b.micro_batch;
    s.grad_accum = b.grad_accum;
    s.restarts = b.restarts;
    s.memory_limit = b.memory_limit;
    s.attempt_start_bytes = b.attempt_start_bytes;
    s.attempt_peak_bytes = b.attempt_peak_bytes;
    write_sized(out, s, offsetof(hr_batch_state, struct_size) + sizeof(uint32_t));
    return HR_OK;
  }
  // A micro-batch the trainer refuses is HR_ERROR_INVALID, a run that cannot change it
  // HR_ERROR_NOT_ALLOWED; both with the trainer's words.
  template <class F>
  static hr_status batch_call(hr_host* h, const char* fn, F&& f) {
    LoadedPlugin& p = plugin(h);
    try {
      f(p.entry.name);
      return HR_OK;
    } catch (const std::invalid_argument& e) {
      p.error = std::string(HR_EXT_BATCH " ") + fn + ": " + e.what();
      return HR_ERROR_INVALID;
    } catch (const std::exception& e) {
      p.error = std::string(HR_EXT_BATCH " ") + fn + ": " + e.what();
      return HR_ERROR_NOT_ALLOWED;
    }
  }
  static hr_status batch_restart_step(hr_host* h, int32_t micro_batch, const char* reason) {
    return batch_call(h, "restart_step", [&](const std::string& name) {
      run(h).batch->restart_step(name, micro_batch, reason ? reason : "");
    });
  }
  static hr_status batch_set_micro_batch(hr_host* h, int32_t micro_batch, const char* reason) {
    return batch_call(h, "set_micro_batch", [&](const std::string& name) {
      run(h).batch->set_micro_batch(name, micro_batch, reason ? reason : "");
    });
  }

  // --- headroom.comm/1 ---
  // The run's communicator, or a local one (rank 0 of 1) when the run has none: a check or an
  // estimate runs on one rank by itself, also under mpirun (an MPI one would be collective).
  static Communicator& comm(hr_host* h) {
    if (Communicator* c = run(h).comm->plugin_communicator()) return *c;
    PluginHost& host = *h->owner;
    if (!host.self_comm_) host.self_comm_ = make_local_communicator(*run(h).device);
    return *host.self_comm_;
  }
  // A collective posted by `post` (a CommRequest) into *out; its errors as statuses: a bad
  // argument is HR_ERROR_INVALID, a failed communicator HR_ERROR, each with its message.
  template <class F>
  static hr_status post_collective(hr_host* h, hr_comm_request** out, F&& post) {
    if (!out) {
      plugin(h).error = "headroom.comm/1: out must not be NULL";
      return HR_ERROR_INVALID;
    }
    *out = nullptr;
    try {
      *out = new hr_comm_request{post(comm(h))};
      return HR_OK;
    } catch (const std::invalid_argument& e) {
      plugin(h).error = e.what();
      return HR_ERROR_INVALID;
    } catch (const std::exception& e) {
      plugin(h).error = e.what();
      return HR_ERROR;
    }
  }
  static ReduceOp reduce_op(uint32_t op) {
    if (op == HR_COMM_SUM) return ReduceOp::kSum;
    if (op == HR_COMM_AVERAGE) return ReduceOp::kAverage;
    throw std::invalid_argument("headroom.comm/1: op " + std::to_string(op) +
                                " is not HR_COMM_SUM or HR_COMM_AVERAGE");
  }
  static int32_t comm_rank(hr_host* h) { return comm(h).rank(); }
  static int32_t comm_local_rank(hr_host* h) { return comm(h).ranks().local_rank; }
  static int32_t comm_world_size(hr_host* h) { return comm(h).world_size(); }
  static hr_status comm_all_reduce(hr_host* h, void* buf, uint64_t n, uint32_t dtype, uint32_t op,
                                   hr_comm_request** out) {
    return post_collective(
        h, out, [&](Communicator& c) { return c.all_reduce(buf, n, Dtype(dtype), reduce_op(op)); });
  }
  static hr_status comm_reduce_scatter(hr_host* h, const void* send, void* recv, uint64_t n,
                                       uint32_t dtype, uint32_t op, hr_comm_request** out) {
    return post_collective(h, out, [&](Communicator& c) {
      return c.reduce_scatter(send, recv, n, Dtype(dtype), reduce_op(op));
    });
  }
  static hr_status comm_all_gather(hr_host* h, const void* send, void* recv, uint64_t n,
                                   uint32_t dtype, hr_comm_request** out) {
    return post_collective(
        h, out, [&](Communicator& c) { return c.all_gather(send, recv, n, Dtype(dtype)); });
  }
  static hr_status comm_broadcast(hr_host* h, void* buf, uint64_t n, uint32_t dtype, int32_t root,
                                  hr_comm_request** out) {
    return post_collective(
        h, out, [&](Communicator& c) { return c.broadcast(buf, n, Dtype(dtype), root); });
  }
  static hr_status comm_barrier(hr_host* h, hr_comm_request** out) {
    return post_collective(h, out, [&](Communicator& c) { return c.barrier(); });
  }
  static hr_status comm_wait(hr_host* h, hr_comm_request* request) {
    if (!request) return HR_OK;
    std::unique_ptr<hr_comm_request> owned(request);
    try {
      owned->request.wait();
      return HR_OK;
    } catch (const std::exception& e) {
      plugin(h).error = e.what();
      return HR_ERROR;
    }
  }
  static void* comm_stream(hr_host* h) { return comm(h).stream(); }

  // --- headroom.shard/1 ---
  static hr_status shard_partition(hr_host* h, uint32_t what) {
    LoadedPlugin& p = plugin(h);
    try {
      if (!is_zero_stage(what))
        throw std::invalid_argument("what = " + std::to_string(what) +
                                    " is no ZeRO stage (valid: HR_SHARD_OPTIMIZER; with "
                                    "HR_SHARD_GRADIENTS; with both and HR_SHARD_PARAMETERS)");
      if (!(p.desc.roles & HR_ROLE_GRADIENT_REDUCTION))
        throw std::invalid_argument("plugin '" + p.entry.name +
                                    "' must take the gradient-reduction role to shard");
      if (h->owner->provides_optimizer())
        throw std::invalid_argument(
            "an optimizer-role plugin keeps its own state, which cannot be partitioned; use the "
            "built-in train.optimizer with a zero plugin");
      run(h).shard->set_partition(p.entry.name, what);
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string(HR_EXT_SHARD " partition: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }
  static hr_status shard_layout(hr_host* h, int32_t layer, hr_shard_layout* out) {
    LoadedPlugin& p = plugin(h);
    Gpt<float>* m = run(h).model->built_model();
    if (!out || !m || layer < 0 || layer >= int32_t(m->layers().size())) {
      p.error = std::string(HR_EXT_SHARD " layout: ") +
                (!out ? "out must not be NULL"
                 : !m ? "the model is not built yet"
                      : "layer " + std::to_string(layer) + " does not exist");
      return HR_ERROR_INVALID;
    }
    const FlatStorage& f = m->layers()[size_t(layer)]->flat();
    Sharding* sh = run(h).shard->sharding();
    hr_shard_layout l;
    std::memset(&l, 0, sizeof l);
    l.struct_size = sizeof l;
    l.what = sh ? sh->what() : 0;
    l.rank = comm(h).rank();
    l.world_size = comm(h).world_size();
    l.numel = f.numel;
    l.padded = f.padded;
    l.shard = sh ? sh->shard_numel(layer) : f.padded;
    l.begin = sh ? sh->shard_begin(layer) : 0;
    l.whole = sh ? (sh->whole(layer) ? 1 : 0) : 1;
    l.tied = m->tied_layer(layer);
    write_sized(out, l, offsetof(hr_shard_layout, struct_size) + sizeof(uint32_t));
    return HR_OK;
  }
  // The mechanism's calls: its errors as HR_ERROR with their message.
  template <class F>
  static hr_status sharded(hr_host* h, const char* fn, F&& f) {
    LoadedPlugin& p = plugin(h);
    Sharding* sh = run(h).shard->sharding();
    if (!sh) {
      p.error = std::string(HR_EXT_SHARD " ") + fn + ": nothing is sharded (partition first)";
      return HR_ERROR;
    }
    try {
      f(*sh);
      return HR_OK;
    } catch (const OutOfMemory& e) {
      p.run_failure = std::current_exception();
      p.error = std::string(HR_EXT_SHARD " ") + fn + ": " + e.what();
      return HR_ERROR_OUT_OF_MEMORY;
    } catch (const PeerFailed& e) {
      p.run_failure = std::current_exception();
      p.error = std::string(HR_EXT_SHARD " ") + fn + ": " + e.what();
      return HR_ERROR;
    } catch (const std::exception& e) {
      p.error = std::string(HR_EXT_SHARD " ") + fn + ": " + e.what();
      return HR_ERROR;
    }
  }
  static hr_status shard_reduce_gradients(hr_host* h, int32_t layer) {
    return sharded(h, "reduce_gradients", [&](Sharding& s) { s.reduce_gradients(layer); });
  }
  static hr_status shard_gather_parameters(hr_host* h, int32_t layer) {
    return sharded(h, "gather_parameters", [&](Sharding& s) { s.gather_parameters(layer); });
  }
  static hr_status shard_persist_below(hr_host* h, uint64_t elements) {
    LoadedPlugin& p = plugin(h);
    try {
      run(h).shard->set_persist_below(p.entry.name, elements);
      return HR_OK;
    } catch (const std::exception& e) {
      p.error = std::string(HR_EXT_SHARD " persist_below: ") + e.what();
      return HR_ERROR_INVALID;
    }
  }
  static hr_status shard_release_parameters(hr_host* h, int32_t layer) {
    Sharding* sh = run(h).shard->sharding();
    if (sh && (layer < 0 || layer >= int32_t(run(h).model->built_model()->layers().size()) ||
               sh->whole(layer))) {
      plugin(h).error = std::string(HR_EXT_SHARD " release_parameters: layer ") +
                        std::to_string(layer) +
                        (layer < 0 || layer >= int32_t(run(h).model->built_model()->layers().size())
                             ? " does not exist"
                             : " keeps its parameters whole (nothing sharded to release)");
      return HR_ERROR_INVALID;
    }
    return sharded(h, "release_parameters", [&](Sharding& s) { s.release_parameters(layer); });
  }
  static hr_status shard_wait(hr_host* h) {
    return sharded(h, "wait", [&](Sharding& s) { s.wait(); });
  }
  static hr_status shard_gradient_range(hr_host* h, int32_t layer, hr_tensor* out) {
    LoadedPlugin& p = plugin(h);
    Sharding* sh = run(h).shard->sharding();
    if (!out || !sh || layer < 0 ||
        layer >= int32_t(run(h).model->built_model()->layers().size())) {
      p.error = std::string(HR_EXT_SHARD " gradient_range: ") +
                (!out  ? "out must not be NULL"
                 : !sh ? "nothing is sharded"
                       : "layer " + std::to_string(layer) + " does not exist");
      return HR_ERROR_INVALID;
    }
    const uint64_t n = sh->shard_numel(layer);
    // Named as its layer (a name that outlives the call).
    hr_tensor t = f32_view(run(h).model->built_model()->layers()[size_t(layer)]->name(),
                           {int64_t(n)}, n, sh->gradient_range(layer));
    t.data = t.grad = sh->gradient_range(layer);
    write_sized(out, t);
    return HR_OK;
  }

  // --- headroom.resize/1 ---
  static int32_t mlp_width(hr_host* h, int32_t layer) {
    Gpt<float>* m = run(h).model->built_model();
    if (!m || layer < 1 || layer > m->config().n_layer) return -1;
    return m->config().mlp_width(layer - 1);
  }
  // keep_mlp_units and keep_attn_heads: `resize` shrinks the block; its failures become the
  // status the header names, with the message.
  template <class Resize>
  static hr_status keep_some(hr_host* h, const char* fn, const char* what, const uint32_t* keep,
                             uint32_t count, Resize&& resize) {
    LoadedPlugin& p = plugin(h);
    const std::string prefix = std::string(HR_EXT_RESIZE " ") + fn + ": ";
    if (!keep || count == 0) {
      p.error = prefix + "keep must name at least one " + what;
      return HR_ERROR_INVALID;
    }
    try {
      resize(p.entry.name, std::vector<uint32_t>(keep, keep + count));
      return HR_OK;
    } catch (const std::invalid_argument& e) {
      p.error = prefix + e.what();
      return HR_ERROR_INVALID;
    } catch (const ResizeRefused& e) {
      p.error = prefix + e.what();
      return HR_ERROR_UNSUPPORTED;
    } catch (const OutOfMemory& e) {
      p.run_failure = std::current_exception();
      p.error = prefix + e.what();
      return HR_ERROR_OUT_OF_MEMORY;
    } catch (const std::exception& e) {
      p.error = prefix + e.what();
      return HR_ERROR;
    }
  }
  static hr_status keep_mlp_units(hr_host* h, int32_t layer, const uint32_t* keep, uint32_t count) {
    return keep_some(h, "keep_mlp_units", "unit", keep, count,
                     [&](const std::string& plugin, const std::vector<uint32_t>& k) {
                       run(h).resize->resize_mlp(plugin, layer, k);
                     });
  }

  static int32_t attn_heads(hr_host* h, int32_t layer) {
    Gpt<float>* m = run(h).model->built_model();
    if (!m || layer < 1 || layer > m->config().n_layer) return -1;
    return m->config().heads(layer - 1);
  }
  static hr_status keep_attn_heads(hr_host* h, int32_t layer, const uint32_t* keep,
                                   uint32_t count) {
    return keep_some(h, "keep_attn_heads", "head", keep, count,
                     [&](const std::string& plugin, const std::vector<uint32_t>& k) {
                       run(h).resize->resize_heads(plugin, layer, k);
                     });
  }

  static const void* get_extension(hr_host* h, const char* id);
};

// ---------------------------------------------------------------------------------------------
// The rules: who may call what. One row per function of the services table and of the host's
// extensions; every call goes through checked<>, which holds the caller against its row before
// the function runs. The header comment of each function (headroom/plugin.h, headroom/ext/*.h)
// says the same in words.

namespace {

enum class When {
  kAnyTime,
  kCreate,             // from the plugin's create() only
  kForwardEndOfLayer,  // from FORWARD_END of the layer the call names (its first argument)
  kNotInAllocation,    // not from an ALLOC, FREE or OOM hook or an allocator hook (they run
                       // inside an allocation)
  kOom,                // from the OOM hook only
  kStepBoundary,       // from TRAIN_BEGIN, STEP_BEGIN or STEP_END only
  kBetweenSteps,       // from STEP_END or TRAIN_BEGIN only (no activations, the update done)
};

struct Rule {
  const char* function;  // as a plugin reaches it: "vm_map", "headroom.vm/1 map"
  uint32_t roles;        // the HR_ROLE_* the caller must provide; 0: any plugin
  When when;
  // What a refused call returns when the function returns an hr_status: HR_ERROR_NOT_ALLOWED,
  // or the HR_ERROR_INVALID that ABI 1.3 / 1.4 documented for drop_activations and
  // set_compute_dtype called from the wrong event. A pointer or a size is NULL / 0.
  hr_status refused;
};

enum Fn : int {
  // the 1.4 table
  kLog,
  kSetError,
  kConfigInt,
  kConfigFloat,
  kConfigBool,
  kConfigString,
  kConfigSize,
  kConfigError,
  kAlloc,
  kFree,
  kRawAlloc,
  kRawFree,
  kMemoryStats,
  kNumLayers,
  kLayerName,
  kLayerNumParams,
  kLayerParam,
  kLayerNumActivations,
  kLayerActivation,
  kOpFill,
  kOpCopy,
  kOpCast,
  kOpScale,
  kOpAxpy,
  kOpSumSquares,
  kOpNonfinite,
  kDeviceKind,
  kDeviceIndex,
  kStream,
  kRank,
  kWorldSize,
  kVetoStep,
  kRequestRetry,
  kVmGranularity,
  kVmReserve,
  kVmMap,
  kVmUnmap,
  kVmRelease,
  kDropActivations,
  kSetComputeDtype,
  kSetLossScale,
  // headroom.vm/1
  kExtRawAlloc,
  kExtRawFree,
  kExtGranularity,
  kExtReserve,
  kExtMap,
  kExtUnmap,
  kExtRelease,
  // headroom.precision/1
  kExtSetComputeDtype,
  kExtSetLossScale,
  kExtComputeDtype,
  kExtLossScale,
  kExtSetGradDtype,
  kExtSetMasterWeights,
  kExtSetStateDtype,
  kExtGradDtype,
  kExtMasterWeights,
  kExtStateDtype,
  kExtNonfiniteMany,
  // headroom.recompute/1
  kExtDropActivations,
  kExtLayerActivationBytes,
  // headroom.tensors/1
  kExtFindParam,
  kExtRead,
  kExtReduce,
  kExtWrite,
  // headroom.step/1
  kExtStepState,
  // headroom.comm/1
  kExtCommRank,
  kExtCommLocalRank,
  kExtCommWorldSize,
  kExtCommAllReduce,
  kExtCommReduceScatter,
  kExtCommAllGather,
  kExtCommBroadcast,
  kExtCommBarrier,
  kExtCommWait,
  kExtCommStream,
  // headroom.shard/1
  kExtShardPartition,
  kExtShardLayout,
  kExtShardReduceGradients,
  kExtShardGatherParameters,
  kExtShardWait,
  kExtShardGradientRange,
  kExtShardPersistBelow,
  kExtShardReleaseParameters,
  // headroom.batch/1
  kExtBatchState,
  kExtBatchRestartStep,
  kExtBatchSetMicroBatch,
  // headroom.resize/1
  kExtResizeMlpWidth,
  kExtResizeKeepMlpUnits,
  kExtResizeAttnHeads,
  kExtResizeKeepAttnHeads,
  kNumFns
};

constexpr uint32_t kAnyone = 0;
constexpr uint32_t kAllocatorRole = HR_ROLE_ALLOCATOR;
constexpr hr_status kNotAllowed = HR_ERROR_NOT_ALLOWED;

// In Fn's order (checked below).
constexpr Rule kRules[kNumFns] = {
    {"log", kAnyone, When::kAnyTime, kNotAllowed},
    {"set_error", kAnyone, When::kAnyTime, kNotAllowed},
    {"config_int", kAnyone, When::kAnyTime, kNotAllowed},
    {"config_float", kAnyone, When::kAnyTime, kNotAllowed},
    {"config_bool", kAnyone, When::kAnyTime, kNotAllowed},
    {"config_string", kAnyone, When::kAnyTime, kNotAllowed},
    {"config_size", kAnyone, When::kAnyTime, kNotAllowed},
    {"config_error", kAnyone, When::kAnyTime, kNotAllowed},
    {"alloc", kAnyone, When::kNotInAllocation, kNotAllowed},
    {"free", kAnyone, When::kNotInAllocation, kNotAllowed},
    {"raw_alloc", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"raw_free", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"memory_stats", kAnyone, When::kAnyTime, kNotAllowed},
    {"num_layers", kAnyone, When::kAnyTime, kNotAllowed},
    {"layer_name", kAnyone, When::kAnyTime, kNotAllowed},
    {"layer_num_params", kAnyone, When::kAnyTime, kNotAllowed},
    {"layer_param", kAnyone, When::kAnyTime, kNotAllowed},
    {"layer_num_activations", kAnyone, When::kAnyTime, kNotAllowed},
    {"layer_activation", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_fill", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_copy", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_cast", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_scale", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_axpy", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_sum_squares", kAnyone, When::kAnyTime, kNotAllowed},
    {"op_nonfinite", kAnyone, When::kAnyTime, kNotAllowed},
    {"device_kind", kAnyone, When::kAnyTime, kNotAllowed},
    {"device_index", kAnyone, When::kAnyTime, kNotAllowed},
    {"stream", kAnyone, When::kAnyTime, kNotAllowed},
    {"rank", kAnyone, When::kAnyTime, kNotAllowed},
    {"world_size", kAnyone, When::kAnyTime, kNotAllowed},
    {"veto_step", kAnyone, When::kAnyTime, kNotAllowed},
    {"request_retry", kAnyone, When::kAnyTime, kNotAllowed},
    {"vm_granularity", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"vm_reserve", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"vm_map", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"vm_unmap", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"vm_release", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {"drop_activations", kAnyone, When::kForwardEndOfLayer, HR_ERROR_INVALID},
    {"set_compute_dtype", kAnyone, When::kCreate, HR_ERROR_INVALID},
    {"set_loss_scale", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " raw_alloc", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " raw_free", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " granularity", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " reserve", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " map", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " unmap", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_VM " release", kAllocatorRole, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " set_compute_dtype", kAnyone, When::kCreate, kNotAllowed},
    {HR_EXT_PRECISION " set_loss_scale", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " compute_dtype", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " loss_scale", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " set_grad_dtype", kAnyone, When::kCreate, kNotAllowed},
    {HR_EXT_PRECISION " set_master_weights", kAnyone, When::kCreate, kNotAllowed},
    {HR_EXT_PRECISION " set_state_dtype", kAnyone, When::kCreate, kNotAllowed},
    {HR_EXT_PRECISION " grad_dtype", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " master_weights", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " state_dtype", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_PRECISION " nonfinite_many", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_RECOMPUTE " drop_activations", kAnyone, When::kForwardEndOfLayer, kNotAllowed},
    {HR_EXT_RECOMPUTE " layer_activation_bytes", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_TENSORS " find_param", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_TENSORS " read", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_TENSORS " reduce", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_TENSORS " write", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_STEP " state", kAnyone, When::kAnyTime, kNotAllowed},
    // Collectives wait for other ranks: never from inside an allocation (an allocator hook or an
    // ALLOC / FREE / OOM hook), where the training thread is in the middle of another operation.
    {HR_EXT_COMM " rank", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_COMM " local_rank", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_COMM " world_size", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_COMM " all_reduce", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_COMM " reduce_scatter", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_COMM " all_gather", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_COMM " broadcast", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_COMM " barrier", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_COMM " wait", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_COMM " stream", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_SHARD " partition", kAnyone, When::kCreate, kNotAllowed},
    {HR_EXT_SHARD " layout", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_SHARD " reduce_gradients", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_SHARD " gather_parameters", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_SHARD " wait", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_SHARD " gradient_range", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_SHARD " persist_below", kAnyone, When::kCreate, kNotAllowed},
    {HR_EXT_SHARD " release_parameters", kAnyone, When::kNotInAllocation, kNotAllowed},
    {HR_EXT_BATCH " state", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_BATCH " restart_step", kAnyone, When::kOom, kNotAllowed},
    {HR_EXT_BATCH " set_micro_batch", kAnyone, When::kStepBoundary, kNotAllowed},
    {HR_EXT_RESIZE " mlp_width", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_RESIZE " keep_mlp_units", kAnyone, When::kBetweenSteps, kNotAllowed},
    {HR_EXT_RESIZE " attn_heads", kAnyone, When::kAnyTime, kNotAllowed},
    {HR_EXT_RESIZE " keep_attn_heads", kAnyone, When::kBetweenSteps, kNotAllowed},
};

std::string roles_words(uint32_t roles) {
  return describe_roles(roles) + " role";
}

// "only from FORWARD_END of that layer", for the messages.
std::string rule_words(const Rule& r) {
  std::string s;
  if (r.roles) s = "the " + roles_words(r.roles) + " only";
  std::string when;
  switch (r.when) {
    case When::kAnyTime:
      break;
    case When::kCreate:
      when = "from create() only";
      break;
    case When::kForwardEndOfLayer:
      when = "from FORWARD_END of the layer it names only";
      break;
    case When::kNotInAllocation:
      when = "not from ALLOC, FREE or OOM hooks or the allocator role's hooks";
      break;
    case When::kOom:
      when = "from the OOM hook only";
      break;
    case When::kStepBoundary:
      when = "from TRAIN_BEGIN, STEP_BEGIN or STEP_END only";
      break;
    case When::kBetweenSteps:
      when = "from STEP_END or TRAIN_BEGIN only";
      break;
  }
  if (!when.empty()) s += (s.empty() ? "" : ", ") + when;
  return s.empty() ? "any plugin, any time" : s;
}

// The layer a call names: the first argument when it is one.
inline int32_t layer_argument() {
  return -1;
}
template <class First, class... Rest>
int32_t layer_argument(First first, Rest...) {
  if constexpr (std::is_same_v<First, int32_t>) {
    return first;
  } else {
    (void)first;
    return -1;
  }
}

// Whether `h`'s plugin may make this call now; if not, its error message says why, naming the
// function, the rule and the plugin.
bool allowed(hr_host* h, const Rule& rule, int32_t layer) {
  LoadedPlugin& p = *h->plugin;
  const int ev = HostServices::current_event(h), ev_layer = HostServices::current_layer(h);
  std::string why;
  if ((p.desc.roles & rule.roles) != rule.roles) {
    why = "plugin '" + p.entry.name + "' does not provide the " + roles_words(rule.roles) +
          " (its descriptor's roles: " + describe_roles(p.desc.roles) + ")";
  } else {
    const std::string from =
        p.creating ? std::string("create()")
        : ev >= 0  ? std::string(event_name(Event(ev))) +
                        (ev_layer >= 0 ? " of layer " + std::to_string(ev_layer) : std::string())
                  : std::string("outside any event");
    switch (rule.when) {
      case When::kAnyTime:
        break;
      case When::kCreate:
        if (!p.creating) why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kForwardEndOfLayer:
        if (p.creating || ev != int(Event::kForwardEnd) || ev_layer != layer)
          why = "plugin '" + p.entry.name + "' called it for layer " + std::to_string(layer) +
                " from " + from;
        break;
      case When::kNotInAllocation:
        if (p.in_allocator_hook > 0)
          why = "plugin '" + p.entry.name + "' called it from its allocator hooks";
        else if (!p.creating &&
                 (ev == int(Event::kAlloc) || ev == int(Event::kFree) || ev == int(Event::kOom)))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kOom:
        if (p.creating || ev != int(Event::kOom))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kStepBoundary:
        if (p.creating || (ev != int(Event::kTrainBegin) && ev != int(Event::kStepBegin) &&
                           ev != int(Event::kStepEnd)))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
      case When::kBetweenSteps:
        if (p.creating || (ev != int(Event::kStepEnd) && ev != int(Event::kTrainBegin)))
          why = "plugin '" + p.entry.name + "' called it from " + from;
        break;
    }
  }
  if (why.empty()) return true;
  p.error = std::string(rule.function) + ": not allowed: " + rule_words(rule) + "; " + why;
  return false;
}

// A service function behind its rule: the call runs only when allowed() says so.
template <Fn F, auto Impl>
struct checked;
template <Fn F, class R, class... A, R (*Impl)(hr_host*, A...)>
struct checked<F, Impl> {
  static R call(hr_host* h, A... a) {
    if (!h || !h->plugin) {
      if constexpr (std::is_void_v<R>) {
        return;
      } else {
        return R{};
      }
    }
    if (!allowed(h, kRules[F], layer_argument(a...))) {
      if constexpr (std::is_void_v<R>) {
        return;
      } else if constexpr (std::is_same_v<R, hr_status>) {
        return kRules[F].refused;
      } else {
        return R{};
      }
    }
    return Impl(h, a...);
  }
};

// The hr_status functions among the 1.4 table's int32_t ones: a refused num_layers, device_index,
// rank or world_size would otherwise answer a status. None of them has a rule that can refuse.
static_assert(kRules[kNumLayers].roles == 0 && kRules[kNumLayers].when == When::kAnyTime);
static_assert(kRules[kLayerNumParams].roles == 0 && kRules[kLayerNumParams].when == When::kAnyTime);
static_assert(kRules[kLayerNumActivations].roles == 0 &&
              kRules[kLayerNumActivations].when == When::kAnyTime);
static_assert(kRules[kDeviceIndex].roles == 0 && kRules[kDeviceIndex].when == When::kAnyTime);
static_assert(kRules[kRank].roles == 0 && kRules[kWorldSize].roles == 0);

#define HR_CHECKED(fn, impl) checked<fn, &HostServices::impl>::call

const hr_ext_vm kVm = {sizeof(hr_ext_vm),
                       0,
                       HR_CHECKED(kExtRawAlloc, raw_alloc),
                       HR_CHECKED(kExtRawFree, raw_free),
                       HR_CHECKED(kExtGranularity, vm_granularity),
                       HR_CHECKED(kExtReserve, vm_reserve),
                       HR_CHECKED(kExtMap, vm_map),
                       HR_CHECKED(kExtUnmap, vm_unmap),
                       HR_CHECKED(kExtRelease, vm_release)};

const hr_ext_precision kPrecision = {sizeof(hr_ext_precision),
                                     0,
                                     HR_CHECKED(kExtSetComputeDtype, set_compute_dtype),
                                     HR_CHECKED(kExtSetLossScale, set_loss_scale),
                                     HR_CHECKED(kExtComputeDtype, compute_dtype),
                                     HR_CHECKED(kExtLossScale, loss_scale),
                                     HR_CHECKED(kExtSetGradDtype, set_grad_dtype),
                                     HR_CHECKED(kExtSetMasterWeights, set_master_weights),
                                     HR_CHECKED(kExtSetStateDtype, set_state_dtype),
                                     HR_CHECKED(kExtGradDtype, grad_dtype),
                                     HR_CHECKED(kExtMasterWeights, master_weights),
                                     HR_CHECKED(kExtStateDtype, state_dtype),
                                     HR_CHECKED(kExtNonfiniteMany, nonfinite_many)};

const hr_ext_recompute kRecompute = {sizeof(hr_ext_recompute), 0,
                                     HR_CHECKED(kExtDropActivations, drop_activations),
                                     HR_CHECKED(kExtLayerActivationBytes, layer_activation_bytes)};

const hr_ext_tensors kTensors = {sizeof(hr_ext_tensors),
                                 0,
                                 HR_CHECKED(kExtFindParam, find_param),
                                 HR_CHECKED(kExtRead, read),
                                 HR_CHECKED(kExtReduce, reduce),
                                 HR_CHECKED(kExtWrite, write)};

const hr_ext_step kStep = {sizeof(hr_ext_step), 0, HR_CHECKED(kExtStepState, step_state)};

// rank, local_rank and world_size answer an int32_t: their rule never refuses.
static_assert(kRules[kExtCommRank].when == When::kAnyTime &&
              kRules[kExtCommLocalRank].when == When::kAnyTime &&
              kRules[kExtCommWorldSize].when == When::kAnyTime);
const hr_ext_comm kComm = {sizeof(hr_ext_comm),
                           0,
                           HR_CHECKED(kExtCommRank, comm_rank),
                           HR_CHECKED(kExtCommLocalRank, comm_local_rank),
                           HR_CHECKED(kExtCommWorldSize, comm_world_size),
                           HR_CHECKED(kExtCommAllReduce, comm_all_reduce),
                           HR_CHECKED(kExtCommReduceScatter, comm_reduce_scatter),
                           HR_CHECKED(kExtCommAllGather, comm_all_gather),
                           HR_CHECKED(kExtCommBroadcast, comm_broadcast),
                           HR_CHECKED(kExtCommBarrier, comm_barrier),
                           HR_CHECKED(kExtCommWait, comm_wait),
                           HR_CHECKED(kExtCommStream, comm_stream)};

const hr_ext_shard kShard = {sizeof(hr_ext_shard),
                             0,
                             HR_CHECKED(kExtShardPartition, shard_partition),
                             HR_CHECKED(kExtShardLayout, shard_layout),
                             HR_CHECKED(kExtShardReduceGradients, shard_reduce_gradients),
                             HR_CHECKED(kExtShardGatherParameters, shard_gather_parameters),
                             HR_CHECKED(kExtShardWait, shard_wait),
                             HR_CHECKED(kExtShardGradientRange, shard_gradient_range),
                             HR_CHECKED(kExtShardPersistBelow, shard_persist_below),
                             HR_CHECKED(kExtShardReleaseParameters, shard_release_parameters)};

const hr_ext_batch kBatch = {sizeof(hr_ext_batch), 0, HR_CHECKED(kExtBatchState, batch_state),
                             HR_CHECKED(kExtBatchRestartStep, batch_restart_step),
                             HR_CHECKED(kExtBatchSetMicroBatch, batch_set_micro_batch)};

}  // namespace

// mlp_width answers an int32_t: its rule never refuses.
static_assert(kRules[kExtResizeMlpWidth].when == When::kAnyTime &&
              kRules[kExtResizeAttnHeads].when == When::kAnyTime);
const hr_ext_resize kResize = {sizeof(hr_ext_resize),
                               0,
                               HR_CHECKED(kExtResizeMlpWidth, mlp_width),
                               HR_CHECKED(kExtResizeKeepMlpUnits, keep_mlp_units),
                               HR_CHECKED(kExtResizeAttnHeads, attn_heads),
                               HR_CHECKED(kExtResizeKeepAttnHeads, keep_attn_heads)};

const void* HostServices::get_extension(hr_host*, const char* id) {
  if (!id) return nullptr;
  // Exact ids only: another version of one ("headroom.vm/2") is another extension.
  const std::pair<const char*, const void*> tables[] = {
      {HR_EXT_VM, &kVm},           {HR_EXT_PRECISION, &kPrecision}, {HR_EXT_RECOMPUTE, &kRecompute},
      {HR_EXT_TENSORS, &kTensors}, {HR_EXT_STEP, &kStep},           {HR_EXT_COMM, &kComm},
      {HR_EXT_SHARD, &kShard},     {HR_EXT_BATCH, &kBatch},         {HR_EXT_RESIZE, &kResize}};
  for (const auto& [name, table] : tables)
    if (std::strcmp(id, name) == 0) return table;
  return nullptr;
}

hr_host_services make_services(LoadedPlugin& p) {
  hr_host_services s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.abi_version = p.abi;
  s.host = &p.handle;
  s.log = HR_CHECKED(kLog, log);
  s.set_error = HR_CHECKED(kSetError, set_error);
  s.config_int = HR_CHECKED(kConfigInt, config_int);
  s.config_float = HR_CHECKED(kConfigFloat, config_float);
  s.config_bool = HR_CHECKED(kConfigBool, config_bool);
  s.config_string = HR_CHECKED(kConfigString, config_string);
  s.config_size = HR_CHECKED(kConfigSize, config_size);
  s.config_error = HR_CHECKED(kConfigError, config_error);
  s.alloc = HR_CHECKED(kAlloc, alloc);
  s.free = HR_CHECKED(kFree, free);
  s.raw_alloc = HR_CHECKED(kRawAlloc, raw_alloc);
  s.raw_free = HR_CHECKED(kRawFree, raw_free);
  s.memory_stats = HR_CHECKED(kMemoryStats, memory_stats);
  s.num_layers = HR_CHECKED(kNumLayers, num_layers);
  s.layer_name = HR_CHECKED(kLayerName, layer_name);
  s.layer_num_params = HR_CHECKED(kLayerNumParams, layer_num_params);
  s.layer_param = HR_CHECKED(kLayerParam, layer_param);
  s.layer_num_activations = HR_CHECKED(kLayerNumActivations, layer_num_activations);
  s.layer_activation = HR_CHECKED(kLayerActivation, layer_activation);
  s.op_fill = HR_CHECKED(kOpFill, op_fill);
  s.op_copy = HR_CHECKED(kOpCopy, op_copy);
  s.op_cast = HR_CHECKED(kOpCast, op_cast);
  s.op_scale = HR_CHECKED(kOpScale, op_scale);
  s.op_axpy = HR_CHECKED(kOpAxpy, op_axpy);
  s.op_sum_squares = HR_CHECKED(kOpSumSquares, op_sum_squares);
  s.op_nonfinite = HR_CHECKED(kOpNonfinite, op_nonfinite);
  s.device_kind = HR_CHECKED(kDeviceKind, device_kind);
  s.device_index = HR_CHECKED(kDeviceIndex, device_index);
  s.stream = HR_CHECKED(kStream, stream);
  s.rank = HR_CHECKED(kRank, rank);
  s.world_size = HR_CHECKED(kWorldSize, world_size);
  s.veto_step = HR_CHECKED(kVetoStep, veto_step);
  s.request_retry = HR_CHECKED(kRequestRetry, request_retry);
  s.vm_granularity = HR_CHECKED(kVmGranularity, vm_granularity);
  s.vm_reserve = HR_CHECKED(kVmReserve, vm_reserve);
  s.vm_map = HR_CHECKED(kVmMap, vm_map);
  s.vm_unmap = HR_CHECKED(kVmUnmap, vm_unmap);
  s.vm_release = HR_CHECKED(kVmRelease, vm_release);
  s.drop_activations = HR_CHECKED(kDropActivations, drop_activations);
  s.set_compute_dtype = HR_CHECKED(kSetComputeDtype, set_compute_dtype);
  s.set_loss_scale = HR_CHECKED(kSetLossScale, set_loss_scale);
  s.get_extension = HostServices::get_extension;
  return s;
}

#undef HR_CHECKED

std::string key_where(const LoadedPlugin& p, const std::string& key) {
  auto it = p.entry.key_pos.find(key);
  const std::string pos = it != p.entry.key_pos.end() ? it->second.str() : p.entry.pos.str();
  return pos + ": plugins." + p.entry.name + "." + key;
}

}  // namespace headroom
