// What the host's service files share: the rule every service function is declared with and the
// check that holds a call against it (checked<>), what a service reads of the host that calls it,
// and the helpers and 1.4 functions that several tables use. One file a table: services_v1.cpp
// (the services table, frozen at ABI 1.4), ext_<name>.cpp (each host extension, its functions
// beside their rules), extensions.cpp (the registry get_extension searches). Not installed for
// plugins; nothing outside core/plugin_host/ uses it.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "core/device/backend.h"
#include "core/plugin_host/plugin_internal.h"

namespace headroom {

// What the services read of the host that calls them (PluginHost's friend).
struct HostServices {
  static PluginHost& host(hr_host* h) { return *h->owner; }
  static const RunInterfaces& run(hr_host* h) { return h->owner->run_; }
  // The event being dispatched (-1: none) and its layer.
  static int current_event(hr_host* h) { return h->owner->current_event_; }
  static int current_layer(hr_host* h) { return h->owner->current_layer_; }
  static const std::string& device_kind(hr_host* h) { return h->owner->device_kind_; }
  static int device_index(hr_host* h) { return h->owner->device_index_; }
  // A failure met inside a service where nothing may throw: the run stops with it at the next
  // event.
  static std::string& pending_failure(hr_host* h) { return h->owner->pending_failure_; }
  static std::unique_ptr<Communicator>& self_comm(hr_host* h) { return h->owner->self_comm_; }
};

namespace services {

// ---------------------------------------------------------------------------------------------
// The rules: who may call what. Every service function is declared with one, beside it, and
// reaches the plugin only through checked<>, which holds the caller against it before the
// function runs. The header comment of each function (headroom/plugin.h, headroom/ext/*.h) says
// the same in words.

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

// `refused` of a function whose int32_t answer is a value (a count, an index, a rank), not an
// hr_status (which is an int32_t too): a refusal could not be told from an answer, so checked<>
// does not compile such a function behind a rule that can refuse.
constexpr hr_status kAnswersValue = -1;

struct Rule {
  const char* function;  // as a plugin reaches it: "vm_map", "headroom.vm/1 map"
  uint32_t roles;        // the HR_ROLE_* the caller must provide; 0: any plugin
  When when;
  // What a refused call returns when the function returns an hr_status: HR_ERROR_NOT_ALLOWED,
  // or the HR_ERROR_INVALID that ABI 1.3 / 1.4 documented for drop_activations and
  // set_compute_dtype called from the wrong event; kAnswersValue for an int32_t that is no
  // status. A pointer or a size is NULL / 0.
  hr_status refused;
};

constexpr uint32_t kAnyone = 0;
constexpr uint32_t kAllocatorRole = HR_ROLE_ALLOCATOR;
constexpr hr_status kNotAllowed = HR_ERROR_NOT_ALLOWED;

constexpr bool can_refuse(const Rule& r) {
  return r.roles != kAnyone || r.when != When::kAnyTime;
}

// Whether `h`'s plugin is inside an allocation now: in an ALLOC, FREE or OOM hook or an allocator
// hook, where it must not start another.
bool in_allocation(hr_host* h);

// Whether `h`'s plugin may make this call now (`layer`: the layer the call names, -1 for none); if
// not, its error message says why, naming the function, the rule and the plugin.
bool allowed(hr_host* h, const Rule& rule, int32_t layer);

// The layer a call names: its first argument when that is an int32_t.
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

// A service function behind its rule: the call runs only when allowed() says so.
template <const Rule& R, auto Impl>
struct Checked;
template <const Rule& R, class Ret, class... A, Ret (*Impl)(hr_host*, A...)>
struct Checked<R, Impl> {
  static_assert(!(std::is_same_v<Ret, int32_t> && R.refused == kAnswersValue && can_refuse(R)),
                "a function answering an int32_t value cannot be refused: its rule must be "
                "any plugin, any time");
  static_assert(R.refused != kAnswersValue || std::is_same_v<Ret, int32_t>,
                "kAnswersValue is for functions answering an int32_t value");
  static Ret call(hr_host* h, A... a) {
    if (!h || !h->plugin) {
      if constexpr (std::is_void_v<Ret>) {
        return;
      } else {
        return Ret{};
      }
    }
    if (!allowed(h, R, layer_argument(a...))) {
      if constexpr (std::is_void_v<Ret>) {
        return;
      } else if constexpr (std::is_same_v<Ret, hr_status>) {
        return R.refused;
      } else {
        return Ret{};
      }
    }
    return Impl(h, a...);
  }
};

// What a table holds: the function behind its rule, as a C entry point.
template <const Rule& R, auto Impl>
inline constexpr auto checked = &Checked<R, Impl>::call;

// ---------------------------------------------------------------------------------------------
// What the service functions share. Every one is a C entry point: nothing may throw through it.

inline LoadedPlugin& plugin(hr_host* h) {
  return *h->plugin;
}
inline const RunInterfaces& run(hr_host* h) {
  return HostServices::run(h);
}
// The loss scale the current step's backward runs with: the step's from STEP_BEGIN on, before it
// the one the next STEP_BEGIN makes the step's.
inline double step_loss_scale(hr_host* h) {
  const StepState& s = run(h).step->step_state();
  return s.phase == StepState::Phase::kIdle ? run(h).precision->loss_scale() : s.loss_scale;
}

// The run's communicator, or a local one (rank 0 of 1) when the run has none: a check or an
// estimate runs on one rank by itself, also under mpirun (an MPI one would be collective).
Communicator& comm(hr_host* h);
// Layer `index` of the built model; nullptr (with the plugin's error set) when there is none.
Layer<float>* layer(hr_host* h, int32_t index);
// An f32 tensor view as the ABI describes it; the name and shape outlive the call.
hr_tensor f32_view(const std::string& name, const std::vector<int64_t>& shape, uint64_t numel,
                   void* data);

// `f` with the backend's failures as statuses: an op the backend lacks is HR_ERROR_UNSUPPORTED,
// anything else HR_ERROR, each with its message.
template <class F>
hr_status guarded(hr_host* h, F&& f) {
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

// The 1.4 table's functions that extensions offer again, under their own rules
// (services_v1.cpp): headroom.vm/1, precision/1, recompute/1, tensors/1.
void* raw_alloc(hr_host* h, uint64_t bytes);
void raw_free(hr_host* h, void* ptr);
uint64_t vm_granularity(hr_host* h);
void* vm_reserve(hr_host* h, uint64_t bytes);
hr_status vm_map(hr_host* h, void* addr, uint64_t bytes);
hr_status vm_unmap(hr_host* h, void* addr, uint64_t bytes);
hr_status vm_release(hr_host* h, void* addr, uint64_t bytes);
hr_status set_compute_dtype(hr_host* h, uint32_t dtype);
hr_status set_loss_scale(hr_host* h, double scale);
hr_status drop_activations(hr_host* h, int32_t index, uint32_t what);
hr_status layer_param(hr_host* h, int32_t index, int32_t i, hr_tensor* out);
// memory_stats of one place's ledger (the device's, or the host's for headroom.offload/1), as
// far as the caller's struct reaches and as the plugin's ABI version knows the categories.
hr_status place_memory_stats(hr_host* h, const Device& place, hr_memory_stats* out);

// services->get_extension: the host extension's table for `id` (extensions.cpp, the registry);
// NULL for an id it does not have.
const void* get_extension(hr_host* h, const char* id);

}  // namespace services
}  // namespace headroom
