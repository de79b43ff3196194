/* headroom.reads/1 — offered by a plugin: what its event hooks read of the run (ABI 1.5).
 *
 * The plugin says it; core does not guess from its subscriptions. Core plans by it: a hook that
 * reads or writes the gradients after clipping sees them as clipping left them, so core clips
 * them in place for it, where it could otherwise fold clipping into the optimizer's update and
 * leave the gradients unclipped in memory.
 *
 * The plugin returns this table from hr_plugin_descriptor.get_extension(HR_EXT_READS): constant
 * data, read once when the host loads the library (before create(), also for a plugin that is
 * never created). A plugin that offers none counts as reading the gradients at every event it
 * subscribes to — conservative, so that a plugin built before this extension stays correct. */
#ifndef HEADROOM_EXT_READS_H
#define HEADROOM_EXT_READS_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_READS "headroom.reads/1"

typedef struct hr_ext_reads {
  uint32_t struct_size;
  uint32_t reserved0;
  /* The HR_EVENT_BIT()s of the events whose hooks read or write the parameters' gradients
   * (hr_tensor.grad, directly or through a service: headroom.tensors/1's reads and reductions,
   * headroom.shard/1's reduce_gradients, op_* on them). 0: no hook touches them. Bits of events
   * the plugin does not subscribe to mean nothing. What an optimizer-role plugin's step reads is
   * its role's, not an event's: the host knows the optimizer reads the gradients. Fields are
   * only appended (other things a hook reads). */
  uint64_t gradients;
} hr_ext_reads;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_READS_H */
