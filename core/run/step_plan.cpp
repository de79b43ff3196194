#include "core/run/step_plan.h"

#include <cstring>
#include <stdexcept>
#include <utility>

#include "kernels/common/dropout.h"

namespace headroom {

StepPlan::StepPlan(const Config& config, Device& device, DataLoader& loader, StepState& state,
                   int rank, std::ostream* log)
    : config_(config), device_(device), loader_(loader), state_(state), log_(log), rank_(rank) {
  state_.micro_batch = config_.train.micro_batch;
  state_.grad_accum = config_.train.grad_accum;
}

StepPlan::BufferLease StepPlan::allocate_buffers() {
  const int B = config_.train.micro_batch, T = config_.model.seq_len;
  const uint64_t batch_bytes = uint64_t(B) * T * sizeof(int32_t);
  // The configured micro-batch's size: a smaller one (headroom.batch/1) uses the first rows.
  inputs_ = Buffer(device_, batch_bytes, Category::kData, "inputs (B, T)");
  targets_ = Buffer(device_, batch_bytes, Category::kData, "targets (B, T)");
  staging_ =
      std::make_unique<HostStaging>(device_.backend(), Backend::kUploadSlots * 2 * batch_bytes);
  batch_.tokens = inputs_.as<int32_t>();
  batch_.targets = targets_.as<int32_t>();
  batch_.host_targets = staging_targets(0);
  batch_.B = B;
  batch_.T = T;
  return BufferLease(*this);
}

void StepPlan::release_buffers() {
  // The reverse of their allocation.
  staging_.reset();
  targets_.reset();
  inputs_.reset();
}

int32_t* StepPlan::staging_inputs(int slot) const {
  const uint64_t BT = uint64_t(config_.train.micro_batch) * config_.model.seq_len;
  return static_cast<int32_t*>(staging_->get()) + uint64_t(slot) * 2 * BT;
}

int32_t* StepPlan::staging_targets(int slot) const {
  return staging_inputs(slot) + uint64_t(config_.train.micro_batch) * config_.model.seq_len;
}

Batch StepPlan::validation_batch() const {
  Batch b = batch_;
  b.host_targets = staging_targets(0);
  b.B = state_.micro_batch;
  return b;
}

void StepPlan::begin_step() {
  if (next_.micro_batch) change_micro_batch(next_);
  next_ = Request{};
  state_.grad_accum = micro_steps_at(state_.micro_batch);
  step_data_read_ = 0;
  state_.restarts = 0;
  begin_attempt();
}

const Batch& StepPlan::upload_micro_batch() {
  Backend& ops = device_.backend();
  // This slot's uploads of two micro-steps ago have read it (the one before may still be running
  // on the device: its slot is the other one).
  slot_ = (slot_ + 1) % Backend::kUploadSlots;
  ops.wait_uploads(slot_);
  // Configured micro-batch c (of B sequences, as the loader reads them) is cut into B / b slices
  // of b consecutive rows, b the micro-batch the step runs at: micro-steps c·(B/b)+1 ..
  // (c+1)·(B/b) read them in order, as a run configured with micro_batch b would.
  const int configured_B = config_.train.micro_batch, b = state_.micro_batch;
  const int T = config_.model.seq_len;
  const size_t BT = size_t(configured_B) * T;
  const int slices = configured_B / b;
  const int c = (state_.micro_step - 1) / slices;
  const size_t at = size_t((state_.micro_step - 1) % slices) * size_t(b) * T;
  for (; step_data_read_ <= c; ++step_data_read_) {
    if (step_data_.size() <= size_t(step_data_read_)) step_data_.emplace_back(2 * BT);
    int32_t* d = step_data_[size_t(step_data_read_)].data();
    state_.data_wait_ms += loader_.next(d, d + BT);
  }
  const int32_t* d = step_data_[size_t(c)].data();
  const size_t n = size_t(b) * T;
  std::memcpy(staging_inputs(slot_), d + at, n * sizeof(int32_t));
  std::memcpy(staging_targets(slot_), d + BT + at, n * sizeof(int32_t));
  ops.upload(inputs_.as<void>(), staging_inputs(slot_), n * sizeof(int32_t));
  ops.upload(targets_.as<void>(), staging_targets(slot_), n * sizeof(int32_t));
  ops.mark_uploads(slot_);
  batch_.host_targets = staging_targets(slot_);  // the model reads the targets on the host too
  batch_.B = b;
  // The step's loss is the mean over all its tokens, times the loss scale a plugin (amp fp16) set
  // for this step.
  const uint64_t tokens_per_step = uint64_t(configured_B) * T * uint64_t(config_.train.grad_accum);
  batch_.dloss = state_.loss_scale / double(tokens_per_step);
  // Dropout's draws (LoRA's): the run's seed, the step, the micro-step and the rank, so that a
  // resumed run draws what the unbroken one drew.
  batch_.dropout_seed =
      dropout_mix(dropout_mix(config_.train.seed ^ 0x64726f706f7574ull) + uint64_t(state_.step)) ^
      dropout_mix((uint64_t(state_.micro_step) << 20) + uint64_t(rank_));
  if (batch_.dropout_seed == 0) batch_.dropout_seed = 1;  // 0 draws nothing
  // What the OOM hooks may ask in this micro-step starts unasked.
  retry_requested_ = false;
  restart_ = Request{};
  return batch_;
}

void StepPlan::begin_attempt() {
  state_.attempt_start_bytes = state_.attempt_peak_bytes = device_.tracker().live_total();
}

void StepPlan::recover(const OutOfMemory& e, Gpt<float>& model) {
  // What the OOM hooks asked for; the next attempt starts with no request.
  const bool retry = retry_requested_;
  const Request restart = std::move(restart_);
  retry_requested_ = false;
  restart_ = Request{};
  const bool backward_begun = state_.phase == StepState::Phase::kBackward;
  state_.losses.micro_known = false;
  // The abandoned attempt's workspace went with the unwinding; its activations and the
  // per-layer compute gradients of a half-done backward (amp) go now, whoever asked.
  model.release_micro_step();
  constexpr int kMaxAttempts = 16;  // a plugin that asks forever does not loop forever
  const bool asked = retry || restart.micro_batch > 0;
  // The same micro-step again: the plugin freed memory, and no gradient was touched yet.
  if (asked && !restart.micro_batch && !backward_begun && state_.restarts < kMaxAttempts) {
    ++state_.restarts;
    --state_.micro_step;
    return;
  }
  // Otherwise the whole step from its first micro-step, where steps can restart.
  if (!asked || state_.restarts >= kMaxAttempts || !fixed_.empty()) {
    if (changed_by_.empty()) throw;  // called from the handler: the failure as it was
    OomReport r = e.report();
    r.note =
        "micro_batch: step " + std::to_string(state_.step) + " ran at micro_batch " +
        std::to_string(state_.micro_batch) + " x grad_accum " + std::to_string(state_.grad_accum) +
        " (configured " + std::to_string(config_.train.micro_batch) + " x " +
        std::to_string(config_.train.grad_accum) + "), as plugin '" + changed_by_ + "' set it" +
        (state_.micro_batch == 1 ? "; it reached micro_batch 1, the smallest there is" : "") +
        (state_.restarts >= kMaxAttempts
             ? "; the step was restarted " + std::to_string(state_.restarts) + " times"
             : "");
    throw OutOfMemory(std::move(r));
  }
  ++state_.restarts;
  model.zero_grad();  // the abandoned attempt's gradients are discarded
  state_.losses = StepState::Losses{};
  const std::string why = restart.micro_batch ? restart.plugin + "': " + restart.reason
                                              : "request_retry after the backward began";
  if (log_)
    *log_ << "step " << state_.step << ": out of memory in micro-step " << state_.micro_step
          << " of " << state_.grad_accum << " (" << e.report().phase.str() << ", "
          << format_bytes(e.report().requested) << " requested): the step restarts"
          << (restart.micro_batch ? " (plugin '" : " (") << why << ")\n"
          << std::flush;
  if (restart.micro_batch) change_micro_batch(restart);
  state_.micro_step = 0;  // the loop goes on with micro-step 1
  begin_attempt();
}

void StepPlan::change_micro_batch(const Request& r) {
  if (r.micro_batch == state_.micro_batch) return;
  const int before = state_.micro_batch, accum_before = state_.grad_accum;
  state_.micro_batch = r.micro_batch;
  state_.grad_accum = micro_steps_at(r.micro_batch);
  changed_by_ = r.plugin;
  if (log_)
    *log_ << "step " << state_.step << ": micro_batch " << before << " x grad_accum "
          << accum_before << " -> " << state_.micro_batch << " x " << state_.grad_accum
          << " (plugin '" << r.plugin << "': " << r.reason << ")\n"
          << std::flush;
}

void StepPlan::check_micro_batch(int micro_batch) const {
  if (!fixed_.empty())
    throw std::logic_error("the micro-batch changes on one rank without a zero plugin so far (" +
                           fixed_ + ")");
  if (micro_batch < 1 || config_.train.micro_batch % micro_batch != 0)
    throw std::invalid_argument("micro_batch " + std::to_string(micro_batch) +
                                " does not divide [train] micro_batch " +
                                std::to_string(config_.train.micro_batch));
}

void StepPlan::restart_step(const std::string& plugin, int micro_batch, const std::string& reason) {
  check_micro_batch(micro_batch);
  if (state_.micro_batch < micro_batch)
    throw std::invalid_argument("micro_batch " + std::to_string(micro_batch) +
                                " is above the step's " + std::to_string(state_.micro_batch));
  if (state_.micro_step == 0)
    throw std::logic_error("the allocation did not fail in a micro-step; the OOM stands");
  restart_ = Request{micro_batch, plugin, reason};
}

void StepPlan::set_micro_batch(const std::string& plugin, int micro_batch,
                               const std::string& reason) {
  check_micro_batch(micro_batch);
  next_ = Request{micro_batch, plugin, reason};
}

}  // namespace headroom
