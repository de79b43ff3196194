// The layout of the built-in optimizer's state in the NVMe tier's file (core/run/state_file.h),
// and the host bytes that follow from it: here, below the run and the report, so that the
// trainer's file and the planner's closed form (core/report/advice.cpp) share one definition.
//
// Segment k's state tensors (AdamW m then v; SGD's momentum) lie back to back, each rounded up to
// kStatePage bytes, so every read and write is page-aligned and O_DIRECT can take it:
//
//   file = [ seg 0: t0 | pad | t1 | pad ][ seg 1: t0 | pad | t1 | pad ] ...
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/device/device.h"

namespace headroom {

constexpr uint64_t kStatePage = 4096;  // O_DIRECT's alignment of offsets, lengths and buffers

// One segment's state in the file and in a staging buffer: `tensors` tensors of `numel` elements
// of `dtype`, each rounded up to kStatePage.
inline uint64_t state_slot_bytes(uint64_t numel, int tensors, Dtype dtype) {
  const uint64_t bytes = numel * dtype_size(dtype);
  return uint64_t(std::max(tensors, 0)) * ((bytes + kStatePage - 1) / kStatePage * kStatePage);
}

// What the tier holds in the host ledger (category optimizer) for segments of `numels`: two
// staging buffers, each the largest slot and one page more (the ledger's buffers are 64-byte
// aligned; O_DIRECT wants kStatePage). 0 when there is no state (`tensors` 0).
inline uint64_t state_file_host_bytes(const std::vector<uint64_t>& numels, int tensors,
                                      Dtype dtype) {
  uint64_t largest = 0;
  for (uint64_t n : numels)
    largest = std::max(largest, state_slot_bytes(n, tensors, dtype));
  return largest ? 2 * (largest + kStatePage) : 0;
}

}  // namespace headroom
