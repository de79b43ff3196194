// The training loop: one place that runs the steps and fires every event (docs/design.md, "The loop
// and its events"). What the loop leans on has a file of its own in core/run/: the step's plan of
// micro-batches and restarts (step_plan.h), how gradients reach the update (grad_sync.h), the
// plugins' choices for the run (run_choices.h), stopping and divergence (run_control.h),
// snapshots and weights files (snapshot_io.h), validation (validation.h), resizing the model
// (resizer.h) and what the run tells (run_log.h).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/data/data.h"
#include "core/data/data_loader.h"
#include "core/device/device.h"
#include "core/events/events.h"
#include "core/events/step_state.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/os/interrupt.h"
#include "core/os/output_file.h"
#include "core/plugin_host/plugin_host.h"
#include "core/report/alloc_trace.h"
#include "core/run/grad_sync.h"
#include "core/run/resizer.h"
#include "core/run/run_choices.h"
#include "core/run/run_control.h"
#include "core/run/run_log.h"
#include "core/run/snapshot_io.h"
#include "core/run/step_plan.h"
#include "core/run/validation.h"

namespace headroom {

struct TrainOptions {
  std::string metrics_path;     // "" = no metrics file; else one JSON object per optimizer step
  std::ostream* log = nullptr;  // progress and reports; nullptr = silent
  bool live_progress = false;   // rewrite one progress line (a terminal) instead of printing lines
  std::string resume_dir;       // continue from the newest snapshot in this folder
  std::string save_weights_path;  // write the final weights here (safetensors)
  // A LoRA run's --save-weights: the merged weights (PEFT's merge_and_unload) instead of the
  // adapter. A run without adapters refuses it.
  bool merge = false;
  // Every allocation and free of the run, as an allocation trace (core/report/alloc_trace.h).
  std::string record_allocs_path;
  // The memory timeline as self-contained HTML (core/report/timeline_html.h), written at the end of
  // run() and also when the run stops out of memory, so the picture shows the way to the failure.
  // With more than one rank, each rank writes its own: FILE.rankN.html (rank_output_path), and
  // likewise the allocation trace (FILE.rankN). The metrics and the weights are rank 0's alone.
  std::string memory_timeline_path;
  int64_t memory_timeline_step = 0;  // the step the timeline draws phase by phase; 0: the peak's
  // The data, when not the one [data] describes (embedding hosts, benchmarks, tests).
  std::unique_ptr<DataSource> data_source;
  // Allocate, free and move memory as the run would, compute nothing (core/device/dry_backend.h):
  // plan --measure's dry runs. The losses are 0 and the step times say nothing.
  bool dry = false;
};

class Trainer final : private LayerEvents,
                      private AllocationObserver,
                      private ModelAccess,
                      private CommAccess,
                      private StepControl {
 public:
  // Checks that every output path can be written, builds the device, loads and creates the
  // plugins, then the model (parameters and gradients allocated now), the optimizer and the data
  // source. Throws ConfigError for unusable input (plugins and output paths included),
  // PluginFailure when a plugin fails to start, and OutOfMemory if the model does not fit. A throw
  // from any step tears down what was built, in order.
  Trainer(const Config& config, TrainOptions options);
  ~Trainer() override;

  // Runs config.train.steps optimizer steps. Throws OutOfMemory when an allocation fails (the
  // OOM event has been fired by then) and no plugin recovers, PluginFailure when a plugin hook
  // fails, Diverged when a step's loss or gradient norm is not finite, Interrupted after a
  // SIGINT / SIGTERM (interrupt.h), and OutputError when an output cannot be written. Whatever
  // ends it, the metrics, the memory timeline and the allocation trace are written up to there.
  void run();

  void add_listener(EventListener* listener) { listeners_.push_back(listener); }

  // The ranks of the run (world size 1 without a launcher) and the collectives between them.
  Communicator& communicator() { return *comm_; }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->world_size(); }
  // The gradient buckets' sizes in bytes, in launch order (last layer first); empty at world
  // size 1.
  std::vector<uint64_t> bucket_bytes() const { return grads_->bucket_bytes(); }

  const Config& config() const { return config_; }
  Device& device() { return *device_; }
  Gpt<float>& model() { return *model_; }
  double loss_scale() const { return choices_.loss_scale(); }
  const DataSource& data() const { return *data_; }
  // Every step's final state, in order: its metrics row.
  const std::vector<StepState>& history() const { return history_; }
  // How the host optimizer overlaps the backward in this run (decided at TRAIN_BEGIN).
  enum class Overlap { kNone, kDownloads, kUpdates };
  Overlap overlap() const { return overlap_; }
  int64_t skipped_steps() const { return counters_.skipped_steps; }

  // The peak-by-category table printed at the end of a run ("rank N: memory report: ..." when the
  // world size is above 1).
  std::string memory_report() const { return log_->memory_report(); }

 private:
  // The loop, and the parts of a step it calls in order.
  void run_steps();
  void begin_step(int64_t step);
  // One micro-step: its batch uploaded, forward and backward (the layers fire their events
  // through LayerEvents).
  void micro_step();
  // Every micro-step done: what the reductions left is waited for (BUCKET_LAUNCH for a bucket not
  // launched yet, BUCKET_DONE for each) and checked.
  void reduce_gradients();
  // The gradient norm, and clipping: folded into the built-in optimizer's update as a scale where
  // nothing else could read the clipped gradients, else done in place.
  void clip_gradients();
  void update();
  void end_step();
  // A non-finite loss or gradient norm that no plugin vetoed: the step's row, TRAIN_END, Diverged.
  [[noreturn]] void diverge();
  // A stop request seen at a safe point of `step` (`mid_step`: after one of its micro-steps):
  // snapshot, TRAIN_END, then Interrupted.
  [[noreturn]] void stop(int signal, int64_t step, bool mid_step);
  // Whether a plugin asked the run to stop (headroom.step/1 stop_run), on any rank; and the stop
  // before `step` it asked for (a snapshot as for a signal; PluginStopped, exit code 7).
  bool plugin_stop_requested();
  [[noreturn]] void stop_by_plugin(int64_t step);

  void fire(Event event, int layer = -1);
  void fire(EventInfo info);
  void fire_bucket(Event event, const BucketEvent& b);
  // The loop's phase now, as both ledgers are stamped with it (layer -1: none).
  Phase phase_of(Phase::Kind kind, int layer = -1) const;
  void set_phase(Phase::Kind kind, int layer = -1);
  bool root() const { return comm_->rank() == 0; }
  std::ostream* root_log() const { return root() ? options_.log : nullptr; }
  // The timeline, the metrics and the trace, complete: at the end of every run, whatever ended
  // it. `oom`: the run stopped out of memory, whose report matters more than a failed write.
  void close_outputs(const OomReport* oom);
  // To options_.memory_timeline_path, if set; `oom` marks the request that stopped the run.
  void write_memory_timeline(const OomReport* oom);

  // LayerEvents: the model announces each layer's forward and backward.
  void forward_begin(int layer) override;
  void forward_end(int layer) override;
  void backward_begin(int layer) override;
  void backward_end(int layer) override;
  // AllocationObserver: every device allocation, free and failure.
  // How the host optimizer (offload) overlaps the backward (HostOptimizer::gradients_final): each
  // layer's gradients start back to the host as its backward ends, and without clipping the
  // layer before is updated there meanwhile (kUpdates); with clipping, whose factor needs every
  // gradient, only the copies overlap and the factor is folded into the update (kDownloads,
  // where nothing reads the clipped gradients). One rank, nothing sharded, not the NVMe tier, and
  // nothing that could change the gradients or skip the update after the backward — no plugin at
  // GRADS_READY or OPTIMIZER_STEP, none at OOM (a step restarted after layers were updated), no
  // other listener. HEADROOM_OVERLAP_UPDATE=0 in the environment turns it off (for comparisons).
  Overlap overlapping_update() const;
  // Whether something could read the gradients once clipped (so clipping scales them in place
  // rather than folding its factor into the update): an event listener other than the plugin
  // host, a plugin that reads them from OPTIMIZER_STEP until the next step zeroes them (as it
  // declares in headroom.reads/1; one that declares nothing, at every event it subscribes to),
  // an optimizer role, or shards that others read.
  bool clipped_gradients_read() const;
  void on_alloc(const void* ptr, uint64_t bytes, Category c, const std::string& what) override;
  void on_free(const void* ptr, uint64_t bytes, Category c) override;
  void on_oom(const OomReport& report) override;
  // What plugins reach of the run (core/plugin_host/run_interfaces.h): the model, the ranks and
  // the step's course here; the choices made while plugins are created (choices_), the steps'
  // micro-batch (plan_) and resizing the model (resizer_) where they belong.
  Gpt<float>* built_model() override { return model_.get(); }
  Communicator* plugin_communicator() override { return comm_.get(); }
  void veto_step(const std::string& plugin, const std::string& reason) override;
  void request_retry(const std::string&, const std::string&) override { plan_->request_retry(); }
  void request_stop(const std::string& plugin, const std::string& reason) override;
  const StepState& step_state() const override { return state_; }

  Config config_;
  TrainOptions options_;
  // One run per output: released after everything else (core/os/output_file.h).
  std::vector<OutputLock> output_locks_;
  // The step as far as it has gone; after each step its final state goes to history_.
  StepState state_;
  std::vector<StepState> history_;
  RunCounters counters_;
  // The first plugin that asked the run to stop, and its reason ("" while none has).
  std::string stop_plugin_, stop_reason_;
  int stop_by_rank_ = -1;  // another rank's plugin asked (its reason is in that rank's output)
  RunChoices choices_;
  PlaceRecord places_;  // headroom.offload/1: where the built-in optimizer lives
  Resizer resizer_{config_};
  std::vector<EventListener*> listeners_;
  // Before the device: it is destroyed after it, so it sees the frees of everything the device
  // still holds when the trainer goes away.
  std::unique_ptr<AllocTraceRecorder> recorder_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Communicator> comm_;   // after the device: its buffers go first
  std::unique_ptr<PluginHost> plugins_;  // after the device, before everything that allocates
  std::unique_ptr<Gpt<float>> model_;
  std::unique_ptr<Optimizer> optimizer_;
  // What the optimizer updates, clipping scales and snapshots hold: every parameter whole, or
  // this rank's ranges when sharded.
  std::vector<OptSegment> segments_;
  // The host optimizer's overlap with the backward (overlapping_update(), decided at
  // TRAIN_BEGIN): each layer's segments [first, last), in segments_' order.
  Overlap overlap_ = Overlap::kNone;
  std::vector<std::pair<size_t, size_t>> layer_segments_;
  std::unique_ptr<Sharding> sharding_;  // a plugin shards the model state (core/shard/)
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<DataLoader> loader_;
  std::unique_ptr<Validation> validation_;  // train.eval_every > 0
  std::unique_ptr<RunLog> log_;
  std::unique_ptr<GradSync> grads_;  // before the model is gone: buckets point into it
  std::unique_ptr<StepPlan> plan_;
  std::unique_ptr<SnapshotIO> snapshots_;
  std::unique_ptr<RunControl> control_;
  // Last, so destroyed first: from then on the device tells this trainer of no more frees, while
  // everything its events reach is still alive.
  ObserverRegistration observing_;
};

}  // namespace headroom
