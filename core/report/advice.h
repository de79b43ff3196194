// What would make a run fit: the advice that follows an out-of-memory report. Estimates come
// from the config (closed forms of the model's memory) and the tracker's numbers at the failure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device/backend.h"
#include "core/config/config.h"
#include "core/device/memory.h"

namespace headroom {

// The peak bytes of one training run by category, in closed form: parameters, gradients and
// optimizer state, plus the activations and workspace at the start of the head's backward (every
// activation still held) or of the last block's backward, whichever is higher.
struct PeakEstimate {
  ByCategory at_peak{};
  uint64_t total() const;
};
// What the run does about memory, as far as the estimate is concerned: the compute dtype (amp)
// and which blocks recompute (checkpoint).
struct Strategy {
  Dtype compute = Dtype::kF32;
  int keep_every = -1;  // -1: no recomputation; 0: every block drops; n: every n-th block keeps
};
// The strategy the config's plugin list gives (amp's dtype; checkpoint's every, every_n, sqrt —
// selective and budget count as none, an upper bound).
Strategy strategy_of(const Config& config);
PeakEstimate estimate_peak(const Config& config, int micro_batch, const Strategy& strategy = {});

// One way out: what to change, the TOML lines that do it, and the bytes it saves by category.
struct Remedy {
  std::string what;         // "micro_batch 4 with grad_accum 8 (the same batch)"
  std::string toml;         // the lines to put in the config
  ByCategory saves{};       // estimated peak bytes saved, by category
  ByCategory costs{};       // ... and added (amp's compute copies beside the fp32 masters)
  uint64_t unstranded = 0;  // free bytes now in holes too small to use, that it makes usable
  bool fits = false;        // the estimate says the run then fits memory_limit
  uint64_t peak_after = 0;  // the estimated peak with it (0 when not estimated)
};

// Remedies for a run that did not fit `limit`: smaller micro-batches at the same effective batch
// (built in), and each plugin in `available_plugins` and not yet in the config that addresses what
// filled the memory (checkpoint and amp: activations — both together when neither alone fits;
// defrag_allocator: a failure with enough free bytes but no hole large enough). Estimates start
// from the config's own plugins (strategy_of).
std::vector<Remedy> suggest_remedies(const Config& config, uint64_t limit, uint64_t requested,
                                     uint64_t free_bytes, uint64_t largest_free,
                                     const std::vector<std::string>& available_plugins);

// The remedies as the report prints them.
std::string format_remedies(const std::vector<Remedy>& remedies);

}  // namespace headroom
