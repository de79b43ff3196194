// The layout of the built-in optimizer's state in the NVMe tier's file (core/run/state_file.h),
// and the host bytes that follow from it: here, below the run and the report, so that the
// trainer's file and the planner's closed form (core/report/advice.cpp) share one definition.
//
// Segment k's state tensors (AdamW m then v; SGD's momentum) lie back to back, each rounded up to
// kStatePage bytes, so every read and write is page-aligned and O_DIRECT can take it:
//
//   file = [ seg 0: t0 | pad | t1 | pad ][ seg 1: t0 | pad | t1 | pad ] ...
//
// An update streams it piece by piece: a piece is kStateChunk elements of a segment (the same
// range of each of its tensors), or the whole segment where the update rounds stochastically (bf16
// weights or state: the rounding noise is indexed from the segment's first element, so a piece
// could not draw the noise the whole segment would). f32 updates are element-wise and
// position-free, so pieces are bitwise the whole.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/device/device.h"

namespace headroom {

constexpr uint64_t kStatePage = 4096;  // O_DIRECT's alignment of offsets, lengths and buffers
// A piece's elements: 4 MiB of each f32 tensor (a multiple of kStatePage for every dtype).
constexpr uint64_t kStateChunk = uint64_t(1) << 20;

// The elements of a segment of `numel` one piece holds at most (`chunked`: f32 updates).
inline uint64_t state_piece_numel(uint64_t numel, bool chunked) {
  return chunked ? std::min(numel, kStateChunk) : numel;
}

// One segment's state in the file and in a staging buffer: `tensors` tensors of `numel` elements
// of `dtype`, each rounded up to kStatePage.
inline uint64_t state_slot_bytes(uint64_t numel, int tensors, Dtype dtype) {
  const uint64_t bytes = numel * dtype_size(dtype);
  return uint64_t(std::max(tensors, 0)) * ((bytes + kStatePage - 1) / kStatePage * kStatePage);
}

// What the tier holds in the host ledger (category optimizer) for segments of `numels`: two
// staging buffers, each the largest piece's state (its tensors each rounded up to kStatePage)
// and one page more (the ledger's buffers are 64-byte aligned; O_DIRECT wants kStatePage). 0
// when there is no state (`tensors` 0).
inline uint64_t state_file_host_bytes(const std::vector<uint64_t>& numels, int tensors, Dtype dtype,
                                      bool chunked) {
  uint64_t largest = 0;
  for (uint64_t n : numels)
    largest = std::max(largest, state_slot_bytes(state_piece_numel(n, chunked), tensors, dtype));
  return largest ? 2 * (largest + kStatePage) : 0;
}

}  // namespace headroom
