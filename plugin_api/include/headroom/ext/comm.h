/* headroom.comm/1 — the ranks of the run and collectives across them on device buffers (ABI 1.5).
 *
 * Training thread, from any event and from create() on. A run of one process (no launcher) is
 * rank 0 of 1, and every collective is then local: a copy at most. On CUDA the collectives run
 * on the communicator's stream (stream()), ordered after the work queued on the compute stream
 * when they are called; wait() orders the compute stream after them. On the CPU they are MPI's
 * non-blocking calls on host memory. Every rank must call the same collectives in the same order
 * (MPI's and NCCL's rule); a rank that does not join makes the others' wait fail after the run's
 * [distributed] timeout_s, naming it. */
#ifndef HEADROOM_EXT_COMM_H
#define HEADROOM_EXT_COMM_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_COMM "headroom.comm/1"

/* The reductions' `op`. */
#define HR_COMM_SUM 0
#define HR_COMM_AVERAGE 1 /* the sum divided by the world size */

/* One collective in flight: the host's, until wait() frees it. Its buffers must stay untouched
 * (and allocated) until then. */
typedef struct hr_comm_request hr_comm_request;

typedef struct hr_ext_comm {
  uint32_t struct_size;
  uint32_t reserved0;
  /* Where this process stands: 0 <= rank < world_size; local_rank among the ranks on its host. */
  int32_t (*rank)(hr_host* host);
  int32_t (*local_rank)(hr_host* host);
  int32_t (*world_size)(hr_host* host);
  /* The collectives, on device buffers of dtype HR_DTYPE_F32, _BF16 or _F16 (else
   * HR_ERROR_INVALID); *out receives the request to wait for. HR_ERROR with a message when the
   * communicator failed (a rank died or announced its failure, or a wait timed out).
   * all_reduce: in place over n elements, every rank ends with the sum or mean (HR_COMM_*). */
  hr_status (*all_reduce)(hr_host* host, void* buf, uint64_t n, uint32_t dtype, uint32_t op,
                          hr_comm_request** out);
  /* send: world_size * n elements; rank r's recv (n elements) ends with the reduction of every
   * rank's r-th block. */
  hr_status (*reduce_scatter)(hr_host* host, const void* send, void* recv, uint64_t n,
                              uint32_t dtype, uint32_t op, hr_comm_request** out);
  /* send: n elements; recv: world_size * n, rank r's block at r * n. */
  hr_status (*all_gather)(hr_host* host, const void* send, void* recv, uint64_t n, uint32_t dtype,
                          hr_comm_request** out);
  /* root's buf to every rank's (HR_ERROR_INVALID unless 0 <= root < world_size). */
  hr_status (*broadcast)(hr_host* host, void* buf, uint64_t n, uint32_t dtype, int32_t root,
                         hr_comm_request** out);
  hr_status (*barrier)(hr_host* host, hr_comm_request** out);
  /* Waits until the request is done, then frees it (also when it fails: call it once per
   * request). HR_ERROR with a message naming the rank when the collective cannot complete: a
   * rank failed, or it did not finish within the timeout. NULL is done at once. */
  hr_status (*wait)(hr_host* host, hr_comm_request* request);
  /* The stream the collectives run on (cudaStream_t); NULL on the CPU. */
  void* (*stream)(hr_host* host);
} hr_ext_comm;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_COMM_H */
