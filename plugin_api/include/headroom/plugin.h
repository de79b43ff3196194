/* headroom plugin ABI: the only header a plugin needs. C99; depends on stdint.h and stddef.h only.
 *
 * This first part pins the identifiers a plugin and the host share: the ABI version, the events of
 * the training loop and the memory categories. The entry point, the descriptor and the host
 * services table are appended by the plugin ABI v1 (see docs/plugin-guide.md once it lands).
 * Values are never renumbered: new ones are only appended. */
#ifndef HEADROOM_PLUGIN_H
#define HEADROOM_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HR_ABI_VERSION_MAJOR 1
#define HR_ABI_VERSION_MINOR 0

/* The events of the training loop, in the order one optimizer step fires them (ALLOC, FREE and
 * OOM at every device allocation). */
typedef enum hr_event {
  HR_EVENT_TRAIN_BEGIN = 0,
  HR_EVENT_TRAIN_END = 1,
  HR_EVENT_STEP_BEGIN = 2,
  HR_EVENT_STEP_END = 3,
  HR_EVENT_FORWARD_BEGIN = 4, /* per layer */
  HR_EVENT_FORWARD_END = 5,
  HR_EVENT_BACKWARD_BEGIN = 6, /* per layer */
  HR_EVENT_BACKWARD_END = 7,
  HR_EVENT_GRADS_READY = 8,
  HR_EVENT_OPTIMIZER_STEP = 9,
  HR_EVENT_ALLOC = 10,
  HR_EVENT_FREE = 11,
  HR_EVENT_OOM = 12,
  HR_EVENT_COUNT_V1 = 13
} hr_event;

/* What a device buffer holds. Every device allocation carries exactly one. */
typedef enum hr_mem_category {
  HR_MEM_PARAMETERS = 0,
  HR_MEM_GRADIENTS = 1,
  HR_MEM_OPTIMIZER = 2,
  HR_MEM_ACTIVATIONS = 3,
  HR_MEM_WORKSPACE = 4,
  HR_MEM_DATA = 5,
  HR_MEM_COMMUNICATION = 6,
  HR_MEM_CATEGORY_COUNT_V1 = 7
} hr_mem_category;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_PLUGIN_H */
