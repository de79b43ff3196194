// `headroom plan --measure --search`: the setups that could run the config's effective batch under
// a budget, each measured as `plan --measure` measures (core/plan/measure.h), and the fastest that
// fits with a margin. The candidates: micro_batch × grad_accum splits with the same sequences per
// step; every installed plugin that offers headroom.estimate/1, as it proposes itself for this
// budget (core/report/advice.h), and the proposals combined until they fit. The closed forms
// prune what is far over the budget; the measurement decides. No plugin is named here.
#pragma once

#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/plan/measure.h"

namespace headroom {

struct Candidate {
  std::string what;               // "as written", "micro_batch 2 x grad_accum 16", a remedy's
  std::vector<std::string> sets;  // what it changes, as --set flags
  std::string toml;               // the [[plugins]] tables it adds
  Config config;                  // the whole config, with the caller's memory_limit
  uint64_t closed_form = 0;       // the closed form's peak
  bool measured = false;
  std::string skipped;  // why it was not measured, or its dry run refused
  Measured m;
  bool fits = false;           // measured reserved <= budget less the margin
  std::vector<double> times;   // measure_step_ms of each timing round
  double step_ms = 0;          // the fastest of them: at its own micro-batch, on 2 blocks
  double step_time_ratio = 0;  // measured step time over the baseline's
  bool untimed = false;        // fits, but the deadline came before it was timed
  // The host ledger (the optimizer offloaded, docs/design.md "Places"): its measured peak
  // (m.host_peak) against the host's wall, and the offload's step cost estimated from rates
  // measured on this machine (OffloadRates). Device-only candidates have m.host_peak 0.
  bool host_fits = true;
  std::string host_wall;  // "[host] memory_limit 8.00 GiB", or this host's available memory
  double offload_ms = 0;  // estimated transfer + host update a step (0: nothing offloaded)
  double transfer_ms = 0, update_ms = 0;
  uint64_t transfer_bytes = 0, update_elements = 0;
};

// The rates an offloaded optimizer's step cost is estimated from, timed at plan time on this
// machine (a fixed table would describe some other machine): a host memcpy of 64 MiB (the CPU
// device's "transfer"; on a GPU the PCIe copy bounds it instead, and it is not measured here) and
// the CPU AdamW kernel the host update runs (Backend::adamw_update on 4 Mi f32 elements, the
// threads of the CPU backend), each the fastest of 3.
struct OffloadRates {
  double copy_bytes_per_s = 0;
  double adamw_elements_per_s = 0;
};
OffloadRates measure_offload_rates();

struct SearchResult {
  uint64_t budget = 0;
  double margin = 0.03;  // of the budget kept free: the measurement's stated error for reserved
  std::vector<Candidate> candidates;  // the config as written first
  int baseline = -1;                  // the candidate the ratios are against (the first measured)
  int best = -1;                      // the pick (below); -1: none
  // The search starts no measurement past its deadline (it ends within it and the one in
  // flight): a candidate not measured (or a fitting one not timed) then is left, counted here and
  // marked.
  double deadline_s = 0;
  double wall_s = 0;
  int past_deadline = 0;
  // What became of the candidates: measured (dry) or skipped (not measured: pruned by the closed
  // form, refused, a duplicate, more ranks than a dry run has, or past the deadline), and of the
  // measured ones those that fit and were timed. The output states each count.
  int measured = 0, skipped = 0, timed = 0;
  // Timing: rounds until the fastest stayed the fastest for two rounds (at most kMaxTimingRounds);
  // the noise is the spread of the fastest's rounds, (slowest - fastest) / fastest, at least 3%.
  int rounds = 0;
  bool ranking_stable = false;
  int within_noise = 0;  // the fitting candidates within the noise of the fastest, it included
  double noise = 0;      // that noise: the median spread of the candidates' rounds, at least 3%
  OffloadRates rates;    // timed when a candidate offloads (0 otherwise)
  // No candidate that keeps everything on the device fits, and one that offloads does: the pick
  // is an offload one (step cost estimated in it).
  bool offload_only = false;
};

// The search's deadline unless one is given: a tiny model's whole search takes seconds; a large
// one's dry runs are what it bounds.
constexpr double kSearchDeadlineS = 120;
constexpr int kMaxTimingRounds = 5;

SearchResult search(const Config& config, uint64_t budget, double deadline_s = kSearchDeadlineS);

// The recommendation among the timed candidates that fit: the fastest, unless others are within
// the timing noise of it (their fastest round within the median spread of the candidates' rounds
// of it, and at least 3%):
// then the one of those with the lowest reserved peak (the fastest of equal ones), since timing
// cannot tell them apart. Candidates that offload (m.host_peak > 0) only when none that keeps
// everything on the device fits: their timing on this machine does not see a GPU's host<->device
// copies, so their measured time does not rank them against the device-only ones. Sets r.best,
// r.within_noise and r.offload_only.
void pick_recommended(SearchResult& r);

std::string format_search(const Config& config, const SearchResult& r);
// One JSON object: budget, margin, the candidates (what, sets, predicted peak_bytes,
// reserved_bytes, fits, step_time_ratio) and the recommended one's index.
std::string search_json(const SearchResult& r);

// The config, whole (format_config), to `path`; OutputError when it cannot be written.
void write_config_file(const std::string& path, const Config& config);

}  // namespace headroom
