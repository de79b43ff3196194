/* headroom.precision/1 — the compute dtype and the loss scale: the mechanism amp drives (ABI 1.5).
 *
 * set_compute_dtype and set_loss_scale are the 1.4 table's (headroom/plugin.h says what each does
 * and when it may be called); the getters are new. Training thread. */
#ifndef HEADROOM_EXT_PRECISION_H
#define HEADROOM_EXT_PRECISION_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_PRECISION "headroom.precision/1"

typedef struct hr_ext_precision {
  uint32_t struct_size;
  uint32_t reserved0;
  /* From create() only. */
  hr_status (*set_compute_dtype)(hr_host* host, uint32_t dtype);
  /* Any event; applies from the next STEP_BEGIN on. */
  hr_status (*set_loss_scale)(hr_host* host, double scale);
  /* Any time: the dtype the model computes in (HR_DTYPE_F32 unless a plugin chose another). */
  uint32_t (*compute_dtype)(hr_host* host);
  /* Any time: the loss scale the current step's backward uses (1 unless a plugin set one). */
  double (*loss_scale)(hr_host* host);
} hr_ext_precision;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_PRECISION_H */
