// Where every device byte goes: categories, the phase of the training loop, and the tracker that
// keeps live and peak bytes per category, the phase at the peak, and a timeline.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace headroom {

// What a device buffer holds. Every allocation is tagged with exactly one.
enum class Category : int {
  kParameters = 0,
  kGradients,
  kOptimizer,
  kActivations,
  kWorkspace,
  kData,
  kCommunication,
  // A plugin's own memory that is none of the above (HR_MEM_PLUGIN, ABI 1.7): the tracker also
  // keeps it by the plugin that holds it.
  kPlugin,
};
constexpr int kNumCategories = 8;
using ByCategory = std::array<uint64_t, kNumCategories>;

const char* category_name(Category c);  // "parameters", "gradients", ...
inline Category category_at(int i) {
  return static_cast<Category>(i);
}

// Which part of the loop is running: what the tracker stamps on its peak and timeline, and what an
// out-of-memory report names.
struct Phase {
  // kEval: the validation forward after a step (train.eval_every).
  enum class Kind { kSetup, kData, kForward, kBackward, kOptimizer, kDone, kEval };
  Kind kind = Kind::kSetup;
  int layer = -1;          // kForward / kBackward: index into the model's layer list
  std::string layer_name;  // "embedding", "block 3", "head"
  int64_t step = 0;        // 1-based optimizer step; 0 before the first
  int micro_step = 0;      // 1-based micro-step within the step

  // "forward of layer 4 (block 3), step 2, micro-step 1"
  std::string str() const;
};

// One timeline entry: a phase and the live bytes by category at its highest point.
struct TimelineSample {
  Phase phase;
  ByCategory live{};
  uint64_t total() const;
};

// One plugin's own memory (Category::kPlugin).
struct OwnerBytes {
  uint64_t live = 0;
  uint64_t peak = 0;     // its own highest
  uint64_t at_peak = 0;  // what it held at the tracker's peak total
};

class MemoryTracker {
 public:
  // `owner`: for Category::kPlugin, the plugin that holds the buffer (its bytes are also kept
  // under its name); empty for everything else.
  void on_alloc(Category c, uint64_t bytes, const std::string& owner = {});
  void on_free(Category c, uint64_t bytes, const std::string& owner = {});
  // Closes the current phase's timeline sample and starts a new one.
  void set_phase(const Phase& phase);
  const Phase& phase() const { return phase_; }

  uint64_t live(Category c) const { return live_[static_cast<int>(c)]; }
  uint64_t live_total() const { return live_total_; }
  const ByCategory& live_by_category() const { return live_; }

  // The highest each category reached on its own.
  const ByCategory& peak_by_category() const { return peak_; }
  uint64_t peak(Category c) const { return peak_[static_cast<int>(c)]; }
  // The highest total, where it happened and what it was made of.
  uint64_t peak_total() const { return peak_total_; }
  const Phase& peak_phase() const { return peak_phase_; }
  const ByCategory& live_at_peak() const { return live_at_peak_; }

  uint64_t num_allocs() const { return num_allocs_; }

  // Category::kPlugin by the plugin that holds it, every plugin that ever allocated any.
  const std::map<std::string, OwnerBytes>& plugin_owners() const { return owners_; }

  // One sample per phase, the current one included.
  std::vector<TimelineSample> timeline() const;

  // Forget the peaks (not the live bytes): a new measurement window starts now.
  void reset_peaks();

 private:
  ByCategory live_{};
  ByCategory peak_{};
  ByCategory live_at_peak_{};
  uint64_t live_total_ = 0;
  uint64_t peak_total_ = 0;
  uint64_t num_allocs_ = 0;
  std::map<std::string, OwnerBytes> owners_;
  Phase phase_;
  Phase peak_phase_;
  std::vector<TimelineSample> timeline_;
  TimelineSample current_;  // the running phase's sample
};

}  // namespace headroom
