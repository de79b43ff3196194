// headroom.step/1 (headroom/ext/step.h): where the current optimizer step stands, stopping the
// run, narrowing the events a plugin takes.
#include <cstddef>
#include <cstdio>
#include <string>

#include "core/plugin_host/services.h"
#include "headroom/ext/step.h"

namespace headroom {
namespace services {

constexpr Rule kStepState = {HR_EXT_STEP " state", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status step_state(hr_host* h, hr_step_state* out) {
  if (!out) {
    plugin(h).error = "state: out must not be NULL";
    return HR_ERROR_INVALID;
  }
  const StepState& r = run(h).step->step_state();
  hr_step_state s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.step = r.step;
  s.micro_step = r.micro_step;
  s.lr = r.lr;
  s.loss_scale = step_loss_scale(h);
  // The micro-steps done, and the current one once the head's backward has computed its loss.
  s.loss = r.losses.mean();
  s.tokens = r.losses.tokens_so_far();
  // The gradient norm and the clipping coefficient from OPTIMIZER_STEP on (ext/step.h).
  const bool norm_known = r.phase >= StepState::Phase::kUpdate;
  s.grad_norm = norm_known ? r.grad_norm : 0.0;
  s.clip_coef = norm_known ? r.clip_coef : 1.0;
  s.skipped = r.skipped ? 1 : 0;
  s.micro_steps = r.grad_accum;
  s.dry = run(h).device->dry() ? 1 : 0;
  write_sized(out, s, offsetof(hr_step_state, struct_size) + sizeof(uint32_t));
  return HR_OK;
}

constexpr Rule kStepStopRun = {HR_EXT_STEP " stop_run", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status step_stop_run(hr_host* h, const char* reason) {
  // One line of the plugin's words, for the run's last message.
  std::string why = reason ? std::string(reason) : std::string();
  why = why.substr(0, why.find_first_of("\r\n"));
  if (why.size() > 500) why = why.substr(0, 500) + "...";
  if (why.empty()) why = "no reason given";
  run(h).step->request_stop(plugin(h).entry.name, why);
  return HR_OK;
}

constexpr Rule kStepSetEvents = {HR_EXT_STEP " set_events", kAnyone, When::kCreate, kNotAllowed};
static hr_status step_set_events(hr_host* h, uint64_t events) {
  LoadedPlugin& p = plugin(h);
  if (events & ~p.desc.events) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "0x%llx",
                  static_cast<unsigned long long>(events & ~p.desc.events));
    p.error = std::string("set_events: asks for events it does not take (bits ") + hex +
              "): it may only narrow them";
    return HR_ERROR_INVALID;
  }
  // What dispatch and the host's plans read (PluginHost::subscribed_events, gradient_events).
  p.desc.events = events;
  p.gradient_events &= events;
  return HR_OK;
}

extern const hr_ext_step kStepExtension;
const hr_ext_step kStepExtension = {sizeof(hr_ext_step), 0, checked<kStepState, step_state>,
                                    checked<kStepStopRun, step_stop_run>,
                                    checked<kStepSetEvents, step_set_events>};

}  // namespace services
}  // namespace headroom
