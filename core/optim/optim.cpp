#include "core/optim/optim.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "kernels/common/elementwise.h"  // rounding_noise

namespace headroom {

namespace {

// One state tensor per segment, zeroed, allocated on first use.
std::vector<Buffer> make_state(Device& device, const std::vector<OptSegment>& segments,
                               const char* what, Dtype dt) {
  std::vector<Buffer> state;
  state.reserve(segments.size());
  for (const OptSegment& s : segments) {
    state.emplace_back(device, s.numel * dtype_size(dt), Category::kOptimizer, s.name + " " + what);
    device.backend().fill(dt, state.back().as<void>(), s.numel, 0.0);
  }
  return state;
}

// Each state tensor of a shrunk parameter (ParamResize::param, a segment's index) keeps the
// parameter's kept elements: read to the host, freed, made again at the new size.
void resize_state(Device& device, std::vector<Buffer>& state,
                  const std::vector<OptSegment>& segments, const std::vector<ParamResize>& changes,
                  const char* what, Dtype dt) {
  if (state.empty()) return;  // no step yet: allocated at the new sizes
  Backend& ops = device.backend();
  const size_t elem = dtype_size(dt);
  for (const ParamResize& r : changes) {
    Buffer& b = state.at(r.param);
    std::vector<unsigned char> old(b.bytes()), next(segments.at(r.param).numel * elem);
    ops.download(old.data(), b.as<void>(), old.size());
    gather_kept(r, old.data(), next.data(), elem);
    b.reset();
    b = Buffer(device, next.size(), Category::kOptimizer, segments[r.param].name + " " + what);
    ops.upload(b.as<void>(), next.data(), next.size());
    ops.synchronize();
  }
}

// HEADROOM_FUSE_CAST=0 in the environment: the built-in optimizers leave the compute copies to
// the cast after the step (Optimizer::writes_compute_copies). Read when one is made, so that a
// test can make both in one process.
bool fuse_cast_from_env() {
  const char* e = std::getenv("HEADROOM_FUSE_CAST");
  return !(e && e[0] == '0' && e[1] == 0);
}

// The operands of segment k's update at `step`: its dtypes, the state's, and its rounding stream.
// grad_scale: the clipping factor folded into the update; fuse_cast: the compute copy written too.
Backend::Stored stored(const OptSegment& s, Dtype state, uint32_t seed, int64_t step, size_t k,
                       float grad_scale, bool fuse_cast) {
  Backend::Stored o;
  if (fuse_cast && s.compute != nullptr) {
    o.compute = s.compute;
    o.compute_dtype = s.compute_dtype;
  }
  o.grad_scale = grad_scale;
  o.param = s.value_dtype;
  o.grad = s.grad_dtype;
  o.state = state;
  o.seed = rounding_noise(seed ^ uint32_t(step), k);
  return o;
}

class AdamW final : public Optimizer {
 public:
  AdamW(const TrainConfig& t, Device& device, Dtype state)
      : t_(t), device_(device), state_(state), fuse_cast_(fuse_cast_from_env()) {
    rounding_seed_ = uint32_t(t.seed);
  }
  bool writes_compute_copies() const override { return fuse_cast_; }
  bool fold_grad_scale(float scale) override {
    grad_scale_ = scale;
    return true;
  }
  void step(const std::vector<OptSegment>& segments, double lr, int64_t step) override {
    allocate(segments);
    for (size_t i = 0; i < segments.size(); ++i) {
      void* const state[2] = {m_[i].as<void>(), v_[i].as<void>()};
      step_segment(segments[i], i, state, lr, step);
    }
  }
  std::vector<std::string> state_kinds() const override { return {"adamw m", "adamw v"}; }
  Dtype state_dtype() const override { return state_; }
  void step_segment(const OptSegment& p, size_t k, void* const* state, double lr,
                    int64_t step) override {
    device_.backend().adamw_update_stored(
        stored(p, state_, rounding_seed_, step, k, grad_scale_, fuse_cast_), p.value, p.grad,
        state[0], state[1], p.numel, static_cast<float>(lr), static_cast<float>(t_.beta1),
        static_cast<float>(t_.beta2), static_cast<float>(t_.eps),
        p.decay ? static_cast<float>(t_.weight_decay) : 0.0f, step);
  }

  bool can_resize() const override { return true; }
  void resize(const std::vector<OptSegment>& segments,
              const std::vector<ParamResize>& changes) override {
    resize_state(device_, m_, segments, changes, "adamw m", state_);
    resize_state(device_, v_, segments, changes, "adamw v", state_);
  }

  std::vector<StateTensor> state(const std::vector<OptSegment>& segments) override {
    allocate(segments);
    std::vector<StateTensor> out;
    for (size_t i = 0; i < segments.size(); ++i) {
      out.push_back({segments[i].name + " adamw m", m_[i].as<void>(), segments[i].numel, state_});
      out.push_back({segments[i].name + " adamw v", v_[i].as<void>(), segments[i].numel, state_});
    }
    return out;
  }

 private:
  void allocate(const std::vector<OptSegment>& segments) {
    if (!m_.empty() || segments.empty()) return;
    m_ = make_state(device_, segments, "adamw m", state_);
    v_ = make_state(device_, segments, "adamw v", state_);
  }

  TrainConfig t_;
  Device& device_;
  Dtype state_;
  bool fuse_cast_;           // writes_compute_copies
  float grad_scale_ = 1.0f;  // fold_grad_scale's, for the next step
  std::vector<Buffer> m_, v_;
};

class Sgd final : public Optimizer {
 public:
  Sgd(const TrainConfig& t, Device& device, Dtype state)
      : t_(t), device_(device), state_(state), fuse_cast_(fuse_cast_from_env()) {
    rounding_seed_ = uint32_t(t.seed);
  }
  bool writes_compute_copies() const override { return fuse_cast_; }
  bool fold_grad_scale(float scale) override {
    grad_scale_ = scale;
    return true;
  }
  void step(const std::vector<OptSegment>& segments, double lr, int64_t step) override {
    allocate(segments);
    for (size_t i = 0; i < segments.size(); ++i) {
      void* const state[1] = {buf_.empty() ? nullptr : buf_[i].as<void>()};
      step_segment(segments[i], i, state, lr, step);
    }
  }
  std::vector<std::string> state_kinds() const override {
    if (t_.momentum > 0) return {"sgd momentum"};
    return {};
  }
  Dtype state_dtype() const override { return state_; }
  void step_segment(const OptSegment& p, size_t k, void* const* state, double lr,
                    int64_t step) override {
    device_.backend().sgd_update_stored(
        stored(p, state_, rounding_seed_, step, k, grad_scale_, fuse_cast_), p.value, p.grad,
        t_.momentum > 0 ? state[0] : nullptr, p.numel, static_cast<float>(lr),
        static_cast<float>(t_.momentum), p.decay ? static_cast<float>(t_.weight_decay) : 0.0f);
  }

  bool can_resize() const override { return true; }
  void resize(const std::vector<OptSegment>& segments,
              const std::vector<ParamResize>& changes) override {
    resize_state(device_, buf_, segments, changes, "sgd momentum", state_);
  }

  std::vector<StateTensor> state(const std::vector<OptSegment>& segments) override {
    allocate(segments);
    std::vector<StateTensor> out;
    for (size_t i = 0; i < buf_.size(); ++i)
      out.push_back(
          {segments[i].name + " sgd momentum", buf_[i].as<void>(), segments[i].numel, state_});
    return out;
  }

 private:
  // Momentum 0 keeps no state at all.
  void allocate(const std::vector<OptSegment>& segments) {
    if (t_.momentum > 0 && buf_.empty())
      buf_ = make_state(device_, segments, "sgd momentum", state_);
  }

  TrainConfig t_;
  Device& device_;
  Dtype state_;
  bool fuse_cast_;           // writes_compute_copies
  float grad_scale_ = 1.0f;  // fold_grad_scale's, for the next step
  std::vector<Buffer> buf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const TrainConfig& train, Device& device, Dtype state) {
  if (train.optimizer == "adamw") return std::make_unique<AdamW>(train, device, state);
  if (train.optimizer == "sgd") return std::make_unique<Sgd>(train, device, state);
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
  for (Param<float>* p : params) {
    out.push_back({p->name, p->optimized().value, p->optimized().grad, p->numel, p->decay,
                   p->optimized().dtype, p->optimized().grad_dtype});
    // f32 masters beside a compute copy (amp): the update can write the copy too.
    if (p->master().value != nullptr && p->flat->compute) {
      out.back().compute = p->compute().value;
      out.back().compute_dtype = p->compute().dtype;
    }
  }
  return out;
}

std::vector<bool> compute_copies_written(const Gpt<float>& model,
                                         const std::vector<OptSegment>& segments) {
  const auto& layers = model.layers();
  const size_t elem = dtype_size(model.compute_dtype());
  std::vector<uint64_t> covered(layers.size(), 0);
  for (const OptSegment& s : segments) {
    if (s.compute == nullptr) continue;
    const auto at = reinterpret_cast<uintptr_t>(s.compute);
    for (size_t l = 0; l < layers.size(); ++l) {
      const FlatStorage& f = layers[l]->flat();
      if (!f.compute) continue;
      const auto begin = reinterpret_cast<uintptr_t>(f.compute.as<void>());
      if (at >= begin && at < begin + f.padded * elem) {
        covered[l] += s.numel;
        break;
      }
    }
  }
  // The segments never overlap: as many elements as the buffer holds is all of them.
  std::vector<bool> written(layers.size(), false);
  for (size_t l = 0; l < layers.size(); ++l)
    written[l] = layers[l]->flat().compute && covered[l] == layers[l]->flat().padded;
  return written;
}

double grad_sum_squares(Backend& ops, const std::vector<OptSegment>& segments) {
  // One fused reduction, one wait for the host (not one per parameter).
  std::vector<Backend::Span> spans;
  spans.reserve(segments.size());
  for (const OptSegment& s : segments)
    spans.push_back({s.grad_dtype, s.grad, s.numel});
  return ops.sum_squares_many(spans);
}

namespace {

// The op table that reads segment s's memory: the host place's for an offloaded shard
// (OptSegment::on_host), else the device's.
Backend& ops_for(Device& device, const OptSegment& s) {
  return s.on_host && device.host_place() ? device.host_place()->backend() : device.backend();
}

}  // namespace

double grad_sum_squares(Device& device, const std::vector<OptSegment>& segments) {
  if (segments.empty()) return 0.0;
  // sum_squares_many adds its spans' sums in order: the leading run of one place's segments in
  // one call, then each later segment's alone, added in the same order (bitwise the one-place
  // sum; one call when every segment is in one place).
  Backend& first = ops_for(device, segments[0]);
  size_t run = 0;
  while (run < segments.size() && &ops_for(device, segments[run]) == &first)
    ++run;
  double total = grad_sum_squares(
      first, std::vector<OptSegment>(segments.begin(), segments.begin() + std::ptrdiff_t(run)));
  for (size_t i = run; i < segments.size(); ++i)
    total += grad_sum_squares(ops_for(device, segments[i]), {segments[i]});
  return total;
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
    ops.scale(s.grad_dtype, s.grad, s.numel, factor);
}

void clip_grads(Device& device, const std::vector<OptSegment>& segments, double norm,
                double max_norm) {
  if (!(max_norm > 0 && norm > max_norm)) return;
  const float factor = clip_factor(norm, max_norm);
  for (const OptSegment& s : segments)
    ops_for(device, s).scale(s.grad_dtype, s.grad, s.numel, factor);
}

double clip_grad_norm(Backend& ops, const std::vector<Param<float>*>& params, double max_norm) {
  const std::vector<OptSegment> segments = whole_params(params);
  const double norm = std::sqrt(grad_sum_squares(ops, segments));
  clip_grads(ops, segments, norm, max_norm);
  return norm;
}

}  // namespace headroom
