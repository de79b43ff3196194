/* headroom.state/1 — offered by a plugin: its state in training snapshots (ABI 1.5).
 *
 * What the descriptor's save_state / load_state (ABI 1.1) do, as an extension the plugin returns
 * from hr_plugin_descriptor.get_extension(HR_EXT_STATE). The host uses the descriptor's fields
 * when they are set, else this. */
#ifndef HEADROOM_EXT_STATE_H
#define HEADROOM_EXT_STATE_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_STATE "headroom.state/1"

typedef struct hr_ext_state {
  uint32_t struct_size;
  uint32_t reserved0;
  /* Training thread, after STEP_END of a snapshot step: everything the plugin needs to continue
   * exactly, through writer->write. */
  hr_status (*save)(void* instance, const hr_state_writer* writer);
  /* Training thread, once, after create() and before TRAIN_BEGIN of a resumed run: exactly the
   * bytes save wrote. HR_ERROR_CONFIG (with set_error) for bytes it cannot take. */
  hr_status (*load)(void* instance, const void* data, uint64_t size);
} hr_ext_state;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_STATE_H */
