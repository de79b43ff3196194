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

bool is_zero_stage(uint32_t what) {
  return what == kShardOptimizer || what == (kShardOptimizer | kShardGradients) ||
         what == (kShardOptimizer | kShardGradients | kShardParameters);
}

uint32_t effective_partition(uint32_t asked, int world_size, bool parameters_on_host) {
  if (world_size > 1 || asked == 0) return asked;
  return (asked & kShardParameters) && parameters_on_host ? asked : uint32_t(kShardOptimizer);
}

Sharding::Sharding(Device& device, Communicator& comm, uint32_t what, uint64_t persist_below,
                   Device* rest, std::unique_ptr<ShardFile> file)
    : device_(device),
      rest_(rest ? *rest : device),
      file_(std::move(file)),
      comm_(comm),
      what_(what),
      persist_below_(persist_below) {
  if (!is_zero_stage(what))
    throw std::logic_error("sharding " + std::to_string(what) +
                           " is no ZeRO stage (each stage shards what the one before does)");
  if (offloads() && !(what & kShardParameters))
    throw std::logic_error("shards rest on the host only when the parameters are sharded");
  if (file_ && !offloads())
    throw std::logic_error("the parameter file is the host place's NVMe tier: no host place given");
}

void Sharding::to_rest(const LayerShard& ls, void* shard, const void* from, uint64_t bytes) {
  if (offloaded(ls)) {
    // A dry run (plan --measure) moves no values, and the dry op table's downloads are real:
    // into the host shards they would commit the host RAM the ledger only counts (an 8B model's
    // tens of GB).
    if (!device_.dry()) device_.backend().download(shard, from, bytes);
  } else {
    device_.backend().copy(shard, from, bytes);
  }
}

void Sharding::from_rest(const LayerShard& ls, void* to, const void* shard, uint64_t bytes) {
  if (offloaded(ls)) {
    device_.backend().upload(to, shard, bytes);
  } else {
    device_.backend().copy(to, shard, bytes);
  }
}

void Sharding::make_rested(const LayerShard& ls, Rested& shard, int part, uint64_t bytes,
                           const std::string& name) {
  shard.bytes = bytes;
  if (ls.slot >= 0)
    shard.part = part;
  else
    shard.buffer = Buffer(place_of(ls), bytes, Category::kParameters, name);
}

int Sharding::idle_staging() {
  for (int b = 0; b < ShardFile::kStagings; ++b) {
    if (staged_layer_[b] >= 0) continue;
    device_.backend().wait_uploads(b);  // the last uploads from it have read it
    return b;
  }
  throw std::logic_error("the parameter file's stagings are both being read into");
}

int Sharding::free_staging() {
  for (int b = 0; b < ShardFile::kStagings; ++b)
    if (staged_layer_[b] < 0) return idle_staging();
  // Both hold a prefetched read: the older gathering is finished first (in the order started,
  // as every rank does).
  for (const Pending& p : pending_)
    if (p.staging >= 0) {
      finish_through_gather(p.layer);
      return idle_staging();
    }
  throw std::logic_error("the parameter file's stagings are held by no gathering");
}

void Sharding::to_rest(const LayerShard& ls, Rested& shard, const void* from) {
  if (shard.part < 0) return to_rest(ls, shard.buffer.as<void>(), from, shard.bytes);
  const size_t slot = size_t(ls.slot), part = size_t(shard.part);
  const int b = idle_staging();
  if (!device_.dry()) device_.backend().download(file_->staged(b, slot, part), from, shard.bytes);
  file_->start_write(b, slot, part);
  file_->wait(b);
}

void Sharding::cast_compute_shard(LayerShard& ls, Dtype dt) {
  if (ls.compute.part < 0) {
    place_of(ls).backend().cast(ls.compute.buffer.as<void>(), dt, ls.value.as<void>(), Dtype::kF32,
                                ls.shard);
    return;
  }
  const int b = idle_staging();
  start_compute_write(ls, dt, b);
  file_->wait(b);
}

void Sharding::start_compute_write(LayerShard& ls, Dtype dt, int b) {
  if (staged_layer_[b] >= 0)
    throw std::logic_error("layer " + std::to_string(staged_layer_[b]) +
                           "'s gathering reads into the staging an update would write from");
  file_->wait(b);
  device_.backend().wait_uploads(b);
  const size_t slot = size_t(ls.slot), part = size_t(ls.compute.part);
  rest_.backend().cast(file_->staged(b, slot, part), dt, ls.value.as<void>(), Dtype::kF32,
                       ls.shard);
  file_->start_write(b, slot, part);
}

CommRequest Sharding::gather_from_rest(const LayerShard& ls, const Rested& shard, void* full,
                                       uint64_t n, Dtype dtype) {
  if (shard.part < 0) return gather_from_rest(ls, shard.buffer.as<void>(), full, n, dtype);
  // The NVMe tier, between steps (with_frozen): the part read into a staging, the rank's range
  // uploaded from it and gathered in place.
  const size_t slot = size_t(ls.slot), part = size_t(shard.part);
  const int b = idle_staging();
  file_->start_read(b, slot, part);
  file_->wait(b);
  char* mine = static_cast<char*>(full) + uint64_t(rank()) * shard.bytes;
  from_rest(ls, mine, file_->staged(b, slot, part), shard.bytes);
  device_.backend().mark_uploads(b);
  return comm_.all_gather(mine, full, n, dtype);
}

void Sharding::finish_read(Pending& p) {
  const int b = p.staging;
  file_->wait(b);
  staged_layer_[b] = -1;
  p.staging = -1;
  LayerShard& ls = layers_[size_t(p.layer)];
  Layer<float>& lay = layer(p.layer);
  const size_t slot = size_t(ls.slot);
  struct Part {
    const Rested& shard;
    void* full;
    uint64_t n;
    Dtype dtype;
  };
  std::vector<Part> parts;
  if (ls.compute)
    parts.push_back({ls.compute, lay.flat().compute.as<void>(), ls.shard, lay.compute_dtype()});
  if (ls.frozen)
    parts.push_back(
        {ls.frozen, lay.frozen_weights().as<void>(), ls.frozen_shard, lay.compute_dtype()});
  if (ls.quant)  // bytes, moved as 4-byte words
    parts.push_back({ls.quant, lay.quantized_storage().as<void>(), ls.quant_shard, Dtype::kI32});
  std::vector<CommRequest> requests;
  for (const Part& part : parts) {
    char* mine = static_cast<char*>(part.full) + uint64_t(rank()) * part.shard.bytes;
    from_rest(ls, mine, file_->staged(b, slot, size_t(part.shard.part)), part.shard.bytes);
    requests.push_back(comm_.all_gather(mine, part.full, part.n, part.dtype));
  }
  device_.backend().mark_uploads(b);
  for (CommRequest& request : requests)
    request.wait();
}

CommRequest Sharding::gather_from_rest(const LayerShard& ls, const void* shard, void* full,
                                       uint64_t n, Dtype dtype) {
  if (!offloaded(ls)) return comm_.all_gather(shard, full, n, dtype);
  const uint64_t bytes = n * dtype_size(dtype);
  char* mine = static_cast<char*>(full) + uint64_t(rank()) * bytes;
  from_rest(ls, mine, shard, bytes);
  return comm_.all_gather(mine, full, n, dtype);
}

Sharding::~Sharding() {
  // A collective still in flight here is one a failure cut short (a peer failed, this rank ran
  // out of memory): the other ranks stop on the failure's notice and never complete it, so it is
  // not waited for (a wait would last [distributed] timeout_s) but abandoned to the
  // communicator, which may still progress it — read and write its buffers — until it goes
  // (after this; core/run/trainer.cpp): the shards of its layer are then never freed, kept
  // reachable (not a leak) for the rest of the process. (The model's buffers outlive the
  // communicator.) A finished run has none in flight.
  static auto* kept = new std::vector<Buffer>();
  for (Pending& p : pending_) {
    try {
      if (p.request.test()) continue;
    } catch (...) {
    }
    p.request.abandon();
    LayerShard& ls = layers_[size_t(p.layer)];
    for (Buffer* b : {&ls.value, &ls.compute.buffer, &ls.grad, &ls.frozen.buffer, &ls.quant.buffer})
      if (*b) kept->push_back(std::move(*b));
  }
  pending_.clear();
}

void Sharding::place(Layer<float>& l) {
  const auto W = uint64_t(comm_.world_size());
  const FlatStorage& f = l.flat();
  if (f.padded % W != 0)
    throw std::logic_error("layer " + l.name() + "'s buffers are not padded to " +
                           std::to_string(W) + " ranks");
  LayerShard ls;
  ls.shard = f.padded / W;
  // The threshold counts every parameter of the layer, the frozen ones too: a LoRA block's base is
  // what zero3 shards, its adapters are few.
  const uint64_t numel = l.num_params();
  ls.whole = !(what_ & kShardParameters) || numel < persist_below_ || numel == 0;
  if (what_ & kShardGradients) {
    ls.grad = Buffer(place_of(ls), ls.shard * sizeof(float), Category::kGradients,
                     l.name() + " gradient shard");
    place_of(ls).backend().fill(Dtype::kF32, ls.grad.as<float>(), ls.shard, 0.0);
  }
  const uint64_t r = uint64_t(comm_.rank());
  // zero3: the frozen weights' and the quantized bytes' ranges (never reduced: no gradient).
  if (!ls.whole) {
    const Dtype dt = l.compute_dtype();
    const FlatStorage& z = l.frozen_flat();
    ls.frozen_shard = z.padded / W;
    ls.quant_shard = l.quantized_padded_bytes() / 4 / W;
    // The NVMe tier: the layer's slot, its parts the compute, frozen and quantized shards.
    const bool computes = f.padded > 0 && f.compute;
    if (offloaded(ls) && file_)
      ls.slot = int64_t(file_->add_slot({computes ? ls.shard * dtype_size(dt) : 0,
                                         ls.frozen_shard * dtype_size(dt), ls.quant_shard * 4}));
    if (z.padded > 0) {
      make_rested(ls, ls.frozen, kFrozenPart, ls.frozen_shard * dtype_size(dt),
                  l.name() + " frozen parameter shard (" + dtype_name(dt) + ")");
      to_rest(ls, ls.frozen, l.frozen_weights().as<char>() + r * ls.frozen.bytes);
    }
    if (ls.quant_shard > 0) {
      make_rested(ls, ls.quant, kQuantPart, ls.quant_shard * 4,
                  l.name() + " quantized frozen parameter shard");
      to_rest(ls, ls.quant, l.quantized_storage().as<char>() + r * ls.quant.bytes);
    }
    l.release_frozen();
    ls.gathered = false;
  }
  // The fp32 masters are sharded whenever the layers read something else (a compute copy, amp:
  // they are optimizer state then, as in ZeRO's 16Ψ/N) or the parameters are sharded (zero3).
  if (f.padded > 0 && (!ls.whole || f.compute)) {
    const uint64_t at = r * ls.shard;
    ls.value = Buffer(place_of(ls), ls.shard * sizeof(float), Category::kParameters,
                      l.name() + " master shard");
    to_rest(ls, ls.value.as<void>(), f.value.as<float>() + at, ls.shard * sizeof(float));
    if (!ls.whole && f.compute) {  // zero3: the compute copy's range too
      const Dtype dt = l.compute_dtype();
      make_rested(ls, ls.compute, kComputePart, ls.shard * dtype_size(dt),
                  l.name() + " parameter shard (" + dtype_name(dt) + ")");
      to_rest(ls, ls.compute, f.compute.as<char>() + at * dtype_size(dt));
    }
    if (ls.whole) {
      l.release_masters();  // the whole compute copy stays
    } else {
      l.release_parameters();
    }
  }
  layers_.push_back(std::move(ls));
}

void Sharding::attach(Gpt<float>& model) {
  if (model.layers().size() != layers_.size())
    throw std::logic_error("the model has " + std::to_string(model.layers().size()) + " layers; " +
                           std::to_string(layers_.size()) + " were placed");
  model_ = &model;
  const uint64_t r = uint64_t(comm_.rank());
  // Offloaded: the staging of the largest sharded gradient range.
  uint64_t stage = 0;
  for (const LayerShard& ls : layers_)
    if (offloaded(ls) && ls.grad) stage = std::max(stage, ls.shard);
  if (stage > 0)
    staging_ = Buffer(rest_, stage * sizeof(float), Category::kGradients,
                      "gradient staging (offloaded shards)");
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerShard& ls = layers_[l];
    const FlatStorage& f = layer(int(l)).flat();
    // This rank's range [lo, hi) of the layer, cut at the parameters' boundaries.
    const uint64_t lo = r * ls.shard, hi = lo + ls.shard;
    for (const auto& p : layer(int(l)).params()) {
      if (p->frozen) continue;  // in the layer's frozen storage, replicated: never sharded
      const uint64_t a = std::max(lo, p->offset), b = std::min(hi, p->offset + p->numel);
      if (a >= b) continue;
      OptSegment s;
      s.name = a == p->offset && b == p->offset + p->numel
                   ? p->name
                   : p->name + " [" + std::to_string(a - p->offset) + ":" +
                         std::to_string(b - p->offset) + ")";
      s.value = ls.value ? ls.value.as<float>() + (a - lo) : f.value.as<float>() + a;
      s.grad = ls.grad ? ls.grad.as<float>() + (a - lo) : f.grad.as<float>() + a;
      s.numel = b - a;
      s.decay = p->decay;
      s.on_host = offloaded(ls);
      segments_.push_back(std::move(s));
    }
  }
}

size_t Sharding::checked(int layer) const {
  if (layer < 0 || layer >= int(layers_.size()))
    throw std::logic_error("layer " + std::to_string(layer) + " does not exist (the model has " +
                           std::to_string(layers_.size()) + " layers)");
  return size_t(layer);
}

uint64_t Sharding::shard_numel(int layer) const {
  return layers_[checked(layer)].shard;
}

bool Sharding::shards_masters() const {
  for (const LayerShard& ls : layers_)
    if (ls.value) return true;
  return false;
}

void Sharding::begin_step() {
  for (LayerShard& ls : layers_)
    if (ls.grad) place_of(ls).backend().fill(Dtype::kF32, ls.grad.as<float>(), ls.shard, 0.0);
}

void Sharding::backward_done(int layer) {
  layers_[checked(layer)].reduced = false;
  for (Pending& p : pending_)
    p.request.test();
}

void Sharding::reduce_gradients(int l) {
  const uint64_t S = shard_numel(l);
  const FlatStorage& f = layer(l).flat();
  if (f.padded == 0) {  // every parameter frozen: no gradient
    layers_[size_t(l)].reduced = true;
    return;
  }
  if (!f.grad)
    throw std::logic_error("layer " + std::to_string(l) +
                           " has no gradients to reduce (reduced already since its backward)");
  for (const Pending& p : pending_)
    if (p.layer == l && !p.gather)
      throw std::logic_error("layer " + std::to_string(l) + "'s gradients are being reduced");
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
      {l, false, comm_.reduce_scatter(full, mine, S, Dtype::kF32, ReduceOp::kAverage)});
  layers_[size_t(l)].reduced = true;
}

void Sharding::gather_parameters(int l) {
  const uint64_t S = shard_numel(l);
  LayerShard& ls = layers_[size_t(l)];
  Layer<float>& lay = layer(l);
  const FlatStorage& f = lay.flat();
  if (ls.whole && f.padded == 0) {  // every parameter frozen and replicated: nothing sharded
    ls.gathered = true;
    return;
  }
  if (ls.whole) {
    // In place: the masters' updated ranges, or with sharded masters (amp) the compute copy's,
    // cast into it by updated().
    const Dtype dt = ls.value ? lay.compute_dtype() : Dtype::kF32;
    char* full = ls.value ? f.compute.as<char>() : f.value.as<char>();
    pending_.push_back(
        {l, true, comm_.all_gather(full + uint64_t(rank()) * S * dtype_size(dt), full, S, dt)});
  } else {
    if (ls.gathered) return;  // there, or on its way
    // What the layers read: the compute copy where there is one (the masters stay sharded), else
    // the masters; and the frozen weights.
    std::vector<CommRequest> requests;
    if (ls.slot >= 0) {
      // The NVMe tier: the slot's read starts now; its uploads and gatherings when it finishes.
      const int b = free_staging();
      file_->start_read(b, size_t(ls.slot));
      staged_layer_[b] = l;
      if (ls.compute) lay.allocate_compute();
      if (ls.frozen || ls.quant) lay.allocate_frozen();
      if (!ls.compute && ls.value) {  // fp32 with frozen weights: the masters from the host
        lay.allocate_masters();
        requests.push_back(
            gather_from_rest(ls, ls.value.as<void>(), f.value.as<void>(), S, Dtype::kF32));
      }
      for (CommRequest& request : requests)
        pending_.push_back({l, true, std::move(request)});
      Pending read{l, true, CommRequest()};
      read.staging = b;
      pending_.push_back(std::move(read));
      ls.gathered = true;
      return;
    }
    if (ls.compute) {
      lay.allocate_compute();
      requests.push_back(
          gather_from_rest(ls, ls.compute, f.compute.as<void>(), S, lay.compute_dtype()));
    } else if (ls.value) {
      lay.allocate_masters();
      requests.push_back(
          gather_from_rest(ls, ls.value.as<void>(), f.value.as<void>(), S, Dtype::kF32));
    }
    gather_frozen(l, requests);
    for (CommRequest& request : requests)
      pending_.push_back({l, true, std::move(request)});
  }
  ls.gathered = true;
}

void Sharding::gather_frozen(int l, std::vector<CommRequest>& into) {
  const LayerShard& ls = layers_[checked(l)];
  if (!ls.frozen && !ls.quant) return;
  Layer<float>& lay = layer(l);
  lay.allocate_frozen();
  if (ls.frozen)
    into.push_back(gather_from_rest(ls, ls.frozen, lay.frozen_weights().as<void>(), ls.frozen_shard,
                                    lay.compute_dtype()));
  if (ls.quant)  // bytes, moved as 4-byte words
    into.push_back(gather_from_rest(ls, ls.quant, lay.quantized_storage().as<void>(),
                                    ls.quant_shard, Dtype::kI32));
}

void Sharding::finish_through_gather(int l) {
  size_t last = pending_.size();
  for (size_t i = 0; i < pending_.size(); ++i)
    if (pending_[i].gather && pending_[i].layer == l) last = i;
  if (last == pending_.size()) return;
  for (size_t i = 0; i <= last; ++i)
    finish(pending_[i]);
  pending_.erase(pending_.begin(), pending_.begin() + std::ptrdiff_t(last + 1));
}

void Sharding::release_parameters(int l) {
  LayerShard& ls = layers_[checked(l)];
  if (ls.whole)
    throw std::logic_error("layer " + std::to_string(l) + " keeps its parameters whole (" +
                           std::to_string(layer(l).flat().numel) +
                           " elements, below the persistence threshold, or not sharded)");
  if (!ls.gathered) return;
  finish_through_gather(l);  // the collective writes into the buffer about to go
  layer(l).release_parameters();
  layer(l).release_frozen();
  ls.gathered = false;
}

void Sharding::require_parameters(int l, int tied, const char* what, const std::string& who) {
  for (const int need : {l, tied}) {
    if (need < 0) continue;
    const LayerShard& ls = layers_[checked(need)];
    if (ls.whole) continue;
    if (!ls.gathered)
      throw std::logic_error("plugin '" + who +
                             "' shards the parameters but did not gather layer " +
                             std::to_string(need) + "'s before layer " + std::to_string(l) + "'s " +
                             what + " (headroom.shard/1 gather_parameters)");
    finish_through_gather(need);
  }
}

void Sharding::finish(Pending& p) {
  if (p.staging >= 0) return finish_read(p);
  p.request.wait();
  Layer<float>& lay = layer(p.layer);
  const FlatStorage& f = lay.flat();
  Backend& ops = device_.backend();
  LayerShard& ls = layers_[size_t(p.layer)];
  if (p.gather) {
    // A whole layer's masters are whole again: so is its compute copy. (With sharded masters the
    // compute copy was gathered itself.)
    if (ls.whole && f.compute && f.value)
      ops.cast(f.compute.as<void>(), lay.compute_dtype(), f.value.as<void>(), Dtype::kF32,
               f.padded);
  } else if (ls.grad) {
    // This micro-step's (or these micro-steps') average into the shard; the full gradients go.
    // Offloaded: read back into the staging and added there, by the host's ops.
    const float* reduced = f.grad.as<float>() + uint64_t(rank()) * ls.shard;
    if (offloaded(ls)) {
      if (!device_.dry()) ops.download(staging_.as<void>(), reduced, ls.shard * sizeof(float));
      reduced = staging_.as<float>();
    }
    place_of(ls).backend().axpy(Dtype::kF32, ls.grad.as<float>(), reduced, ls.shard, 1.0);
    lay.release_grads();
  }
}

void Sharding::wait() {
  // In the order started (every rank started the same ones in the same order).
  for (Pending& p : pending_)
    finish(p);
  pending_.clear();
}

// "layer(s) 0, 3" for the layers `miss` holds for; "" when none.
std::string Sharding::missed(const std::function<bool(const LayerShard&)>& miss) const {
  std::vector<int> layers;
  for (size_t l = 0; l < layers_.size(); ++l)
    if (miss(layers_[l])) layers.push_back(int(l));
  return layers.empty() ? std::string() : "layer(s) " + layer_list(layers);
}

void Sharding::check_reduced(const std::string& who) const {
  const std::string m = missed([](const LayerShard& ls) { return !ls.reduced; });
  if (!m.empty())
    throw std::logic_error("plugin '" + who + "' shards the gradients' reduction but did not " +
                           "reduce " + m +
                           " before GRADS_READY (headroom.shard/1 reduce_gradients)");
}

void Sharding::updated() {
  Backend& ops = device_.backend();
  int staging = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    LayerShard& ls = layers_[l];
    Layer<float>& lay = layer(int(l));
    const Dtype dt = lay.compute_dtype();
    if (ls.whole) {
      // Sharded masters (amp): this rank's range of the compute copy follows them; the gather
      // brings the others'.
      if (ls.value)
        ops.cast(lay.flat().compute.as<char>() + uint64_t(rank()) * ls.shard * dtype_size(dt), dt,
                 ls.value.as<void>(), Dtype::kF32, ls.shard);
      ls.gathered = false;
    } else if (ls.compute.part >= 0) {
      // The NVMe tier: cast into a staging, the write started while the next layer's is cast
      // into the other (the previous write from it waited for first).
      start_compute_write(ls, dt, staging++ % ShardFile::kStagings);
    } else if (ls.compute) {
      cast_compute_shard(ls, dt);
    }
  }
  // In the file before anything reads it (the next gathering).
  for (int b = 0; file_ && b < ShardFile::kStagings; ++b)
    file_->wait(b);
}

void Sharding::check_step_end(const std::string& who) const {
  const std::string m = missed([](const LayerShard& ls) { return ls.whole && !ls.gathered; });
  if (!m.empty())
    throw std::logic_error("plugin '" + who + "' shards the optimizer state but did not gather " +
                           m +
                           " after the update, by STEP_END (headroom.shard/1 gather_parameters)");
  const std::string kept = missed([](const LayerShard& ls) { return !ls.whole && ls.gathered; });
  if (!kept.empty())
    throw std::logic_error("plugin '" + who + "' shards the parameters but left " + kept +
                           " gathered at the end of STEP_END: nothing gathered may outlive a "
                           "step (headroom.shard/1 release_parameters)");
}

void Sharding::with_masters(int l, bool gather, bool scatter, const std::function<void()>& f) {
  with_frozen(l, scatter, [&] { with_trainable_masters(l, gather, scatter, f); });
}

void Sharding::with_frozen(int l, bool scatter, const std::function<void()>& f) {
  LayerShard& ls = layers_[checked(l)];
  if (!ls.frozen && !ls.quant) {  // replicated, or none
    f();
    return;
  }
  if (ls.gathered)
    throw std::logic_error("layer " + std::to_string(l) + " is gathered between steps");
  Layer<float>& lay = layer(l);
  struct Release {  // however f ends
    Layer<float>& layer;
    ~Release() { layer.release_frozen(); }
  } release{lay};
  std::vector<CommRequest> requests;
  gather_frozen(l, requests);
  for (CommRequest& request : requests)
    request.wait();
  f();
  if (!scatter) return;
  Backend& ops = device_.backend();
  const uint64_t r = uint64_t(rank());
  if (ls.frozen) to_rest(ls, ls.frozen, lay.frozen_weights().as<char>() + r * ls.frozen.bytes);
  if (ls.quant) to_rest(ls, ls.quant, lay.quantized_storage().as<char>() + r * ls.quant.bytes);
  ops.synchronize();
}

void Sharding::with_trainable_masters(int l, bool gather, bool scatter,
                                      const std::function<void()>& f) {
  LayerShard& ls = layers_[checked(l)];
  if (!ls.value) {  // whole masters: nothing to make
    f();
    return;
  }
  if (!ls.whole && ls.gathered)
    throw std::logic_error("layer " + std::to_string(l) + " is gathered between steps");
  Layer<float>& lay = layer(l);
  const FlatStorage& fs = lay.flat();
  lay.allocate_masters();
  // Freed again however f ends (fp32 zero3: they are its gathered parameters too).
  struct Release {
    Layer<float>& layer;
    ~Release() { layer.release_masters(); }
  } release{lay};
  if (gather)
    gather_from_rest(ls, ls.value.as<void>(), fs.value.as<void>(), ls.shard, Dtype::kF32).wait();
  f();
  if (!scatter) return;
  Backend& ops = device_.backend();
  to_rest(ls, ls.value.as<void>(), fs.value.as<float>() + uint64_t(rank()) * ls.shard,
          ls.shard * sizeof(float));
  const Dtype dt = lay.compute_dtype();
  if (ls.compute) {  // zero3: the compute copy's shard
    cast_compute_shard(ls, dt);
  } else if (fs.compute) {  // a whole compute copy (amp, zero1/zero2)
    ops.cast(fs.compute.as<void>(), dt, fs.value.as<void>(), Dtype::kF32, fs.padded);
  }
  ops.synchronize();
}

MasterAccess Sharding::master_access(bool gather, bool scatter) {
  if (!shards_masters() && !frozen_access()) return nullptr;
  return [this, gather, scatter](int l, const std::function<void()>& f) {
    with_masters(l, gather, scatter, f);
  };
}

MasterAccess Sharding::frozen_access() {
  const bool any = std::any_of(layers_.begin(), layers_.end(),
                               [](const LayerShard& ls) { return ls.frozen || ls.quant; });
  if (!any) return nullptr;
  return [this](int l, const std::function<void()>& f) { with_frozen(l, true, f); };
}

float* Sharding::gradient_range(int l) const {
  const LayerShard& ls = layers_[checked(l)];
  if (ls.grad) return ls.grad.as<float>();
  const FlatStorage& f = layer(l).flat();
  return f.grad.as<float>() + uint64_t(rank()) * ls.shard;
}

double Sharding::grad_sum_squares() {
  double sum = headroom::grad_sum_squares(device_, segments_);
  comm_.all_reduce_host(&sum, 1, ReduceOp::kSum);
  return sum;
}

}  // namespace headroom
