#include "core/device/memory.h"

#include <algorithm>

namespace headroom {

const char* category_name(Category c) {
  switch (c) {
    case Category::kParameters:
      return "parameters";
    case Category::kGradients:
      return "gradients";
    case Category::kOptimizer:
      return "optimizer";
    case Category::kActivations:
      return "activations";
    case Category::kWorkspace:
      return "workspace";
    case Category::kData:
      return "data";
    case Category::kCommunication:
      return "communication";
    case Category::kPlugin:
      return "plugin";
  }
  return "unknown";
}

std::string Phase::str() const {
  std::string s;
  switch (kind) {
    case Kind::kSetup:
      return "setup (parameters, gradients)";
    case Kind::kDone:
      return "after training";
    case Kind::kData:
      s = "loading a batch";
      break;
    case Kind::kOptimizer:
      // A layer's: the host optimizer's update of it overlapped with the backward (offload).
      s = layer >= 0 ? "optimizer step of layer " + std::to_string(layer) + " (" + layer_name +
                           ") during the backward"
                     : "optimizer step";
      break;
    case Kind::kEval:
      s = "validation";
      break;
    case Kind::kForward:
    case Kind::kBackward:
      s = std::string(kind == Kind::kForward ? "forward" : "backward") + " of layer " +
          std::to_string(layer) + " (" + layer_name + ")";
      break;
  }
  if (step > 0) s += ", step " + std::to_string(step);
  if (micro_step > 0 && kind != Kind::kOptimizer && kind != Kind::kEval)
    s += ", micro-step " + std::to_string(micro_step);
  return s;
}

uint64_t TimelineSample::total() const {
  uint64_t t = 0;
  for (uint64_t b : live)
    t += b;
  return t;
}

void MemoryTracker::on_alloc(Category c, uint64_t bytes, const std::string& owner) {
  const int i = static_cast<int>(c);
  live_[i] += bytes;
  live_total_ += bytes;
  ++num_allocs_;
  peak_[i] = std::max(peak_[i], live_[i]);
  if (!owner.empty()) {
    OwnerBytes& o = owners_[owner];
    o.live += bytes;
    o.peak = std::max(o.peak, o.live);
  }
  if (live_total_ > peak_total_) {
    peak_total_ = live_total_;
    peak_phase_ = phase_;
    live_at_peak_ = live_;
    for (auto& [name, o] : owners_)
      o.at_peak = o.live;
  }
  if (live_total_ > current_.total()) current_.live = live_;
}

void MemoryTracker::on_free(Category c, uint64_t bytes, const std::string& owner) {
  const int i = static_cast<int>(c);
  live_[i] -= std::min(live_[i], bytes);
  live_total_ -= std::min(live_total_, bytes);
  if (!owner.empty()) {
    auto it = owners_.find(owner);
    if (it != owners_.end()) it->second.live -= std::min(it->second.live, bytes);
  }
}

void MemoryTracker::set_phase(const Phase& phase) {
  timeline_.push_back(current_);
  phase_ = phase;
  current_.phase = phase;
  current_.live = live_;
}

std::vector<TimelineSample> MemoryTracker::timeline() const {
  std::vector<TimelineSample> t = timeline_;
  t.push_back(current_);
  return t;
}

void MemoryTracker::reset_peaks() {
  peak_ = live_;
  peak_total_ = live_total_;
  live_at_peak_ = live_;
  peak_phase_ = phase_;
  for (auto& [name, o] : owners_)
    o.peak = o.at_peak = o.live;
}

}  // namespace headroom
