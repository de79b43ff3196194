#include "core/optim/optim.h"

#include <cmath>

namespace headroom {

namespace {

// One state tensor per parameter, zeroed, allocated on first use.
std::vector<Buffer> make_state(Device& device, const std::vector<Param<float>*>& params,
                               const char* what) {
  std::vector<Buffer> state;
  state.reserve(params.size());
  for (const Param<float>* p : params) {
    state.emplace_back(device, p->numel * sizeof(float), Category::kOptimizer,
                       p->name + " " + what);
    device.backend().fill(Dtype::kF32, state.back().as<float>(), p->numel, 0.0);
  }
  return state;
}

class AdamW final : public Optimizer {
 public:
  AdamW(const TrainConfig& t, Device& device) : t_(t), device_(device) {}
  void step(const std::vector<Param<float>*>& params, double lr, int64_t step) override {
    allocate(params);
    for (size_t i = 0; i < params.size(); ++i) {
      Param<float>& p = *params[i];
      device_.backend().adamw_update(p.data(), p.gdata(), m_[i].as<float>(), v_[i].as<float>(),
                                     p.numel, static_cast<float>(lr), static_cast<float>(t_.beta1),
                                     static_cast<float>(t_.beta2), static_cast<float>(t_.eps),
                                     p.decay ? static_cast<float>(t_.weight_decay) : 0.0f, step);
    }
  }

  std::vector<StateTensor> state(const std::vector<Param<float>*>& params) override {
    allocate(params);
    std::vector<StateTensor> out;
    for (size_t i = 0; i < params.size(); ++i) {
      out.push_back({params[i]->name + " adamw m", m_[i].as<float>(), params[i]->numel});
      out.push_back({params[i]->name + " adamw v", v_[i].as<float>(), params[i]->numel});
    }
    return out;
  }

 private:
  void allocate(const std::vector<Param<float>*>& params) {
    if (!m_.empty()) return;
    m_ = make_state(device_, params, "adamw m");
    v_ = make_state(device_, params, "adamw v");
  }

  TrainConfig t_;
  Device& device_;
  std::vector<Buffer> m_, v_;
};

class Sgd final : public Optimizer {
 public:
  Sgd(const TrainConfig& t, Device& device) : t_(t), device_(device) {}
  void step(const std::vector<Param<float>*>& params, double lr, int64_t) override {
    allocate(params);
    for (size_t i = 0; i < params.size(); ++i) {
      Param<float>& p = *params[i];
      device_.backend().sgd_update(p.data(), p.gdata(),
                                   buf_.empty() ? nullptr : buf_[i].as<float>(), p.numel,
                                   static_cast<float>(lr), static_cast<float>(t_.momentum),
                                   p.decay ? static_cast<float>(t_.weight_decay) : 0.0f);
    }
  }

  std::vector<StateTensor> state(const std::vector<Param<float>*>& params) override {
    allocate(params);
    std::vector<StateTensor> out;
    for (size_t i = 0; i < buf_.size(); ++i)
      out.push_back({params[i]->name + " sgd momentum", buf_[i].as<float>(), params[i]->numel});
    return out;
  }

 private:
  // Momentum 0 keeps no state at all.
  void allocate(const std::vector<Param<float>*>& params) {
    if (t_.momentum > 0 && buf_.empty()) buf_ = make_state(device_, params, "sgd momentum");
  }

  TrainConfig t_;
  Device& device_;
  std::vector<Buffer> buf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const TrainConfig& train, Device& device) {
  if (train.optimizer == "adamw") return std::make_unique<AdamW>(train, device);
  if (train.optimizer == "sgd") return std::make_unique<Sgd>(train, device);
  throw ConfigError("train.optimizer = \"" + train.optimizer +
                    "\": valid optimizers are \"adamw\" and \"sgd\"");
}

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  if (t.lr_schedule == "constant" || t.steps <= t.warmup_steps) return t.lr;
  const double progress = double(step - t.warmup_steps) / double(t.steps - t.warmup_steps);
  const double decay = t.lr_schedule == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress))
                                                 : 1.0 - progress;  // linear
  return t.min_lr + decay * (t.lr - t.min_lr);
}

double global_grad_norm(Backend& ops, const std::vector<Param<float>*>& params) {
  double sum = 0.0;
  for (const Param<float>* p : params)
    sum += ops.sum_squares(Dtype::kF32, p->gdata(), p->numel);
  return std::sqrt(sum);
}

double clip_grad_norm(Backend& ops, const std::vector<Param<float>*>& params, double max_norm) {
  const double norm = global_grad_norm(ops, params);
  if (max_norm > 0 && norm > max_norm) {
    // Rounded to float first, as the factor always was: the same update on every backend.
    const float factor = static_cast<float>(max_norm / (norm + 1e-6));
    for (Param<float>* p : params)
      ops.scale(Dtype::kF32, p->gdata(), p->numel, factor);
  }
  return norm;
}

}  // namespace headroom
