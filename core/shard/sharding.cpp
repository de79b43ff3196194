#include "core/shard/sharding.h"

#include <algorithm>
#include <stdexcept>

namespace headroom {

namespace {

std::string layer_list(const std::vector<int>& layers) {
  std::string s;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0) s += ", ";
    if (i == 8) return s + "... (" + std::to_string(layers.size()) + " layers)";
    s += std::to_string(layers[i]);
  }
  return s;
}

}  // namespace

Sharding::Sharding(Gpt<float>& model, Communicator& comm, uint32_t what)
    : model_(model), comm_(comm), what_(what) {
  if (!(what & kShardOptimizer))
    throw std::logic_error("sharding gradients without the optimizer state is not a ZeRO stage");
  const auto W = uint64_t(comm.world_size());
  const auto r = uint64_t(comm.rank());
  Device& device = model.device();
  const auto& layers = model.layers();
  layers_.resize(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    const FlatStorage& f = layers[l]->flat();
    if (f.padded % W != 0)
      throw std::logic_error("layer " + std::to_string(l) + "'s buffers are not padded to " +
                             std::to_string(W) + " ranks");
    LayerShard& ls = layers_[l];
    ls.shard = f.padded / W;
    if (what & kShardGradients) {
      ls.grad = Buffer(device, ls.shard * sizeof(float), Category::kGradients,
                       layers[l]->name() + " gradient shard");
      device.backend().fill(Dtype::kF32, ls.grad.as<float>(), ls.shard, 0.0);
    }
    // This rank's range [lo, hi) of the layer, cut at the parameters' boundaries.
    const uint64_t lo = r * ls.shard, hi = lo + ls.shard;
    for (const auto& p : layers[l]->params()) {
      const uint64_t a = std::max(lo, p->offset), b = std::min(hi, p->offset + p->numel);
      if (a >= b) continue;
      OptSegment s;
      s.name = a == p->offset && b == p->offset + p->numel
                   ? p->name
                   : p->name + " [" + std::to_string(a - p->offset) + ":" +
                         std::to_string(b - p->offset) + ")";
      s.value = f.value.as<float>() + a;
      s.grad = ls.grad ? ls.grad.as<float>() + (a - lo) : f.grad.as<float>() + a;
      s.numel = b - a;
      s.decay = p->decay;
      segments_.push_back(std::move(s));
    }
  }
}

Sharding::~Sharding() {
  // Requests wait in their destructors; nothing may outlive the buffers they read.
  pending_.clear();
}

uint64_t Sharding::shard_numel(int layer) const {
  if (layer < 0 || layer >= int(layers_.size()))
    throw std::logic_error("layer " + std::to_string(layer) + " does not exist (the model has " +
                           std::to_string(layers_.size()) + " layers)");
  return layers_[size_t(layer)].shard;
}

void Sharding::begin_step() {
  Backend& ops = model_.device().backend();
  for (LayerShard& ls : layers_)
    if (ls.grad) ops.fill(Dtype::kF32, ls.grad.as<float>(), ls.shard, 0.0);
}

void Sharding::backward_done(int layer) {
  layers_[size_t(layer)].reduced = false;
  for (Pending& p : pending_)
    p.request.test();
}

void Sharding::reduce_gradients(int layer) {
  const uint64_t S = shard_numel(layer);
  const FlatStorage& f = model_.layers()[size_t(layer)]->flat();
  if (!f.grad)
    throw std::logic_error("layer " + std::to_string(layer) +
                           " has no gradients to reduce (reduced already since its backward)");
  for (const Pending& p : pending_)
    if (p.layer == layer && !p.gather)
      throw std::logic_error("layer " + std::to_string(layer) + "'s gradients are being reduced");
  if (!(what_ & kShardGradients) && micro_ < micro_steps_)
    throw std::logic_error(
        "without sharded gradients a layer is reduced once, in the step's last "
        "micro-step (this is micro-step " +
        std::to_string(micro_) + " of " + std::to_string(micro_steps_) + ")");
  // Sharded gradients: the reductions started before this one are finished first (their full
  // gradients freed), so that at most one layer's are in flight while the next computes.
  if (what_ & kShardGradients) {
    for (Pending& p : pending_)
      if (!p.gather) finish(p);
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const Pending& p) { return !p.gather; }),
                   pending_.end());
  }
  float* full = f.grad.as<float>();
  float* mine = full + uint64_t(rank()) * S;
  pending_.push_back(
      {layer, false, comm_.reduce_scatter(full, mine, S, Dtype::kF32, ReduceOp::kAverage)});
  layers_[size_t(layer)].reduced = true;
}

void Sharding::gather_parameters(int layer) {
  const uint64_t S = shard_numel(layer);
  const FlatStorage& f = model_.layers()[size_t(layer)]->flat();
  float* full = f.value.as<float>();
  pending_.push_back(
      {layer, true, comm_.all_gather(full + uint64_t(rank()) * S, full, S, Dtype::kF32)});
  layers_[size_t(layer)].gathered = true;
}

void Sharding::finish(Pending& p) {
  p.request.wait();
  Layer<float>& layer = *model_.layers()[size_t(p.layer)];
  const FlatStorage& f = layer.flat();
  Backend& ops = model_.device().backend();
  LayerShard& ls = layers_[size_t(p.layer)];
  if (p.gather) {
    // The layer's masters are whole again: so is its compute copy.
    if (f.compute)
      ops.cast(f.compute.as<void>(), model_.compute_dtype(), f.value.as<void>(), Dtype::kF32,
               f.padded);
  } else if (ls.grad) {
    // This micro-step's (or these micro-steps') average into the shard; the full gradients go.
    ops.axpy(Dtype::kF32, ls.grad.as<float>(), f.grad.as<float>() + uint64_t(rank()) * ls.shard,
             ls.shard, 1.0);
    layer.release_grads();
  }
}

void Sharding::wait() {
  // In the order started (every rank started the same ones in the same order).
  for (Pending& p : pending_)
    finish(p);
  pending_.clear();
}

// "layer(s) 0, 3" for the layers whose flag `member` is false; "" when none.
std::string Sharding::missed(bool LayerShard::*member) const {
  std::vector<int> layers;
  for (size_t l = 0; l < layers_.size(); ++l)
    if (!(layers_[l].*member)) layers.push_back(int(l));
  return layers.empty() ? std::string() : "layer(s) " + layer_list(layers);
}

void Sharding::check_reduced(const std::string& who) const {
  const std::string m = missed(&LayerShard::reduced);
  if (!m.empty())
    throw std::logic_error("plugin '" + who + "' shards the gradients' reduction but did not " +
                           "reduce " + m +
                           " before GRADS_READY (headroom.shard/1 reduce_gradients)");
}

void Sharding::updated() {
  for (LayerShard& ls : layers_)
    ls.gathered = false;
}

void Sharding::check_gathered(const std::string& who) const {
  const std::string m = missed(&LayerShard::gathered);
  if (!m.empty())
    throw std::logic_error("plugin '" + who + "' shards the optimizer state but did not gather " +
                           m +
                           " after the update, by STEP_END (headroom.shard/1 gather_parameters)");
}

float* Sharding::gradient_range(int layer) const {
  const LayerShard& ls = layers_[size_t(layer)];
  if (ls.grad) return ls.grad.as<float>();
  const FlatStorage& f = model_.layers()[size_t(layer)]->flat();
  return f.grad.as<float>() + uint64_t(rank()) * ls.shard;
}

double Sharding::grad_sum_squares() {
  double sum = headroom::grad_sum_squares(model_.device().backend(), segments_);
  comm_.all_reduce_host(&sum, 1, ReduceOp::kSum);
  return sum;
}

}  // namespace headroom
