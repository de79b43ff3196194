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
  /* Training thread, once, in a resumed run whose snapshot holds this plugin's state (nothing
   * saved, no call), exactly the bytes save wrote. When: after every plugin's create(), after
   * the model is built (its parameters, gradients and the optimizer's state allocated; the
   * ALLOC events of that setup fired) and after the snapshot's values are in it, before
   * TRAIN_BEGIN; the plugins in TOML order. So the model is there: num_layers() is the model's,
   * layer_param gives every parameter with the snapshot's values (the masters, as at the
   * snapshot step's STEP_END, bitwise; amp's compute copies already cast from them; data NULL
   * where the masters are sharded, as always) and its gradient buffer (allocated; gradients are
   * not in snapshots, and every step zeroes them first), the built-in
   * optimizer's state is the snapshot's, and the data position too. Read the model freely (and
   * alloc); do not write parameters: the host has already made what follows from them. No event
   * is being dispatched: services that only some events may call refuse. HR_ERROR_CONFIG (with
   * set_error) for bytes it cannot take: exit 2; any other failure: exit 1. */
  hr_status (*load)(void* instance, const void* data, uint64_t size);
} hr_ext_state;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_STATE_H */
