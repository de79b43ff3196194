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
/* The NVMe tier: HR_PLACE_HOST's layout with the optimizer's state in a file (set_optimizer_files,
 * appended to this table). */
#define HR_PLACE_NVME 2u

/* set_optimizer_files' direct_io: O_DIRECT where the file system allows it, else buffered (one
 * log line says so); always (a file system that refuses it is an error); never. */
#define HR_DIRECT_IO_AUTO 0u
#define HR_DIRECT_IO_ON 1u
#define HR_DIRECT_IO_OFF 2u

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
   * one (an optimizer-role plugin) refuses the host place before step 1, naming the plugins; with
   * the model state sharded (headroom.shard/1) it holds and updates this rank's ranges; resizes
   * (headroom.resize/1) reach its state. */
  hr_status (*set_optimizer_place)(hr_host* host, uint32_t place);
  /* Any time: what set_optimizer_place or set_optimizer_files chose (HR_PLACE_DEVICE unless a
   * plugin chose). */
  uint32_t (*optimizer_place)(hr_host* host);
  /* Any time: the host ledger, as services->memory_stats gives the device's: limit is [host]
   * memory_limit (0 = none), the bytes by category its live and peak. */
  hr_status (*host_memory_stats)(hr_host* host, hr_memory_stats* out);
  /* Appended (check HR_HAS_FIELD). From create() only: the NVMe tier, HR_PLACE_NVME. The place is
   * HR_PLACE_HOST's (an f32 copy of the weights and the gradients' staging in the host ledger),
   * but the optimizer's state lives in one file per rank under the folder `dir`
   * (dir/headroom-<pid>-<n>-rank<R>.optstate, made and preallocated before step 1, removed at the
   * end of the run and on an error exit), streamed at each update piece by piece (1 Mi elements of
   * a parameter, or the whole of it where the update rounds stochastically) through two host
   * buffers (category optimizer) with io_uring: the next piece's state is read while this one's
   * is updated, and written back after. `direct_io`: HR_DIRECT_IO_AUTO, _ON or _OFF.
   * HR_ERROR_INVALID for a `dir` that is not a writable folder, a `direct_io` value that is none
   * of the three, or HR_DIRECT_IO_ON on a file system that refuses O_DIRECT (the message names
   * the file system); HR_ERROR_NOT_ALLOWED outside create(). The same refusals as
   * set_optimizer_place's HR_PLACE_HOST apply. */
  hr_status (*set_optimizer_files)(hr_host* host, const char* dir, uint32_t direct_io);
  /* Appended (check HR_HAS_FIELD). From create() only: where each layer's output waits between
   * the next layer's forward, which reads it, and that layer's backward, which reads it again
   * (the saved block outputs that activation checkpointing keeps, the embedding's output too).
   * HR_PLACE_DEVICE: on the device (the default). HR_PLACE_HOST: in the host ledger (category
   * activations), moved there once the next layer's forward ends and back on the device when the
   * backward reaches the layer above the next, one layer ahead of its use; the last block's output
   * (the head's input) stays. Results are bitwise those on the device. HR_ERROR_INVALID for
   * another value; HR_ERROR_NOT_ALLOWED outside create(). */
  hr_status (*set_activation_place)(hr_host* host, uint32_t place);
  /* Appended (check HR_HAS_FIELD). From create() only: whether the host place's buffers are
   * page-locked (1, the default: the device copies them by DMA, asynchronously on CUDA) or
   * pageable (0: plain host memory; CUDA stages each copy through its own page-locked buffers,
   * and no page-locked memory is taken from the system). The CPU backend's host place is plain
   * memory either way. HR_ERROR_NOT_ALLOWED outside create(). */
  hr_status (*set_host_page_locked)(hr_host* host, int32_t page_locked);
  /* Appended (check HR_HAS_FIELD). From create() only: where the parameter shards of a
   * run whose parameters are sharded (headroom.shard/1 HR_SHARD_PARAMETERS: zero3) rest between
   * their uses, ZeRO-Infinity's offload_param. HR_PLACE_DEVICE: on the device (the default).
   * HR_PLACE_HOST: each sharded layer's parameter, master, frozen and gradient shards live in
   * the host ledger; the device holds a layer's parameters only from its gathering (the rank's
   * range uploaded, the others' all-gathered) to its release, and its full gradients only from
   * its backward to its reduction, whose result is read back and added into the host shard. On
   * one rank too: the device then holds only the layers in flight. Layers below the persistence
   * threshold stay whole on the device. The run needs the optimizer on the host
   * (set_optimizer_place or set_optimizer_files: it updates the host shards in place) and a
   * plugin that shards the parameters; it refuses, naming the plugins, before step 1 otherwise.
   * Results are bitwise those of the same run on the device. HR_ERROR_INVALID for another value;
   * HR_ERROR_NOT_ALLOWED outside create(). */
  hr_status (*set_parameter_place)(hr_host* host, uint32_t place);
  /* Appended (check HR_HAS_FIELD). From create() only: the parameters' NVMe tier,
   * HR_PLACE_NVME, ZeRO-Infinity's offload_param "nvme". set_parameter_place's HR_PLACE_HOST,
   * except that the shards a gathering reads and only an update or a load writes — a sharded
   * layer's compute-dtype shard (amp), its frozen weights' and a quantized base's — live in one
   * file per rank under the folder `dir` (dir/headroom-<pid>-<n>-rank<R>.params, allocated layer
   * by layer as the model is built, before step 1; removed at the end of the run and on an error
   * exit): each gathering reads the layer's part into one host staging buffer (category
   * parameters, the largest layer's) with io_uring and uploads it from there; each update casts
   * the new compute shard there and writes it back. The master and gradient shards stay in the
   * host ledger. `direct_io` as set_optimizer_files'. HR_ERROR_INVALID for a `dir` that is not a
   * writable folder, a `direct_io` value that is none of the three, or HR_DIRECT_IO_ON on a file
   * system that refuses O_DIRECT; HR_ERROR_NOT_ALLOWED outside create(). The same refusals as
   * HR_PLACE_HOST's apply, and one more before step 1: a run with nothing for the file (fp32
   * parameters, no frozen weights: the masters are what the layers read and the optimizer
   * updates). */
  hr_status (*set_parameter_files)(hr_host* host, const char* dir, uint32_t direct_io);
} hr_ext_offload;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_OFFLOAD_H */
