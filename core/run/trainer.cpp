#include "core/run/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <utility>

#include "core/config/hf_config.h"
#include "core/model/hf_folder.h"
#include "core/model/peft_adapter.h"
#include "core/model/safetensors.h"
#include "core/report/timeline_html.h"
#include "core/run/host_optimizer.h"
#include "core/run/rank_agreement.h"
#include "core/run/snapshot.h"
#include "headroom/ext/offload.h"
#include "headroom/plugin.h"

namespace headroom {

namespace {

// headroom.offload/1's HR_DIRECT_IO_* as the tier files take it.
DirectIo direct_io_mode(uint32_t d) {
  return d == HR_DIRECT_IO_ON    ? DirectIo::kOn
         : d == HR_DIRECT_IO_OFF ? DirectIo::kOff
                                 : DirectIo::kAuto;
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

Trainer::Trainer(const Config& config, TrainOptions options)
    : config_(config), options_(std::move(options)), choices_(config_.model) {
  // The ranks come from the launcher (mpirun, srun); a process started alone is rank 0 of 1.
  const RankInfo& ranks = rank_info();
  const bool ranked = ranks.world_size > 1;
  if (ranked) {
    // Each rank's own memory picture and trace; rank 0 alone writes the metrics and the weights
    // (which every rank takes part in gathering, with zero3).
    if (!options_.memory_timeline_path.empty())
      options_.memory_timeline_path = rank_output_path(options_.memory_timeline_path, ranks.rank);
    if (!options_.record_allocs_path.empty())
      options_.record_allocs_path = rank_output_path(options_.record_allocs_path, ranks.rank);
    if (ranks.rank != 0) options_.metrics_path.clear();
  }
  // A GPU rank takes the device of its local rank unless [device] index names one.
  if (config_.device.kind == "cuda" && ranks.launched && !config_.device.index_set)
    config_.device.index = ranks.local_rank;
  // A Llama's weights go in and out as Hugging Face folders (config.json beside the tensors, which
  // the rotary and SwiGLU settings need); a single .safetensors file is GPT-2's. Say so before any
  // work, naming what asked for one.
  if (config_.model.llama()) {
    const std::string why =
        " names a single .safetensors file, which holds GPT-2 shapes only; an arch = \"llama\" "
        "model's weights are a Hugging Face folder (config.json beside model.safetensors)";
    if (!config_.train.init_from.empty() && !is_hf_folder(config_.train.init_from))
      throw ConfigError(config_.train.init_from_pos.str() + ": train.init_from" + why);
    if (!options_.save_weights_path.empty() && !names_hf_folder(options_.save_weights_path))
      throw ConfigError("--save-weights " + options_.save_weights_path + why +
                        ": end the path with /");
    if (config_.snapshot.save_weights)
      throw ConfigError(config_.file +
                        ": snapshot.save_weights = true writes a .safetensors file " +
                        "beside each snapshot, which holds GPT-2 shapes only; an arch = \"llama\" "
                        "model's snapshots resume without it");
  }
  // Every output is checked before any work is done: a run must not train for hours and then find
  // it cannot write its weights.
  const std::string no_path;
  const std::pair<const std::string*, const char*> outputs[] = {
      {&options_.metrics_path, "--metrics"},
      {ranks.rank == 0 ? &options_.save_weights_path : &no_path, "--save-weights"},
      {&options_.record_allocs_path, "--record-allocs"},
      {&options_.memory_timeline_path, "--memory-timeline"}};
  for (const auto& [path, flag] : outputs) {
    if (path->empty()) continue;
    // --save-weights DIR/: a Hugging Face folder, made now.
    if (path == &options_.save_weights_path && names_hf_folder(*path)) {
      make_output_dir(*path, flag);
      // It exists now, so it still names a folder without the slash (which the lock's name needs).
      while (options_.save_weights_path.size() > 1 && options_.save_weights_path.back() == '/')
        options_.save_weights_path.pop_back();
    } else {
      check_output_path(*path, flag);
    }
  }
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
  comm_ = make_communicator(*device_, config_.distributed);
  // Every rank runs the same run (core/run/rank_agreement.h): the first collective after it.
  check_ranks_agree(
      agreement_items(config_,
                      {{"--resume", options_.resume_dir.empty() ? "no" : "yes"},
                       {"--save-weights", options_.save_weights_path.empty() ? "no" : "yes"}}),
      *comm_);
  data_ = options_.data_source
              ? std::move(options_.data_source)
              : make_data_source(config_.data, config_.model, config_.train.micro_batch,
                                 config_.model.seq_len, comm_->rank(), comm_->world_size());
  loader_ = std::make_unique<DataLoader>(*data_, config_.data.workers, config_.data.prefetch,
                                         config_.train.micro_batch, config_.model.seq_len);
  if (config_.train.eval_every > 0)
    validation_ = std::make_unique<Validation>(config_, *comm_, root_log());
  plan_ =
      std::make_unique<StepPlan>(config_, *device_, *loader_, state_, comm_->rank(), root_log());

  // Plugins come before anything allocates: an allocator-role plugin serves every buffer. What
  // they choose while created (precision, sharding) the model is built with.
  plugins_ = std::make_unique<PluginHost>(config_);
  RunInterfaces run;
  run.device = device_.get();
  run.model = this;
  run.comm = this;
  run.step = this;
  run.precision = &choices_;
  run.shard = &choices_;
  run.adapters = &choices_;
  run.batch = plan_.get();
  run.resize = &resizer_;
  run.place = &places_;
  plugins_->create(run);
  add_listener(plugins_.get());
  const Precision& precision = choices_.precision();
  const std::string& shard_plugin = choices_.shard_plugin();
  // What is sharded: what the plugin asked for, on one rank only the optimizer state unless the
  // parameters' shards rest on the host (effective_partition).
  const bool params_on_host = places_.parameters_on_host();
  const uint32_t shard_what =
      effective_partition(choices_.shard_what(), ranks.world_size, params_on_host);
  std::ostream* log = root_log();
  if (shard_what != choices_.shard_what() && log)
    *log << "[" << shard_plugin
         << "] one rank: nothing but the optimizer state partitioned (a shard would be the whole; "
            "offload's parameters = \"host\" puts the shards in host memory)\n";
  // amp's state layouts other than its default are one rank's, unsharded, so far: the gradient
  // buckets, the shards and their resharding hold f32 masters and gradients.
  const bool layout = precision.grad_in_compute || !precision.masters;
  if (layout && (ranked || shard_what))
    throw ConfigError("plugin '" + choices_.precision_by() + "': " +
                      (precision.masters ? "grad_dtype = \"bf16\"" : "master_weights = false") +
                      " runs on one rank without a zero plugin so far (this run has " +
                      std::to_string(ranks.world_size) + " rank(s)" +
                      (shard_what ? " and shards with '" + shard_plugin + "'" : "") +
                      "); use grad_dtype = \"fp32\" and master_weights = true there");
  // The validation forward reads every layer whole; sharded parameters are gathered only around
  // the training passes, by the plugin's schedule.
  if (validation_ && (shard_what & kShardParameters))
    throw ConfigError(config_.train.eval_every_pos.str() + ": train.eval_every: plugin '" +
                      shard_plugin +
                      "' shards the parameters, which validation cannot read yet; use a plugin "
                      "that shards only the optimizer state or the gradients, or set "
                      "eval_every = 0");
  // Frozen parameters ([train] freeze): each pattern matches a parameter of this model. They run
  // on one rank, unsharded, with a built-in optimizer so far: the shards, the gradient buckets
  // and the optimizer plugins (which update every layer_param) assume every parameter trains.
  check_freeze(config_.model, config_.train);
  if (options_.merge && choices_.lora().empty())
    throw ConfigError(
        "--merge folds LoRA adapters into the weights they adapt, but this run has "
        "none: list the lora plugin in [[plugins]], or leave --merge out");
  // The built-in optimizer on the host place when a plugin put it there (headroom.offload/1):
  // its state in the host ledger, its update by the CPU kernels there.
  places_.freeze();
  device_->host_place()->set_page_locked(places_.host_page_locked());
  const bool host_optimizer = places_.optimizer_on_host();
  // Where the plugin that chose the place was listed, for the messages.
  std::string place_where;
  for (const PluginEntry& e : config_.plugins)
    if (e.name == places_.chosen_by()) place_where = e.pos.str() + ": ";
  // Offloaded parameters: zero3's shards in the host ledger, updated there.
  if (params_on_host && !(shard_what & kShardParameters))
    throw ConfigError(place_where + "plugin '" + places_.chosen_by() +
                      "' puts the parameter shards in host memory, but " +
                      (shard_plugin.empty() ? std::string("no plugin shards the parameters")
                                            : "plugin '" + shard_plugin + "' does not shard them") +
                      ": list zero3 in [[plugins]] (it shards each layer's parameters and "
                      "gathers them around their use)");
  // The parameters' NVMe tier holds what the layers read that the masters are not: a compute copy
  // (amp) or frozen weights.
  if (!places_.parameter_dir().empty() && precision.compute == Dtype::kF32 &&
      config_.train.freeze.empty() && choices_.lora().empty())
    throw ConfigError(place_where + "plugin '" + places_.chosen_by() +
                      "' puts the parameter shards in files, but this run's layers read fp32 "
                      "parameters, which are the optimizer's masters (in host memory, where it "
                      "updates them): nothing would go to the file. Turn amp on (its bf16 or "
                      "fp16 copy goes there), or use parameters = \"host\"");
  if (params_on_host && !places_.optimizer_on_host())
    throw ConfigError(place_where + "plugin '" + places_.chosen_by() +
                      "' puts the parameter shards in host memory, where the optimizer must "
                      "update them: put the optimizer on the host too (offload's optimizer = "
                      "\"host\" or \"nvme\")");
  if (host_optimizer && plugins_->provides_optimizer())
    throw ConfigError(
        place_where + "plugin '" + places_.chosen_by() +
        "' puts the built-in optimizer ([train] optimizer) on the host, but plugin '" +
        plugins_->optimizer_plugin() + "' takes the optimizer role: use one of the two");
  if (host_optimizer) {
    // The NVMe tier: the state in a file under the folder the plugin named, checked here (exit
    // 2 naming the plugin) and made with the host copies, before step 1.
    std::unique_ptr<StateFile> file;
    if (!places_.optimizer_dir().empty()) {
      file = std::make_unique<StateFile>(
          *device_->host_place(), places_.optimizer_dir(),
          direct_io_mode(places_.optimizer_direct_io()), ranks.rank,
          place_where + "plugin '" + places_.chosen_by() + "': ", root_log());
    }
    optimizer_ = std::make_unique<HostOptimizer>(
        *device_, *device_->host_place(),
        make_optimizer(config_.train, *device_->host_place(), precision.state), std::move(file));
  } else {
    optimizer_ = plugins_->provides_optimizer()
                     ? plugins_->make_optimizer()
                     : make_optimizer(config_.train, *device_, precision.state);
  }
  log_ = std::make_unique<RunLog>(config_, *device_, *comm_, options_.metrics_path, root_log(),
                                  options_.live_progress);
  std::unique_ptr<SnapshotData> resumed;
  std::string resumed_path;
  try {
    // A pruned model (headroom.resize/1) is built at its widths before anything loads into it:
    // the snapshot's it resumes from, or the weights file it starts from.
    adopt_pruned_widths(config_, options_.resume_dir, &resumed, &resumed_path);
    // In the compute dtype a plugin asked for while it was created (amp), else fp32. Sharded (a
    // zero plugin partitioned while it was created): every layer's buffers padded to a multiple
    // of the ranks, and with sharded parameters (zero3) each layer cut to its shard as soon as it
    // is initialised.
    std::function<void(Layer<float>&)> placed;
    if (shard_what) {
      // The parameters' NVMe tier: its folder checked here (exit 2 naming the plugin), its file
      // made as the layers are placed.
      std::unique_ptr<ShardFile> file;
      if (!places_.parameter_dir().empty())
        file = std::make_unique<ShardFile>(
            *device_->host_place(), places_.parameter_dir(),
            direct_io_mode(places_.parameter_direct_io()), ranks.rank,
            place_where + "plugin '" + places_.chosen_by() + "': ", root_log());
      sharding_ = std::make_unique<Sharding>(
          *device_, *comm_, shard_what, choices_.shard_persist_below(),
          params_on_host ? device_->host_place() : nullptr, std::move(file));
      placed = [this](Layer<float>& layer) { sharding_->place(layer); };
    } else if (host_optimizer && precision.masters && precision.compute != Dtype::kF32) {
      // ZeRO-Offload's masters: amp's f32 masters move to the host optimizer as each layer is
      // initialised; the device keeps the compute copies and the gradients.
      auto& host = static_cast<HostOptimizer&>(*optimizer_);
      placed = [&host](Layer<float>& layer) { host.take_masters(layer); };
    }
    model_ = std::make_unique<Gpt<float>>(
        config_.model, *device_, config_.train.seed, precision,
        shard_what ? uint64_t(comm_->world_size()) : 1, (shard_what & kShardGradients) != 0, placed,
        Tuning{config_.train.freeze, choices_.lora(), choices_.base(), choices_.double_quant()});
    choices_.freeze(sharding_.get());
    // Activation offload: the layers' outputs wait on the host between forward and backward.
    if (places_.activations_on_host()) model_->set_activation_place(device_->host_place());
    // Sharded gradients beside the optimizer on the host: the tied embedding's full gradient
    // waits on the host through the blocks' backward (issue 34, item 3).
    if (host_optimizer && (shard_what & kShardGradients))
      model_->set_gradient_park(device_->host_place());
    uint64_t trainable = 0;
    for (const Param<float>* p : model_->trainable_params())
      trainable += p->numel;
    log_->set_params(model_->num_params(), trainable);
    if (sharding_) {
      sharding_->attach(*model_);
      segments_ = sharding_->segments();
      grads_ = make_sharded_grad_sync(*sharding_, shard_plugin);
    } else {
      segments_ = whole_params(model_->trainable_params());
      // A plugin with the gradient-reduction role reduces them itself (headroom.comm/1).
      grads_ = ranked && !plugins_->provides_gradient_reduction()
                   ? make_bucket_grad_sync(*device_, *comm_, *model_,
                                           config_.distributed.bucket_size, segments_)
                   : make_local_grad_sync(device_->backend(), segments_);
    }
    // The NVMe tier's file, preallocated now: a disk too small for it stops the run before step
    // 1 (exit 4), with nothing written yet to lose.
    if (!places_.optimizer_dir().empty())
      static_cast<HostOptimizer&>(*optimizer_).prepare(segments_);
  } catch (const OutOfMemory& e) {
    close_outputs(&e.report());
    throw;
  }
  // The micro-batch of the steps, and the model's widths, change on one rank, unsharded, so far.
  plan_->fix_micro_batch(ranked       ? "this run has more than one rank"
                         : shard_what ? "this run is sharded"
                                      : "");
  resizer_.attach(*model_, *optimizer_, segments_,
                  ranked || sharding_
                      ? "this run has " + std::to_string(ranks.world_size) + " rank(s)" +
                            (sharding_ ? " and shards with '" + shard_plugin + "'" : "")
                      : "");
  snapshots_ = std::make_unique<SnapshotIO>(
      SnapshotIO::Parts{config_, *comm_, *device_, *model_, *optimizer_, segments_, sharding_.get(),
                        *loader_, *plugins_, counters_, root_log(), options_.live_progress},
      options_.resume_dir, std::move(resumed), resumed_path);
  control_ = std::make_unique<RunControl>(config_, *snapshots_);
  snapshots_->load_init_from(choices_.lora());
}

Trainer::~Trainer() {
  // A collective that could not finish (a peer failed, this rank ran out of memory) is abandoned
  // to the communicator, which progresses it while it goes: every buffer it touches — the
  // model's, the buckets', an allocator plugin's memory under them — must outlive the
  // communicator. So the requests go first (Sharding keeps its own buffers of an abandoned one),
  // then the communicator, then everything else in member order. The device stops telling this
  // trainer of frees first, as the default order of the members would.
  observing_.detach();
  grads_->abandon();
  sharding_.reset();
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

Trainer::Overlap Trainer::overlapping_update() const {
  const auto* host = dynamic_cast<const HostOptimizer*>(optimizer_.get());
  if (!host || host->state_in_file() || sharding_ || comm_->world_size() > 1) return Overlap::kNone;
  const char* env = std::getenv("HEADROOM_OVERLAP_UPDATE");
  if (env && std::string(env) == "0") return Overlap::kNone;
  constexpr uint64_t kAfterBackward = HR_EVENT_BIT(HR_EVENT_GRADS_READY) |
                                      HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP) |
                                      HR_EVENT_BIT(HR_EVENT_OOM);
  if (plugins_->subscribed_events() & kAfterBackward) return Overlap::kNone;
  if (!std::all_of(listeners_.begin(), listeners_.end(),
                   [&](const EventListener* l) { return l == plugins_.get(); }))
    return Overlap::kNone;
  // Clipping's factor needs every gradient: the downloads alone overlap, and the factor is folded
  // into the update, so the device's gradients are never scaled after their copy left.
  if (config_.train.grad_clip > 0)
    return clipped_gradients_read() ? Overlap::kNone : Overlap::kDownloads;
  return Overlap::kUpdates;
}

bool Trainer::clipped_gradients_read() const {
  constexpr uint64_t kAfterClipping =
      HR_EVENT_BIT(HR_EVENT_OPTIMIZER_STEP) | HR_EVENT_BIT(HR_EVENT_STEP_END) |
      HR_EVENT_BIT(HR_EVENT_STEP_BEGIN) | HR_EVENT_BIT(HR_EVENT_TRAIN_END) |
      HR_EVENT_BIT(HR_EVENT_ALLOC) | HR_EVENT_BIT(HR_EVENT_FREE) | HR_EVENT_BIT(HR_EVENT_OOM);
  const bool listened = std::any_of(listeners_.begin(), listeners_.end(),
                                    [&](EventListener* l) { return l != plugins_.get(); });
  return listened || grads_->gradients_shared() || plugins_->provides_optimizer() ||
         (plugins_->gradient_events() & kAfterClipping) != 0;
}

void Trainer::run_steps() {
  // A resumed run's state, the plugins' included, is in place before TRAIN_BEGIN.
  const int64_t first = snapshots_->resume_or_start();
  overlap_ = overlapping_update();
  if (overlap_ != Overlap::kNone) {
    // Each layer's trainable parameters are consecutive segments (whole_params' order).
    layer_segments_.clear();
    size_t k = 0;
    for (const auto& layer : model_->layers()) {
      const size_t from = k;
      for (const auto& p : layer->params())
        k += p->frozen ? 0 : 1;
      layer_segments_.emplace_back(from, k);
    }
    if (k != segments_.size()) overlap_ = Overlap::kNone;  // not whole parameters: no overlap
  }
  fire(Event::kTrainBegin);
  set_phase(Phase::Kind::kData);
  const StepPlan::BufferLease buffers = plan_->allocate_buffers();
  log_->start(first);
  for (int64_t step = first; step <= config_.train.steps; ++step) {
    // A safe point: the previous step is complete (and snapshotted, if its turn came).
    if (const int sig = control_->stop_requested()) stop(sig, step, false);
    if (plugin_stop_requested()) stop_by_plugin(step);  // headroom.step/1 stop_run
    begin_step(step);  // STEP_BEGIN; gradients zeroed; the step's micro-batch
    for (state_.micro_step = 1; state_.micro_step <= state_.grad_accum; ++state_.micro_step) {
      try {
        micro_step();  // FORWARD_* and BACKWARD_* of every layer
      } catch (const OutOfMemory& e) {
        plan_->recover(e, *model_);  // this micro-step or the whole step again, or rethrows
        continue;
      }
      state_.losses.count_micro_step();
      // A safe point. After the last micro-step the step is all but done: finish it instead.
      const int sig = control_->stop_requested();
      if (sig && state_.micro_step < state_.grad_accum) stop(sig, step, true);
    }
    reduce_gradients();        // BUCKET_DONE for each bucket, in launch order
    fire(Event::kGradsReady);  // amp checks for overflow, unscales, may veto
    clip_gradients();
    if (!state_.skipped && !RunControl::finite(state_)) diverge();
    state_.phase = StepState::Phase::kUpdate;
    set_phase(Phase::Kind::kOptimizer);
    if (!state_.skipped) fire(Event::kOptimizerStep);  // a veto up to here skips the update
    if (!state_.skipped) update();
    state_.phase = StepState::Phase::kEnd;
    if (state_.skipped) ++counters_.skipped_steps;
    fire(Event::kStepEnd);
    grads_->end_step();
    end_step();  // validation, the metrics row, the progress line
    if (config_.snapshot.every > 0 && step % config_.snapshot.every == 0) snapshots_->write(step);
  }
  set_phase(Phase::Kind::kDone);
  fire(Event::kTrainEnd);
  if (!options_.save_weights_path.empty()) {
    const std::vector<LoraSpec>& lora = choices_.lora();
    const std::string& path = options_.save_weights_path;
    if (options_.merge || (!lora.empty() && names_hf_folder(path))) {
      // Every rank reads (gathering sharded masters is a collective); rank 0 writes.
      const bool root = comm_->rank() == 0;
      const auto host = download_params(*model_, snapshots_->masters(true, false), root);
      if (root && options_.merge) {
        // PEFT's merge_and_unload: a base model with the adapters folded in.
        save_merged_weights(path, *model_, lora, host);
      } else if (root) {
        // A LoRA run's folder is its adapter, in PEFT's format, on init_from's base (an adapter
        // folder's own base when it continued one).
        const std::string& from = config_.train.init_from;
        save_peft_adapter(path, *model_, lora,
                          is_peft_adapter_folder(from) ? read_peft_adapter_config(from).base : from,
                          &host);
      }
    } else {
      snapshots_->save_weights(path);
    }
  }
}

void Trainer::begin_step(int64_t step) {
  snapshots_->mark_step_start();
  state_.begin(step, learning_rate(config_.train, step - 1));
  state_.start_ms = now_ms();
  state_.start_host_syncs = device_->backend().host_syncs();
  fire(Event::kStepBegin);
  // The loss scale a plugin (amp fp16) set by now is the step's.
  state_.loss_scale = choices_.loss_scale();
  state_.phase = StepState::Phase::kForward;
  model_->zero_grad();
  grads_->begin_step();
  plan_->begin_step();  // a micro-batch a plugin asked for takes effect
}

void Trainer::micro_step() {
  set_phase(Phase::Kind::kData);
  const Batch& batch = plan_->upload_micro_batch();
  grads_->begin_micro_step(state_.micro_step, state_.grad_accum);
  state_.phase = StepState::Phase::kForward;
  model_->forward(batch, this);
  model_->backward(batch, this);  // the head's backward_end records the loss
  // What a zero plugin started in this micro-step's backward is done before the next one touches
  // the gradients (or GRADS_READY reads them).
  grads_->end_micro_step();
  if (state_.micro_step < state_.grad_accum) return;
  // Buckets not launched from a BACKWARD_END (overlap = false) start here.
  const double c0 = now_ms();
  while (const auto b = grads_->launch_next(-1))
    fire_bucket(Event::kBucketLaunch, *b);
  state_.comm_wait_ms = now_ms() - c0;
}

void Trainer::reduce_gradients() {
  state_.micro_step = 0;
  state_.phase = StepState::Phase::kReduce;
  const double c0 = now_ms();
  while (const auto b = grads_->launch_next(-1))
    fire_bucket(Event::kBucketLaunch, *b);
  while (const auto b = grads_->finish_next())
    fire_bucket(Event::kBucketDone, *b);
  state_.comm_wait_ms += now_ms() - c0;
  grads_->check_reduced();
}

void Trainer::clip_gradients() {
  const TrainConfig& t = config_.train;
  // The metrics' loss: the mean over ranks (every rank reads as many tokens).
  state_.loss = state_.losses.mean();
  if (comm_->world_size() > 1) comm_->all_reduce_host(&state_.loss, 1, ReduceOp::kAverage);
  state_.grad_norm = std::sqrt(grads_->grad_sum_squares());
  // The built-in optimizers fold clipping into the update as a scale (no pass of its own) unless
  // something could read the clipped gradients (clipped_gradients_read). Then they are clipped in
  // place.
  const float clip = clip_factor(state_.grad_norm, t.grad_clip);
  if (clipped_gradients_read() || !optimizer_->fold_grad_scale(clip))
    clip_grads(*device_, segments_, state_.grad_norm, t.grad_clip);
  state_.clip_coef = double(clip);
}

void Trainer::update() {
  optimizer_->step(segments_, state_.lr, state_.step);
  // The compute copies follow, but where the update wrote them itself; or the plugin gathers the
  // ranges.
  grads_->updated(*model_, optimizer_->writes_compute_copies()
                               ? compute_copies_written(*model_, segments_)
                               : std::vector<bool>{});
}

void Trainer::end_step() {
  Backend& ops = device_->backend();
  state_.host_syncs = ops.host_syncs() - state_.start_host_syncs;  // validation not counted
  if (validation_ && validation_->due(state_.step)) {
    ops.synchronize();  // the last micro-step is done with the batch buffers
    set_phase(Phase::Kind::kEval);
    // Nothing when a stop request ended it: the loop stops at the next step's safe point.
    const std::optional<Evaluation> eval =
        validation_->evaluate(*model_, plan_->validation_batch(), plan_->staging_inputs(0),
                              plan_->staging_targets(0), state_.step);
    state_.evaluated = eval.has_value();
    state_.val_loss = eval ? eval->loss : 0.0;
    if (eval && (counters_.best_val_step == 0 || state_.val_loss < counters_.best_val_loss)) {
      counters_.best_val_loss = state_.val_loss;
      counters_.best_val_step = state_.step;
    }
    if (eval) {  // the loss the metrics row reports as val_loss
      EventInfo info;
      info.event = Event::kEvalEnd;
      info.loss = eval->loss;
      info.tokens = eval->tokens;
      fire(info);
    }
  }
  state_.step_ms = now_ms() - state_.start_ms;
  const uint64_t tokens_per_step = uint64_t(config_.train.micro_batch) * config_.model.seq_len *
                                   uint64_t(config_.train.grad_accum);
  state_.tokens_per_s = double(tokens_per_step) / (state_.step_ms / 1000.0);
  history_.push_back(state_);
  log_->step(state_, counters_.skipped_steps, counters_.best_val_loss);
  if (recorder_) recorder_->flush();  // a full disk stops the run now, not at its end
}

void Trainer::diverge() {
  state_.step_ms = now_ms() - state_.start_ms;
  history_.push_back(state_);
  log_->step(state_, counters_.skipped_steps, counters_.best_val_loss);
  set_phase(Phase::Kind::kDone);
  fire(Event::kTrainEnd);
  throw control_->diverged(state_);
}

void Trainer::stop(int signal, int64_t step, bool mid_step) {
  const int micro_steps_done = mid_step ? state_.micro_step : 0;
  state_.step = step;
  state_.micro_step = 0;
  set_phase(Phase::Kind::kDone);
  Interrupted e = control_->stop(signal, step, mid_step, micro_steps_done, state_.grad_accum);
  state_.step = step - 1;  // the last completed step
  fire(Event::kTrainEnd);
  throw e;
}

bool Trainer::plugin_stop_requested() {
  // With ranks, one rank's request stops them all after the same step. Only a run with plugins
  // can have one: a run without pays no collective. Every rank lists the same plugins (the ranks
  // agree on the config), so a request travels as (rank + 1, the plugin's place in the list + 1),
  // and the other ranks can name who asked; the highest asking rank's is the one they name.
  if (comm_->world_size() == 1 || !plugins_ || plugins_->size() == 0) return !stop_plugin_.empty();
  const std::vector<PluginEntry>& listed = config_.plugins;
  uint64_t asked = 0;
  if (!stop_plugin_.empty()) {
    const auto at = std::find_if(listed.begin(), listed.end(),
                                 [&](const PluginEntry& e) { return e.name == stop_plugin_; });
    asked = (uint64_t(comm_->rank()) + 1) << 32 | uint64_t(at - listed.begin() + 1);
  }
  comm_->all_max_host(&asked, 1);
  if (asked != 0 && stop_plugin_.empty()) {
    const uint64_t index = (asked & 0xFFFFFFFFu) - 1;
    stop_by_rank_ = int(asked >> 32) - 1;
    stop_plugin_ = index < listed.size() ? listed[index].name : "?";
  }
  return asked != 0;
}

void Trainer::stop_by_plugin(int64_t step) {
  state_.step = step;
  state_.micro_step = 0;
  set_phase(Phase::Kind::kDone);
  PluginStopped e = control_->plugin_stop(stop_plugin_, stop_reason_, step, stop_by_rank_);
  state_.step = step - 1;  // the last completed step
  fire(Event::kTrainEnd);
  throw e;
}

void Trainer::close_outputs(const OomReport* oom) {
  try {
    write_memory_timeline(oom);
    if (log_) log_->close();
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
  o.oom = oom && oom->place == "device" ? oom : nullptr;
  o.detail_step = options_.memory_timeline_step;
  write_timeline_html(options_.memory_timeline_path, device_->tracker().timeline(), o);
  // The host ledger's timeline beside it (<path>.host.html), when the host held anything.
  const Device* host = device_->host_place();
  if (!host || host->tracker().num_allocs() == 0) return;
  TimelineHtmlOptions h = o;
  h.title = config_.file + " (host memory)";
  h.memory_limit = host->memory_limit();
  h.oom = oom && oom->place == "host" ? oom : nullptr;
  write_timeline_html(host_timeline_path(options_.memory_timeline_path), host->tracker().timeline(),
                      h);
}

// ---------------------------------------------------------------------------------------------
// Events

void Trainer::fire(Event event, int layer) {
  EventInfo info;
  info.event = event;
  info.layer = layer;
  fire(info);
}

void Trainer::fire(EventInfo info) {
  info.step = state_.step;
  info.micro_step = state_.micro_step;
  if (info.event == Event::kBackwardEnd && state_.losses.micro_known) {
    info.loss = state_.losses.micro;
    info.tokens = state_.losses.micro_tokens;
  } else if (info.event == Event::kGradsReady || info.event == Event::kStepEnd) {
    info.loss = state_.losses.mean();
    info.tokens = state_.losses.tokens;
  }
  for (EventListener* l : listeners_)
    l->on_event(info);
}

void Trainer::fire_bucket(Event event, const BucketEvent& b) {
  EventInfo info;
  info.event = event;
  info.layer = b.lowest_layer;
  info.bytes = b.bytes;
  fire(info);
}

Phase Trainer::phase_of(Phase::Kind kind, int layer) const {
  Phase p;
  p.kind = kind;
  p.layer = layer;
  if (layer >= 0 && model_) p.layer_name = model_->layers()[layer]->name();
  p.step = state_.step;
  p.micro_step = state_.micro_step;
  return p;
}

void Trainer::set_phase(Phase::Kind kind, int layer) {
  const Phase p = phase_of(kind, layer);
  device_->tracker().set_phase(p);
  if (Device* host = device_->host_place()) host->tracker().set_phase(p);
}

void Trainer::forward_begin(int layer) {
  set_phase(Phase::Kind::kForward, layer);
  fire(Event::kForwardBegin, layer);
  grads_->require_parameters(layer, model_->tied_layer(layer), "forward");
}

void Trainer::forward_end(int layer) {
  fire(Event::kForwardEnd, layer);
}

void Trainer::backward_begin(int layer) {
  state_.phase = StepState::Phase::kBackward;  // the gradients are no longer untouched
  set_phase(Phase::Kind::kBackward, layer);
  fire(Event::kBackwardBegin, layer);
  // Before a dropped layer's recomputation too: it runs inside the layer's backward.
  grads_->require_parameters(layer, model_->tied_layer(layer), "backward");
}

void Trainer::backward_end(int layer) {
  if (size_t(layer) + 1 == model_->layers().size()) {
    // The head's backward computed the micro-batch's loss (the chunked loss computes its logits
    // there, once). Known from here to the micro-step's end: every BACKWARD_END carries it,
    // headroom.step/1 counts it. On the host already (the head reads its losses back once).
    state_.losses.micro = model_->loss();
    state_.losses.micro_tokens = model_->loss_tokens();
    state_.losses.micro_known = true;
  }
  grads_->backward_ending(layer);
  fire(Event::kBackwardEnd, layer);
  // The step's last micro-step: the buckets this layer completes start reducing while the layers
  // below run their backward (with compute copies, the model added the layer's gradients into
  // their fp32 masters just before this event).
  if (state_.micro_step == state_.grad_accum && config_.distributed.overlap) {
    while (const auto b = grads_->launch_next(layer))
      fire_bucket(Event::kBucketLaunch, *b);
    grads_->progress();
  }
  // The host optimizer's update overlapped with the backward (offload): this layer's gradients
  // are final, and the layer before, whose gradients are on the host by now, is updated there
  // (the host ledger's timeline marks it) while the device goes on with the layers below.
  // With clipping only the gradients start back; the update waits for the factor.
  if (overlap_ != Overlap::kNone && state_.micro_step == state_.grad_accum) {
    const bool update = overlap_ == Overlap::kUpdates;
    Device* host = device_->host_place();
    if (update && host && size_t(layer) + 1 < model_->layers().size())
      host->tracker().set_phase(phase_of(Phase::Kind::kOptimizer, layer + 1));
    const auto [from, to] = layer_segments_.at(size_t(layer));
    static_cast<HostOptimizer&>(*optimizer_)
        .gradients_final(segments_, from, to, state_.lr, state_.step, update);
    if (update && host) host->tracker().set_phase(device_->tracker().phase());
  }
}

void Trainer::on_alloc(const void* ptr, uint64_t bytes, Category c, const std::string&) {
  state_.attempt_peak_bytes = std::max(state_.attempt_peak_bytes, device_->tracker().live_total());
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

// ---------------------------------------------------------------------------------------------
// What plugins read of the run and ask of it

void Trainer::request_stop(const std::string& plugin, const std::string& reason) {
  if (!stop_plugin_.empty()) return;  // the first request wins
  stop_plugin_ = plugin;
  stop_reason_ = reason;
}

void Trainer::veto_step(const std::string& plugin, const std::string& reason) {
  if (state_.phase == StepState::Phase::kEnd) return;  // from STEP_END on: too late, ignored
  state_.skipped = true;
  state_.veto_reason = plugin + ": " + reason;
}

}  // namespace headroom
