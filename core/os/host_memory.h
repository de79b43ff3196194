// How much memory this host can give a process now: what the CPU device's memory is (its
// buffers are host memory), so that `plan` of a config that needs more than the host has does not
// say it fits, and `plan --measure` knows whether the config itself can run dry here.
#pragma once

#include <cstdint>
#include <string>

namespace headroom {

struct HostMemory {
  uint64_t bytes = 0;  // 0: unknown
  std::string source;  // where it was read: "/proc/meminfo MemAvailable"
};

// Linux's MemAvailable (the memory a process can take without swapping), or unknown elsewhere.
// Test hook: HEADROOM_TEST_HOST_MEMORY (bytes) stands in for it.
HostMemory host_available_memory();

}  // namespace headroom
