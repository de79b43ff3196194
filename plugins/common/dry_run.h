// Whether this run is dry (`headroom plan --measure`): headroom.step/1's hr_step_state.dry (ABI
// 1.7). A plugin whose own loops read and write device memory (an optimizer's update on the CPU)
// skips them then, keeping every allocation: the dry run measures its bytes without the host
// committing the memory (headroom/ext/step.h). False from a host without it.
#pragma once

#include "headroom/ext/step.h"
#include "headroom/plugin.h"

namespace headroom_plugin {

inline bool dry_run(const hr_host_services* s) {
  if (!HR_HAS_FIELD(s, hr_host_services, get_extension) || !s->get_extension) return false;
  const auto* step = static_cast<const hr_ext_step*>(s->get_extension(s->host, HR_EXT_STEP));
  if (!step || !step->state) return false;
  hr_step_state st{};
  st.struct_size = sizeof st;
  return step->state(s->host, &st) == HR_OK && HR_HAS_FIELD(&st, hr_step_state, dry) && st.dry != 0;
}

}  // namespace headroom_plugin
