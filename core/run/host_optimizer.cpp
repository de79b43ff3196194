#include "core/run/host_optimizer.h"

#include <stdexcept>
#include <string>

namespace headroom {

bool streams_in_pieces(const std::vector<OptSegment>& segments, Dtype state) {
  if (state != Dtype::kF32) return false;
  for (const OptSegment& s : segments)
    if (s.value_dtype != Dtype::kF32) return false;
  return true;
}

ByCategory host_optimizer_bytes(const std::vector<OptSegment>& segments, uint64_t state_tensors,
                                Dtype state, bool masters_on_host) {
  ByCategory b{};
  for (const OptSegment& s : segments) {
    b[int(Category::kOptimizer)] += state_tensors * s.numel * dtype_size(state);
    if (s.on_host) continue;  // an offloaded shard: no copies
    // The masters (f32) and their compute-dtype copy (the segment's), or the copy of the values.
    b[int(Category::kParameters)] +=
        s.numel * ((masters_on_host ? dtype_size(Dtype::kF32) : 0) + dtype_size(s.value_dtype));
    b[int(Category::kGradients)] += s.numel * dtype_size(s.grad_dtype);
  }
  return b;
}

namespace {

// A segment's host copies: its values and its gradient, in the host ledger.
Buffer host_values(Device& host, const OptSegment& s) {
  return Buffer(host, s.numel * dtype_size(s.value_dtype), Category::kParameters,
                s.name + " (host copy)");
}
Buffer host_grad(Device& host, const OptSegment& s) {
  return Buffer(host, s.numel * dtype_size(s.grad_dtype), Category::kGradients,
                s.name + " gradient (host copy)");
}

}  // namespace

HostOptimizer::HostOptimizer(Device& device, Device& host, std::unique_ptr<Optimizer> inner,
                             std::unique_ptr<StateFile> file)
    : device_(device), host_(host), inner_(std::move(inner)), file_(std::move(file)) {
  rounding_seed_ = inner_->rounding_seed();
}

HostOptimizer::~HostOptimizer() {
  // The device may still read a host copy it was last uploaded from.
  if (uploads_pending_) device_.backend().synchronize();
}

void HostOptimizer::allocate(const std::vector<OptSegment>& segments) {
  if (!on_host_.empty() || segments.empty()) return;
  // Made whole or not at all: an allocation past the host's wall leaves nothing half made.
  std::vector<OptSegment> on_host = segments;
  std::vector<Buffer> values, grads, casts;
  values.reserve(segments.size());
  grads.reserve(segments.size());
  const bool masters = masters_on_host();
  if (masters && values_.size() != segments.size())
    throw std::logic_error("HostOptimizer: " + std::to_string(segments.size()) + " segments over " +
                           std::to_string(values_.size()) + " host masters");
  for (size_t k = 0; k < on_host.size(); ++k) {
    OptSegment& s = on_host[k];
    s.compute = nullptr;  // the device's: the host makes and uploads its own copies (step)
    if (s.on_host) {
      // Offloaded parameter shards (core/shard/sharding.h): already in the host ledger, where
      // the update runs in place; no copies, nothing read back or uploaded.
      if (masters) throw std::logic_error("HostOptimizer: host masters of an offloaded shard");
      values.emplace_back();
      grads.emplace_back();
      continue;
    }
    if (masters) {
      // The masters taken from the device (take_masters): the update's f32 values; the
      // segment's own dtype is the compute copy's, which the host makes for the upload.
      const auto at = master_index_.find(s.name);
      if (at == master_index_.end() || at->second != k)
        throw std::logic_error("HostOptimizer: segment " + s.name +
                               " is not the host master at its index");
      casts.push_back(Buffer(host_, s.numel * dtype_size(s.value_dtype), Category::kParameters,
                             s.name + " (host compute copy)"));
      s.value = values_[k].as<void>();
      s.value_dtype = Dtype::kF32;
    } else {
      values.push_back(host_values(host_, s));
      s.value = values.back().as<void>();
    }
    grads.push_back(host_grad(host_, s));
    s.grad = grads.back().as<void>();
  }
  if (file_ && !file_->is_open()) {
    std::vector<uint64_t> numels;
    for (const OptSegment& s : segments)
      numels.push_back(s.numel);
    file_->open(numels, int(inner_->state_kinds().size()), inner_->state_dtype(),
                streams_in_pieces(on_host, inner_->state_dtype()));
  }
  if (masters) {
    casts_ = std::move(casts);
    values_current_ = true;  // they are the masters
  } else {
    values_ = std::move(values);
  }
  grads_ = std::move(grads);
  on_host_ = std::move(on_host);
}

void HostOptimizer::take_masters(Layer<float>& layer) {
  if (!on_host_.empty())
    throw std::logic_error("HostOptimizer::take_masters after the first update");
  Backend& ops = device_.backend();
  for (const auto& p : layer.params()) {
    if (p->frozen) continue;  // no masters beside a compute copy (refused with offload anyway)
    Buffer master(host_, p->numel * sizeof(float), Category::kParameters,
                  p->name + " (host master)");
    ops.download(master.as<void>(), p->master().value, p->numel * sizeof(float));
    master_index_[p->name] = values_.size();
    values_.push_back(std::move(master));
  }
  layer.release_masters();
}

MasterAccess HostOptimizer::master_access(Gpt<float>& model, bool scatter) {
  if (!masters_on_host()) return nullptr;
  return [this, &model, scatter](int l, const std::function<void()>& f) {
    Layer<float>& layer = *model.layers().at(size_t(l));
    const FlatStorage& fs = layer.flat();
    if (fs.padded == 0) return f();
    Backend& ops = device_.backend();
    // The last update's uploads may read the host copies a scatter rewrites.
    if (uploads_pending_) ops.synchronize();
    uploads_pending_ = false;
    layer.allocate_masters();
    struct Release {  // however f ends
      Layer<float>& layer;
      ~Release() { layer.release_masters(); }
    } release{layer};
    // Always the host's values, also for a load: one that writes some of the parameters keeps
    // the others.
    for (const auto& p : layer.params())
      if (!p->frozen)
        ops.upload(p->master().value, values_.at(master_index_.at(p->name)).as<void>(),
                   p->numel * sizeof(float));
    f();
    if (scatter) {
      for (const auto& p : layer.params())
        if (!p->frozen)
          ops.download(values_.at(master_index_.at(p->name)).as<void>(), p->master().value,
                       p->numel * sizeof(float));
      ops.cast(fs.compute.as<void>(), layer.compute_dtype(), fs.value.as<void>(), Dtype::kF32,
               fs.padded);
    }
    ops.synchronize();
  };
}

void HostOptimizer::gradients_final(const std::vector<OptSegment>& segments, size_t first,
                                    size_t last, double lr, int64_t step, bool update) {
  if (file_) throw std::logic_error("HostOptimizer: the NVMe tier updates in step() alone");
  allocate(segments);
  if (first > last || last > segments.size())
    throw std::logic_error("HostOptimizer: segments [" + std::to_string(first) + ", " +
                           std::to_string(last) + ") of " + std::to_string(segments.size()));
  Backend& ops = device_.backend();
  if (early_step_ != step) {
    // The step's first: the last step's uploads read host copies about to change.
    if (uploads_pending_) ops.synchronize();
    uploads_pending_ = false;
    early_.assign(segments.size(), false);
    updated_.assign(segments.size(), false);
    arriving_first_ = arriving_last_ = 0;
    early_step_ = step;
  }
  // The segments named before: their gradients are here once their downloads are.
  if (update && arriving_last_ > arriving_first_) ops.wait_downloads();
  const size_t ready_first = arriving_first_, ready_last = update ? arriving_last_ : ready_first;
  // These start back while the host updates those (a dry run moves nothing: step()'s reason).
  for (size_t k = first; k < last && !device_.dry(); ++k)
    if (!segments[k].on_host)
      ops.download_async(on_host_[k].grad, segments[k].grad,
                         segments[k].numel * dtype_size(segments[k].grad_dtype));
  for (size_t k = first; k < last; ++k)
    early_[k] = true;
  arriving_first_ = first;
  arriving_last_ = last;
  update_on_host(segments, ready_first, ready_last, lr, step);
  for (size_t k = ready_first; k < ready_last; ++k)
    updated_[k] = true;
}

void HostOptimizer::update_on_host(const std::vector<OptSegment>& segments, size_t first,
                                   size_t last, double lr, int64_t step) {
  if (first >= last) return;
  Backend& ops = device_.backend();
  for (size_t k = first; k < last && !values_current_ && !device_.dry(); ++k)
    if (!segments[k].on_host)
      ops.download(on_host_[k].value, segments[k].value,
                   segments[k].numel * dtype_size(segments[k].value_dtype));
  inner_->set_rounding_seed(rounding_seed_);
  // The state's tensors, segment by segment (Optimizer::state lists each segment's kinds in turn).
  const size_t kinds = inner_->state_kinds().size();
  const std::vector<StateTensor> state =
      kinds > 0 ? inner_->state(on_host_) : std::vector<StateTensor>{};
  for (size_t k = first; k < last; ++k) {
    void* tensors[2] = {nullptr, nullptr};
    for (size_t j = 0; j < kinds && j < 2; ++j)
      tensors[j] = state.at(k * kinds + j).data;
    inner_->step_segment(on_host_[k], k, tensors, lr, step);
    upload_weights(segments[k], k);
  }
  uploads_pending_ = true;
}

void HostOptimizer::upload_weights(const OptSegment& d, size_t k) {
  if (d.on_host) return;  // updated in place
  const void* from = on_host_[k].value;
  if (!casts_.empty()) {
    // The host masters' compute-dtype copy, rounded as Gpt::sync_compute_params rounds.
    host_.backend().cast(casts_[k].as<void>(), d.value_dtype, from, Dtype::kF32, d.numel);
    from = casts_[k].as<void>();
  }
  device_.backend().upload(d.value, from, d.numel * dtype_size(d.value_dtype));
}

void HostOptimizer::step(const std::vector<OptSegment>& segments, double lr, int64_t step) {
  allocate(segments);
  Backend& ops = device_.backend();
  if (early_step_ == step) {
    // The backward started the gradients back layer by layer (gradients_final), and updated the
    // layers named before the last where it could: every other segment now, one by one as step()
    // would (each segment's update is its own: the order changes no value), its gradients read
    // back first where none was started.
    ops.wait_downloads();
    for (size_t k = 0; k < segments.size(); ++k) {
      if (updated_[k]) continue;
      if (!early_[k] && !device_.dry() && !segments[k].on_host)
        ops.download(on_host_[k].grad, segments[k].grad,
                     segments[k].numel * dtype_size(segments[k].grad_dtype));
      update_on_host(segments, k, k + 1, lr, step);
    }
    values_current_ = true;
    arriving_first_ = arriving_last_ = 0;
    early_step_ = 0;
    return;
  }
  // The last update's uploads read the host copies: done before they change again.
  if (uploads_pending_) ops.synchronize();
  uploads_pending_ = false;
  // A dry run (plan --measure) holds no values, and the dry op table's downloads are real (they
  // usually land in the caller's own memory): into the host copies they would only write their
  // unbacked mappings, committing 8 bytes a parameter of host RAM (an 8B model's 64 GB) for
  // ledgers that hold the same bytes without them.
  for (size_t k = 0; k < segments.size() && !device_.dry(); ++k) {
    const OptSegment& d = segments[k];
    const OptSegment& h = on_host_[k];
    if (d.on_host) continue;  // in the host ledger already
    if (!values_current_) ops.download(h.value, d.value, d.numel * dtype_size(d.value_dtype));
    ops.download(h.grad, d.grad, d.numel * dtype_size(d.grad_dtype));
  }
  values_current_ = true;
  inner_->set_rounding_seed(rounding_seed_);
  if (file_ && device_.dry()) {
    // A dry run computes nothing: the state's reads and writes would only fill the disk.
  } else if (file_)
    file_->stream([&](size_t k, uint64_t first, uint64_t n, void* const* state) {
      // Elements [first, first + n) of segment k: the same rounding stream (k), so a whole
      // segment is bitwise step()'s, and a piece is where nothing rounds stochastically.
      OptSegment piece = on_host_[k];
      piece.value =
          static_cast<unsigned char*>(piece.value) + first * dtype_size(piece.value_dtype);
      piece.grad = static_cast<unsigned char*>(piece.grad) + first * dtype_size(piece.grad_dtype);
      piece.numel = n;
      inner_->step_segment(piece, k, state, lr, step);
    });
  else
    inner_->step(on_host_, lr, step);
  for (size_t k = 0; k < segments.size(); ++k)
    upload_weights(segments[k], k);
  uploads_pending_ = true;
}

void HostOptimizer::resize(const std::vector<OptSegment>& segments,
                           const std::vector<ParamResize>& changes) {
  if (on_host_.empty()) return;  // nothing made yet: made at the new sizes
  if (uploads_pending_) device_.backend().synchronize();
  uploads_pending_ = false;
  for (const ParamResize& r : changes) {
    const OptSegment& s = segments.at(r.param);
    values_.at(r.param).reset();
    grads_.at(r.param).reset();
    values_[r.param] = host_values(host_, s);
    grads_[r.param] = host_grad(host_, s);
  }
  on_host_ = segments;
  for (size_t k = 0; k < on_host_.size(); ++k) {
    on_host_[k].value = values_[k].as<void>();
    on_host_[k].grad = grads_[k].as<void>();
    on_host_[k].compute = nullptr;
  }
  values_current_ = false;
  inner_->resize(on_host_, changes);
}

std::vector<Optimizer::StateTensor> HostOptimizer::state(const std::vector<OptSegment>& segments) {
  allocate(segments);
  if (!file_) return inner_->state(on_host_);
  // The file's, mapped (StateFile::map): what a snapshot reads, or a resume writes before the
  // next update streams it.
  const std::vector<std::string> kinds = inner_->state_kinds();
  const std::vector<void*> data = file_->map();
  std::vector<StateTensor> out;
  for (size_t k = 0; k < on_host_.size(); ++k)
    for (size_t j = 0; j < kinds.size(); ++j)
      out.push_back({on_host_[k].name + " " + kinds[j], data[k * kinds.size() + j],
                     on_host_[k].numel, inner_->state_dtype()});
  return out;
}

}  // namespace headroom
