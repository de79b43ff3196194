// The training loop: one place that runs the steps and fires every event (docs/design.md, "The loop
// and its events").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/data/data.h"
#include "core/data/data_loader.h"
#include "core/device/device.h"
#include "core/events/events.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/os/interrupt.h"
#include "core/os/output_file.h"
#include "core/plugin_host/plugin_host.h"
#include "core/report/alloc_trace.h"

namespace headroom {

struct SnapshotData;
class StateResharder;

struct TrainOptions {
  std::string metrics_path;     // "" = no metrics file; else one JSON object per optimizer step
  std::ostream* log = nullptr;  // progress and reports; nullptr = silent
  bool live_progress = false;   // rewrite one progress line (a terminal) instead of printing lines
  std::string resume_dir;       // continue from the newest snapshot in this folder
  std::string save_weights_path;  // write the final weights here (safetensors)
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

struct StepRecord {
  int64_t step = 0;
  double loss = 0.0;  // the mean over the step's tokens (of its micro-steps' means, when equal)
  double lr = 0.0;
  double grad_norm = 0.0;  // before clipping
  double step_ms = 0.0;
  double tokens_per_s = 0.0;
  double data_wait_ms = 0.0;  // waiting for batches, summed over the step's micro-steps
  double comm_wait_ms = 0.0;  // world size > 1: launching what was left and waiting for the
                              // gradient buckets after the backward (what overlap did not hide)
  // Times the host waited for the device in the step (Backend::host_syncs; the validation
  // evaluation and snapshots after it not counted).
  uint64_t host_syncs = 0;
  bool skipped = false;     // a plugin vetoed the optimizer step
  double loss_scale = 1.0;  // the loss scale the step's backward ran with (amp fp16)
  bool evaluated = false;   // train.eval_every: the validation loss was measured after the step
  double val_loss = 0.0;
  int micro_batch = 0;  // what the step ran at (headroom.batch/1 may change it) and
  int grad_accum = 0;   // its micro-steps: micro_batch · grad_accum is the configured's
  int restarts = 0;     // attempts abandoned out of memory and run again
};

// Thrown by Trainer::run when a step's loss or gradient norm is not finite and no plugin vetoed
// the step: the update is not applied, so the last snapshot holds the last good weights.
class Diverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Trainer final : private LayerEvents, private AllocationObserver, private PluginRun {
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
  std::vector<uint64_t> bucket_bytes() const;

  const Config& config() const { return config_; }
  Device& device() override { return *device_; }
  Gpt<float>& model() { return *model_; }
  double loss_scale() const { return loss_scale_; }
  const DataSource& data() const { return *data_; }
  const std::vector<StepRecord>& history() const { return history_; }
  int64_t skipped_steps() const { return skipped_steps_; }

  // The peak-by-category table printed at the end of a run ("rank N: memory report: ..." when the
  // world size is above 1).
  std::string memory_report() const;

 private:
  void run_steps();
  // To options_.memory_timeline_path, if set; `oom` marks the request that stopped the run.
  void write_memory_timeline(const OomReport* oom);
  // The timeline, the metrics and the trace, complete: at the end of every run, whatever ended
  // it. `oom`: the run stopped out of memory, whose report matters more than a failed write.
  void close_outputs(const OomReport* oom);
  // A stop request seen at a safe point: snapshot of the last completed step (when [snapshot] is
  // on and it has none yet), TRAIN_END, then Interrupted. `mid_step`: the current step's
  // micro-steps so far are dropped, and the step is read again on resume.
  [[noreturn]] void stop_interrupted(int signal, bool mid_step);
  void fire(Event event, int layer = -1);
  void fire(EventInfo info);
  // One micro-step, forward and backward.
  double micro_step(const Batch& batch);
  // The current micro-step's slice of the step's sequences into the host staging buffers:
  // (micro_batch_, T) rows of the configured micro-batch it belongs to, which is read from the
  // loader the first time the step needs it and kept for a restart. Returns the data wait (ms).
  double fetch_micro_batch(int32_t* host_inputs, int32_t* host_targets);
  // An allocation failed in one of the step's micro-steps and the OOM event has been fired: what
  // the abandoned attempt holds is released, and the micro-step (a plugin asked request_retry
  // and no backward had begun) or the whole step from its first micro-step (restart_step, or
  // request_retry once the gradients were touched; the gradients are discarded) runs again.
  // Rethrows the failure, with a note on the micro-batch, when nothing recovers.
  void recover(const OutOfMemory& e);
  // A new attempt of the step begins: its memory is measured from here (headroom.batch/1).
  void begin_attempt();
  // The micro-batch from the next micro-step 1 on: logged with who asked and why.
  void change_micro_batch(int micro_batch, const std::string& plugin, const std::string& reason);
  int grad_accum() const {
    return config_.train.micro_batch * config_.train.grad_accum / micro_batch_;
  }
  void set_phase(Phase::Kind kind, int layer = -1);
  // Data parallelism (world size > 1): the gradient buckets, filled from the last layer to the
  // first, each one contiguous buffer of bucket_size bytes or a little more (a parameter is never
  // split), tagged communication. In the step's last micro-step a bucket's gradients are copied in
  // and its all-reduce (average) launched once the lowest layer feeding it finished its backward;
  // finish_buckets waits for each, in launch order, and copies the averages back.
  void build_buckets();
  void launch_buckets(int layer);  // the buckets whose lowest layer is `layer`; -1: every one left
  void finish_buckets();
  bool root() const { return comm_->rank() == 0; }
  void log_step(const StepRecord& r);
  // The validation loss (train.eval_every): the first eval_batches micro-batches of the
  // validation data, the same ones every time, forward only (Gpt::evaluate) through the
  // step's batch buffers; with ranks, the mean over them. Nothing when a stop request ends it
  // between two batches.
  std::optional<double> evaluate(Batch batch, void* host_inputs, void* host_targets);
  // The run's state after `step` steps, written to [snapshot] dir: the device tensors as they
  // are now, with the data position and plugin states of that moment. Returns the file.
  std::string write_snapshot(int64_t step, const std::string& data_state,
                             const std::map<std::string, std::vector<uint8_t>>& plugin_states);
  // Before the model is built: the per-block MLP widths and attention heads of a pruned model to
  // resume (the newest snapshot's, read now and kept for resume()) or to start from ([train]
  // init_from's file).
  void adopt_mlp_widths();
  // Loads the newest snapshot of options_.resume_dir; returns its step. At the world size and
  // sharding it was written at, each rank reads its own part, bitwise; else it is resharded.
  int64_t resume();
  // Resharding: this rank's optimizer state assembled from snapshot `d` (at `path`, written by
  // `written_by` ranks, sharded or not): every rank part is read, one at a time, for the ranges
  // this run's segments_ cover. *data_state gets the global data position (rank 0's part's; a
  // part that differs is refused) or, at the same world size, this rank's own. ConfigError naming
  // the file for a part that is missing or damaged, and for state that does not cover the
  // segments.
  std::unique_ptr<StateResharder> reshard_optimizer_state(const SnapshotData& d,
                                                          const std::string& path, int written_by,
                                                          std::string* data_state);

  // LayerEvents: the model announces each layer's forward and backward.
  void forward_begin(int layer) override;
  void forward_end(int layer) override;
  void backward_begin(int layer) override;
  void backward_end(int layer) override;
  // AllocationObserver: every device allocation, free and failure.
  void on_alloc(const void* ptr, uint64_t bytes, Category c, const std::string& what) override;
  void on_free(const void* ptr, uint64_t bytes, Category c) override;
  void on_oom(const OomReport& report) override;
  // PluginRun: what plugins reach of the run.
  Gpt<float>* built_model() override { return model_.get(); }
  void veto_step(const std::string& plugin, const std::string& reason) override;
  void request_retry(const std::string& plugin, const std::string& reason) override;
  BatchState batch_state() const override;
  void restart_step(const std::string& plugin, int micro_batch, const std::string& reason) override;
  void set_micro_batch(const std::string& plugin, int micro_batch,
                       const std::string& reason) override;
  void set_compute_dtype(const std::string& plugin, Dtype dtype) override;
  void set_precision(const std::string& plugin, const Precision& p) override;
  void set_loss_scale(const std::string& plugin, double scale) override;
  RunState state() const override;
  Communicator* plugin_communicator() override { return comm_.get(); }
  void set_partition(const std::string& plugin, uint32_t what) override;
  void set_persist_below(const std::string& plugin, uint64_t elements) override;
  Sharding* sharding() override { return sharding_.get(); }
  void resize_mlp(const std::string& plugin, int layer, const std::vector<uint32_t>& keep) override;
  void resize_heads(const std::string& plugin, int layer,
                    const std::vector<uint32_t>& keep) override;
  // What resize_mlp and resize_heads share: the checks, then `resize` (the model's), then the
  // optimizer's segments and state.
  void resize(const std::string& plugin, const std::function<std::vector<ParamResize>()>& resize);
  // Every layer's masters made whole one at a time for what reads or writes the model whole
  // (zero3 and amp keep shards; core/shard/sharding.h with_masters): gathered first (`gather`, a
  // collective: every rank calls it) and/or scattered back into the shards after (`scatter`).
  // Empty when the masters are whole.
  MasterAccess masters(bool gather, bool scatter);

  Config config_;
  TrainOptions options_;
  // Every output the run owns, locked for its whole life: released after everything below.
  std::vector<OutputLock> output_locks_;
  // Before the device: it is destroyed after it, so it sees the frees of everything the device
  // still holds when the trainer goes away.
  std::unique_ptr<AllocTraceRecorder> recorder_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Communicator> comm_;   // after the device: its buffers go first
  std::unique_ptr<PluginHost> plugins_;  // after the device, before everything that allocates
  std::unique_ptr<Gpt<float>> model_;
  std::unique_ptr<Optimizer> optimizer_;
  // What the optimizer updates, clipping scales and snapshots hold: every parameter whole.
  std::vector<OptSegment> segments_;
  // ZeRO: what a plugin chose to shard while it was created, and the mechanism once the model is
  // built (core/shard/sharding.h).
  bool save_weights_ = false;  // --save-weights on any rank
  uint32_t shard_what_ = 0;
  uint64_t shard_persist_below_ = 0;
  std::string shard_plugin_;
  std::unique_ptr<Sharding> sharding_;
  // The optimizer state is sharded over more than one rank: snapshots keep it in the rank parts.
  bool sharded_state() const;
  // What a snapshot's "optimizer" says: "adamw", "adamw sharded over 2 ranks", "plugin".
  std::string optimizer_signature() const;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<DataLoader> loader_;
  // train.eval_every: the validation data, rewound to val_start_ before each evaluation; the
  // lowest loss so far and its step (0: none yet), kept in snapshots.
  std::unique_ptr<DataSource> val_data_;
  std::string val_start_;
  double best_val_loss_ = 0.0;
  int64_t best_val_step_ = 0;
  std::vector<EventListener*> listeners_;
  std::unique_ptr<AppendFile> metrics_;
  bool metrics_header_written_ = false;  // the first record carries the backend's description
  std::vector<StepRecord> history_;
  struct Bucket {
    Buffer buffer;  // Category::kCommunication
    uint64_t bytes = 0;
    int lowest_layer = 0;
    std::vector<Param<float>*> params;  // in buffer order
    CommRequest request;
    bool launched = false;
  };
  std::vector<Bucket> buckets_;       // before the model is gone: they point into it
  std::vector<size_t> launch_order_;  // this step's launches, in order
  int64_t step_ = 0;
  int micro_step_ = 0;
  bool backward_begun_ = false;  // in this micro-step: the gradients are untouched while false
  bool veto_ = false;
  std::string veto_reason_;
  // The current step as far as it has gone: headroom.step/1, and the loss and tokens the
  // BACKWARD_END, GRADS_READY and STEP_END events carry.
  struct StepProgress {
    double lr = 0.0;
    double loss_scale = 1.0;
    bool loss_scale_set = false;  // after STEP_BEGIN: the step's backward uses loss_scale
    int micro_steps = 0;          // done
    double loss_sum = 0.0, weighted_sum = 0.0;  // of their mean losses; times their tokens
    uint64_t tokens = 0, first_tokens = 0;
    bool equal_tokens = true;
    // The micro-step running now, once its forward has computed its loss.
    bool micro_known = false;
    double micro_loss = 0.0;
    uint64_t micro_tokens = 0;
    bool norm_known = false;  // from OPTIMIZER_STEP on
    double grad_norm = 0.0, clip_coef = 1.0;
    // The step's mean loss over its tokens (the metrics' loss).
    double step_loss() const;
    // Counts the current micro-step in, once it is known.
    void add_micro_step();
  };
  StepProgress cur_;
  bool retry_requested_ = false;
  // headroom.batch/1: the micro-batch the steps run at (a divisor of [train] micro_batch; the
  // accumulation makes up the rest), a change asked for the next step, and a restart asked from
  // OOM.
  int micro_batch_ = 1;
  struct BatchRequest {
    int micro_batch = 0;  // 0: none
    std::string plugin, reason;
  };
  BatchRequest next_batch_, restart_;
  std::string batch_by_;  // the plugin that last changed the micro-batch, for the OOM report
  int restarts_ = 0;      // of the current step
  uint64_t attempt_start_bytes_ = 0, attempt_peak_bytes_ = 0;
  // The configured micro-batches of the current step read so far, inputs then targets, each
  // 2·B·T tokens: a restarted step reads the same sequences again.
  std::vector<std::vector<int32_t>> step_data_;
  int step_data_read_ = 0;
  int64_t skipped_steps_ = 0;
  // The model's compute dtype and the state layout around it (amp's dtype, grad_dtype,
  // master_weights, state_dtype), as the plugins chose them while they were created.
  Precision precision_;
  std::string compute_dtype_by_, precision_by_;
  double loss_scale_ = 1.0;
  double run_start_ms_ = 0.0;
  int64_t first_step_ = 1;  // > 1 after a resume
  // --resume: the snapshot read before the model was built (its MLP widths are the model's),
  // which resume() then loads; its path.
  std::unique_ptr<SnapshotData> resume_data_;
  std::string resume_path_;
  // The newest snapshot of this run (or the one it resumed from) and its step.
  std::string snapshot_path_;
  int64_t snapshot_step_ = 0;
  // With [snapshot] on: the data position and plugin states as the current step began, for a
  // snapshot of the step before it when a stop drops this step half done.
  std::string step_start_data_;
  std::map<std::string, std::vector<uint8_t>> step_start_plugins_;
  // Last, so destroyed first: from then on the device tells this trainer of no more frees, while
  // everything its events reach is still alive.
  ObserverRegistration observing_;
};

}  // namespace headroom
