/* headroom.offload/1 — places: the host ledger beside the device's, and where the built-in
 * optimizer keeps its state (ABI 1.8).
 *
 * Memory has places (docs/design.md "Places"): the device, and the host (page-locked on CUDA),
 * each a ledger with the same categories (hr_mem_category) and its own wall ([device]
 * memory_limit, [host] memory_limit). Moving tensors between places is core's mechanism; which
 * tensors go is a plugin's policy (the offload plugin's). Training thread. */
#ifndef HEADROOM_EXT_OFFLOAD_H
#define HEADROOM_EXT_OFFLOAD_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_OFFLOAD "headroom.offload/1"

/* Places (hr_mechanisms.optimizer_place too). */
#define HR_PLACE_DEVICE 0u
#define HR_PLACE_HOST 1u

typedef struct hr_ext_offload {
  uint32_t struct_size;
  uint32_t reserved0;
  /* From create() only. Where the built-in optimizer ([train] optimizer: AdamW, SGD) keeps its
   * state and the f32 weights it updates. HR_PLACE_DEVICE: on the device (the default).
   * HR_PLACE_HOST: in the host ledger, ZeRO-Offload's layout: an f32 copy of every parameter the
   * optimizer updates (category parameters), its state (optimizer) and one staging buffer of the
   * largest parameter's gradient (gradients); at each update every parameter's gradient is read
   * back into the staging buffer, the same CPU kernel as the CPU backend's updates the host copy
   * and state (on the CPU backend's threads), and the new weights go to the device on the copy
   * stream. Results are bitwise those on the device (CPU backend). HR_ERROR_INVALID for another
   * value; HR_ERROR_NOT_ALLOWED outside create(). A run where the optimizer is not the built-in
   * one (an optimizer-role plugin) or the model state is sharded (headroom.shard/1) refuses the
   * host place before step 1, naming the plugins; resizes (headroom.resize/1) reach its state. */
  hr_status (*set_optimizer_place)(hr_host* host, uint32_t place);
  /* Any time: what set_optimizer_place chose (HR_PLACE_DEVICE unless a plugin chose). */
  uint32_t (*optimizer_place)(hr_host* host);
  /* Any time: the host ledger, as services->memory_stats gives the device's: limit is [host]
   * memory_limit (0 = none), the bytes by category its live and peak. */
  hr_status (*host_memory_stats)(hr_host* host, hr_memory_stats* out);
} hr_ext_offload;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_OFFLOAD_H */
