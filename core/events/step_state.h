// Where the current optimizer step stands: its phase (as FSDP2's TrainingState says where a
// module is), what it has measured so far, and what plugins asked of it. The trainer keeps one and
// resets it at every step; once the step ends it is the step's record (the metrics row,
// Trainer::history()). Plugins read it through headroom.step/1 and headroom.batch/1.
#pragma once

#include <cstdint>
#include <string>

namespace headroom {

struct StepState {
  // In loop order (docs/design.md, "The loop and its events").
  enum class Phase {
    kIdle,      // before STEP_BEGIN: the loss scale is not the step's yet
    kForward,   // a micro-step before any layer's backward: the gradients are untouched
    kBackward,  // a micro-step from the first BACKWARD_BEGIN on
    kReduce,    // every micro-step done: reductions finish, GRADS_READY
    kUpdate,    // the gradient norm known: OPTIMIZER_STEP and the update
    kEnd,       // STEP_END, validation, metrics
  };
  Phase phase = Phase::kIdle;
  int64_t step = 0;
  // When the step began: the clock (ms) and Backend::host_syncs().
  double start_ms = 0.0;
  uint64_t start_host_syncs = 0;
  // The micro-step running now (1-based; 0 outside micro-steps), of `grad_accum` at
  // `micro_batch` sequences each: micro_batch · grad_accum is [train] micro_batch · grad_accum
  // (headroom.batch/1 may lower the micro-batch; the accumulation makes up the rest).
  int micro_step = 0;
  int grad_accum = 1;
  int micro_batch = 1;
  int restarts = 0;  // attempts abandoned out of memory and run again
  // Device bytes live when the current attempt began, and its highest since (headroom.batch/1).
  uint64_t attempt_start_bytes = 0, attempt_peak_bytes = 0;
  double lr = 0.0;
  double loss_scale = 1.0;  // what the step's backward runs with (amp fp16), from kForward on

  // The loss so far: the current micro-step's, from the head's backward on, and the micro-steps
  // done. Started again when the step restarts.
  struct Losses {
    bool micro_known = false;
    double micro = 0.0;
    uint64_t micro_tokens = 0;
    int done = 0;
    double sum = 0.0, weighted_sum = 0.0;  // of their mean losses; times their tokens
    uint64_t tokens = 0, first_tokens = 0;
    bool equal_tokens = true;
    // Counts the current micro-step in, once its loss is known.
    void count_micro_step() {
      if (!micro_known) return;
      if (done > 0 && micro_tokens != first_tokens) equal_tokens = false;
      if (done == 0) first_tokens = micro_tokens;
      ++done;
      sum += micro;
      weighted_sum += micro * double(micro_tokens);
      tokens += micro_tokens;
      micro_known = false;
    }
    // The mean over the step's tokens, of the micro-steps done and the current one once its loss
    // is known: with as many tokens in every micro-step (every target counted) the mean of their
    // means, as the metrics always reported it; else weighted by their tokens.
    double mean() const {
      Losses l = *this;
      l.count_micro_step();
      if (l.done == 0) return 0.0;
      if (l.equal_tokens) return l.sum / l.done;
      return l.tokens ? l.weighted_sum / double(l.tokens) : 0.0;
    }
    uint64_t tokens_so_far() const { return tokens + (micro_known ? micro_tokens : 0); }
  };
  Losses losses;

  // From kUpdate on: the global gradient norm before clipping, and what clipping multiplied the
  // gradients by.
  double grad_norm = 0.0;
  double clip_coef = 1.0;
  // A plugin vetoed the step (from any event up to OPTIMIZER_STEP), so its update is skipped:
  // who, and why.
  bool skipped = false;
  std::string veto_reason;

  // The record, once the step has ended.
  double loss = 0.0;  // the step's mean loss; with ranks, the mean over them
  double step_ms = 0.0;
  double tokens_per_s = 0.0;
  double data_wait_ms = 0.0;  // waiting for batches, summed over the step's micro-steps
  double comm_wait_ms = 0.0;  // world size > 1: what the overlap of the reductions did not hide
  // Times the host waited for the device in the step (Backend::host_syncs; the validation after
  // it and snapshots not counted).
  uint64_t host_syncs = 0;
  bool evaluated = false;  // train.eval_every: the validation loss was measured after the step
  double val_loss = 0.0;

  // Step `n` begins at learning rate `learning_rate`: what the last step measured goes; its
  // micro-batch, restarts and attempt bytes stay until the step plan sets this step's, once
  // STEP_BEGIN has been dispatched.
  void begin(int64_t n, double learning_rate) {
    StepState s;
    s.micro_batch = micro_batch;
    s.grad_accum = grad_accum;
    s.restarts = restarts;
    s.attempt_start_bytes = attempt_start_bytes;
    s.attempt_peak_bytes = attempt_peak_bytes;
    s.step = n;
    s.lr = learning_rate;
    *this = s;
  }
};

}  // namespace headroom
