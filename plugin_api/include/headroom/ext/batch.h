/* headroom.batch/1 — the micro-batch of the steps, and restarting a step that ran out of memory
 * (ABI 1.5).
 *
 * The effective batch is fixed: [train] micro_batch B times grad_accum A sequences a step. A step
 * may run them as micro-batches of b sequences (b divides B) with B·A/b micro-steps of
 * accumulation: the same sequences in the same order (each configured micro-batch of B is cut into
 * B/b consecutive slices), the same loss (the mean over the step's tokens), so what is learned is
 * the same up to float rounding in the accumulation. The host keeps the data; a plugin chooses b.
 *
 * One rank without a zero plugin so far: elsewhere restart_step and set_micro_batch answer
 * HR_ERROR_NOT_ALLOWED with a message (the ranks would have to agree on every restart).
 *
 * Training thread only. */
#ifndef HEADROOM_EXT_BATCH_H
#define HEADROOM_EXT_BATCH_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_BATCH "headroom.batch/1"

/* An out-struct: the caller sets struct_size; the host fills what it covers. */
typedef struct hr_batch_state {
  uint32_t struct_size;
  int32_t configured_micro_batch; /* [train] micro_batch */
  int32_t configured_grad_accum;  /* [train] grad_accum */
  int32_t micro_batch;            /* what the current step runs at (between steps: the last one's,
                                   * or the next one's once set_micro_batch chose it) */
  int32_t grad_accum;           /* configured_micro_batch · configured_grad_accum / micro_batch */
  int32_t restarts;             /* times the current step was restarted so far */
  uint64_t memory_limit;        /* [device] memory_limit; 0 = none */
  uint64_t attempt_start_bytes; /* live bytes as the current attempt of the step began (after
                                 * STEP_BEGIN, or after a restart released the abandoned one) */
  uint64_t attempt_peak_bytes;  /* the highest live bytes since then: at STEP_END, the step's
                                 * peak at its micro-batch */
} hr_batch_state;

typedef struct hr_ext_batch {
  uint32_t struct_size;
  uint32_t reserved0;
  /* Any time. */
  hr_status (*state)(hr_host* host, hr_batch_state* out);
  /* From the OOM hook only, for an allocation that failed inside one of the step's micro-steps
   * (forward or backward): once the hooks return, the host releases what the abandoned attempt
   * holds (activations, workspace, per-layer compute gradients; what a plugin allocated for the
   * attempt it frees from its next hook, the OOM hook being inside the failed allocation, and
   * tells a restarted attempt by `restarts`), discards the step's gradients, and runs the step
   * again from its first micro-step at `micro_batch` (it divides configured_micro_batch,
   * 1 <= micro_batch <= the current one), on the same sequences. No second STEP_BEGIN fires;
   * micro-steps count from 1 again. `reason` goes to the log. An OOM anywhere else, or a step
   * restarted 16 times, stops the run as usual. HR_ERROR_INVALID (with a message) for a micro_batch
   * outside those bounds; the last request of the hooks wins. */
  hr_status (*restart_step)(hr_host* host, int32_t micro_batch, const char* reason);
  /* From TRAIN_BEGIN, STEP_BEGIN (the current step runs at it) or STEP_END (the next step does):
   * the micro-batch, as for restart_step but any divisor of configured_micro_batch (growing back
   * included). `reason` goes to the log when it changes anything. */
  hr_status (*set_micro_batch)(hr_host* host, int32_t micro_batch, const char* reason);
} hr_ext_batch;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_BATCH_H */
