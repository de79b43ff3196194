// headroom.estimate/1 of the zero plugins (headroom/ext/estimate.h), one source for every stage:
// what the stage shards over how many ranks, set in core's mechanisms (hr_mechanisms.world_size,
// shard, grad_reduce, prefetch_layers, param_persistence_threshold); core's closed form has the
// bytes of a rank.
#pragma once

#include <cstdint>

#include "headroom/ext/estimate.h"

namespace zero_plugin {

// What a zero plugin's [[plugins]] table sets, as far as the peak is concerned: its keys as its
// create() read them (the defaults when a key is not written).
struct Settings {
  bool overlap_comm = true;
  bool reduce_every_micro_step = true;            // zero2, zero3
  int32_t prefetch_layers = 1;                    // zero3
  uint64_t param_persistence_threshold = 100000;  // zero3: elements
};

// The estimate of ZeRO stage `stage` (1, 2 or 3). `configured`: the instance's settings, to
// estimate the config as written on the run's ranks (query->before->world_size); nullptr: the
// plugin is not in the config and proposes itself, with its defaults, on the fewest ranks of 2, 4
// and 8 (or the run's, when it has more than one) at which a rank fits memory_limit — the most when
// none does. HR_ERROR_UNSUPPORTED from a host whose mechanisms have no world size.
hr_status estimate(int stage, const Settings* configured, const hr_estimate_query* query,
                   hr_estimate_result* result);

}  // namespace zero_plugin
