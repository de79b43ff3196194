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

  /* Appended: the model state's layout (HR_HAS_FIELD). The setters are for create() only, after
   * set_compute_dtype chose bf16 or fp16; HR_ERROR_INVALID with a message otherwise, or for a
   * value not listed.
   * set_grad_dtype: what each parameter's gradient accumulates in over a step's micro-steps.
   * HR_DTYPE_F32 (the default): f32 gradients, each layer's compute-dtype gradients living only
   * through its backward (made at its BACKWARD_BEGIN, added in and freed at its BACKWARD_END).
   * The compute dtype: one gradient buffer in that dtype, the backward adds into it directly
   * (DeepSpeed's layout); layer_param's grad is then of that dtype (hr_tensor.grad_dtype). */
  hr_status (*set_grad_dtype)(hr_host* host, uint32_t dtype);
  /* keep = 1 (the default): f32 master weights beside the compute copies, what the optimizer
   * updates. keep = 0: the weights exist only in the compute dtype (bf16 only), and the
   * optimizer updates them with stochastic rounding, seeded from [train] seed and the step, its
   * state in snapshots; layer_param's data is then the bf16 weights (hr_tensor.dtype). */
  hr_status (*set_master_weights)(hr_host* host, int32_t keep);
  /* The built-in optimizers' state (AdamW's moments, SGD's momentum): HR_DTYPE_F32 (the default)
   * or HR_DTYPE_BF16 (stored rounded to nearest even; the update computes in f32). */
  hr_status (*set_state_dtype)(hr_host* host, uint32_t dtype);
  /* Any time: what the setters chose. */
  uint32_t (*grad_dtype)(hr_host* host);
  int32_t (*master_weights)(hr_host* host);
  uint32_t (*state_dtype)(hr_host* host);

  /* Appended (HR_HAS_FIELD). Any time: *out = 1 when any of the `count` tensors (data[i], of
   * dtypes[i] (a float hr_dtype), numels[i] elements, device memory) holds a NaN or an
   * infinity, else 0; one wait for the device for all of them, where op_nonfinite waits once a
   * tensor. amp's overflow check over every gradient. HR_ERROR_INVALID for a NULL array or out,
   * HR_ERROR_UNSUPPORTED for a dtype that is not a float. */
  hr_status (*nonfinite_many)(hr_host* host, uint64_t count, const void* const* data,
                              const uint32_t* dtypes, const uint64_t* numels, int32_t* out);
} hr_ext_precision;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_PRECISION_H */
