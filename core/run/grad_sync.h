// How a step's gradients get where the update reads them: left as they are (one rank), averaged
// over the ranks in buckets as the backward finishes them (data parallelism), or reduced into each
// rank's shard by a zero plugin through core/shard/. One interface, three implementations, chosen
// once at start (make_grad_sync): the loop calls the same methods whichever the run has and never
// asks which.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/comm.h"
#include "core/model/model.h"
#include "core/optim/optim.h"
#include "core/shard/sharding.h"

namespace headroom {

// A gradient bucket launched or waited for: what BUCKET_LAUNCH and BUCKET_DONE carry.
struct BucketEvent {
  int lowest_layer = 0;
  uint64_t bytes = 0;
};

class GradSync {
 public:
  virtual ~GradSync() = default;

  // A step begins, the model's gradients zeroed.
  virtual void begin_step() {}
  // Micro-step `micro` (1-based) of `micro_steps` begins.
  virtual void begin_micro_step(int micro, int micro_steps) {
    (void)micro;
    (void)micro_steps;
  }
  // Before layer `layer` computes (`pass`: "forward", "backward"; a dropped layer's recomputation
  // runs inside its backward): its parameters and those of `tied` (or -1) are there. Throws
  // std::logic_error naming the plugin that shards when they are not.
  virtual void require_parameters(int layer, int tied, const char* pass) {
    (void)layer;
    (void)tied;
    (void)pass;
  }
  // Layer `layer`'s backward is about to end (before its BACKWARD_END).
  virtual void backward_ending(int layer) { (void)layer; }
  // In the step's last micro-step, after layer `layer`'s BACKWARD_END (-1: after the backward):
  // the next bucket whose lowest layer it is (-1: any not launched yet) starts its all-reduce;
  // nullopt when there is none. The caller fires BUCKET_LAUNCH for each.
  virtual std::optional<BucketEvent> launch_next(int layer) {
    (void)layer;
    return std::nullopt;
  }
  // Moves the collectives in flight on at a layer boundary (MPI progresses a non-blocking
  // collective only inside MPI calls).
  virtual void progress() {}
  // A micro-step's backward is done: what was started in it is waited for before the next one
  // touches the gradients.
  virtual void end_micro_step() {}
  // Every micro-step done: the next launched bucket waited for, in launch order, its averages
  // copied back; nullopt when all are. The caller fires BUCKET_DONE for each.
  virtual std::optional<BucketEvent> finish_next() { return std::nullopt; }
  // Every micro-step done and waited for: what must be reduced was (std::logic_error naming the
  // plugin and the layers otherwise).
  virtual void check_reduced() const {}
  // The square of the global gradient norm, over every rank.
  virtual double grad_sum_squares() = 0;
  // Something besides the optimizer reads the gradients this rank holds after clipping (the
  // shards): the built-in optimizers cannot fold clipping into the update.
  virtual bool gradients_shared() const { return false; }
  // The optimizer updated what this rank owns: the compute copies follow (amp) but in the layers
  // `written` says it wrote them of already (compute_copies_written; empty: none), or, sharded,
  // the plugin gathers the updated ranges.
  virtual void updated(Gpt<float>& model, const std::vector<bool>& written) {
    model.sync_compute_params(written);
  }
  // STEP_END has been dispatched: what the plugin started is waited for, and checked.
  virtual void end_step() {}
  // The gradient buckets' sizes in bytes, in launch order (last layer first); empty without
  // buckets.
  virtual std::vector<uint64_t> bucket_bytes() const { return {}; }
  // The run is going: collectives that could not finish (a peer failed, this rank ran out of
  // memory) are abandoned to the communicator, which may progress them until it goes, so their
  // buffers must outlive it: the requests go now, the buffers with this object after it.
  virtual void abandon() {}
};

// One rank, nothing sharded: the gradients are the update's as the backward leaves them.
// `segments`: what the optimizer updates (it may change when the model is resized).
std::unique_ptr<GradSync> make_local_grad_sync(Backend& ops,
                                               const std::vector<OptSegment>& segments);
// World size > 1, data parallelism: the gradient buckets, filled from the last layer to the first,
// each one contiguous buffer of `bucket_size` bytes or a little more (a parameter is never split),
// tagged communication. In the step's last micro-step a bucket's gradients are copied in and its
// all-reduce (average) launched once the lowest layer feeding it finished its backward.
std::unique_ptr<GradSync> make_bucket_grad_sync(Device& device, Communicator& comm,
                                                const Gpt<float>& model, uint64_t bucket_size,
                                                const std::vector<OptSegment>& segments);
// A zero plugin (`plugin`) shards the model state: core/shard/'s Sharding reduces, gathers and
// checks what the plugin's schedule asks.
std::unique_ptr<GradSync> make_sharded_grad_sync(Sharding& sharding, const std::string& plugin);

}  // namespace headroom
