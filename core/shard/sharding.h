// Sharded model state across ranks (ZeRO, Rajbhandari et al. 2020): the mechanism. Each layer's
// flat buffers (core/model/model.h FlatStorage, numel padded to a multiple of the world size W)
// are partitioned into W equal contiguous ranges; rank r owns [r·S, (r+1)·S), S = padded / W.
//
//   optimizer   the optimizer state (and so the update) covers only the rank's ranges: segments()
//   gradients   + each layer's full gradients exist only while its backward runs; what stays is
//                the rank's gradient shard (S elements a layer), which reduce_gradients adds into
//
// When to reduce and gather, and what to keep, is the plugins' policy (zero1, zero2), driven
// through headroom.shard/1; the trainer checks that every layer was reduced before GRADS_READY
// and gathered before STEP_END ends, and waits for whatever is still in flight.
//
// Training thread only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/device/device.h"
#include "core/model/model.h"
#include "core/optim/optim.h"

namespace headroom {

// What is sharded: the C ABI's HR_SHARD_* bits.
enum ShardBits : uint32_t {
  kShardOptimizer = 1,
  kShardGradients = 2,
};

class Sharding {
 public:
  // `what`: kShardOptimizer, optionally with kShardGradients. The model's layers must have been
  // allocated padded to comm.world_size(). Allocates the gradient shards (zero2).
  Sharding(Gpt<float>& model, Communicator& comm, uint32_t what);
  Sharding(const Sharding&) = delete;
  Sharding& operator=(const Sharding&) = delete;
  ~Sharding();

  uint32_t what() const { return what_; }
  int rank() const { return comm_.rank(); }
  int world_size() const { return comm_.world_size(); }
  // Layer l's partition: S elements a rank, this rank's range starting at begin.
  uint64_t shard_numel(int layer) const;
  uint64_t shard_begin(int layer) const { return uint64_t(rank()) * shard_numel(layer); }

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
  // Layer l's parameters all-gathered from every rank's updated range, in place; asynchronous.
  // With compute copies (amp) the layer's copy is cast from its masters when done.
  void gather_parameters(int layer);
  // Waits for every collective started, and finishes each (the adds into the shards, the frees,
  // the casts). Throws CommError as the communicator does.
  void wait();

  // The trainer's checks: every layer reduced since its last backward (before GRADS_READY), every
  // layer gathered since the update (at STEP_END). Throw std::logic_error naming the layers
  // missed and `who` (the plugin that shards).
  void check_reduced(const std::string& who) const;
  void check_gathered(const std::string& who) const;
  // The optimizer updated the ranges: every layer needs gathering before the next forward.
  void updated();

  // Layer l's gradients as the optimizer reads them on this rank: its range of the full gradients
  // (optimizer state sharded) or its gradient shard (gradients sharded); shard_numel(l) elements.
  float* gradient_range(int layer) const;

  // The sum of squares of this rank's gradient ranges over every rank: the global norm's square.
  double grad_sum_squares();

 private:
  struct LayerShard {
    uint64_t shard = 0;  // elements a rank
    Buffer grad;         // with sharded gradients: this rank's gradient range (S elements)
    bool reduced = false;
    bool gathered = true;
  };
  struct Pending {
    int layer;
    bool gather;  // else a gradient reduction
    CommRequest request;
  };
  void finish(Pending& p);
  std::string missed(bool LayerShard::*member) const;

  Gpt<float>& model_;
  Communicator& comm_;
  uint32_t what_;
  std::vector<LayerShard> layers_;
  std::vector<OptSegment> segments_;
  std::vector<Pending> pending_;
  int micro_ = 1, micro_steps_ = 1;
};

}  // namespace headroom
