#include "core/os/host_memory.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace headroom {

HostMemory host_available_memory() {
  HostMemory m;
  if (const char* v = std::getenv("HEADROOM_TEST_HOST_MEMORY")) {
    m.bytes = std::strtoull(v, nullptr, 10);
    m.source = "HEADROOM_TEST_HOST_MEMORY";
    return m;
  }
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    // "MemAvailable:   20971520 kB"
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream is(line.substr(13));
    uint64_t kib = 0;
    std::string unit;
    if (is >> kib >> unit && unit == "kB") {
      m.bytes = kib * 1024;
      m.source = "/proc/meminfo MemAvailable";
    }
    break;
  }
  return m;
}

}  // namespace headroom
