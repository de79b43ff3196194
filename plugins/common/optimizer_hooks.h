// For in-tree optimizer-role plugins written in C++: the C hooks around a class T that does the
// work, each run under guarded() so that no exception crosses the ABI. T has
//   const hr_host_services* services() const;
//   hr_status step(const hr_optimizer_step_info* info);   // the optimizer role's update
//   hr_status save(const hr_state_writer* writer);        // its state, for snapshots
//   hr_status load(const void* data, uint64_t size);      // and back
//   hr_status resize(const hr_resize_info* info);         // a parameter shrank (pruning)
// and the plugin's create() makes it with new. Training thread, as the hooks are.
#pragma once

#include <cstdint>

#include "common/hook_guard.h"
#include "headroom/ext/resize.h"
#include "headroom/plugin.h"

namespace headroom_plugin {

template <class T>
struct OptimizerHooks {
  static void destroy(void* instance) { delete static_cast<T*>(instance); }
  // Optimizers subscribe to no event; the descriptor still needs the hook.
  static hr_status on_event(void*, const hr_event_info*) { return HR_OK; }
  static hr_status step(void* instance, const hr_optimizer_step_info* info) {
    T* t = static_cast<T*>(instance);
    return guarded(t->services(), "updating the parameters", [&] { return t->step(info); });
  }
  static hr_status save_state(void* instance, const hr_state_writer* writer) {
    T* t = static_cast<T*>(instance);
    return guarded(t->services(), "saving its state", [&] { return t->save(writer); });
  }
  static hr_status load_state(void* instance, const void* data, uint64_t size) {
    T* t = static_cast<T*>(instance);
    return guarded(t->services(), "loading its state", [&] { return t->load(data, size); });
  }
  static hr_status resize(void* instance, const hr_resize_info* info) {
    T* t = static_cast<T*>(instance);
    return guarded(t->services(), "resizing its state", [&] { return t->resize(info); });
  }
  static constexpr hr_optimizer_hooks kHooks = {sizeof(hr_optimizer_hooks), 0, step, resize};
};

}  // namespace headroom_plugin
