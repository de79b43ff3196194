// The built-in optimizers (AdamW, SGD with optional momentum), global-norm clipping and the
// learning-rate schedule.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/model/model.h"

namespace headroom {

// A contiguous run of one parameter's elements that the optimizer updates: the whole parameter,
// or, when the optimizer state is sharded across ranks, the part of it in this rank's range.
// Its weights are the f32 masters, or (amp without masters) the bf16 weights; its gradient f32,
// or bf16 when amp accumulates in the compute dtype. With f32 masters beside compute copies (amp)
// `compute` is the same elements' compute copy, which an optimizer that writes_compute_copies()
// writes in the update's own pass (the cast after the step then skips them); null where nothing
// fuses (no compute copies, no masters, a shard, the host optimizer's copies).
struct OptSegment {
  std::string name;  // the parameter's name; a part adds its element range: "wte.weight [0:512)"
  void* value = nullptr;
  void* grad = nullptr;
  uint64_t numel = 0;
  bool decay = false;
  Dtype value_dtype = Dtype::kF32;
  Dtype grad_dtype = Dtype::kF32;
  void* compute = nullptr;
  Dtype compute_dtype = Dtype::kBF16;  // bf16 or f16
  // value and grad (and compute) live in the device's host place (offloaded parameter shards,
  // core/shard/sharding.h): the host place's ops read and write them.
  bool on_host = false;
};
// One segment per parameter, the whole of each; `compute` set where it has f32 masters and a
// compute copy.
std::vector<OptSegment> whole_params(const std::vector<Param<float>*>& params);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Updates every segment from its gradient. `step` is the 1-based optimizer step. State (one
  // tensor per segment and kind) is allocated, category optimizer, at the first call, as PyTorch
  // does; the segments must be the same at every call.
  virtual void step(const std::vector<OptSegment>& segments, double lr, int64_t step) = 0;
  // True when step() (and step_segment) also writes each updated segment's compute copy
  // (OptSegment::compute, where set) in the update's pass, rounded to nearest even with the bits
  // Backend::cast writes: the built-in AdamW and SGD, unless HEADROOM_FUSE_CAST=0 was in the
  // environment when they were made (the unfused "before" of a benchmark, the same bits). False
  // (the default): the caller casts every compute copy after the step (an optimizer plugin).
  virtual bool writes_compute_copies() const { return false; }

  struct StateTensor {
    std::string name;  // "h.0.attn.c_attn.weight adamw m"
    void* data;
    uint64_t numel;
    Dtype dtype = Dtype::kF32;  // [amp] state_dtype
    uint64_t bytes() const { return numel * dtype_size(dtype); }
  };
  // Its state tensors, for snapshots; allocates them first (zeroed) if no step has yet, so that a
  // snapshot can be loaded into them. Empty for an optimizer that keeps state elsewhere.
  virtual std::vector<StateTensor> state(const std::vector<OptSegment>& segments) = 0;

  // Structured pruning shrank parameters (Gpt::resize_mlp, headroom.resize/1): the state of each
  // keeps the elements the parameter kept. `segments` are the new whole_params. Nothing to do
  // before the state exists. std::logic_error from an optimizer that cannot (can_resize false).
  virtual bool can_resize() const { return false; }
  virtual void resize(const std::vector<OptSegment>& segments,
                      const std::vector<ParamResize>& changes) {
    (void)segments;
    (void)changes;
    throw std::logic_error("this optimizer cannot resize its state");
  }

  // Streaming the state (the NVMe tier, core/run/state_file.h): the kinds of state tensor a
  // segment has, in the order state() lists them ("adamw m", "adamw v"; "sgd momentum"; none
  // for SGD without momentum), their dtype, and the update of segment `k` of `step`'s segments
  // alone with its state tensors where the caller keeps them (`state`: one pointer a kind, each
  // segment.numel of state_dtype()). Bitwise what step() does to that segment. std::logic_error
  // from an optimizer that keeps its state its own way (the default).
  virtual std::vector<std::string> state_kinds() const {
    throw std::logic_error("this optimizer keeps its state its own way");
  }
  virtual Dtype state_dtype() const { return Dtype::kF32; }
  virtual void step_segment(const OptSegment& segment, size_t k, void* const* state, double lr,
                            int64_t step) {
    (void)segment;
    (void)k;
    (void)state;
    (void)lr;
    (void)step;
    throw std::logic_error("this optimizer keeps its state its own way");
  }

  // Where the stochastic rounding of bf16 weights and state starts (kernels/common/
  // elementwise.h): [train] seed's, or a snapshot's on resume. Segment k at step t draws its
  // noise from rounding_noise(seed ^ t, k), so a resumed run rounds as the run it continues.
  uint32_t rounding_seed() const { return rounding_seed_; }
  void set_rounding_seed(uint32_t seed) { rounding_seed_ = seed; }

  // Gradient clipping folded into the next step's update: it reads every gradient times `scale`
  // (Backend::Stored::grad_scale) instead of a pass scaling them in place first. True when this
  // optimizer does so (the built-in ones); false, and the caller scales the gradients itself,
  // otherwise (an optimizer plugin reads the gradients as they are).
  virtual bool fold_grad_scale(float scale) {
    (void)scale;
    return false;
  }

 protected:
  uint32_t rounding_seed_ = 0;
};

// Which of the model's layers the last update wrote the compute copy of whole, by an optimizer
// that writes_compute_copies(): every element of the layer's flat compute buffer (its padding
// included) in some segment's `compute`. Gpt::sync_compute_params skips those (an empty vector:
// none).
std::vector<bool> compute_copies_written(const Gpt<float>& model,
                                         const std::vector<OptSegment>& segments);

// Throws ConfigError for an unknown optimizer name. `state`: the dtype of its state (f32, bf16).
std::unique_ptr<Optimizer> make_optimizer(const TrainConfig& train, Device& device,
                                          Dtype state = Dtype::kF32);

// The learning rate at 0-based optimizer step `step`: linear warmup over warmup_steps, then
// cosine / linear decay to min_lr at the last step, or constant.
double learning_rate(const TrainConfig& train, int64_t step);

// The sum of squares of every segment's gradient (this rank's part of the global norm's square).
double grad_sum_squares(Backend& ops, const std::vector<OptSegment>& segments);
// The same over segments of either place (OptSegment::on_host), each read by its place's ops;
// bitwise the one-place sum (the spans' sums added in order).
double grad_sum_squares(Device& device, const std::vector<OptSegment>& segments);
// sqrt of the sum of squares of every gradient.
double global_grad_norm(Backend& ops, const std::vector<Param<float>*>& params);
// The factor clipping multiplies the gradients by at global norm `norm` (torch.nn.utils.
// clip_grad_norm_: max_norm / (norm + 1e-6) when norm > max_norm, rounded to float), else 1.
float clip_factor(double norm, double max_norm);
// Scales every segment's gradient by clip_factor(norm, max_norm) when it is not 1.
void clip_grads(Backend& ops, const std::vector<OptSegment>& segments, double norm,
                double max_norm);
// The same over segments of either place (OptSegment::on_host).
void clip_grads(Device& device, const std::vector<OptSegment>& segments, double norm,
                double max_norm);
// Scales the gradients so their global norm is at most max_norm. Returns the norm before clipping.
double clip_grad_norm(Backend& ops, const std::vector<Param<float>*>& params, double max_norm);

}  // namespace headroom
