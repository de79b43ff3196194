// Bytes and element sizes in words, one definition for core and the in-tree plugins (C++17,
// header-only, depends on nothing of either): "1.50 MiB", and the size of an hr_dtype's element.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "headroom/plugin.h"

namespace headroom_units {

// "512 B", "1.50 KiB", "3.25 MiB", "1.07 GiB" (binary units, two decimals).
inline std::string format_bytes(uint64_t bytes) {
  char buf[64];
  const double kib = 1024.0, mib = kib * 1024.0, gib = mib * 1024.0;
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else if (bytes < (uint64_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(bytes) / kib);
  } else if (bytes < (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / mib);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / gib);
  }
  return buf;
}

// "64.00 KiB (65536 bytes)": the exact count too, where a message quotes a configured size.
inline std::string format_bytes_exact(uint64_t bytes) {
  return format_bytes(bytes) + " (" + std::to_string(bytes) + " bytes)";
}

// Bytes of one element of an hr_dtype (the host's Dtype numbers its values alike); 0 for a value
// outside the enum.
inline uint64_t dtype_size(uint32_t dtype) {
  switch (dtype) {
    case HR_DTYPE_F32:
    case HR_DTYPE_I32:
      return 4;
    case HR_DTYPE_BF16:
    case HR_DTYPE_F16:
      return 2;
    case HR_DTYPE_F64:
      return 8;
    default:
      return 0;
  }
}

}  // namespace headroom_units
