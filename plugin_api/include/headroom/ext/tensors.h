/* headroom.tensors/1 — parameters by name, small device-to-host reads, reductions (ABI 1.5).
 *
 * Training thread. Device work goes on the compute stream; every function here waits for its
 * result, which is ready on the host when it returns. */
#ifndef HEADROOM_EXT_TENSORS_H
#define HEADROOM_EXT_TENSORS_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_TENSORS "headroom.tensors/1"

/* reduce()'s `op`. */
#define HR_REDUCE_SUM 0
#define HR_REDUCE_MAX 1     /* the largest element; NaN when any element is NaN */
#define HR_REDUCE_MAX_ABS 2 /* the largest |element|; NaN when any element is NaN */
#define HR_REDUCE_SUM_SQUARES 3

/* The most read() copies in one call: it is for scalars and small buffers, not for tensors. */
#define HR_READ_MAX_BYTES ((uint64_t)1 << 20)

typedef struct hr_ext_tensors {
  uint32_t struct_size;
  uint32_t reserved0;
  /* From the model's build on (TRAIN_BEGIN and later): the parameter with this Hugging Face GPT-2
   * name ("h.3.attn.c_attn.weight", "wte.weight"), as layer_param describes it; *layer and
   * *index (either may be NULL) say where it is for layer_param. HR_ERROR_INVALID with a message
   * for a name the model does not have. */
  hr_status (*find_param)(hr_host* host, const char* name, hr_tensor* out, int32_t* layer,
                          int32_t* index);
  /* Copies `bytes` (at most HR_READ_MAX_BYTES) of device memory at `src` to host memory at
   * `dst`. */
  hr_status (*read)(hr_host* host, void* dst, const void* src, uint64_t bytes);
  /* *out = the reduction (HR_REDUCE_*) of n elements of dtype at x, accumulated in double.
   * n = 0 gives 0 for the sums and -infinity for the maxima. */
  hr_status (*reduce)(hr_host* host, const void* x, uint32_t dtype, uint64_t n, uint32_t op,
                      double* out);
  /* Appended (HR_HAS_FIELD): copies `bytes` of host memory at `src` to device memory at `dst`
   * (any size; a plugin loading its state into its buffers). Done when it returns. */
  hr_status (*write)(hr_host* host, void* dst, const void* src, uint64_t bytes);
} hr_ext_tensors;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_TENSORS_H */
