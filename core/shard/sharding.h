// Sharded model state across ranks (ZeRO, Rajbhandari et al. 2020): the mechanism. Each layer's
// flat buffers (core/model/model.h FlatStorage, numel padded to a multiple of the world size W)
// are partitioned into W equal contiguous ranges; rank r owns [r·S, (r+1)·S), S = padded / W.
//
//   optimizer   the optimizer state (and so the update) covers only the rank's ranges: segments();
//                where the layers read a compute copy (amp), the fp32 masters are optimizer state
//                too: each rank keeps its range of them, and the whole compute copy is gathered
//   gradients   + each layer's full gradients exist only while its backward runs; what stays is
//                the rank's gradient shard (S elements a layer), which reduce_gradients adds into
//   parameters  + each layer keeps only its parameter shard (the masters' range, and with a
//                compute dtype the compute copy's); its full parameters, in the dtype the layers
//                read, exist from gather_parameters to release_parameters. A layer smaller than
//                the persistence threshold keeps them whole (a "whole" layer, zero2's treatment).
//                Frozen parameters (core/model/model.h Param::frozen) are sharded with their layer
//                the same way — their weights (the compute dtype) and a quantized base's bytes,
//                each padded to W equal ranges — and gathered and released with it; never reduced.
//                Below zero3 they are replicated.
//
// Offloaded parameters (ZeRO-Infinity's offload_param; headroom.offload/1 set_parameter_place):
// a sharded layer's shards — its parameter, master, frozen and gradient shards — rest in the
// device's host place instead, in the host ledger. Its gathering uploads the rank's range into the
// full buffer on the device and all-gathers the others' in place; its reduction reads the rank's
// range of the reduced gradients back (one staging buffer, the largest shard's) and adds it into
// the host shard there; the optimizer's segments over them are OptSegment::on_host. Whole layers
// (below the persistence threshold) stay on the device. On one rank this is the device holding
// only the layers in flight.
//
// Their NVMe tier (set_parameter_files): the shards a gathering reads and only an update or a
// load writes — a sharded layer's compute, frozen and quantized shards — rest in a file
// (core/shard/shard_file.h) instead. A gathering starts reading the layer's slot into one of the
// file's two host stagings and returns; the read is waited for, the rank's ranges uploaded and
// all-gathered where the gathering is finished (the layer's first use, its release, wait()), so
// the reads of the layers prefetched run while the layers before them compute. The compute shard
// is cast in a staging from the updated master shard and written back after each update. The
// master and gradient shards stay in the host ledger.
//
// When to reduce, gather and release, and what to keep, is the plugins' policy (zero1, zero2,
// zero3), driven through headroom.shard/1; the trainer checks that a layer's parameters are there
// before it computes, that every layer was reduced before GRADS_READY, and that by the end of
// STEP_END every whole layer was gathered after the update and no sharded layer's full parameters
// are left; it waits for whatever is still in flight.
//
// Built before the model: Gpt's constructor hands each layer to place() as soon as it is
// initialised, so a sharded layer's full parameters exist only while it is being made; attach()
// then binds the model.
//
// Training thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/device/device.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/shard/shard_file.h"

namespace headroom {

// What is sharded: the C ABI's HR_SHARD_* bits.
enum ShardBits : uint32_t {
  kShardOptimizer = 1,
  kShardGradients = 2,
  kShardParameters = 4,
};

// A valid ZeRO stage: optimizer; optimizer + gradients; all three.
bool is_zero_stage(uint32_t what);
// What a plugin that asked to shard `asked` gets sharded on `world_size` ranks. On one rank a
// shard is the whole: a gradient or parameter shard would come on top of the layer's full
// gradients or parameters, so only the optimizer state is partitioned (zero1's) — unless the
// parameters are offloaded (`parameters_on_host`), where the shards resting in the host ledger
// are what leaves the device.
uint32_t effective_partition(uint32_t asked, int world_size, bool parameters_on_host);

class Sharding {
 public:
  // `what`: a ZeRO stage (is_zero_stage). `persist_below`: with kShardParameters, layers of fewer
  // parameter elements keep their parameters whole (0: none). `rest`: where a sharded layer's
  // shards rest: the device (nullptr) or its host place (offloaded parameters; kShardParameters).
  // `file`: with `rest`, the NVMe tier of the parameter shards.
  Sharding(Device& device, Communicator& comm, uint32_t what, uint64_t persist_below,
           Device* rest = nullptr, std::unique_ptr<ShardFile> file = nullptr);
  Sharding(const Sharding&) = delete;
  Sharding& operator=(const Sharding&) = delete;
  ~Sharding();

  // Layer number size() of the model being built, initialised and padded to world_size(): its
  // gradient shard is made (zero2, zero3) and, when its parameters are sharded, its parameter
  // shard, and its full parameters freed.
  void place(Layer<float>& layer);
  // The model whose layers were placed, all of them; builds segments().
  void attach(Gpt<float>& model);

  uint32_t what() const { return what_; }
  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.world_size(); }
  // Layer l's partition: S elements a rank, this rank's range starting at begin.
  uint64_t shard_numel(int layer) const;
  uint64_t shard_begin(int layer) const { return uint64_t(rank()) * shard_numel(layer); }
  // Layer l keeps its parameters whole (no kShardParameters, or fewer elements than the
  // threshold, frozen ones included).
  bool whole(int layer) const { return layers_[checked(layer)].whole; }
  // The shards of sharded layers rest in the host place (offloaded parameters).
  bool offloads() const { return &rest_ != &device_; }
  // The NVMe tier's file, or nullptr.
  const ShardFile* file() const { return file_.get(); }
  // Some layer's fp32 masters are sharded (amp, zero3): the model's full masters are not there.
  bool shards_masters() const;
  // with_masters as a MasterAccess (core/model/model.h); empty when no masters and no frozen
  // weights are sharded.
  MasterAccess master_access(bool gather, bool scatter);
  // with_frozen as a MasterAccess (a scatter): what a loader writes frozen weights inside; empty
  // when no frozen weights are sharded.
  MasterAccess frozen_access();

  // What the optimizer updates: every layer's range of this rank, cut at its parameters'
  // boundaries (the padding is no parameter's). The same list for the whole run.
  const std::vector<OptSegment>& segments() const { return segments_; }

  // Start of a step: the gradient shards are zeroed.
  void begin_step();
  // Micro-step `micro` (1-based) of `micro_steps` starts.
  void begin_micro_step(int micro, int micro_steps) {
    micro_ = micro;
    micro_steps_ = micro_steps;
  }
  // Layer l's backward is about to end (before BACKWARD_END fires): its gradients need reducing
  // again. Also tests the collectives in flight, so that MPI moves them on between layers.
  void backward_done(int layer);
  // Layer l's full gradients (this rank's micro-steps so far) reduce-scattered (average) into
  // this rank's range; asynchronous. With sharded gradients the result is added into the shard
  // when done and the full gradients are freed (the model makes them again, zeroed, before the
  // layer's next backward). Throws std::logic_error for a layer out of range, or one whose
  // gradients are not there (reduced already this micro-step), or, without sharded gradients, a
  // micro-step before the step's last (the in-place reduction overwrites the other ranges).
  void reduce_gradients(int layer);
  // Layer l's parameters all-gathered; asynchronous. A whole layer: every rank's updated range,
  // in place (with compute copies, the layer's copy is cast from its masters when done). A sharded
  // layer: into a new full buffer of the dtype the layers read (the compute copy's, else the
  // masters'); nothing when it is gathered or being gathered.
  void gather_parameters(int layer);
  // A sharded layer's full parameters freed (its gathering finished first, when in flight);
  // nothing when not gathered. Throws std::logic_error for a whole layer.
  void release_parameters(int layer);
  // Before layer l computes (`what`: "forward", "backward"): its parameters and its tied layer's
  // (`tied`, or -1) are there, their gatherings finished. Throws std::logic_error naming `who`
  // (the plugin that shards) when one was not gathered.
  void require_parameters(int layer, int tied, const char* what, const std::string& who);
  // Waits for every collective started, and finishes each (the adds into the shards, the frees,
  // the casts). Throws CommError as the communicator does.
  void wait();

  // The trainer's checks: every layer reduced since its last backward (before GRADS_READY); at
  // the end of STEP_END, every whole layer gathered since the update and no sharded layer
  // gathered. Throw std::logic_error naming the layers missed and `who` (the plugin that shards).
  void check_reduced(const std::string& who) const;
  void check_step_end(const std::string& who) const;
  // The optimizer updated the ranges: whole layers need gathering before the next forward; a
  // sharded layer's compute shard is cast from its updated master shard.
  void updated();

  // Between steps, on every rank in the same order (collective when `gather`): runs f with layer
  // l's full fp32 masters on the device, for what reads or writes the model whole (snapshots,
  // weights files, loading) one layer at a time. `gather`: all-gathered from the shards first,
  // else left for f to fill; `scatter`: afterwards this rank's range of what f left (loaded: the
  // same on every rank) goes into the master shard, and the compute copy follows. Just f when the
  // layer's masters are whole. Inside with_frozen(layer, scatter).
  void with_masters(int layer, bool gather, bool scatter, const std::function<void()>& f);
  // Between steps, on every rank in the same order (collective): runs f with layer l's full
  // frozen storage (its weights and quantized bytes) on the device, all-gathered from the shards
  // whatever f does (a loader may write some of them: the others stay); `scatter`: afterwards
  // this rank's ranges of it go into its shards. Just f when the layer's frozen weights are not
  // sharded.
  void with_frozen(int layer, bool scatter, const std::function<void()>& f);

  // Layer l's gradients as the optimizer reads them on this rank: its range of the full gradients
  // (optimizer state sharded) or its gradient shard (gradients sharded); shard_numel(l) elements.
  float* gradient_range(int layer) const;

  // The sum of squares of this rank's gradient ranges over every rank: the global norm's square.
  double grad_sum_squares();

 private:
  // A parameter shard a gathering reads: a buffer in its place, or (the NVMe tier) part `part`
  // of its layer's slot in the file.
  struct Rested {
    Buffer buffer;
    uint64_t bytes = 0;
    int part = -1;
    explicit operator bool() const { return bytes > 0; }
  };
  enum : int { kComputePart = 0, kFrozenPart = 1, kQuantPart = 2 };
  struct LayerShard {
    uint64_t shard = 0;  // elements a rank
    bool whole = true;   // parameters not sharded
    Buffer grad;         // with sharded gradients: this rank's gradient range (S elements)
    Buffer value;        // sharded masters (amp, zero3): this rank's range of them (S, f32)
    Rested compute;      // zero3 with a compute copy: this rank's range of it (S elements)
    // zero3: this rank's range of the frozen weights (frozen_shard elements of the compute dtype)
    // and of the quantized bytes (quant_shard 4-byte words).
    Rested frozen, quant;
    uint64_t frozen_shard = 0, quant_shard = 0;
    int64_t slot = -1;  // the NVMe tier: the layer's slot in the file
    bool reduced = false;
    bool gathered = true;  // whole: gathered since the update; sharded: full parameters there
  };
  struct Pending {
    int layer;
    bool gather;  // else a gradient reduction
    CommRequest request;
    int staging = -1;  // the NVMe tier: the file's staging its slot is being read into
  };
  size_t checked(int layer) const;
  Layer<float>& layer(int l) const { return *model_->layers()[size_t(l)]; }
  void finish(Pending& p);
  // Starts all-gathering layer l's frozen weights and quantized bytes into its frozen storage
  // (made first); one request each, appended to `into`.
  void gather_frozen(int layer, std::vector<CommRequest>& into);
  // Layer l's masters (with_masters without the frozen weights).
  void with_trainable_masters(int layer, bool gather, bool scatter, const std::function<void()>& f);
  // Finishes the pending collectives in the order started, up to and including the last gather
  // of layer l; none when no gather of l is in flight.
  void finish_through_gather(int layer);
  std::string missed(const std::function<bool(const LayerShard&)>& miss) const;
  // Where a layer's shards rest: the host place for a sharded layer when parameters are
  // offloaded, else the device.
  bool offloaded(const LayerShard& ls) const { return !ls.whole && offloads(); }
  Device& place_of(const LayerShard& ls) const { return offloaded(ls) ? rest_ : device_; }
  // `bytes` from the device into a shard at rest (a download when offloaded), and back.
  void to_rest(const LayerShard& ls, void* shard, const void* from, uint64_t bytes);
  void from_rest(const LayerShard& ls, void* to, const void* shard, uint64_t bytes);
  // The same for a parameter shard, wherever it rests (the NVMe tier: through the file's
  // staging).
  void to_rest(const LayerShard& ls, Rested& shard, const void* from);
  // Makes `shard` (`bytes`) in the layer's place, or names its part of the layer's slot.
  void make_rested(const LayerShard& ls, Rested& shard, int part, uint64_t bytes,
                   const std::string& name);
  // A sharded layer's compute shard cast from its master shard (an update, a load).
  void cast_compute_shard(LayerShard& ls, Dtype dt);
  // The NVMe tier: the same into staging `b` (its last transfer and uploads waited for first),
  // and its write to the file started (in flight until ShardFile::wait(b)).
  void start_compute_write(LayerShard& ls, Dtype dt, int b);
  // The NVMe tier: a staging no read in flight holds, its uploads done (idle_staging: std::
  // logic_error when both hold one; free_staging: finishes the older's gathering first).
  int idle_staging();
  int free_staging();
  // A gathering whose slot is being read into p.staging: the read waited for, each part's range
  // uploaded and all-gathered.
  void finish_read(Pending& p);
  // All-gathers every rank's shard (n elements) into `full` on the device: offloaded, the rank's
  // own range is uploaded first and the gathering runs in place.
  CommRequest gather_from_rest(const LayerShard& ls, const void* shard, void* full, uint64_t n,
                               Dtype dtype);
  CommRequest gather_from_rest(const LayerShard& ls, const Rested& shard, void* full, uint64_t n,
                               Dtype dtype);

  Device& device_;
  Device& rest_;                     // where sharded layers' shards rest
  std::unique_ptr<ShardFile> file_;  // the NVMe tier of their parameter shards, or null
  int staged_layer_[ShardFile::kStagings] = {-1, -1};  // whose slot each staging is reading
  Communicator& comm_;
  uint32_t what_;
  uint64_t persist_below_;
  Gpt<float>* model_ = nullptr;
  std::vector<LayerShard> layers_;
  std::vector<OptSegment> segments_;
  std::vector<Pending> pending_;
  // Offloaded: the rank's range of one layer's reduced gradients, read back before its add
  // (category gradients, the host place; the largest shard's size).
  Buffer staging_;
  int micro_ = 1, micro_steps_ = 1;
};

}  // namespace headroom
