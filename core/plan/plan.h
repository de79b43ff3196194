// `headroom plan` and the advice of the out-of-memory report: the config's estimate as written
// (its [[plugins]] included) against memory_limit, and what would make it fit (core/report/advice).
#pragma once

#include <string>

#include "core/config/config.h"
#include "core/device/device.h"

namespace headroom {

struct PlanResult {
  bool fits = true;  // the estimate of the config as written fits memory_limit (or there is none)
  std::string text;  // what `plan` prints
};
// The peak by category and its total; when it does not fit, the remedies.
PlanResult plan(const Config& config);

// For the out-of-memory report: "needs about 231.64 MiB; 80.00 MiB available" (the estimate of the
// config as written against memory_limit), then the remedies for this failure.
std::string oom_advice(const Config& config, const OomReport& report);

}  // namespace headroom
