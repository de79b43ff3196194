// headroom.batch/1 (headroom/ext/batch.h): the steps' micro-batch, restarting a step that ran out
// of memory at a smaller one, and choosing it between steps.
#include <cstddef>
#include <stdexcept>

#include "core/plugin_host/services.h"
#include "headroom/ext/batch.h"

namespace headroom {
namespace services {

constexpr Rule kBatchState = {HR_EXT_BATCH " state", kAnyone, When::kAnyTime, kNotAllowed};
static hr_status batch_state(hr_host* h, hr_batch_state* out) {
  if (!out) {
    plugin(h).error = HR_EXT_BATCH " state: out must not be NULL";
    return HR_ERROR_INVALID;
  }
  const BatchControl& b = *run(h).batch;
  const StepState& step = run(h).step->step_state();
  hr_batch_state s;
  std::memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  s.configured_micro_batch = b.configured_micro_batch();
  s.configured_grad_accum = b.configured_grad_accum();
  s.micro_batch = b.next_micro_batch();
  s.grad_accum = s.configured_micro_batch * s.configured_grad_accum / s.micro_batch;
  s.restarts = step.restarts;
  s.memory_limit = run(h).device->memory_limit();
  s.attempt_start_bytes = step.attempt_start_bytes;
  s.attempt_peak_bytes = step.attempt_peak_bytes;
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

constexpr Rule kBatchRestartStep = {HR_EXT_BATCH " restart_step", kAnyone, When::kOom, kNotAllowed};
static hr_status batch_restart_step(hr_host* h, int32_t micro_batch, const char* reason) {
  return batch_call(h, "restart_step", [&](const std::string& name) {
    run(h).batch->restart_step(name, micro_batch, reason ? reason : "");
  });
}

constexpr Rule kBatchSetMicroBatch = {HR_EXT_BATCH " set_micro_batch", kAnyone, When::kStepBoundary,
                                      kNotAllowed};
static hr_status batch_set_micro_batch(hr_host* h, int32_t micro_batch, const char* reason) {
  return batch_call(h, "set_micro_batch", [&](const std::string& name) {
    run(h).batch->set_micro_batch(name, micro_batch, reason ? reason : "");
  });
}

extern const hr_ext_batch kBatchExtension;
const hr_ext_batch kBatchExtension = {sizeof(hr_ext_batch), 0, checked<kBatchState, batch_state>,
                                      checked<kBatchRestartStep, batch_restart_step>,
                                      checked<kBatchSetMicroBatch, batch_set_micro_batch>};

}  // namespace services
}  // namespace headroom
