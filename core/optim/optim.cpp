#include "core/optim/optim.h"

#include <cmath>

namespace headroom {

namespace {

// One state tensor per segment, zeroed, allocated on first use.
std::vector<Buffer> make_state(Device& device, const std::vector<OptSegment>& segments,
                               const char* what) {
  std::vector<Buffer> state;
  state.reserve(segments.size());
  for (const OptSegment& s : segments) {
    state.emplace_back(device, s.numel * sizeof(float), Category::kOptimizer, s.name + " " + what);
    device.backend().fill(Dtype::kF32, state.back().as<float>(), s.numel, 0.0);
  }
  return state;
}

class AdamW final : public Optimizer {
 public:
  AdamW(const TrainConfig& t, Device& device) : t_(t), device_(device) {}
  void step(const std::vector<OptSegment>& segments, double lr, int64_t step) override {
    allocate(segments);
    for (size_t i = 0; i < segments.size(); ++i) {
      const OptSegment& p = segments[i];
      device_.backend().adamw_update(p.value, p.grad, m_[i].as<float>(), v_[i].as<float>(), p.numel,
                                     static_cast<float>(lr), static_cast<float>(t_.beta1),
                                     static_cast<float>(t_.beta2), static_cast<float>(t_.eps),
                                     p.decay ? static_cast<float>(t_.weight_decay) : 0.0f, step);
    }
  }

  std::vector<StateTensor> state(const std::vector<OptSegment>& segments) override {
    allocate(segments);
    std::vector<StateTensor> out;
    for (size_t i = 0; i < segments.size(); ++i) {
      out.push_back({segments[i].name + " adamw m", m_[i].as<float>(), segments[i].numel});
      out.push_back({segments[i].name + " adamw v", v_[i].as<float>(), segments[i].numel});
    }
    return out;
  }

 private:
  void allocate(const std::vector<OptSegment>& segments) {
    if (!m_.empty() || segments.empty()) return;
    m_ = make_state(device_, segments, "adamw m");
    v_ = make_state(device_, segments, "adamw v");
  }

  TrainConfig t_;
  Device& device_;
  std::vector<Buffer> m_, v_;
};

class Sgd final : public Optimizer {
 public:
  Sgd(const TrainConfig& t, Device& device) : t_(t), device_(device) {}
  void step(const std::vector<OptSegment>& segments, double lr, int64_t) override {
    allocate(segments);
    for (size_t i = 0; i < segments.size(); ++i) {
      const OptSegment& p = segments[i];
      device_.backend().sgd_update(p.value, p.grad, buf_.empty() ? nullptr : buf_[i].as<float>(),
                                   p.numel, static_cast<float>(lr), static_cast<float>(t_.momentum),
                                   p.decay ? static_cast<float>(t_.weight_decay) : 0.0f);
    }
  }

  std::vector<StateTensor> state(const std::vector<OptSegment>& segments) override {
    allocate(segments);
    std::vector<StateTensor> out;
    for (size_t i = 0; i < buf_.size(); ++i)
      out.push_back({segments[i].name + " sgd momentum", buf_[i].as<float>(), segments[i].numel});
    return out;
  }

 private:
  // Momentum 0 keeps no state at all.
  void allocate(const std::vector<OptSegment>& segments) {
    if (t_.momentum > 0 && buf_.empty()) buf_ = make_state(device_, segments, "sgd momentum");
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

std::vector<OptSegment> whole_params(const std::vector<Param<float>*>& params) {
  std::vector<OptSegment> out;
  out.reserve(params.size());
  for (Param<float>* p : params)
    out.push_back({p->name, p->data(), p->gdata(), p->numel, p->decay});
  return out;
}

double grad_sum_squares(Backend& ops, const std::vector<OptSegment>& segments) {
  double sum = 0.0;
  for (const OptSegment& s : segments)
    sum += ops.sum_squares(Dtype::kF32, s.grad, s.numel);
  return sum;
}

double global_grad_norm(Backend& ops, const std::vector<Param<float>*>& params) {
  return std::sqrt(grad_sum_squares(ops, whole_params(params)));
}

float clip_factor(double norm, double max_norm) {
  // Rounded to float first, as the factor always was: the same update on every backend.
  return max_norm > 0 && norm > max_norm ? static_cast<float>(max_norm / (norm + 1e-6)) : 1.0f;
}

void clip_grads(Backend& ops, const std::vector<OptSegment>& segments, double norm,
                double max_norm) {
  if (!(max_norm > 0 && norm > max_norm)) return;
  const float factor = clip_factor(norm, max_norm);
  for (const OptSegment& s : segments)
    ops.scale(Dtype::kF32, s.grad, s.numel, factor);
}

double clip_grad_norm(Backend& ops, const std::vector<Param<float>*>& params, double max_norm) {
  const std::vector<OptSegment> segments = whole_params(params);
  const double norm = std::sqrt(grad_sum_squares(ops, segments));
  clip_grads(ops, segments, norm, max_norm);
  return norm;
}

}  // namespace headroom
