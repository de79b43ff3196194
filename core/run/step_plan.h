// The plan of a step: which of the step's sequences each micro-step runs, at which micro-batch,
// how they reach the device, and what happens when a micro-step runs out of memory.
//
// A step is [train] micro_batch · grad_accum sequences (B · A), read from the loader as A
// configured micro-batches of B and kept on the host until the step ends. At micro-batch b (a
// divisor of B, headroom.batch/1) they run as B·A/b micro-steps of b consecutive rows: whatever b,
// the step learns from the same sequences. An out-of-memory failure in a micro-step runs it again
// (request_retry, while no layer began its backward) or the whole step from its first micro-step
// (restart_step at a smaller b, or request_retry later); docs/design.md draws both.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/data/data_loader.h"
#include "core/device/backend.h"
#include "core/device/device.h"
#include "core/events/step_state.h"
#include "core/model/model.h"
#include "core/plugin_host/run_interfaces.h"

namespace headroom {

class StepPlan final : public BatchControl {
 public:
  // `log`: where the changes are said; nullptr for none (every rank but 0).
  // `rank`: this rank's, which its dropout draws differ by.
  StepPlan(const Config& config, Device& device, DataLoader& loader, StepState& state, int rank,
           std::ostream* log);
  // Once the plugins are created: why this run's steps keep their micro-batch ("this run has more
  // than one rank", "this run is sharded": the ranks would have to agree on it); empty where it
  // may change.
  void fix_micro_batch(std::string why) { fixed_ = std::move(why); }
  StepPlan(const StepPlan&) = delete;
  StepPlan& operator=(const StepPlan&) = delete;

  // The batch buffers: (B, T) inputs and targets on the device (Category::kData), and two host
  // staging slots of both (page-locked on CUDA) that micro-steps take in turn. Held until the
  // returned lease goes: the end of the steps however they end, so that the allocation trace and
  // the memory timeline see them freed before they close.
  class BufferLease {
   public:
    explicit BufferLease(StepPlan& plan) : plan_(plan) {}
    ~BufferLease() { plan_.release_buffers(); }
    BufferLease(const BufferLease&) = delete;
    BufferLease& operator=(const BufferLease&) = delete;

   private:
    StepPlan& plan_;
  };
  [[nodiscard]] BufferLease allocate_buffers();

  // STEP_BEGIN has been dispatched: a micro-batch a plugin asked for takes effect; the state's
  // micro-batch and micro-steps are this step's, and its first attempt begins.
  void begin_step();
  // The current micro-step's slice of the step's sequences on the device: read from the loader
  // the first time the step needs its configured micro-batch (the wait goes to data_wait_ms),
  // staged in the next host slot once its last uploads have read it (Backend::wait_uploads, not a
  // synchronize), uploaded on the copy stream.
  const Batch& upload_micro_batch();
  // An allocation failed in the current micro-step and the OOM event has been fired: what the
  // abandoned attempt holds is released, and the micro-step (a plugin asked request_retry and no
  // backward had begun) or the whole step from its first micro-step (restart_step, or
  // request_retry once the gradients were touched; they are discarded) runs again: the state's
  // micro_step is set so that the loop's next one is it. Rethrows the failure, with a note on
  // the micro-batch, when nothing recovers.
  void recover(const OutOfMemory& e, Gpt<float>& model);

  // The device buffers at the current micro-batch, the host targets of staging slot 0 (for the
  // validation forward, which synchronizes around it), and that slot's buffers.
  Batch validation_batch() const;
  int32_t* staging_inputs(int slot) const;
  int32_t* staging_targets(int slot) const;

  // What plugins ask (headroom.batch/1, request_retry), with the plugin's name for the logs.
  void request_retry() { retry_requested_ = true; }
  // From the OOM event: the step again from its first micro-step at `micro_batch`
  // (std::invalid_argument for one that does not divide [train] micro_batch or is above the
  // step's; std::logic_error where steps cannot be restarted, or outside a micro-step).
  void restart_step(const std::string& plugin, int micro_batch, const std::string& reason) override;
  // From TRAIN_BEGIN, STEP_BEGIN (this step) or STEP_END (the next step).
  void set_micro_batch(const std::string& plugin, int micro_batch,
                       const std::string& reason) override;
  int configured_micro_batch() const override { return config_.train.micro_batch; }
  int configured_grad_accum() const override { return config_.train.grad_accum; }
  // The micro-batch the next micro-step runs at: the one asked for, else the current one.
  int next_micro_batch() const override {
    return next_.micro_batch ? next_.micro_batch : state_.micro_batch;
  }
  int micro_steps_at(int micro_batch) const {
    return config_.train.micro_batch * config_.train.grad_accum / micro_batch;
  }

 private:
  struct Request {
    int micro_batch = 0;  // 0: none
    std::string plugin, reason;
  };
  void release_buffers();
  // The micro-batch from the next micro-step 1 on: logged with who asked and why.
  void change_micro_batch(const Request& r);
  // A new attempt of the step begins: its memory is measured from here.
  void begin_attempt();
  // The micro-batches a step can run at: divisors of [train] micro_batch.
  void check_micro_batch(int micro_batch) const;

  const Config& config_;
  Device& device_;
  DataLoader& loader_;
  StepState& state_;
  std::string fixed_;
  std::ostream* log_;
  int rank_;
  Buffer inputs_, targets_;
  std::unique_ptr<HostStaging> staging_;
  int slot_ = 0;
  Batch batch_;
  // The configured micro-batches of the current step read so far, inputs then targets, each
  // 2·B·T tokens: a restarted step reads the same sequences again.
  std::vector<std::vector<int32_t>> step_data_;
  int step_data_read_ = 0;
  // Asked from the OOM hooks for the failed micro-step; a micro-batch asked for the next step.
  bool retry_requested_ = false;
  Request restart_, next_;
  std::string changed_by_;  // the plugin that last changed the micro-batch, for the OOM report
};

}  // namespace headroom
