// tests/hf/lora_reference.py's side of the LoRA tests (tests/lora_test.cpp,
// tests/peft_adapter_test.cpp): a random base folder, PEFT's adapters on it, a batch, and PEFT's
// loss and gradients, made by the test-only Python reference in .venv-test.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace headroom {
namespace test {

// The Python that runs the reference (.venv-test's).
inline std::string reference_python() {
  return std::string(HEADROOM_SOURCE_DIR) + "/.venv-test/bin/python";
}

// tests/hf/lora_reference.py make ARCH: the base folder, the adapters, the batch, PEFT's loss and
// gradients; `skip` says why there is none.
struct Reference {
  std::string dir, skip;
  nlohmann::json ref;
  TokenBatch ids;  // the batch
};

inline Reference make_reference(const std::string& arch) {
  Reference r;
  const std::string python = reference_python();
  if (!std::filesystem::exists(python)) {
    r.skip = "no " + python + " (the test-only reference; scripts/setup makes it)";
    return r;
  }
  r.dir = test::temp_dir();
  const test::RunResult run =
      test::run_command(python + " " + HEADROOM_SOURCE_DIR + "/tests/hf/lora_reference.py make " +
                        arch + " " + r.dir);
  // 77: torch, transformers or peft not importable (the script says which; scripts/setup installs
  // them). No import probe first: importing them is most of the script's time.
  if (run.exit_code == 77) {
    r.skip = run.output;
    return r;
  }
  EXPECT_EQ(run.exit_code, 0) << run.output;
  r.ref = nlohmann::json::parse(test::read_file(r.dir + "/lora_reference.json"));
  r.ids = read_batch_json(r.dir + "/batch.json");
  return r;
}

}  // namespace test
}  // namespace headroom
