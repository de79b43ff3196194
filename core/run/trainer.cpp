#include "core/run/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/model/safetensors.h"
#include "core/report/timeline_html.h"
#include "core/run/rank_agreement.h"
#include "core/run/snapshot.h"

namespace headroom {

namespace {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// "0.0123", "1e+30", and "nan" / "inf" without the sign printf may give a NaN.
std::string format_number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// FILE.html -> FILE.rankN.html; FILE -> FILE.rankN: each rank's own copy of a per-rank output.
std::string rank_output_path(const std::string& path, int rank) {
  const std::filesystem::path p(path);
  const std::string ext = p.extension().string();
  const std::string tag = ".rank" + std::to_string(rank);
  if (ext.empty() || p.stem().empty()) return path + tag;
  return path.substr(0, path.size() - ext.size()) + tag + ext;
}

}  // namespace

MasterAccess Trainer::masters(bool gather, bool scatter) {
  // Sharded masters are gathered; a model without masters makes them from its bf16 weights.
  return sharding_ ? sharding_->master_access(gather, scatter)
                   : model_->master_access(gather, scatter);
}

Trainer::Trainer(const Config& config, TrainOptions options)
    : config_(config), options_(std::move(options)) {
  // The ranks come from the launcher (mpirun, srun); a process started alone is rank 0 of 1.
  const RankInfo& ranks = rank_info();
  const bool ranked = ranks.world_size > 1;
  // Every rank takes part in gathering the weights (zero3), rank 0 alone writes them.
  save_weights_ = !options_.save_weights_path.empty();
  if (ranked) {
    // Each rank's own memory picture and trace; rank 0 alone writes the metrics and the weights.
    if (!options_.memory_timeline_path.empty())
      options_.memory_timeline_path = rank_output_path(options_.memory_timeline_path, ranks.rank);
    if (!options_.record_allocs_path.empty())
      options_.record_allocs_path = rank_output_path(options_.record_allocs_path, ranks.rank);
    if (ranks.rank != 0) {
      options_.metrics_path.clear();
      options_.save_weights_path.clear();
    }
  }
  // A GPU rank takes the device of its local rank unless [device] index names one.
  if (config_.device.kind == "cuda" && ranks.launched && !config_.device.index_set)
    config_.device.index = ranks.local_rank;
  // Every output is checked before any work is done: a run must not train for hours and then find
  // it cannot write its weights.
  const std::pair<const std::string*, const char*> outputs[] = {
      {&options_.metrics_path, "--metrics"},
      {&options_.save_weights_path, "--save-weights"},
      {&options_.record_allocs_path, "--record-allocs"},
      {&options_.memory_timeline_path, "--memory-timeline"}};
  for (const auto& [path, flag] : outputs)
    if (!path->empty()) check_output_path(*path, flag);
  if (config_.snapshot.every > 0) make_output_dir(config_.snapshot.dir, "snapshot.dir");
  // One run per output (core/os/output_file.h OutputLock), held until this trainer is gone; the
  // snapshot folder, which every rank shares, by rank 0.
  for (const auto& [path, flag] : outputs)
    if (!path->empty()) output_locks_.emplace_back(*path, flag);
  if (config_.snapshot.every > 0 && ranks.rank == 0)
    output_locks_.emplace_back(config_.snapshot.dir, "snapshot.dir");
  if (!options_.resume_dir.empty() && !std::filesystem::is_directory(options_.resume_dir))
    throw ConfigError("--resume " + options_.resume_dir + ": not a folder of snapshots");

  // Members are torn down in reverse order if any step below throws: the registration (the last
  // member) first, so the device stops calling back before the model's buffers are freed.
  device_ = Device::create(config_.device);
  if (options_.dry) device_->set_dry(true);  // before any op: everything holds the dry table
  if (!options_.record_allocs_path.empty()) {
    recorder_ = std::make_unique<AllocTraceRecorder>(options_.record_allocs_path, *device_,
                                                     device_->memory_limit());
    device_->add_observer(recorder_.get());  // outlives the device: sees every free
  }
  observing_.attach(*device_, this);
  set_phase(Phase::Kind::kSetup);
  micro_batch_ = config_.train.micro_batch;
  comm_ = make_communicator(*device_, config_.distributed);
  // Every rank runs the same run (core/run/rank_agreement.h): the first collective after it.
  check_ranks_agree(
      agreement_items(config_, {{"--resume", options_.resume_dir.empty() ? "no" : "yes"},
                                {"--save-weights", save_weights_ ? "yes" : "no"}}),
      *comm_);
  data_ = options_.data_source
              ? std::move(options_.data_source)
              : make_data_source(config_.data, config_.model, config_.train.micro_batch,
                                 config_.model.seq_len, comm_->rank(), comm_->world_size());
  loader_ = std::make_unique<DataLoader>(*data_, config_.data.workers, config_.data.prefetch,
                                         config_.train.micro_batch, config_.model.seq_len);
  if (config_.train.eval_every > 0) {
    val_data_ = make_validation_source(config_.data, config_.model, config_.train.micro_batch,
                                       config_.model.seq_len, comm_->rank(), comm_->world_size());
    if (!val_data_)
      throw ConfigError(config_.train.eval_every_pos.str() +
                        ": train.eval_every needs validation data: set data.val_path, "
                        "data.val_pattern or data.val_fraction");
    val_start_ = val_data_->state();
  }
  // Plugins come before anything allocates: an allocator-role plugin serves every buffer.
  plugins_ = std::make_unique<PluginHost>(config_);
  plugins_->create(*this);
  add_listener(plugins_.get());
  // amp's state layouts other than its default are one rank's, unsharded, so far: the gradient
  // buckets, the shards and their resharding hold f32 masters and gradients.
  const bool layout = precision_.grad_in_compute || !precision_.masters;
  if (layout && (ranked || shard_what_))
    throw ConfigError("plugin '" + precision_by_ + "': " +
                      (precision_.masters ? "grad_dtype = \"bf16\"" : "master_weights = false") +
                      " runs on one rank without a zero plugin so far (this run has " +
                      std::to_string(ranks.world_size) + " rank(s)" +
                      (shard_what_ ? " and shards with '" + shard_plugin_ + "'" : "") +
                      "); use grad_dtype = \"fp32\" and master_weights = true there");
  // The validation forward reads every layer whole; sharded parameters are gathered only around
  // the training passes, by the plugin's schedule.
  if (val_data_ && (shard_what_ & kShardParameters))
    throw ConfigError(config_.train.eval_every_pos.str() + ": train.eval_every: plugin '" +
                      shard_plugin_ +
                      "' shards the parameters, which validation cannot read yet; use zero1 or "
                      "zero2, or set eval_every = 0");
  optimizer_ = plugins_->provides_optimizer()
                   ? plugins_->make_optimizer()
                   : make_optimizer(config_.train, *device_, precision_.state);
  if (!options_.metrics_path.empty())
    metrics_ = std::make_unique<AppendFile>(options_.metrics_path, "--metrics");
  try {
    // In the compute dtype a plugin asked for while it was created (amp), else fp32.
    // Sharded (a zero plugin partitioned while it was created): every layer's buffers padded to
    // a multiple of the ranks.
    // Sharded parameters (zero3): each layer is cut to its shard as soon as it is initialised.
    // A pruned model (headroom.resize/1) is built at its widths before anything loads into it:
    // the snapshot's it resumes from, or the weights file it starts from.
    adopt_mlp_widths();
    std::function<void(Layer<float>&)> placed;
    if (shard_what_) {
      sharding_ = std::make_unique<Sharding>(*device_, *comm_, shard_what_, shard_persist_below_);
      placed = [this](Layer<float>& layer) { sharding_->place(layer); };
    }
    model_ = std::make_unique<Gpt<float>>(config_.model, *device_, config_.train.seed, precision_,
                                          shard_what_ ? uint64_t(comm_->world_size()) : 1,
                                          (shard_what_ & kShardGradients) != 0, placed);
    build_buckets();
    if (sharding_) {
      sharding_->attach(*model_);
      segments_ = sharding_->segments();
    } else {
      segments_ = whole_params(model_->params());
    }
  } catch (const OutOfMemory& e) {
    close_outputs(&e.report());
    throw;
  }
  if (!config_.train.init_from.empty()) {
    try {
      load_safetensors(config_.train.init_from, *model_, masters(false, true));
    } catch (const ConfigError& e) {
      throw ConfigError(config_.train.init_from_pos.str() + ": train.init_from: " + e.what());
    }
    if (options_.log && root())
      *options_.log << "init_from: loaded " << model_->params().size() << " tensors ("
                    << model_->num_params() << " parameters) from " << config_.train.init_from
                    << "\n";
  }
}

Trainer::~Trainer() {
  // A collective that could not finish (a peer failed, this rank ran out of memory) is abandoned
  // to the communicator, which progresses it while it goes: every buffer it touches — the
  // model's, the buckets', an allocator plugin's memory under them — must outlive the
  // communicator. So the requests go first (they name it; Sharding keeps its own buffers of an
  // abandoned one), then the communicator, then everything else in member order. The device
  // stops telling this trainer of frees first, as the default order of the members would.
  observing_.detach();
  sharding_.reset();
  for (Bucket& b : buckets_)
    b.request = CommRequest();
  comm_.reset();
}

// ---------------------------------------------------------------------------------------------
// The loop. docs/design.md ("The loop and its events") draws every event it fires, in order, and
// the ways out before the last step: a stop request (seen after each micro-step and between steps;
// a half step is dropped) and a non-finite loss or gradient norm that no plugin vetoed.

void Trainer::run() {
  // The one place a failing rank tells the others why it leaves (before writing its outputs, so
  // that they stop waiting now): out of memory, or any other error but another rank's failure
  // (which they have heard of already) and a stop request (which every rank gets from the
  // launcher). A divergence is global: every rank sees the same averaged loss and norm.
  try {
    run_steps();
  } catch (const OutOfMemory& e) {
    comm_->announce_failure("ran out of memory");
    close_outputs(&e.report());
    throw;
  } catch (const Interrupted&) {
    close_outputs(nullptr);
    throw;
  } catch (const Diverged&) {
    close_outputs(nullptr);
    throw;
  } catch (const CommError&) {
    try {
      close_outputs(nullptr);
    } catch (const std::exception&) {
    }
    throw;
  } catch (const std::exception& e) {
    comm_->announce_failure(std::string("failed: ") + e.what());
    try {
      close_outputs(nullptr);
    } catch (const std::exception&) {
    }
    throw;
  } catch (...) {
    // A plugin hook or an output failed: the rest is still written as far as it can be, and the
    // first error is the one reported.
    try {
      close_outputs(nullptr);
    } catch (const std::exception&) {
    }
    throw;
  }
  close_outputs(nullptr);
}

void Trainer::close_outputs(const OomReport* oom) {
  try {
    write_memory_timeline(oom);
    if (metrics_) metrics_->close();
    if (recorder_) recorder_->close();
  } catch (const std::exception&) {
    if (!oom) throw;
    // Out of memory: that report matters more than a picture or a trace that could not be
    // written (a trace without its end record is refused when read).
  }
}

void Trainer::write_memory_timeline(const OomReport* oom) {
  if (options_.memory_timeline_path.empty()) return;
  TimelineHtmlOptions o;
  o.title = config_.file;
  o.memory_limit = device_->memory_limit();
  o.oom = oom;
  o.detail_step = options_.memory_timeline_step;
  write_timeline_html(options_.memory_timeline_path, device_->tracker().timeline(), o);
}

void Trainer::run_steps() {
  const TrainConfig& t = config_.train;
  const int B = t.micro_batch, T = config_.model.seq_len, A = t.grad_accum;
  const uint64_t tokens_per_step = uint64_t(B) * T * A;

  // A resumed run's state (plugins' included) is in place before TRAIN_BEGIN.
  first_step_ = options_.resume_dir.empty() ? 1 : resume() + 1;
  const bool snapshots = config_.snapshot.every > 0;
  fire(Event::kTrainBegin);
  set_phase(Phase::Kind::kData);
  const uint64_t batch_bytes = uint64_t(B) * T * sizeof(int32_t);
  // The configured micro-batch's size: a smaller one (headroom.batch/1) uses the first rows.
  Buffer inputs(*device_, batch_bytes, Category::kData, "inputs (B, T)");
  Buffer targets(*device_, batch_bytes, Category::kData, "targets (B, T)");
  // The loader fills host staging buffers (page-locked on CUDA), uploaded on the copy stream.
  // Double-buffered: micro-steps take the slots in turn, and a slot is refilled once its last
  // uploads have read it (Backend::wait_uploads), not after a synchronize of all the work.
  Backend& ops = device_->backend();
  constexpr int kSlots = Backend::kUploadSlots;
  HostStaging staging(ops, kSlots * 2 * batch_bytes);
  auto slot_inputs = [&](int slot) {
    return static_cast<int32_t*>(staging.get()) + uint64_t(slot) * 2 * uint64_t(B) * T;
  };
  auto slot_targets = [&](int slot) { return slot_inputs(slot) + uint64_t(B) * T; };
  int slot = 0;
  // Slot 0 serves the validation too (evaluate() synchronizes around it).
  int32_t* host_inputs = slot_inputs(0);
  int32_t* host_targets = slot_targets(0);
  Batch batch;
  batch.tokens = inputs.as<int32_t>();
  batch.targets = targets.as<int32_t>();
  batch.host_targets = host_targets;
  batch.B = B;
  batch.T = T;
  const std::vector<Param<float>*> params = model_->params();

  run_start_ms_ = now_ms();
  for (step_ = first_step_; step_ <= t.steps; ++step_) {
    // A safe point: the previous step is complete (and snapshotted, if its turn came).
    if (const int sig = stop_signal()) stop_interrupted(sig, false);
    if (snapshots) {
      step_start_data_ = loader_->state();
      step_start_plugins_ = plugins_->save_states();
    }
    const double t0 = now_ms();
    const uint64_t syncs0 = ops.host_syncs();
    StepRecord r;
    micro_step_ = 0;
    veto_ = false;
    cur_ = StepProgress{};
    cur_.lr = learning_rate(t, step_ - 1);
    fire(Event::kStepBegin);
    model_->zero_grad();
    if (sharding_) sharding_->begin_step();
    // The step's loss is the mean over all its tokens, times the loss scale a plugin (amp fp16)
    // set for this step.
    batch.dloss = loss_scale_ / double(tokens_per_step);
    r.loss_scale = loss_scale_;
    cur_.loss_scale = loss_scale_;
    cur_.loss_scale_set = true;
    double data_wait_ms = 0.0, comm_wait_ms = 0.0;
    // The step's B·A sequences in micro-batches of micro_batch_ (a plugin may have chosen it
    // by now), read from the loader once and kept: a restart runs the same ones again.
    if (next_batch_.micro_batch)
      change_micro_batch(next_batch_.micro_batch, next_batch_.plugin, next_batch_.reason);
    next_batch_ = BatchRequest{};
    step_data_read_ = 0;
    restarts_ = 0;
    begin_attempt();
    for (micro_step_ = 1; micro_step_ <= grad_accum(); ++micro_step_) {
      try {
        set_phase(Phase::Kind::kData);
        // This slot's uploads of two micro-steps ago have read it (the one before may still be
        // running on the device: its slot is the other one).
        slot = (slot + 1) % kSlots;
        ops.wait_uploads(slot);
        data_wait_ms += fetch_micro_batch(slot_inputs(slot), slot_targets(slot));
        const uint64_t bytes = uint64_t(micro_batch_) * T * sizeof(int32_t);
        ops.upload(inputs.as<void>(), slot_inputs(slot), bytes);
        ops.upload(targets.as<void>(), slot_targets(slot), bytes);
        ops.mark_uploads(slot);
        batch.host_targets = slot_targets(slot);  // the model reads the targets on the host too
        batch.B = micro_batch_;
        if (sharding_) sharding_->begin_micro_step(micro_step_, grad_accum());
        micro_step(batch);
        // What a zero plugin started in this micro-step's backward is done before the next one
        // touches the gradients (or GRADS_READY reads them).
        if (sharding_) sharding_->wait();
        // Buckets not launched from a BACKWARD_END (overlap = false) start here.
        if (micro_step_ == grad_accum()) {
          const double c0 = now_ms();
          launch_buckets(-1);
          comm_wait_ms = now_ms() - c0;
        }
      } catch (const OutOfMemory& e) {
        recover(e);  // rethrows unless this micro-step, or the step, runs again
        continue;
      }
      cur_.add_micro_step();
      // A safe point. After the last micro-step the step is all but done: finish it instead.
      if (const int sig = stop_signal(); sig && micro_step_ < grad_accum())
        stop_interrupted(sig, true);
    }
    micro_step_ = 0;
    const double c0 = now_ms();
    finish_buckets();
    comm_wait_ms += now_ms() - c0;
    if (sharding_) sharding_->check_reduced(shard_plugin_);
    fire(Event::kGradsReady);
    r.step = step_;
    r.micro_batch = micro_batch_;
    r.grad_accum = grad_accum();
    r.restarts = restarts_;
    r.loss = cur_.step_loss();
    // The metrics' loss: the mean over ranks (every rank reads as many tokens).
    if (comm_->world_size() > 1) comm_->all_reduce_host(&r.loss, 1, ReduceOp::kAverage);
    // Sharded: each rank holds its ranges of the gradients, so their squares are summed over the
    // ranks.
    r.grad_norm =
        std::sqrt(sharding_ ? sharding_->grad_sum_squares() : grad_sum_squares(ops, segments_));
    // With nothing that could read the clipped gradients (no listener, no plugin hook from
    // OPTIMIZER_STEP until the next step zeroes them, no optimizer role, no sharding), the
    // built-in optimizers fold clipping into the update as a scale: no pass of its own. amp
    // (GRADS_READY: before clipping) and checkpoint leave it folded. Otherwise the gradients are
    // clipped in place, as whatever reads them at OPTIMIZER_STEP or later expects.
    const float clip = clip_factor(r.grad_norm, t.grad_clip);
    constexpr uint64_t kSeesClippedGrads =
        HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
        HR_EVENT_BIT(HR_EVENT_STEP_BEGIN) | HR_EVENT_BIT(HR_EVENT_TRAIN_END) |
        HR_EVENT_BIT(HR_EVENT_ALLOC) | HR_EVENT_BIT(HR_EVENT_FREE) | HR_EVENT_BIT(HR_EVENT_OOM);
    // (The plugin host is always a listener: the others are what an embedder added.)
    const bool listened = std::any_of(listeners_.begin(), listeners_.end(),
                                      [&](EventListener* l) { return l != plugins_.get(); });
    const bool observed = listened || sharding_ || plugins_->provides_optimizer() ||
                          (plugins_->subscribed_events() & kSeesClippedGrads) != 0;
    if (observed || !optimizer_->fold_grad_scale(clip))
      clip_grads(ops, segments_, r.grad_norm, t.grad_clip);
    r.lr = cur_.lr;
    cur_.grad_norm = r.grad_norm;
    // What clip_grad_norm multiplied the gradients by (optim.h), for headroom.step/1.
    cur_.clip_coef = double(clip_factor(r.grad_norm, t.grad_clip));
    // A plugin that handles non-finite steps (amp's loss scaler) has vetoed this one by now; one
    // that nothing handled would poison the weights, so the run stops before the update.
    if (!veto_ && !(std::isfinite(r.loss) && std::isfinite(r.grad_norm))) {
      r.step_ms = now_ms() - t0;
      history_.push_back(r);
      log_step(r);
      set_phase(Phase::Kind::kDone);
      fire(Event::kTrainEnd);
      std::string msg = "training diverged at step " + std::to_string(step_) + ": the loss is " +
                        format_number(r.loss) + " and the gradient norm " +
                        format_number(r.grad_norm) +
                        ", and no plugin skipped the step. The update was not applied; ";
      msg += snapshot_path_.empty() ? "no snapshot was written ([snapshot] every = " +
                                          std::to_string(config_.snapshot.every) + ")"
                                    : "the last good snapshot is " + snapshot_path_ + " (step " +
                                          std::to_string(snapshot_step_) + ")";
      msg += ". Lower train.lr (now " + format_number(t.lr) + ")" +
             (t.grad_clip > 0 ? "" : " or turn on train.grad_clip") + ", then resume or restart";
      throw Diverged(msg);
    }
    set_phase(Phase::Kind::kOptimizer);
    cur_.norm_known = true;  // headroom.step/1: grad_norm and clip_coef from OPTIMIZER_STEP on
    // A veto from any event up to and including OPTIMIZER_STEP skips the update.
    if (!veto_) fire(Event::kOptimizerStep);
    if (!veto_) {
      optimizer_->step(segments_, r.lr, step_);
      if (sharding_) {
        sharding_->updated();  // each rank updated its ranges: the plugin gathers them
      } else {
        model_->sync_compute_params();  // the compute copies (amp) follow the updated masters
      }
    }
    r.skipped = veto_;
    if (veto_) ++skipped_steps_;
    fire(Event::kStepEnd);
    if (sharding_) {
      sharding_->wait();
      sharding_->check_step_end(shard_plugin_);
    }
    r.host_syncs = ops.host_syncs() - syncs0;  // the validation below not counted
    if (val_data_ && (step_ % t.eval_every == 0 || step_ == t.steps)) {
      ops.synchronize();  // the last micro-step is done with the batch buffers
      batch.host_targets = host_targets;
      const std::optional<double> val = evaluate(batch, host_inputs, host_targets);
      r.evaluated = val.has_value();  // a stop request ends it between batches, uncounted
      if (val) r.val_loss = *val;
      if (val && (best_val_step_ == 0 || r.val_loss < best_val_loss_)) {
        best_val_loss_ = r.val_loss;
        best_val_step_ = step_;
      }
    }
    r.data_wait_ms = data_wait_ms;
    r.comm_wait_ms = comm_wait_ms;
    r.step_ms = now_ms() - t0;
    r.tokens_per_s = double(tokens_per_step) / (r.step_ms / 1000.0);
    history_.push_back(r);
    log_step(r);
    if (recorder_) recorder_->flush();  // a full disk stops the run now, not at its end
    if (snapshots && step_ % config_.snapshot.every == 0)
      write_snapshot(step_, loader_->state(), plugins_->save_states());
  }
  step_ = t.steps;
  set_phase(Phase::Kind::kDone);
  fire(Event::kTrainEnd);
  if (save_weights_) {
    // Read on every rank (sharded masters are gathered layer by layer), written by rank 0.
    const bool writes = !options_.save_weights_path.empty();
    const auto host = download_params(*model_, masters(true, false), writes);
    if (writes) save_safetensors(options_.save_weights_path, *model_, &host);
  }
}

std::optional<double> Trainer::evaluate(Batch batch, void* host_inputs, void* host_targets) {
  set_phase(Phase::Kind::kEval);
  Backend& ops = device_->backend();
  // The validation data comes in configured micro-batches (the staging buffers' size); each runs
  // in slices of the micro-batch the steps run at now (headroom.batch/1 may have lowered it), so
  // that evaluation needs no more memory than a step.
  const int B = config_.train.micro_batch, T = batch.T;
  const int b = batch.B;
  const size_t BT = size_t(B) * T, bt = size_t(b) * T;
  std::vector<int32_t> rows(2 * BT);
  batch.dloss = 0.0;  // the head's gradient of the loss is not used
  val_data_->restore(val_start_);
  double sum = 0.0;
  uint64_t tokens = 0;
  for (int i = 0; i < config_.train.eval_batches; ++i) {
    // A stop request (of any rank: every rank leaves at the same batch) ends the evaluation here;
    // the step before it is complete, and the loop stops at its next safe point.
    if (const int sig = stop_signal_of_any_rank(*comm_)) {
      if (options_.log && root())
        *options_.log << "validation after step " << step_ << ": stopped by " << signal_name(sig)
                      << " after " << i << " of " << config_.train.eval_batches
                      << " batches; not counted\n"
                      << std::flush;
      return std::nullopt;
    }
    val_data_->next(rows.data(), rows.data() + BT, B, T);
    for (size_t at = 0; at < BT; at += bt) {
      std::memcpy(host_inputs, rows.data() + at, bt * sizeof(int32_t));
      std::memcpy(host_targets, rows.data() + BT + at, bt * sizeof(int32_t));
      ops.upload(const_cast<int32_t*>(batch.tokens), host_inputs, bt * sizeof(int32_t));
      ops.upload(const_cast<int32_t*>(batch.targets), host_targets, bt * sizeof(int32_t));
      const double loss = model_->evaluate(batch);
      const uint64_t n = model_->loss_tokens();
      sum += loss * double(n);
      tokens += n;
      ops.synchronize();  // the next upload overwrites the staging buffers
    }
  }
  double loss = tokens ? sum / double(tokens) : 0.0;
  if (comm_->world_size() > 1) comm_->all_reduce_host(&loss, 1, ReduceOp::kAverage);
  return loss;
}

// ---------------------------------------------------------------------------------------------
// Data parallelism: bucketed, overlapped gradient all-reduce (world size > 1)

void Trainer::build_buckets() {
  // One rank has nothing to reduce; a plugin with the gradient-reduction role (ZeRO) reduces them
  // itself.
  if (comm_->world_size() <= 1 || plugins_->provides_gradient_reduction()) return;
  const auto& layers = model_->layers();
  const uint64_t cap = config_.distributed.bucket_size;
  Bucket cur;
  auto close = [&] {
    if (cur.params.empty()) return;
    buckets_.push_back(std::move(cur));
    cur = Bucket{};
  };
  // Last layer first: the order backward finishes them. A layer's parameters are written only by
  // its own backward, except wte, which the head also writes and which the embedding (layer 0)
  // owns: its gradient is final at layer 0's BACKWARD_END, where its bucket launches.
  for (int l = int(layers.size()) - 1; l >= 0; --l) {
    const auto& ps = layers[size_t(l)]->params();
    for (auto it = ps.rbegin(); it != ps.rend(); ++it) {
      Param<float>* p = it->get();
      cur.params.push_back(p);
      cur.bytes += p->numel * sizeof(float);
      cur.lowest_layer = l;
      if (cur.bytes >= cap) close();
    }
  }
  close();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    b.buffer = Buffer(*device_, b.bytes, Category::kCommunication,
                      "gradient bucket " + std::to_string(i) + " (layers " +
                          std::to_string(b.lowest_layer) + "..)");
  }
}

std::vector<uint64_t> Trainer::bucket_bytes() const {
  std::vector<uint64_t> v;
  for (const Bucket& b : buckets_)
    v.push_back(b.bytes);
  return v;
}

void Trainer::launch_buckets(int layer) {
  if (buckets_.empty()) return;
  Backend& ops = device_->backend();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    if (b.launched || (layer >= 0 && b.lowest_layer != layer)) continue;
    char* at = b.buffer.as<char>();
    for (Param<float>* p : b.params) {
      ops.copy(at, p->gdata(), p->numel * sizeof(float));
      at += p->numel * sizeof(float);
    }
    b.request = comm_->all_reduce(b.buffer.as<void>(), b.bytes / sizeof(float), Dtype::kF32,
                                  ReduceOp::kAverage);
    b.launched = true;
    launch_order_.push_back(i);
    EventInfo info;
    info.event = Event::kBucketLaunch;
    info.layer = b.lowest_layer;
    info.bytes = b.bytes;
    fire(info);
  }
}

void Trainer::finish_buckets() {
  if (buckets_.empty()) return;
  launch_buckets(-1);  // none is left unless a micro-step never ran
  Backend& ops = device_->backend();
  for (size_t i : launch_order_) {
    Bucket& b = buckets_[i];
    b.request.wait();
    const char* at = b.buffer.as<const char>();
    for (Param<float>* p : b.params) {
      ops.copy(p->gdata(), at, p->numel * sizeof(float));
      at += p->numel * sizeof(float);
    }
    b.launched = false;
    EventInfo info;
    info.event = Event::kBucketDone;
    info.layer = b.lowest_layer;
    info.bytes = b.bytes;
    fire(info);
  }
  launch_order_.clear();
}

double Trainer::micro_step(const Batch& batch) {
  backward_begun_ = false;
  retry_requested_ = false;
  restart_ = BatchRequest{};
  model_->forward(batch, this);
  model_->backward(batch, this);  // the head's backward_end records the loss (cur_.micro_*)
  return cur_.micro_loss;
}

double Trainer::fetch_micro_batch(int32_t* host_inputs, int32_t* host_targets) {
  const int B = config_.train.micro_batch, T = config_.model.seq_len;
  const size_t BT = size_t(B) * T;
  // Configured micro-batch c is cut into B / b slices of b consecutive rows: micro-steps
  // c·(B/b)+1 .. (c+1)·(B/b) read them in order, as a run configured with micro_batch b would.
  const int slices = B / micro_batch_;
  const int c = (micro_step_ - 1) / slices;
  const size_t at = size_t((micro_step_ - 1) % slices) * size_t(micro_batch_) * T;
  double wait_ms = 0.0;
  for (; step_data_read_ <= c; ++step_data_read_) {
    if (step_data_.size() <= size_t(step_data_read_)) step_data_.emplace_back(2 * BT);
    int32_t* d = step_data_[size_t(step_data_read_)].data();
    wait_ms += loader_->next(d, d + BT);
  }
  const int32_t* d = step_data_[size_t(c)].data();
  const size_t n = size_t(micro_batch_) * T;
  std::memcpy(host_inputs, d + at, n * sizeof(int32_t));
  std::memcpy(host_targets, d + BT + at, n * sizeof(int32_t));
  return wait_ms;
}

void Trainer::begin_attempt() {
  attempt_start_bytes_ = attempt_peak_bytes_ = device_->tracker().live_total();
}

void Trainer::recover(const OutOfMemory& e) {
  // What the OOM hooks asked for; the next attempt starts with no request.
  const bool retry = retry_requested_;
  const BatchRequest restart = std::move(restart_);
  retry_requested_ = false;
  restart_ = BatchRequest{};
  cur_.micro_known = false;
  // The abandoned attempt's workspace went with the unwinding; its activations and the
  // per-layer compute gradients of a half-done backward (amp) go now, whoever asked.
  model_->release_micro_step();
  constexpr int kMaxAttempts = 16;  // a plugin that asks forever does not loop forever
  const bool asked = retry || restart.micro_batch > 0;
  // The same micro-step again: the plugin freed memory, and no gradient was touched yet.
  if (asked && !restart.micro_batch && !backward_begun_ && restarts_ < kMaxAttempts) {
    ++restarts_;
    --micro_step_;
    return;
  }
  // Otherwise the whole step from its first micro-step (one rank, nothing sharded: the ranks
  // would have to agree on it).
  if (!asked || restarts_ >= kMaxAttempts || sharding_ || comm_->world_size() > 1) {
    if (batch_by_.empty()) throw;
    OomReport r = e.report();
    r.note = "micro_batch: step " + std::to_string(step_) + " ran at micro_batch " +
             std::to_string(micro_batch_) + " x grad_accum " + std::to_string(grad_accum()) +
             " (configured " + std::to_string(config_.train.micro_batch) + " x " +
             std::to_string(config_.train.grad_accum) + "), as plugin '" + batch_by_ + "' set it" +
             (micro_batch_ == 1 ? "; it reached micro_batch 1, the smallest there is" : "") +
             (restarts_ >= kMaxAttempts
                  ? "; the step was restarted " + std::to_string(restarts_) + " times"
                  : "");
    throw OutOfMemory(std::move(r));
  }
  ++restarts_;
  model_->zero_grad();  // the abandoned attempt's gradients are discarded
  const double lr = cur_.lr, scale = cur_.loss_scale;
  cur_ = StepProgress{};
  cur_.lr = lr;
  cur_.loss_scale = scale;
  cur_.loss_scale_set = true;
  const std::string why = restart.micro_batch ? restart.plugin + "': " + restart.reason
                                              : "request_retry after the backward began";
  if (options_.log && root())
    *options_.log << "step " << step_ << ": out of memory in micro-step " << micro_step_ << " of "
                  << grad_accum() << " (" << e.report().phase.str() << ", "
                  << format_bytes(e.report().requested) << " requested): the step restarts"
                  << (restart.micro_batch ? " (plugin '" : " (") << why << ")\n"
                  << std::flush;
  if (restart.micro_batch) change_micro_batch(restart.micro_batch, restart.plugin, restart.reason);
  micro_step_ = 0;  // the loop goes on with micro-step 1
  begin_attempt();
}

void Trainer::change_micro_batch(int micro_batch, const std::string& plugin,
                                 const std::string& reason) {
  if (micro_batch == micro_batch_) return;
  const int before = micro_batch_, accum_before = grad_accum();
  micro_batch_ = micro_batch;
  batch_by_ = plugin;
  if (options_.log && root())
    *options_.log << "step " << step_ << ": micro_batch " << before << " x grad_accum "
                  << accum_before << " -> " << micro_batch_ << " x " << grad_accum() << " (plugin '"
                  << plugin << "': " << reason << ")\n"
                  << std::flush;
}

BatchState Trainer::batch_state() const {
  BatchState b;
  b.configured_micro_batch = config_.train.micro_batch;
  b.configured_grad_accum = config_.train.grad_accum;
  b.micro_batch = next_batch_.micro_batch ? next_batch_.micro_batch : micro_batch_;
  b.grad_accum = b.configured_micro_batch * b.configured_grad_accum / b.micro_batch;
  b.restarts = restarts_;
  b.memory_limit = device_->memory_limit();
  b.attempt_start_bytes = attempt_start_bytes_;
  b.attempt_peak_bytes = attempt_peak_bytes_;
  return b;
}

namespace {

// The micro-batches a step can run at: divisors of [train] micro_batch; one rank, nothing
// sharded.
void check_micro_batch(int micro_batch, int configured, bool ranked, bool sharded) {
  if (ranked || sharded)
    throw std::logic_error(std::string("the micro-batch changes on one rank without a zero "
                                       "plugin so far (this run ") +
                           (ranked ? "has more than one rank" : "is sharded") + ")");
  if (micro_batch < 1 || configured % micro_batch != 0)
    throw std::invalid_argument("micro_batch " + std::to_string(micro_batch) +
                                " does not divide [train] micro_batch " +
                                std::to_string(configured));
}

}  // namespace

void Trainer::restart_step(const std::string& plugin, int micro_batch, const std::string& reason) {
  check_micro_batch(micro_batch, config_.train.micro_batch, comm_->world_size() > 1,
                    sharding_ != nullptr);
  if (micro_batch_ < micro_batch)
    throw std::invalid_argument("micro_batch " + std::to_string(micro_batch) +
                                " is above the step's " + std::to_string(micro_batch_));
  if (micro_step_ == 0)
    throw std::logic_error("the allocation did not fail in a micro-step; the OOM stands");
  restart_ = BatchRequest{micro_batch, plugin, reason};
}

void Trainer::set_micro_batch(const std::string& plugin, int micro_batch,
                              const std::string& reason) {
  check_micro_batch(micro_batch, config_.train.micro_batch, comm_->world_size() > 1,
                    sharding_ != nullptr);
  next_batch_ = BatchRequest{micro_batch, plugin, reason};
}

// ---------------------------------------------------------------------------------------------

void Trainer::fire(Event event, int layer) {
  EventInfo info;
  info.event = event;
  info.layer = layer;
  fire(info);
}

void Trainer::fire(EventInfo info) {
  info.step = step_;
  info.micro_step = micro_step_;
  if (info.event == Event::kBackwardEnd && cur_.micro_known) {
    info.loss = cur_.micro_loss;
    info.tokens = cur_.micro_tokens;
  } else if (info.event == Event::kGradsReady || info.event == Event::kStepEnd) {
    info.loss = cur_.step_loss();
    info.tokens = cur_.tokens;
  }
  for (EventListener* l : listeners_)
    l->on_event(info);
}

void Trainer::set_phase(Phase::Kind kind, int layer) {
  Phase p;
  p.kind = kind;
  p.layer = layer;
  if (layer >= 0 && model_) p.layer_name = model_->layers()[layer]->name();
  p.step = step_;
  p.micro_step = micro_step_;
  device_->tracker().set_phase(p);
}

void Trainer::forward_begin(int layer) {
  set_phase(Phase::Kind::kForward, layer);
  fire(Event::kForwardBegin, layer);
  if (sharding_)
    sharding_->require_parameters(layer, model_->tied_layer(layer), "forward", shard_plugin_);
}
void Trainer::forward_end(int layer) {
  fire(Event::kForwardEnd, layer);
}
void Trainer::backward_begin(int layer) {
  backward_begun_ = true;
  set_phase(Phase::Kind::kBackward, layer);
  fire(Event::kBackwardBegin, layer);
  // Before a dropped layer's recomputation too: it runs inside the layer's backward.
  if (sharding_)
    sharding_->require_parameters(layer, model_->tied_layer(layer), "backward", shard_plugin_);
}
void Trainer::backward_end(int layer) {
  if (size_t(layer) + 1 == model_->layers().size()) {
    // The head's backward computed the micro-batch's loss (the chunked loss computes its logits
    // there, once). Known from here to the micro-step's end: every BACKWARD_END carries it,
    // headroom.step/1 counts it. On the host already (the head reads its losses back once).
    cur_.micro_loss = model_->loss();
    cur_.micro_tokens = model_->loss_tokens();
    cur_.micro_known = true;
  }
  if (sharding_) sharding_->backward_done(layer);
  fire(Event::kBackwardEnd, layer);
  // The step's last micro-step: the buckets this layer completes start reducing while the layers
  // below run their backward (with compute copies, the model added the layer's gradients into
  // their fp32 masters just before this event).
  if (micro_step_ == grad_accum() && config_.distributed.overlap) {
    launch_buckets(layer);
    // MPI moves a non-blocking collective forward only inside MPI calls: testing the ones in
    // flight at each layer boundary is what lets them run while the layers below compute.
    for (size_t i : launch_order_)
      buckets_[i].request.test();
  }
}

void Trainer::on_alloc(const void* ptr, uint64_t bytes, Category c, const std::string&) {
  attempt_peak_bytes_ = std::max(attempt_peak_bytes_, device_->tracker().live_total());
  EventInfo info;
  info.event = Event::kAlloc;
  info.ptr = ptr;
  info.bytes = bytes;
  info.category = c;
  fire(info);
}

void Trainer::on_free(const void* ptr, uint64_t bytes, Category c) {
  EventInfo info;
  info.event = Event::kFree;
  info.ptr = ptr;
  info.bytes = bytes;
  info.category = c;
  fire(info);
}

void Trainer::on_oom(const OomReport& report) {
  EventInfo info;
  info.event = Event::kOom;
  info.bytes = report.requested;
  info.category = report.category;
  fire(info);
}

double Trainer::StepProgress::step_loss() const {
  if (micro_steps == 0) return 0.0;
  // With the same number of tokens in every micro-step (every target counted), the mean of the
  // micro-steps' means, as the metrics always reported it; else weighted by their tokens.
  if (equal_tokens) return loss_sum / micro_steps;
  return tokens ? weighted_sum / double(tokens) : 0.0;
}

void Trainer::StepProgress::add_micro_step() {
  if (!micro_known) return;
  if (micro_steps > 0 && micro_tokens != first_tokens) equal_tokens = false;
  if (micro_steps == 0) first_tokens = micro_tokens;
  ++micro_steps;
  loss_sum += micro_loss;
  weighted_sum += micro_loss * double(micro_tokens);
  tokens += micro_tokens;
  micro_known = false;
}

RunState Trainer::state() const {
  RunState r;
  r.step = step_;
  r.micro_step = micro_step_;
  r.micro_steps = grad_accum();
  r.lr = cur_.lr;
  r.loss_scale = cur_.loss_scale_set ? cur_.loss_scale : loss_scale_;
  // The micro-steps done, and the current one once the head's backward has computed its loss.
  StepProgress p = cur_;
  p.add_micro_step();
  r.loss = p.step_loss();
  r.tokens = p.tokens;
  r.grad_norm = cur_.norm_known ? cur_.grad_norm : 0.0;
  r.clip_coef = cur_.norm_known ? cur_.clip_coef : 1.0;
  r.skipped = veto_;
  r.precision = precision_;
  return r;
}

void Trainer::veto_step(const std::string& plugin, const std::string& reason) {
  veto_ = true;
  veto_reason_ = plugin + ": " + reason;
}

void Trainer::request_retry(const std::string&, const std::string&) {
  retry_requested_ = true;
}

void Trainer::set_compute_dtype(const std::string& plugin, Dtype dtype) {
  if (model_)
    throw std::logic_error(plugin +
                           ": the compute dtype can only be chosen while the plugin is "
                           "created, before the model is built");
  if (dtype != Dtype::kF32 && dtype != Dtype::kBF16 && dtype != Dtype::kF16)
    throw std::invalid_argument(plugin + ": compute dtype " + dtype_name(dtype) +
                                " is not one of f32, bf16, f16");
  if (precision_.compute != Dtype::kF32 && precision_.compute != dtype)
    throw std::logic_error(plugin + ": the compute dtype is already " +
                           dtype_name(precision_.compute) + " (set by " + compute_dtype_by_ +
                           "); two plugins cannot both choose it");
  precision_.compute = dtype;
  compute_dtype_by_ = plugin;
}

void Trainer::set_precision(const std::string& plugin, const Precision& p) {
  if (model_)
    throw std::logic_error(plugin +
                           ": the model state's layout can only be chosen while the plugin is "
                           "created, before the model is built");
  Precision q = p;
  q.compute = precision_.compute;
  const std::string why = precision_problem(q);
  if (!why.empty()) throw std::invalid_argument(plugin + ": " + why);
  precision_ = q;
  precision_by_ = plugin;
}

bool Trainer::sharded_state() const {
  return sharding_ && comm_->world_size() > 1;
}

std::string Trainer::optimizer_signature() const {
  if (plugins_->provides_optimizer()) return "plugin";
  // Its state's dtype and, for bf16 weights or state, where its stochastic rounding starts: a
  // resume must continue the same stream (optim.h rounding_seed).
  std::string layout;
  if (precision_.state != Dtype::kF32) layout += " with bf16 state";
  if (precision_.state != Dtype::kF32 || !precision_.masters)
    layout += std::string(precision_.masters ? "" : " updating bf16 weights") +
              ", stochastic rounding seed " + std::to_string(optimizer_->rounding_seed());
  if (!layout.empty()) return config_.train.optimizer + layout;
  // Where the state is: sharded, in the rank parts (a resume elsewhere reshards it).
  return sharded_state() ? config_.train.optimizer + " sharded over " +
                               std::to_string(comm_->world_size()) + " ranks"
                         : config_.train.optimizer;
}

void Trainer::set_partition(const std::string& plugin, uint32_t what) {
  if (model_)
    throw std::logic_error(plugin +
                           ": what is sharded can only be chosen while the plugin is created");
  if (shard_what_ != 0)
    throw std::logic_error(plugin + ": the model state is sharded already, by " + shard_plugin_ +
                           "; two plugins cannot both shard it");
  if (!is_zero_stage(what))
    throw std::invalid_argument(plugin + ": sharding " + std::to_string(what) +
                                " is no ZeRO stage");
  shard_what_ = what;
  shard_plugin_ = plugin;
}

void Trainer::set_persist_below(const std::string& plugin, uint64_t elements) {
  if (model_ || plugin != shard_plugin_ || !(shard_what_ & kShardParameters))
    throw std::logic_error(plugin +
                           ": the persistence threshold is set while the plugin is created, "
                           "after it partitioned the parameters");
  shard_persist_below_ = elements;
}

void Trainer::set_loss_scale(const std::string& plugin, double scale) {
  if (!(scale > 0) || !std::isfinite(scale))
    throw std::invalid_argument(plugin + ": loss scale " + std::to_string(scale) +
                                " must be finite and > 0");
  loss_scale_ = scale;
}

// ---------------------------------------------------------------------------------------------
// Snapshots

namespace {

// A pruned model's adds its blocks' MLP widths and heads (an unpruned one's reads as it always
// did).
std::string model_signature(const ModelConfig& m) {
  return "n_layer=" + std::to_string(m.n_layer) + " n_head=" + std::to_string(m.n_head) +
         " n_embd=" + std::to_string(m.n_embd) + " seq_len=" + std::to_string(m.seq_len) +
         " vocab_size=" + std::to_string(m.vocab_size) +
         (m.pruned() ? " mlp_hidden=" + mlp_hidden_str(m) : "") +
         (m.heads_pruned() ? " attn_heads=" + attn_heads_str(m) : "");
}

// The widths a signature records ("... mlp_hidden=3072,1536"); empty when it records none or
// they do not parse as `n` positive integers.
std::vector<int> signature_widths(const std::string& sig, int n,
                                  const std::string& key = " mlp_hidden=") {
  const size_t at = sig.find(key);
  if (at == std::string::npos) return {};
  std::vector<int> out;
  std::string rest = sig.substr(at + key.size());
  rest = rest.substr(0, rest.find(' '));
  size_t pos = 0;
  while (pos <= rest.size()) {
    const size_t comma = std::min(rest.find(',', pos), rest.size());
    const std::string num = rest.substr(pos, comma - pos);
    if (num.empty() || num.size() > 9 || num.find_first_not_of("0123456789") != std::string::npos)
      return {};
    out.push_back(std::stoi(num));
    if (out.back() < 1) return {};
    pos = comma + 1;
  }
  return int(out.size()) == n ? out : std::vector<int>{};
}

std::vector<uint8_t> bytes_of(Backend& ops, const void* data, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  ops.download(host.data(), data, host.size());
  return host;
}

}  // namespace

void Trainer::adopt_mlp_widths() {
  if (!options_.resume_dir.empty()) {
    // Read once, here; resume() loads it. A folder without a readable snapshot is resume()'s to
    // refuse, where it always was.
    try {
      resume_data_ =
          std::make_unique<SnapshotData>(read_newest_snapshot(options_.resume_dir, &resume_path_));
    } catch (const ConfigError&) {
      resume_data_.reset();
      return;
    }
    ModelConfig pruned = config_.model;
    pruned.mlp_hidden = signature_widths(resume_data_->model, config_.model.n_layer);
    pruned.attn_heads =
        signature_widths(resume_data_->model, config_.model.n_layer, " attn_heads=");
    // Only the widths are taken: a snapshot of another model is refused by resume().
    if (model_signature(pruned) == resume_data_->model) {
      config_.model.mlp_hidden = pruned.mlp_hidden;
      config_.model.attn_heads = pruned.attn_heads;
    }
    return;
  }
  if (!config_.train.init_from.empty()) {
    try {
      config_.model.mlp_hidden = safetensors_mlp_widths(config_.train.init_from, config_.model);
      config_.model.attn_heads = safetensors_attn_heads(config_.train.init_from, config_.model);
    } catch (const ConfigError& e) {
      throw ConfigError(config_.train.init_from_pos.str() + ": train.init_from: " + e.what());
    }
  }
}

void Trainer::resize_mlp(const std::string& plugin, int layer, const std::vector<uint32_t>& keep) {
  resize(plugin, [&] { return model_->resize_mlp(layer, keep); });
}

void Trainer::resize_heads(const std::string& plugin, int layer,
                           const std::vector<uint32_t>& keep) {
  resize(plugin, [&] { return model_->resize_heads(layer, keep); });
}

void Trainer::resize(const std::string& plugin,
                     const std::function<std::vector<ParamResize>()>& resize) {
  if (!model_) throw ResizeRefused(plugin + ": the model is not built yet");
  // The shards, the gradient buckets and the resharding of snapshots cut every layer at fixed
  // sizes: resizing runs on one rank without a zero plugin so far.
  if (sharding_ || comm_->world_size() > 1)
    throw ResizeRefused(
        "the model can be resized only on one rank without a zero plugin so far "
        "(this run has " +
        std::to_string(comm_->world_size()) + " rank(s)" +
        (sharding_ ? " and shards with '" + shard_plugin_ + "'" : "") + ")");
  if (!optimizer_->can_resize())
    throw ResizeRefused(
        "the optimizer-role plugin cannot resize its state (its "
        "hr_optimizer_hooks has no resize)");
  const std::vector<ParamResize> changes = resize();
  segments_ = whole_params(model_->params());
  optimizer_->resize(segments_, changes);
  config_.model.mlp_hidden = model_->config().mlp_hidden;
  config_.model.attn_heads = model_->config().attn_heads;
}

void Trainer::stop_interrupted(int signal, bool mid_step) {
  const int64_t stopped_in = step_;
  const int micro_steps_done = micro_step_;
  // The last completed step: the weights and optimizer state are still those after it (no
  // update has run in the current step).
  const int64_t completed = step_ - 1;
  micro_step_ = 0;
  set_phase(Phase::Kind::kDone);
  std::string saved;
  if (config_.snapshot.every > 0 && completed >= 1 && completed != snapshot_step_) {
    if (mid_step) {
      write_snapshot(completed, step_start_data_, step_start_plugins_);
    } else {
      write_snapshot(completed, loader_->state(), plugins_->save_states());
    }
    saved = "snapshot " + snapshot_path_ + " written";
  } else if (snapshot_step_ >= 1) {
    saved = "the newest snapshot is " + snapshot_path_;
  }
  step_ = completed;
  fire(Event::kTrainEnd);
  std::string what = "stopped by " + signal_name(signal) + " before step " +
                     std::to_string(stopped_in) + " of " + std::to_string(config_.train.steps);
  if (mid_step)
    what = "stopped by " + signal_name(signal) + " in step " + std::to_string(stopped_in) +
           " (its " + std::to_string(micro_steps_done) + " of " + std::to_string(grad_accum()) +
           " micro-steps are dropped)";
  what += "; " + std::to_string(completed) + " step" + (completed == 1 ? "" : "s") + " done";
  if (!saved.empty()) {
    what += "; " + saved + " (resume with --resume " + config_.snapshot.dir + ")";
  } else {
    what += config_.snapshot.every > 0 ? "; no step completed, so no snapshot"
                                       : "; no snapshot ([snapshot] every = 0)";
  }
  throw Interrupted(signal, what);
}

std::string Trainer::write_snapshot(
    int64_t step, const std::string& data_state,
    const std::map<std::string, std::vector<uint8_t>>& plugin_states) {
  const int world = comm_->world_size();
  // The parameters on the host, read on every rank (sharded masters are gathered layer by layer,
  // a collective), kept by the rank that writes them.
  const auto host = download_params(*model_, masters(true, false), world == 1 || root());
  // Sharded optimizer state (zero plugins) is each rank's own: it goes in the rank's part.
  std::map<std::string, std::vector<uint8_t>> own;
  if (sharded_state())
    for (const Optimizer::StateTensor& s : optimizer_->state(segments_))
      own[s.name] = bytes_of(device_->backend(), s.data, s.bytes());
  if (world > 1) {
    // Each rank's own part (its data position, its shards) first, then, once every rank's is
    // written, rank 0 writes the replicated state: a step_<N>.hrsnap in the folder means every
    // part is there.
    write_rank_part(config_.snapshot.dir, step, comm_->rank(), world, data_state, own);
    comm_->barrier().wait();
    if (!root()) {
      snapshot_path_ = snapshot_file(config_.snapshot.dir, step);
      snapshot_step_ = step;
      return snapshot_path_;
    }
  }
  SnapshotData d;
  d.step = step;
  d.skipped_steps = skipped_steps_;
  d.best_val_loss = best_val_loss_;
  d.best_val_step = best_val_step_;
  // With ranks the data positions are in the rank parts; the replicated file says how many.
  d.data_state = world > 1 ? ranks_data_state(world) : data_state;
  d.model = model_signature(config_.model);
  d.optimizer = optimizer_signature();
  const std::vector<Param<float>*> params = model_->params();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto* b = reinterpret_cast<const uint8_t*>(host[i].data());
    d.tensors[params[i]->name].assign(b, b + host[i].size() * sizeof(float));
  }
  if (!sharded_state())
    for (const Optimizer::StateTensor& s : optimizer_->state(segments_))
      d.tensors[s.name] = bytes_of(device_->backend(), s.data, s.bytes());
  d.plugins = plugin_states;
  const std::string path = headroom::write_snapshot(config_.snapshot.dir, d, config_.snapshot.keep);
  snapshot_path_ = path;
  snapshot_step_ = step;
  // The weights beside it, for other tools; pruned with the snapshot. Rank 0's alone.
  if (config_.snapshot.save_weights)
    save_safetensors(path.substr(0, path.size() - std::strlen(".hrsnap")) + ".safetensors", *model_,
                     &host);
  if (options_.log && !options_.live_progress) *options_.log << "snapshot: " << path << "\n";
  return path;
}

int64_t Trainer::resume() {
  std::string path = resume_path_;
  SnapshotData d =
      resume_data_ ? std::move(*resume_data_) : read_newest_snapshot(options_.resume_dir, &path);
  resume_data_.reset();
  auto refuse = [&](const std::string& why) {
    return ConfigError("--resume: snapshot " + path + " " + why);
  };
  // What every rank reads alike (the replicated file, the config) is checked first.
  if (d.model != model_signature(config_.model))
    throw refuse("is of another model (" + d.model + "); this config has " +
                 model_signature(config_.model));
  // The optimizer must be this run's; how its state is sharded need not be (resharding).
  const std::string optimizer = optimizer_signature();
  const OptimizerLayout theirs = optimizer_layout(d.optimizer);
  if (theirs.optimizer != optimizer_layout(optimizer).optimizer) {
    std::vector<std::string> loaded;
    for (const PluginEntry& p : config_.plugins)
      loaded.push_back(p.name);
    throw refuse(optimizer_mismatch(d, optimizer, plugins_->optimizer_plugin(), loaded));
  }
  if (d.step >= config_.train.steps)
    throw refuse("is at step " + std::to_string(d.step) +
                 ", already at train.steps = " + std::to_string(config_.train.steps));
  const int world = comm_->world_size();
  const int written_by = snapshot_world_size(d.data_state);
  if (theirs.sharded_over != 0 && theirs.sharded_over != written_by)
    throw refuse("says its optimizer state is sharded over " + std::to_string(theirs.sharded_over) +
                 " ranks, but it was written by " + std::to_string(written_by));
  // The same world size and the same sharding: each rank reads its own part (its data position
  // and shards), and everything loads as it was saved, bitwise. Otherwise the state is resharded.
  const bool same_layout = written_by == world && d.optimizer == optimizer;
  std::string data_state = d.data_state;
  RankPart part;
  std::unique_ptr<StateResharder> resharded;
  std::string why;
  try {
    if (!same_layout) {
      resharded = reshard_optimizer_state(d, path, written_by, &data_state);
    } else if (world > 1) {
      part = read_rank_part(options_.resume_dir, d.step, comm_->rank(), world);
      data_state = part.data_state;
    }
  } catch (const ConfigError& e) {
    why = std::string(same_layout ? "is incomplete: " : "cannot be resharded: ") + e.what();
  }
  // Every rank learns whether any rank refused, so all stop alike.
  if (world > 1) {
    uint64_t failed = why.empty() ? 0 : 1;
    comm_->all_max_host(&failed, 1);
    if (failed && why.empty()) why = "cannot be resumed: another rank refused its part";
  }
  if (!why.empty()) throw refuse(why);
  // Every tensor the run has must be in the snapshot, with the same size; nothing else may be.
  // Sharded optimizer state is in this rank's part instead; resharded state was assembled above.
  // A target: a parameter (its masters made whole layer by layer inside masters(), sharded or
  // not) or an optimizer state tensor (this rank's, always on the device).
  struct Target {
    std::string name;
    Param<float>* param = nullptr;
    void* data = nullptr;
    uint64_t bytes = 0;  // f32 parameters; optimizer state in its dtype
  };
  auto check = [&](const std::map<std::string, std::vector<uint8_t>>& tensors,
                   const std::vector<Target>& targets, const std::string& where) {
    if (targets.size() != tensors.size())
      throw refuse(where + "holds " + std::to_string(tensors.size()) + " tensors; this run has " +
                   std::to_string(targets.size()));
    for (const Target& t : targets) {
      const auto it = tensors.find(t.name);
      if (it == tensors.end()) throw refuse(where + "has no tensor '" + t.name + "'");
      if (it->second.size() != t.bytes)
        throw refuse(where + "has tensor '" + t.name + "' of " + std::to_string(it->second.size()) +
                     " bytes; expected " + std::to_string(t.bytes));
    }
  };
  Backend& ops = device_->backend();
  auto upload_state = [&](const std::map<std::string, std::vector<uint8_t>>& tensors,
                          const std::vector<Target>& targets) {
    for (const Target& t : targets)
      if (!t.param) ops.upload(t.data, tensors.at(t.name).data(), t.bytes);
  };
  std::vector<Target> replicated, own;
  for (Param<float>* p : model_->params())
    replicated.push_back({p->name, p, nullptr, p->numel * sizeof(float)});
  if (resharded) {
    // The replicated file's optimizer state (an unsharded snapshot's) went into the resharder.
    std::set<std::string> names;
    for (const Target& t : replicated)
      names.insert(t.name);
    for (auto it = d.tensors.begin(); it != d.tensors.end();)
      it = names.count(it->first) ? std::next(it) : d.tensors.erase(it);
    for (const Optimizer::StateTensor& s : optimizer_->state(segments_)) {
      const std::vector<uint8_t>& bytes = resharded->bytes(s.name);
      ops.upload(s.data, bytes.data(), bytes.size());
    }
  } else {
    for (const Optimizer::StateTensor& s : optimizer_->state(segments_))
      (sharded_state() ? own : replicated).push_back({s.name, nullptr, s.data, s.bytes()});
  }
  const std::string own_where = "(rank " + std::to_string(comm_->rank()) + "'s part) ";
  check(d.tensors, replicated, "");
  if (world > 1 && !resharded) check(part.tensors, own, own_where);
  upload_state(d.tensors, replicated);
  if (world > 1 && !resharded) upload_state(part.tensors, own);
  // The parameters, layer by layer: every rank loads the full masters and keeps its shard of
  // them where they are sharded (zero3, amp).
  const MasterAccess access = masters(false, true);
  for (size_t l = 0; l < model_->layers().size(); ++l) {
    const auto write = [&] {
      for (const auto& p : model_->layers()[l]->params())
        ops.upload(p->data(), d.tensors.at(p->name).data(), p->numel * sizeof(float));
      ops.synchronize();  // `d` holds the bytes until here
    };
    if (access) {
      access(int(l), write);
    } else {
      write();
    }
  }
  ops.synchronize();  // `d`, the part and the resharder hold the bytes until here
  model_->sync_compute_params();
  try {
    loader_->restore(data_state);
  } catch (const ConfigError& e) {
    throw refuse(std::string("has a data position this run cannot use: ") + e.what());
  }
  plugins_->load_states(d.plugins, path);
  skipped_steps_ = d.skipped_steps;
  best_val_loss_ = d.best_val_loss;
  best_val_step_ = d.best_val_step;
  snapshot_path_ = path;
  snapshot_step_ = d.step;
  if (options_.log && root()) {
    *options_.log << "resumed from " << path << " (step " << d.step << ")";
    if (!same_layout)
      *options_.log << ", resharded from " << written_by << " rank" << (written_by == 1 ? "" : "s")
                    << " to " << world;
    *options_.log << "\n";
  }
  return d.step;
}

std::unique_ptr<StateResharder> Trainer::reshard_optimizer_state(const SnapshotData& d,
                                                                 const std::string& path,
                                                                 int written_by,
                                                                 std::string* data_state) {
  std::map<std::string, uint64_t> numel;
  for (const Param<float>* p : model_->params())
    numel[p->name] = p->numel;
  auto r = std::make_unique<StateResharder>(numel);
  // What this run's segments need (whole parameters, or this rank's ranges when sharded).
  for (const Optimizer::StateTensor& s : optimizer_->state(segments_))
    r->want(s.name, s.numel);
  // An unsharded snapshot's optimizer state is in the replicated file, beside the parameters.
  for (const auto& [name, bytes] : d.tensors)
    if (!numel.count(name)) r->take(name, bytes, path);
  // Every rank part, one at a time: each gives its ranges (sharded state), and its data position.
  // That position is global (the same on every rank, data.h), so it moves to another world size
  // as it is; a part whose position differs from rank 0's cannot.
  const bool same_world = written_by == comm_->world_size();
  for (int q = 0; q < (written_by > 1 ? written_by : 0); ++q) {
    const RankPart part = read_rank_part(options_.resume_dir, d.step, q, written_by);
    const std::string file = rank_part_file(options_.resume_dir, d.step, q);
    if (same_world) {
      if (q == comm_->rank()) *data_state = part.data_state;
    } else if (q == 0) {
      *data_state = part.data_state;
    } else if (part.data_state != *data_state) {
      throw ConfigError(file + " holds another data position than rank 0's part, so the " +
                        "positions cannot be moved to another world size");
    }
    for (const auto& [name, bytes] : part.tensors)
      r->take(name, bytes, file);
  }
  r->check("what " + std::to_string(written_by) + " rank" + (written_by == 1 ? "" : "s") +
           " wrote");
  return r;
}

// ---------------------------------------------------------------------------------------------
// Output

void Trainer::log_step(const StepRecord& r) {
  const MemoryTracker& mt = device_->tracker();
  // Every rank's peak, for rank 0's metrics: a collective, so every rank takes part.
  std::vector<uint64_t> peaks;
  if (comm_->world_size() > 1) peaks = comm_->all_gather_host(mt.peak_total());
  if (metrics_) {
    nlohmann::json j;
    j["step"] = r.step;
    // The first record a run writes says what computed it (the GEMM library and its kernel).
    if (!metrics_header_written_) {
      j["backend"] = device_->kind() + ": " + device_->backend().describe();
      metrics_header_written_ = true;
    }
    j["loss"] = r.loss;
    j["lr"] = r.lr;
    j["grad_norm"] = r.grad_norm;
    j["step_ms"] = r.step_ms;
    j["tokens_per_s"] = r.tokens_per_s;
    j["data_wait_ms"] = r.data_wait_ms;
    j["comm_wait_ms"] = r.comm_wait_ms;
    j["host_syncs"] = r.host_syncs;
    j["skipped"] = r.skipped;
    if (r.skipped) j["skip_reason"] = veto_reason_;
    j["skipped_steps"] = skipped_steps_;
    j["loss_scale"] = r.loss_scale;
    if (r.evaluated) {
      j["val_loss"] = r.val_loss;
      j["best_val_loss"] = best_val_loss_;
    }
    j["micro_batch"] = r.micro_batch;
    j["grad_accum"] = r.grad_accum;
    j["restarts"] = r.restarts;
    j["mem_live_bytes"] = mt.live_total();
    j["mem_peak_bytes"] = mt.peak_total();
    j["mem_num_allocs"] = mt.num_allocs();
    nlohmann::json by = nlohmann::json::object();
    for (int i = 0; i < kNumCategories; ++i)
      by[category_name(category_at(i))] = mt.peak_by_category()[i];
    j["mem_peak_by_category"] = by;
    if (!peaks.empty()) j["mem_peak_bytes_by_rank"] = peaks;
    metrics_->write(j.dump() + "\n");
    metrics_->flush();
  }
  if (!options_.log || !root()) return;  // the progress line is rank 0's
  const int64_t every = config_.train.log_every;
  const bool last = r.step == config_.train.steps;
  if (!options_.live_progress && r.step % every != 0 && r.step != 1 && !last && !r.skipped &&
      !r.evaluated)
    return;
  // An overflowing fp16 step (amp vetoes it) has an infinite or NaN norm: say so plainly.
  char norm[32];
  std::snprintf(norm, sizeof norm, "%.3f", r.grad_norm);
  const std::string norm_text = std::isfinite(r.grad_norm) ? norm : format_number(r.grad_norm);
  char line[256];
  std::snprintf(line, sizeof line,
                "step %6lld/%lld | loss %.4f | lr %.2e | norm %s | %9.0f tok/s | %7.1f ms | "
                "peak %s",
                static_cast<long long>(r.step), static_cast<long long>(config_.train.steps), r.loss,
                r.lr, norm_text.c_str(), r.tokens_per_s, r.step_ms,
                format_bytes(mt.peak_total()).c_str());
  // A vetoed step says who vetoed it and why, whatever the cadence.
  std::string extra = r.skipped ? " | update skipped by " + veto_reason_ : "";
  if (r.evaluated) {
    char val[64];
    std::snprintf(val, sizeof val, " | val %.4f (best %.4f)", r.val_loss, best_val_loss_);
    extra = val + extra;
  }
  if (options_.live_progress) {
    // On a terminal: the time left at the average pace of this run so far.
    const double per_step = (now_ms() - run_start_ms_) / double(r.step - first_step_ + 1);
    const long long eta_s = llround(per_step * double(config_.train.steps - r.step) / 1000.0);
    char eta[48];
    std::snprintf(eta, sizeof eta, " | ETA %lldh%02lldm%02llds", eta_s / 3600, eta_s / 60 % 60,
                  eta_s % 60);
    *options_.log << '\r' << line << extra << (last ? "" : eta) << "\033[K"
                  << (last || r.skipped ? "\n" : "") << std::flush;
  } else {
    *options_.log << line << extra << '\n' << std::flush;
  }
}

std::string Trainer::memory_report() const {
  const MemoryTracker& mt = device_->tracker();
  std::string s;
  char line[256];
  if (comm_->world_size() > 1) s += "rank " + std::to_string(comm_->rank()) + ": ";
  s += "memory report: peak " + format_bytes(mt.peak_total());
  if (device_->memory_limit()) s += " of memory_limit " + format_bytes(device_->memory_limit());
  s += ", at " + mt.peak_phase().str() + "\n";
  std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", "category", "at peak", "own peak");
  s += line;
  for (int i = 0; i < kNumCategories; ++i) {
    std::snprintf(line, sizeof line, "  %-16s %14s %14s\n", category_name(category_at(i)),
                  format_bytes(mt.live_at_peak()[i]).c_str(),
                  format_bytes(mt.peak_by_category()[i]).c_str());
    s += line;
  }
  return s;
}

}  // namespace headroom
