// clang-format off
// fuzz-sources: core/report/alloc_trace.cpp core/device/arena.cpp core/device/backend.cpp core/device/backend_cpu.cpp core/config/config.cpp core/config/config_keys.cpp core/config/hf_config.cpp core/device/device.cpp core/device/dry_backend.cpp core/events/events.cpp core/device/memory.cpp core/model/model.cpp core/os/output_file.cpp core/os/interrupt.cpp core/plugin_host/*.cpp core/comm/comm.cpp core/comm/self_comm.cpp core/comm/ranks.cpp core/shard/*.cpp core/os/direct_file.cpp core/optim/optim.cpp
// fuzz-pkgs: openblas liburing
// fuzz-flags: -DHEADROOM_INSTALL_LIBDIR="lib" -DHEADROOM_INSTALL_PLUGIN_DIR="/nonexistent" -DHEADROOM_BUILD_PLUGIN_DIR="/nonexistent" -DHEADROOM_BUILD_DIR="/nonexistent" -DHEADROOM_VERSION="fuzz"
// clang-format on
//
// libFuzzer target for the allocation trace reader (and the replay of what it accepts): any text
// must come back as a trace that keeps every rule of the format (core/report/alloc_trace.h) or as a
// ConfigError, never a crash, a hang, an out-of-bounds read or another exception. (Replay is what
// pulls in the device and plugin host sources.)
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <unordered_map>

#include "core/config/config.h"
#include "core/report/alloc_trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  headroom::AllocTrace t;
  try {
    t = headroom::parse_alloc_trace(in, "fuzz.trace");
  } catch (const headroom::ConfigError&) {
    return 0;
  }
  // What it accepts must hold together.
  if (t.memory_limit > headroom::kMaxTraceBytes || t.phases.empty()) __builtin_trap();
  std::unordered_map<uint64_t, uint64_t> live;
  uint64_t allocs = 0, total = 0;
  for (size_t i = 0; i < t.records.size(); ++i) {
    const headroom::TraceRecord& r = t.records[i];
    if (r.seq != i || r.phase >= t.phases.size() || r.bytes > headroom::kMaxTraceBytes)
      __builtin_trap();
    if (r.op == headroom::TraceRecord::Op::kAlloc) {
      if (r.id != ++allocs) __builtin_trap();
      live[r.id] = r.bytes;
      total += r.bytes;
    } else {
      const auto it = live.find(r.id);
      if (it == live.end() || it->second != r.bytes) __builtin_trap();
      live.erase(it);
    }
  }
  // Replay it under a small memory limit (a CPU arena of at most 1 MiB, so that no request can
  // ask the host for more): it completes or stops at an allocation that did not fit.
  headroom::Config c;
  c.device.memory_limit = t.memory_limit > 0 && t.memory_limit <= (1u << 20) ? 0 : 1u << 20;
  try {
    const headroom::ReplayResult r =
        headroom::replay_alloc_trace(t, c, headroom::ReplayOptions{false, 0});
    if (r.failed ? r.allocations >= allocs : r.allocations != allocs) __builtin_trap();
    if (r.peak_live > total) __builtin_trap();
  } catch (const headroom::ConfigError&) {
  }
  return 0;
}
