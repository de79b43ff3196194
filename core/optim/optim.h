// The built-in optimizers (AdamW, SGD with optional momentum), global-norm clipping and the
// learning-rate schedule.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/config/config.h"
#include "core/device/device.h"
#include "core/model/model.h"

namespace headroom {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Updates every parameter from its gradient. `step` is the 1-based optimizer step. State is
  // allocated (category optimizer) at the first call, as PyTorch does.
  virtual void step(const std::vector<Param<float>*>& params, double lr, int64_t step) = 0;

  struct StateTensor {
    std::string name;  // "h.0.attn.c_attn.weight adamw m"
    float* data;
    uint64_t numel;
  };
  // Its state tensors, for snapshots; allocates them first (zeroed) if no step has yet, so that a
  // snapshot can be loaded into them. Empty for an optimizer that keeps state elsewhere.
  virtual std::vector<StateTensor> state(const std::vector<Param<float>*>& params) = 0;
};

// Throws ConfigError for an unknown optimizer name.
std::unique_ptr<Optimizer> make_optimizer(const TrainConfig& train, Device& device);

// The learning rate at 0-based optimizer step `step`: linear warmup over warmup_steps, then
// cosine / linear decay to min_lr at the last step, or constant.
double learning_rate(const TrainConfig& train, int64_t step);

// sqrt of the sum of squares of every gradient.
double global_grad_norm(Backend& ops, const std::vector<Param<float>*>& params);
// Scales the gradients so their global norm is at most max_norm (torch.nn.utils.clip_grad_norm_:
// factor max_norm / (norm + 1e-6) when norm > max_norm). Returns the norm before clipping.
double clip_grad_norm(Backend& ops, const std::vector<Param<float>*>& params, double max_norm);

}  // namespace headroom
