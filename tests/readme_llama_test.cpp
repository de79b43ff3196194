// README.md, "Your own text on a Llama": every command of its sh block, as written, in a copy of
// the files it names (so the source tree gets no shards or snapshots), with build/bin/headroom the
// binary under test. A smollm2-135m shape: the release pass only (the sanitizers' would take
// minutes for what the release pass shows).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using test::contains;

TEST(ReadmeLlama, CommandsRunAsWritten) {
#ifdef HEADROOM_SANITIZE_BUILD
  GTEST_SKIP() << "a smollm2-135m shape: the release pass runs it";
#endif
  const std::string src = HEADROOM_SOURCE_DIR;
  const std::vector<std::string> cmds =
      test::commands_under(test::read_file(src + "/README.md"), "## Your own text on a Llama");
  ASSERT_EQ(cmds.size(), 3u);
  const std::string dir = test::temp_dir();
  fs::create_directories(dir + "/docs");
  fs::create_directories(dir + "/examples/own-text-llama");
  fs::copy_file(src + "/docs/design.md", dir + "/docs/design.md");
  for (const char* f : {"config.toml", "tokenizer.json"})
    fs::copy_file(src + "/examples/own-text-llama/" + f, dir + "/examples/own-text-llama/" + f);
  const std::string prefix = "build/bin/headroom ";
  std::vector<test::RunResult> runs;
  for (const std::string& c : cmds) {
    ASSERT_EQ(c.compare(0, prefix.size(), prefix), 0) << c;
    runs.push_back(
        test::run_command("cd " + dir + " && " + HEADROOM_BINARY + " " + c.substr(prefix.size())));
    ASSERT_EQ(runs.back().exit_code, 0) << c << "\n" << runs.back().output;
  }
  EXPECT_TRUE(contains(runs[0].output, "(vocab 1024")) << runs[0].output;
  EXPECT_TRUE(contains(runs[0].output, "Llama 3's split")) << runs[0].output;
  EXPECT_TRUE(contains(runs[1].output, "   8/8 | loss")) << runs[1].output;
  EXPECT_TRUE(contains(runs[1].output, "| val ")) << runs[1].output;  // eval_every
  EXPECT_TRUE(contains(runs[2].output, "sampling from snapshot ")) << runs[2].output;
  EXPECT_TRUE(contains(runs[2].output, "\nThe plugin")) << runs[2].output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace headroom
