/* headroom.recompute/1 — activation recomputation: the mechanism checkpoint drives (ABI 1.5).
 *
 * drop_activations is the 1.4 table's (headroom/plugin.h: from FORWARD_END of that layer only,
 * HR_DROP_ALL or HR_DROP_CHEAP, blocks only). Training thread. */
#ifndef HEADROOM_EXT_RECOMPUTE_H
#define HEADROOM_EXT_RECOMPUTE_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_RECOMPUTE "headroom.recompute/1"

typedef struct hr_ext_recompute {
  uint32_t struct_size;
  uint32_t reserved0;
  /* FORWARD_END(layer) only. */
  hr_status (*drop_activations)(hr_host* host, int32_t layer, uint32_t what);
  /* Any time: the bytes of activations `layer` holds now (0 outside its forward..backward). */
  uint64_t (*layer_activation_bytes)(hr_host* host, int32_t layer);
} hr_ext_recompute;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_RECOMPUTE_H */
