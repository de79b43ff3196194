// The built-in optimizer on the host place (headroom.offload/1's HR_PLACE_HOST, ZeRO-Offload's
// layout): its state and an f32 copy of the weights it updates live in the host ledger, the
// gradients are read back into host memory before each update, the update runs there on the CPU
// backend's kernels (the same ones the CPU device runs, so the results are bitwise the same) and
// the new weights go back to the device on the copy stream.
//
// Segments over offloaded parameter shards (OptSegment::on_host: core/shard/sharding.h) are in
// the host ledger already: the update runs on them in place, with no copy, read-back or upload.
//
// The NVMe tier (HR_PLACE_NVME) is the same with the optimizer's state in a file
// (core/run/state_file.h) instead of the host ledger: each update streams it through two
// staging buffers segment by segment, updating each with Optimizer::step_segment.
//
// With compute copies and f32 masters (amp), the masters live on the host instead of the device
// (ZeRO-Offload's layout): take_masters moves each layer's f32 masters into the host ledger as the
// model initialises it, and the device keeps only the compute-dtype weights and the gradients.
// Each update then runs on the host masters in f32, casts the result to the compute dtype there
// (round to nearest even, as the device's cast) and uploads that into the compute copies.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device/device.h"
#include "core/optim/optim.h"
#include "core/run/state_file.h"

namespace headroom {

// Host bytes by category that HostOptimizer holds for `segments` with `state_tensors` f32-or-
// state-dtype tensors of each segment's size (AdamW 2, SGD with momentum 1, else 0): an f32 (the
// value dtype) copy of each segment (parameters), a copy of each segment's gradient (gradients),
// the state (optimizer). With `masters_on_host` (the segments are the device's compute copies),
// the parameters are the f32 masters and the compute-dtype copy uploaded after each update. The
// closed form core/report/advice.cpp computes from shapes.
ByCategory host_optimizer_bytes(const std::vector<OptSegment>& segments, uint64_t state_tensors,
                                Dtype state, bool masters_on_host = false);

// Whether the NVMe tier streams `segments` in pieces of kStateChunk elements
// (core/optim/state_layout.h): when nothing rounds stochastically (f32 weights and state), else
// whole segments.
bool streams_in_pieces(const std::vector<OptSegment>& segments, Dtype state);

class HostOptimizer final : public Optimizer {
 public:
  // `inner`: the built-in optimizer made over `host` (make_optimizer(train, host, state)), whose
  // state it allocates there; or, with `file` (the NVMe tier), whose state it keeps in the file.
  HostOptimizer(Device& device, Device& host, std::unique_ptr<Optimizer> inner,
                std::unique_ptr<StateFile> file = nullptr);
  ~HostOptimizer() override;

  void step(const std::vector<OptSegment>& segments, double lr, int64_t step) override;
  std::vector<StateTensor> state(const std::vector<OptSegment>& segments) override;
  bool fold_grad_scale(float scale) override { return inner_->fold_grad_scale(scale); }
  // Pruning shrank parameters: the inner optimizer's state keeps their kept elements (on the
  // host), the host copies are made again at the new sizes and the weights read from the device
  // at the next update.
  // Not with the NVMe tier so far (the file's layout is fixed when it is made), nor with the
  // masters on the host (the device's masters are what a resize shrinks).
  bool can_resize() const override { return !file_ && !masters_on_host() && inner_->can_resize(); }
  bool state_in_file() const { return file_ != nullptr; }
  void resize(const std::vector<OptSegment>& segments,
              const std::vector<ParamResize>& changes) override;

  // Makes the host copies and, with the NVMe tier, the state file now (before step 1: a disk
  // that cannot hold it fails the run there, OutputError).
  void prepare(const std::vector<OptSegment>& segments) { allocate(segments); }

  // The update overlapped with the backward, layer by layer (ZeRO-Offload's): segments
  // [first, last) of `segments` — one layer's — have their final gradients for `step`, which
  // nothing will change or veto before the update (the trainer decides where:
  // Trainer::overlapping_update). Their gradients start back to the host
  // (Backend::download_async), and the segments named before them, whose gradients have
  // arrived, are updated on the host and their new weights uploaded, while the device goes on
  // with the backward below. step() then updates the ones named last and those none named. Each
  // segment bitwise as step() updates it (Optimizer::step_segment is step()'s own per-segment
  // update). `update` false (clipping: its factor needs every gradient): only their gradients
  // start back, and step() updates every segment once the factor is folded in
  // (fold_grad_scale). Not with the NVMe tier (std::logic_error).
  void gradients_final(const std::vector<OptSegment>& segments, size_t first, size_t last,
                       double lr, int64_t step, bool update = true);
  // Segment k's new weights to the device (d, on the copy stream): the host values, or with the
  // masters on the host their compute-dtype copy.
  void upload_weights(const OptSegment& d, size_t k);

  // Moves `layer`'s f32 masters (its trainable parameters', just initialised) into the host
  // ledger, where they become the values the update runs on, and frees them on the device: the
  // model's `placed` callback, layer by layer, so the device never holds more than one layer's
  // masters. The segments the optimizer is then given are the compute copies (whole_params
  // without masters).
  void take_masters(Layer<float>& layer);
  bool masters_on_host() const { return !master_index_.empty(); }
  // Gpt::master_access's contract for the host masters: runs f with layer l's f32 masters on
  // the device (Param::master() valid), made from the host's; with `scatter` they are read back
  // into the host masters and cast into the compute copy after f (a load). Empty without
  // take_masters.
  MasterAccess master_access(Gpt<float>& model, bool scatter);

 private:
  // The host copies of `segments` (values and gradients), made at the first call.
  void allocate(const std::vector<OptSegment>& segments);
  // Segments [first, last), their gradients on the host: the update of each (with its values
  // read from the device first in a process's first step) and the upload of its new weights.
  void update_on_host(const std::vector<OptSegment>& segments, size_t first, size_t last, double lr,
                      int64_t step);

  Device& device_;
  Device& host_;
  std::unique_ptr<Optimizer> inner_;
  std::unique_ptr<StateFile> file_;     // the NVMe tier's; null on the host place
  std::vector<Buffer> values_, grads_;  // host: per segment
  std::vector<OptSegment> on_host_;     // the segments over the host copies
  // take_masters: each parameter's index in values_ (the segments' order), and the host's
  // compute-dtype copies of the masters that each update uploads.
  std::map<std::string, size_t> master_index_;
  std::vector<Buffer> casts_;
  // The host copies of the weights hold the device's: false until the first update of this
  // process reads them (after a resume or init_from loaded the device's), true after.
  bool values_current_ = false;
  bool uploads_pending_ = false;  // the last update's uploads may still read the host copies
  // gradients_final's: the segments whose gradients were started back during this step's
  // backward (early_), those updated then (updated_), the last named (downloads in flight), the
  // step they are for.
  std::vector<bool> early_, updated_;
  size_t arriving_first_ = 0, arriving_last_ = 0;
  int64_t early_step_ = 0;
};

}  // namespace headroom
