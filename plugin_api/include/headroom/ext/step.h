/* headroom.step/1 — where the current optimizer step stands (ABI 1.5), stopping the run
 * (appended in ABI 1.6: stop_run) and narrowing the events a plugin takes (ABI 1.8: set_events).
 *
 * Training thread, from any event. What is not known yet at the event reads as documented. */
#ifndef HEADROOM_EXT_STEP_H
#define HEADROOM_EXT_STEP_H

#include "headroom/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HR_EXT_STEP "headroom.step/1"

/* An out-struct: the caller sets struct_size; the host fills what it covers. */
typedef struct hr_step_state {
  uint32_t struct_size;
  int32_t micro_step; /* 1-based within the step; 0 outside micro-steps */
  int64_t step;       /* 1-based; 0 before the first */
  double lr;          /* the learning rate of this step's update (the schedule's) */
  double loss_scale;  /* what this step's backward multiplies the loss gradient by */
  double loss;        /* the mean loss over the tokens of this step's micro-steps whose loss is
                       * known (the running one from its head's BACKWARD_END on); 0 before */
  uint64_t tokens;    /* the tokens of those micro-steps */
  double grad_norm;   /* from OPTIMIZER_STEP on: the global gradient norm (as the gradients are,
                       * scaled or not); 0 before */
  double clip_coef;   /* from OPTIMIZER_STEP on: what clipping multiplies the gradients by (1 when
                       * it does not clip); 1 before */
  int32_t skipped;    /* 1 once a plugin vetoed this step's update */
  int32_t reserved0;
  /* Appended (check struct_size): the micro-steps the step has: [train] grad_accum, or more
   * when the step runs at a smaller micro-batch (headroom.batch/1). */
  int32_t micro_steps;
  int32_t reserved1;
  /* Appended (ABI 1.7; check struct_size): 1 in a dry run (`headroom plan --measure`): every
   * allocation and free happens as in the real run, but no op computes and no buffer holds values
   * anyone reads (the host backs them with memory it never commits). A plugin with loops of its
   * own over device memory (an optimizer's update on the CPU) skips them then, and keeps every
   * allocation, so that the dry run measures it and costs the host no memory. 0 otherwise. Any
   * time from create() on. */
  int32_t dry;
  int32_t reserved2;
} hr_step_state;

typedef struct hr_ext_step {
  uint32_t struct_size;
  uint32_t reserved0;
  hr_status (*state)(hr_host* host, hr_step_state* out);
  /* Appended (ABI 1.6; check HR_HAS_FIELD(table, hr_ext_step, stop_run)). Stops the run cleanly,
   * as a first SIGINT does, but after the current step: the step in progress finishes (its
   * update, STEP_END, its evaluation and EVAL_END, its snapshot when due), then, before the next
   * step begins, the run writes a snapshot of it when [snapshot] is on (unless it already has
   * one), fires TRAIN_END, closes every output whole and exits with code 7, saying
   *   "stopped by plugin '<name>' after step S of N: <reason>; ..."
   * and where the snapshot is. `reason`: one line, copied (NULL: "no reason given"). From
   * create() or TRAIN_BEGIN the run stops before step 1; during the last step, or from TRAIN_END,
   * it changes nothing (the run completes, exit 0). The first request wins; later ones (of any
   * plugin) are ignored. With ranks, a request on any rank stops every rank after the same step;
   * the other ranks say "stopped by plugin '<name>' of rank R after step S of N (its reason is in
   * rank R's output)". Any plugin, any time; HR_OK. */
  hr_status (*stop_run)(hr_host* host, const char* reason);
  /* Appended (ABI 1.8; check HR_HAS_FIELD(table, hr_ext_step, set_events)). From create() only:
   * from then on the plugin receives only `events` (HR_EVENT_BIT()s), which must be a subset of
   * the events it takes (its descriptor's `events`, or what an earlier call narrowed them to) —
   * for a plugin whose config leaves a hook nothing to do (amp in bf16 has no loss scale to
   * check at GRADS_READY). The host plans by the events the plugins take: one no plugin takes
   * holds nothing back (the offload plugin's host update overlapped with the backward waits for
   * no GRADS_READY hook). A bit it does not take: HR_ERROR_INVALID with a message, nothing
   * changed; from any event: HR_ERROR_NOT_ALLOWED. */
  hr_status (*set_events)(hr_host* host, uint64_t events);
} hr_ext_step;

#ifdef __cplusplus
}
#endif

#endif /* HEADROOM_EXT_STEP_H */
