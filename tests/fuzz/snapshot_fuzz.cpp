// fuzz-sources: core/run/snapshot.cpp core/os/output_file.cpp core/comm/ranks.cpp
//
// libFuzzer target for the training snapshot reader: any bytes must come back as a SnapshotData
// that keeps every rule of the format (core/run/snapshot.h) or as a ConfigError, never a crash, an
// out-of-bounds read or another exception.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/config/config.h"
#include "core/run/snapshot.h"

namespace {

uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= uint64_t(p[i]) << (8 * i);
  return v;
}

void check(const uint8_t* data, size_t size) {
  try {
    const headroom::SnapshotData d = headroom::parse_snapshot(data, size, "fuzz.hrsnap");
    // What it accepts must hold together.
    if (size < headroom::kSnapshotHeaderBytes) __builtin_trap();
    if (d.step < 1 || d.skipped_steps < 0 || d.skipped_steps > d.step) __builtin_trap();
    if (d.model.empty() || d.optimizer.empty()) __builtin_trap();
    if (get_u64(data + 16) != headroom::snapshot_checksum(data, size)) __builtin_trap();
    // The entries cover the payload exactly.
    uint64_t total = 0;
    for (const auto* items : {&d.tensors, &d.plugins})
      for (const auto& [name, bytes] : *items) {
        if (name.empty()) __builtin_trap();
        total += bytes.size();
      }
    const uint64_t manifest_len = get_u64(data + 8);
    if (total != size - headroom::kSnapshotHeaderBytes - manifest_len) __builtin_trap();
  } catch (const headroom::ConfigError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The input is the whole file: nearly always refused by its magic or its checksum.
  check(data, size);
  if (size >= headroom::kSnapshotHeaderBytes) {
    // The same with the magic and the checksum made right: reaches the manifest's checks.
    std::vector<uint8_t> file(data, data + size);
    std::memcpy(file.data(), "HRSNAP02", 8);
    const uint64_t sum = headroom::snapshot_checksum(file.data(), file.size());
    for (int i = 0; i < 8; ++i)
      file[16 + i] = uint8_t(sum >> (8 * i));
    check(file.data(), file.size());
  }
  return 0;
}
