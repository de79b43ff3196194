// fuzz-sources: core/model/safetensors.cpp core/os/output_file.cpp core/device/backend.cpp
//
// libFuzzer target for the safetensors header parser: any bytes at all must come back as entries or
// a ConfigError, never a crash, a hang, an out-of-bounds read or an uncaught exception.
#include <cstddef>
#include <cstdint>

#include "core/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    // The input is the whole file: the parser must bound every offset by it.
    const auto entries = headroom::parse_safetensors_header(data, size, size, "fuzz.safetensors");
    // What it accepts must hold together: every tensor inside the data section.
    for (const auto& e : entries)
      if (e.begin > e.end || e.end > size) __builtin_trap();
  } catch (const headroom::ConfigError&) {
  }
  return 0;
}
