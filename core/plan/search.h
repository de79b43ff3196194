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
  double step_ms = 0;          // measure_step_ms: at its own micro-batch, on 2 blocks
  double step_time_ratio = 0;  // measured step time over the baseline's
};

struct SearchResult {
  uint64_t budget = 0;
  double margin = 0.03;  // of the budget kept free: the measurement's stated error for reserved
  std::vector<Candidate> candidates;  // the config as written first
  int baseline = -1;                  // the candidate the ratios are against (the first measured)
  int best = -1;                      // the fastest that fits; -1: none
};

SearchResult search(const Config& config, uint64_t budget);

std::string format_search(const Config& config, const SearchResult& r);
// One JSON object: budget, margin, the candidates (what, sets, predicted peak_bytes,
// reserved_bytes, fits, step_time_ratio) and the recommended one's index.
std::string search_json(const SearchResult& r);

// The config, whole (format_config), to `path`; OutputError when it cannot be written.
void write_config_file(const std::string& path, const Config& config);

}  // namespace headroom
