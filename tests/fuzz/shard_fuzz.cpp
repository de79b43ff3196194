// clang-format off
// fuzz-sources: core/data/shards.cpp core/data/bpe_tokenizer.cpp core/config/config.cpp core/config/config_keys.cpp core/config/hf_config.cpp core/data/data.cpp core/os/output_file.cpp core/os/interrupt.cpp
// (run.sh reads the sources from that one line)
// clang-format on
// libFuzzer target for the llm.c token shard header parser: any bytes, with any claimed file size,
// must come back as a token count or a ConfigError, never a crash, an out-of-bounds read or an
// uncaught exception.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/data/shards.h"

namespace {

// What the parser accepts must hold together: the file is exactly the header and the tokens.
void check(const uint8_t* data, size_t size, uint64_t file_size) {
  try {
    const uint64_t tokens = headroom::parse_shard_header(data, size, file_size, "fuzz.bin");
    if (file_size != headroom::kShardHeaderBytes + 2 * tokens) __builtin_trap();
  } catch (const headroom::ConfigError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The input is the whole file.
  check(data, size, size);
  if (size >= 12) {
    // The size the header's count implies: reaches the accepting path with small inputs.
    uint32_t count;
    std::memcpy(&count, data + 8, 4);
    check(data, size, headroom::kShardHeaderBytes + 2 * uint64_t(count));
  }
  if (size >= 8) {
    // Any claimed size, from the last 8 bytes.
    uint64_t file_size;
    std::memcpy(&file_size, data + size - 8, 8);
    check(data, size, file_size);
  }
  return 0;
}
