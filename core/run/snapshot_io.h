// The run's state in and out of files: training snapshots ([snapshot], --resume, resharding to
// another world size or ZeRO stage), and the weights files ([train] init_from, --save-weights).
// The file formats are core/run/snapshot.h's and core/model/safetensors.h's; this is what a run
// puts in them and takes out, rank by rank (docs/design.md, "Ranks").
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.h"
#include "core/config/config.h"
#include "core/data/data_loader.h"
#include "core/device/device.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/plugin_host/plugin_host.h"
#include "core/run/snapshot.h"
#include "core/shard/sharding.h"

namespace headroom {

class StateResharder;

// What a run counts across its steps and snapshots keep.
struct RunCounters {
  int64_t skipped_steps = 0;
  double best_val_loss = 0.0;  // the lowest validation loss so far, at best_val_step (0: none)
  int64_t best_val_step = 0;
};

// Before the model is built: the per-block MLP widths and attention heads of a pruned model to
// resume (read from the newest snapshot of `resume_dir`, which is kept in *snapshot and *path for
// SnapshotIO) or to start from ([train] init_from's file); the model's config gets them.
// ConfigError naming init_from for a weights file whose widths do not parse.
void adopt_pruned_widths(Config& config, const std::string& resume_dir,
                         std::unique_ptr<SnapshotData>* snapshot, std::string* path);

// The Llama keys a snapshot's model signature records beyond GPT-2's ("... arch=llama n_kv_head=2
// intermediate_size=64 ..."), into `m`; false (m untouched) for a GPT-2's. std::invalid_argument
// (or std::stod's) for a Llama signature that misses a key or does not parse.
bool read_llama_signature(const std::string& sig, ModelConfig& m);

class SnapshotIO {
 public:
  // Everything it reads and writes, the run's; `segments` (what the optimizer updates) and
  // `config.model` (a pruned model's widths) may change while it lives. `sharding`: nullptr when
  // nothing is sharded. `log`: rank 0's progress stream, nullptr elsewhere or when silent.
  struct Parts {
    const Config& config;
    Communicator& comm;
    Device& device;
    Gpt<float>& model;
    Optimizer& optimizer;
    const std::vector<OptSegment>& segments;
    Sharding* sharding;
    DataLoader& loader;
    PluginHost& plugins;
    RunCounters& counters;
    std::ostream* log;
    bool live_progress;  // the progress line is redrawn: no "snapshot:" lines
  };
  // `resume_dir`: --resume's folder ("" for a fresh run); `resumed`: its newest snapshot, read
  // already by adopt_pruned_widths (may be null), at `resumed_path`.
  SnapshotIO(Parts parts, std::string resume_dir, std::unique_ptr<SnapshotData> resumed,
             std::string resumed_path);
  ~SnapshotIO();
  SnapshotIO(const SnapshotIO&) = delete;
  SnapshotIO& operator=(const SnapshotIO&) = delete;

  // [train] init_from's weights into the model (every rank keeps its shard of sharded masters):
  // a weights file or folder, or a PEFT adapter folder (its base, then its adapters, which must
  // be `lora`'s). ConfigError naming init_from for one that does not fit the model.
  void load_init_from(const std::vector<LoraSpec>& lora);
  // The first step to run: 1, or after --resume's newest snapshot (loaded: parameters, optimizer
  // state, data position, plugin states, counters) the one after it. At the world size and
  // sharding it was written at, each rank reads its own part, bitwise; else it is resharded.
  // ConfigError naming the snapshot for one this run cannot continue.
  int64_t resume_or_start();

  // The run's state after `step` steps, written to [snapshot] dir: the device tensors as they
  // are now, with the data position and plugin states of the step's end. Returns the file.
  std::string write(int64_t step);
  // [snapshot] on: the data position and plugin states as a step begins, for a snapshot of the
  // step before it when a stop drops this step half done (write_at_stop).
  void mark_step_start();
  // A stop request at a safe point: a snapshot of the last completed step `completed` when
  // [snapshot] is on and it has none yet (`mid_step`: the current step was begun, and is read
  // again on resume). Returns what happened in words ("snapshot ... written", "the newest
  // snapshot is ...", "" for none).
  std::string write_at_stop(int64_t completed, bool mid_step);
  // --save-weights: read on every rank (sharded masters are gathered layer by layer), written by
  // rank 0.
  void save_weights(const std::string& path);

  // The newest snapshot of this run (or the one it resumed from) and its step; "" and 0 for none.
  const std::string& newest() const { return newest_path_; }
  int64_t newest_step() const { return newest_step_; }

  // Every layer's masters made whole one at a time for what reads or writes the model whole
  // (zero3 and amp keep shards; core/shard/sharding.h with_masters): gathered first (`gather`, a
  // collective: every rank calls it) and/or scattered back into the shards after (`scatter`).
  // Frozen weights beside compute copies are made f32 inside it too. Empty when the masters are
  // whole.
  MasterAccess masters(bool gather, bool scatter);

 private:
  // What a snapshot says of this run's frozen base, from `host` (every parameter's values, in
  // model order).
  SnapshotData::FrozenBase frozen_base(const std::vector<std::vector<float>>& host);
  // "train.init_from DIR, 148 tensors of checksum 0123456789abcdef", for messages.
  static std::string base_str(const SnapshotData::FrozenBase& b);
  std::string write(int64_t step, const std::string& data_state,
                    const std::map<std::string, std::vector<uint8_t>>& plugin_states);
  int64_t resume();
  // Resharding: this rank's optimizer state assembled from snapshot `d` (at `path`, written by
  // `written_by` ranks, sharded or not): every rank part is read, one at a time, for the ranges
  // this run's segments cover. *data_state gets the global data position (rank 0's part's; a
  // part that differs is refused) or, at the same world size, this rank's own. ConfigError naming
  // the file for a part that is missing or damaged, and for state that does not cover the
  // segments.
  std::unique_ptr<StateResharder> reshard_optimizer_state(const SnapshotData& d,
                                                          const std::string& path, int written_by,
                                                          std::string* data_state);
  // The optimizer state is sharded over more than one rank: snapshots keep it in the rank parts.
  bool sharded_state() const;
  // What a snapshot's "optimizer" says: "adamw", "adamw sharded over 2 ranks", "plugin 'lion'"
  // (the plugin that took the optimizer role).
  std::string optimizer_signature() const;
  bool root() const { return p_.comm.rank() == 0; }

  Parts p_;
  std::string resume_dir_;
  std::unique_ptr<SnapshotData> resumed_;
  std::string resumed_path_;
  std::string newest_path_;
  int64_t newest_step_ = 0;
  // The frozen base's checksum and tensor count, once computed (frozen_base).
  std::optional<std::pair<uint64_t, uint64_t>> base_checksum_;
  std::string step_start_data_;
  std::map<std::string, std::vector<uint8_t>> step_start_plugins_;
};

}  // namespace headroom
